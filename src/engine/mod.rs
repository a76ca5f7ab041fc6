//! The engine: request state, KV block allocation and the loop that batches requests through
//! the runtime. See shared/design.md, "Engine step".

pub mod block_pool;
pub mod detokenizer;
pub mod generate;
pub mod stop;

pub use block_pool::BlockPool;
pub use generate::{Completion, FinishReason, GenerateError, GenerateRequest, Generator, Timings};
