//! Quarry: schema-first structured extraction over a paged, continuously batched LLM engine.
//! See shared/design.md for how the modules fit together.

pub mod cli;
pub mod engine;
pub mod extract;
pub mod jobs;
pub mod logging;
pub mod model_path;
pub mod runtime;
pub mod sampling;
pub mod server;
pub mod service;
pub mod tokenizer;
