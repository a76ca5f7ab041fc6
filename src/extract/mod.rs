//! Extraction: the prompt that tells the model the schema and the task (the grammar then
//! guarantees the shape), one extraction over the engine and how it ended, batch input
//! (JSONL, CSV), records as schema-shaped CSV rows, and grounding of values in the document.

pub mod confidence;
mod extractor;
pub mod grounding;
mod prompt;
pub mod records;
pub mod spelling;
pub mod table;
pub mod validate;

pub use extractor::{
    ExtractError, Extraction, Extractor, FieldConfidence, FieldReport, Outcome, Task, PRETTY, RETRY_TEMPERATURE,
};

pub use prompt::{prompt, PromptLayout};

/// An object key as a JSON pointer's reference token (RFC 6901: `~` as `~0`, `/` as `~1`).
pub fn pointer_token(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}
