//! The engine step (shared/design.md): propose drafts, schedule, run the model on one
//! flattened batch, constrain and sample the requests that reached their last known token (and
//! check their drafts), update, emit. The grammar masks of the step are filled on worker
//! threads while the forward pass runs.
//!
//! `propose` guesses tokens ahead, `verify` draws each sampled request's rows and keeps the
//! drafts the model agrees with, `output` turns the kept tokens into request state and
//! outputs; `state` is a request's engine-side state.

mod handoff;
mod host_phases;
mod output;
mod pipeline;
mod propose;
mod state;
mod verify;

use output::merge;
pub use output::{Completion, Completions, FinishReason, RequestMetrics, RequestOutput};
use state::State;
use verify::{copy_prior, RowGrammar};

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use quarry_grammar::bitmask_words;

use super::client::EngineStats;
use super::contained::ContainedMatcher;
use super::contrast;
use super::detokenizer::Detokenizer;
use super::kv_cache_manager::{KvCacheManager, RequestId};
use super::proposers::forced_after;
use super::proposers::{DraftModel, NgramProposer};
use super::scheduler::{AdmitError, Scheduled, Scheduler, SchedulerConfig};
use super::speculation::{Acceptance, Availability, DraftCounts, HostTime, SpeculativeConfig, StepCost};
use super::stop::StopStrings;
use super::structured::CompiledConstraint;
use super::BlockPool;
use crate::runtime::{Backend, Draw, ForwardBatch, RowRequest, RuntimeError, Sampled};
use crate::sampling::{DeviceDraw, SampledToken, Sampler, SamplingParamError, SamplingParams};
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
    /// Plan and queue each step before the last one's tokens are read (`core::pipeline`).
    /// While speculating, only the steps in which drafting would gain less (drafts need the
    /// last step's tokens); never with a draft model.
    pub async_scheduling: AsyncScheduling,
}

/// When steps are pipelined (`EngineConfig::async_scheduling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AsyncScheduling {
    /// Where the backend draws on the device and the next pass takes its tokens from there
    /// (`Backend::pipelines`): the device then goes from one pass to the next without waiting
    /// for the host. On the CPU, whose pass blocks anyway, nothing is won.
    #[default]
    Auto,
    /// On every backend (on the CPU the engine fills the placeholders itself).
    On,
    Off,
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
            async_scheduling: AsyncScheduling::Auto,
        }
    }
}

pub struct EngineCore {
    backend: Box<dyn Backend>,
    tokenizer: Arc<Tokenizer>,
    /// Every request, with the engine's state of it (`State`).
    scheduler: Scheduler<State>,
    /// Forward passes run.
    steps: u64,
    jump_forward: bool,
    /// Per list of DRY sequence breakers, which tokens hold one (by token id).
    dry_breakers: HashMap<Vec<String>, Arc<[bool]>>,
    speculative: Option<SpeculativeConfig>,
    ngram: NgramProposer,
    /// Every request's draft counts so far.
    drafts: DraftCounts,
    /// Guesses tokens where the engine speculates with a draft model.
    draft_model: Option<DraftModel>,
    /// Times the draft model failed (it is dropped the first time).
    draft_model_failures: u64,
    /// What a decoding step costs against its sampled rows, measured as steps run.
    step_cost: StepCost,
    /// What a pipelined decoding step takes against its sampled rows, measured as they run.
    pipelined_cost: StepCost,
    /// The host's exposed share of a step and what proposing takes, measured as steps run.
    host_time: HostTime,
    /// `QUARRY_ENGINE_TIMING`'s sums.
    host_phases: host_phases::HostPhases,
    async_scheduling: AsyncScheduling,
    /// The pipelined step whose tokens are not read yet.
    in_flight: Option<pipeline::InFlight>,
    pipelined_steps: u64,
    pipelined_rows_dropped: u64,
    /// Disaggregated serving's KV transfers (`handoff`).
    handoffs: handoff::Handoffs,
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
            steps: 0,
            jump_forward: config.jump_forward,
            dry_breakers: HashMap::new(),
            speculative: config.speculative.filter(|c| c.tokens > 0 && (c.ngram || c.grammar)),
            ngram: NgramProposer::default(),
            drafts: DraftCounts::default(),
            draft_model: None,
            draft_model_failures: 0,
            step_cost: StepCost::default(),
            pipelined_cost: StepCost::default(),
            host_time: HostTime::default(),
            host_phases: host_phases::HostPhases::from_env(),
            async_scheduling: config.async_scheduling,
            in_flight: None,
            pipelined_steps: 0,
            pipelined_rows_dropped: 0,
            handoffs: handoff::Handoffs::default(),
        }
    }

    /// Speculates with `backend`, a smaller model with the same tokenizer, as the proposer
    /// (where `EngineConfig::speculative` is on): it guesses, this engine's model checks.
    pub fn set_draft_model(&mut self, backend: Box<dyn Backend>) {
        self.draft_model = Some(DraftModel::new(backend));
    }

    /// The draft model's backend back (a benchmark moves it between engines).
    pub fn take_draft_model(&mut self) -> Option<Box<dyn Backend>> {
        self.draft_model.take().map(DraftModel::into_backend)
    }

    /// The KV cache the requests' blocks come from (tests check that none leak).
    pub fn kv(&self) -> &KvCacheManager {
        self.scheduler.kv()
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
        self.scheduler.has_unfinished() || self.in_flight.is_some()
    }

    pub fn add_request(&mut self, r: EngineRequest) -> Result<(), AddError> {
        r.params.validate(self.backend.config().vocab_size)?;
        if r.params.contrast.is_some() && !contrast::allows(r.id) {
            return Err(AddError::BadParams(SamplingParamError {
                field: "contrast",
                reason: format!("request id {} is past the ids a contrasting request may have", r.id),
            }));
        }
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
        let state = State {
            stops: StopStrings::new(r.params.stop.clone()),
            sampler,
            matcher,
            detokenizer: Detokenizer::default(),
            arrived: Instant::now(),
            scheduled_at: None,
            last_token_at: None,
            metrics: RequestMetrics {
                prompt_tokens,
                twin_prompt_tokens: r.params.contrast.as_ref().map_or(0, |c| c.prompt.len()),
                ..Default::default()
            },
            draft_sources: Vec::new(),
            acceptance: Acceptance::default(),
            availability: Availability::default(),
        };
        let shadow = r.params.contrast.as_ref().map(|c| c.prompt.clone());
        let max_output = r.params.max_tokens;
        self.scheduler.add(r.id, r.prompt, r.priority, state)?;
        self.scheduler.set_max_output(r.id, max_output);
        if let Some(prompt) = shadow {
            self.scheduler.set_shadow(r.id, prompt);
        }
        Ok(())
    }

    /// `add_request`, for a request whose prompt's blocks another engine computes: it is not
    /// scheduled until `receive_blocks` has them in the cache (disaggregated serving).
    pub fn add_held_request(&mut self, r: EngineRequest) -> Result<(), AddError> {
        let id = r.id;
        self.add_request(r)?;
        self.scheduler.hold(id);
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
        let (r, state) = self.finish(id)?;
        Some(self.final_output(id, state, r.num_preemptions, FinishReason::Aborted, String::new(), None))
    }

    /// Ends every request as `internal` (the backend failed under them); their blocks go back.
    pub fn fail_all(&mut self) -> Vec<RequestOutput> {
        self.in_flight = None;
        let mut outputs = Vec::new();
        for id in self.scheduler.ids() {
            if let Some((r, state)) = self.finish(id) {
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
            draft_model_failures: self.draft_model_failures,
            logits_rows_copied: self.backend.logits_rows_copied(),
            graph_steps: self.backend.graph_steps(),
            pipelined_steps: self.pipelined_steps,
            pipelined_rows_dropped: self.pipelined_rows_dropped,
            kv_blocks_sent: self.handoffs.blocks_sent,
            kv_blocks_received: self.handoffs.blocks_received,
            kv_transfer_failures: self.handoffs.failures,
            broken: self.backend.broken(),
        }
    }

    /// One engine step; outputs of the requests that produced tokens or finished. The phases:
    /// propose drafts, schedule, prepare the batch, run the model while the grammar masks
    /// fill, sample (and check the drafts), then update the requests with what was kept.
    /// Where steps may be pipelined, a speculating engine pipelines those whose drafts would
    /// gain less than pipelining does (`speculation_pays`), and reads the step in flight
    /// before one that drafts, whose guesses follow its tokens.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>, RuntimeError> {
        let proposing = Instant::now();
        match (self.speculative, self.pipelining()) {
            (None, true) => return self.step_pipelined(),
            (None, false) => {}
            (Some(config), pipelining) => {
                let wanted = self.drafts_wanted(config);
                // Checking every draft (not adaptive) is asked for as such: never traded away.
                if pipelining && config.adaptive && !self.speculation_pays(&wanted) {
                    self.clear_drafts(&wanted);
                    return self.step_pipelined();
                }
                if self.in_flight.is_some() {
                    self.clear_drafts(&wanted);
                    return self.read_in_flight();
                }
                self.propose(wanted, config);
            }
        }
        let proposing = proposing.elapsed();
        let scheduling = Instant::now();
        let plan = self.scheduler.schedule();
        if plan.scheduled.is_empty() {
            return Ok(Vec::new());
        }
        let started = Instant::now();
        let scheduling = started - scheduling;
        let (batch, sampling) = self.prepare_batch(&plan.scheduled, &HashMap::new())?;
        let queued = Instant::now();
        let grammar = self.forward_with_masks(&batch, &sampling, true)?;
        let decided = self.draw(&sampling, &grammar)?;
        let read = Instant::now();
        let runs = self.verify_all(&sampling, &grammar, &decided)?;
        self.steps += 1;
        let outputs = self.update(&plan.scheduled, &sampling, runs);
        // Decoding steps only: a prompt's tokens cost far less each than a sampled row (no
        // logits, no mask, no draw), so they would hide what a draft costs.
        let rows = batch.logits_rows.len();
        // A step that captured a CUDA graph took many times what its next replays will.
        let measured = !self.backend.last_run_warmed_up();
        if measured && plan.scheduled.iter().all(|s| s.samples) && plan.num_tokens() <= 2 * rows {
            self.step_cost.record(rows, started.elapsed().as_secs_f64());
            let exposed = (queued - started) + read.elapsed();
            let seconds = |d: std::time::Duration| d.as_secs_f64();
            self.host_time
                .record(seconds(scheduling), seconds(exposed), seconds(proposing));
        }
        Ok(outputs)
    }

    /// Whether steps may be pipelined: asked for (`AsyncScheduling`), and no draft model
    /// guesses (its sequences follow every token). A speculating engine pipelines the steps
    /// in which drafting would not pay (`step`).
    pub fn pipelining(&self) -> bool {
        let asked = match self.async_scheduling {
            AsyncScheduling::Auto => self.backend.pipelines(),
            AsyncScheduling::On => true,
            AsyncScheduling::Off => false,
        };
        asked && self.draft_model.is_none()
    }

    /// The flattened batch of the scheduled requests' tokens (their drafts last), and the
    /// requests that sample, with their rows of logits: the last known token's, then each
    /// draft's. `drawn`: for a pipelined plan, the row of the step in flight that draws each
    /// waiting request's placeholder, which the batch then marks `FROM_LAST_DRAW | row` (in
    /// the request's span and its twin's).
    fn prepare_batch(
        &mut self,
        scheduled: &[Scheduled],
        drawn: &HashMap<RequestId, u32>,
    ) -> Result<(ForwardBatch, Vec<Sampling>), RuntimeError> {
        let now = Instant::now();
        let block_size = self.scheduler.kv().block_size();
        let mut batch = ForwardBatch::default();
        let mut sampling = Vec::new();
        for s in scheduled {
            let r = self.scheduler.request(s.id).expect("scheduled requests exist");
            let tokens = r.span(s.start, s.num_known(), s.num_drafts);
            let from = batch.token_ids.len();
            batch.push_sequence(&tokens, s.start, self.scheduler.kv().block_table(s.id), block_size);
            if s.samples {
                let end = *batch.query_start.last().expect("just pushed") as usize;
                let first_row = batch.logits_rows.len();
                batch
                    .logits_rows
                    .extend((end - 1 - s.num_drafts..end).map(|p| p as u32));
                let drafts = r.drafts[..s.num_drafts].to_vec();
                let weight = self
                    .scheduler
                    .state(s.id)
                    .and_then(|state| state.sampler.params().contrast.as_ref())
                    .map(|c| c.weight);
                let twin = match (s.shadow, weight) {
                    (Some(start), Some(weight)) => {
                        let row = contrast::push_twin(&mut batch, self.scheduler.kv(), r, start, &drafts);
                        row.map(|row| (row, weight))
                    }
                    _ => None,
                };
                sampling.push(Sampling {
                    s: *s,
                    first_row,
                    drafts,
                    twin,
                });
            }
            if r.pending {
                pipeline::mark_placeholders(&mut batch.token_ids[from..], s.id, drawn)?;
            }
            let (r, state) = self.scheduler.get_mut(s.id).expect("scheduled requests exist");
            if state.scheduled_at.is_none() {
                state.scheduled_at = Some(now);
                state.metrics.queue = now - state.arrived;
                state.metrics.cached_tokens = r.num_cached;
            }
        }
        Ok((batch, sampling))
    }

    /// Queues the forward pass (unless `run` is false: a pipelined step queued it already) and
    /// fills the sampled rows' grammar masks and copy priors meanwhile (they depend only on the tokens accepted so far, and a draft row's on the
    /// drafts before it): the one walk of the matcher through a request's drafts, off the
    /// engine thread. Masks span the grammar's vocabulary, the tokenizer's; a model may have
    /// more rows (padding, or a stand-in tokenizer for dummy weights), which a mask never
    /// allows.
    fn forward_with_masks(
        &mut self,
        batch: &ForwardBatch,
        sampling: &[Sampling],
        run: bool,
    ) -> Result<Vec<RowGrammar>, RuntimeError> {
        let words = bitmask_words(self.tokenizer.vocab_size());
        let rows = batch.logits_rows.len();
        let mut grammar: Vec<RowGrammar> = vec![RowGrammar::default(); rows];
        let mut matchers: Vec<(&Sampling, &mut ContainedMatcher, f32)> = Vec::new();
        {
            let by_id: HashMap<RequestId, &Sampling> = sampling.iter().map(|v| (v.s.id, v)).collect();
            for (id, state) in self.scheduler.states_mut() {
                let bias = state.sampler.params().copy_bias;
                if let (Some(&v), Some(m)) = (by_id.get(&id), state.matcher.as_mut()) {
                    matchers.push((v, m, bias));
                }
            }
        }
        // The forward pass is queued from this thread (a GPU context is bound to the thread that
        // made it); the masks are filled on the pool meanwhile.
        let backend = &mut self.backend;
        let filled = std::sync::Mutex::new(Vec::with_capacity(rows));
        let ran = rayon::in_place_scope(|scope| {
            for (v, m, bias) in matchers {
                let filled = &filled;
                scope.spawn(move |_| {
                    let mut done = Vec::with_capacity(v.rows());
                    let mut advanced = 0;
                    for j in 0..v.rows() {
                        let mut mask = vec![0u32; words];
                        m.fill_bitmask(&mut mask);
                        let copy = copy_prior(m, bias);
                        done.push((v.first_row + j, RowGrammar { mask: Some(mask), copy }));
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
            match run {
                true => backend.run(batch),
                false => Ok(()),
            }
        });
        let filled = filled.into_inner().unwrap_or_else(|e| e.into_inner());
        ran?;
        for (i, row) in filled {
            grammar[i] = row;
        }
        Ok(grammar)
    }

    /// Draws each sampling request's rows (`Backend::sample`): where the backend draws on its
    /// device, each row's draw goes with it (the sampler's parameters and penalties, the copy
    /// bias's mask, as they stand after the drafts before the row, and a contrasting request's
    /// twin row); the rows it leaves come back as logits for the request's sampler.
    fn draw(&mut self, sampling: &[Sampling], grammar: &[RowGrammar]) -> Result<Sampled, RuntimeError> {
        let asks = self.asks(sampling, grammar);
        self.backend.sample(&asks.requests(grammar))
    }

    /// Each sampling request's run of tokens: the drafts the model agrees with, then its own
    /// token after them.
    fn verify_all(
        &mut self,
        sampling: &[Sampling],
        grammar: &[RowGrammar],
        decided: &Sampled,
    ) -> Result<Vec<Vec<SampledToken>>, RuntimeError> {
        let words = bitmask_words(self.tokenizer.vocab_size());
        sampling
            .iter()
            .map(|v| self.verify(v, decided, grammar, words))
            .collect()
    }

    /// What the backend is asked of each row of the pass (`sample`): where it draws on its
    /// device, each sampling request's rows with their draws; every other row's logits back,
    /// but a contrast twin's whose request's row is drawn beside it. `rows`: the pass's rows.
    fn asks(&mut self, sampling: &[Sampling], grammar: &[RowGrammar]) -> RowAsks {
        let rows = grammar.len();
        let mut asks = RowAsks {
            draws: vec![None; rows],
            contrasts: vec![None; rows],
            logits_back: vec![true; rows],
        };
        if !self.backend.draws_on_device() {
            return asks;
        }
        for v in sampling {
            let Some(state) = self.scheduler.state_mut(v.s.id) else {
                continue;
            };
            let constrained = state.matcher.is_some();
            let checkpoint = (!v.drafts.is_empty()).then(|| state.sampler.checkpoint());
            for j in 0..v.rows() {
                let row = v.first_row + j;
                // A constrained row without a mask comes after a draft the grammar
                // refuses: never reached.
                if constrained && grammar[row].mask.is_none() {
                    break;
                }
                asks.draws[row] = Some(state.sampler.device_draw());
                if let Some((twin, weight)) = v.twin {
                    asks.contrasts[row] = Some((twin + j, weight));
                    asks.logits_back[twin + j] = false;
                }
                let Some(&draft) = v.drafts.get(j) else { break };
                state.sampler.record(draft);
            }
            if let Some(c) = checkpoint {
                state.sampler.rewind(c);
            }
        }
        asks
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
            let tokens: Vec<u32> = run.iter().map(|t| t.token).collect();
            self.scheduler.update(&v.s, &tokens);
            outputs.extend(self.commit(v.s.id, run));
        }
        outputs
    }

    /// A sampled run, already in the request's tokens, into its state: each token accepted
    /// (detokenized, checked for stops and the budget) until the request finishes, then the
    /// tokens the grammar forces after it, under jump-forward. The request's output of the step.
    fn commit(&mut self, id: RequestId, run: Vec<SampledToken>) -> Option<RequestOutput> {
        let mut out: Option<RequestOutput> = None;
        let n = run.len();
        for (i, sampled) in run.into_iter().enumerate() {
            let Some(next) = self.accept(id, sampled, n - 1 - i) else {
                break;
            };
            let finished = next.finished.is_some();
            merge(&mut out, next);
            if finished {
                break;
            }
        }
        let o = out.as_ref()?;
        if o.finished.is_none() && self.jump_forward {
            for token in self.forced_tokens(id) {
                self.scheduler.append(id, token);
                let state = self.scheduler.state_mut(id).expect("unfinished requests are kept");
                let forced = state.sampler.forced(token);
                let Some(next) = self.accept(id, forced, 0) else { break };
                let finished = next.finished.is_some();
                merge(&mut out, next);
                if finished {
                    break;
                }
            }
        }
        out
    }

    /// Removes a request from the scheduler, and its twin's blocks with it.
    fn finish(&mut self, id: RequestId) -> Option<(super::request::Request, State)> {
        self.scheduler.finish(id)
    }

    /// The tokens a request may still add after the one about to be sampled: its
    /// `max_tokens` and the context both bound it.
    fn room_after_next(&self, id: RequestId) -> usize {
        let (Some(r), Some(state)) = (self.scheduler.request(id), self.scheduler.state(id)) else {
            return 0;
        };
        let context = self.scheduler.token_limit().saturating_sub(r.num_tokens() + 1);
        let budget = state.sampler.params().max_tokens.saturating_sub(r.output.len() + 1);
        context.min(budget)
    }

    /// The tokens the grammar alone decides after a request's last token (`forced_after`),
    /// capped by max_tokens and the context.
    fn forced_tokens(&mut self, id: RequestId) -> Vec<u32> {
        let limit = self.scheduler.token_limit();
        let Some((r, state)) = self.scheduler.get_mut(id) else {
            return Vec::new();
        };
        let (Some(&last), output_len) = (r.output.last(), r.output.len()) else {
            return Vec::new();
        };
        let room = limit.saturating_sub(r.num_tokens() + 1);
        let room = room.min(state.sampler.params().max_tokens.saturating_sub(output_len));
        let Some(matcher) = state.matcher.as_mut() else {
            return Vec::new();
        };
        forced_after(&self.tokenizer, matcher, last, room)
    }
}

/// A request whose step samples: its rows of logits (the last known token's, then one after
/// each draft) and the drafts they check.
struct Sampling {
    s: Scheduled,
    /// Its first row among the batch's logits rows.
    first_row: usize,
    drafts: Vec<u32>,
    /// Its twin's first logits row (one per row of its own) and the contrast's weight, where
    /// it contrasts (`engine::contrast`).
    twin: Option<(usize, f32)>,
}

impl Sampling {
    fn rows(&self) -> usize {
        1 + self.drafts.len()
    }
}

/// What the backend is asked of each row of a pass, owned (`EngineCore::asks`).
struct RowAsks {
    draws: Vec<Option<DeviceDraw>>,
    contrasts: Vec<Option<(usize, f32)>>,
    logits_back: Vec<bool>,
}

impl RowAsks {
    fn requests<'a>(&'a self, grammar: &'a [RowGrammar]) -> Vec<RowRequest<'a>> {
        grammar
            .iter()
            .zip(&self.draws)
            .enumerate()
            .map(|(row, (g, draw))| RowRequest {
                mask: g.mask.as_deref(),
                draw: draw.as_ref().map(|d| Draw {
                    params: d.params,
                    bias: g.copy.as_ref().map(|(c, b)| (&c[..], *b)),
                    penalties: &d.penalties,
                    contrast: self.contrasts[row],
                }),
                logits_back: self.logits_back[row],
            })
            .collect()
    }
}
