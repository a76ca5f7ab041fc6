//! The engine: request state, KV block allocation and the loop that batches requests through
//! the runtime. See shared/design.md, "Engine step".

pub mod block_pool;
pub mod client;
mod contained;
pub mod contrast;
pub mod core;
pub mod detokenizer;
pub mod disaggregated;
pub mod kv_cache_manager;
mod placement;
pub mod proposers;
pub mod request;
pub mod scheduler;
pub mod speculation;
pub mod stop;
pub mod structured;

pub use block_pool::{BlockHash, BlockId, BlockPool};
pub use client::{EngineClient, EngineStats, RequestStream, SubmitError};
pub use core::{
    AddError, AsyncScheduling, Completion, Completions, EngineConfig, EngineCore, EngineRequest, FinishReason,
    RequestMetrics, RequestOutput,
};
pub use disaggregated::KvLink;
pub use kv_cache_manager::{BlockHasher, KvCacheManager, PrefixCacheStats, RequestId};
pub use request::{Request, RequestStatus};
pub use scheduler::{AdmitError, Policy, Scheduled, Scheduler, SchedulerConfig, SchedulerOutput};
pub use speculation::{DraftCounts, Proposer, SpeculativeConfig};
pub use structured::{CompiledConstraint, Constraint, StructuredOutputs};
