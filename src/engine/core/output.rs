//! The output processor: one place where what the model produced becomes request state. Each
//! kept token is detokenized, checked against stop strings, end-of-generation and the budget,
//! counted, and returned as the step's output of its request; the request finishes there.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::{EngineCore, State};
use crate::engine::kv_cache_manager::RequestId;
use crate::engine::speculation::DraftCounts;
use crate::engine::stop::StopScan;
use crate::sampling::SampledToken;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token, a stop token or string, or the constraint completed.
    Stop,
    /// `max_tokens` reached, or the context is full: the output may be cut short.
    Length,
    /// The client went away or asked to stop.
    Aborted,
    /// The grammar refused a token its own mask allowed: a bug, reported rather than hidden.
    Internal,
}

/// Per-request times and counts, reported with the last output.
#[derive(Debug, Clone, Default)]
pub struct RequestMetrics {
    pub queue: Duration,
    pub ttft: Duration,
    /// Time between consecutive tokens, one entry per token after the first.
    pub itl: Vec<Duration>,
    pub e2e: Duration,
    pub prompt_tokens: usize,
    /// The prompt of the request's twin (context-aware decoding), which the request's cache
    /// holds beside its own; 0 without one.
    pub twin_prompt_tokens: usize,
    pub cached_tokens: usize,
    pub output_tokens: usize,
    /// Output tokens the grammar decided alone, appended without sampling (jump-forward).
    pub forced_tokens: usize,
    pub preemptions: usize,
    /// The token budget overruled the model at least once: it wanted a token after which the
    /// constrained output could no longer close within `max_tokens`, so a string or an array
    /// may have been cut short.
    pub budget_closed: bool,
    /// The grammar panicked under this request (it ended `Internal`); the panic's message.
    pub grammar_failure: Option<String>,
    /// Speculative decoding's drafts checked and kept, per proposer.
    pub drafts: DraftCounts,
}

/// What one step produced for one request.
#[derive(Debug, Clone)]
pub struct RequestOutput {
    pub id: RequestId,
    pub tokens: Vec<SampledToken>,
    /// New text, held back while it may still become a stop string.
    pub text: String,
    pub finished: Option<FinishReason>,
    pub stop_string: Option<String>,
    /// With the last output.
    pub metrics: Option<RequestMetrics>,
}

/// A finished request, as `run_until_idle` collects it.
#[derive(Debug, Clone)]
pub struct Completion {
    pub id: RequestId,
    pub tokens: Vec<u32>,
    pub sampled: Vec<SampledToken>,
    pub text: String,
    pub finish: FinishReason,
    pub stop_string: Option<String>,
    pub metrics: RequestMetrics,
}

/// Gathers streamed outputs into completions.
#[derive(Default)]
pub struct Completions {
    open: HashMap<RequestId, Completion>,
    /// In the order they finished.
    pub done: Vec<Completion>,
}

impl Completions {
    pub fn push(&mut self, out: &RequestOutput) {
        let c = self.open.entry(out.id).or_insert_with(|| Completion {
            id: out.id,
            tokens: Vec::new(),
            sampled: Vec::new(),
            text: String::new(),
            finish: FinishReason::Length,
            stop_string: None,
            metrics: RequestMetrics::default(),
        });
        c.tokens.extend(out.tokens.iter().map(|t| t.token));
        c.sampled.extend(out.tokens.iter().cloned());
        c.text.push_str(&out.text);
        if let Some(f) = out.finished {
            let mut c = self.open.remove(&out.id).expect("just inserted");
            c.finish = f;
            c.stop_string = out.stop_string.clone();
            c.metrics = out.metrics.clone().unwrap_or_default();
            self.done.push(c);
        }
    }
}

impl EngineCore {
    /// Records a sampled token, `after` tokens before the end of the request's output (a run
    /// joins the output at once); finishes the request when it is done.
    pub(super) fn accept(&mut self, id: RequestId, sampled: SampledToken, after: usize) -> Option<RequestOutput> {
        let token = sampled.token;
        let limit = self.scheduler.token_limit();
        let (r, state) = self.scheduler.get_mut(id)?;
        let (num_tokens, output_len, preemptions) = (r.num_tokens() - after, r.output.len() - after, r.num_preemptions);
        if !sampled.forced {
            let now = Instant::now();
            match state.last_token_at {
                None => state.metrics.ttft = now - state.arrived,
                Some(t) => state.metrics.itl.push(now - t),
            }
            state.last_token_at = Some(now);
        } else {
            state.metrics.forced_tokens += 1;
        }
        let params = state.sampler.params();
        let eog = self.tokenizer.end_of_generation_ids().contains(&token);
        let mut finish = None;
        if let Some(m) = state.matcher.as_mut() {
            // The mask allowed it, so the matcher takes it; EOS is allowed only where the
            // constraint is complete.
            if m.accept(token).is_err() {
                finish = Some(FinishReason::Internal);
                state.metrics.grammar_failure = m.failure().map(str::to_string);
            } else if m.is_finished() {
                finish = Some(FinishReason::Stop);
            }
        } else if (eog && !params.ignore_eos) || params.stop_token_ids.contains(&token) {
            finish = Some(FinishReason::Stop);
        }
        let delta = state.detokenizer.push(&self.tokenizer, token).unwrap_or_default();
        let mut stop_string = None;
        let mut text = match state.stops.push(&delta) {
            StopScan::Continue(t) => t,
            StopScan::Stopped(t, stop) => {
                stop_string = Some(stop);
                finish = Some(FinishReason::Stop);
                t
            }
        };
        if finish.is_none() && (output_len >= params.max_tokens || num_tokens >= limit) {
            // A constrained output that is complete here has ended: its end-of-output token
            // would only have been the budget's last.
            let complete = state.matcher.as_mut().is_some_and(|m| m.can_finish());
            finish = Some(if complete {
                FinishReason::Stop
            } else {
                FinishReason::Length
            });
        }
        let Some(reason) = finish else {
            return Some(RequestOutput {
                id,
                tokens: vec![sampled],
                text,
                finished: None,
                stop_string: None,
                metrics: None,
            });
        };
        if stop_string.is_none() {
            text.push_str(&state.stops.flush());
        }
        let (_, state) = self.finish(id)?;
        let mut out = self.final_output(id, state, preemptions, reason, text, stop_string);
        out.tokens = vec![sampled];
        Some(out)
    }

    pub(super) fn final_output(
        &self,
        id: RequestId,
        state: State,
        preemptions: usize,
        reason: FinishReason,
        text: String,
        stop_string: Option<String>,
    ) -> RequestOutput {
        let mut metrics = state.metrics;
        metrics.e2e = state.arrived.elapsed();
        metrics.output_tokens = state.detokenizer.len();
        metrics.preemptions = preemptions;
        RequestOutput {
            id,
            tokens: Vec::new(),
            text,
            finished: Some(reason),
            stop_string,
            metrics: Some(metrics),
        }
    }
}

/// Appends one accepted token's output to a step's output of the same request.
pub(super) fn merge(out: &mut Option<RequestOutput>, next: RequestOutput) {
    match out {
        None => *out = Some(next),
        Some(out) => {
            out.tokens.extend(next.tokens);
            out.text.push_str(&next.text);
            (out.finished, out.stop_string, out.metrics) = (next.finished, next.stop_string, next.metrics);
        }
    }
}
