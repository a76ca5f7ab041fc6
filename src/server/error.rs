//! Every failure the API reports: an HTTP status and a JSON body naming the problem, the
//! field or schema keyword and its JSON pointer where there is one.

use axum::extract::multipart::MultipartRejection;
use axum::extract::rejection::{BytesRejection, JsonRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use quarry_grammar::GrammarError;
use serde::Serialize;
use utoipa::ToSchema;

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// A stable machine-readable kind: `bad_request`, `invalid_json`, `unknown_field`,
    /// `invalid_field`, `invalid_query`, `body_too_large`, `queue_full`, `too_many_choices`, `unknown_job`, `schema_rejected`, `unknown_schema_id`, `input_too_long`,
    /// `max_tokens_too_small`, `unauthorized`, `internal`.
    #[serde(rename = "type")]
    pub kind: String,
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

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub detail: ErrorDetail,
    /// Seconds to wait before retrying (`Retry-After`), for `queue_full`.
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            detail: ErrorDetail {
                kind: kind.into(),
                message: message.into(),
                keyword: None,
                pointer: None,
                minimum: None,
            },
            retry_after: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    /// A schema that cannot be compiled (malformed, an unresolvable `$ref`, too large, or a
    /// keyword refused in strict mode).
    pub fn schema_rejected(e: GrammarError) -> Self {
        let mut err = Self::new(StatusCode::BAD_REQUEST, "schema_rejected", e.to_string());
        if let GrammarError::InvalidSchema { pointer, keyword, .. }
        | GrammarError::Unsupported { pointer, keyword, .. } = e
        {
            err.detail.pointer = Some(pointer);
            err.detail.keyword = Some(keyword);
        }
        err
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // These are answered before the request body is read (the key check and the route
        // come first; a wrong content type or an oversized body stop the read); the unread
        // rest would be taken for the next request on a kept-alive connection, so the server
        // closes it, and says so, lest the client reuse it and see a reset.
        let body_unread = matches!(
            self.status,
            StatusCode::UNAUTHORIZED | StatusCode::PAYLOAD_TOO_LARGE | StatusCode::UNSUPPORTED_MEDIA_TYPE
        ) || self.detail.kind == "not_found";
        let mut response = (self.status, axum::Json(ErrorBody { error: self.detail })).into_response();
        if body_unread {
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, seconds.into());
        }
        response
    }
}

/// A bad query string names the parameter (400).
impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_query", r.body_text())
    }
}

/// A body that is not a multipart form (no boundary, another content type).
impl From<MultipartRejection> for ApiError {
    fn from(r: MultipartRejection) -> Self {
        Self::new(r.status(), "bad_request", r.body_text())
    }
}

/// A raw body over the limit (413) or unreadable.
impl From<BytesRejection> for ApiError {
    fn from(r: BytesRejection) -> Self {
        let kind = if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            "body_too_large"
        } else {
            "bad_request"
        };
        Self::new(r.status(), kind, r.body_text())
    }
}

/// Body rejections become JSON errors too, with axum's status: malformed JSON (400), unknown,
/// missing or mistyped fields (422; serde names the field and where), a wrong content type
/// (415), a body over the limit (413).
impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        let (status, message) = (r.status(), r.body_text());
        let kind = match r {
            JsonRejection::JsonDataError(_) if message.contains("unknown field") => "unknown_field",
            JsonRejection::JsonDataError(_) => "invalid_field",
            JsonRejection::JsonSyntaxError(_) => "invalid_json",
            _ if status == StatusCode::PAYLOAD_TOO_LARGE => "body_too_large",
            _ => "bad_request",
        };
        Self::new(status, kind, message)
    }
}
