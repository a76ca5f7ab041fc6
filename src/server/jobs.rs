//! Batch jobs for ETL: `POST /jobs?schema_id=ID` with a JSONL body (one `{"id"?, "document"}`
//! per line) or a CSV body (a `document` column, or the one `text_column` names) answers at
//! once with a job id; the items go into the job store (`crate::jobs`), where this process's
//! worker, and those of every other process sharing the store, run them; `GET /jobs/{id}`
//! reports progress; `GET /jobs/{id}/results?format=jsonl|csv` streams one result per item in
//! input order (CSV columns come from the schema, see `extract::table`); `POST
//! /jobs/{id}/retry` runs the failed items again. An item that fails never fails the job.
//! Jobs outlive the process: a restarted server finds its jobs, and goes on with their items.

use crate::service::ErrorKind;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::{ApiError, ErrorBody};
use super::{ApiBody, ApiQuery, AppState};
use crate::extract::records::{self, Format, RecordResult};
use crate::extract::table::Table;
use crate::jobs::runners::ExtractSettings as Settings;
use crate::jobs::{self, Counts, Deleted, JobSpec, JobStore, NewItem, NewJob, StoreError};

/// The kind of the jobs this API makes (`crate::jobs` keeps others too: OpenAI batches).
use crate::jobs::runners::EXTRACT as KIND;

fn settings(spec: &JobSpec) -> Result<Settings, ApiError> {
    Ok(Settings::of(spec)?)
}

/// Result rows per chunk of a streamed results body (and per read from the store).
const ROWS_PER_CHUNK: usize = 256;

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
    /// `jsonl` (default): one `{id, outcome, data, partial?, error?, fields?}` object per item
    /// (`fields`: each leaf's pointer, confidence and span, for items that ended `ok`); `csv`:
    /// `id, outcome`, one column per scalar of the schema (dotted names, schema order), `error`.
    pub format: Option<BatchFormat>,
    /// For CSV, the dotted path of one array of the schema to spread over one row per element.
    pub explode: Option<String>,
    /// For CSV, a `<column>__confidence` column after each column: its field's confidence, or
    /// for a cell of JSON the least confidence of the fields in it [default: false].
    pub confidence: Option<bool>,
    /// For JSONL, each item's `document` too (as the job received it), so that spans can be
    /// shown in place [default: false].
    pub documents: Option<bool>,
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

fn job_status(job_id: &str, schema_id: &str, c: Counts) -> JobStatus {
    let total = c.total();
    JobStatus {
        job_id: job_id.into(),
        schema_id: schema_id.into(),
        total,
        queued: c.queued,
        running: c.running,
        ok: c.ok,
        failed: c.failed,
        progress: (c.ok + c.failed) as f64 / total.max(1) as f64,
        done: c.queued + c.running == 0,
    }
}

/// A store call off the async threads; a store that fails is a 503 naming it.
pub(super) async fn store_call<T: Send + 'static>(
    state: &AppState,
    f: impl FnOnce(&dyn JobStore) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, ApiError> {
    let store = state.jobs.store().clone();
    tokio::task::spawn_blocking(move || f(store.as_ref()))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| match e {
            StoreError::Invalid(message) => ApiError::bad_request(message),
            e => ApiError::new(ErrorKind::JobStoreUnavailable, e.to_string()),
        })
}

fn max_tokens_ok(n: Option<usize>) -> Result<(), ApiError> {
    match n {
        Some(n) if n == 0 || n > crate::service::MAX_MAX_TOKENS => Err(ApiError::bad_request(format!(
            "`max_tokens` must be 1 to {}",
            crate::service::MAX_MAX_TOKENS
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
        (Some(id), None) if state.service.schemas.get(&id).is_some() => id,
        (Some(id), None) => return Err(super::schemas::unknown(&id)),
        (None, Some(text)) => {
            let schema: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ApiError::new(ErrorKind::InvalidJson, format!("`schema`: {e}")))?;
            super::schemas::preflight(&state, &schema, false).await?;
            state.service.schemas.register(schema)?
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
    let schema = state
        .service
        .schemas
        .get(&schema_id)
        .ok_or_else(|| super::schemas::unknown(&schema_id))?;
    let job = NewJob {
        id: jobs::new_id("job-"),
        kind: KIND.into(),
        settings: serde_json::to_value(Settings {
            schema_id: schema_id.clone(),
            schema,
            max_tokens: params.max_tokens,
        })
        .map_err(|e| ApiError::internal(e.to_string()))?,
        items: items
            .into_iter()
            .map(|r| NewItem {
                item_id: r.id,
                payload: r.document,
            })
            .collect(),
    };
    let counts = Counts {
        queued: job.items.len(),
        ..Default::default()
    };
    let status = job_status(&job.id, &schema_id, counts);
    store_call(&state, move |s| s.create(&job)).await?;
    state.jobs.wake();
    Ok((StatusCode::ACCEPTED, Json(status)))
}

fn unknown_job(id: &str) -> ApiError {
    ApiError::new(ErrorKind::UnknownJob, format!("no job `{id}`"))
}

/// An extraction job's settings and status, or 404.
async fn find(state: &AppState, id: &str) -> Result<(Settings, JobStatus), ApiError> {
    let key = id.to_string();
    let (spec, counts) = store_call(state, move |s| Ok((s.spec(&key)?, s.counts(&key)?))).await?;
    match (spec, counts) {
        (Some(spec), Some(c)) if spec.kind == KIND => {
            let settings = settings(&spec)?;
            let status = job_status(id, &settings.schema_id, c);
            Ok((settings, status))
        }
        _ => Err(unknown_job(id)),
    }
}

#[utoipa::path(
    get,
    path = "/jobs/{id}",
    tag = "jobs",
    params(("id" = String, Path, description = "A job id")),
    responses((status = 200, body = JobStatus), (status = 404, body = ErrorBody))
)]
pub async fn status(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<JobStatus>, ApiError> {
    Ok(Json(find(&state, &id).await?.1))
}

/// What `DELETE /jobs/{id}` answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct JobDeleted {
    pub job_id: String,
    pub deleted: bool,
}

#[utoipa::path(
    delete,
    path = "/jobs/{id}",
    tag = "jobs",
    params(("id" = String, Path, description = "A job id")),
    responses(
        (status = 200, description = "The job and its results are gone", body = JobDeleted),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Items are still queued or running (`job_running`)", body = ErrorBody),
    )
)]
pub async fn delete(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<JobDeleted>, ApiError> {
    find(&state, &id).await?;
    let key = id.clone();
    match store_call(&state, move |s| s.delete(&key)).await? {
        Deleted::Deleted => Ok(Json(JobDeleted {
            job_id: id,
            deleted: true,
        })),
        Deleted::Busy => Err(ApiError::new(
            ErrorKind::JobRunning,
            format!("job `{id}` has items queued or running; delete it once it is done"),
        )),
        Deleted::Missing => Err(unknown_job(&id)),
    }
}

#[utoipa::path(
    get,
    path = "/jobs/{id}/results",
    tag = "jobs",
    params(("id" = String, Path, description = "A job id"), ResultParams),
    responses(
        (status = 200, description = "One result per finished item, in input order: JSONL `{id, outcome, data, partial?, error?, fields?}` lines, or CSV rows", content((String = "application/jsonl"), (String = "text/csv"))),
        (status = 400, description = "`explode` names no array of the schema", body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn results(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    ApiQuery(params): ApiQuery<ResultParams>,
) -> Result<impl IntoResponse, ApiError> {
    let (spec, _) = find(&state, &id).await?;
    // Read in pages by item index, so a long job never holds the store for long.
    let page = ROWS_PER_CHUNK * 16;
    let format = params.format.unwrap_or(BatchFormat::Jsonl);
    let with_documents = params.documents.unwrap_or(false) && matches!(format, BatchFormat::Jsonl);
    let mut done: Vec<Done> = Vec::new();
    let mut from = 0;
    loop {
        let key = id.clone();
        let rows = store_call(&state, move |s| s.results(&key, from, page)).await?;
        let full = rows.len() == page;
        let first = from;
        from = rows.last().map_or(from, |r| r.0 + 1);
        let mut documents = std::collections::HashMap::new();
        if with_documents && !rows.is_empty() {
            let (key, to) = (id.clone(), from);
            documents.extend(store_call(&state, move |s| s.payloads(&key, first, to)).await?);
        }
        for (idx, r) in rows {
            let result = serde_json::from_value(r.result)
                .map_err(|e| ApiError::internal(format!("job {id} item {}: {e}", r.item_id)))?;
            done.push(Done {
                id: r.item_id,
                result,
                document: documents.remove(&idx),
            });
        }
        if !full {
            break;
        }
    }
    let (content_type, chunks): (&str, Vec<Bytes>) = match format {
        BatchFormat::Jsonl => (
            "application/jsonl",
            done.chunks(ROWS_PER_CHUNK).map(jsonl_chunk).collect(),
        ),
        BatchFormat::Csv => {
            let table = Table::from_schema(&spec.schema, params.explode.as_deref())
                .map_err(|e| ApiError::bad_request(e.to_string()))?
                .with_confidence(params.confidence.unwrap_or(false));
            let mut chunks = vec![csv_rows(&[table.header()])];
            chunks.extend(done.chunks(ROWS_PER_CHUNK).map(|c| {
                let rows: Vec<Vec<String>> = c.iter().flat_map(|d| table.rows(&d.id, &d.result)).collect();
                csv_rows(&rows)
            }));
            ("text/csv; charset=utf-8", chunks)
        }
    };
    let stream = futures_util::stream::iter(chunks.into_iter().map(Ok::<_, std::convert::Infallible>));
    Ok(([(header::CONTENT_TYPE, content_type)], Body::from_stream(stream)))
}

/// A finished item as the results stream it.
struct Done {
    id: String,
    result: RecordResult,
    document: Option<String>,
}

fn jsonl_chunk(results: &[Done]) -> Bytes {
    let mut out = String::new();
    for d in results {
        let mut line = d.result.json(&d.id);
        if let Some(doc) = &d.document {
            line["document"] = doc.as_str().into();
        }
        out.push_str(&line.to_string());
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
    find(&state, &id).await?;
    let req: RetryRequest = if body.iter().all(u8::is_ascii_whitespace) {
        RetryRequest::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| ApiError::new(ErrorKind::InvalidField, e.to_string()))?
    };
    max_tokens_ok(req.max_tokens)?;
    let key = id.clone();
    store_call(&state, move |s| s.retry_failed(&key, req.max_tokens)).await?;
    state.jobs.wake();
    Ok((StatusCode::ACCEPTED, Json(find(&state, &id).await?.1)))
}
