//! Extraction: the prompt that tells the model the schema and the task (the grammar then
//! guarantees the shape), one extraction over the engine and how it ended, batch input
//! (JSONL, CSV), records as schema-shaped CSV rows, and grounding of values in the document.

mod extractor;
pub mod grounding;
pub mod records;
pub mod table;

pub use extractor::{ExtractError, Extraction, Extractor, Outcome, Task};

use serde_json::Value;

use crate::tokenizer::{ChatMessage, Tokenizer, TokenizerError};

/// The chat prompt of one extraction: the schema and the instructions as the system turn, the
/// document as the user turn (its text can never open a turn of its own: special-token text
/// in it stays plain text).
pub fn prompt(
    tokenizer: &Tokenizer,
    schema: &Value,
    document: &str,
    instructions: Option<&str>,
) -> Result<Vec<u32>, TokenizerError> {
    let mut system = String::from(
        "Extract the data from the user's document as one JSON object matching this JSON Schema. \
         Copy values from the document; use null where the schema allows it and the document says nothing.\n",
    );
    system.push_str(&schema.to_string());
    if let Some(extra) = instructions {
        system.push_str("\n\n");
        system.push_str(extra);
    }
    tokenizer.encode_chat(&[ChatMessage::new("system", &system), ChatMessage::new("user", document)])
}
