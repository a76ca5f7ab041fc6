//! Every failure the API reports: an HTTP status and a JSON body naming the problem, the
//! field or schema keyword and its JSON pointer where there is one.

use axum::extract::multipart::MultipartRejection;
use axum::extract::rejection::{BytesRejection, JsonRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use quarry_grammar::GrammarError;

pub use crate::service::error::{ErrorBody, ErrorDetail};
use crate::service::{ErrorKind, ServiceError};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub detail: ErrorDetail,
    /// Seconds to wait before retrying (`Retry-After`), for `queue_full`.
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// An error of `kind`, with the status the kinds' table gives it.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ServiceError::new(kind, message).into()
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadRequest, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// A schema that cannot be compiled, its keyword and pointer named.
    pub fn schema_rejected(e: GrammarError) -> Self {
        ServiceError::schema_rejected(e).into()
    }
}

/// The service's error as a response: the status its kind has in the table.
impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        ApiError {
            status: StatusCode::from_u16(e.kind.status()).expect("the table's statuses are valid"),
            detail: ErrorBody::from(&e).error,
            retry_after: e.retry_after,
        }
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
        ) || self.detail.kind == ErrorKind::NotFound;
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
        Self::new(ErrorKind::InvalidQuery, r.body_text())
    }
}

/// A body that is not a multipart form (no boundary, another content type).
impl From<MultipartRejection> for ApiError {
    fn from(r: MultipartRejection) -> Self {
        Self::new(ErrorKind::of_rejected_body(r.status().as_u16()), r.body_text())
    }
}

/// A raw body over the limit (413) or unreadable.
impl From<BytesRejection> for ApiError {
    fn from(r: BytesRejection) -> Self {
        Self::new(ErrorKind::of_rejected_body(r.status().as_u16()), r.body_text())
    }
}

/// Body rejections become JSON errors too: malformed JSON (400), unknown, missing or mistyped
/// fields (422; serde names the field and where), a wrong content type (415), a body over the
/// limit (413).
impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        let (status, message) = (r.status(), r.body_text());
        let kind = match r {
            JsonRejection::JsonDataError(_) if message.contains("unknown field") => ErrorKind::UnknownField,
            JsonRejection::JsonDataError(_) => ErrorKind::InvalidField,
            JsonRejection::JsonSyntaxError(_) => ErrorKind::InvalidJson,
            _ => ErrorKind::of_rejected_body(status.as_u16()),
        };
        Self::new(kind, message)
    }
}
