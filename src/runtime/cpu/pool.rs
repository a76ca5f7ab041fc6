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

/// Number of threads the kernels use (the caller's thread plus the pool's workers).
pub fn num_threads() -> usize {
    candle_core::utils::get_num_threads()
}
