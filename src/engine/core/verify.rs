//! Drawing a sampled request's rows: each as decoding would draw it there (the grammar's mask,
//! the copy prior, penalties, the budget's room), keeping the drafts the model agrees with.

use quarry_grammar::is_allowed;

use super::{EngineCore, Sampling, State};
use crate::engine::contained::ContainedMatcher;
use crate::engine::contrast::contrast;
use crate::engine::proposers::forced_after;
use crate::runtime::{RowDraw, RuntimeError};
use crate::sampling::{SampledToken, TokenConfidence, TopLogprob};
use crate::tokenizer::Tokenizer;

impl EngineCore {
    /// Draws a request's rows in order, each under the state the tokens before it leave
    /// (penalties, copy prior, the budget's room), as long as the token drawn is the draft the
    /// row checks: those drafts and the first token that differs (or the one after the last
    /// draft) make the run. Drawing a row is what decoding without drafts does at that
    /// position, so the run is the output it would give, greedy or seeded. (Every proposer
    /// guesses one token, not a distribution; for such a guess, keeping it exactly when the
    /// draw equals it is rejection sampling: kept with the target's probability of it, else a
    /// draw from the rest.) Under jump-forward,
    /// forced tokens after a kept draft are kept where the drafts spell them as `update`
    /// would; where they do not, the run ends and `update` appends them.
    pub(super) fn verify(
        &mut self,
        v: &Sampling,
        decided: &crate::runtime::Sampled,
        grammar: &[RowGrammar],
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
            let budget = self
                .scheduler
                .state(id)
                .expect("sampling requests are kept")
                .sampler
                .params()
                .max_tokens
                .saturating_sub(r.output.len());
            move |m: usize| context.saturating_sub(m).min(budget.saturating_sub(m))
        };
        let eog = self.tokenizer.end_of_generation_ids();
        let state = self.scheduler.state_mut(id).expect("sampling requests are kept");
        let mut run: Vec<SampledToken> = Vec::with_capacity(v.rows());
        let mut advanced = 0;
        let mut j = 0;
        let outcome = loop {
            let row = v.first_row + j;
            let left = room.saturating_sub(run.len());
            let sampled = match (decided.tokens[row], decided.host_row(row)) {
                (Some(token), _) => {
                    let drawn = RowDraw {
                        token,
                        logprobs: decided.logprobs.get(row).cloned().flatten(),
                        confidence: decided.confidence.get(row).copied().flatten(),
                    };
                    match keep_within(state, self.backend.as_mut(), &self.tokenizer, row, drawn, left, words) {
                        Ok(s) => s,
                        Err(e) => break Err(e),
                    }
                }
                (None, Some(logits)) => {
                    let contrasted = v.twin.and_then(|(twin, weight)| {
                        let without = decided.host_row(twin + j)?;
                        Some(contrast(logits, without, weight))
                    });
                    let logits = contrasted.as_deref().unwrap_or(logits);
                    draw_within(state, &self.tokenizer, logits, &grammar[row], left, words)
                }
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
            // Forced tokens come from the matcher itself; a refusal ends the run, so rows stay
            // in step with the drafts.
            let kept = forced.iter().take_while(|&&t| m.accept(t).is_ok()).count();
            advanced += kept;
            run.extend(forced[..kept].iter().map(|&t| state.sampler.forced(t)));
            if kept < forced.len() {
                break Ok(());
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
}

/// What the grammar says of a sampled row before it is drawn, worked out while the model runs:
/// the tokens it allows (none for an unconstrained request, or a row after a draft it refuses)
/// and the copy bias's tokens and weight there.
#[derive(Debug, Clone, Default)]
pub(super) struct RowGrammar {
    pub mask: Option<Vec<u32>>,
    pub copy: Option<(Vec<u32>, f32)>,
}

/// The token a backend drew for a row, kept if the output can still close within `room` more
/// tokens; otherwise drawn again where the logits are, under the mask that keeps room: the same
/// choice `draw_within` makes on the host.
fn keep_within(
    state: &mut State,
    backend: &mut dyn crate::runtime::Backend,
    tokenizer: &Tokenizer,
    row: usize,
    drawn: RowDraw,
    room: usize,
    words: usize,
) -> Result<SampledToken, RuntimeError> {
    let mut drawn = drawn;
    if let Some(m) = state.matcher.as_mut() {
        if let Some(tight) = room_keeping_mask(m, drawn.token, room, words) {
            state.metrics.budget_closed = true;
            drawn = backend.redraw_within(row, &tight)?;
        }
    }
    let confidence = drawn
        .confidence
        .map(|c| decided_by_grammar(state, tokenizer, drawn.token, c));
    Ok(state.sampler.take(
        drawn.token,
        drawn.logprobs.map(|l| {
            let top = l.top.into_iter().map(|(token, logprob)| TopLogprob { token, logprob });
            (l.logprob, top.collect())
        }),
        confidence,
    ))
}

/// A drawn token whose text the grammar had already decided (it lies within the bytes forced
/// from here) tells no more than a forced one, whichever spelling of that text the model chose
/// (a key in several pieces or in one): its confidence is the grammar's, so that confidence is
/// the same with jump-forward on or off. Asked before the matcher takes the token.
fn decided_by_grammar(state: &mut State, tokenizer: &Tokenizer, token: u32, c: TokenConfidence) -> TokenConfidence {
    let Some(m) = state.matcher.as_mut() else { return c };
    if c.choices <= 1 {
        return c;
    }
    let forced = m.forced_bytes();
    match tokenizer.decode(&[token], false) {
        Ok(text) if !text.is_empty() && forced.starts_with(text.as_bytes()) => TokenConfidence::SOLE,
        _ => c,
    }
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
pub(super) fn copy_prior(m: &mut ContainedMatcher, bias: f32) -> Option<(Vec<u32>, f32)> {
    if bias <= 0.0 {
        return None;
    }
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
fn draw_within(
    state: &mut State,
    tokenizer: &Tokenizer,
    logits: &[f32],
    row: &RowGrammar,
    room: usize,
    words: usize,
) -> SampledToken {
    let mut sampled = draw_within_room(state, logits, row, room, words);
    if let Some(c) = sampled.confidence {
        sampled.confidence = Some(decided_by_grammar(state, tokenizer, sampled.token, c));
    }
    sampled
}

/// `draw_within` before the confidence is judged.
fn draw_within_room(state: &mut State, logits: &[f32], row: &RowGrammar, room: usize, words: usize) -> SampledToken {
    let (copying, bias) = match &row.copy {
        Some((c, b)) => (Some(c), *b),
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
    let Some(mask) = row.mask.as_deref() else {
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
