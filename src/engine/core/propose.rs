//! Guessing tokens ahead: each decoding request's drafts for the next step, from the
//! proposers the engine speculates with, as many as pay for themselves.

use super::EngineCore;
use crate::engine::kv_cache_manager::RequestId;
use crate::engine::proposers::forced_after;
use crate::engine::speculation::{drafts_worth, Proposer, SpeculativeConfig};

impl EngineCore {
    /// Gives each decoding request its drafts for the next step, where the engine speculates:
    /// as many as pay for themselves (`SpeculativeConfig::adaptive`).
    pub(super) fn propose(&mut self) {
        let Some(config) = self.speculative else { return };
        let running = self.scheduler.running().to_vec();
        let share = self.step_cost.marginal_share(self.last_step_tokens.max(running.len()));
        for id in running {
            let Some(state) = self.states.get_mut(&id) else {
                continue;
            };
            let k = match config.adaptive {
                true => drafts_worth(
                    state.acceptance.rate(),
                    self.scheduler.num_running(),
                    share,
                    config.tokens,
                ),
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
}
