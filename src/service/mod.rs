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

use crate::engine::{EngineRequest, EngineStats, RequestMetrics, RequestStream};
use crate::extract::Extractor;
use crate::tokenizer::Tokenizer;

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

/// `attempt` again while the queue is full of other traffic: job items and batch lines wait
/// rather than report it.
async fn until_admitted<T, F, Fut>(mut attempt: F) -> Result<T, ServiceError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ServiceError>>,
{
    loop {
        match attempt().await {
            Err(e) if e.kind == ErrorKind::QueueFull => tokio::time::sleep(std::time::Duration::from_millis(200)).await,
            result => return result,
        }
    }
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

    /// The engine's queue, running requests, KV blocks and counters, now.
    pub fn stats(&self) -> EngineStats {
        self.extractor.client.stats()
    }

    /// Whether a request's record is the same whatever else runs beside it
    /// (`EngineClient::batch_invariant`).
    pub fn batch_invariant(&self) -> bool {
        self.extractor.client.batch_invariant()
    }

    /// The model's tokenizer (for what responses show of tokens: log-probabilities).
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.extractor.tokenizer
    }

    /// Stops the engine once the requests in it end (blocking).
    pub fn shutdown(&self) {
        self.extractor.client.shutdown();
    }

    /// The metrics' text, with the engine's gauges read now.
    pub fn render_metrics(&self) -> String {
        let client = &self.extractor.client;
        self.metrics
            .render(&self.stats(), &client.loads(), client.placed().as_deref())
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// Every `.rs` file under `dir`, with its text.
    fn sources(dir: &Path, out: &mut Vec<(String, String)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push((path.display().to_string(), std::fs::read_to_string(&path).unwrap()));
            }
        }
    }

    /// The doors (the server's handlers, job and batch runners, the CLI) reach the engine only
    /// through the service: none of them touches the extractor or the engine client. The
    /// benchmarks under cli/bench measure the engine below the service and may; the CLI's
    /// composition roots build the extractor they hand to the service.
    #[test]
    fn no_door_reaches_past_the_service() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        for door in ["server", "jobs", "cli"] {
            sources(&root.join(door), &mut files);
        }
        // Each file's code without comments or whitespace, so a chain split over lines counts.
        let reach = ["extractor.", "client.submit(", ".structured.compile("];
        let mut found = Vec::new();
        for (path, text) in &files {
            if path.contains("/cli/bench/") {
                continue;
            }
            let code: String = text
                .lines()
                .map(|l| l.split("//").next().unwrap_or_default())
                .collect::<String>()
                .chars()
                .filter(|c| !c.is_whitespace())
                .collect();
            for r in reach {
                let starts_word = |at: usize| {
                    at == 0 || !code.as_bytes()[at - 1].is_ascii_alphanumeric() && code.as_bytes()[at - 1] != b'_'
                };
                if code
                    .match_indices(r)
                    .any(|(at, _)| r.starts_with('.') || starts_word(at))
                {
                    found.push(format!("{path}: {r}"));
                }
            }
        }
        assert!(files.len() > 20, "read {} files", files.len());
        assert!(
            found.is_empty(),
            "doors that reach past the service:\n{}",
            found.join("\n")
        );
    }
}
