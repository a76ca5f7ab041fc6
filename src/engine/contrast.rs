//! Context-aware decoding (Shi et al., 2023, "Trusting Your Evidence: Hallucinate Less with
//! Context-aware Decoding"): a small model follows its prior where the document says otherwise,
//! `USD` for a document in euros, a line number for a line's item. A contrasting request's
//! tokens are drawn from `(1 + w) * logits(with the document) - w * logits(without it)`, which
//! rewards what the document makes likelier and takes back what the model would say anyway.
//!
//! The logits without the document come from a twin: the request's shadow sequence
//! (`Request::shadow`), its prompt with the document left out (`SamplingParams::contrast`), fed
//! the same output and drafts, in the same forward pass and on blocks of the same cache. The
//! scheduler plans the twin's blocks with its request's and preempts for them as for the
//! request, so a request is contrasted at every step whatever else runs: its record does not
//! depend on the load. The twin's prompt starts as the request's does (the instructions, the
//! schema), so it takes those blocks from the prefix cache where an earlier request left them.

use super::kv_cache_manager::{KvCacheManager, RequestId};
use super::request::Request;
use super::scheduler::SHADOW;
use crate::runtime::ForwardBatch;

/// Puts request `r`'s twin into `batch`, as the scheduler planned it: its tokens (the shadow
/// prompt, the output, the step's `drafts`) from `start` on, with a logits row for the last
/// known token and each draft (the rows the request itself samples). Returns the twin's first
/// logits row.
pub fn push_twin(
    batch: &mut ForwardBatch,
    kv: &KvCacheManager,
    r: &Request,
    start: usize,
    drafts: &[u32],
) -> Option<usize> {
    let prompt = r.shadow.as_ref()?;
    // Only what this step feeds: the tokens from `start` on.
    let tokens: Vec<u32> = prompt
        .iter()
        .chain(&r.output)
        .chain(drafts)
        .skip(start)
        .copied()
        .collect();
    batch.push_sequence(&tokens, start, kv.block_table(r.id | SHADOW), kv.block_size());
    let first = batch.logits_rows.len();
    let end = batch.token_ids.len();
    batch
        .logits_rows
        .extend((end - 1 - drafts.len()..end).map(|p| p as u32));
    Some(first)
}

/// Whether `id` is an id a request may have (its twin's must not be one).
pub fn allows(id: RequestId) -> bool {
    id & SHADOW == 0
}

/// The logits a contrasting row is drawn from: `(1 + weight) * with - weight * without`.
pub fn contrast(with: &[f32], without: &[f32], weight: f32) -> Vec<f32> {
    with.iter()
        .zip(without)
        .map(|(&a, &b)| (1.0 + weight) * a - weight * b)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_weight_of_one_against_the_same_logits_gives_them_back_exactly() {
        let logits = [-3.25f32, 0.0, 7.5, 1e-3, -1e4, 12.125];
        assert_eq!(contrast(&logits, &logits, 1.0), logits);
        let other = [0.0f32, 1.0, 0.0, 0.0, 0.0, 2.0];
        assert_eq!(contrast(&logits, &other, 0.5)[1], -0.5);
        assert_eq!(contrast(&logits, &other, 0.5)[5], 1.5 * 12.125 - 1.0);
    }
}
