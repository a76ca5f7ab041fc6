//! Where the default model lives: `models/` of the checkout, as scripts/fetch-model puts it.

use std::path::PathBuf;

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$QUARRY_MODEL`, else `./models/<default>` if present, else the checkout's `models/`.
pub fn default_model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("QUARRY_MODEL") {
        return PathBuf::from(p);
    }
    let local = PathBuf::from("models").join(DEFAULT_MODEL_FILE);
    if local.is_file() {
        return local;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(DEFAULT_MODEL_FILE)
}
