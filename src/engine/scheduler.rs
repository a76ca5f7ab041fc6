//! Decides, each step, which requests run and with how many tokens (vLLM's scheduler):
//! running requests first (a decode token each, or the rest of a chunked prompt), then waiting
//! ones, within a token budget and a cap on sequences. A prompt longer than what is left of
//! the budget is split into chunks over several steps, so it never stalls the others' decoding.
//! When blocks run out, the running request that deserves them least is preempted: its blocks
//! are freed and it waits to be recomputed (its tokens so far are kept, so it resumes with the
//! same output). A request's shadow sequence (context-aware decoding's twin) takes its blocks
//! here too, with its request's: where they run out, someone is preempted, as for the request
//! itself, so that a request never goes without its shadow because of what else runs.

use std::collections::HashMap;

use super::kv_cache_manager::{KvCacheManager, RequestId};
use super::request::{Request, RequestStatus};

/// A shadow sequence's id in the cache: its request's with the top bit set (request ids stay
/// below it).
pub const SHADOW: RequestId = 1 << 63;

/// The placeholder a request's output holds for the token a launched step is still drawing
/// (pipelined steps; `Scheduler::launched`). No vocabulary reaches it.
pub const PENDING: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served.
    Fcfs,
    /// Lowest `priority` value first, then arrival.
    Priority,
}

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Tokens in one forward pass, over every request.
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub policy: Policy,
    /// Tokens one request may hold in the cache (the model's context, at most).
    pub max_model_len: usize,
}

/// One request's share of a step: tokens `start..start + num_tokens` of its prompt-then-output,
/// the last `num_drafts` of them its drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    pub id: RequestId,
    pub start: usize,
    pub num_tokens: usize,
    /// The step reaches the last known token, so the next one is sampled (and each draft's
    /// successor, to check the drafts).
    pub samples: bool,
    /// Drafts computed after the known tokens; only a step that samples has any.
    pub num_drafts: usize,
    /// Where the request has a shadow, every step that samples runs it beside: its tokens
    /// (its prompt, the request's output, the drafts) from this one on, whose rows are the
    /// last `1 + num_drafts` (the rows the request samples are fed again where its blocks hold
    /// them: their logits are wanted).
    pub shadow: Option<usize>,
}

impl Scheduled {
    /// Known tokens in the span.
    pub fn num_known(&self) -> usize {
        self.num_tokens - self.num_drafts
    }
}

#[derive(Debug, Default)]
pub struct SchedulerOutput {
    pub scheduled: Vec<Scheduled>,
    /// Requests that lost their blocks this step.
    pub preempted: Vec<RequestId>,
}

impl SchedulerOutput {
    pub fn num_tokens(&self) -> usize {
        self.scheduled.iter().map(|s| s.num_tokens).sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    #[error("prompt of {tokens} tokens does not fit: at most {limit} tokens (model context and KV cache)")]
    InputTooLong { tokens: usize, limit: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("request id {0} is already in use")]
    DuplicateId(RequestId),
}

/// The scheduler over requests that carry the engine's own state of each (`T`: its sampler,
/// grammar matcher, detokenizer): one map holds a request whole, so nothing has to be kept in
/// step with it. The scheduler never looks inside `T`.
pub struct Scheduler<T = ()> {
    config: SchedulerConfig,
    kv: KvCacheManager,
    requests: HashMap<RequestId, Entry<T>>,
    /// In the order they will be considered (see `pick_waiting`).
    waiting: Vec<RequestId>,
    running: Vec<RequestId>,
    /// Admitted but not to be scheduled yet: their prompt's blocks are on their way from
    /// another engine (disaggregated serving).
    held: Vec<RequestId>,
    next_arrival: u64,
    num_preemptions: usize,
}

/// One request: what the scheduler keeps of it, and its owner's state.
struct Entry<T> {
    request: Request,
    state: T,
}

impl<T> Scheduler<T> {
    pub fn new(config: SchedulerConfig, kv: KvCacheManager) -> Self {
        Scheduler {
            config,
            kv,
            requests: HashMap::new(),
            waiting: Vec::new(),
            running: Vec::new(),
            held: Vec::new(),
            next_arrival: 0,
            num_preemptions: 0,
        }
    }

    /// The most tokens a request can ever hold: the model's context, and the whole cache.
    pub fn token_limit(&self) -> usize {
        self.config
            .max_model_len
            .min(self.kv.pool().total() * self.kv.block_size())
    }

    /// Queues a request, or refuses it up front when its prompt could never run.
    pub fn add(&mut self, id: RequestId, prompt: Vec<u32>, priority: i32, state: T) -> Result<(), AdmitError> {
        if prompt.is_empty() {
            return Err(AdmitError::EmptyPrompt);
        }
        let limit = self.token_limit();
        // The prompt and one sampled token must fit.
        if prompt.len() >= limit {
            return Err(AdmitError::InputTooLong {
                tokens: prompt.len(),
                limit: limit.saturating_sub(1),
            });
        }
        if self.requests.contains_key(&id) {
            return Err(AdmitError::DuplicateId(id));
        }
        let request = Request::new(id, prompt, priority, self.next_arrival);
        self.next_arrival += 1;
        self.requests.insert(id, Entry { request, state });
        self.waiting.push(id);
        Ok(())
    }

    /// Keeps a waiting request from being scheduled until `release`.
    pub fn hold(&mut self, id: RequestId) {
        if let Some(at) = self.waiting.iter().position(|&r| r == id) {
            self.waiting.remove(at);
            self.held.push(id);
        }
    }

    /// Lets a held request be scheduled, behind those waiting already.
    pub fn release(&mut self, id: RequestId) {
        if let Some(at) = self.held.iter().position(|&r| r == id) {
            self.held.remove(at);
            self.waiting.push(id);
        }
    }

    /// Whether `id` is held (`hold`).
    pub fn is_held(&self, id: RequestId) -> bool {
        self.held.contains(&id)
    }

    /// Bounds a request's output (`Request::max_output`).
    pub fn set_max_output(&mut self, id: RequestId, max_output: usize) {
        if let Some(e) = self.requests.get_mut(&id) {
            e.request.max_output = max_output;
        }
    }

    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(&id).map(|e| &e.request)
    }

    /// A request's state as its owner keeps it.
    pub fn state(&self, id: RequestId) -> Option<&T> {
        self.requests.get(&id).map(|e| &e.state)
    }

    pub fn state_mut(&mut self, id: RequestId) -> Option<&mut T> {
        self.requests.get_mut(&id).map(|e| &mut e.state)
    }

    /// A request, read-only, with its owner's state to change.
    pub fn get_mut(&mut self, id: RequestId) -> Option<(&Request, &mut T)> {
        self.requests.get_mut(&id).map(|e| (&e.request, &mut e.state))
    }

    /// Every request's owner state, waiting or running, in no particular order.
    pub fn states_mut(&mut self) -> impl Iterator<Item = (RequestId, &mut T)> {
        self.requests.iter_mut().map(|(&id, e)| (id, &mut e.state))
    }

    /// Every request's id, waiting or running.
    pub fn ids(&self) -> Vec<RequestId> {
        self.requests.keys().copied().collect()
    }

    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    /// The cache, for blocks held outside any request (disaggregated serving's transfers).
    pub fn kv_mut(&mut self) -> &mut KvCacheManager {
        &mut self.kv
    }

    /// `KvCacheManager::forget_prefixes`.
    pub fn forget_prefixes(&mut self) {
        self.kv.forget_prefixes();
    }

    /// Waiting requests, held ones included.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len() + self.held.len()
    }

    /// The running requests, in the order they are considered.
    pub fn running(&self) -> &[RequestId] {
        &self.running
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_preemptions(&self) -> usize {
        self.num_preemptions
    }

    /// Whether a request can be scheduled (held ones wait for their owner's `release`).
    pub fn has_unfinished(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Plans one step.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.config.max_num_batched_tokens;
        for id in self.running.clone() {
            if budget == 0 {
                break;
            }
            // Preempted earlier in this loop, to make room for another.
            if !self.running.contains(&id) {
                continue;
            }
            let r = &self.requests[&id].request;
            // The token in flight ends it: computing a position after it would be wasted.
            if r.ends_at_placeholder(self.token_limit()) {
                continue;
            }
            // Drafts ride after the known tokens, as far as the budget goes.
            let known = r.num_tokens() - r.num_computed;
            let num_new = (known + r.drafts.len()).min(budget);
            let num_drafts = num_new.saturating_sub(known);
            let total = r.num_computed + num_new;
            let shadow = shadow_len(r, !r.is_prefill_chunk(num_new - num_drafts), num_drafts);
            let mut scheduled = true;
            while !(self.kv.allocate_slots(id, total, &[]) && self.allocate_shadow(id, shadow, num_drafts)) {
                let victim = self.victim();
                // A victim scheduled earlier in this step gives its tokens back.
                budget += out
                    .scheduled
                    .iter()
                    .filter(|s| s.id == victim)
                    .map(|s| s.num_tokens)
                    .sum::<usize>();
                self.preempt(victim, &mut out);
                if victim == id {
                    scheduled = false;
                    break;
                }
            }
            if scheduled {
                self.push(id, num_new, num_drafts, &mut out);
                budget -= num_new;
                budget = self.plan_shadow(shadow, num_drafts, budget, &mut out);
            }
        }
        // New requests only when nobody had to give way this step.
        if !out.preempted.is_empty() {
            return out;
        }
        while budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(at) = self.pick_waiting() else { break };
            let id = self.waiting[at];
            let r = &self.requests[&id].request;
            let tokens = r.all_tokens();
            let (hit, cached) = self.kv.get_computed_blocks(&tokens);
            let num_new = (tokens.len() - cached).min(budget);
            let shadow = shadow_len(r, cached + num_new == tokens.len(), 0);
            if !self.kv.allocate_slots(id, cached + num_new, &hit) {
                break;
            }
            if !self.allocate_shadow(id, shadow, 0) {
                self.kv.free(id);
                break;
            }
            self.waiting.remove(at);
            self.running.push(id);
            let r = &mut self.requests.get_mut(&id).expect("waiting requests exist").request;
            r.status = RequestStatus::Running;
            r.num_computed = cached;
            r.num_cached = cached;
            self.push(id, num_new, 0, &mut out);
            budget -= num_new;
            budget = self.plan_shadow(shadow, 0, budget, &mut out);
        }
        out
    }

    /// Puts the shadow whose blocks were just given room for `len` tokens into the step of the
    /// request pushed last (after `num_drafts` drafts), from what its blocks hold on; the
    /// budget left after its tokens, which count against it too: its request's step cannot go
    /// without them, so they may take the last of it, and more.
    fn plan_shadow(
        &mut self,
        len: Option<usize>,
        num_drafts: usize,
        budget: usize,
        out: &mut SchedulerOutput,
    ) -> usize {
        let (Some(len), Some(last)) = (len, out.scheduled.last_mut()) else {
            return budget;
        };
        let computed = self.requests[&last.id].request.shadow_computed;
        let start = computed.min(len - 1 - num_drafts);
        last.shadow = Some(start);
        budget.saturating_sub(len - start)
    }

    fn push(&self, id: RequestId, num_tokens: usize, num_drafts: usize, out: &mut SchedulerOutput) {
        let r = &self.requests[&id].request;
        out.scheduled.push(Scheduled {
            id,
            start: r.num_computed,
            num_tokens,
            samples: !r.is_prefill_chunk(num_tokens - num_drafts),
            num_drafts,
            shadow: None,
        });
    }

    /// Gives request `id`'s shadow the blocks for `len` tokens, the last `num_drafts` of them
    /// the request's drafts (none where it does not run this step); on its first step (or its
    /// first after a preemption) it starts from the blocks the prefix cache holds of them.
    /// False where the pool is short.
    fn allocate_shadow(&mut self, id: RequestId, len: Option<usize>, num_drafts: usize) -> bool {
        let Some(len) = len else { return true };
        let shadow = id | SHADOW;
        if !self.kv.block_table(shadow).is_empty() {
            return self.kv.allocate_slots(shadow, len, &[]);
        }
        let tokens = shadow_tokens(&self.requests[&id].request, num_drafts);
        let (hit, cached) = self.kv.get_computed_blocks(&tokens);
        let allocated = self.kv.allocate_slots(shadow, len, &hit);
        if let (true, Some(e)) = (allocated, self.requests.get_mut(&id)) {
            e.request.shadow_computed = cached;
        }
        allocated
    }

    /// Sets a request's shadow prompt (see `Request::shadow`), before it first runs.
    pub fn set_shadow(&mut self, id: RequestId, prompt: Vec<u32>) {
        if let Some(e) = self.requests.get_mut(&id) {
            e.request.shadow = Some(prompt);
        }
    }

    /// Sets a running request's drafts for the next step (replacing any it had); a request
    /// that is not running keeps none.
    pub fn set_drafts(&mut self, id: RequestId, drafts: Vec<u32>) {
        if let Some(r) = self
            .requests
            .get_mut(&id)
            .map(|e| &mut e.request)
            .filter(|r| r.status == RequestStatus::Running)
        {
            r.drafts = drafts;
        }
    }

    /// The waiting request to consider next.
    fn pick_waiting(&self) -> Option<usize> {
        match self.config.policy {
            Policy::Fcfs => (!self.waiting.is_empty()).then_some(0),
            Policy::Priority => (0..self.waiting.len()).min_by_key(|&i| {
                let r = &self.requests[&self.waiting[i]].request;
                (r.priority, r.arrival)
            }),
        }
    }

    /// The running request that deserves its blocks least: the latest arrival (FCFS), or the
    /// lowest priority, latest among equals.
    fn victim(&self) -> RequestId {
        let key = |id: &RequestId| {
            let r = &self.requests[id].request;
            match self.config.policy {
                Policy::Fcfs => (0, r.arrival),
                Policy::Priority => (r.priority, r.arrival),
            }
        };
        *self
            .running
            .iter()
            .max_by_key(|id| key(id))
            .expect("a running request needs blocks")
    }

    fn preempt(&mut self, id: RequestId, out: &mut SchedulerOutput) {
        self.kv.free(id);
        self.kv.free(id | SHADOW);
        self.running.retain(|&r| r != id);
        out.scheduled.retain(|s| s.id != id);
        let r = &mut self.requests.get_mut(&id).expect("running requests exist").request;
        r.status = RequestStatus::Preempted;
        r.num_computed = 0;
        r.shadow_computed = 0;
        r.drafts.clear();
        r.num_preemptions += 1;
        self.num_preemptions += 1;
        // Back to the front: under FCFS it is the earliest waiting request again.
        self.waiting.insert(0, id);
        out.preempted.push(id);
    }

    /// After the forward pass: `s`'s known tokens are in the cache, and `run` (what was
    /// sampled, when it sampled: the drafts the model agreed with, then its own next token)
    /// joins its output. The accepted drafts' keys and values are kept; the slots of rejected
    /// ones are given back, and only full blocks of accepted tokens become reusable prefixes,
    /// so no cached block ever holds a rejected token.
    pub fn update(&mut self, s: &Scheduled, run: &[u32]) {
        let Some(r) = self.requests.get_mut(&s.id).map(|e| &mut e.request) else {
            return;
        };
        if r.status != RequestStatus::Running {
            return;
        }
        let accepted = run.len().saturating_sub(1);
        assert!(
            accepted <= s.num_drafts,
            "request {}: {accepted} of {} drafts accepted",
            s.id,
            s.num_drafts
        );
        r.num_computed = s.start + s.num_known() + accepted;
        r.output.extend_from_slice(run);
        r.drafts.clear();
        // The shadow holds what the request does past its prompt: its own prompt, then the
        // output but for the token just sampled.
        let shadow_len = r.shadow.as_ref().map(|p| p.len() + r.output.len());
        if let (Some(_), Some(len), false) = (s.shadow, shadow_len, run.is_empty()) {
            r.shadow_computed = len - 1;
        }
        if s.num_drafts > accepted {
            self.kv.truncate(s.id, r.num_tokens());
            if let (Some(_), Some(len)) = (s.shadow, shadow_len) {
                self.kv.truncate(s.id | SHADOW, len);
            }
        }
        let computed = r.num_computed;
        self.kv.cache_blocks(s.id, computed, |range| r.tokens(range));
    }

    /// Pipelined steps (`engine::core::pipeline`): step N is launched, its successor planned
    /// and launched, and only then are N's tokens known. On launch the step's tokens count as
    /// computed (the device computes them before anything queued after), and each row it samples
    /// leaves a placeholder, `PENDING`, as the request's last output token, which the next
    /// plan feeds like any known token (the backend takes it from its own draw) and which
    /// `resolve` replaces. Only whole blocks of known tokens are cached, so no block's hash
    /// ever covers a placeholder.
    pub fn launched(&mut self, s: &Scheduled) {
        let Some(r) = self.requests.get_mut(&s.id).map(|e| &mut e.request) else {
            return;
        };
        if r.status != RequestStatus::Running {
            return;
        }
        debug_assert_eq!(s.num_drafts, 0, "pipelined steps carry no drafts");
        r.num_computed = s.start + s.num_tokens;
        if let (Some(_), Some(prompt)) = (s.shadow, r.shadow.as_ref()) {
            r.shadow_computed = prompt.len() + r.output.len();
        }
        let known = r.num_computed.min(r.num_tokens() - r.pending as usize);
        self.kv.cache_blocks(s.id, known, |range| r.tokens(range));
    }

    /// Gives a request whose row of the launched step is drawn its placeholder (see `launched`).
    pub fn push_pending(&mut self, id: RequestId) {
        if let Some(r) = self.requests.get_mut(&id).map(|e| &mut e.request) {
            debug_assert!(!r.pending, "request {id} already waits on a token");
            r.output.push(PENDING);
            r.pending = true;
        }
    }

    /// Takes a request's placeholder off again, before its token is checked (a request may
    /// have lost its blocks meanwhile: its token still joins its output).
    pub fn take_pending(&mut self, id: RequestId) {
        if let Some(r) = self.requests.get_mut(&id).map(|e| &mut e.request).filter(|r| r.pending) {
            r.output.pop();
            r.pending = false;
        }
    }

    /// Appends a pipelined step's drawn token (after `take_pending`) and caches the blocks it
    /// completes. `redo`: the step launched after it computed its position from another token
    /// (the device's draw, which the engine then took back), so that position is computed
    /// again, in the request and its shadow.
    pub fn resolve(&mut self, id: RequestId, token: u32, redo: bool) {
        let Some(r) = self.requests.get_mut(&id).map(|e| &mut e.request) else {
            return;
        };
        r.output.push(token);
        if r.status != RequestStatus::Running {
            return;
        }
        if redo {
            r.num_computed = r.num_computed.min(r.num_tokens() - 1);
            if let Some(prompt) = r.shadow.as_ref() {
                r.shadow_computed = r.shadow_computed.min(prompt.len() + r.output.len() - 1);
            }
        }
        let computed = r.num_computed;
        self.kv.cache_blocks(id, computed, |range| r.tokens(range));
    }

    /// Appends a token decided without sampling (jump-forward); the next step computes it.
    pub fn append(&mut self, id: RequestId, token: u32) {
        if let Some(e) = self.requests.get_mut(&id) {
            e.request.output.push(token);
        }
    }

    /// Removes a request wherever it is (finished, aborted, refused) and frees its blocks; its
    /// final state, and its owner's, are returned.
    pub fn finish(&mut self, id: RequestId) -> Option<(Request, T)> {
        self.kv.free(id);
        self.kv.free(id | SHADOW);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        self.held.retain(|&r| r != id);
        let Entry { mut request, state } = self.requests.remove(&id)?;
        request.status = RequestStatus::Finished;
        Some((request, state))
    }
}

/// How many tokens request `r`'s shadow holds after a step in which `r` samples (`samples`)
/// after `num_drafts` drafts: its prompt, the output and those drafts; `None` where the shadow
/// does not run: a request without one, and a step that does not sample.
fn shadow_len(r: &Request, samples: bool, num_drafts: usize) -> Option<usize> {
    let prompt = r.shadow.as_ref().filter(|_| samples)?;
    Some(prompt.len() + r.output.len() + num_drafts)
}

/// Those tokens themselves (only a shadow's first step needs them: the prefix cache's lookup).
fn shadow_tokens(r: &Request, num_drafts: usize) -> Vec<u32> {
    let prompt = r.shadow.as_deref().unwrap_or_default();
    [prompt, &r.output[..], &r.drafts[..num_drafts]].concat()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::BlockPool;

    /// A stand-in model: the next token is a hash of every token before it, so any mistake in
    /// which tokens were computed changes the output.
    fn next_token(tokens: &[u32]) -> u32 {
        tokens.iter().fold(17u32, |h, &t| h.wrapping_mul(31).wrapping_add(t)) % 1000
    }

    #[derive(Clone)]
    struct Job {
        id: RequestId,
        prompt: Vec<u32>,
        max_tokens: usize,
        priority: i32,
        arrival_step: usize,
        abort_at_step: Option<usize>,
        /// Runs a shadow whose prompt is the first half of its own.
        shadow: bool,
    }

    /// Runs `jobs` to the end; returns each job's output (None when aborted) and the
    /// scheduler, for its counters. Every step checks the budget and the block accounting.
    fn run(jobs: &[Job], config: SchedulerConfig, blocks: usize) -> (Vec<Option<Vec<u32>>>, Scheduler) {
        let (outputs, s, _) = run_with(jobs, config, blocks, false);
        (outputs, s)
    }

    /// `run`, where `speculate` gives every decoding request a few drafts before each step,
    /// some of them the stand-in model's own continuation and then a wrong one; a step keeps
    /// the drafts the model agrees with and its own token after them. Also returns the drafts
    /// accepted and those scheduled.
    fn run_with(
        jobs: &[Job],
        config: SchedulerConfig,
        blocks: usize,
        speculate: bool,
    ) -> (Vec<Option<Vec<u32>>>, Scheduler, (usize, usize)) {
        let kv = KvCacheManager::new(BlockPool::new(blocks), 4, 0, true);
        let mut s = Scheduler::new(config, kv);
        let mut outputs: Vec<Option<Vec<u32>>> = vec![None; jobs.len()];
        let (mut accepted, mut scheduled) = (0, 0);
        let mut step = 0;
        while step <= jobs.iter().map(|j| j.arrival_step).max().unwrap_or(0) || s.has_unfinished() {
            for (i, j) in jobs.iter().enumerate() {
                if j.arrival_step == step {
                    s.add(j.id, j.prompt.clone(), j.priority, ()).unwrap();
                    if j.shadow {
                        s.set_shadow(j.id, j.prompt[..j.prompt.len() / 2 + 1].to_vec());
                    }
                }
                if j.abort_at_step == Some(step) && s.finish(j.id).is_some() {
                    outputs[i] = None;
                }
            }
            for j in jobs.iter().filter(|_| speculate) {
                let Some(r) = s
                    .request(j.id)
                    .filter(|r| r.status == RequestStatus::Running && !r.output.is_empty())
                else {
                    continue;
                };
                let n = (j.id as usize + step) % 5;
                let right = (j.id as usize * 3 + step) % 4;
                let mut context = r.all_tokens();
                let mut drafts = Vec::new();
                for i in 0..n.min(j.max_tokens.saturating_sub(r.output.len() + 1)) {
                    let t = next_token(&context);
                    let t = if i < right { t } else { (t + 1) % 1000 };
                    drafts.push(t);
                    context.push(t);
                }
                s.set_drafts(j.id, drafts);
            }
            let plan = s.schedule();
            assert!(plan.num_tokens() <= config.max_num_batched_tokens);
            assert!(plan.scheduled.len() <= config.max_num_seqs);
            for sch in &plan.scheduled {
                let r = s.request(sch.id).unwrap();
                assert!(s.kv().block_table(sch.id).len() * 4 >= sch.start + sch.num_tokens);
                assert!(
                    sch.samples || sch.num_drafts == 0,
                    "drafts only after the last known token"
                );
                // Every step that samples has the shadow beside it, on blocks for all its tokens.
                if let (true, Some(prompt)) = (sch.samples, &r.shadow) {
                    let start = sch.shadow.expect("a sampling step runs its shadow");
                    let len = prompt.len() + r.output.len() + sch.num_drafts;
                    assert!(start < len && s.kv().block_table(sch.id | SHADOW).len() * 4 >= len);
                } else {
                    assert_eq!(sch.shadow, None, "a shadow only where its request samples");
                }
                let mut run = Vec::new();
                if sch.samples {
                    let mut context = r.all_tokens();
                    loop {
                        let t = next_token(&context);
                        run.push(t);
                        match r.drafts[..sch.num_drafts].get(run.len() - 1) {
                            Some(&d) if d == t => context.push(t),
                            _ => break,
                        }
                    }
                }
                accepted += run.len().saturating_sub(1);
                scheduled += sch.num_drafts;
                s.update(sch, &run);
                let r = s.request(sch.id).unwrap();
                if sch.samples {
                    assert_eq!(
                        r.num_computed,
                        r.num_tokens() - 1,
                        "all but the model's own token computed"
                    );
                    let held = s.kv().block_table(sch.id).len();
                    assert!(held <= r.num_tokens().div_ceil(4), "rejected drafts' blocks given back");
                }
                let j = jobs.iter().position(|j| j.id == sch.id).unwrap();
                if r.output.len() >= jobs[j].max_tokens || r.num_tokens() >= s.token_limit() {
                    outputs[j] = Some(s.finish(sch.id).unwrap().0.output);
                }
            }
            step += 1;
            assert!(step < 100_000, "no progress");
        }
        assert_eq!(s.kv().num_free_blocks(), blocks, "every block back in the pool");
        (outputs, s, (accepted, scheduled))
    }

    fn config(budget: usize, seqs: usize, policy: Policy) -> SchedulerConfig {
        SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: seqs,
            policy,
            max_model_len: 4096,
        }
    }

    fn jobs(n: usize, seed: u64) -> Vec<Job> {
        let mut x = seed;
        let mut rand = move |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let shared: Vec<u32> = (0..24).map(|i| 500 + i).collect();
        (0..n)
            .map(|i| {
                let mut prompt: Vec<u32> = if rand(2) == 0 { shared.clone() } else { Vec::new() };
                prompt.extend((0..1 + rand(30)).map(|_| rand(1000) as u32));
                Job {
                    id: 100 + i as RequestId,
                    prompt,
                    max_tokens: 1 + rand(20) as usize,
                    priority: rand(3) as i32,
                    arrival_step: rand(10) as usize,
                    abort_at_step: None,
                    shadow: false,
                }
            })
            .collect()
    }

    fn alone(jobs: &[Job]) -> Vec<Option<Vec<u32>>> {
        jobs.iter()
            .map(|j| {
                let solo = Job {
                    arrival_step: 0,
                    abort_at_step: None,
                    ..j.clone()
                };
                run(std::slice::from_ref(&solo), config(4096, 1, Policy::Fcfs), 64)
                    .0
                    .remove(0)
            })
            .collect()
    }

    #[test]
    fn batching_chunking_and_preemption_never_change_outputs() {
        let mut preemptions = 0;
        for seed in 1..6u64 {
            let jobs = jobs(12, seed * 7919);
            let reference = alone(&jobs);
            for (cfg, blocks) in [
                (config(4096, 64, Policy::Fcfs), 256),
                (config(7, 64, Policy::Fcfs), 256),
                (config(64, 3, Policy::Priority), 256),
                (config(4096, 64, Policy::Fcfs), 20),
                (config(5, 64, Policy::Priority), 20),
            ] {
                let (out, s) = run(&jobs, cfg, blocks);
                assert_eq!(out, reference, "seed {seed}, {cfg:?}, {blocks} blocks");
                if blocks == 20 {
                    preemptions += s.num_preemptions();
                }
            }
        }
        assert!(preemptions > 10, "the 20-block pools preempt ({preemptions} times)");
    }

    #[test]
    fn drafts_change_no_output_and_rejected_ones_give_their_slots_back() {
        let (mut accepted, mut scheduled, mut preemptions) = (0, 0, 0);
        for seed in 1..6u64 {
            let mut jobs = jobs(12, seed * 7919);
            for j in &mut jobs {
                j.max_tokens += 10;
            }
            let reference = alone(&jobs);
            for (cfg, blocks) in [
                (config(4096, 64, Policy::Fcfs), 256),
                (config(7, 64, Policy::Fcfs), 256),
                (config(64, 3, Policy::Priority), 256),
                (config(4096, 64, Policy::Fcfs), 24),
                (config(5, 64, Policy::Priority), 24),
            ] {
                // `run_with` asserts the pool is whole at the end.
                let (out, s, (a, n)) = run_with(&jobs, cfg, blocks, true);
                assert_eq!(out, reference, "seed {seed}, {cfg:?}, {blocks} blocks");
                (accepted, scheduled, preemptions) = (accepted + a, scheduled + n, preemptions + s.num_preemptions());
            }
        }
        assert!(
            accepted > 100 && scheduled > accepted + 100,
            "{accepted} of {scheduled} drafts accepted"
        );
        assert!(preemptions > 10, "the small pools preempt ({preemptions} times)");
    }

    /// Shadows (context-aware decoding's twins) run at every step their requests sample, on
    /// blocks planned with theirs, preempting others where the pool is short; the outputs and
    /// the pool come out as without them.
    #[test]
    fn shadows_run_beside_every_sampling_step_and_give_their_blocks_back() {
        let mut preemptions = 0;
        for seed in 1..6u64 {
            let mut jobs = jobs(12, seed * 6151);
            for j in jobs.iter_mut().filter(|j| j.id % 3 != 0) {
                j.shadow = true;
            }
            let reference = alone(&jobs);
            for (cfg, blocks, speculate) in [
                (config(4096, 64, Policy::Fcfs), 256, false),
                (config(7, 64, Policy::Fcfs), 256, true),
                (config(4096, 64, Policy::Fcfs), 40, false),
                (config(5, 64, Policy::Priority), 40, true),
            ] {
                // `run_with` checks each step's shadows and that the pool is whole at the end.
                let (out, s, _) = run_with(&jobs, cfg, blocks, speculate);
                assert_eq!(out, reference, "seed {seed}, {cfg:?}, {blocks} blocks");
                preemptions += s.num_preemptions();
            }
        }
        assert!(preemptions > 10, "the small pools preempt ({preemptions} times)");
    }

    #[test]
    fn aborts_anywhere_leak_nothing() {
        for seed in 1..20u64 {
            let mut jobs = jobs(10, seed * 104729);
            for (i, j) in jobs.iter_mut().enumerate() {
                if i % 3 == 0 {
                    j.abort_at_step = Some(j.arrival_step + i % 7);
                }
            }
            // `run` asserts the pool is whole at the end.
            let (out, _) = run(&jobs, config(6, 4, Policy::Priority), 20);
            for (j, o) in jobs.iter().zip(&out) {
                assert!(o.is_some() || j.abort_at_step.is_some(), "job {} never finished", j.id);
            }
        }
    }

    #[test]
    fn a_second_request_reuses_the_cached_prefix() {
        let kv = KvCacheManager::new(BlockPool::new(32), 4, 0, true);
        let mut s = Scheduler::new(config(4096, 8, Policy::Fcfs), kv);
        let prompt: Vec<u32> = (0..21).collect();
        s.add(1, prompt.clone(), 0, ()).unwrap();
        let plan = s.schedule();
        for sch in &plan.scheduled {
            s.update(sch, &[7]);
        }
        s.finish(1);
        s.add(2, prompt, 0, ()).unwrap();
        let plan = s.schedule();
        assert_eq!(plan.scheduled[0].start, 20, "five full blocks reused");
        assert_eq!(plan.scheduled[0].num_tokens, 1);
        assert_eq!(s.request(2).unwrap().num_cached, 20);
    }

    #[test]
    fn oversized_prompts_are_refused_up_front() {
        let kv = KvCacheManager::new(BlockPool::new(4), 4, 0, true);
        let mut s = Scheduler::new(config(64, 8, Policy::Fcfs), kv);
        assert_eq!(
            s.add(1, vec![1; 16], 0, ()),
            Err(AdmitError::InputTooLong { tokens: 16, limit: 15 })
        );
        assert_eq!(s.add(1, vec![], 0, ()), Err(AdmitError::EmptyPrompt));
        assert!(s.add(1, vec![1; 15], 0, ()).is_ok());
        assert_eq!(s.add(1, vec![1], 0, ()), Err(AdmitError::DuplicateId(1)));
    }

    #[test]
    fn a_pipelined_plan_leaves_out_a_request_whose_token_in_flight_is_its_last() {
        let kv = KvCacheManager::new(BlockPool::new(16), 4, 0, true);
        let mut s: Scheduler = Scheduler::new(config(4096, 8, Policy::Fcfs), kv);
        s.add(1, vec![5, 6, 7], 0, ()).unwrap();
        s.add(2, vec![8, 9], 0, ()).unwrap();
        s.set_max_output(1, 2);
        // Two steps launched back to back, each sampling both requests.
        for step in 0..2 {
            let plan = s.schedule();
            assert_eq!(
                plan.scheduled.iter().map(|p| p.id).collect::<Vec<_>>(),
                vec![1, 2],
                "step {step}"
            );
            for p in &plan.scheduled {
                s.launched(p);
                if step == 1 {
                    s.take_pending(p.id);
                    s.resolve(p.id, 40 + p.id as u32, false);
                }
                s.push_pending(p.id);
            }
        }
        // Request 1's placeholder is its second output token: no step after it.
        let plan = s.schedule();
        assert_eq!(plan.scheduled.iter().map(|p| p.id).collect::<Vec<_>>(), vec![2]);
        assert!(s.request(1).unwrap().ends_at_placeholder(s.token_limit()));
        assert!(!s.request(2).unwrap().ends_at_placeholder(s.token_limit()));
    }
}
