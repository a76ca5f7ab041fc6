//! One flattened forward pass over several sequences, in the vLLM layout: the tokens of all
//! sequences are concatenated; each sequence has a span of query tokens (a prefill chunk or a
//! single decode token) and a block table into the paged KV cache.

use super::error::{Result, RuntimeError};

/// KV cache geometry shared by the backend (which owns the memory) and the block allocator
/// (which hands out block ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub num_blocks: usize,
    pub block_size: usize,
}

impl KvLayout {
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

#[derive(Debug, Clone, Default)]
pub struct ForwardBatch {
    /// Token ids of every query token, sequence after sequence.
    pub token_ids: Vec<u32>,
    /// Absolute position of each query token within its sequence.
    pub positions: Vec<u32>,
    /// KV slot (block id * block size + offset) each query token's key and value go to.
    pub slot_mapping: Vec<u32>,
    /// `query_start[s]..query_start[s + 1]` are sequence `s`'s rows; length is sequences + 1.
    pub query_start: Vec<u32>,
    /// Tokens in each sequence's KV after this pass (cached context plus its query tokens).
    pub context_lens: Vec<u32>,
    /// Block ids of each sequence, in order; must cover `context_lens[s]` tokens.
    pub block_tables: Vec<Vec<u32>>,
    /// Rows (indices into `token_ids`) whose logits the caller wants, in output order.
    pub logits_rows: Vec<u32>,
}

impl ForwardBatch {
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    pub fn num_seqs(&self) -> usize {
        self.query_start.len().saturating_sub(1)
    }

    /// The most query tokens any sequence has; `None` for a batch of no sequences.
    pub fn longest_query(&self) -> Option<usize> {
        self.query_start.windows(2).map(|w| (w[1] - w[0]) as usize).max()
    }

    /// Appends one sequence's query span. Slots are derived from the block table, so callers
    /// cannot get the two out of step.
    pub fn push_sequence(&mut self, tokens: &[u32], start_pos: usize, block_table: &[u32], block_size: usize) {
        if self.query_start.is_empty() {
            self.query_start.push(0);
        }
        for (i, &t) in tokens.iter().enumerate() {
            let pos = start_pos + i;
            self.token_ids.push(t);
            self.positions.push(pos as u32);
            let block = block_table.get(pos / block_size).copied().unwrap_or(u32::MAX);
            let slot = (block as usize)
                .checked_mul(block_size)
                .map(|s| s + pos % block_size)
                .unwrap_or(usize::MAX);
            self.slot_mapping.push(u32::try_from(slot).unwrap_or(u32::MAX));
        }
        self.query_start.push(self.token_ids.len() as u32);
        self.context_lens.push((start_pos + tokens.len()) as u32);
        self.block_tables.push(block_table.to_vec());
    }

    /// Checks every index a backend will follow, so a bad batch is an error, never an
    /// out-of-bounds access on the device or in the pool.
    pub fn validate(&self, layout: KvLayout, vocab_size: usize, max_positions: usize) -> Result<()> {
        self.validate_drawing(layout, vocab_size, max_positions, &[])
    }

    /// `validate`, where token ids marked `FROM_LAST_DRAW` may stand for the rows of the last
    /// draw that `drawn` says were drawn where the backend can read them.
    pub fn validate_drawing(
        &self,
        layout: KvLayout,
        vocab_size: usize,
        max_positions: usize,
        drawn: &[bool],
    ) -> Result<()> {
        let bad = |m: String| Err(RuntimeError::InvalidBatch(m));
        let n = self.num_tokens();
        if n == 0 {
            return bad("no tokens".into());
        }
        if self.positions.len() != n || self.slot_mapping.len() != n {
            return bad("token_ids, positions and slot_mapping differ in length".into());
        }
        let seqs = self.num_seqs();
        if self.query_start.first() != Some(&0) || self.query_start.last() != Some(&(n as u32)) {
            return bad("query_start must run from 0 to the number of tokens".into());
        }
        if self.context_lens.len() != seqs || self.block_tables.len() != seqs {
            return bad("context_lens and block_tables need one entry per sequence".into());
        }
        for &t in &self.token_ids {
            let from_draw = t & super::FROM_LAST_DRAW != 0;
            let row = (t & !super::FROM_LAST_DRAW) as usize;
            if from_draw && !drawn.get(row).copied().unwrap_or(false) {
                return bad(format!(
                    "a token stands for row {row} of the last draw, which did not draw it"
                ));
            }
            if !from_draw && t as usize >= vocab_size {
                return bad(format!("token id {t} outside the vocabulary of {vocab_size}"));
            }
        }
        if let Some(&s) = self.slot_mapping.iter().find(|&&s| s as usize >= layout.num_slots()) {
            return bad(format!("slot {s} outside the KV pool of {} slots", layout.num_slots()));
        }
        // Backends write the tokens' keys and values in parallel.
        let mut slots = self.slot_mapping.clone();
        slots.sort_unstable();
        if let Some(w) = slots.windows(2).find(|w| w[0] == w[1]) {
            return bad(format!("two tokens write KV slot {}", w[0]));
        }
        for s in 0..seqs {
            let (lo, hi) = (self.query_start[s] as usize, self.query_start[s + 1] as usize);
            if lo >= hi {
                return bad(format!("sequence {s} has no query tokens"));
            }
            let ctx = self.context_lens[s] as usize;
            if ctx > max_positions {
                return bad(format!(
                    "sequence {s} has {ctx} tokens, the model allows {max_positions}"
                ));
            }
            if self.block_tables[s].len() * layout.block_size < ctx {
                return bad(format!("sequence {s}: block table too short for {ctx} tokens"));
            }
            if let Some(&b) = self.block_tables[s].iter().find(|&&b| b as usize >= layout.num_blocks) {
                return bad(format!("sequence {s}: block {b} outside the pool"));
            }
            for row in lo..hi {
                let pos = self.positions[row] as usize;
                if pos >= ctx {
                    return bad(format!("row {row}: position {pos} beyond context length {ctx}"));
                }
                let want = self.block_tables[s][pos / layout.block_size] as usize * layout.block_size
                    + pos % layout.block_size;
                if self.slot_mapping[row] as usize != want {
                    return bad(format!("row {row}: slot does not match the block table"));
                }
            }
        }
        if let Some(&r) = self.logits_rows.iter().find(|&&r| r as usize >= n) {
            return bad(format!("logits row {r} outside the batch"));
        }
        Ok(())
    }
}

/// Logits of the rows asked for, row-major `[rows, vocab]`.
#[derive(Debug, Clone, Default)]
pub struct Logits {
    pub vocab_size: usize,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn rows(&self) -> usize {
        self.data.len() / self.vocab_size.max(1)
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab_size..(i + 1) * self.vocab_size]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_whose_tokens_share_a_kv_slot_is_refused() {
        let layout = KvLayout {
            num_blocks: 4,
            block_size: 16,
        };
        let mut batch = ForwardBatch::default();
        batch.push_sequence(&[1, 2, 3], 0, &[2], 16);
        batch.logits_rows.push(2);
        assert!(batch.validate(layout, 100, 64).is_ok());
        // A second sequence pointing at the same block and positions: its tokens would write
        // the first one's slots (the backend writes tokens in parallel).
        batch.push_sequence(&[4], 1, &[2], 16);
        let err = batch.validate(layout, 100, 64).unwrap_err().to_string();
        assert!(err.contains("two tokens write KV slot 33"), "{err}");
    }
}
