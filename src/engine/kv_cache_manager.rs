//! Which KV blocks each request holds (vLLM's KV cache manager): prefix-cache lookup for new
//! requests, slots for each step's new tokens, caching of blocks as they fill, and freeing.
//!
//! A full block is known by a chained hash: its parent block's hash, its tokens and the
//! cache's extra key (the model, so two models never share a cache entry). Equal hashes mean
//! equal prefixes, so the block's keys and values can be reused as they are.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::ops::Range;

use super::block_pool::{BlockHash, BlockId, BlockPool};

pub type RequestId = u64;

/// Tokens looked up in the prefix cache, and how many were found there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    pub queried_tokens: u64,
    pub hit_tokens: u64,
}

impl PrefixCacheStats {
    pub fn hit_rate(&self) -> f64 {
        if self.queried_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.queried_tokens as f64
        }
    }
}

/// How a cache names its full blocks: two caches with equal hashers give a prefix the same
/// hashes (disaggregated serving hands blocks between them by hash).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    pub block_size: usize,
    extra_key: u64,
}

impl BlockHasher {
    /// The chained hashes of the full blocks of `tokens`, which follow the block of hash
    /// `parent` (`None`: they start the sequence).
    pub fn chain(&self, parent: Option<BlockHash>, tokens: &[u32]) -> Vec<BlockHash> {
        let mut parent = parent.unwrap_or(self.extra_key as BlockHash);
        tokens
            .chunks_exact(self.block_size)
            .map(|block| {
                // Two independently seeded 64-bit hashes make the 128.
                let half = |seed: u8| {
                    let mut h = DefaultHasher::new();
                    (seed, parent, block, self.extra_key).hash(&mut h);
                    h.finish() as BlockHash
                };
                parent = (half(1) << 64) | half(2);
                parent
            })
            .collect()
    }
}

#[derive(Default)]
struct Table {
    blocks: Vec<BlockId>,
    /// Hashes of the leading full blocks already entered in the pool's cache.
    hashes: Vec<BlockHash>,
}

pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    extra_key: u64,
    caching: bool,
    tables: HashMap<RequestId, Table>,
    stats: PrefixCacheStats,
}

impl KvCacheManager {
    /// `extra_key` separates caches that must not mix (say, a hash of the model's name);
    /// `caching` turns automatic prefix caching on.
    pub fn new(pool: BlockPool, block_size: usize, extra_key: u64, caching: bool) -> Self {
        KvCacheManager {
            pool,
            block_size,
            extra_key,
            caching,
            tables: HashMap::new(),
            stats: PrefixCacheStats::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether automatic prefix caching is on.
    pub fn caching(&self) -> bool {
        self.caching
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Forgets every cached prefix, the requests' own record of theirs too: after a failed
    /// pipelined step, blocks it was to compute may already be cached.
    pub fn forget_prefixes(&mut self) {
        self.pool.reset_prefix_cache();
        self.tables.values_mut().for_each(|t| t.hashes.clear());
    }

    pub fn stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Fraction of the blocks some request holds.
    pub fn usage(&self) -> f64 {
        1.0 - self.pool.num_free() as f64 / self.pool.total().max(1) as f64
    }

    /// The chained hashes of the full blocks of `tokens`.
    pub fn block_hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        self.block_hashes_from(None, tokens)
    }

    /// The chained hashes of the full blocks of `tokens`, which follow the block of hash
    /// `parent` (`None`: they start the sequence).
    fn block_hashes_from(&self, parent: Option<BlockHash>, tokens: &[u32]) -> Vec<BlockHash> {
        self.hasher().chain(parent, tokens)
    }

    /// What names this cache's blocks, for another party that must name them alike.
    pub fn hasher(&self) -> BlockHasher {
        BlockHasher {
            block_size: self.block_size,
            extra_key: self.extra_key,
        }
    }

    /// The longest run of cached blocks that starts `tokens`, and the tokens they hold. At
    /// least the last token is always left to compute: its logits are needed.
    pub fn get_computed_blocks(&mut self, tokens: &[u32]) -> (Vec<BlockId>, usize) {
        if !self.caching || tokens.is_empty() {
            return (Vec::new(), 0);
        }
        let usable = (tokens.len() - 1) / self.block_size;
        let blocks: Vec<BlockId> = self
            .block_hashes(&tokens[..usable * self.block_size])
            .into_iter()
            .map_while(|h| self.pool.cached_block(h))
            .collect();
        let hit = blocks.len() * self.block_size;
        self.stats.queried_tokens += tokens.len() as u64;
        self.stats.hit_tokens += hit as u64;
        (blocks, hit)
    }

    /// Grows request `id`'s block table to hold `total_tokens` tokens; on its first call the
    /// table starts with `computed` (from `get_computed_blocks`). False, with nothing changed,
    /// when the pool has too few free blocks.
    pub fn allocate_slots(&mut self, id: RequestId, total_tokens: usize, computed: &[BlockId]) -> bool {
        let held = self.tables.get(&id).map_or(0, |t| t.blocks.len());
        let start = if held == 0 { computed } else { &[] };
        let needed = total_tokens
            .div_ceil(self.block_size)
            .saturating_sub(held + start.len());
        // Cached blocks nobody holds sit in the free queue: taking them uses it up too.
        let revived = start.iter().filter(|&&b| self.pool.ref_count(b) == 0).count();
        if needed + revived > self.pool.num_free() {
            return false;
        }
        self.pool.touch(start);
        let fresh = self.pool.allocate(needed).expect("checked above");
        let table = self.tables.entry(id).or_default();
        table.blocks.extend_from_slice(start);
        table.blocks.extend(fresh);
        true
    }

    /// Enters the blocks of request `id` that its first `computed` tokens fill completely into
    /// the prefix cache. `tokens(range)` gives the request's tokens in `range`; it is called
    /// only when a block has newly filled (this runs for every request after every step).
    pub fn cache_blocks(&mut self, id: RequestId, computed: usize, tokens: impl FnOnce(Range<usize>) -> Vec<u32>) {
        if !self.caching {
            return;
        }
        let Some(table) = self.tables.get(&id) else {
            return;
        };
        let full = (computed / self.block_size).min(table.blocks.len());
        if full <= table.hashes.len() {
            return;
        }
        // Each hash chains on the one before: the new ones continue from the last known.
        let known = table.hashes.len();
        let new = tokens(known * self.block_size..full * self.block_size);
        let hashes = self.block_hashes_from(table.hashes.last().copied(), &new);
        let table = self.tables.get_mut(&id).expect("looked up above");
        for (i, &h) in hashes.iter().enumerate() {
            self.pool.cache(table.blocks[known + i], h);
        }
        table.hashes.extend(hashes);
    }

    /// Shrinks request `id`'s table to the blocks that hold its first `tokens` tokens, giving
    /// back the rest (last first): the slots of draft tokens a verification rejected, taken
    /// ahead by `allocate_slots`. The blocks kept must not be cached ones: `cache_blocks` is
    /// only ever given accepted tokens, so a cached block never holds a token that can be
    /// rejected, and a shared one is never written again.
    pub fn truncate(&mut self, id: RequestId, tokens: usize) {
        let Some(table) = self.tables.get_mut(&id) else {
            return;
        };
        assert!(
            tokens >= table.hashes.len() * self.block_size,
            "request {id}: truncating to {tokens} tokens would cut into its cached blocks"
        );
        let keep = tokens.div_ceil(self.block_size);
        if keep < table.blocks.len() {
            let dropped = table.blocks.split_off(keep);
            self.pool.free(dropped.into_iter().rev());
        }
    }

    /// Request `id`'s blocks, in order.
    pub fn block_table(&self, id: RequestId) -> &[BlockId] {
        self.tables.get(&id).map_or(&[], |t| t.blocks.as_slice())
    }

    /// Gives back every block of request `id` (finished, aborted or preempted); cached blocks
    /// stay reusable until evicted.
    pub fn free(&mut self, id: RequestId) {
        if let Some(t) = self.tables.remove(&id) {
            self.pool.free(t.blocks.into_iter().rev());
        }
    }

    /// How many leading blocks of the chain `hashes` are cached (nothing is held).
    pub fn cached_run(&self, hashes: &[BlockHash]) -> usize {
        if !self.caching {
            return 0;
        }
        hashes
            .iter()
            .take_while(|&&h| self.pool.cached_block(h).is_some())
            .count()
    }

    /// Disaggregated serving, sending side: the leading blocks of the chain `hashes` that are
    /// still cached, each held (so not evicted or written) until `let_go`.
    pub fn hold_cached(&mut self, hashes: &[BlockHash]) -> Vec<BlockId> {
        let blocks: Vec<BlockId> = hashes.iter().map_while(|&h| self.pool.cached_block(h)).collect();
        self.pool.touch(&blocks);
        blocks
    }

    /// Drops the hold `hold_cached` or `hold_chain` took on `blocks`.
    pub fn let_go(&mut self, blocks: &[BlockId]) {
        self.pool.free(blocks.iter().rev().copied());
    }

    /// Disaggregated serving, receiving side: blocks for the chain `hashes` (a prompt's full
    /// blocks), held: the leading ones this cache has already, then fresh ones for as many of
    /// the rest as the pool has free, leaving `keep_free` blocks. Returns them and how many
    /// were cached; the fresh ones are to be filled by a transfer, then `enter_chain`.
    pub fn hold_chain(&mut self, hashes: &[BlockHash], keep_free: usize) -> (Vec<BlockId>, usize) {
        if !self.caching {
            return (Vec::new(), 0);
        }
        let mut blocks = self.hold_cached(hashes);
        let cached = blocks.len();
        let fresh = (hashes.len() - cached).min(self.pool.num_free().saturating_sub(keep_free));
        blocks.extend(self.pool.allocate(fresh).expect("no more than are free"));
        (blocks, cached)
    }

    /// Enters the first `filled` of `blocks` (held by `hold_chain`, now holding the chain
    /// `hashes`) into the prefix cache, then lets go of them all: unfilled ones go back as
    /// free blocks, filled ones stay cached until a request takes them or they are evicted.
    pub fn enter_chain(&mut self, blocks: &[BlockId], hashes: &[BlockHash], filled: usize) {
        for (&b, &h) in blocks.iter().zip(hashes).take(filled) {
            self.pool.cache(b, h);
        }
        self.let_go(blocks);
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    /// Blocks needed for `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manager(blocks: usize) -> KvCacheManager {
        KvCacheManager::new(BlockPool::new(blocks), 4, 7, true)
    }

    #[test]
    fn a_shared_prefix_is_found_and_shared() {
        let mut m = manager(8);
        let prompt: Vec<u32> = (0..10).collect();
        let (hit, n) = m.get_computed_blocks(&prompt);
        assert_eq!((hit.len(), n), (0, 0));
        assert!(m.allocate_slots(1, 10, &hit));
        assert_eq!(m.block_table(1).len(), 3);
        m.cache_blocks(1, 10, |r| prompt[r].to_vec());
        assert_eq!(m.pool().num_cached(), 2, "two full blocks");

        // Same first 8 tokens: two blocks reused, held by both requests.
        let other: Vec<u32> = (0..8).chain([99, 98, 97]).collect();
        let (hit, n) = m.get_computed_blocks(&other);
        assert_eq!(n, 8);
        assert_eq!(hit, m.block_table(1)[..2]);
        assert!(m.allocate_slots(2, 11, &hit));
        assert_eq!(m.block_table(2)[..2], m.block_table(1)[..2]);
        assert_eq!(m.pool().ref_count(hit[0]), 2);
        assert_eq!(m.num_free_blocks(), 8 - 3 - 1);

        // A prompt that is exactly cached still leaves its last token to compute.
        let (_, n) = m.get_computed_blocks(&prompt[..8]);
        assert_eq!(n, 4);

        m.free(1);
        m.free(2);
        assert_eq!(m.num_free_blocks(), 8);
        // Freed, but still cached: a third request finds the prefix.
        let (hit, n) = m.get_computed_blocks(&prompt);
        assert_eq!(n, 8);
        assert!(m.allocate_slots(3, 10, &hit));
        assert_eq!(m.num_free_blocks(), 5);
        m.free(3);
        assert_eq!(m.stats().hit_tokens, 8 + 4 + 8);
    }

    #[test]
    fn truncating_gives_back_the_blocks_taken_ahead_and_keeps_the_cache_whole() {
        let mut m = manager(8);
        let tokens: Vec<u32> = (0..10).collect();
        // 10 tokens and 8 slots ahead for drafts: 5 blocks of 4.
        assert!(m.allocate_slots(1, 18, &[]));
        assert_eq!(m.block_table(1).len(), 5);
        let kept = m.block_table(1)[..3].to_vec();
        // Two drafts accepted: 12 tokens, three blocks.
        m.truncate(1, 12);
        assert_eq!(m.block_table(1), &kept[..]);
        assert_eq!(m.num_free_blocks(), 8 - 3);
        // Only accepted tokens are cached: the two full blocks of the first 8.
        m.cache_blocks(1, 10, |r| tokens[r].to_vec());
        assert_eq!(m.pool().num_cached(), 2);
        // Truncating past the end, or to the same length, changes nothing.
        m.truncate(1, 40);
        m.truncate(1, 12);
        assert_eq!(m.block_table(1), &kept[..]);
        m.truncate(1, 8);
        assert_eq!(m.block_table(1), &kept[..2]);
        m.free(1);
        assert_eq!(m.num_free_blocks(), 8);
    }

    #[test]
    #[should_panic(expected = "cut into its cached blocks")]
    fn truncating_into_cached_blocks_is_refused() {
        let mut m = manager(4);
        let tokens: Vec<u32> = (0..9).collect();
        assert!(m.allocate_slots(1, 9, &[]));
        m.cache_blocks(1, 9, |r| tokens[r].to_vec());
        m.truncate(1, 7);
    }

    #[test]
    fn a_chain_is_held_filled_and_entered() {
        // The sending side: a request's prompt cached in one manager.
        let mut sender = manager(8);
        let prompt: Vec<u32> = (0..13).collect();
        assert!(sender.allocate_slots(1, 13, &[]));
        sender.cache_blocks(1, 13, |r| prompt[r].to_vec());
        sender.free(1);
        let hashes = sender.block_hashes(&prompt);
        assert_eq!(hashes.len(), 3);
        let held = sender.hold_cached(&hashes);
        assert_eq!(held.len(), 3);
        assert_eq!(sender.num_free_blocks(), 5, "held blocks are not free to evict");
        sender.let_go(&held);
        assert_eq!(sender.num_free_blocks(), 8);

        // The receiving side already has the first block.
        let mut receiver = manager(6);
        assert!(receiver.allocate_slots(7, 4, &[]));
        receiver.cache_blocks(7, 4, |r| prompt[r].to_vec());
        receiver.free(7);
        let (blocks, cached) = receiver.hold_chain(&hashes, 0);
        assert_eq!((blocks.len(), cached), (3, 1));
        assert_eq!(receiver.num_free_blocks(), 3);
        // Only the second block arrives: the third goes back uncached.
        receiver.enter_chain(&blocks, &hashes, 2);
        assert_eq!(receiver.num_free_blocks(), 6);
        let (hit, n) = receiver.get_computed_blocks(&prompt);
        assert_eq!((hit, n), (blocks[..2].to_vec(), 8));

        // Room is left for running requests: only what `keep_free` spares is taken.
        let (blocks, cached) = receiver.hold_chain(&hashes, 5);
        assert_eq!((blocks.len(), cached), (2, 2));
        receiver.let_go(&blocks);
        assert_eq!(receiver.num_free_blocks(), 6);
    }

    #[test]
    fn other_extra_keys_never_share() {
        let a = manager(2);
        let b = KvCacheManager::new(BlockPool::new(2), 4, 8, true);
        let tokens: Vec<u32> = (0..8).collect();
        assert_ne!(a.block_hashes(&tokens), b.block_hashes(&tokens));
        assert_ne!(a.block_hashes(&tokens)[1], a.block_hashes(&[9, 9, 9, 9, 4, 5, 6, 7])[1]);
    }

    #[test]
    fn a_failed_allocation_changes_nothing() {
        let mut m = manager(3);
        let prompt: Vec<u32> = (0..8).collect();
        assert!(m.allocate_slots(1, 8, &[]));
        m.cache_blocks(1, 8, |r| prompt[r].to_vec());
        m.free(1);
        let (hit, _) = m.get_computed_blocks(&(0..9).collect::<Vec<u32>>());
        assert_eq!(hit.len(), 2);
        // Two cached blocks revived plus two fresh: four, from a pool of three.
        assert!(!m.allocate_slots(2, 16, &hit));
        assert_eq!(m.num_free_blocks(), 3);
        assert_eq!(m.block_table(2), &[] as &[BlockId]);
        assert_eq!(m.pool().num_cached(), 2);
        assert!(m.allocate_slots(2, 12, &hit));
        assert_eq!(m.num_free_blocks(), 0);
        m.free(2);
        assert_eq!(m.num_free_blocks(), 3);
    }
}
