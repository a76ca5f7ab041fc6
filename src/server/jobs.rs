//! Batch jobs for ETL: `POST /jobs?schema_id=ID` with a JSONL body (one `{"id"?, "document"}`
//! per line) answers at once with a job id; the items run through the engine concurrently;
//! `GET /jobs/{id}` reports progress; `GET /jobs/{id}/results` returns one JSON line per item
//! in input order; `POST /jobs/{id}/retry` runs the failed items again. An item that fails
//! never fails the job.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use utoipa::{IntoParams, ToSchema};

use super::api::{ExtractOptions, ExtractRequest, Outcome};
use super::error::{ApiError, ErrorBody};
use super::AppState;

/// Items of one job in flight at once: enough to fill the engine's batch.
const CONCURRENCY: usize = 32;
/// Most items in one job.
const MAX_ITEMS: usize = 100_000;

#[derive(Default)]
pub struct JobStore {
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    next: AtomicU64,
}

struct Job {
    id: String,
    schema_id: String,
    items: Vec<Item>,
    /// Per item, in input order.
    states: Mutex<Vec<ItemState>>,
}

struct Item {
    id: String,
    document: String,
}

#[derive(Clone)]
enum ItemState {
    Queued,
    Running,
    /// The result line, and whether the outcome was `ok`.
    Done(Value, bool),
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct JobParams {
    /// The schema every item is extracted with (ready-made or registered).
    pub schema_id: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct JobStatus {
    pub job_id: String,
    pub schema_id: String,
    pub total: usize,
    pub queued: usize,
    pub running: usize,
    pub ok: usize,
    pub failed: usize,
    /// Every item has a result.
    pub done: bool,
}

impl Job {
    fn status(&self) -> JobStatus {
        let states = self.states.lock().unwrap_or_else(|e| e.into_inner());
        let (mut queued, mut running, mut ok, mut failed) = (0, 0, 0, 0);
        for s in states.iter() {
            match s {
                ItemState::Queued => queued += 1,
                ItemState::Running => running += 1,
                ItemState::Done(_, true) => ok += 1,
                ItemState::Done(_, false) => failed += 1,
            }
        }
        JobStatus {
            job_id: self.id.clone(),
            schema_id: self.schema_id.clone(),
            total: states.len(),
            queued,
            running,
            ok,
            failed,
            done: queued + running == 0,
        }
    }
}

/// Parses the JSONL body: one object per non-empty line with a `document` string and an
/// optional `id` (the line number otherwise). A bad line fails the request, naming the line.
fn parse_jsonl(body: &[u8]) -> Result<Vec<Item>, ApiError> {
    let text = std::str::from_utf8(body).map_err(|_| ApiError::bad_request("the body is not UTF-8"))?;
    let mut items = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |why: &str| ApiError::bad_request(format!("line {}: {why}", n + 1));
        let v: Value = serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
        let document = v["document"].as_str().ok_or_else(|| bad("no `document` string"))?;
        let id = match &v["id"] {
            Value::Null => (n + 1).to_string(),
            Value::String(s) => s.clone(),
            Value::Number(x) => x.to_string(),
            _ => return Err(bad("`id` must be a string or a number")),
        };
        items.push(Item {
            id,
            document: document.to_string(),
        });
    }
    if items.is_empty() {
        return Err(ApiError::bad_request("the body has no items"));
    }
    if items.len() > MAX_ITEMS {
        return Err(ApiError::bad_request(format!("at most {MAX_ITEMS} items per job")));
    }
    Ok(items)
}

#[utoipa::path(
    post,
    path = "/jobs",
    tag = "jobs",
    params(JobParams),
    request_body(content = String, description = "JSONL: one {\"id\"?, \"document\"} object per line", content_type = "application/jsonl"),
    responses(
        (status = 202, description = "Accepted; the items run in the background", body = JobStatus),
        (status = 400, description = "A bad line (named), or no items", body = ErrorBody),
        (status = 404, description = "Unknown schema id", body = ErrorBody),
    )
)]
pub async fn create(
    State(state): State<Arc<AppState>>,
    Query(params): Query<JobParams>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    if state.schemas.get(&params.schema_id).is_none() {
        return Err(super::schemas::unknown(&params.schema_id));
    }
    let items = parse_jsonl(&body)?;
    let n = state.jobs.next.fetch_add(1, Ordering::Relaxed);
    let job = Arc::new(Job {
        id: format!("job-{n}"),
        schema_id: params.schema_id,
        states: Mutex::new(vec![ItemState::Queued; items.len()]),
        items,
    });
    state
        .jobs
        .jobs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(job.id.clone(), job.clone());
    let todo: Vec<usize> = (0..job.items.len()).collect();
    tokio::spawn(run(state.clone(), job.clone(), todo));
    Ok((StatusCode::ACCEPTED, Json(job.status())))
}

/// Works through `todo` (item indices), `CONCURRENCY` at a time.
async fn run(state: Arc<AppState>, job: Arc<Job>, todo: Vec<usize>) {
    let permits = Arc::new(Semaphore::new(CONCURRENCY));
    let mut tasks = tokio::task::JoinSet::new();
    for i in todo {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let (state, job) = (state.clone(), job.clone());
        tasks.spawn(async move {
            set(&job, i, ItemState::Running);
            let result = extract_item(&state, &job, i).await;
            set(&job, i, result);
            drop(permit);
        });
    }
    while tasks.join_next().await.is_some() {}
}

fn set(job: &Job, i: usize, s: ItemState) {
    job.states.lock().unwrap_or_else(|e| e.into_inner())[i] = s;
}

/// One item's result line; a full queue (other traffic) is waited out, not reported.
async fn extract_item(state: &Arc<AppState>, job: &Job, i: usize) -> ItemState {
    let item = &job.items[i];
    loop {
        let req = ExtractRequest {
            schema: None,
            schema_id: Some(job.schema_id.clone()),
            document: item.document.clone(),
            instructions: None,
            options: ExtractOptions::default(),
        };
        match super::extract::extract_one(state, req).await {
            Ok(out) => {
                let ok = out.outcome == Outcome::Ok;
                let mut line = json!({"id": item.id, "outcome": out.outcome, "data": out.data});
                if !ok {
                    line["partial"] = json!(out.partial);
                }
                return ItemState::Done(line, ok);
            }
            Err(e) if e.detail.kind == "queue_full" => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(e) => {
                let line = json!({"id": item.id, "outcome": e.detail.kind, "data": null, "error": e.detail.message});
                return ItemState::Done(line, false);
            }
        }
    }
}

fn find(state: &AppState, id: &str) -> Result<Arc<Job>, ApiError> {
    state
        .jobs
        .jobs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(id)
        .cloned()
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "unknown_job", format!("no job `{id}`")))
}

#[utoipa::path(
    get,
    path = "/jobs/{id}",
    tag = "jobs",
    params(("id" = String, Path, description = "A job id")),
    responses((status = 200, body = JobStatus), (status = 404, body = ErrorBody))
)]
pub async fn status(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<JobStatus>, ApiError> {
    Ok(Json(find(&state, &id)?.status()))
}

#[utoipa::path(
    get,
    path = "/jobs/{id}/results",
    tag = "jobs",
    params(("id" = String, Path, description = "A job id")),
    responses(
        (status = 200, description = "JSONL, one {id, outcome, data, partial?, error?} line per finished item, in input order", content_type = "application/jsonl", body = String),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn results(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let job = find(&state, &id)?;
    let states = job.states.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut body = String::new();
    for s in states {
        if let ItemState::Done(line, _) = s {
            body.push_str(&line.to_string());
            body.push('\n');
        }
    }
    Ok(([(header::CONTENT_TYPE, "application/jsonl")], body))
}

#[utoipa::path(
    post,
    path = "/jobs/{id}/retry",
    tag = "jobs",
    params(("id" = String, Path, description = "A job id")),
    responses((status = 202, description = "The failed items are queued again", body = JobStatus), (status = 404, body = ErrorBody))
)]
pub async fn retry(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<impl IntoResponse, ApiError> {
    let job = find(&state, &id)?;
    let todo: Vec<usize> = {
        let mut states = job.states.lock().unwrap_or_else(|e| e.into_inner());
        let failed: Vec<usize> = (0..states.len())
            .filter(|&i| matches!(states[i], ItemState::Done(_, false)))
            .collect();
        for &i in &failed {
            states[i] = ItemState::Queued;
        }
        failed
    };
    tokio::spawn(run(state.clone(), job.clone(), todo));
    Ok((StatusCode::ACCEPTED, Json(job.status())))
}
