//! A draft model: a smaller model with the same tokenizer guesses the next tokens, one
//! forward pass per guess for every drafting request at once, on its own small paged KV cache.
//! Its cache keeps what it computed for each request; after a step it lacks only the tokens
//! the target model decided differently, so it catches up with a few tokens, not the prompt.

use std::collections::HashMap;

use quarry_grammar::is_allowed;

use crate::engine::kv_cache_manager::{KvCacheManager, RequestId};
use crate::engine::BlockPool;
use crate::runtime::{Backend, Draw, ForwardBatch, RowRequest, RuntimeError};

pub struct DraftModel {
    backend: Box<dyn Backend>,
    kv: KvCacheManager,
    /// Per request, the tokens whose keys and values the draft's cache holds, in order.
    held: HashMap<RequestId, Vec<u32>>,
    /// A pass's time, recent passes weighing most: what a guess costs.
    pass_seconds: Option<f64>,
}

/// One request's next guess: all its tokens so far (known, then drafted), and the grammar's
/// mask for the next one where it is constrained.
pub struct DraftRow<'a> {
    pub id: RequestId,
    pub tokens: &'a [u32],
    pub mask: Option<&'a [u32]>,
}

impl DraftModel {
    pub fn new(backend: Box<dyn Backend>) -> Self {
        let layout = backend.kv_layout();
        DraftModel {
            kv: KvCacheManager::new(BlockPool::new(layout.num_blocks), layout.block_size, 0, false),
            backend,
            held: HashMap::new(),
            pass_seconds: None,
        }
    }

    /// What one pass (one more guess for every drafting request) takes, once one has run.
    pub fn pass_seconds(&self) -> Option<f64> {
        self.pass_seconds
    }

    pub fn into_backend(self) -> Box<dyn Backend> {
        self.backend
    }

    /// Forgets the requests not in `keep` (finished, aborted or preempted): their slots go back.
    pub fn retain(&mut self, keep: &[RequestId]) {
        let gone: Vec<RequestId> = self.held.keys().filter(|id| !keep.contains(id)).copied().collect();
        for id in gone {
            self.held.remove(&id);
            self.kv.free(id);
        }
    }

    /// One pass of the draft model: each row's most likely next token under its mask, or
    /// `None` where its cache has no room (that request drafts no further this step).
    pub fn next_tokens(&mut self, rows: &[DraftRow<'_>]) -> Result<Vec<Option<u32>>, RuntimeError> {
        let block_size = self.kv.block_size();
        let mut batch = ForwardBatch::default();
        let mut fed = Vec::with_capacity(rows.len());
        for row in rows {
            let held = self.held.get(&row.id).map_or(&[][..], Vec::as_slice);
            let same = held.iter().zip(row.tokens).take_while(|(a, b)| a == b).count();
            // At least the last token goes in: its logits are the guess.
            let start = same.min(row.tokens.len() - 1);
            self.kv.truncate(row.id, start);
            if !self.kv.allocate_slots(row.id, row.tokens.len(), &[]) {
                self.held.remove(&row.id);
                self.kv.free(row.id);
                fed.push(false);
                continue;
            }
            batch.push_sequence(&row.tokens[start..], start, self.kv.block_table(row.id), block_size);
            batch.logits_rows.push(batch.token_ids.len() as u32 - 1);
            self.held.insert(row.id, row.tokens.to_vec());
            fed.push(true);
        }
        if batch.logits_rows.is_empty() {
            return Ok(vec![None; rows.len()]);
        }
        let started = std::time::Instant::now();
        self.backend.run(&batch)?;
        let greedy = Draw::GREEDY;
        let on_device = self.backend.draws_on_device();
        let requests: Vec<RowRequest<'_>> = rows
            .iter()
            .zip(&fed)
            .filter(|(_, &f)| f)
            .map(|(row, _)| RowRequest {
                mask: row.mask,
                draw: on_device.then_some(greedy),
                logits_back: true,
            })
            .collect();
        let sampled = self.backend.sample(&requests)?;
        let mut next = Vec::with_capacity(rows.len());
        let mut i = 0;
        for (row, &f) in rows.iter().zip(&fed) {
            if !f {
                next.push(None);
                continue;
            }
            next.push(match (sampled.tokens[i], sampled.host_row(i)) {
                (Some(t), _) => Some(t),
                (None, Some(logits)) => masked_argmax(logits, row.mask),
                (None, None) => None,
            });
            i += 1;
        }
        // A guess's cost is a decoding pass's: one that catches up with prompts costs more, once.
        if batch.num_tokens() <= 2 * batch.logits_rows.len() {
            let took = started.elapsed().as_secs_f64();
            self.pass_seconds = Some(self.pass_seconds.map_or(took, |s| 0.8 * s + 0.2 * took));
        }
        Ok(next)
    }
}

/// The first most likely token the mask allows (every token where there is no mask).
fn masked_argmax(logits: &[f32], mask: Option<&[u32]>) -> Option<u32> {
    let mut best: Option<(u32, f32)> = None;
    for (t, &v) in logits.iter().enumerate() {
        let t = t as u32;
        if mask.is_some_and(|m| !is_allowed(m, t)) {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((t, v));
        }
    }
    best.map(|(t, _)| t)
}
