//! How the items of each kind of job run: extraction jobs' documents and OpenAI batches'
//! lines, as clients of the service (the admission, extraction and completions of the HTTP
//! endpoints, a full queue waited out rather than reported). An item that fails never fails
//! its job: it ends with an explicit result.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::worker::{Done, Work};
use super::JobSpec;
use crate::extract::records::RecordResult;
use crate::service::api::{ExtractOptions, ExtractRequest};
use crate::service::error::ErrorBody;
use crate::service::openai::ChatCompletionRequest;
use crate::service::{ErrorKind, Service, ServiceError};

/// Extraction jobs (`POST /jobs`).
pub const EXTRACT: &str = "extract";
/// OpenAI batches (`POST /v1/batches`).
pub const BATCH: &str = "batch";

/// An extraction job's settings, as stored with it.
#[derive(Debug, Serialize, Deserialize)]
pub struct ExtractSettings {
    pub schema_id: String,
    /// The schema itself: an item can run in a process whose registry never saw it.
    pub schema: Value,
    pub max_tokens: Option<usize>,
}

impl ExtractSettings {
    pub fn of(spec: &JobSpec) -> Result<Self, ServiceError> {
        serde_json::from_value(spec.settings.clone())
            .map_err(|e| ServiceError::internal(format!("job {}: {e}", spec.id)))
    }
}

/// A batch's settings, as stored with it.
#[derive(Debug, Serialize, Deserialize)]
pub struct BatchSettings {
    /// `/v1/chat/completions` or `/extract`: every line's `url`.
    pub endpoint: String,
    pub input_file_id: String,
    pub completion_window: String,
    pub metadata: Option<Value>,
}

/// One item, by the kind of its job.
pub async fn run_item(service: &Service, work: Work) -> Done {
    match work.job.kind.as_str() {
        EXTRACT => run_document(service, work).await,
        BATCH => run_line(service, work).await,
        other => {
            let message = format!("this Quarry has no runner for jobs of kind `{other}`");
            (false, failed_item(&work.job, &message))
        }
    }
}

/// An item that failed inside Quarry (`internal`), in its job's result shape.
pub fn failed_item(job: &JobSpec, message: &str) -> Value {
    match job.kind.as_str() {
        EXTRACT => failed_document("internal", message),
        _ => failed_line("internal", message),
    }
}

/// A document that failed before or outside its extraction, as the store keeps it.
pub fn failed_document(kind: &str, message: &str) -> Value {
    serde_json::to_value(RecordResult::failed(kind, message.to_string())).unwrap_or_default()
}

/// A batch line that failed without a response (malformed, cancelled, or an internal failure).
pub fn failed_line(code: &str, message: &str) -> Value {
    json!({"error": {"code": code, "message": message}})
}

/// The result of a line the batch's cancelling ended before it ran.
pub fn cancelled_line() -> Value {
    failed_line("batch_cancelled", "the batch was cancelled before this request ran")
}

/// One document of an extraction job, extracted with the job's schema.
async fn run_document(service: &Service, work: Work) -> Done {
    if work.cancelled {
        return (
            false,
            failed_document("cancelled", "the job was cancelled before this item ran"),
        );
    }
    let result = match ExtractSettings::of(&work.job) {
        Ok(settings) => {
            let req = ExtractRequest {
                schema: Some(settings.schema),
                schema_id: None,
                document: work.payload.clone(),
                instructions: None,
                options: ExtractOptions {
                    max_tokens: work.max_tokens.or(settings.max_tokens),
                    ..Default::default()
                },
                grounding: false,
            };
            match service.extract_waiting(req).await {
                Ok(out) => RecordResult::finished(
                    out.outcome,
                    out.data,
                    out.partial.unwrap_or_default(),
                    out.usage.completion_tokens,
                    &out.violations,
                )
                .with_fields(out.fields),
                Err(e) => RecordResult::failed(e.kind.as_str(), e.message),
            }
        }
        Err(e) => RecordResult::failed(e.kind.as_str(), e.message),
    };
    (result.ok(), serde_json::to_value(result).unwrap_or_default())
}

/// One batch line against its endpoint, answered as the server would answer it over HTTP:
/// `{"status_code", "body"}`.
async fn run_line(service: &Service, work: Work) -> Done {
    let failed = |message: String| (false, failed_line("invalid_request", &message));
    if work.cancelled {
        return (false, cancelled_line());
    }
    let settings: BatchSettings = match serde_json::from_value(work.job.settings.clone()) {
        Ok(s) => s,
        Err(e) => return failed(format!("batch {}: {e}", work.job.id)),
    };
    let payload: Value = match serde_json::from_str(&work.payload) {
        Ok(p) => p,
        Err(e) => return failed(e.to_string()),
    };
    if let Some(message) = payload["error"].as_str() {
        return failed(message.to_string());
    }
    let line = payload["line"].as_u64().unwrap_or(0);
    let body = payload["body"].clone();
    let invalid = |e: serde_json::Error| Err(ServiceError::new(ErrorKind::InvalidField, format!("line {line}: {e}")));
    let result = match settings.endpoint.as_str() {
        "/extract" => match serde_json::from_value::<ExtractRequest>(body) {
            Ok(req) => service
                .extract_waiting(req)
                .await
                .map(|out| serde_json::to_value(out).unwrap_or_default()),
            Err(e) => invalid(e),
        },
        _ => match serde_json::from_value::<ChatCompletionRequest>(body) {
            Ok(req) if req.stream => Err(ServiceError::bad_request(format!(
                "line {line}: a batch request cannot stream"
            ))),
            Ok(req) => service
                .chat_waiting(&req)
                .await
                .map(|c| serde_json::to_value(c).unwrap_or_default()),
            Err(e) => invalid(e),
        },
    };
    let (status, body) = match result {
        Ok(body) => (200, body),
        Err(e) => (
            e.kind.status(),
            serde_json::to_value(ErrorBody::from(&e)).unwrap_or_default(),
        ),
    };
    (
        (200..300).contains(&status),
        json!({"status_code": status, "body": body}),
    )
}
