//! The model runtime: one `Backend` interface over a paged KV cache, with a CPU implementation
//! (candle, quantized GGUF) and, later, a CUDA one. Nothing here decides who runs; it computes
//! the batch it is given.

pub mod batch;
pub mod config;
pub mod cpu;
pub mod error;
pub mod gguf;

pub use batch::{ForwardBatch, KvLayout, Logits};
pub use config::{Architecture, ModelConfig};
pub use error::{Result, RuntimeError};

/// A model that can run one flattened, paged batch. Prefill chunks and decode tokens of
/// different sequences may be mixed freely in one call.
pub trait Backend: Send {
    fn config(&self) -> &ModelConfig;

    fn kv_layout(&self) -> KvLayout;

    /// Runs the batch, writing each query token's K and V into its slot, and returns the
    /// logits of `batch.logits_rows`.
    fn forward(&mut self, batch: &ForwardBatch) -> Result<Logits>;

    /// A short human-readable name of the device, for logs and benchmarks.
    fn device_name(&self) -> String;
}
