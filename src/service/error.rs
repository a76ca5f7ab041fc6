//! Every kind of failure the service reports, and the one table that gives each its HTTP status
//! and meaning. The server's errors, job items' and batch lines' failures and the OpenAPI spec's
//! list of kinds all come from here, so a kind cannot be emitted without being documented.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use quarry_grammar::GrammarError;

use crate::engine::{AddError, AdmitError, SubmitError};

/// An error as the API's bodies carry it (and batch lines and job results store it).
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// A stable machine-readable kind; the status it comes with is fixed per kind.
    #[serde(rename = "type")]
    pub kind: ErrorKind,
    pub message: String,
    /// The JSON Schema keyword at fault, for `schema_rejected`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keyword: Option<String>,
    /// JSON pointer into the schema, for `schema_rejected`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pointer: Option<String>,
    /// The least `max_tokens` that can hold the schema's shortest record, for
    /// `max_tokens_too_small`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub minimum: Option<u32>,
}

impl From<&ServiceError> for ErrorBody {
    fn from(e: &ServiceError) -> Self {
        ErrorBody {
            error: ErrorDetail {
                kind: e.kind,
                message: e.message.clone(),
                keyword: e.keyword.clone(),
                pointer: e.pointer.clone(),
                minimum: e.minimum,
            },
        }
    }
}

/// A failure of the service: its kind, a message for people, and what the kind may add.
#[derive(Debug, Clone)]
pub struct ServiceError {
    pub kind: ErrorKind,
    pub message: String,
    /// The JSON Schema keyword at fault and its pointer, for `schema_rejected`.
    pub keyword: Option<String>,
    pub pointer: Option<String>,
    /// The least `max_tokens` that can hold the schema's shortest record, for
    /// `max_tokens_too_small`.
    pub minimum: Option<u32>,
    /// Seconds to wait before retrying, for `queue_full`.
    pub retry_after: Option<u32>,
}

impl ServiceError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ServiceError {
            kind,
            message: message.into(),
            keyword: None,
            pointer: None,
            minimum: None,
            retry_after: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadRequest, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// A schema that cannot be compiled (malformed, an unresolvable `$ref`, too large, or a
    /// keyword refused in strict mode), naming its keyword and pointer where it can.
    pub fn schema_rejected(e: GrammarError) -> Self {
        let mut err = Self::new(ErrorKind::SchemaRejected, e.to_string());
        if let GrammarError::InvalidSchema { pointer, keyword, .. }
        | GrammarError::Unsupported { pointer, keyword, .. } = e
        {
            err.pointer = Some(pointer);
            err.keyword = Some(keyword);
        }
        err
    }

    /// The engine's refusal of a request.
    pub fn refusal(e: SubmitError) -> Self {
        let kind = ErrorKind::of_refusal(&e);
        let message = match &e {
            SubmitError::Refused(AddError::Admit(AdmitError::InputTooLong { tokens, limit })) => {
                format!("the prompt is {tokens} tokens; this model and cache take at most {limit}")
            }
            SubmitError::Refused(AddError::MaxTokensTooSmall { max_tokens, minimum }) => format!(
                "at most {max_tokens} tokens fit (max_tokens, and the context after the prompt), but the schema's shortest record is {minimum} bytes; ask for at least {minimum} tokens"
            ),
            SubmitError::Refused(e @ AddError::NoValidOutput) => format!("{e}: no value satisfies the schema"),
            SubmitError::Refused(e) => e.to_string(),
            SubmitError::Stopped => "the engine is shutting down".into(),
        };
        let mut err = Self::new(kind, message);
        if let SubmitError::Refused(AddError::MaxTokensTooSmall { minimum, .. }) = e {
            err.minimum = Some(minimum.min(u32::MAX as usize) as u32);
        }
        err
    }
}

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

/// A stable, machine-readable error kind (the `type` of an error body).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request is malformed in a way no other kind names.
    BadRequest,
    /// The body (or a JSON field given as text) is not JSON.
    InvalidJson,
    /// A field the endpoint does not know.
    UnknownField,
    /// A field missing, mistyped or out of range.
    InvalidField,
    /// A query parameter missing or malformed.
    InvalidQuery,
    /// The body is not of the content type the endpoint reads.
    UnsupportedMediaType,
    /// The body is over the server's limit.
    BodyTooLarge,
    /// A batch file names one `custom_id` twice.
    DuplicateCustomId,
    /// More engine requests at once (`n`) than the server ever admits.
    TooManyChoices,
    /// The prompt is longer than the model and cache take.
    InputTooLong,
    /// `max_tokens` cannot hold the schema's shortest record.
    MaxTokensTooSmall,
    /// The schema cannot be compiled, or no value satisfies it.
    SchemaRejected,
    /// No valid API key.
    Unauthorized,
    /// No such route, file or batch.
    NotFound,
    /// No such job.
    UnknownJob,
    /// No registered schema with that id.
    UnknownSchemaId,
    /// The request names a model this server does not serve.
    ModelNotFound,
    /// The job has items queued or running.
    JobRunning,
    /// The batch has finished.
    BatchNotCancellable,
    /// Too many requests are pending; retry after `Retry-After` seconds.
    QueueFull,
    /// The schema registry is full.
    RegistryFull,
    /// The engine failed on this request.
    Internal,
    /// The engine is shutting down.
    Unavailable,
    /// The server is still loading its model.
    Starting,
    /// The job store cannot be reached.
    JobStoreUnavailable,
    /// The request was cancelled before it finished.
    Cancelled,
}

impl ErrorKind {
    /// Every kind, in the order of the table.
    pub const ALL: [ErrorKind; 26] = [
        ErrorKind::BadRequest,
        ErrorKind::InvalidJson,
        ErrorKind::UnknownField,
        ErrorKind::InvalidField,
        ErrorKind::InvalidQuery,
        ErrorKind::UnsupportedMediaType,
        ErrorKind::BodyTooLarge,
        ErrorKind::DuplicateCustomId,
        ErrorKind::TooManyChoices,
        ErrorKind::InputTooLong,
        ErrorKind::MaxTokensTooSmall,
        ErrorKind::SchemaRejected,
        ErrorKind::Unauthorized,
        ErrorKind::NotFound,
        ErrorKind::UnknownJob,
        ErrorKind::UnknownSchemaId,
        ErrorKind::ModelNotFound,
        ErrorKind::JobRunning,
        ErrorKind::BatchNotCancellable,
        ErrorKind::QueueFull,
        ErrorKind::RegistryFull,
        ErrorKind::Internal,
        ErrorKind::Unavailable,
        ErrorKind::Starting,
        ErrorKind::JobStoreUnavailable,
        ErrorKind::Cancelled,
    ];

    /// The table: each kind's name and HTTP status.
    pub fn entry(self) -> (&'static str, u16) {
        use ErrorKind::*;
        match self {
            BadRequest => ("bad_request", 400),
            InvalidJson => ("invalid_json", 400),
            UnknownField => ("unknown_field", 422),
            InvalidField => ("invalid_field", 422),
            InvalidQuery => ("invalid_query", 400),
            UnsupportedMediaType => ("unsupported_media_type", 415),
            BodyTooLarge => ("body_too_large", 413),
            DuplicateCustomId => ("duplicate_custom_id", 400),
            TooManyChoices => ("too_many_choices", 400),
            InputTooLong => ("input_too_long", 400),
            MaxTokensTooSmall => ("max_tokens_too_small", 400),
            SchemaRejected => ("schema_rejected", 400),
            Unauthorized => ("unauthorized", 401),
            NotFound => ("not_found", 404),
            UnknownJob => ("unknown_job", 404),
            UnknownSchemaId => ("unknown_schema_id", 404),
            ModelNotFound => ("model_not_found", 404),
            JobRunning => ("job_running", 409),
            BatchNotCancellable => ("batch_not_cancellable", 409),
            QueueFull => ("queue_full", 429),
            RegistryFull => ("registry_full", 507),
            Internal => ("internal", 500),
            Unavailable => ("unavailable", 503),
            Starting => ("starting", 503),
            JobStoreUnavailable => ("job_store_unavailable", 503),
            Cancelled => ("cancelled", 503),
        }
    }

    pub fn as_str(self) -> &'static str {
        self.entry().0
    }

    pub fn status(self) -> u16 {
        self.entry().1
    }

    /// The kind of the engine's refusal of a request.
    pub fn of_refusal(e: &SubmitError) -> ErrorKind {
        match e {
            SubmitError::Refused(AddError::Admit(AdmitError::InputTooLong { .. })) => ErrorKind::InputTooLong,
            SubmitError::Refused(AddError::MaxTokensTooSmall { .. }) => ErrorKind::MaxTokensTooSmall,
            SubmitError::Refused(AddError::NoValidOutput) => ErrorKind::SchemaRejected,
            SubmitError::Refused(_) => ErrorKind::BadRequest,
            SubmitError::Stopped => ErrorKind::Unavailable,
        }
    }

    /// The kind for a body rejected before it was read, by the status the HTTP layer gave it.
    pub fn of_rejected_body(status: u16) -> ErrorKind {
        match status {
            413 => ErrorKind::BodyTooLarge,
            415 => ErrorKind::UnsupportedMediaType,
            s if s >= 500 => ErrorKind::Internal,
            _ => ErrorKind::BadRequest,
        }
    }
}

/// A kind equals its name (`kind == "queue_full"`).
impl PartialEq<&str> for ErrorKind {
    fn eq(&self, name: &&str) -> bool {
        self.as_str() == *name
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_in_the_table_once_and_serializes_as_its_name() {
        let mut names = std::collections::HashSet::new();
        for kind in ErrorKind::ALL {
            assert!(names.insert(kind.as_str()), "{kind:?} shares its name");
            assert_eq!(serde_json::to_value(kind).unwrap(), kind.as_str(), "{kind:?}");
            assert!((400..600).contains(&kind.status()), "{kind:?}");
        }
    }
}
