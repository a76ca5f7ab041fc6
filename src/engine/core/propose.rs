//! Guessing tokens ahead: each decoding request's drafts for the next step, from the
//! proposers the engine speculates with, as many as pay for themselves.

use quarry_grammar::bitmask_words;

use super::EngineCore;
use crate::engine::contained::ContainedMatcher;
use crate::engine::kv_cache_manager::RequestId;
use crate::engine::proposers::{forced_after, DraftRow};
use crate::engine::speculation::{drafts_worth, expected_kept, speculation_pays, Proposer, SpeculativeConfig};
use crate::tokenizer::Tokenizer;

impl EngineCore {
    /// How many drafts each decoding request should have checked in the next step, where the
    /// engine speculates: as many as pay for themselves (`SpeculativeConfig::adaptive`). Those
    /// that want none have their drafts cleared and their evidence aged.
    pub(super) fn drafts_wanted(&mut self, config: SpeculativeConfig) -> Vec<(RequestId, usize)> {
        let running = self.scheduler.running().to_vec();
        // A decoding step samples a row per running request, and one more per draft.
        let rows = running.len();
        let share = self.step_cost.marginal_share(rows);
        // A draft model's guess costs its pass, a share of the step it saves.
        let per_draft = match (
            self.draft_model.as_ref().and_then(|d| d.pass_seconds()),
            self.step_cost.step_seconds(rows),
        ) {
            (Some(pass), Some(step)) if step > 0.0 => pass / step,
            _ => 0.0,
        };
        let mut wanted = Vec::new();
        for &id in &running {
            let Some(state) = self.scheduler.state_mut(id) else {
                continue;
            };
            let k = match config.adaptive {
                true => drafts_worth(state.acceptance.rate(), rows, share, per_draft, config.tokens),
                false => config.tokens,
            };
            if k == 0 {
                state.acceptance.forget();
                state.draft_sources.clear();
                self.scheduler.set_drafts(id, Vec::new());
            } else {
                wanted.push((id, k));
            }
        }
        wanted
    }

    /// Whether drafting for `wanted` gains more than pipelining the step would
    /// (`speculation_pays`), judged from the requests' acceptance, how often they get drafts
    /// at all, and the steps measured.
    pub(super) fn speculation_pays(&self, wanted: &[(RequestId, usize)]) -> bool {
        let kept: f64 = wanted
            .iter()
            .filter_map(|&(id, k)| {
                let state = self.scheduler.state(id)?;
                Some(state.availability.rate() * expected_kept(state.acceptance.rate(), k))
            })
            .sum();
        let drafts = wanted.iter().map(|&(_, k)| k).sum();
        speculation_pays(
            self.scheduler.running().len(),
            drafts,
            kept,
            &self.step_cost,
            &self.pipelined_cost,
            &self.host_time,
        )
    }

    /// Clears every request's drafts: the step is pipelined, and its plan has no tokens to
    /// guess after yet.
    pub(super) fn clear_drafts(&mut self, wanted: &[(RequestId, usize)]) {
        for &(id, _) in wanted {
            if let Some(state) = self.scheduler.state_mut(id) {
                state.draft_sources.clear();
                state.availability.forget();
            }
            self.scheduler.set_drafts(id, Vec::new());
        }
    }

    /// Gives each request in `wanted` (id, most drafts) its drafts for the next step: from
    /// the draft model where there is one, else from prompt lookup and the grammar.
    pub(super) fn propose(&mut self, wanted: Vec<(RequestId, usize)>, config: SpeculativeConfig) {
        if let Some(model) = self.draft_model.as_mut() {
            model.retain(self.scheduler.running());
            return self.model_drafts(&wanted, config);
        }
        for (id, k) in wanted {
            let (drafts, sources) = self.drafts(id, k, config);
            if let Some(state) = self.scheduler.state_mut(id) {
                state.draft_sources = sources;
                state.availability.record(!drafts.is_empty());
            }
            self.scheduler.set_drafts(id, drafts);
        }
    }

    /// The draft model's guesses for the requests in `wanted` (id, most drafts), one pass of
    /// it per guess for all of them at once, each under its constraint's mask; the grammar's
    /// forced tokens go in where it forces text, as in `drafts`.
    fn model_drafts(&mut self, wanted: &[(RequestId, usize)], config: SpeculativeConfig) {
        struct Seq {
            id: RequestId,
            tokens: Vec<u32>,
            known: usize,
            k: usize,
            sources: Vec<Proposer>,
            mask: Option<Vec<u32>>,
            open: bool,
        }
        let words = bitmask_words(self.tokenizer.vocab_size());
        let forcing = config.grammar || self.jump_forward;
        let mut seqs = Vec::new();
        for &(id, k) in wanted {
            let room = self.room_after_next(id);
            let (Some(r), Some(state)) = (self.scheduler.request(id), self.scheduler.state(id)) else {
                continue;
            };
            let tokens = r.all_tokens();
            let open = !r.output.is_empty() && state.sampler.params().speculate && room > 0;
            seqs.push(Seq {
                id,
                known: tokens.len(),
                tokens,
                k: k.min(room),
                sources: Vec::new(),
                mask: None,
                open,
            });
        }
        let mut failed = None;
        loop {
            // Forced text first, then the mask the model's guess is held to.
            for s in seqs.iter_mut().filter(|s| s.open) {
                let state = self.scheduler.state_mut(s.id).expect("running requests are kept");
                let Some(m) = state.matcher.as_mut() else { continue };
                let drafted = s.tokens.len() - s.known;
                if forcing && (config.grammar || drafted > 0) {
                    let left = s.k - drafted;
                    s.open &= push_forced(&self.tokenizer, m, &mut s.tokens, &mut s.sources, left).is_some();
                }
                s.open &= s.tokens.len() - s.known < s.k;
                if s.open {
                    let mut mask = vec![0u32; words];
                    m.fill_bitmask(&mut mask);
                    s.mask = Some(mask);
                }
            }
            let open: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].open).collect();
            if open.is_empty() {
                break;
            }
            let model = self.draft_model.as_mut().expect("drafting with a model");
            let rows: Vec<DraftRow<'_>> = open
                .iter()
                .map(|&i| DraftRow {
                    id: seqs[i].id,
                    tokens: &seqs[i].tokens,
                    mask: seqs[i].mask.as_deref(),
                })
                .collect();
            let next = match model.next_tokens(&rows) {
                Ok(next) => next,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            };
            for (&i, token) in open.iter().zip(next) {
                let s = &mut seqs[i];
                let Some(t) = token else {
                    s.open = false;
                    continue;
                };
                let state = self.scheduler.state_mut(s.id).expect("running requests are kept");
                if let Some(m) = state.matcher.as_mut() {
                    if m.accept(t).is_err() {
                        s.open = false;
                        continue;
                    }
                    s.open &= !m.is_finished();
                }
                s.tokens.push(t);
                s.sources.push(Proposer::Model);
                s.open &= s.tokens.len() - s.known < s.k;
            }
        }
        // The constraints back where the known tokens leave them; the drafts to the scheduler.
        for s in seqs {
            let drafted = s.tokens.len() - s.known;
            let state = self.scheduler.state_mut(s.id).expect("running requests are kept");
            if let Some(m) = state.matcher.as_mut() {
                let _ = m.rollback(drafted);
            }
            state.draft_sources = s.sources;
            self.scheduler.set_drafts(s.id, s.tokens[s.known..].to_vec());
        }
        if let Some(e) = failed {
            // Guesses only ever save time: without the draft model the requests decode as they
            // would have, so its failure costs the speed-up, never a request.
            tracing::warn!("quarry: the draft model failed ({e}); decoding on without it");
            self.draft_model = None;
            self.draft_model_failures += 1;
        }
    }

    /// Up to `k` guesses of a request's next tokens, within what it may still add,
    /// each one its constraint allows: prompt lookup's, and the constraint's forced tokens
    /// wherever it forces text after a draft (where jump-forward is off, also right after the
    /// last known token). Under jump-forward the forced tokens are those `update` would
    /// append, so that checking them gives the output it would.
    fn drafts(&mut self, id: RequestId, k: usize, config: SpeculativeConfig) -> (Vec<u32>, Vec<Proposer>) {
        let none = (Vec::new(), Vec::new());
        let room = self.room_after_next(id);
        let Some((r, state)) = self.scheduler.get_mut(id) else {
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
            if let Some(m) = matcher.as_deref_mut().filter(|_| forcing) {
                if config.grammar || context.len() > known {
                    match push_forced(&self.tokenizer, m, &mut context, &mut sources, left) {
                        None => break 'propose,
                        Some(0) => {}
                        Some(_) => continue,
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

/// Appends the tokens the grammar forces after the last of `tokens` (at most `left`), each
/// accepted by the matcher, as the grammar's drafts: how many, or `None` where the matcher
/// refused one (no draft may follow).
fn push_forced(
    tokenizer: &Tokenizer,
    m: &mut ContainedMatcher,
    tokens: &mut Vec<u32>,
    sources: &mut Vec<Proposer>,
    left: usize,
) -> Option<usize> {
    let last = *tokens.last().expect("drafts follow a known token");
    let forced = forced_after(tokenizer, m, last, left);
    for &t in &forced {
        m.accept(t).ok()?;
        tokens.push(t);
        sources.push(Proposer::Grammar);
    }
    Some(forced.len())
}
