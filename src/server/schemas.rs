//! The schema registry: ready-made schemas loaded from schemas/ at start, plus schemas
//! registered over `POST /schemas`, each compiled once (preflight) and addressable by id.

use crate::service::ErrorKind;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, RwLock};

use axum::extract::{Path as UrlPath, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::api::KeywordEntry;
use super::error::{ApiError, ErrorBody};
use super::{ApiJson, AppState};
use crate::extract::Task;

/// Most schemas registered over the API; ready-made ones do not count.
const MAX_REGISTERED: usize = 10_000;

#[derive(Default)]
pub struct SchemaRegistry {
    by_id: RwLock<BTreeMap<String, Value>>,
    /// Loaded from the folder at start: the rest were registered over the API.
    ready_made: usize,
}

impl SchemaRegistry {
    /// Every `*.json` of `dir`, by file stem. A file that is not JSON stops the start.
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let mut by_id = BTreeMap::new();
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries {
                let path = entry?.path();
                if path.extension().is_some_and(|e| e == "json") {
                    let text = std::fs::read_to_string(&path)?;
                    let schema = serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                    by_id.insert(
                        path.file_stem().unwrap_or_default().to_string_lossy().into_owned(),
                        schema,
                    );
                }
            }
        }
        Ok(SchemaRegistry {
            ready_made: by_id.len(),
            by_id: RwLock::new(by_id),
        })
    }

    pub fn get(&self, id: &str) -> Option<Value> {
        self.by_id.read().unwrap_or_else(|e| e.into_inner()).get(id).cloned()
    }

    pub fn ids(&self) -> Vec<String> {
        self.by_id
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect()
    }

    /// Registers `schema` under an id derived from its text (the same schema, the same id).
    pub(super) fn register(&self, schema: Value) -> Result<String, ApiError> {
        let id = format!("s-{:016x}", fnv1a(schema.to_string().as_bytes()));
        let mut by_id = self.by_id.write().unwrap_or_else(|e| e.into_inner());
        if by_id.contains_key(&id) {
            return Ok(id);
        }
        if by_id.len() - self.ready_made >= MAX_REGISTERED {
            return Err(ApiError::new(
                ErrorKind::RegistryFull,
                format!("{MAX_REGISTERED} schemas are registered already"),
            ));
        }
        by_id.insert(id.clone(), schema);
        Ok(id)
    }
}

/// A stable 64-bit hash (FNV-1a), so an id survives restarts.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

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
pub(super) async fn preflight(
    state: &Arc<AppState>,
    schema: &Value,
    strict: bool,
) -> Result<Vec<KeywordEntry>, ApiError> {
    // As an extraction with the default options compiles it, so that one finds it cached.
    let constraint = Task {
        strict,
        ..Task::new(schema.clone(), String::new())
    }
    .constraint();
    let work = state.clone();
    let compiled = tokio::task::spawn_blocking(move || work.extractor.structured.compile(&constraint))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(ApiError::schema_rejected)?;
    Ok(compiled.report().map(KeywordEntry::from_report).unwrap_or_default())
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
    let schema_id = state.schemas.register(req.schema.clone())?;
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
    let schema = state.schemas.get(&id).ok_or_else(|| unknown(&id))?;
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
        schema_ids: state.schemas.ids(),
    })
}

pub fn unknown(id: &str) -> ApiError {
    ApiError::new(ErrorKind::UnknownSchemaId, format!("no schema with id `{id}`"))
}
