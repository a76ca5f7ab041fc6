//! The KV cache's blocks, handed out by id (vLLM's block pool). A block is referenced by every
//! request whose block table holds it; a full block also carries the hash of the tokens it
//! holds (chained through the blocks before it), so a later request with the same prefix can
//! reuse it. Unreferenced blocks wait in a free queue, least recently freed first: allocation
//! takes from the front and evicts the cached prefix a block held, so the prefixes used last
//! survive longest. The runtime only ever sees the ids.

use std::collections::HashMap;

pub type BlockId = u32;
/// Hash of a full block's tokens, its parent's hash and the cache's extra keys (see
/// `KvCacheManager`). 128 bits: a collision would hand one request another's keys and values.
pub type BlockHash = u128;

/// Marks "no block" in the free queue's links; also the queue's sentinel index is `len`.
const NONE: u32 = u32::MAX;

pub struct BlockPool {
    ref_count: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    /// The free queue as a doubly linked list through the blocks, so a cached block that a new
    /// request takes back leaves the middle of the queue in O(1). Index `total` is the
    /// sentinel: `next[total]` is the front (least recently freed), `prev[total]` the back.
    prev: Vec<u32>,
    next: Vec<u32>,
    num_free: usize,
    cached: HashMap<BlockHash, BlockId>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        Self::with_order((0..num_blocks as BlockId).collect())
    }

    /// A pool whose free queue is shuffled by `seed`, so consecutive allocations land in
    /// scattered, non-contiguous blocks (tests of the paged layout).
    pub fn scattered(num_blocks: usize, seed: u64) -> Self {
        use rand::seq::SliceRandom;
        use rand::SeedableRng;
        let mut ids: Vec<BlockId> = (0..num_blocks as BlockId).collect();
        ids.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
        Self::with_order(ids)
    }

    fn with_order(order: Vec<BlockId>) -> Self {
        let n = order.len();
        let mut pool = BlockPool {
            ref_count: vec![0; n],
            hash: vec![None; n],
            prev: vec![NONE; n + 1],
            next: vec![NONE; n + 1],
            num_free: 0,
            cached: HashMap::new(),
        };
        let s = n as u32;
        pool.prev[n] = s;
        pool.next[n] = s;
        for b in order {
            pool.push_back(b);
        }
        pool
    }

    pub fn total(&self) -> usize {
        self.ref_count.len()
    }

    /// Blocks no request holds (cached ones included: they are evicted on demand).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Blocks that hold a reusable prefix, referenced or not.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_count[block as usize]
    }

    /// The block holding the prefix that ends in `hash`, if it is still cached.
    pub fn cached_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Takes a reference on blocks found in the prefix cache; unreferenced ones leave the free
    /// queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            if self.ref_count[b as usize] == 0 {
                self.unlink(b);
            }
            self.ref_count[b as usize] += 1;
        }
    }

    /// `n` blocks from the front of the free queue, each with one reference, or none at all
    /// when fewer are free. A block that held a cached prefix loses it.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.next[self.total()];
            self.unlink(b);
            if let Some(h) = self.hash[b as usize].take() {
                if self.cached.get(&h) == Some(&b) {
                    self.cached.remove(&h);
                }
            }
            self.ref_count[b as usize] = 1;
            out.push(b);
        }
        Some(out)
    }

    /// Drops one reference on each block, in order; a block nobody holds joins the back of
    /// the free queue (callers pass a request's blocks last first, so its tail is evicted
    /// before the prefix other requests are likelier to share).
    pub fn free(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for b in blocks {
            let rc = &mut self.ref_count[b as usize];
            assert!(*rc > 0, "block {b} freed more often than taken");
            *rc -= 1;
            if *rc == 0 {
                self.push_back(b);
            }
        }
    }

    /// Records that `block` (full, computed) holds the prefix ending in `hash`. A prefix
    /// already cached in another block keeps that block.
    pub fn cache(&mut self, block: BlockId, hash: BlockHash) {
        if self.hash[block as usize].is_some() {
            return;
        }
        self.hash[block as usize] = Some(hash);
        self.cached.entry(hash).or_insert(block);
    }

    /// Forgets every cached prefix (the blocks themselves stay where they are).
    pub fn reset_prefix_cache(&mut self) {
        self.cached.clear();
        self.hash.iter_mut().for_each(|h| *h = None);
    }

    fn push_back(&mut self, b: BlockId) {
        let s = self.total() as u32;
        let last = self.prev[s as usize];
        self.prev[b as usize] = last;
        self.next[b as usize] = s;
        self.next[last as usize] = b;
        self.prev[s as usize] = b;
        self.num_free += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        debug_assert!(p != NONE && n != NONE, "block {b} is not in the free queue");
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.prev[b as usize] = NONE;
        self.next[b as usize] = NONE;
        self.num_free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_freed_is_evicted_first() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(4).unwrap();
        assert_eq!(pool.num_free(), 0);
        assert!(pool.allocate(1).is_none());
        for (i, &b) in a.iter().enumerate() {
            pool.cache(b, i as BlockHash + 100);
        }
        pool.free([a[2], a[0], a[3], a[1]]);
        assert_eq!(pool.num_free(), 4);
        assert_eq!(pool.num_cached(), 4);
        // Block a[0] is taken back by a prefix hit: it leaves the middle of the queue.
        assert_eq!(pool.cached_block(100), Some(a[0]));
        pool.touch(&[a[0]]);
        assert_eq!((pool.num_free(), pool.ref_count(a[0])), (3, 1));
        // The rest go in the order they were freed, each losing its cached prefix.
        assert_eq!(pool.allocate(2).unwrap(), vec![a[2], a[3]]);
        assert_eq!(pool.cached_block(102), None);
        assert_eq!(pool.cached_block(101), Some(a[1]));
        assert_eq!(pool.num_cached(), 2);
        pool.touch(&[a[0]]);
        pool.free([a[0]]);
        assert_eq!(pool.ref_count(a[0]), 1, "a shared block stays while someone holds it");
        pool.free([a[0], a[2], a[3]]);
        assert_eq!(pool.num_free(), pool.total());
    }

    #[test]
    #[should_panic(expected = "freed more often")]
    fn double_free_is_caught() {
        let mut pool = BlockPool::new(2);
        let a = pool.allocate(1).unwrap();
        pool.free(a.clone());
        pool.free(a);
    }
}
