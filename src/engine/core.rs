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
use super::proposers::NgramProposer;
use super::scheduler::{AdmitError, Scheduled, Scheduler, SchedulerConfig};
use super::speculation::{drafts_worth, Acceptance, StepCost};
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
    /// Speculative decoding's drafts checked and kept, per proposer.
    pub drafts: DraftCounts,
}

/// Who guessed a draft token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proposer {
    /// Prompt lookup (`NgramProposer`).
    Ngram,
    /// The constraint's forced tokens.
    Grammar,
}

/// Draft tokens the model checked, and those it agreed with, per proposer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftCounts {
    pub ngram_proposed: usize,
    pub ngram_accepted: usize,
    pub grammar_proposed: usize,
    pub grammar_accepted: usize,
    /// Steps that checked at least one draft of a request.
    pub checks: usize,
}

impl DraftCounts {
    fn count(&mut self, by: Proposer, accepted: bool) {
        let (proposed, kept) = match by {
            Proposer::Ngram => (&mut self.ngram_proposed, &mut self.ngram_accepted),
            Proposer::Grammar => (&mut self.grammar_proposed, &mut self.grammar_accepted),
        };
        *proposed += 1;
        *kept += accepted as usize;
    }

    pub fn proposed(&self) -> usize {
        self.ngram_proposed + self.grammar_proposed
    }

    pub fn accepted(&self) -> usize {
        self.ngram_accepted + self.grammar_accepted
    }

    pub fn add(&mut self, other: &DraftCounts) {
        self.ngram_proposed += other.ngram_proposed;
        self.ngram_accepted += other.ngram_accepted;
        self.grammar_proposed += other.grammar_proposed;
        self.grammar_accepted += other.grammar_accepted;
        self.checks += other.checks;
    }
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
    /// Guess tokens ahead and check the guesses in the same forward pass (off when `None`).
    pub speculative: Option<SpeculativeConfig>,
}

/// Speculative decoding: which proposers guess a request's next tokens, and how many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculativeConfig {
    /// Draft tokens per request and step, at most.
    pub tokens: usize,
    /// Prompt lookup: what followed the output's last tokens where they occur earlier.
    pub ngram: bool,
    /// The constraint's forced tokens. Under jump-forward they are appended without the
    /// model anyway; this adds them where they follow a draft, and guesses them where
    /// jump-forward is off.
    pub grammar: bool,
    /// Draft only as many tokens as pay for themselves, judged from each request's recent
    /// acceptance and the measured cost of a token in a step as large as the batch
    /// (`speculation::drafts_worth`); otherwise always up to `tokens`.
    pub adaptive: bool,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        SpeculativeConfig {
            tokens: 8,
            ngram: true,
            grammar: true,
            adaptive: true,
        }
    }
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
            speculative: None,
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
    /// Who proposed each of the request's current drafts.
    draft_sources: Vec<Proposer>,
    acceptance: Acceptance,
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
    speculative: Option<SpeculativeConfig>,
    ngram: NgramProposer,
    /// Every request's draft counts so far.
    drafts: DraftCounts,
    /// What a step costs against its tokens, measured as steps run.
    step_cost: StepCost,
    /// Tokens in the last step, drafts aside.
    last_step_tokens: usize,
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
            speculative: config.speculative.filter(|c| c.tokens > 0 && (c.ngram || c.grammar)),
            ngram: NgramProposer::default(),
            drafts: DraftCounts::default(),
            step_cost: StepCost::default(),
            last_step_tokens: 0,
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
                draft_sources: Vec::new(),
                acceptance: Acceptance::default(),
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
            drafts: self.drafts,
        }
    }

    /// One engine step; outputs of the requests that produced tokens or finished. The phases:
    /// propose drafts, schedule, prepare the batch, run the model while the grammar masks
    /// fill, sample (and check the drafts), then update the requests with what was kept.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>, RuntimeError> {
        self.propose();
        let plan = self.scheduler.schedule();
        if plan.scheduled.is_empty() {
            return Ok(Vec::new());
        }
        let started = Instant::now();
        let (batch, sampling) = self.prepare_batch(&plan.scheduled);
        let masks = self.forward_with_masks(&batch, &sampling)?;
        let runs = self.sample(&sampling, &masks)?;
        self.steps += 1;
        let outputs = self.update(&plan.scheduled, &sampling, runs);
        let tokens = plan.num_tokens();
        self.step_cost.record(tokens, started.elapsed().as_secs_f64());
        self.last_step_tokens = tokens - plan.scheduled.iter().map(|s| s.num_drafts).sum::<usize>();
        Ok(outputs)
    }

    /// Gives each decoding request its drafts for the next step, where the engine speculates:
    /// as many as pay for themselves (`SpeculativeConfig::adaptive`).
    fn propose(&mut self) {
        let Some(config) = self.speculative else { return };
        let running = self.scheduler.running().to_vec();
        let share = self.step_cost.marginal_share(self.last_step_tokens.max(running.len()));
        for id in running {
            let Some(state) = self.states.get_mut(&id) else { continue };
            let k = match config.adaptive {
                true => drafts_worth(state.acceptance.rate(), self.scheduler.num_running(), share, config.tokens),
                false => config.tokens,
            };
            if k == 0 {
                state.acceptance.forget();
            }
            let (drafts, sources) = self.drafts(id, k, config);
            if let Some(state) = self.states.get_mut(&id) {
                state.draft_sources = sources;
            }
            self.scheduler.set_drafts(id, drafts);
        }
    }

    /// Up to `k` guesses of a request's next tokens, within what it may still add,
    /// each one its constraint allows: prompt lookup's, and the constraint's forced tokens
    /// wherever it forces text after a draft (where jump-forward is off, also right after the
    /// last known token). Under jump-forward the forced tokens are those `update` would
    /// append, so that checking them gives the output it would.
    fn drafts(&mut self, id: RequestId, k: usize, config: SpeculativeConfig) -> (Vec<u32>, Vec<Proposer>) {
        let none = (Vec::new(), Vec::new());
        if k == 0 {
            return none;
        }
        let room = self.room_after_next(id);
        let (Some(r), Some(state)) = (self.scheduler.request(id), self.states.get_mut(&id)) else {
            return none;
        };
        // Still prefilling: its first token is not known yet.
        if r.output.is_empty() || !state.sampler.params().speculate {
            return none;
        }
        let k = k.min(room);
        let mut context = r.all_tokens();
        let known = context.len();
        let mut sources = Vec::new();
        let mut matcher = state.matcher.as_mut();
        let forcing = config.grammar || self.jump_forward;
        'propose: while context.len() - known < k {
            let left = k - (context.len() - known);
            let last = *context.last().expect("the output is not empty");
            if let Some(m) = matcher.as_deref_mut().filter(|_| forcing) {
                if config.grammar || context.len() > known {
                    let forced = forced_after(&self.tokenizer, m, last, left);
                    if !forced.is_empty() {
                        for t in forced {
                            if m.accept(t).is_err() {
                                break 'propose;
                            }
                            context.push(t);
                            sources.push(Proposer::Grammar);
                        }
                        continue;
                    }
                }
            }
            if !config.ngram {
                break;
            }
            let guess = self.ngram.propose(&context, left);
            if guess.is_empty() {
                break;
            }
            for t in guess {
                if let Some(m) = matcher.as_deref_mut() {
                    if m.accept(t).is_err() {
                        break 'propose;
                    }
                    if m.is_finished() {
                        context.push(t);
                        sources.push(Proposer::Ngram);
                        break 'propose;
                    }
                }
                context.push(t);
                sources.push(Proposer::Ngram);
                // Forced text after this draft is the grammar's to propose.
                if forcing && matcher.as_deref_mut().is_some_and(|m| !m.forced_bytes_empty()) {
                    continue 'propose;
                }
            }
        }
        let drafted = context.len() - known;
        if let Some(m) = matcher {
            let _ = m.rollback(drafted);
        }
        (context.split_off(known), sources)
    }

    /// The flattened batch of the scheduled requests' tokens (their drafts last), and the
    /// requests that sample, with their rows of logits: the last known token's, then each
    /// draft's.
    fn prepare_batch(&mut self, scheduled: &[Scheduled]) -> (ForwardBatch, Vec<Sampling>) {
        let now = Instant::now();
        let block_size = self.scheduler.kv().block_size();
        let mut batch = ForwardBatch::default();
        let mut sampling = Vec::new();
        for s in scheduled {
            let r = self.scheduler.request(s.id).expect("scheduled requests exist");
            let tokens = r.span(s.start, s.num_known(), s.num_drafts);
            batch.push_sequence(&tokens, s.start, self.scheduler.kv().block_table(s.id), block_size);
            if s.samples {
                let end = *batch.query_start.last().expect("just pushed") as usize;
                sampling.push(Sampling {
                    s: *s,
                    first_row: batch.logits_rows.len(),
                    drafts: r.drafts[..s.num_drafts].to_vec(),
                });
                batch.logits_rows.extend((end - 1 - s.num_drafts..end).map(|p| p as u32));
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
    /// depend only on the tokens accepted so far, and a draft row's on the drafts before it).
    /// Masks span the grammar's vocabulary, the tokenizer's; a model may have more rows
    /// (padding, or a stand-in tokenizer for dummy weights), which a mask never allows.
    fn forward_with_masks(
        &mut self,
        batch: &ForwardBatch,
        sampling: &[Sampling],
    ) -> Result<Vec<Option<Vec<u32>>>, RuntimeError> {
        let words = bitmask_words(self.tokenizer.vocab_size());
        let rows = batch.logits_rows.len();
        let mut masks: Vec<Option<Vec<u32>>> = vec![None; rows];
        let mut matchers: Vec<(&Sampling, &mut ContainedMatcher)> = Vec::new();
        {
            let by_id: HashMap<RequestId, &Sampling> = sampling.iter().map(|v| (v.s.id, v)).collect();
            for (id, state) in self.states.iter_mut() {
                if let (Some(&v), Some(m)) = (by_id.get(id), state.matcher.as_mut()) {
                    matchers.push((v, m));
                }
            }
        }
        // The forward pass is queued from this thread (a GPU context is bound to the thread that
        // made it); the masks are filled on the pool meanwhile.
        let backend = &mut self.backend;
        let filled = std::sync::Mutex::new(Vec::with_capacity(rows));
        let ran = rayon::in_place_scope(|scope| {
            for (v, m) in matchers {
                let filled = &filled;
                scope.spawn(move |_| {
                    let mut done = Vec::with_capacity(v.rows());
                    let mut advanced = 0;
                    for j in 0..v.rows() {
                        let mut mask = vec![0u32; words];
                        m.fill_bitmask(&mut mask);
                        done.push((v.first_row + j, mask));
                        // A row after a draft the grammar refuses is never reached.
                        if j == v.drafts.len() || m.accept(v.drafts[j]).is_err() {
                            break;
                        }
                        advanced += 1;
                    }
                    let _ = m.rollback(advanced);
                    filled.lock().unwrap_or_else(|e| e.into_inner()).extend(done);
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

    /// Each sampling request's run of tokens: the drafts the model agrees with, then its own
    /// token after them. Where the backend draws on its device, each row's draw goes with it
    /// (the sampler's parameters and penalties, and the copy bias's mask, as they stand after
    /// the drafts before the row); the rows it leaves come back as logits for the request's
    /// sampler.
    fn sample(
        &mut self,
        sampling: &[Sampling],
        masks: &[Option<Vec<u32>>],
    ) -> Result<Vec<Vec<SampledToken>>, RuntimeError> {
        let words = bitmask_words(self.tokenizer.vocab_size());
        let mut draws: Vec<Option<RowDraw>> = vec![None; masks.len()];
        if self.backend.draws_on_device() {
            for v in sampling {
                let Some(state) = self.states.get_mut(&v.s.id) else {
                    continue;
                };
                let checkpoint = (!v.drafts.is_empty()).then(|| state.sampler.checkpoint());
                let mut advanced = 0;
                for j in 0..v.rows() {
                    draws[v.first_row + j] = Some((state.sampler.device_draw(), copy_prior(state)));
                    let Some(&draft) = v.drafts.get(j) else { break };
                    state.sampler.record(draft);
                    if let Some(m) = state.matcher.as_mut() {
                        if m.accept(draft).is_err() {
                            break;
                        }
                        advanced += 1;
                    }
                }
                if let Some(m) = state.matcher.as_mut() {
                    let _ = m.rollback(advanced);
                }
                if let Some(c) = checkpoint {
                    state.sampler.rewind(c);
                }
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
        let mut runs = Vec::with_capacity(sampling.len());
        for v in sampling {
            runs.push(self.verify(v, &decided, masks, words)?);
        }
        Ok(runs)
    }

    /// Draws a request's rows in order, each under the state the tokens before it leave
    /// (penalties, copy prior, the budget's room), as long as the token drawn is the draft the
    /// row checks: those drafts and the first token that differs (or the one after the last
    /// draft) make the run. Drawing a row is what decoding without drafts does at that
    /// position, so the run is the output it would give, greedy or seeded. Under jump-forward,
    /// forced tokens after a kept draft are kept where the drafts spell them as `update`
    /// would; where they do not, the run ends and `update` appends them.
    fn verify(
        &mut self,
        v: &Sampling,
        decided: &crate::runtime::Sampled,
        masks: &[Option<Vec<u32>>],
        words: usize,
    ) -> Result<Vec<SampledToken>, RuntimeError> {
        let id = v.s.id;
        let room = self.room_after_next(id);
        // What jump-forward may append after `m` tokens of the run, as `forced_tokens` counts
        // it once they are in the output: the context left after them and one more, and
        // max_tokens less the output.
        let forced_room = {
            let r = self.scheduler.request(id).expect("sampling requests exist");
            let context = self.scheduler.token_limit().saturating_sub(r.num_tokens() + 1);
            let budget = self.states[&id].sampler.params().max_tokens.saturating_sub(r.output.len());
            move |m: usize| context.saturating_sub(m).min(budget.saturating_sub(m))
        };
        let eog = self.tokenizer.end_of_generation_ids();
        let state = self.states.get_mut(&id).expect("every request has a state");
        let mut run: Vec<SampledToken> = Vec::with_capacity(v.rows());
        let mut advanced = 0;
        let mut j = 0;
        let outcome = loop {
            let row = v.first_row + j;
            let left = room.saturating_sub(run.len());
            let sampled = match (decided.tokens[row], decided.host_row(row)) {
                (Some(token), _) => {
                    let drawn = (token, decided.logprobs.get(row).cloned().flatten());
                    match keep_within(state, self.backend.as_mut(), row, drawn, left, words) {
                        Ok(s) => s,
                        Err(e) => break Err(e),
                    }
                }
                (None, Some(logits)) => draw_within(state, logits, masks[row].as_deref(), left, words),
                (None, None) => unreachable!("a row without a token has logits"),
            };
            let token = sampled.token;
            run.push(sampled);
            if v.drafts.get(j) != Some(&token) || left == 0 {
                break Ok(());
            }
            // The model agrees with draft j, so row j + 1 was computed after the right token.
            let params = state.sampler.params();
            let ends = match state.matcher.as_mut() {
                Some(m) => match m.accept(token) {
                    Ok(()) => {
                        advanced += 1;
                        m.is_finished()
                    }
                    Err(_) => true,
                },
                None => (eog.contains(&token) && !params.ignore_eos) || params.stop_token_ids.contains(&token),
            };
            if ends {
                break Ok(());
            }
            j += 1;
            let Some(m) = state.matcher.as_mut().filter(|_| self.jump_forward) else {
                continue;
            };
            let forced = forced_after(&self.tokenizer, m, token, forced_room(run.len()));
            if forced.is_empty() {
                continue;
            }
            if !v.drafts[j..].starts_with(&forced) {
                break Ok(());
            }
            for &t in &forced {
                if m.accept(t).is_err() {
                    break;
                }
                advanced += 1;
                run.push(state.sampler.forced(t));
            }
            j += forced.len();
            if run.len() > room {
                break Ok(());
            }
        };
        if let Some(m) = state.matcher.as_mut() {
            let _ = m.rollback(advanced);
        }
        let by = &state.draft_sources;
        for (i, &source) in by.iter().enumerate().take(v.drafts.len()) {
            let kept = i + 1 < run.len();
            state.metrics.drafts.count(source, kept);
            self.drafts.count(source, kept);
        }
        if !v.drafts.is_empty() {
            state.metrics.drafts.checks += 1;
            self.drafts.checks += 1;
            state.acceptance.record(v.drafts.len(), run.len().saturating_sub(1));
        }
        outcome.map(|()| run)
    }

    /// The requests after the step: prefill chunks advance, each run of sampled tokens is
    /// accepted (then the tokens the grammar forces after it, under jump-forward), and the
    /// outputs of the requests that produced tokens or finished come back.
    fn update(
        &mut self,
        scheduled: &[Scheduled],
        sampling: &[Sampling],
        runs: Vec<Vec<SampledToken>>,
    ) -> Vec<RequestOutput> {
        let mut outputs = Vec::new();
        for s in scheduled {
            if !s.samples {
                self.scheduler.update(s, &[]);
            }
        }
        for (v, run) in sampling.iter().zip(runs) {
            let id = v.s.id;
            let tokens: Vec<u32> = run.iter().map(|t| t.token).collect();
            self.scheduler.update(&v.s, &tokens);
            let mut out: Option<RequestOutput> = None;
            let n = run.len();
            for (i, sampled) in run.into_iter().enumerate() {
                let Some(next) = self.accept(id, sampled, n - 1 - i) else { break };
                let finished = next.finished.is_some();
                merge(&mut out, next);
                if finished {
                    break;
                }
            }
            let Some(o) = out.as_ref() else { continue };
            if o.finished.is_none() && self.jump_forward {
                for token in self.forced_tokens(id) {
                    self.scheduler.append(id, token);
                    let state = self.states.get_mut(&id).expect("unfinished requests have a state");
                    let forced = state.sampler.forced(token);
                    let Some(next) = self.accept(id, forced, 0) else { break };
                    let finished = next.finished.is_some();
                    merge(&mut out, next);
                    if finished {
                        break;
                    }
                }
            }
            outputs.extend(out);
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

    /// The tokens the grammar alone decides after a request's last token (`forced_after`),
    /// capped by max_tokens and the context.
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
        forced_after(&self.tokenizer, matcher, last, room)
    }

    /// Records a sampled token, `after` tokens before the end of the request's output (a run
    /// joins the output at once); finishes the request when it is done.
    fn accept(&mut self, id: RequestId, sampled: SampledToken, after: usize) -> Option<RequestOutput> {
        let token = sampled.token;
        let limit = self.scheduler.token_limit();
        let r = self.scheduler.request(id)?;
        let (num_tokens, output_len, preemptions) = (r.num_tokens() - after, r.output.len() - after, r.num_preemptions);
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

/// A request whose step samples: its rows of logits (the last known token's, then one after
/// each draft) and the drafts they check.
struct Sampling {
    s: Scheduled,
    /// Its first row among the batch's logits rows.
    first_row: usize,
    drafts: Vec<u32>,
}

impl Sampling {
    fn rows(&self) -> usize {
        1 + self.drafts.len()
    }
}

/// Appends one accepted token's output to a step's output of the same request.
fn merge(out: &mut Option<RequestOutput>, next: RequestOutput) {
    match out {
        None => *out = Some(next),
        Some(out) => {
            out.tokens.extend(next.tokens);
            out.text.push_str(&next.text);
            (out.finished, out.stop_string, out.metrics) = (next.finished, next.stop_string, next.metrics);
        }
    }
}

/// The tokens the grammar alone decides after `last`, where appending them keeps the output's
/// tokenization canonical: the forced text is tokenized together with `last`, and used only
/// if `last` survives unmerged (the matcher also drops the last forced token, which could
/// merge with what follows). At most `room` of them.
fn forced_after(tokenizer: &Tokenizer, matcher: &mut ContainedMatcher, last: u32, room: usize) -> Vec<u32> {
    if room == 0 {
        return Vec::new();
    }
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
