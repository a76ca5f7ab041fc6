//! The chat prompt of one extraction. The grammar guarantees the record's shape, so the prompt
//! is there for the meaning: which field wants which value. Its layout (where the schema and
//! the document sit, whether the schema is shown as JSON or as a list of fields) is a choice
//! measured by `quarry bench quality`.

use serde_json::Value;

use crate::tokenizer::{ChatMessage, Tokenizer, TokenizerError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PromptLayout {
    /// The task and the schema as JSON in the system turn, the document as the user turn.
    #[default]
    SchemaFirst,
    /// The task in the system turn; the document, then the schema as JSON, in the user turn
    /// (the schema nearest the answer).
    DocumentFirst,
    /// The task in the system turn; the document, then the fields the record has (path,
    /// type, description) as a list, in the user turn.
    Fields,
    /// `Fields`, after one worked example of the task (an invented memo, its fields and its
    /// record) as an earlier user and assistant turn: copying, numbers without their
    /// symbols, null for what the document does not say.
    FieldsExample,
}

const TASK: &str = "Extract the data from the user's document as one JSON object matching this JSON Schema. \
                    Copy values from the document; use null where the schema allows it and the document says nothing.";

const TASK_FIELDS: &str = "You extract data from documents into JSON. Give every field its value as the document \
                           states it: copy names, numbers and dates from the text. Use null where the document does \
                           not say.";

/// The worked example of `FieldsExample`: nothing in it comes from any evaluation set.
const EXAMPLE_DOCUMENT: &str = "Hi all, the kickoff for Project Falcon is on 2024-05-02 at 10:30 in room 4B. \
                                Maria Lopez leads it. Budget approved: $12,500.";
const EXAMPLE_FIELDS: &str = "- project (string)\n- date (string, date)\n- time (string): HH:MM\n- room (string)\n\
                              - lead (string)\n- budget_usd (number)\n- catering (boolean or null)\n";
const EXAMPLE_RECORD: &str = r#"{"project": "Falcon", "date": "2024-05-02", "time": "10:30", "room": "4B", "lead": "Maria Lopez", "budget_usd": 12500, "catering": null}"#;

/// The document can never open a turn of its own: special-token text in it stays plain text
/// (see `Tokenizer::encode_chat`).
pub fn prompt(
    tokenizer: &Tokenizer,
    layout: PromptLayout,
    schema: &Value,
    document: &str,
    instructions: Option<&str>,
) -> Result<Vec<u32>, TokenizerError> {
    let extra = instructions.map(|i| format!("\n\n{i}")).unwrap_or_default();
    let (system, user) = match layout {
        PromptLayout::SchemaFirst => (format!("{TASK}\n{schema}{extra}"), document.to_string()),
        PromptLayout::DocumentFirst => (
            format!("{TASK}{extra}"),
            format!("Document:\n{document}\n\nJSON Schema:\n{schema}"),
        ),
        PromptLayout::Fields | PromptLayout::FieldsExample => {
            let mut fields = String::new();
            describe(schema, 0, &mut fields);
            (
                format!("{TASK_FIELDS}{extra}"),
                format!("Document:\n{document}\n\nFields:\n{fields}"),
            )
        }
    };
    let mut messages = vec![ChatMessage::new("system", &system)];
    if layout == PromptLayout::FieldsExample {
        messages.push(ChatMessage::new(
            "user",
            &format!("Document:\n{EXAMPLE_DOCUMENT}\n\nFields:\n{EXAMPLE_FIELDS}"),
        ));
        messages.push(ChatMessage::new("assistant", EXAMPLE_RECORD));
    }
    messages.push(ChatMessage::new("user", &user));
    tokenizer.encode_chat(&messages)
}

/// One line per property: `- name (type): description`, nested properties indented under
/// their object or array.
fn describe(schema: &Value, depth: usize, out: &mut String) {
    let Some(props) = schema.get("properties").and_then(Value::as_object) else {
        if let Some(items) = schema.get("items") {
            describe(items, depth, out);
        }
        return;
    };
    for (key, sub) in props {
        out.push_str(&"  ".repeat(depth));
        out.push_str(&format!("- {key} ({})", kind(sub)));
        if let Some(d) = sub.get("description").and_then(Value::as_str) {
            out.push_str(": ");
            out.push_str(d);
        }
        out.push('\n');
        let inner = sub.get("items").unwrap_or(sub);
        describe(inner, depth + 1, out);
    }
}

/// A short type phrase: `string, date`, `integer or null`, `one of "a", "b"`, `list of objects`.
fn kind(schema: &Value) -> String {
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        let list: Vec<String> = values.iter().map(Value::to_string).collect();
        return format!("one of {}", list.join(", "));
    }
    let types: Vec<String> = match schema.get("type") {
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(ts)) => ts.iter().filter_map(|t| t.as_str().map(str::to_string)).collect(),
        _ => vec!["value".into()],
    };
    let mut phrase: Vec<String> = types
        .iter()
        .map(|t| match (t.as_str(), schema.get("items")) {
            ("array", Some(items)) => format!("list of {}", kind(items)),
            ("array", None) => "list".into(),
            (t, _) => t.to_string(),
        })
        .collect();
    if let Some(f) = schema.get("format").and_then(Value::as_str) {
        phrase[0] = format!("{}, {f}", phrase[0]);
    }
    if let Some(p) = schema.get("pattern").and_then(Value::as_str) {
        phrase[0] = format!("{}, matching {p}", phrase[0]);
    }
    phrase.join(" or ")
}
