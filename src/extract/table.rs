//! Records as CSV, with columns taken from the schema rather than from whatever the records
//! happen to hold: every scalar leaf gets a dotted column (`customer.address.city`) in the
//! schema's property order, so every row of every job with one schema has the same header.
//! One array may be exploded into rows (one row per element, the other columns repeated);
//! other arrays and free-form objects are one cell of compact JSON. Each row starts with the
//! item's id and outcome and ends with an `error` column. With confidence, each column is
//! followed by `<column>__confidence`: its leaf's confidence, or for a JSON cell the least of
//! the confidences of the leaves in it (a cell is as sure as its least sure value).

use serde_json::{Map, Value};

use super::records::RecordResult;
use super::FieldReport;

/// `$ref` chains and nesting deeper than this become a JSON cell.
const MAX_DEPTH: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// A path from the record's root.
    Root(Vec<String>),
    /// A path inside one element of the exploded array.
    Element(Vec<String>),
}

#[derive(Debug, Clone)]
pub struct Table {
    names: Vec<String>,
    sources: Vec<Source>,
    /// Where the exploded array is, from the root.
    explode: Option<Vec<String>>,
    confidence: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the schema has no array at `{0}` to explode")]
pub struct NoSuchArray(pub String);

impl Table {
    /// The columns of `schema`; `explode` is the dotted path of an array property.
    pub fn from_schema(schema: &Value, explode: Option<&str>) -> Result<Table, NoSuchArray> {
        let mut walk = Walk {
            root: schema,
            explode: explode.map(|p| p.split('.').map(str::to_string).collect()),
            found: false,
            names: Vec::new(),
            sources: Vec::new(),
        };
        walk.node(schema, &[], false, 0);
        if let (Some(path), false) = (explode, walk.found) {
            return Err(NoSuchArray(path.to_string()));
        }
        if walk.names.is_empty() {
            // A schema without properties: the whole record in one cell.
            walk.names.push("data".into());
            walk.sources.push(Source::Root(Vec::new()));
        }
        Ok(Table {
            names: walk.names,
            sources: walk.sources,
            explode: walk.explode,
            confidence: false,
        })
    }

    /// With `on`, a `<column>__confidence` column after each column.
    pub fn with_confidence(mut self, on: bool) -> Table {
        self.confidence = on;
        self
    }

    pub fn header(&self) -> Vec<String> {
        let mut h = vec!["id".to_string(), "outcome".to_string()];
        for name in &self.names {
            h.push(name.clone());
            if self.confidence {
                h.push(format!("{name}__confidence"));
            }
        }
        h.push("error".into());
        h
    }

    /// The rows of one item: one per element of the exploded array (at least one), or one row
    /// of empty cells with the error when there is no data.
    pub fn rows(&self, id: &str, r: &RecordResult) -> Vec<Vec<String>> {
        let data = r.data.as_ref();
        let elements: Vec<Option<(usize, &Value)>> = match (data, &self.explode) {
            (Some(d), Some(path)) => match lookup(d, path) {
                Some(Value::Array(a)) if !a.is_empty() => a.iter().enumerate().map(Some).collect(),
                _ => vec![None],
            },
            _ => vec![None],
        };
        let fields = r.fields.as_deref().unwrap_or_default();
        elements
            .into_iter()
            .map(|element| {
                let mut row = vec![id.to_string(), r.outcome.clone()];
                for s in &self.sources {
                    let (v, pointer) = match s {
                        Source::Root(p) => (data.and_then(|d| lookup(d, p)), Some(pointer(&[], p))),
                        Source::Element(p) => match (element, &self.explode) {
                            (Some((i, e)), Some(at)) => {
                                let mut prefix = at.clone();
                                prefix.push(i.to_string());
                                (lookup(e, p), Some(pointer(&prefix, p)))
                            }
                            _ => (None, None),
                        },
                    };
                    row.push(v.map(cell).unwrap_or_default());
                    if self.confidence {
                        let c = v.and(pointer).and_then(|p| cell_confidence(fields, &p));
                        row.push(c.map(|c| format!("{c:.3}")).unwrap_or_default());
                    }
                }
                row.push(r.error.clone().unwrap_or_default());
                row
            })
            .collect()
    }
}

/// The JSON pointer of `path` below `prefix`.
fn pointer(prefix: &[String], path: &[String]) -> String {
    prefix
        .iter()
        .chain(path)
        .map(|k| format!("/{}", super::pointer_token(k)))
        .collect()
}

/// The confidence of the leaf at `pointer`, or the least of those of the leaves inside it.
fn cell_confidence(fields: &[FieldReport], pointer: &str) -> Option<f64> {
    if let Some(f) = fields.iter().find(|f| f.pointer == pointer) {
        return f.confidence;
    }
    let inside = format!("{pointer}/");
    fields
        .iter()
        .filter(|f| f.pointer.starts_with(&inside))
        .filter_map(|f| f.confidence)
        .reduce(f64::min)
}

struct Walk<'a> {
    root: &'a Value,
    explode: Option<Vec<String>>,
    found: bool,
    names: Vec<String>,
    sources: Vec<Source>,
}

impl<'a> Walk<'a> {
    /// Adds the columns of `node` at `path` (relative to the exploded element when `inside`).
    fn node(&mut self, node: &'a Value, path: &[String], inside: bool, depth: usize) {
        let node = self.resolve(node, 0);
        let Some(obj) = node.as_object().filter(|_| depth < MAX_DEPTH) else {
            return self.leaf(path, inside);
        };
        if let Some(Value::Object(props)) = obj.get("properties") {
            for (key, sub) in props {
                let mut p = path.to_vec();
                p.push(key.clone());
                self.node(sub, &p, inside, depth + 1);
            }
            return;
        }
        if let Some(Value::Array(parts)) = obj.get("allOf") {
            let before = self.names.len();
            for part in parts {
                self.properties_only(part, path, inside, depth + 1);
            }
            if self.names.len() > before {
                return;
            }
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(variants)) = obj.get(key) {
                let non_null: Vec<&Value> = variants.iter().filter(|v| !is_null_only(self.resolve(v, 0))).collect();
                if let [only] = non_null[..] {
                    return self.node(only, path, inside, depth + 1);
                }
            }
        }
        if !inside && self.explode.as_deref() == Some(path) && is_array(obj) {
            self.found = true;
            return match obj.get("items") {
                Some(items) => self.node(items, &[], true, depth + 1),
                None => self.leaf(&[], true),
            };
        }
        self.leaf(path, inside)
    }

    /// An `allOf` part contributes its properties, never a column for itself.
    fn properties_only(&mut self, node: &'a Value, path: &[String], inside: bool, depth: usize) {
        if self.resolve(node, 0).get("properties").is_some() {
            self.node(node, path, inside, depth);
        }
    }

    fn leaf(&mut self, path: &[String], inside: bool) {
        let mut name: Vec<String> = Vec::new();
        if inside {
            name.extend(self.explode.iter().flatten().cloned());
        }
        name.extend(path.iter().cloned());
        self.names
            .push(if name.is_empty() { "data".into() } else { name.join(".") });
        self.sources.push(if inside {
            Source::Element(path.to_vec())
        } else {
            Source::Root(path.to_vec())
        });
    }

    /// Follows local `$ref`s (`#/$defs/x`), as far as `MAX_DEPTH`.
    fn resolve(&self, node: &'a Value, depth: usize) -> &'a Value {
        match node.get("$ref").and_then(Value::as_str) {
            Some(r) if depth < MAX_DEPTH => match r.strip_prefix('#').and_then(|p| self.root.pointer(p)) {
                Some(target) => self.resolve(target, depth + 1),
                None => node,
            },
            _ => node,
        }
    }
}

fn is_array(obj: &Map<String, Value>) -> bool {
    match obj.get("type") {
        Some(Value::String(t)) => t == "array",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "array"),
        _ => obj.contains_key("items"),
    }
}

fn is_null_only(v: &Value) -> bool {
    v.get("type") == Some(&Value::String("null".into())) || v.get("const") == Some(&Value::Null)
}

fn lookup<'v>(v: &'v Value, path: &[String]) -> Option<&'v Value> {
    path.iter().try_fold(v, |v, key| v.get(key.as_str()))
}

fn cell(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extract::grounding::Span;
    use serde_json::json;

    fn result(outcome: &str, data: Option<Value>, error: Option<&str>) -> RecordResult {
        RecordResult {
            outcome: outcome.into(),
            data,
            partial: None,
            error: error.map(str::to_string),
            fields: None,
        }
    }

    fn invoice() -> Value {
        json!({
            "type": "object",
            "$defs": {"money": {"type": "number"}},
            "properties": {
                "number": {"type": "string"},
                "customer": {"type": "object", "properties": {
                    "name": {"type": "string"},
                    "address": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"city": {"type": "string"}}}]}
                }},
                "items": {"type": "array", "items": {"type": "object", "properties": {
                    "description": {"type": "string"}, "amount": {"$ref": "#/$defs/money"}
                }}},
                "tags": {"type": "array", "items": {"type": "string"}},
                "total": {"$ref": "#/$defs/money"}
            }
        })
    }

    #[test]
    fn columns_follow_the_schema_order_with_dotted_names() {
        let t = Table::from_schema(&invoice(), None).unwrap();
        assert_eq!(
            t.header(),
            [
                "id",
                "outcome",
                "number",
                "customer.name",
                "customer.address.city",
                "items",
                "tags",
                "total",
                "error"
            ]
        );
        let data = json!({"total": 12.5, "number": "A-1", "customer": {"name": "Ann", "address": null},
                          "items": [{"description": "x", "amount": 1}], "tags": ["a", "b"]});
        let rows = t.rows("7", &result("ok", Some(data), None));
        assert_eq!(
            rows,
            [[
                "7",
                "ok",
                "A-1",
                "Ann",
                "",
                r#"[{"description":"x","amount":1}]"#,
                r#"["a","b"]"#,
                "12.5",
                ""
            ]]
        );
    }

    #[test]
    fn an_exploded_array_gives_one_row_per_element() {
        let t = Table::from_schema(&invoice(), Some("items")).unwrap();
        let h = t.header();
        assert_eq!(h[5..7], ["items.description", "items.amount"]);
        let data = json!({"number": "A-1", "items": [{"description": "x", "amount": 1}, {"description": "y"}]});
        let rows = t.rows("1", &result("ok", Some(data), None));
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0][2], "A-1");
        assert_eq!(rows[1][2], "A-1");
        assert_eq!((rows[1][5].as_str(), rows[1][6].as_str()), ("y", ""));
        let empty = t.rows("2", &result("ok", Some(json!({"items": []})), None));
        assert_eq!(empty.len(), 1);
    }

    #[test]
    fn failed_items_keep_the_header_shape_and_carry_the_error() {
        let t = Table::from_schema(&invoice(), Some("items")).unwrap();
        let rows = t.rows("3", &result("truncated", None, Some("no closing within 16 tokens")));
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].len(), t.header().len());
        assert_eq!(rows[0][1], "truncated");
        assert_eq!(rows[0].last().unwrap(), "no closing within 16 tokens");
    }

    #[test]
    fn exploding_a_missing_array_is_an_error_and_schemaless_records_are_one_cell() {
        assert_eq!(
            Table::from_schema(&invoice(), Some("customer")).unwrap_err(),
            NoSuchArray("customer".into())
        );
        let t = Table::from_schema(&json!({"type": "object"}), None).unwrap();
        assert_eq!(t.header(), ["id", "outcome", "data", "error"]);
        assert_eq!(
            t.rows("1", &result("ok", Some(json!({"a": 1})), None))[0][2],
            r#"{"a":1}"#
        );
    }

    #[test]
    fn confidence_columns_follow_their_columns_and_json_cells_take_their_least_sure_leaf() {
        let t = Table::from_schema(&invoice(), Some("items"))
            .unwrap()
            .with_confidence(true);
        let h = t.header();
        assert_eq!(
            h[2..8],
            [
                "number",
                "number__confidence",
                "customer.name",
                "customer.name__confidence",
                "customer.address.city",
                "customer.address.city__confidence"
            ]
        );
        assert_eq!(
            h[8..12],
            [
                "items.description",
                "items.description__confidence",
                "items.amount",
                "items.amount__confidence"
            ]
        );
        let field = |pointer: &str, c: Option<f64>| FieldReport {
            pointer: pointer.into(),
            confidence: c,
            span: Some(Span { start: 0, end: 1 }),
        };
        let mut r = result(
            "ok",
            Some(json!({"number": "A/1", "customer": {"name": "Ann"}, "tags": ["a", "b"],
                        "items": [{"description": "x", "amount": 1}, {"description": "y", "amount": 2}]})),
            None,
        );
        r.fields = Some(vec![
            field("/number", Some(0.5)),
            field("/customer/name", None),
            field("/items/0/description", Some(0.25)),
            field("/items/0/amount", Some(0.125)),
            field("/items/1/description", Some(0.75)),
            field("/items/1/amount", Some(1.0)),
            field("/tags/0", Some(0.9)),
            field("/tags/1", Some(0.8)),
        ]);
        let rows = t.rows("1", &r);
        let col = |row: usize, name: &str| rows[row][h.iter().position(|c| c == name).unwrap()].clone();
        assert_eq!(col(0, "number__confidence"), "0.500");
        // Not computed, and absent from the record: empty cells.
        assert_eq!(col(0, "customer.name__confidence"), "");
        assert_eq!(col(0, "customer.address.city__confidence"), "");
        // Each exploded row takes its own element's leaves.
        assert_eq!(col(0, "items.amount__confidence"), "0.125");
        assert_eq!(col(1, "items.description__confidence"), "0.750");
        assert_eq!(col(1, "items.amount__confidence"), "1.000");
        // A JSON cell is as sure as its least sure leaf.
        assert_eq!(col(1, "tags__confidence"), "0.800");
        // Without fields (an old result, or a failed item), the columns are empty.
        let rows = t.rows("2", &result("truncated", None, Some("cut")));
        assert_eq!(rows[0].len(), h.len());
        assert!(rows[0][2..h.len() - 1].iter().all(String::is_empty));
    }
}
