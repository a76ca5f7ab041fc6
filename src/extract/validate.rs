//! Validation of finished records against the schema as the user gave it, by the independent
//! `jsonschema` crate: the grammar enforces what its report calls enforced, and this catches
//! whatever it approximated or left out before a record is called `ok`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

/// One way a record fails its schema.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Violation {
    /// The schema keyword that failed (`uniqueItems`, `not`, ...).
    pub keyword: String,
    /// JSON pointer of the failing value in the record.
    pub instance_pointer: String,
    /// JSON pointer of the keyword in the schema.
    pub schema_pointer: String,
    pub message: String,
}

/// A schema the validator cannot build (not a valid schema for the draft it names).
#[derive(Debug, Clone, thiserror::Error)]
#[error("the schema cannot be validated against: {message}")]
pub struct ValidatorError {
    /// JSON pointer, in the schema, of the value at fault.
    pub pointer: String,
    pub message: String,
}

/// Most validators kept; past it the cache starts over.
const MAX_CACHED: usize = 1024;

/// Validators by schema text, built once per schema.
#[derive(Default)]
pub struct Validators {
    cache: Mutex<HashMap<String, Arc<jsonschema::Validator>>>,
}

impl Validators {
    pub fn get(&self, schema: &Value) -> Result<Arc<jsonschema::Validator>, ValidatorError> {
        let key = schema.to_string();
        if let Some(v) = self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(v.clone());
        }
        // Formats are assertions here: the grammar enforces the ones it knows, and a record
        // whose date is no date must not pass as valid.
        let v = jsonschema::options()
            .should_validate_formats(true)
            .build(schema)
            .map_err(|e| ValidatorError {
                pointer: e.instance_path().as_str().to_string(),
                message: e.to_string(),
            })?;
        let v = Arc::new(v);
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= MAX_CACHED {
            cache.clear();
        }
        cache.insert(key, v.clone());
        Ok(v)
    }
}

/// Every violation of `record`, in the validator's order (none: the record is valid).
pub fn violations(validator: &jsonschema::Validator, record: &Value) -> Vec<Violation> {
    validator
        .iter_errors(record)
        .map(|e| Violation {
            keyword: e.kind().keyword().to_string(),
            instance_pointer: e.instance_path().as_str().to_string(),
            schema_pointer: e.schema_path().as_str().to_string(),
            message: e.to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_the_keyword_and_both_pointers() {
        let v = Validators::default();
        let schema = json!({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": true},
            "day": {"type": "string", "format": "date"}}});
        let validator = v.get(&schema).unwrap();
        assert!(violations(&validator, &json!({"tags": ["a", "b"], "day": "2024-02-29"})).is_empty());
        let found = violations(&validator, &json!({"tags": ["a", "a"], "day": "2023-02-29"}));
        let mut keywords: Vec<(&str, &str, &str)> = found
            .iter()
            .map(|x| {
                (
                    x.keyword.as_str(),
                    x.instance_pointer.as_str(),
                    x.schema_pointer.as_str(),
                )
            })
            .collect();
        keywords.sort();
        assert_eq!(
            keywords,
            vec![
                ("format", "/day", "/properties/day/format"),
                ("uniqueItems", "/tags", "/properties/tags/uniqueItems")
            ]
        );
        assert!(
            Arc::ptr_eq(&validator, &v.get(&schema).unwrap()),
            "built once per schema"
        );
        let err = v.get(&json!({"properties": {"a": {"type": 12}}})).unwrap_err();
        assert_eq!(err.pointer, "/properties/a/type");
    }
}
