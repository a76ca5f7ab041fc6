//! Batch jobs for ETL: `POST /jobs?schema_id=ID` with a JSONL body (one `{"id"?, "document"}`
//! per line) or a CSV body (a `document` column, or the one `text_column` names) answers at
//! once with a job id; the items run through the engine concurrently; `GET /jobs/{id}`
//! reports progress; `GET /jobs/{id}/results?format=jsonl|csv` streams one result per item in
//! input order (CSV columns come from the schema, see `extract::table`); `POST
//! /jobs/{id}/retry` runs the failed items again. An item that fails never fails the job.
//! Finished jobs are forgotten an hour after their last item ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use serde::{Deserialize, Serialize};

use tokio::sync::Semaphore;
use utoipa::{IntoParams, ToSchema};

use super::api::{ExtractOptions, ExtractRequest};
use super::error::{ApiError, ErrorBody};
use super::{ApiBody, ApiQuery, AppState};
use crate::extract::records::{self, Format, Record, RecordResult};
use crate::extract::table::Table;

/// Items of one job in flight at once: enough to fill the engine's batch.
const CONCURRENCY: usize = 32;
/// How long a finished job's results stay available.
const TTL: Duration = Duration::from_secs(3600);
/// Result rows per chunk of a streamed results body.
const ROWS_PER_CHUNK: usize = 256;

#[derive(Default)]
pub struct JobStore {
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    next: AtomicU64,
}

struct Job {
    id: String,
    schema_id: String,
    max_tokens: Option<usize>,
    items: Vec<Record>,
    /// Per item, in input order.
    states: Mutex<Vec<ItemState>>,
    /// When the last item ended, while none is queued or running.
    finished: Mutex<Option<Instant>>,
}

#[derive(Clone)]
enum ItemState {
    Queued,
    Running,
    Done(Arc<RecordResult>),
}

#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BatchFormat {
    Jsonl,
    Csv,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct JobParams {
    /// The schema every item is extracted with (ready-made or registered), or `schema`.
    pub schema_id: Option<String>,
    /// A JSON Schema as JSON text (URL-encoded); it is compiled and registered first, and
    /// the job reports its `schema_id`.
    pub schema: Option<String>,
    /// The body's format [default: `csv` when the content type is `text/csv`, else `jsonl`].
    pub format: Option<BatchFormat>,
    /// The CSV column holding the text [default: `document`].
    pub text_column: Option<String>,
    /// Most output tokens per item (default 512).
    pub max_tokens: Option<usize>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ResultParams {
    /// `jsonl` (default): one `{id, outcome, data, partial?, error?}` object per item; `csv`:
    /// `id, outcome`, one column per scalar of the schema (dotted names, schema order), `error`.
    pub format: Option<BatchFormat>,
    /// For CSV, the dotted path of one array of the schema to spread over one row per element.
    pub explode: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct RetryRequest {
    /// A new output budget for the retried items (e.g. for items that were `truncated`).
    pub max_tokens: Option<usize>,
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
    /// Items with a result, over all items (0 to 1).
    pub progress: f64,
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
                ItemState::Done(r) if r.ok() => ok += 1,
                ItemState::Done(_) => failed += 1,
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
            progress: (ok + failed) as f64 / states.len().max(1) as f64,
            done: queued + running == 0,
        }
    }
}

impl JobStore {
    /// Forgets jobs that finished more than `TTL` ago.
    fn expire(&self) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.retain(|_, job| {
            let finished = *job.finished.lock().unwrap_or_else(|e| e.into_inner());
            finished.is_none_or(|t| t.elapsed() < TTL)
        });
    }
}

fn max_tokens_ok(n: Option<usize>) -> Result<(), ApiError> {
    match n {
        Some(n) if n == 0 || n > super::extract::MAX_MAX_TOKENS => Err(ApiError::bad_request(format!(
            "`max_tokens` must be 1 to {}",
            super::extract::MAX_MAX_TOKENS
        ))),
        _ => Ok(()),
    }
}

#[utoipa::path(
    post,
    path = "/jobs",
    tag = "jobs",
    params(JobParams),
    request_body(description = "JSONL (one {\"id\"?, \"document\"} object per line) or CSV with a header row (a `document` column, or the one `text_column` names, and an optional `id` column); `text/csv` reads it as CSV, other content types by `format`", content(
        (String = "application/jsonl"),
        (String = "text/csv"),
        (Vec<u8> = "application/octet-stream"),
    )),
    responses(
        (status = 202, description = "Accepted; the items run in the background", body = JobStatus),
        (status = 400, description = "A bad line or row (named), no items, or no text column", body = ErrorBody),
        (status = 404, description = "Unknown schema id", body = ErrorBody),
    )
)]
pub async fn create(
    State(state): State<Arc<AppState>>,
    ApiQuery(params): ApiQuery<JobParams>,
    headers: HeaderMap,
    ApiBody(body): ApiBody,
) -> Result<impl IntoResponse, ApiError> {
    max_tokens_ok(params.max_tokens)?;
    let schema_id = match (params.schema_id, params.schema) {
        (Some(id), None) if state.schemas.get(&id).is_some() => id,
        (Some(id), None) => return Err(super::schemas::unknown(&id)),
        (None, Some(text)) => {
            let schema: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", format!("`schema`: {e}")))?;
            super::schemas::preflight(&state, &schema, false).await?;
            state.schemas.register(schema)?
        }
        _ => return Err(ApiError::bad_request("give exactly one of `schema_id` and `schema`")),
    };
    let csv_body = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("text/csv"));
    let format = match params.format {
        Some(BatchFormat::Csv) => Format::Csv,
        Some(BatchFormat::Jsonl) => Format::Jsonl,
        None if csv_body => Format::Csv,
        None => Format::Jsonl,
    };
    let items = records::parse(&body, format, params.text_column.as_deref())
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    state.jobs.expire();
    let n = state.jobs.next.fetch_add(1, Ordering::Relaxed);
    let job = Arc::new(Job {
        id: format!("job-{n}"),
        schema_id,
        max_tokens: params.max_tokens,
        states: Mutex::new(vec![ItemState::Queued; items.len()]),
        items,
        finished: Mutex::new(None),
    });
    state
        .jobs
        .jobs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(job.id.clone(), job.clone());
    let todo: Vec<usize> = (0..job.items.len()).collect();
    tokio::spawn(run(state.clone(), job.clone(), todo, params.max_tokens));
    Ok((StatusCode::ACCEPTED, Json(job.status())))
}

/// Works through `todo` (item indices), `CONCURRENCY` at a time.
async fn run(state: Arc<AppState>, job: Arc<Job>, todo: Vec<usize>, max_tokens: Option<usize>) {
    let permits = Arc::new(Semaphore::new(CONCURRENCY));
    let mut tasks = tokio::task::JoinSet::new();
    for i in todo {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let (state, job) = (state.clone(), job.clone());
        tasks.spawn(async move {
            set(&job, i, ItemState::Running);
            let result = extract_item(&state, &job, i, max_tokens).await;
            set(&job, i, ItemState::Done(Arc::new(result)));
            drop(permit);
        });
    }
    while tasks.join_next().await.is_some() {}
    if job.status().done {
        *job.finished.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }
}

fn set(job: &Job, i: usize, s: ItemState) {
    job.states.lock().unwrap_or_else(|e| e.into_inner())[i] = s;
}

/// One item's result; a full queue (other traffic) is waited out, not reported.
async fn extract_item(state: &Arc<AppState>, job: &Job, i: usize, max_tokens: Option<usize>) -> RecordResult {
    let item = &job.items[i];
    loop {
        let req = ExtractRequest {
            schema: None,
            schema_id: Some(job.schema_id.clone()),
            document: item.document.clone(),
            instructions: None,
            options: ExtractOptions {
                max_tokens,
                ..Default::default()
            },
            grounding: false,
        };
        match super::extract::extract_one(state, req).await {
            Ok(out) => {
                let text = out.partial.unwrap_or_default();
                return RecordResult::finished(
                    out.outcome,
                    out.data,
                    text,
                    out.usage.completion_tokens,
                    &out.violations,
                );
            }
            Err(e) if e.detail.kind == "queue_full" => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(e) => return RecordResult::failed(&e.detail.kind, e.detail.message),
        }
    }
}

fn find(state: &AppState, id: &str) -> Result<Arc<Job>, ApiError> {
    state.jobs.expire();
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
    params(("id" = String, Path, description = "A job id"), ResultParams),
    responses(
        (status = 200, description = "One result per finished item, in input order: JSONL `{id, outcome, data, partial?, error?}` lines, or CSV rows", content((String = "application/jsonl"), (String = "text/csv"))),
        (status = 400, description = "`explode` names no array of the schema", body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn results(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    ApiQuery(params): ApiQuery<ResultParams>,
) -> Result<impl IntoResponse, ApiError> {
    let job = find(&state, &id)?;
    let done: Vec<(String, Arc<RecordResult>)> = {
        let states = job.states.lock().unwrap_or_else(|e| e.into_inner());
        (states.iter().zip(&job.items))
            .filter_map(|(s, item)| match s {
                ItemState::Done(r) => Some((item.id.clone(), r.clone())),
                _ => None,
            })
            .collect()
    };
    let (content_type, chunks): (&str, Vec<Bytes>) = match params.format.unwrap_or(BatchFormat::Jsonl) {
        BatchFormat::Jsonl => (
            "application/jsonl",
            done.chunks(ROWS_PER_CHUNK).map(jsonl_chunk).collect(),
        ),
        BatchFormat::Csv => {
            let schema = state
                .schemas
                .get(&job.schema_id)
                .ok_or_else(|| super::schemas::unknown(&job.schema_id))?;
            let table = Table::from_schema(&schema, params.explode.as_deref())
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
            let mut chunks = vec![csv_rows(&[table.header()])];
            chunks.extend(done.chunks(ROWS_PER_CHUNK).map(|c| {
                let rows: Vec<Vec<String>> = c
                    .iter()
                    .flat_map(|(id, r)| table.rows(id, &r.outcome, r.data.as_ref(), r.error.as_deref()))
                    .collect();
                csv_rows(&rows)
            }));
            ("text/csv; charset=utf-8", chunks)
        }
    };
    let stream = futures_util::stream::iter(chunks.into_iter().map(Ok::<_, std::convert::Infallible>));
    Ok(([(header::CONTENT_TYPE, content_type)], Body::from_stream(stream)))
}

fn jsonl_chunk(results: &[(String, Arc<RecordResult>)]) -> Bytes {
    let mut out = String::new();
    for (id, r) in results {
        out.push_str(&r.json_line(id));
        out.push('\n');
    }
    Bytes::from(out)
}

fn csv_rows(rows: &[Vec<String>]) -> Bytes {
    let mut w = csv::Writer::from_writer(Vec::new());
    for row in rows {
        // Writing to memory cannot fail.
        let _ = w.write_record(row);
    }
    Bytes::from(w.into_inner().unwrap_or_default())
}

#[utoipa::path(
    post,
    path = "/jobs/{id}/retry",
    tag = "jobs",
    params(("id" = String, Path, description = "A job id")),
    request_body(content = Option<RetryRequest>, description = "Optional overrides for the retried items"),
    responses(
        (status = 202, description = "The failed items are queued again", body = JobStatus),
        (status = 400, description = "A bad override", body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn retry(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    ApiBody(body): ApiBody,
) -> Result<impl IntoResponse, ApiError> {
    let job = find(&state, &id)?;
    let req: RetryRequest = if body.iter().all(u8::is_ascii_whitespace) {
        RetryRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", e.to_string()))?
    };
    max_tokens_ok(req.max_tokens)?;
    let todo: Vec<usize> = {
        let mut states = job.states.lock().unwrap_or_else(|e| e.into_inner());
        let failed: Vec<usize> = (0..states.len())
            .filter(|&i| matches!(&states[i], ItemState::Done(r) if !r.ok()))
            .collect();
        for &i in &failed {
            states[i] = ItemState::Queued;
        }
        failed
    };
    *job.finished.lock().unwrap_or_else(|e| e.into_inner()) = None;
    tokio::spawn(run(state.clone(), job.clone(), todo, req.max_tokens.or(job.max_tokens)));
    Ok((StatusCode::ACCEPTED, Json(job.status())))
}
