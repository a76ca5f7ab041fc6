//! Data parallelism on candle's persistent barrier pool: the same spinning workers candle's own
//! matmuls use, so our kernels and candle's never compete for cores and a region costs
//! microseconds to start, which matters at 120+ parallel regions per decoded token.

/// Splits `0..n` into ranges handed to all worker threads; returns when all are done.
pub fn parallel_for<F: Fn(std::ops::Range<usize>) + Sync>(n: usize, f: F) {
    candle_core::utils::barrier_pool().execute_chunked(n, f)
}

/// A raw pointer that parallel workers write through at disjoint offsets.
#[derive(Clone, Copy)]
pub struct SyncPtr<T>(pub *mut T);
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// # Safety
    /// The caller guarantees no two threads touch the same element.
    pub unsafe fn at(self, i: usize) -> *mut T {
        self.0.add(i)
    }
}

/// How many times a pool worker spins waiting for work before it parks, unless
/// `CANDLE_BARRIER_POOL_SPIN_LIMIT` says otherwise. candle spins 25,000 times, which holds a
/// core that another process sharing the machine (a second Quarry process, a build) needs, and
/// every step then waits for the worker that lost its core. On 2 cores, `quarry bench single
/// --input-len 64 --output-len 64` decoded 361-367 tok/s alone at 25,000 and 351-364 at 100 (0:
/// 214-224), and beside one busy process 64-66 at 25,000 and 125-162 at 100. Three processes
/// sharing a job (`scripts/crash-test --store postgres`) took 726 s at 25,000 and 140 s at 100.
/// The price, for a process alone on its cores: about 2% at batch 32 (`bench throughput`) and
/// 2.5% at batch 1 (`bench single --output-len 256`, 6 runs each), near the runs' own spread.
const SPIN_LIMIT: &str = "100";

/// Gives candle's pool the spin limit above; called first thing in `main`, before any thread
/// starts, since it sets the environment variable candle reads when it makes the pool.
pub fn prefer_parking() {
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", SPIN_LIMIT);
    }
}

/// Number of threads the kernels use (the caller's thread plus the pool's workers).
pub fn num_threads() -> usize {
    candle_core::utils::get_num_threads()
}
