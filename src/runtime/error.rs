use std::path::PathBuf;

/// Everything that can go wrong loading or running a model, typed so that the CLI and the
/// server can say exactly what is wrong instead of panicking.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("model file not found: {0} (run scripts/fetch-model for the default model)")]
    ModelNotFound(PathBuf),
    #[error("cannot read model file {path}: {reason}")]
    CorruptModel { path: PathBuf, reason: String },
    #[error("unsupported model architecture `{0}` (supported: llama, qwen2)")]
    UnsupportedArchitecture(String),
    #[error("model metadata key `{key}`: {reason}")]
    BadMetadata { key: String, reason: String },
    #[error("tensor `{name}`: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("invalid forward batch: {0}")]
    InvalidBatch(String),
    #[error("backend failure: {0}")]
    Backend(String),
    #[error("GPU: {0}")]
    Device(String),
}

impl From<candle_core::Error> for RuntimeError {
    fn from(e: candle_core::Error) -> Self {
        RuntimeError::Backend(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, RuntimeError>;
