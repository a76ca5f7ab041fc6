//! Pipelined steps (`EngineConfig::async_scheduling`): the host plans and queues step N+1
//! before it reads step N's tokens, so that the device goes from one pass to the next without
//! waiting on the host's bookkeeping. A step's sampled rows leave placeholders
//! (`scheduler::PENDING`) that the next plan feeds like known tokens; a backend that
//! `pipelines` takes them from its own draws (`FROM_LAST_DRAW`), any other is given them once
//! they are read.
//!
//! One call of `step_pipelined`:
//!   plan N+1 -> queue its pass (pipelining backends) -> collect N: check and commit its
//!   tokens -> N+1's rows that still stand get their masks (while the pass runs) -> queue N+1's
//!   draws, and leave its placeholders.
//! A row of N+1 no longer stands where N's token ended its request, where the grammar forced
//! tokens after it (they are computed in N+2, before the request samples again), or where the
//! engine took back the device's draw (the budget's room): N+1 computed that position from the
//! wrong token, so it is computed again. Pipelined steps carry no drafts: a speculating engine
//! pipelines the steps in which drafting would gain less (`speculation::speculation_pays`),
//! and reads the step in flight (`read_in_flight`) before one that drafts.

use std::collections::HashMap;
use std::time::Instant;

use quarry_grammar::bitmask_words;

use super::host_phases::Part;
use super::verify::RowGrammar;
use super::{EngineCore, RequestOutput, Sampling};
use crate::engine::kv_cache_manager::RequestId;
use crate::engine::scheduler::PENDING;
use crate::runtime::{ForwardBatch, RuntimeError, Sampled, FROM_LAST_DRAW};

/// A step whose pass and draws are queued and whose tokens are not read yet.
pub(super) struct InFlight {
    sampling: Vec<Sampling>,
    grammar: Vec<RowGrammar>,
    /// The draws, where the backend decided them at once (it does not pipeline).
    sampled: Option<Sampled>,
    /// Every row the step samples is drawn on the device: the next step may take its tokens
    /// from there.
    drawn_on_device: bool,
}

/// A planned step: its batch and the requests that sample.
struct Planned {
    batch: ForwardBatch,
    sampling: Vec<Sampling>,
}

impl EngineCore {
    /// One pipelined step; the outputs of the step before it (collected here).
    pub(super) fn step_pipelined(&mut self) -> Result<Vec<RequestOutput>, RuntimeError> {
        let result = self.pipelined();
        if result.is_err() {
            self.pipeline_failed();
        }
        result
    }

    /// After a failed pipelined step: its requests end with the rest (`fail_all`), and
    /// nothing of the step in flight may be read. Blocks a step was to compute were cached
    /// when it was planned: none may be found again.
    fn pipeline_failed(&mut self) {
        self.in_flight = None;
        self.scheduler.forget_prefixes();
    }

    /// Reads the step in flight and plans none after it: the outputs. The next step drafts,
    /// and its guesses follow that step's tokens.
    pub(super) fn read_in_flight(&mut self) -> Result<Vec<RequestOutput>, RuntimeError> {
        let Some(f) = self.in_flight.take() else {
            return Ok(Vec::new());
        };
        let result = self.collect_step(f).map(|(outputs, _)| outputs);
        if result.is_err() {
            self.pipeline_failed();
        }
        result
    }

    fn pipelined(&mut self) -> Result<Vec<RequestOutput>, RuntimeError> {
        let started = Instant::now();
        self.host_phases.start();
        let next = self.plan_next()?;
        self.host_phases.lap(Part::Plan);
        let queue_first = self.backend.pipelines() && self.in_flight.as_ref().is_none_or(|f| f.drawn_on_device);
        if let (Some(n), true) = (&next, queue_first) {
            self.backend.run(&n.batch)?;
        }
        self.host_phases.lap(Part::Queue);
        let steady = next.is_some() && self.in_flight.is_some();
        if steady {
            self.pipelined_steps += 1;
        }
        let (outputs, tokens) = match self.in_flight.take() {
            Some(f) => self.collect_step(f)?,
            None => (Vec::new(), HashMap::new()),
        };
        let Some(mut next) = next else {
            self.host_phases.end(0);
            return Ok(outputs);
        };
        let planned = next.sampling.len();
        let standing: Vec<Sampling> = std::mem::take(&mut next.sampling)
            .into_iter()
            .filter(|v| self.still_stands(v))
            .collect();
        self.pipelined_rows_dropped += (planned - standing.len()) as u64;
        self.host_time.record_pipelined(planned, planned - standing.len());
        if !queue_first {
            for t in next.batch.token_ids.iter_mut().filter(|t| **t & FROM_LAST_DRAW != 0) {
                // A row whose request is gone computes a token nobody reads.
                *t = tokens.get(&(*t & !FROM_LAST_DRAW)).copied().unwrap_or(0);
            }
        }
        let grammar = self.forward_with_masks(&next.batch, &standing, !queue_first)?;
        self.host_phases.lap(Part::Masks);
        // A step in the pipeline's stride (one before it in flight) takes what the pipeline
        // gives a step: decoding steps only, as `StepCost` is fitted in `step`.
        let stride = steady && !self.backend.last_run_warmed_up();
        let decoding = planned > 0 && next.batch.token_ids.len() <= 2 * planned;
        self.launch_draws(standing, grammar)?;
        self.host_phases.lap(Part::Draws);
        self.host_phases.end(planned);
        if stride && decoding {
            self.pipelined_cost.record(planned, started.elapsed().as_secs_f64());
        }
        Ok(outputs)
    }

    /// Plans the next step, its placeholders marked for the backend, and counts its tokens as
    /// computed (`Scheduler::launched`).
    fn plan_next(&mut self) -> Result<Option<Planned>, RuntimeError> {
        let plan = self.scheduler.schedule();
        if plan.scheduled.is_empty() {
            return Ok(None);
        }
        // Where each request's placeholder comes from: its row of the step in flight.
        let drawn: HashMap<RequestId, u32> = self
            .in_flight
            .as_ref()
            .map(|f| f.sampling.iter().map(|v| (v.s.id, v.first_row as u32)).collect())
            .unwrap_or_default();
        let (batch, sampling) = self.prepare_batch(&plan.scheduled, &drawn)?;
        for s in &plan.scheduled {
            self.scheduler.launched(s);
        }
        Ok(Some(Planned { batch, sampling }))
    }

    /// Whether a request's sampled row of the step just planned still stands after the step
    /// before it was committed: the request runs on, its placeholder became the token the pass
    /// computed, and nothing was appended after it.
    fn still_stands(&self, v: &Sampling) -> bool {
        let end = v.s.start + v.s.num_tokens;
        self.scheduler
            .request(v.s.id)
            .is_some_and(|r| r.num_tokens() == end && r.num_computed == end)
    }

    /// Queues the draws of the step just run (its standing rows; every other row's logits stay
    /// where they are) and leaves each drawn request its placeholder.
    fn launch_draws(&mut self, sampling: Vec<Sampling>, grammar: Vec<RowGrammar>) -> Result<(), RuntimeError> {
        let mut asks = self.asks(&sampling, &grammar);
        let mut wanted = vec![false; grammar.len()];
        for v in &sampling {
            wanted[v.first_row] = true;
            if let Some((twin, _)) = v.twin {
                wanted[twin] = true;
            }
        }
        for (back, wanted) in asks.logits_back.iter_mut().zip(&wanted) {
            *back &= *wanted;
        }
        self.host_phases.lap(Part::Asks);
        let drawn_on_device = sampling.iter().all(|v| asks.draws[v.first_row].is_some());
        let sampled = match self.backend.pipelines() {
            true => {
                self.backend.launch_sample(&asks.requests(&grammar))?;
                None
            }
            false => Some(self.backend.sample(&asks.requests(&grammar))?),
        };
        for v in &sampling {
            self.scheduler.push_pending(v.s.id);
        }
        self.in_flight = Some(InFlight {
            sampling,
            grammar,
            sampled,
            drawn_on_device,
        });
        Ok(())
    }

    /// Reads a step's draws, checks each sampled row as `verify` does and commits its token:
    /// the outputs, and each drawn row's token by row (what the next step's placeholders
    /// stand for).
    fn collect_step(&mut self, f: InFlight) -> Result<(Vec<RequestOutput>, HashMap<u32, u32>), RuntimeError> {
        let decided = match f.sampled {
            Some(s) => s,
            None => self.backend.collect()?,
        };
        self.host_phases.lap(Part::Wait);
        self.steps += 1;
        let words = bitmask_words(self.tokenizer.vocab_size());
        let mut outputs = Vec::new();
        let mut tokens = HashMap::new();
        for v in &f.sampling {
            let id = v.s.id;
            self.scheduler.take_pending(id);
            if self.scheduler.request(id).is_none() {
                // Aborted while its step ran.
                continue;
            }
            let run = self.verify(v, &decided, &f.grammar, words)?;
            let token = run[0].token;
            tokens.insert(v.first_row as u32, token);
            // The next step computed this position from the device's draw.
            let redo = f.drawn_on_device && self.backend.pipelines() && decided.tokens[v.first_row] != Some(token);
            self.scheduler.resolve(id, token, redo);
            outputs.extend(self.commit(id, run));
        }
        self.host_phases.lap(Part::Commit);
        Ok((outputs, tokens))
    }
}

/// Marks a request's placeholders among its tokens in a batch (its span, and its twin's after
/// it) as the row of the step in flight that draws them.
pub(super) fn mark_placeholders(
    tokens: &mut [u32],
    id: RequestId,
    drawn: &HashMap<RequestId, u32>,
) -> Result<(), RuntimeError> {
    for t in tokens.iter_mut().filter(|t| **t == PENDING) {
        // Only after a failed step, whose requests were not ended (`fail_all`).
        let row = drawn
            .get(&id)
            .ok_or_else(|| RuntimeError::InvalidBatch(format!("request {id} waits on a token no step is drawing")))?;
        *t = FROM_LAST_DRAW | row;
    }
    Ok(())
}
