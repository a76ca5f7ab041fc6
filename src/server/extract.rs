//! `POST /extract`: one document in, one record out that validates against the schema, or an
//! explicit outcome saying why not.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;

use super::api::{ExtractRequest, ExtractResponse};
use super::error::{ApiError, ErrorBody};
use super::{ApiJson, AppState};

#[utoipa::path(
    post,
    path = "/extract",
    tag = "extraction",
    request_body = ExtractRequest,
    responses(
        (status = 200, description = "The record (outcome `ok`), or why there is none", body = ExtractResponse),
        (status = 400, description = "Bad JSON, a schema that cannot be compiled (its keyword and pointer named), or an input too long for the model", body = ErrorBody),
        (status = 404, description = "Unknown `schema_id`", body = ErrorBody),
        (status = 413, description = "Body over the size limit", body = ErrorBody),
        (status = 422, description = "Unknown, missing or mistyped field", body = ErrorBody),
        (status = 429, description = "Too many pending requests; see `Retry-After`", body = ErrorBody),
    )
)]
pub async fn extract(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<ExtractRequest>,
) -> Result<Json<ExtractResponse>, ApiError> {
    Ok(Json(state.service.extract(req).await?))
}
