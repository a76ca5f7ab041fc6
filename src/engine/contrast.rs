//! Context-aware decoding (Shi et al., 2023, "Trusting Your Evidence: Hallucinate Less with
//! Context-aware Decoding"): a small model follows its prior where the document says otherwise,
//! `USD` for a document in euros, a line number for a line's item. A contrasting request's
//! tokens are drawn from `(1 + w) * logits(with the document) - w * logits(without it)`, which
//! rewards what the document makes likelier and takes back what the model would say anyway.
//!
//! The logits without the document come from a twin: the request's prompt with the document
//! left out (`SamplingParams::contrast`), fed the same output and drafts, in the same forward
//! pass and on blocks of the same cache. The twin's prompt starts as the request's does (the
//! instructions, the schema), so it takes those blocks from the prefix cache; it joins from
//! the request's first step that feeds no prompt token, once they are cached, and the first
//! token is drawn without it. Twins yield to the requests: a twin takes blocks only where a
//! block per running request stays free after it (otherwise requests would be preempted for
//! their own twins' sake), and where it cannot, its request's step goes without contrast.

use std::collections::HashMap;

use super::kv_cache_manager::{KvCacheManager, RequestId};
use crate::runtime::ForwardBatch;

/// A twin's id in the cache: the request's with the top bit set (request ids stay below it).
const TWIN: RequestId = 1 << 63;

/// The twins of the contrasting requests: what each one's blocks hold.
#[derive(Default)]
pub struct Twins {
    /// Per request, the tokens whose keys and values its twin's blocks hold, in order.
    held: HashMap<RequestId, Vec<u32>>,
}

impl Twins {
    /// Puts request `id`'s twin into `batch`: `known` (its prompt, then the request's output),
    /// then the request's `drafts`, feeding only what its blocks lack, with a logits row for
    /// the last known token and each draft (the rows the request itself samples). Returns the
    /// twin's first logits row, or `None` where the cache would keep fewer than `reserve`
    /// blocks free after it (the twin is dropped).
    pub fn push(
        &mut self,
        kv: &mut KvCacheManager,
        reserve: usize,
        batch: &mut ForwardBatch,
        id: RequestId,
        known: &[u32],
        drafts: &[u32],
    ) -> Option<usize> {
        let twin = id | TWIN;
        let tokens: Vec<u32> = [known, drafts].concat();
        let sampled = 1 + drafts.len();
        let mut start = match self.held.get(&id) {
            Some(held) => held.iter().zip(&tokens).take_while(|(a, b)| a == b).count(),
            None => 0,
        };
        let mut cached = Vec::new();
        if !self.held.contains_key(&id) {
            (cached, start) = kv.get_computed_blocks(known);
        }
        // The sampled rows are fed again even where the blocks hold them: their logits are wanted.
        start = start.min(tokens.len() - sampled);
        kv.truncate(twin, start);
        let held = kv.block_table(twin).len().max(cached.len());
        let needed = kv.blocks_for(tokens.len()).saturating_sub(held);
        if kv.num_free_blocks() < needed + reserve || !kv.allocate_slots(twin, tokens.len(), &cached) {
            self.release(kv, id);
            return None;
        }
        batch.push_sequence(&tokens[start..], start, kv.block_table(twin), kv.block_size());
        let first = batch.logits_rows.len();
        let end = batch.token_ids.len();
        batch.logits_rows.extend((end - sampled..end).map(|p| p as u32));
        self.held.insert(id, tokens);
        Some(first)
    }

    /// Frees request `id`'s twin (finished, aborted, preempted).
    pub fn release(&mut self, kv: &mut KvCacheManager, id: RequestId) {
        if self.held.remove(&id).is_some() {
            kv.free(id | TWIN);
        }
    }

    /// Whether `id` is an id a request may have (its twin's must not be one).
    pub fn allows(id: RequestId) -> bool {
        id & TWIN == 0
    }
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
    use crate::engine::BlockPool;

    #[test]
    fn a_weight_of_one_against_the_same_logits_gives_them_back_exactly() {
        let logits = [-3.25f32, 0.0, 7.5, 1e-3, -1e4, 12.125];
        assert_eq!(contrast(&logits, &logits, 1.0), logits);
        let other = [0.0f32, 1.0, 0.0, 0.0, 0.0, 2.0];
        assert_eq!(contrast(&logits, &other, 0.5)[1], -0.5);
        assert_eq!(contrast(&logits, &other, 0.5)[5], 1.5 * 12.125 - 1.0);
    }

    #[test]
    fn a_twin_feeds_only_what_its_blocks_lack_and_gives_every_block_back() {
        let mut kv = KvCacheManager::new(BlockPool::new(16), 4, 0, false);
        let free = kv.num_free_blocks();
        let mut twins = Twins::default();
        let prompt = [1, 2, 3, 4, 5, 6];
        let mut batch = ForwardBatch::default();
        let row = twins.push(&mut kv, 0, &mut batch, 7, &prompt, &[]);
        assert_eq!(row, Some(0));
        assert_eq!(batch.token_ids, prompt);
        assert_eq!(batch.logits_rows, [5]);
        // Two drafts after an output token: the output token and the drafts go in.
        let mut batch = ForwardBatch::default();
        let row = twins.push(&mut kv, 0, &mut batch, 7, &[&prompt[..], &[9]].concat(), &[10, 11]);
        assert_eq!(row, Some(0));
        assert_eq!((batch.token_ids.as_slice(), batch.positions[0]), (&[9, 10, 11][..], 6));
        assert_eq!(batch.logits_rows, [0, 1, 2]);
        // The first draft was kept and the second not: the kept one's row is wanted again.
        let mut batch = ForwardBatch::default();
        twins.push(&mut kv, 0, &mut batch, 7, &[&prompt[..], &[9, 10, 12]].concat(), &[]);
        assert_eq!((batch.token_ids.as_slice(), batch.positions[0]), (&[12][..], 8));
        assert_eq!(kv.block_table(7 | TWIN).len(), 3);
        twins.release(&mut kv, 7);
        assert_eq!(kv.num_free_blocks(), free);
    }

    #[test]
    fn a_twin_without_room_is_dropped() {
        let mut kv = KvCacheManager::new(BlockPool::new(2), 4, 0, false);
        let mut twins = Twins::default();
        let mut batch = ForwardBatch::default();
        assert_eq!(twins.push(&mut kv, 0, &mut batch, 3, &[1; 12], &[]), None);
        // Room for the twin, but not for the reserve the running requests keep.
        assert_eq!(twins.push(&mut kv, 1, &mut batch, 3, &[1; 8], &[]), None);
        assert!(batch.token_ids.is_empty());
        assert_eq!(kv.num_free_blocks(), 2);
        assert_eq!(twins.push(&mut kv, 0, &mut batch, 3, &[1; 8], &[]), Some(0));
        twins.release(&mut kv, 3);
        assert_eq!(kv.num_free_blocks(), 2);
    }
}
