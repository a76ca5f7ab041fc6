//! The schema registry: ready-made schemas loaded from schemas/ at start, plus schemas
//! registered over `POST /schemas`, each compiled once (preflight) and addressable by id.

use std::sync::Arc;

use axum::extract::{Path as UrlPath, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::api::KeywordEntry;
use super::error::{ApiError, ErrorBody};
use super::{ApiJson, AppState};

pub use crate::service::schemas::SchemaRegistry;

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegisterSchema {
    #[schema(value_type = Object)]
    pub schema: Value,
    /// Refuse the schema if any keyword cannot be enforced.
    #[serde(default)]
    pub strict: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SchemaInfo {
    pub schema_id: String,
    #[schema(value_type = Object)]
    pub schema: Value,
    /// Every keyword of the schema with its JSON pointer and what the grammar makes of it.
    pub report: Vec<KeywordEntry>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SchemaList {
    pub schema_ids: Vec<String>,
}

/// Compiles `schema` off the async threads (cached, so the first extraction with it is fast).
pub(super) async fn preflight(state: &AppState, schema: &Value, strict: bool) -> Result<Vec<KeywordEntry>, ApiError> {
    Ok(state.service.preflight(schema, strict).await?)
}

#[utoipa::path(
    post,
    path = "/schemas",
    tag = "schemas",
    request_body = RegisterSchema,
    responses(
        (status = 200, description = "Compiled and registered; the report lists every keyword", body = SchemaInfo),
        (status = 400, description = "The schema cannot be compiled: its keyword and pointer are named", body = ErrorBody),
        (status = 422, description = "Unknown or missing field", body = ErrorBody),
    )
)]
pub async fn register(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<RegisterSchema>,
) -> Result<Json<SchemaInfo>, ApiError> {
    let report = preflight(&state, &req.schema, req.strict).await?;
    let schema_id = state.service.schemas.register(req.schema.clone())?;
    Ok(Json(SchemaInfo {
        schema_id,
        schema: req.schema,
        report,
    }))
}

#[utoipa::path(
    get,
    path = "/schemas/{id}",
    tag = "schemas",
    params(("id" = String, Path, description = "A schema id")),
    responses(
        (status = 200, body = SchemaInfo),
        (status = 404, description = "Unknown id", body = ErrorBody),
    )
)]
pub async fn get_one(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<SchemaInfo>, ApiError> {
    let schema = state.service.schemas.get(&id).ok_or_else(|| unknown(&id))?;
    let report = preflight(&state, &schema, false).await?;
    Ok(Json(SchemaInfo {
        schema_id: id,
        schema,
        report,
    }))
}

#[utoipa::path(get, path = "/schemas", tag = "schemas", responses((status = 200, body = SchemaList)))]
pub async fn list(State(state): State<Arc<AppState>>) -> Json<SchemaList> {
    Json(SchemaList {
        schema_ids: state.service.schemas.ids(),
    })
}

pub fn unknown(id: &str) -> ApiError {
    crate::service::schemas::unknown(id).into()
}
