//! The paged KV cache in host memory: per layer, one K and one V pool of `num_blocks`
//! blocks. Entries are bf16 (as llama.cpp's `--cache-type-k bf16`): decode attention is
//! bound by reading the cache, which half-size entries halve, and the attention kernels
//! multiply bf16 pairs directly. Within a block each kv head's part is contiguous and laid
//! out for those pair products: keys as, per pair of channels, `block_size` lanes of the two
//! channels; values as, per pair of slots, `head_dim` channels of the two slots. Which block
//! belongs to whom is the block allocator's business; this only stores and reads slots.

use half::bf16;

use super::pool::{parallel_for, SyncPtr};
use crate::runtime::batch::KvLayout;

pub struct KvCache {
    layout: KvLayout,
    num_kv_heads: usize,
    head_dim: usize,
    k: Vec<Vec<bf16>>,
    v: Vec<Vec<bf16>>,
}

/// Asks for transparent huge pages over a fresh (untouched) pool: a 4 GiB cache is then two
/// thousand page faults instead of a million, and attention's strided reads miss the TLB
/// less. Advice only: where the kernel declines, nothing changes.
fn huge_pages(pool: &[bf16]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = pool.as_ptr() as usize;
        let end = start + std::mem::size_of_val(pool);
        let aligned = start.next_multiple_of(HUGE);
        if end > aligned + HUGE {
            let len = (end - aligned) / HUGE * HUGE;
            // SAFETY: the range lies inside `pool`'s allocation; MADV_HUGEPAGE changes no
            // contents and no mapping, only how future faults are served.
            unsafe { libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = pool;
}

/// A pool of zeros the kernel has not yet backed: `vec![bf16::ZERO; n]` would write every
/// entry (the standard library only knows primitive zeros come free), faulting the whole pool
/// in small pages before `huge_pages` could advise otherwise.
fn zeroed(n: usize) -> Vec<bf16> {
    let mut raw = std::mem::ManuallyDrop::new(vec![0u16; n]);
    // SAFETY: `bf16` is a transparent u16, so the allocation's layout is the same and all-zero
    // bits are `bf16::ZERO`; the u16 vector is forgotten, so the memory has one owner.
    unsafe { Vec::from_raw_parts(raw.as_mut_ptr() as *mut bf16, raw.len(), raw.capacity()) }
}

impl KvCache {
    pub fn new(layout: KvLayout, num_layers: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        let alloc = || {
            (0..num_layers)
                .map(|_| {
                    let pool = zeroed(layout.num_slots() * num_kv_heads * head_dim);
                    huge_pages(&pool);
                    pool
                })
                .collect()
        };
        KvCache {
            layout,
            num_kv_heads,
            head_dim,
            k: alloc(),
            v: alloc(),
        }
    }

    /// Has the kernel back every page of the pools on a background thread (returned, for
    /// callers that wait), rather than page by page as blocks are first used.
    /// MADV_POPULATE_WRITE faults pages in without touching their contents, so it is safe
    /// beside the engine's own writes; on kernels without it (before 5.14) or other systems,
    /// pages come in on first use as before.
    pub fn prefault(&self) -> Option<std::thread::JoinHandle<()>> {
        #[cfg(target_os = "linux")]
        {
            // madvise wants page-aligned ranges: the pool's partial first page comes in on use.
            let ranges: Vec<(usize, usize)> = (self.k.iter().chain(&self.v))
                .map(|p| {
                    let (start, end) = (p.as_ptr() as usize, p.as_ptr() as usize + std::mem::size_of_val(&p[..]));
                    let aligned = start.next_multiple_of(4096);
                    (aligned, end.saturating_sub(aligned) / 4096 * 4096)
                })
                .collect();
            Some(std::thread::spawn(move || {
                const CHUNK: usize = 64 << 20;
                for (start, len) in ranges {
                    for at in (0..len).step_by(CHUNK) {
                        // SAFETY: the range lies in a pool the cache keeps for its whole life
                        // (pools never grow); populating changes no contents. Should the cache
                        // be gone, the call fails or populates unrelated pages, harmlessly.
                        let r = unsafe {
                            libc::madvise(
                                (start + at) as *mut libc::c_void,
                                CHUNK.min(len - at),
                                libc::MADV_POPULATE_WRITE,
                            )
                        };
                        if r != 0 {
                            return;
                        }
                    }
                }
            }))
        }
        #[cfg(not(target_os = "linux"))]
        None
    }

    /// Host memory one token's keys and values take over every layer.
    pub fn bytes_per_token(num_layers: usize, slot_width: usize) -> usize {
        2 * num_layers * slot_width * std::mem::size_of::<bf16>()
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Stores each token's K and V (already rotated, every kv head): `k(t)` and `v(t)` of
    /// token `t` go to `slots[t]`, tokens shared out among the threads.
    pub fn write<'a>(
        &mut self,
        layer: usize,
        slots: &[u32],
        k: impl Fn(usize) -> &'a [f32] + Sync,
        v: impl Fn(usize) -> &'a [f32] + Sync,
    ) {
        let (bs, hd) = (self.layout.block_size, self.head_dim);
        let head_len = hd * bs;
        let block_len = self.num_kv_heads * head_len;
        debug_assert!(slots.iter().all(|&s| (s as usize) < self.layout.num_slots()));
        let (kp, vp) = (SyncPtr(self.k[layer].as_mut_ptr()), SyncPtr(self.v[layer].as_mut_ptr()));
        parallel_for(slots.len(), |tokens| {
            for t in tokens {
                let slot = slots[t] as usize;
                let (block, lane) = (slot / bs, slot % bs);
                for (h, (k, v)) in k(t).chunks_exact(hd).zip(v(t).chunks_exact(hd)).enumerate() {
                    let base = block * block_len + h * head_len;
                    // SAFETY: the slot lies in the pool (the batch was validated) and no two
                    // tokens of a batch share a slot, so each entry has one writer.
                    unsafe {
                        for (d, &x) in k.iter().enumerate() {
                            *kp.at(base + (d / 2) * bs * 2 + lane * 2 + d % 2) = bf16::from_f32(x);
                        }
                        for (c, &x) in v.iter().enumerate() {
                            *vp.at(base + (lane / 2) * hd * 2 + c * 2 + lane % 2) = bf16::from_f32(x);
                        }
                    }
                }
            }
        });
    }

    pub fn layer(&self, layer: usize) -> (&[bf16], &[bf16]) {
        (&self.k[layer], &self.v[layer])
    }
}
