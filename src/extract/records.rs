//! Batch records: the documents of a job or of `quarry extract --input`, from JSONL (one
//! `{"id"?, "document"}` object per line) or CSV (a header row with a text column, `document`
//! unless named otherwise, and an optional `id` column), and the result of each. Items
//! without an id get their line or row number, so every result can be joined back to its
//! input.

use serde_json::{json, Value};

use super::validate::Violation;
use super::{FieldReport, Outcome};

/// Most items in one batch.
pub const MAX_RECORDS: usize = 100_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub id: String,
    pub document: String,
}

/// How one record's extraction ended.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RecordResult {
    /// `ok`, another outcome (`truncated`, ...) or an error type (`input_too_long`, ...).
    pub outcome: String,
    pub data: Option<Value>,
    /// What was generated, for outcomes other than `ok` that produced text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// With outcome `ok`: each leaf's confidence and span (results stored before confidence
    /// existed have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fields: Option<Vec<FieldReport>>,
}

impl RecordResult {
    /// An extraction that ran: its record, or its outcome, the text it got to and, for a
    /// record that fails its schema, the violations.
    pub fn finished(
        outcome: Outcome,
        data: Option<Value>,
        text: String,
        completion_tokens: usize,
        violations: &[Violation],
    ) -> RecordResult {
        let error = match outcome {
            Outcome::Ok => None,
            Outcome::Truncated => Some(format!("the record did not close within {completion_tokens} tokens")),
            Outcome::SchemaViolation => Some(
                violations
                    .iter()
                    .map(|v| format!("{} at {:?}: {}", v.keyword, v.instance_pointer, v.message))
                    .collect::<Vec<_>>()
                    .join("; "),
            ),
            Outcome::Cancelled => Some("the request was cancelled".into()),
            Outcome::Internal => Some("the engine failed on this item".into()),
        };
        RecordResult {
            outcome: outcome.name().into(),
            data,
            partial: (outcome != Outcome::Ok).then_some(text),
            error,
            fields: None,
        }
    }

    /// The same result with its record's fields (kept only where the outcome is `ok`).
    pub fn with_fields(mut self, fields: Vec<FieldReport>) -> RecordResult {
        self.fields = self.ok().then_some(fields);
        self
    }

    /// An extraction that could not run, with the error's type.
    pub fn failed(kind: &str, message: String) -> RecordResult {
        RecordResult {
            outcome: kind.into(),
            data: None,
            partial: None,
            error: Some(message),
            fields: None,
        }
    }

    pub fn ok(&self) -> bool {
        self.outcome == "ok"
    }

    /// The JSONL form: `{id, outcome, data, partial?, error?, fields?}`.
    pub fn json_line(&self, id: &str) -> String {
        self.json(id).to_string()
    }

    /// `json_line` as a value, for callers that add to it.
    pub fn json(&self, id: &str) -> Value {
        let mut line = json!({"id": id, "outcome": self.outcome, "data": self.data});
        if let Some(p) = &self.partial {
            line["partial"] = json!(p);
        }
        if let Some(e) = &self.error {
            line["error"] = json!(e);
        }
        if let Some(f) = &self.fields {
            line["fields"] = json!(f);
        }
        line
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Jsonl,
    Csv,
}

impl Format {
    /// From a file name's extension: `.csv` is CSV, anything else JSONL.
    pub fn of_path(path: &std::path::Path) -> Format {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("csv") => Format::Csv,
            _ => Format::Jsonl,
        }
    }
}

/// A bad input, naming the line (JSONL) or row (CSV, 1 is the header) where it is.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("the input is not UTF-8")]
    NotUtf8,
    #[error("line {line}: {message}")]
    Line { line: usize, message: String },
    #[error("the CSV header has no `{0}` column")]
    NoTextColumn(String),
    #[error("the input has no items")]
    Empty,
    #[error("at most {MAX_RECORDS} items per batch")]
    TooMany,
}

pub fn parse(body: &[u8], format: Format, text_column: Option<&str>) -> Result<Vec<Record>, RecordError> {
    let records = match format {
        Format::Jsonl => parse_jsonl(std::str::from_utf8(body).map_err(|_| RecordError::NotUtf8)?)?,
        Format::Csv => parse_csv(body, text_column.unwrap_or("document"))?,
    };
    if records.is_empty() {
        return Err(RecordError::Empty);
    }
    Ok(records)
}

fn parse_jsonl(text: &str) -> Result<Vec<Record>, RecordError> {
    let mut records = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |message: String| RecordError::Line { line: n + 1, message };
        let v: Value = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        let document = v["document"]
            .as_str()
            .ok_or_else(|| bad("no `document` string".into()))?;
        let id = match &v["id"] {
            Value::Null => (n + 1).to_string(),
            Value::String(s) => s.clone(),
            Value::Number(x) => x.to_string(),
            _ => return Err(bad("`id` must be a string or a number".into())),
        };
        records.push(Record {
            id,
            document: document.to_string(),
        });
        if records.len() > MAX_RECORDS {
            return Err(RecordError::TooMany);
        }
    }
    Ok(records)
}

fn parse_csv(body: &[u8], text_column: &str) -> Result<Vec<Record>, RecordError> {
    let mut reader = csv::ReaderBuilder::new().flexible(false).from_reader(body);
    let header = reader.headers().map_err(|e| csv_error(&e, 1))?.clone();
    let find = |name: &str| header.iter().position(|h| h.trim() == name);
    let text = find(text_column).ok_or_else(|| RecordError::NoTextColumn(text_column.to_string()))?;
    let id = find("id");
    let mut records = Vec::new();
    for (n, row) in reader.records().enumerate() {
        let row = row.map_err(|e| csv_error(&e, n + 2))?;
        records.push(Record {
            id: id.map_or_else(|| (n + 1).to_string(), |i| row[i].to_string()),
            document: row[text].to_string(),
        });
        if records.len() > MAX_RECORDS {
            return Err(RecordError::TooMany);
        }
    }
    Ok(records)
}

fn csv_error(e: &csv::Error, row: usize) -> RecordError {
    match e.kind() {
        csv::ErrorKind::Utf8 { .. } => RecordError::NotUtf8,
        _ => RecordError::Line {
            line: e.position().map_or(row, |p| p.line() as usize),
            message: e.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_ids_default_to_line_numbers() {
        let body = b"{\"document\": \"a\"}\n\n{\"id\": 7, \"document\": \"b\"}\n{\"id\": \"x\", \"document\": \"c\"}\n";
        let r = parse(body, Format::Jsonl, None).unwrap();
        let ids: Vec<_> = r.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["1", "7", "x"]);
        assert_eq!(r[2].document, "c");
    }

    #[test]
    fn jsonl_errors_name_the_line() {
        let e = parse(b"{\"document\": \"a\"}\n{\"doc\": 1}\n", Format::Jsonl, None).unwrap_err();
        assert_eq!(e.to_string(), "line 2: no `document` string");
        assert!(matches!(parse(b"\n \n", Format::Jsonl, None), Err(RecordError::Empty)));
    }

    #[test]
    fn csv_reads_quoted_multiline_text_from_the_named_column() {
        let body = b"id,body,other\nr1,\"Line one,\nline \"\"two\"\"\",z\nr2,plain,z\n";
        let r = parse(body, Format::Csv, Some("body")).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].id, "r1");
        assert_eq!(r[0].document, "Line one,\nline \"two\"");
        assert!(matches!(
            parse(body, Format::Csv, None),
            Err(RecordError::NoTextColumn(c)) if c == "document"
        ));
    }

    #[test]
    fn csv_rows_without_id_are_numbered_and_ragged_rows_are_named() {
        let r = parse(b"document\nfirst\nsecond\n", Format::Csv, None).unwrap();
        assert_eq!((r[1].id.as_str(), r[1].document.as_str()), ("2", "second"));
        let e = parse(b"document,x\na,b\nc\n", Format::Csv, None).unwrap_err();
        assert!(matches!(e, RecordError::Line { line: 3, .. }), "{e}");
    }
}
