//! The OpenAI Batch API on the job store: `POST /v1/files` (multipart, `purpose=batch`), `GET
//! /v1/files/{id}` and `/content`, `POST /v1/batches`, `GET /v1/batches/{id}`, `GET
//! /v1/batches`, `POST /v1/batches/{id}/cancel`. A batch is a job of kind `batch` whose items
//! are the input file's request lines, for `/v1/chat/completions` or `/extract`; it is as
//! durable as any job, and any process sharing the store works on it and serves it. Output and
//! error files are written from the results when asked for (`file-out-` and `file-err-` and the
//! batch's id), so they are never out of step with them.

use crate::service::ErrorKind;
use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use utoipa::{IntoParams, ToSchema};

use super::error::{ApiError, ErrorBody};
use super::jobs::store_call;
use super::{ApiJson, ApiMultipart, ApiQuery, AppState};
use crate::jobs::runners::{self, BatchSettings};
use crate::jobs::{self, Counts, JobSpec, NewItem, NewJob, StoredFile};

/// The kind of the jobs batches are.
use crate::jobs::runners::BATCH as KIND;
/// Endpoints a batch line may call.
const ENDPOINTS: [&str; 2] = ["/v1/chat/completions", "/extract"];
const OUTPUT_PREFIX: &str = "file-out-";
const ERROR_PREFIX: &str = "file-err-";
/// Most request lines in one batch (OpenAI's limit).
const MAX_LINES: usize = 50_000;

#[derive(Debug, Serialize, ToSchema)]
pub struct FileObject {
    pub id: String,
    /// Always `file`.
    pub object: String,
    pub bytes: usize,
    /// Unix seconds.
    pub created_at: i64,
    pub filename: String,
    /// `batch` for inputs, `batch_output` for output and error files.
    pub purpose: String,
    pub status: String,
}

/// What `DELETE /v1/files/{id}` answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct FileDeleted {
    pub id: String,
    /// Always `file`.
    pub object: String,
    pub deleted: bool,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateBatch {
    pub input_file_id: String,
    /// `/v1/chat/completions` or `/extract`: every line's `url` must be this.
    pub endpoint: String,
    /// Only `24h`; Quarry works on a batch as soon as it has it.
    pub completion_window: String,
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RequestCounts {
    pub total: usize,
    pub completed: usize,
    pub failed: usize,
}

/// OpenAI's batch object; times are Unix seconds.
#[derive(Debug, Serialize, ToSchema)]
pub struct BatchObject {
    pub id: String,
    /// Always `batch`.
    pub object: String,
    pub endpoint: String,
    #[schema(value_type = Option<Object>)]
    pub errors: Option<Value>,
    pub input_file_id: String,
    pub completion_window: String,
    /// `in_progress`, `completed`, `cancelling` or `cancelled` (a batch Quarry cannot take is
    /// refused with a 400, never left `failed`).
    pub status: String,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    pub created_at: i64,
    pub in_progress_at: Option<i64>,
    pub expires_at: Option<i64>,
    pub finalizing_at: Option<i64>,
    pub completed_at: Option<i64>,
    pub failed_at: Option<i64>,
    pub expired_at: Option<i64>,
    pub cancelling_at: Option<i64>,
    pub cancelled_at: Option<i64>,
    pub request_counts: RequestCounts,
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct BatchList {
    /// Always `list`.
    pub object: String,
    pub data: Vec<BatchObject>,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
    pub has_more: bool,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListParams {
    /// At most this many (1 to 100, default 20), newest first.
    pub limit: Option<usize>,
    /// The last id of the previous page.
    pub after: Option<String>,
}

fn seconds(ms: i64) -> i64 {
    ms / 1000
}

fn not_found(what: &str, id: &str) -> ApiError {
    ApiError::new(ErrorKind::NotFound, format!("no {what} `{id}`"))
}

#[utoipa::path(
    post,
    operation_id = "create_file",
    path = "/v1/files",
    tag = "openai",
    request_body(content_type = "multipart/form-data", description = "`purpose` (`batch`) and `file` (JSONL of `{custom_id, method, url, body}` lines)"),
    responses(
        (status = 200, body = FileObject),
        (status = 400, description = "No file, or a purpose other than `batch`", body = ErrorBody),
        (status = 413, description = "Over the size limit", body = ErrorBody),
    )
)]
pub async fn upload(
    State(state): State<Arc<AppState>>,
    ApiMultipart(mut form): ApiMultipart,
) -> Result<Json<FileObject>, ApiError> {
    let (mut purpose, mut file) = (None, None);
    while let Some(field) = form.next_field().await.map_err(multipart_error)? {
        match field.name() {
            Some("purpose") => purpose = Some(field.text().await.map_err(multipart_error)?),
            Some("file") => {
                let name = field.file_name().unwrap_or("upload.jsonl").to_string();
                file = Some((name, field.bytes().await.map_err(multipart_error)?));
            }
            _ => {}
        }
    }
    let purpose = purpose.ok_or_else(|| ApiError::bad_request("the form has no `purpose` field"))?;
    if purpose != "batch" {
        return Err(ApiError::bad_request(format!(
            "`purpose` must be `batch` (files here are batch inputs), not `{purpose}`"
        )));
    }
    let (filename, bytes) = file.ok_or_else(|| ApiError::bad_request("the form has no `file` field"))?;
    let stored = StoredFile {
        id: jobs::new_id("file-"),
        purpose,
        filename,
        bytes: bytes.to_vec(),
        created_ms: jobs::now_ms(),
    };
    let object = file_object(
        &stored.id,
        &stored.purpose,
        &stored.filename,
        stored.bytes.len(),
        stored.created_ms,
    );
    store_call(&state, move |s| s.put_file(&stored)).await?;
    Ok(Json(object))
}

fn multipart_error(e: axum::extract::multipart::MultipartError) -> ApiError {
    let kind = ErrorKind::of_rejected_body(e.status().as_u16());
    ApiError::new(kind, format!("multipart body: {}", e.body_text()))
}

fn file_object(id: &str, purpose: &str, filename: &str, bytes: usize, created_ms: i64) -> FileObject {
    FileObject {
        id: id.into(),
        object: "file".into(),
        bytes,
        created_at: seconds(created_ms),
        filename: filename.into(),
        purpose: purpose.into(),
        status: "processed".into(),
    }
}

/// A stored file, or a batch's output or error file written now from its results.
async fn file_content(state: &AppState, id: &str) -> Result<StoredFile, ApiError> {
    let generated = [(OUTPUT_PREFIX, true), (ERROR_PREFIX, false)]
        .into_iter()
        .find_map(|(prefix, ok)| id.strip_prefix(prefix).map(|batch| (batch.to_string(), ok)));
    let Some((batch_id, ok)) = generated else {
        let key = id.to_string();
        return store_call(state, move |s| s.file(&key))
            .await?
            .ok_or_else(|| not_found("file", id));
    };
    let (spec, _) = find(state, &batch_id).await?;
    let mut bytes = Vec::new();
    let mut from = 0;
    loop {
        let key = batch_id.clone();
        let page = store_call(state, move |s| s.results(&key, from, 4096)).await?;
        let full = page.len() == 4096;
        from = page.last().map_or(from, |r| r.0 + 1);
        for (index, r) in page.into_iter().filter(|(_, r)| r.ok == ok) {
            let line = output_line(&batch_id, index, &r.item_id, &r.result);
            bytes.extend_from_slice(line.to_string().as_bytes());
            bytes.push(b'\n');
        }
        if !full {
            break;
        }
    }
    Ok(StoredFile {
        id: id.into(),
        purpose: "batch_output".into(),
        filename: format!("{}_{}.jsonl", spec.id, if ok { "output" } else { "error" }),
        bytes,
        created_ms: spec.created_ms,
    })
}

/// One line of an output or error file, as OpenAI writes it: the response where there was
/// one, else the error.
fn output_line(batch_id: &str, index: usize, custom_id: &str, result: &Value) -> Value {
    let id = format!("batch_req_{batch_id}_{index}");
    // A line without a `custom_id` is stored with an empty one: null here, as it came.
    let custom_id = (!custom_id.is_empty()).then_some(custom_id);
    match result.get("status_code") {
        Some(status) => json!({
            "id": id,
            "custom_id": custom_id,
            "response": {"status_code": status, "request_id": format!("req_{batch_id}_{index}"), "body": result["body"]},
            "error": null,
        }),
        None => json!({"id": id, "custom_id": custom_id, "response": null, "error": result["error"]}),
    }
}

#[utoipa::path(
    delete,
    operation_id = "delete_file",
    path = "/v1/files/{id}",
    tag = "openai",
    params(("id" = String, Path, description = "An uploaded file's id (a batch's output and error files go with the batch)")),
    responses((status = 200, body = FileDeleted), (status = 404, body = ErrorBody))
)]
pub async fn delete_file(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<FileDeleted>, ApiError> {
    let key = id.clone();
    if !store_call(&state, move |s| s.delete_file(&key)).await? {
        return Err(not_found("file", &id));
    }
    Ok(Json(FileDeleted {
        id,
        object: "file".into(),
        deleted: true,
    }))
}

#[utoipa::path(
    get,
    operation_id = "retrieve_file",
    path = "/v1/files/{id}",
    tag = "openai",
    params(("id" = String, Path, description = "A file id")),
    responses((status = 200, body = FileObject), (status = 404, body = ErrorBody))
)]
pub async fn file_info(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<FileObject>, ApiError> {
    let f = file_content(&state, &id).await?;
    Ok(Json(file_object(
        &f.id,
        &f.purpose,
        &f.filename,
        f.bytes.len(),
        f.created_ms,
    )))
}

#[utoipa::path(
    get,
    operation_id = "file_content",
    path = "/v1/files/{id}/content",
    tag = "openai",
    params(("id" = String, Path, description = "A file id")),
    responses(
        (status = 200, description = "The file's bytes (JSONL)", content_type = "application/jsonl"),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn file_bytes(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let f = file_content(&state, &id).await?;
    Ok(([(header::CONTENT_TYPE, "application/jsonl")], Body::from(f.bytes)).into_response())
}

/// The batch's items from its input file: one per request line, in order. A line that is not
/// a request for the batch's endpoint becomes an item that fails with the line named; a
/// `custom_id` seen twice refuses the whole batch, naming both lines.
fn batch_items(text: &str, endpoint: &str) -> Result<Vec<NewItem>, ApiError> {
    let mut items = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let number = n + 1;
        let parsed: Result<Value, String> = serde_json::from_str(line).map_err(|e| e.to_string());
        let custom_id = parsed
            .as_ref()
            .ok()
            .and_then(|v| v.get("custom_id"))
            .and_then(Value::as_str)
            .filter(|id| !id.is_empty())
            .map(str::to_string);
        if let Some(id) = &custom_id {
            if let Some(first) = seen.insert(id.clone(), number) {
                return Err(ApiError::new(
                    ErrorKind::DuplicateCustomId,
                    format!("`custom_id` {id:?} is on line {first} and again on line {number}"),
                ));
            }
        }
        let payload = match parsed.and_then(|v| request_of(&v, endpoint)) {
            Ok(body) => json!({"line": number, "body": body}),
            Err(message) => json!({"line": number, "error": format!("line {number}: {message}")}),
        };
        items.push(NewItem {
            // A line without a `custom_id` has none (the output's `custom_id` is null, its
            // error names the line): no made-up name that a real one could collide with.
            item_id: custom_id.unwrap_or_default(),
            payload: payload.to_string(),
        });
    }
    if items.is_empty() {
        return Err(ApiError::bad_request("the input file has no request lines"));
    }
    if items.len() > MAX_LINES {
        return Err(ApiError::bad_request(format!("at most {MAX_LINES} requests per batch")));
    }
    Ok(items)
}

/// A line's request body, where the line is a POST to `endpoint`.
fn request_of(line: &Value, endpoint: &str) -> Result<Value, String> {
    match line.get("custom_id").and_then(Value::as_str) {
        None => return Err("no `custom_id` string".into()),
        Some("") => return Err("`custom_id` is empty".into()),
        Some(_) => {}
    }
    match line.get("method").and_then(Value::as_str) {
        Some("POST") => {}
        other => return Err(format!("`method` must be \"POST\", not {other:?}")),
    }
    match line.get("url").and_then(Value::as_str) {
        Some(url) if url == endpoint => {}
        other => {
            return Err(format!(
                "`url` must be the batch's endpoint {endpoint:?}, not {other:?}"
            ))
        }
    }
    match line.get("body") {
        Some(body @ Value::Object(_)) => Ok(body.clone()),
        _ => Err("no `body` object".into()),
    }
}

#[utoipa::path(
    post,
    operation_id = "create_batch",
    path = "/v1/batches",
    tag = "openai",
    request_body = CreateBatch,
    responses(
        (status = 200, body = BatchObject),
        (status = 400, description = "An unknown endpoint or window, a file with no requests, or a `custom_id` that repeats (both lines named)", body = ErrorBody),
        (status = 404, description = "Unknown input file", body = ErrorBody),
    )
)]
pub async fn create(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<CreateBatch>,
) -> Result<Json<BatchObject>, ApiError> {
    if !ENDPOINTS.contains(&req.endpoint.as_str()) {
        return Err(ApiError::bad_request(format!(
            "`endpoint` must be one of {ENDPOINTS:?}, not {:?}",
            req.endpoint
        )));
    }
    if req.completion_window != "24h" {
        return Err(ApiError::bad_request("`completion_window` must be \"24h\""));
    }
    let key = req.input_file_id.clone();
    let file = store_call(&state, move |s| s.file(&key))
        .await?
        .ok_or_else(|| not_found("file", &req.input_file_id))?;
    let text = std::str::from_utf8(&file.bytes).map_err(|_| ApiError::bad_request("the input file is not UTF-8"))?;
    let items = batch_items(text, &req.endpoint)?;
    let settings = BatchSettings {
        endpoint: req.endpoint,
        input_file_id: req.input_file_id,
        completion_window: req.completion_window,
        metadata: req.metadata,
    };
    let job = NewJob {
        id: jobs::new_id("batch_"),
        kind: KIND.into(),
        settings: serde_json::to_value(&settings).map_err(|e| ApiError::internal(e.to_string()))?,
        items,
    };
    let id = job.id.clone();
    store_call(&state, move |s| s.create(&job)).await?;
    state.jobs.wake();
    Ok(Json(batch_object(&state, &id).await?))
}

/// A batch's spec and item counts, or 404.
async fn find(state: &AppState, id: &str) -> Result<(JobSpec, Counts), ApiError> {
    let key = id.to_string();
    let (spec, counts) = store_call(state, move |s| Ok((s.spec(&key)?, s.counts(&key)?))).await?;
    match (spec, counts) {
        (Some(spec), Some(counts)) if spec.kind == KIND => Ok((spec, counts)),
        _ => Err(not_found("batch", id)),
    }
}

async fn batch_object(state: &AppState, id: &str) -> Result<BatchObject, ApiError> {
    let (spec, c) = find(state, id).await?;
    let key = id.to_string();
    let last = store_call(state, move |s| s.last_result_ms(&key)).await?;
    let settings: BatchSettings =
        serde_json::from_value(spec.settings.clone()).map_err(|e| ApiError::internal(format!("batch {id}: {e}")))?;
    let open = c.queued + c.running > 0;
    let status = match (spec.cancelled_ms, open) {
        (Some(_), true) => "cancelling",
        (Some(_), false) => "cancelled",
        (None, true) => "in_progress",
        (None, false) => "completed",
    };
    let ended = (!open).then(|| seconds(last.unwrap_or(spec.created_ms)));
    let created = seconds(spec.created_ms);
    Ok(BatchObject {
        id: spec.id.clone(),
        object: "batch".into(),
        endpoint: settings.endpoint,
        errors: None,
        input_file_id: settings.input_file_id,
        completion_window: settings.completion_window,
        status: status.into(),
        output_file_id: (!open && c.ok > 0).then(|| format!("{OUTPUT_PREFIX}{}", spec.id)),
        error_file_id: (!open && c.failed > 0).then(|| format!("{ERROR_PREFIX}{}", spec.id)),
        created_at: created,
        in_progress_at: Some(created),
        expires_at: Some(created + 24 * 3600),
        finalizing_at: ended.filter(|_| spec.cancelled_ms.is_none()),
        completed_at: ended.filter(|_| spec.cancelled_ms.is_none()),
        failed_at: None,
        expired_at: None,
        cancelling_at: spec.cancelled_ms.map(seconds),
        cancelled_at: ended.filter(|_| spec.cancelled_ms.is_some()),
        request_counts: RequestCounts {
            total: c.total(),
            completed: c.ok,
            failed: c.failed,
        },
        metadata: settings.metadata,
    })
}

#[utoipa::path(
    get,
    operation_id = "retrieve_batch",
    path = "/v1/batches/{id}",
    tag = "openai",
    params(("id" = String, Path, description = "A batch id")),
    responses((status = 200, body = BatchObject), (status = 404, body = ErrorBody))
)]
pub async fn retrieve(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<BatchObject>, ApiError> {
    Ok(Json(batch_object(&state, &id).await?))
}

#[utoipa::path(
    get,
    operation_id = "list_batches",
    path = "/v1/batches",
    tag = "openai",
    params(ListParams),
    responses((status = 200, body = BatchList), (status = 400, body = ErrorBody))
)]
pub async fn list(
    State(state): State<Arc<AppState>>,
    ApiQuery(params): ApiQuery<ListParams>,
) -> Result<Json<BatchList>, ApiError> {
    let limit = params.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(ApiError::bad_request("`limit` must be 1 to 100"));
    }
    let after = params.after.clone();
    let specs = store_call(&state, move |s| s.list(KIND, limit + 1, after.as_deref())).await?;
    let has_more = specs.len() > limit;
    let mut data = Vec::new();
    for spec in specs.into_iter().take(limit) {
        data.push(batch_object(&state, &spec.id).await?);
    }
    Ok(Json(BatchList {
        object: "list".into(),
        first_id: data.first().map(|b| b.id.clone()),
        last_id: data.last().map(|b| b.id.clone()),
        has_more,
        data,
    }))
}

#[utoipa::path(
    post,
    operation_id = "cancel_batch",
    path = "/v1/batches/{id}/cancel",
    tag = "openai",
    params(("id" = String, Path, description = "A batch id")),
    responses(
        (status = 200, description = "`cancelling` while requests run, then `cancelled`", body = BatchObject),
        (status = 404, body = ErrorBody),
        (status = 409, description = "The batch has finished: `batch_not_cancellable`", body = ErrorBody),
    )
)]
pub async fn cancel(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<BatchObject>, ApiError> {
    let (spec, _) = find(&state, &id).await?;
    let key = id.clone();
    let ended = store_call(&state, move |s| s.cancel(&key, &runners::cancelled_line())).await?;
    // Cancelling a cancelled batch again is a no-op (another request may have just done it);
    // a completed one stays completed.
    let cancelled = match (ended, spec.cancelled_ms) {
        (None, None) => find(&state, &id).await?.0.cancelled_ms.is_some(),
        _ => true,
    };
    if !cancelled {
        return Err(ApiError::new(
            ErrorKind::BatchNotCancellable,
            format!("batch `{id}` has finished: there is nothing left to cancel"),
        ));
    }
    Ok(Json(batch_object(&state, &id).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_become_items_and_bad_ones_fail_alone() {
        let url = "/v1/chat/completions";
        let ok = |id: &str| {
            format!(r#"{{"custom_id": "{id}", "method": "POST", "url": "{url}", "body": {{"model": "m"}}}}"#)
        };
        let text = format!(
            "{}\n\nnot json\n{}\n{}\n{}\n",
            ok("a"),
            r#"{"custom_id": "b", "method": "GET", "url": "/v1/chat/completions", "body": {}}"#,
            r#"{"custom_id": "c", "method": "POST", "url": "/extract", "body": {}}"#,
            ok("d")
        );
        let items = batch_items(&text, url).unwrap();
        let ids: Vec<&str> = items.iter().map(|i| i.item_id.as_str()).collect();
        assert_eq!(ids, ["a", "", "b", "c", "d"]);
        let payload = |i: usize| serde_json::from_str::<Value>(&items[i].payload).unwrap();
        assert_eq!(payload(0)["body"]["model"], "m");
        assert!(
            payload(1)["error"].as_str().unwrap().starts_with("line 3: "),
            "{}",
            payload(1)
        );
        assert!(
            payload(2)["error"].as_str().unwrap().contains("`method`"),
            "{}",
            payload(2)
        );
        assert!(
            payload(3)["error"].as_str().unwrap().contains("endpoint"),
            "{}",
            payload(3)
        );
        assert_eq!(payload(4)["line"], 6);

        let twice = format!("{}\n{}\n{}\n", ok("x"), ok("y"), ok("x"));
        let err = batch_items(&twice, url).unwrap_err();
        assert_eq!(err.detail.kind, "duplicate_custom_id");
        assert!(
            err.detail.message.contains("line 1") && err.detail.message.contains("line 3"),
            "{}",
            err.detail.message
        );
        assert!(batch_items("\n\n", url).is_err());
        // Empty ids are no ids: each such line fails alone, and they are not duplicates.
        let blank = r#"{"custom_id": "", "method": "POST", "url": "/v1/chat/completions", "body": {}}"#;
        let items = batch_items(&format!("{blank}\n{blank}\n{}\n", ok("z")), url).unwrap();
        assert_eq!(items.len(), 3);
        let error = |i: usize| serde_json::from_str::<Value>(&items[i].payload).unwrap()["error"].clone();
        assert!(error(0).as_str().unwrap().contains("empty") && error(1).as_str().unwrap().contains("empty"));
    }
}
