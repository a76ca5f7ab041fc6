//! The paged KV cache in host memory: per layer, one K and one V pool of `num_blocks *
//! block_size` slots, each slot holding every kv head of one token (keys transposed within
//! their block). Which block belongs to whom is the block allocator's business; this only
//! stores and reads slots.

use crate::runtime::batch::KvLayout;

pub struct KvCache {
    layout: KvLayout,
    /// Floats per slot: kv heads times head dimension.
    slot_width: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

/// Asks for transparent huge pages over a fresh (untouched) pool: a 4 GiB cache is then two
/// thousand page faults instead of a million, and attention's strided reads miss the TLB
/// less. Advice only: where the kernel declines, nothing changes.
fn huge_pages(pool: &[f32]) {
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

impl KvCache {
    pub fn new(layout: KvLayout, num_layers: usize, slot_width: usize) -> Self {
        let alloc = || {
            (0..num_layers)
                .map(|_| {
                    let pool = vec![0f32; layout.num_slots() * slot_width];
                    huge_pages(&pool);
                    pool
                })
                .collect()
        };
        KvCache {
            layout,
            slot_width,
            k: alloc(),
            v: alloc(),
        }
    }

    /// Has the kernel back every page of the pools now, on a background thread, rather than
    /// page by page as blocks are first used: a server's footprint is flat from its first
    /// minute, and decode steps do not pay for page faults. MADV_POPULATE_WRITE faults pages
    /// in without touching their contents, so it is safe beside the engine's own writes; on
    /// kernels without it (before 5.14) or other systems, pages come in on first use as before.
    pub fn prefault(&self) {
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
            std::thread::spawn(move || {
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
            });
        }
    }

    /// Host memory one token's keys and values take over every layer.
    pub fn bytes_per_token(num_layers: usize, slot_width: usize) -> usize {
        2 * num_layers * slot_width * std::mem::size_of::<f32>()
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Stores one token's K and V (already rotated) in `slot`. Keys are transposed within
    /// their block (channel-major, one lane per slot), which is how attention reads them.
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let bs = self.layout.block_size;
        let (block, lane) = (slot / bs, slot % bs);
        let kt = &mut self.k[layer][block * self.slot_width * bs..][..self.slot_width * bs];
        for (c, &x) in k.iter().enumerate() {
            kt[c * bs + lane] = x;
        }
        let at = slot * self.slot_width;
        self.v[layer][at..at + self.slot_width].copy_from_slice(v);
    }

    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.k[layer], &self.v[layer])
    }
}
