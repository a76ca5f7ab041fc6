//! The service's metrics, in the Prometheus text format (prometheus-client): latency histograms
//! (queue, TTFT, ITL, end to end), tokens (rate() gives tokens/s), request outcomes by
//! endpoint and type, and gauges read from the engine at scrape time (queue depth, running requests, KV
//! usage, prefix-cache hit rate, preemptions).

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::engine::{EngineStats, RequestMetrics};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `extract`, `chat_completions` or `completions` (job items and batch lines count under
    /// the endpoint they run).
    pub endpoint: &'static str,
    pub outcome: String,
}

/// Which of the engines serving the model (data parallelism) a gauge is for: its index.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineLabel {
    pub engine: String,
}

/// Which speculative-decoding proposer a draft count is for.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProposerLabel {
    pub proposer: &'static str,
}

pub struct Metrics {
    registry: Registry,
    queue: Histogram,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    prompt_tokens: Counter,
    cached_tokens: Counter,
    completion_tokens: Counter,
    outcomes: Family<OutcomeLabel, Counter>,
    budget_closed: Counter,
    grammar_failures: Counter,
    draft_tokens: Family<ProposerLabel, Counter>,
    accepted_draft_tokens: Family<ProposerLabel, Counter>,
    draft_checks: Counter,
    waiting: Gauge,
    running: Gauge,
    kv_usage: Gauge<f64, AtomicU64>,
    prefix_hit_rate: Gauge<f64, AtomicU64>,
    preemptions: Gauge,
    draft_model_failures: Gauge,
    logits_rows_copied: Gauge,
    graph_steps: Gauge,
    pipelined_steps: Gauge,
    engine_requests: Family<EngineLabel, Gauge>,
    engine_requests_placed: Family<EngineLabel, Counter>,
}

impl Metrics {
    /// `quarry_device_info{device="..."} 1`: which device serves, for dashboards.
    pub fn register_device(&mut self, device: &str) {
        let info = prometheus_client::metrics::info::Info::new(vec![("device".to_string(), device.to_string())]);
        self.registry.register("device", "The device the model runs on", info);
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let seconds = || Histogram::new(exponential_buckets(0.001, 2.0, 18));
        let mut m = Metrics {
            registry: Registry::with_prefix("quarry"),
            queue: seconds(),
            ttft: seconds(),
            itl: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            e2e: seconds(),
            prompt_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            outcomes: Family::default(),
            budget_closed: Counter::default(),
            grammar_failures: Counter::default(),
            draft_tokens: Family::default(),
            accepted_draft_tokens: Family::default(),
            draft_checks: Counter::default(),
            waiting: Gauge::default(),
            running: Gauge::default(),
            kv_usage: Gauge::default(),
            prefix_hit_rate: Gauge::default(),
            preemptions: Gauge::default(),
            draft_model_failures: Gauge::default(),
            logits_rows_copied: Gauge::default(),
            graph_steps: Gauge::default(),
            pipelined_steps: Gauge::default(),
            engine_requests: Family::default(),
            engine_requests_placed: Family::default(),
        };
        let r = &mut m.registry;
        r.register(
            "queue_seconds",
            "Time from arrival to first scheduling",
            m.queue.clone(),
        );
        r.register("time_to_first_token_seconds", "Time to first token", m.ttft.clone());
        r.register(
            "inter_token_latency_seconds",
            "Time between output tokens",
            m.itl.clone(),
        );
        r.register("request_seconds", "End-to-end request time", m.e2e.clone());
        r.register(
            "prompt_tokens",
            "Prompt tokens of finished requests",
            m.prompt_tokens.clone(),
        );
        r.register(
            "cached_prompt_tokens",
            "Prompt tokens found in the prefix cache",
            m.cached_tokens.clone(),
        );
        r.register("completion_tokens", "Output tokens", m.completion_tokens.clone());
        r.register(
            "requests",
            "API requests by endpoint and outcome (`ok`, `truncated`, `schema_violation`, ...) or error type",
            m.outcomes.clone(),
        );
        r.register(
            "budget_closed",
            "Constrained outputs the token budget closed early (the model would have run past max_tokens)",
            m.budget_closed.clone(),
        );
        r.register(
            "grammar_failures",
            "Requests ended internal because the grammar failed under them (the others went on)",
            m.grammar_failures.clone(),
        );
        r.register(
            "spec_draft_tokens",
            "Speculative decoding: draft tokens the model checked, by proposer",
            m.draft_tokens.clone(),
        );
        r.register(
            "spec_accepted_tokens",
            "Speculative decoding: draft tokens the model agreed with and kept, by proposer",
            m.accepted_draft_tokens.clone(),
        );
        r.register(
            "spec_checks",
            "Speculative decoding: request steps that checked drafts (accepted tokens / checks is the mean accepted length)",
            m.draft_checks.clone(),
        );
        r.register(
            "waiting_requests",
            "Requests waiting to be scheduled",
            m.waiting.clone(),
        );
        r.register("running_requests", "Requests running", m.running.clone());
        r.register("kv_cache_usage_ratio", "Share of KV blocks in use", m.kv_usage.clone());
        r.register(
            "prefix_cache_hit_ratio",
            "Prompt tokens found in the prefix cache, of those looked up",
            m.prefix_hit_rate.clone(),
        );
        r.register("preemptions", "Requests preempted so far", m.preemptions.clone());
        r.register(
            "spec_draft_model_failures",
            "Speculative decoding: draft-model passes that failed (the draft model is then dropped; requests go on without it)",
            m.draft_model_failures.clone(),
        );
        r.register(
            "logits_rows_copied",
            "Full rows of logits copied from the GPU to the host, for the engine to draw them itself (none on the default paths)",
            m.logits_rows_copied.clone(),
        );
        r.register(
            "graph_steps",
            "Forward passes replayed from CUDA graphs (the others ran kernel by kernel)",
            m.graph_steps.clone(),
        );
        r.register(
            "pipelined_steps",
            "Steps planned and queued before the step before them was read (--async-scheduling)",
            m.pipelined_steps.clone(),
        );
        r.register(
            "engine_requests",
            "Requests placed on each engine serving the model (--data-parallel-size) and not ended",
            m.engine_requests.clone(),
        );
        r.register(
            "engine_requests_placed",
            "Requests placed on each engine serving the model (--data-parallel-size, or the decode engines of --decode-device) so far",
            m.engine_requests_placed.clone(),
        );
        m
    }
}

impl Metrics {
    /// A finished request's times and token counts.
    pub fn observe(&self, m: &RequestMetrics, completion_tokens: usize) {
        self.queue.observe(m.queue.as_secs_f64());
        self.ttft.observe(m.ttft.as_secs_f64());
        for d in &m.itl {
            self.itl.observe(d.as_secs_f64());
        }
        self.e2e.observe(m.e2e.as_secs_f64());
        self.prompt_tokens.inc_by(m.prompt_tokens as u64);
        self.cached_tokens.inc_by(m.cached_tokens as u64);
        self.completion_tokens.inc_by(completion_tokens as u64);
        if m.budget_closed {
            self.budget_closed.inc();
        }
        if m.grammar_failure.is_some() {
            self.grammar_failures.inc();
        }
        let d = &m.drafts;
        for (proposer, proposed, kept) in [
            ("ngram", d.ngram_proposed, d.ngram_accepted),
            ("grammar", d.grammar_proposed, d.grammar_accepted),
            ("model", d.model_proposed, d.model_accepted),
        ] {
            let label = ProposerLabel { proposer };
            self.draft_tokens.get_or_create(&label).inc_by(proposed as u64);
            self.accepted_draft_tokens.get_or_create(&label).inc_by(kept as u64);
        }
        self.draft_checks.inc_by(d.checks as u64);
    }

    pub fn outcome(&self, endpoint: &'static str, outcome: &str) {
        self.outcomes
            .get_or_create(&OutcomeLabel {
                endpoint,
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// The text of every metric, with the gauges read from the engines' `stats` (summed) and
    /// `loads` (each engine's requests) now, and `placed` (requests given to each engine so
    /// far, where several serve).
    pub fn render(&self, stats: &EngineStats, loads: &[usize], placed: Option<&[u64]>) -> String {
        for (i, &load) in loads.iter().enumerate() {
            let label = EngineLabel { engine: i.to_string() };
            self.engine_requests.get_or_create(&label).set(load as i64);
        }
        for (i, &n) in placed.unwrap_or_default().iter().enumerate() {
            let label = EngineLabel { engine: i.to_string() };
            let counter = self.engine_requests_placed.get_or_create(&label);
            counter.inc_by(n.saturating_sub(counter.get()));
        }
        self.waiting.set(stats.waiting as i64);
        self.running.set(stats.running as i64);
        let used = stats.kv_blocks_total.saturating_sub(stats.kv_blocks_free);
        self.kv_usage.set(used as f64 / stats.kv_blocks_total.max(1) as f64);
        self.prefix_hit_rate.set(stats.prefix_cache.hit_rate());
        self.preemptions.set(stats.preemptions as i64);
        self.draft_model_failures.set(stats.draft_model_failures as i64);
        self.logits_rows_copied.set(stats.logits_rows_copied as i64);
        self.graph_steps.set(stats.graph_steps as i64);
        self.pipelined_steps.set(stats.pipelined_steps as i64);
        let mut text = String::new();
        let _ = encode(&mut text, &self.registry);
        text
    }
}
