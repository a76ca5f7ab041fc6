//! The schema registry: ready-made schemas loaded from a folder at start, plus schemas
//! registered over the API, addressable by id.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::RwLock;

use serde_json::Value;

use super::{ErrorKind, ServiceError};

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
    pub fn register(&self, schema: Value) -> Result<String, ServiceError> {
        let id = format!("s-{:016x}", fnv1a(schema.to_string().as_bytes()));
        let mut by_id = self.by_id.write().unwrap_or_else(|e| e.into_inner());
        if by_id.contains_key(&id) {
            return Ok(id);
        }
        if by_id.len() - self.ready_made >= MAX_REGISTERED {
            return Err(ServiceError::new(
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

/// No schema under `id`.
pub fn unknown(id: &str) -> ServiceError {
    ServiceError::new(ErrorKind::UnknownSchemaId, format!("no schema with id `{id}`"))
}
