//! The engine step (shared/design.md): schedule, run the model on one flattened batch,
//! constrain and sample the requests that reached their last known token, update, emit. The
//! grammar masks of the step are filled on worker threads while the forward pass runs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use quarry_grammar::{bitmask_words, is_allowed};

use super::client::EngineStats;
use super::contained::ContainedMatcher;
use super::detokenizer::Detokenizer;
use super::kv_cache_manager::{KvCacheManager, RequestId};
use super::scheduler::{AdmitError, Scheduled, Scheduler, SchedulerConfig};
use super::stop::{StopScan, StopStrings};
use super::structured::CompiledConstraint;
use super::BlockPool;
use crate::runtime::{Backend, Draw, ForwardBatch, RowLogprobs, RowRequest, RuntimeError};
use crate::sampling::{DeviceDraw, SampledToken, Sampler, SamplingParamError, SamplingParams, TopLogprob};
use crate::tokenizer::Tokenizer;

/// What a client asks of the engine.
pub struct EngineRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Lower runs first under the priority policy.
    pub priority: i32,
    pub constraint: Option<CompiledConstraint>,
}

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

#[derive(Debug, thiserror::Error)]
pub enum AddError {
    #[error(transparent)]
    Admit(#[from] AdmitError),
    #[error(transparent)]
    BadParams(#[from] SamplingParamError),
    /// The constraint's shortest output is longer than `max_tokens` (or what the context
    /// leaves after the prompt) allows: `minimum` is its length in bytes, which as many tokens
    /// always hold.
    #[error("at most {max_tokens} tokens fit, but the shortest output the constraint allows is {minimum} bytes, which takes up to {minimum} tokens")]
    MaxTokensTooSmall { max_tokens: usize, minimum: usize },
    /// The constraint admits no output at all (a schema no value satisfies).
    #[error("the constraint admits no output at all")]
    NoValidOutput,
}

/// A completion cost this large means no output can complete (the grammar's infinity).
const NO_OUTPUT: usize = 1 << 60;

#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    pub prefix_caching: bool,
    /// Append the tokens a constraint forces without sampling them (jump-forward decoding).
    pub jump_forward: bool,
    /// Separates prefix caches of different models (a hash of the model file's name).
    pub cache_key: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            scheduler: SchedulerConfig {
                max_num_batched_tokens: 2048,
                max_num_seqs: 128,
                policy: super::scheduler::Policy::Fcfs,
                // Clamped to the model's context.
                max_model_len: usize::MAX,
            },
            prefix_caching: true,
            jump_forward: true,
            cache_key: 0,
        }
    }
}

struct State {
    sampler: Sampler,
    matcher: Option<ContainedMatcher>,
    detokenizer: Detokenizer,
    stops: StopStrings,
    arrived: Instant,
    scheduled_at: Option<Instant>,
    last_token_at: Option<Instant>,
    metrics: RequestMetrics,
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

pub struct EngineCore {
    backend: Box<dyn Backend>,
    tokenizer: Arc<Tokenizer>,
    scheduler: Scheduler,
    states: HashMap<RequestId, State>,
    /// Forward passes run.
    steps: u64,
    jump_forward: bool,
    /// Per list of DRY sequence breakers, which tokens hold one (by token id).
    dry_breakers: HashMap<Vec<String>, Arc<[bool]>>,
}

impl EngineCore {
    pub fn new(backend: Box<dyn Backend>, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Self {
        let pool = BlockPool::new(backend.kv_layout().num_blocks);
        Self::with_pool(backend, tokenizer, config, pool)
    }

    /// With a given pool of the backend's blocks (tests scatter the free order).
    pub fn with_pool(
        backend: Box<dyn Backend>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
        pool: BlockPool,
    ) -> Self {
        let layout = backend.kv_layout();
        let kv = KvCacheManager::new(pool, layout.block_size, config.cache_key, config.prefix_caching);
        let scheduler_config = SchedulerConfig {
            max_model_len: config.scheduler.max_model_len.min(backend.config().context_length),
            ..config.scheduler
        };
        EngineCore {
            backend,
            tokenizer,
            scheduler: Scheduler::new(scheduler_config, kv),
            states: HashMap::new(),
            steps: 0,
            jump_forward: config.jump_forward,
            dry_breakers: HashMap::new(),
        }
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    pub fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    /// Gives the backend back (its cache contents are then meaningless to anyone else).
    pub fn into_backend(self) -> Box<dyn Backend> {
        self.backend
    }

    /// Steps until every request has finished, passing each output to `on_output`; returns
    /// the completions by request id.
    pub fn run_until_idle(
        &mut self,
        mut on_output: impl FnMut(&RequestOutput),
    ) -> Result<Vec<Completion>, RuntimeError> {
        let mut all = Completions::default();
        while self.has_unfinished() {
            for out in self.step()? {
                on_output(&out);
                all.push(&out);
            }
        }
        let mut done = all.done;
        done.sort_by_key(|c| c.id);
        Ok(done)
    }

    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished()
    }

    pub fn add_request(&mut self, r: EngineRequest) -> Result<(), AddError> {
        r.params.validate(self.backend.config().vocab_size)?;
        let mut matcher = r.constraint.map(|c| ContainedMatcher::new(c.matcher()));
        // A budget below the shortest output would end truncated whatever the model does; the
        // context bounds the budget as much as max_tokens does.
        if let Some(minimum) = matcher.as_mut().and_then(|m| m.completion_cost()) {
            if minimum >= NO_OUTPUT {
                return Err(AddError::NoValidOutput);
            }
            // A prompt that leaves no room at all is the scheduler's to refuse (too long).
            let context = self.scheduler.token_limit().saturating_sub(r.prompt.len());
            let room = match context {
                0 => r.params.max_tokens,
                c => r.params.max_tokens.min(c),
            };
            if minimum > room {
                return Err(AddError::MaxTokensTooSmall {
                    max_tokens: room,
                    minimum,
                });
            }
        }
        let mut sampler = Sampler::new(r.params.clone(), &r.prompt);
        if let Some(breakers) = r.params.dry.as_ref().map(|d| &d.breakers).filter(|b| !b.is_empty()) {
            sampler.set_breakers(self.breaker_tokens(breakers));
        }
        let prompt_tokens = r.prompt.len();
        self.scheduler.add(r.id, r.prompt, r.priority)?;
        self.states.insert(
            r.id,
            State {
                stops: StopStrings::new(r.params.stop.clone()),
                sampler,
                matcher,
                detokenizer: Detokenizer::default(),
                arrived: Instant::now(),
                scheduled_at: None,
                last_token_at: None,
                metrics: RequestMetrics {
                    prompt_tokens,
                    ..Default::default()
                },
            },
        );
        Ok(())
    }

    /// The tokens whose text holds one of `breakers`, worked out once per list.
    fn breaker_tokens(&mut self, breakers: &[String]) -> Arc<[bool]> {
        let tokenizer = &self.tokenizer;
        self.dry_breakers
            .entry(breakers.to_vec())
            .or_insert_with(|| {
                (0..tokenizer.vocab_size() as u32)
                    .map(|t| {
                        let text = tokenizer.decode(&[t], false).unwrap_or_default();
                        breakers.iter().any(|b| text.contains(b.as_str()))
                    })
                    .collect()
            })
            .clone()
    }

    /// Drops a request wherever it is; its blocks go back to the pool at once.
    pub fn abort(&mut self, id: RequestId) -> Option<RequestOutput> {
        let r = self.scheduler.finish(id)?;
        let state = self.states.remove(&id)?;
        Some(self.final_output(id, state, r.num_preemptions, FinishReason::Aborted, String::new(), None))
    }

    /// Ends every request as `internal` (the backend failed under them); their blocks go back.
    pub fn fail_all(&mut self) -> Vec<RequestOutput> {
        let ids: Vec<RequestId> = self.states.keys().copied().collect();
        let mut outputs = Vec::new();
        for id in ids {
            if let (Some(r), Some(state)) = (self.scheduler.finish(id), self.states.remove(&id)) {
                let reason = FinishReason::Internal;
                outputs.push(self.final_output(id, state, r.num_preemptions, reason, String::new(), None));
            }
        }
        outputs
    }

    pub fn stats(&self) -> EngineStats {
        let kv = self.scheduler.kv();
        EngineStats {
            waiting: self.scheduler.num_waiting(),
            running: self.scheduler.num_running(),
            kv_blocks_total: kv.pool().total(),
            kv_blocks_free: kv.num_free_blocks(),
            prefix_cache: kv.stats(),
            preemptions: self.scheduler.num_preemptions(),
            steps: self.steps,
        }
    }

    /// One engine step; outputs of the requests that produced tokens or finished. The phases:
    /// schedule, prepare the batch, run the model while the grammar masks fill, sample, then
    /// update the requests with what was sampled.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>, RuntimeError> {
        let plan = self.scheduler.schedule();
        if plan.scheduled.is_empty() {
            return Ok(Vec::new());
        }
        let (batch, sampling) = self.prepare_batch(&plan.scheduled);
        let masks = self.forward_with_masks(&batch, &sampling)?;
        let sampled = self.sample(&sampling, &masks)?;
        self.steps += 1;
        Ok(self.update(&plan.scheduled, &sampling, sampled))
    }

    /// The flattened batch of the scheduled requests' tokens, and the requests whose last
    /// token is sampled, in the order of the batch's logits rows.
    fn prepare_batch(&mut self, scheduled: &[Scheduled]) -> (ForwardBatch, Vec<Scheduled>) {
        let now = Instant::now();
        let block_size = self.scheduler.kv().block_size();
        let mut batch = ForwardBatch::default();
        let mut sampling: Vec<Scheduled> = Vec::new();
        for s in scheduled {
            let r = self.scheduler.request(s.id).expect("scheduled requests exist");
            let tokens = r.tokens(s.start..s.start + s.num_tokens);
            batch.push_sequence(&tokens, s.start, self.scheduler.kv().block_table(s.id), block_size);
            if s.samples {
                batch
                    .logits_rows
                    .push(*batch.query_start.last().expect("just pushed") - 1);
                sampling.push(*s);
            }
            let state = self.states.get_mut(&s.id).expect("every request has a state");
            if state.scheduled_at.is_none() {
                state.scheduled_at = Some(now);
                state.metrics.queue = now - state.arrived;
                state.metrics.cached_tokens = r.num_cached;
            }
        }
        (batch, sampling)
    }

    /// Queues the forward pass and fills the sampled rows' grammar masks meanwhile (they
    /// depend only on the tokens accepted so far). Masks span the grammar's vocabulary, the
    /// tokenizer's; a model may have more rows (padding, or a stand-in tokenizer for dummy
    /// weights), which a mask never allows.
    fn forward_with_masks(
        &mut self,
        batch: &ForwardBatch,
        sampling: &[Scheduled],
    ) -> Result<Vec<Option<Vec<u32>>>, RuntimeError> {
        let words = bitmask_words(self.tokenizer.vocab_size());
        let mut masks: Vec<Option<Vec<u32>>> = vec![None; sampling.len()];
        let mut matchers: Vec<(usize, &mut ContainedMatcher)> = Vec::new();
        {
            let mut by_id: HashMap<RequestId, usize> = HashMap::new();
            for (i, s) in sampling.iter().enumerate() {
                by_id.insert(s.id, i);
            }
            for (id, state) in self.states.iter_mut() {
                if let (Some(&i), Some(m)) = (by_id.get(id), state.matcher.as_mut()) {
                    matchers.push((i, m));
                }
            }
        }
        // The forward pass is queued from this thread (a GPU context is bound to the thread that
        // made it); the masks are filled on the pool meanwhile.
        let backend = &mut self.backend;
        let filled = std::sync::Mutex::new(Vec::with_capacity(matchers.len()));
        let ran = rayon::in_place_scope(|scope| {
            for (i, m) in matchers {
                let filled = &filled;
                scope.spawn(move |_| {
                    let mut mask = vec![0u32; words];
                    m.fill_bitmask(&mut mask);
                    filled.lock().unwrap_or_else(|e| e.into_inner()).push((i, mask));
                });
            }
            backend.run(batch)
        });
        let filled = filled.into_inner().unwrap_or_else(|e| e.into_inner());
        ran?;
        for (i, mask) in filled {
            masks[i] = Some(mask);
        }
        Ok(masks)
    }

    /// Each sampled row's token. Where the backend draws on its device, each row's draw goes
    /// with it (the sampler's parameters and penalties, and the copy bias's mask); the rows it
    /// leaves come back as logits for the request's sampler. Either way the token is kept only
    /// where the output can still close within its budget.
    fn sample(
        &mut self,
        sampling: &[Scheduled],
        masks: &[Option<Vec<u32>>],
    ) -> Result<Vec<SampledToken>, RuntimeError> {
        let words = bitmask_words(self.tokenizer.vocab_size());
        let mut draws: Vec<Option<RowDraw>> = vec![None; sampling.len()];
        if self.backend.draws_on_device() {
            for (i, s) in sampling.iter().enumerate() {
                let Some(state) = self.states.get_mut(&s.id) else {
                    continue;
                };
                draws[i] = Some((state.sampler.device_draw(), copy_prior(state)));
            }
        }
        let requests: Vec<RowRequest<'_>> = masks
            .iter()
            .zip(&draws)
            .map(|(mask, draw)| RowRequest {
                mask: mask.as_deref(),
                draw: draw.as_ref().map(|(d, copying)| Draw {
                    params: d.params,
                    bias: copying.as_ref().map(|(c, b)| (&c[..], *b)),
                    penalties: &d.penalties,
                }),
            })
            .collect();
        let decided = self.backend.sample(&requests)?;
        let mut sampled = Vec::with_capacity(sampling.len());
        for (row, (s, mask)) in sampling.iter().zip(masks).enumerate() {
            let room = self.room_after_next(s.id);
            let state = self.states.get_mut(&s.id).expect("every request has a state");
            sampled.push(match (decided.tokens[row], decided.host_row(row)) {
                (Some(token), _) => {
                    let drawn = (token, decided.logprobs.get(row).cloned().flatten());
                    keep_within(state, self.backend.as_mut(), row, drawn, room, words)?
                }
                (None, Some(logits)) => draw_within(state, logits, mask.as_deref(), room, words),
                (None, None) => unreachable!("a row without a token has logits"),
            });
        }
        Ok(sampled)
    }

    /// The requests after the step: prefill chunks advance, each sampled token is accepted
    /// (with the tokens the grammar then forces, under jump-forward), and the outputs of the
    /// requests that produced tokens or finished come back.
    fn update(
        &mut self,
        scheduled: &[Scheduled],
        sampling: &[Scheduled],
        sampled: Vec<SampledToken>,
    ) -> Vec<RequestOutput> {
        let mut outputs = Vec::new();
        for s in scheduled {
            if !s.samples {
                self.scheduler.update(s, None);
            }
        }
        for (s, sampled) in sampling.iter().zip(sampled) {
            self.scheduler.update(s, Some(sampled.token));
            let Some(mut out) = self.accept(s.id, sampled) else {
                continue;
            };
            if out.finished.is_none() && self.jump_forward {
                for token in self.forced_tokens(s.id) {
                    self.scheduler.append(s.id, token);
                    let state = self.states.get_mut(&s.id).expect("unfinished requests have a state");
                    let forced = state.sampler.forced(token);
                    let Some(next) = self.accept(s.id, forced) else { break };
                    out.tokens.extend(next.tokens);
                    out.text.push_str(&next.text);
                    (out.finished, out.stop_string, out.metrics) = (next.finished, next.stop_string, next.metrics);
                    if out.finished.is_some() {
                        break;
                    }
                }
            }
            outputs.push(out);
        }
        outputs
    }

    /// The tokens a request may still add after the one about to be sampled: its
    /// `max_tokens` and the context both bound it.
    fn room_after_next(&self, id: RequestId) -> usize {
        let (Some(r), Some(state)) = (self.scheduler.request(id), self.states.get(&id)) else {
            return 0;
        };
        let context = self.scheduler.token_limit().saturating_sub(r.num_tokens() + 1);
        let budget = state.sampler.params().max_tokens.saturating_sub(r.output.len() + 1);
        context.min(budget)
    }

    /// The tokens the grammar alone decides next, where appending them keeps the output's
    /// tokenization canonical: the forced text is tokenized together with the token before it,
    /// and used only if that token survives unmerged (the matcher also drops the last forced
    /// token, which could merge with what follows). Capped by max_tokens and the context.
    fn forced_tokens(&mut self, id: RequestId) -> Vec<u32> {
        let Some(r) = self.scheduler.request(id) else {
            return Vec::new();
        };
        let (Some(&last), output_len) = (r.output.last(), r.output.len()) else {
            return Vec::new();
        };
        let room = self.scheduler.token_limit().saturating_sub(r.num_tokens() + 1);
        let Some(state) = self.states.get_mut(&id) else {
            return Vec::new();
        };
        let room = room.min(state.sampler.params().max_tokens.saturating_sub(output_len));
        let Some(matcher) = state.matcher.as_mut() else {
            return Vec::new();
        };
        if room == 0 {
            return Vec::new();
        }
        let tokenizer = &self.tokenizer;
        // Called only when the grammar forces some text, so most steps decode nothing here.
        let mut forced = matcher.forced_tokens(&|text: &str| {
            let before = match tokenizer.decode(&[last], false) {
                Ok(b) if !b.is_empty() && !b.ends_with('\u{FFFD}') => b,
                _ => return Vec::new(),
            };
            match tokenizer.encode_fragment(&format!("{before}{text}"), false) {
                Ok(mut t) if t.first() == Some(&last) => {
                    t.remove(0);
                    t
                }
                _ => Vec::new(),
            }
        });
        forced.truncate(room);
        forced
    }

    /// Records a sampled token; finishes the request when it is done.
    fn accept(&mut self, id: RequestId, sampled: SampledToken) -> Option<RequestOutput> {
        let token = sampled.token;
        let limit = self.scheduler.token_limit();
        let r = self.scheduler.request(id)?;
        let (num_tokens, output_len, preemptions) = (r.num_tokens(), r.output.len(), r.num_preemptions);
        let state = self.states.get_mut(&id)?;
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
        let state = self.states.remove(&id)?;
        self.scheduler.finish(id);
        let mut out = self.final_output(id, state, preemptions, reason, text, stop_string);
        out.tokens = vec![sampled];
        Some(out)
    }

    fn final_output(
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

/// A row's draw for the backend, with the copy bias's mask and weight.
type RowDraw = (DeviceDraw, Option<(Vec<u32>, f32)>);

/// The token a backend drew for a row, kept if the output can still close within `room` more
/// tokens; otherwise drawn again where the logits are, under the mask that keeps room: the same
/// choice `draw_within` makes on the host.
fn keep_within(
    state: &mut State,
    backend: &mut dyn crate::runtime::Backend,
    row: usize,
    drawn: (u32, Option<RowLogprobs>),
    room: usize,
    words: usize,
) -> Result<SampledToken, RuntimeError> {
    let mut drawn = drawn;
    if let Some(m) = state.matcher.as_mut() {
        if let Some(tight) = room_keeping_mask(m, drawn.0, room, words) {
            state.metrics.budget_closed = true;
            drawn = backend.redraw_within(row, &tight)?;
        }
    }
    let (token, logprobs) = drawn;
    Ok(state.sampler.take(
        token,
        logprobs.map(|l| {
            let top = l.top.into_iter().map(|(token, logprob)| TopLogprob { token, logprob });
            (l.logprob, top.collect())
        }),
    ))
}

/// The mask that keeps room to close within `room` more tokens, where `token` would not: tried
/// on the matcher (an accept, a completion cost and a rollback, about a microsecond); only then
/// is the full walk made. `None` where `token` fits, or where no token would (not reachable
/// while completion costs are exact: some byte always brings the end one closer), so the
/// plain choice stands.
fn room_keeping_mask(m: &mut ContainedMatcher, token: u32, room: usize, words: usize) -> Option<Vec<u32>> {
    let fits = match m.accept(token) {
        Ok(()) => {
            let fits = m.is_finished() || m.completion_cost().is_none_or(|c| c <= room);
            let _ = m.rollback(1);
            fits
        }
        // Refused: `accept` ends the request as internal.
        Err(_) => true,
    };
    if fits {
        return None;
    }
    let mut tight = vec![0u32; words];
    m.fill_bitmask_within(&mut tight, room);
    tight.iter().any(|&w| w != 0).then_some(tight)
}

/// The copy bias's tokens and weight for a request's next token: the tokens that continue a
/// run copied from its document, at the request's `copy_bias`, or `CHOICE_FACTOR` times that
/// inside a closed choice of strings, where an option the document spells out is strong
/// evidence (a currency code, a status the document names).
fn copy_prior(state: &mut State) -> Option<(Vec<u32>, f32)> {
    let bias = state.sampler.params().copy_bias;
    let m = state.matcher.as_mut().filter(|_| bias > 0.0)?;
    let mask = m.copy_mask()?;
    let factor = if m.in_choice() { CHOICE_FACTOR } else { 1.0 };
    Some((mask, bias * factor))
}

/// The copy bias's weight inside a closed choice, chosen on `quarry bench quality` over the
/// development set: fields right 125/618 at 1, 127/618 at 2, 126/635 at 3 (with verbatim
/// strings 126/630 at 1, 128/630 at 2).
const CHOICE_FACTOR: f32 = 2.0;

/// Samples the next token of a request from its logits under its grammar mask (with the copy
/// bias on the tokens that continue a run copied from its document), keeping its constrained
/// output able to close within `room` more tokens: the plain mask is used as it is, and only
/// when the drawn token would leave too little room is it drawn again under the mask that keeps
/// room. Greedy, this is the argmax of the tighter mask; sampled, the distribution the tighter
/// mask gives.
fn draw_within(state: &mut State, logits: &[f32], mask: Option<&[u32]>, room: usize, words: usize) -> SampledToken {
    let prior = copy_prior(state);
    let (copying, bias) = match prior {
        Some((c, b)) => (Some(c), b),
        None => (None, 0.0),
    };
    let masked = |mask: &[u32]| -> Vec<f32> {
        logits
            .iter()
            .enumerate()
            .map(|(t, &v)| match (is_allowed(mask, t as u32), &copying) {
                (false, _) => f32::NEG_INFINITY,
                (true, Some(c)) if is_allowed(c, t as u32) => v + bias,
                (true, _) => v,
            })
            .collect()
    };
    let Some(mask) = mask else {
        return state.sampler.sample(logits);
    };
    let sampled = state.sampler.draw(&masked(mask));
    let Some(m) = state.matcher.as_mut() else {
        state.sampler.record(sampled.token);
        return sampled;
    };
    let Some(tight) = room_keeping_mask(m, sampled.token, room, words) else {
        state.sampler.record(sampled.token);
        return sampled;
    };
    state.metrics.budget_closed = true;
    state.sampler.sample(&masked(&tight))
}
