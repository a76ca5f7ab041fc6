//! The engine: request state, KV block allocation and the loop that batches requests through
//! the runtime. See shared/design.md, "Engine step".

pub mod block_pool;
pub mod detokenizer;
pub mod generate;
pub mod kv_cache_manager;
pub mod request;
pub mod scheduler;
pub mod stop;

pub use block_pool::{BlockHash, BlockId, BlockPool};
pub use generate::{Completion, FinishReason, GenerateError, GenerateRequest, Generator, Timings};
pub use kv_cache_manager::{KvCacheManager, PrefixCacheStats, RequestId};
pub use request::{Request, RequestStatus};
pub use scheduler::{AdmitError, Policy, Scheduled, Scheduler, SchedulerConfig, SchedulerOutput};
