//! Hands out KV cache blocks by id. The engine issue grows this into vLLM's block pool (ref
//! counts, prefix hashes, LRU eviction); the runtime only ever sees the ids.

use std::collections::VecDeque;

pub struct BlockPool {
    free: VecDeque<u32>,
    total: usize,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        BlockPool {
            free: (0..num_blocks as u32).collect(),
            total: num_blocks,
        }
    }

    /// A pool whose free list is shuffled by `seed`, so consecutive allocations land in
    /// scattered, non-contiguous blocks (tests of the paged layout).
    pub fn scattered(num_blocks: usize, seed: u64) -> Self {
        use rand::seq::SliceRandom;
        use rand::SeedableRng;
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        ids.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
        BlockPool {
            free: ids.into(),
            total: num_blocks,
        }
    }

    /// `n` blocks, or none at all if fewer are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        (n <= self.free.len()).then(|| self.free.drain(..n).collect())
    }

    pub fn release(&mut self, blocks: impl IntoIterator<Item = u32>) {
        self.free.extend(blocks);
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn total(&self) -> usize {
        self.total
    }
}
