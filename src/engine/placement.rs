//! Where a request goes among several engines serving the same model (data parallelism,
//! `quarry serve --data-parallel-size N`): to the engine whose prefix cache most likely holds
//! the start of its prompt, unless that engine is already much busier than another.
//!
//! The router does not ask the engines what they cache (a question would wait for a step to
//! end on each of them): it remembers the prompts' full blocks it sent to each, by the hash the
//! engines' caches give them, as many as an engine's pool holds, the least recently sent
//! forgotten first. An engine that evicted a block under pressure is still credited with it:
//! the record is a guess, and a wrong one costs a prompt computed again, never a wrong answer.
//!
//! The rule, after SGLang's cache-aware routing (whose falls back to the engine that holds
//! least, and whose bounds have been 0.5, 32 and 1.0001, now 0.3, 64 and 1.5):
//! - where the engines' loads (requests placed and not ended) differ by more than
//!   `BALANCE_ABS` and by a factor of more than `BALANCE_REL`, the least loaded engine;
//! - else the engine that holds the longest start of the prompt, where that is at least
//!   `CACHE_THRESHOLD` of the prompt's full blocks;
//! - else the least loaded engine (the one that holds least, among equals): a prompt no
//!   engine knows goes where it waits least.
//!
//! Where an engine does not cache prefixes, only loads count.

use std::collections::{BTreeMap, HashMap};

use super::block_pool::BlockHash;
use super::kv_cache_manager::BlockHasher;

/// Requests by which loads must differ before balance overrules the caches.
const BALANCE_ABS: usize = 32;
/// ... and the factor by which the busiest must exceed the least busy.
const BALANCE_REL: f64 = 1.5;
/// The share of a prompt's full blocks an engine must hold to draw it by its cache.
const CACHE_THRESHOLD: f64 = 0.5;

/// The router's record of the engines: what each was sent, and how many requests each runs.
#[derive(Debug)]
pub struct Placement {
    hasher: BlockHasher,
    engines: Vec<Engine>,
    /// Whether the engines cache prefixes (else only loads count).
    caching: bool,
}

#[derive(Debug)]
struct Engine {
    /// Blocks sent to the engine, by hash, with when they were last sent.
    blocks: HashMap<BlockHash, u64>,
    /// The same, by when: the oldest first to go.
    by_age: BTreeMap<u64, BlockHash>,
    /// Blocks the engine's pool holds: as many as the record keeps.
    capacity: usize,
    /// Requests placed on the engine that have not ended.
    load: usize,
    /// Requests placed on the engine so far.
    placed: u64,
}

impl Placement {
    /// A record of engines whose pools hold `capacities` blocks each, naming blocks by
    /// `hasher` (the engines', all alike), which cache prefixes where `caching`.
    pub fn new(hasher: BlockHasher, capacities: &[usize], caching: bool) -> Self {
        let engines = capacities
            .iter()
            .map(|&capacity| Engine {
                blocks: HashMap::new(),
                by_age: BTreeMap::new(),
                capacity,
                load: 0,
                placed: 0,
            })
            .collect();
        Placement {
            hasher,
            engines,
            caching,
        }
    }

    /// The engine for a request of `prompt`, among those `usable` says can take it (`None`
    /// where none can); the request counts in its load until `ended`.
    pub fn place(&mut self, prompt: &[u32], usable: impl Fn(usize) -> bool) -> Option<usize> {
        // The last token is always computed (its logits are drawn from): the blocks before it
        // are what a cache gives.
        let full = match self.caching {
            true => prompt.len().saturating_sub(1) / self.hasher.block_size * self.hasher.block_size,
            false => 0,
        };
        let hashes = self.hasher.chain(None, &prompt[..full]);
        let candidates: Vec<usize> = (0..self.engines.len()).filter(|&i| usable(i)).collect();
        let least_loaded = *candidates
            .iter()
            .min_by_key(|&&i| (self.engines[i].load, self.engines[i].blocks.len()))?;
        let busiest = candidates.iter().map(|&i| self.engines[i].load).max()?;
        let lightest = self.engines[least_loaded].load;
        let unbalanced = busiest - lightest > BALANCE_ABS && busiest as f64 > BALANCE_REL * lightest as f64;
        let chosen = match unbalanced {
            true => least_loaded,
            false => {
                let (best, held) = candidates
                    .iter()
                    .map(|&i| (i, self.engines[i].held(&hashes)))
                    .max_by_key(|&(i, held)| (held, std::cmp::Reverse(self.engines[i].load)))
                    .expect("at least one candidate");
                match held > 0 && held as f64 >= CACHE_THRESHOLD * hashes.len() as f64 {
                    true => best,
                    false => least_loaded,
                }
            }
        };
        // Recorded now, not once the engine admits it: requests sharing a start that arrive
        // together then go together. One the engine refuses is credited all the same (a miss
        // for a later prompt, rarely).
        self.engines[chosen].sent(&hashes);
        self.engines[chosen].load += 1;
        self.engines[chosen].placed += 1;
        Some(chosen)
    }

    /// A request placed on `engine` has ended.
    pub fn ended(&mut self, engine: usize) {
        let e = &mut self.engines[engine];
        debug_assert!(e.load > 0, "a request ended that was not placed");
        e.load = e.load.saturating_sub(1);
    }

    /// Requests placed on each engine that have not ended.
    pub fn loads(&self) -> Vec<usize> {
        self.engines.iter().map(|e| e.load).collect()
    }

    /// Requests placed on each engine so far.
    pub fn placed(&self) -> Vec<u64> {
        self.engines.iter().map(|e| e.placed).collect()
    }
}

impl Engine {
    /// How many of the chained `hashes`, from the first, the engine was sent.
    fn held(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.blocks.contains_key(h)).count()
    }

    /// Records `hashes` as sent now, forgetting the oldest beyond the pool's size. A prompt's
    /// last blocks count as older than its first, as an engine's cache evicts them first: a
    /// start is what a later prompt can match.
    fn sent(&mut self, hashes: &[BlockHash]) {
        let next = self.by_age.last_key_value().map_or(0, |(&t, _)| t + 1);
        for (now, &h) in (next..).zip(hashes.iter().rev()) {
            if let Some(then) = self.blocks.insert(h, now) {
                self.by_age.remove(&then);
            }
            self.by_age.insert(now, h);
        }
        while self.blocks.len() > self.capacity {
            let Some((_, oldest)) = self.by_age.pop_first() else {
                break;
            };
            self.blocks.remove(&oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK: usize = 4;

    fn hasher() -> BlockHasher {
        crate::engine::KvCacheManager::new(crate::engine::BlockPool::new(1), BLOCK, 0, true).hasher()
    }

    /// A prompt of `blocks` full blocks of `prefix`'s tokens, then `tail` blocks of `tail_of`'s,
    /// and one token more.
    fn prompt(prefix: u32, blocks: usize, tail_of: u32, tail: usize) -> Vec<u32> {
        let mut p = vec![prefix; blocks * BLOCK];
        p.extend(std::iter::repeat_n(tail_of, tail * BLOCK));
        p.push(7);
        p
    }

    #[test]
    fn prompts_that_share_their_start_go_where_it_was_sent() {
        let mut p = Placement::new(hasher(), &[100, 100], true);
        let first = p.place(&prompt(1, 6, 2, 2), |_| true).unwrap();
        // Another document, the same long start: the same engine, though it is the busier.
        assert_eq!(p.place(&prompt(1, 6, 3, 2), |_| true), Some(first));
        // A prompt nobody has seen goes to the engine with less to do.
        let other = p.place(&prompt(9, 6, 3, 2), |_| true).unwrap();
        assert_ne!(other, first);
        // A start shorter than half the prompt does not draw it.
        let short = prompt(1, 2, 5, 6);
        p.ended(other);
        assert_eq!(p.place(&short, |_| true), Some(other));
        // An ended request leaves its engine's load, not its count of requests placed.
        let mut placed = [0u64; 2];
        placed[first] = 2;
        placed[other] = 2;
        assert_eq!(p.placed(), placed);
        assert_eq!(p.loads()[other], 1);
    }

    #[test]
    fn balance_overrules_the_cache_when_loads_part_far() {
        let mut p = Placement::new(hasher(), &[100, 100], true);
        let hot = prompt(1, 8, 2, 1);
        let first = p.place(&hot, |_| true).unwrap();
        for _ in 0..BALANCE_ABS {
            assert_eq!(p.place(&hot, |_| true), Some(first), "within the bounds the cache wins");
        }
        // 33 against 0: the next goes to the idle engine, cached or not.
        assert_eq!(p.place(&hot, |_| true), Some(1 - first));
        assert_eq!(p.loads().iter().sum::<usize>(), BALANCE_ABS + 2);
    }

    #[test]
    fn engines_that_cannot_take_requests_are_passed_over() {
        let mut p = Placement::new(hasher(), &[100, 100, 100], true);
        let hot = prompt(1, 8, 2, 1);
        let first = p.place(&hot, |_| true).unwrap();
        let next = p.place(&hot, |i| i != first).unwrap();
        assert_ne!(next, first);
        assert_eq!(p.place(&hot, |_| false), None);
    }

    #[test]
    fn the_record_forgets_the_oldest_blocks_beyond_the_pool() {
        let mut p = Placement::new(hasher(), &[6, 6], true);
        let old = prompt(1, 6, 2, 0);
        let first = p.place(&old, |_| true).unwrap();
        p.ended(first);
        // The same engine is sent 6 other blocks (the other engine is busier): the first
        // prompt's are forgotten, so it no longer draws it.
        p.engines[1 - first].load = 1;
        assert_eq!(p.place(&prompt(5, 6, 2, 0), |_| true), Some(first));
        p.ended(first);
        assert_eq!(p.engines[first].held(&hasher().chain(None, &old[..old.len() - 1])), 0);
        assert_eq!(p.engines[first].blocks.len(), 6);
        assert_eq!(p.engines[first].by_age.len(), 6);
    }

    #[test]
    fn without_prefix_caching_only_loads_count() {
        let mut p = Placement::new(hasher(), &[100, 100], false);
        let hot = prompt(1, 8, 2, 1);
        let first = p.place(&hot, |_| true).unwrap();
        assert_eq!(p.place(&hot, |_| true), Some(1 - first));
    }

    #[test]
    fn a_prompts_start_outlives_its_tail_in_the_record() {
        let mut p = Placement::new(hasher(), &[4, 4], true);
        let long = prompt(1, 6, 2, 0);
        let first = p.place(&long, |_| true).unwrap();
        p.ended(first);
        // Of its 6 blocks, the record keeps the first 4: a prompt sharing them draws it.
        let hashes = hasher().chain(None, &long[..long.len() - 1]);
        assert_eq!(p.engines[first].held(&hashes), 4);
        p.engines[first].load = 1;
        assert_eq!(
            p.place(&prompt(1, 4, 3, 2), |_| true),
            Some(first),
            "the busier, by its cache"
        );
    }

    #[test]
    fn prompts_shorter_than_a_block_spread_by_load() {
        let mut p = Placement::new(hasher(), &[10, 10], true);
        let a = p.place(&[1, 2], |_| true).unwrap();
        let b = p.place(&[1, 2], |_| true).unwrap();
        assert_ne!(a, b);
    }
}
