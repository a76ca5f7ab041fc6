//! The service every door into Quarry goes through, below HTTP: `/extract`, the OpenAI
//! endpoints, job items and batch lines all admit, submit and count here, and get typed results
//! and typed errors (one table of kinds and statuses, which the server and the OpenAPI spec
//! read). Nothing here knows axum; the server maps `ServiceError` to responses.

pub mod admission;
pub mod api;
pub mod error;
mod extract;

pub use extract::MAX_MAX_TOKENS;
pub mod metrics;
pub mod openai;
pub mod schemas;

use std::sync::Arc;

pub use admission::Admission;
pub use error::{ErrorKind, ServiceError};

use serde_json::Value;

use crate::engine::{EngineRequest, RequestMetrics, RequestStream};
use crate::extract::{Extractor, Task};

/// Which API a request came through, as the metrics label it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Extract,
    ChatCompletions,
    Completions,
}

impl Endpoint {
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Extract => "extract",
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
        }
    }
}

/// The model's extractor and engine client, the schema registry, admission and metrics.
pub struct Service {
    /// The model's name, as requests name it (`model`) and responses report it.
    pub model: String,
    /// The device it runs on.
    pub device: String,
    pub extractor: Arc<Extractor>,
    pub schemas: schemas::SchemaRegistry,
    pub metrics: metrics::Metrics,
    admission: Admission,
}

impl Service {
    pub fn new(
        model: String,
        device: String,
        extractor: Arc<Extractor>,
        schemas: schemas::SchemaRegistry,
        max_pending: usize,
    ) -> Self {
        let mut metrics = metrics::Metrics::default();
        metrics.register_device(&device);
        Service {
            model,
            device,
            extractor,
            schemas,
            metrics,
            admission: Admission::new(max_pending),
        }
    }

    /// Compiles `schema` as an extraction with the default options would, off the async
    /// threads, so that the first extraction finds it cached; its keyword report.
    pub async fn preflight(&self, schema: &Value, strict: bool) -> Result<Vec<api::KeywordEntry>, ServiceError> {
        let constraint = Task {
            strict,
            ..Task::new(schema.clone(), String::new())
        }
        .constraint();
        let extractor = self.extractor.clone();
        let compiled = tokio::task::spawn_blocking(move || extractor.structured.compile(&constraint))
            .await
            .map_err(|e| ServiceError::internal(e.to_string()))?
            .map_err(ServiceError::schema_rejected)?;
        Ok(compiled
            .report()
            .map(api::KeywordEntry::from_report)
            .unwrap_or_default())
    }

    /// Engine requests admitted and not finished.
    pub fn pending(&self) -> usize {
        self.admission.pending()
    }

    /// Admits the requests together (all or none), then hands them to the engine; each stream
    /// holds its request's permit.
    pub async fn submit(&self, requests: Vec<EngineRequest>) -> Result<Vec<RequestStream>, ServiceError> {
        let mut permits = self.admission.admit(requests.len())?;
        let mut streams = Vec::with_capacity(requests.len());
        for request in requests {
            let stream = self
                .extractor
                .client
                .submit(request)
                .await
                .map_err(ServiceError::refusal)?;
            let permit = permits.split(1).expect("a permit was taken for each request");
            streams.push(stream.hold(permit));
        }
        Ok(streams)
    }

    /// One engine request that ended: its times and tokens.
    pub fn observe(&self, metrics: &RequestMetrics, completion_tokens: usize) {
        self.metrics.observe(metrics, completion_tokens);
    }

    /// One API request that ended: `ok`, another outcome, or the error kind it was refused with.
    pub fn count(&self, endpoint: Endpoint, outcome: &str) {
        self.metrics.outcome(endpoint.label(), outcome);
    }
}
