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

/// A pool of zeros the kernel has not yet backed: `vec![bf16::ZERO; n]` writes every entry
/// (the standard library only knows primitive zeros come free), so every `quarry extract`
/// paid for a whole pool it mostly never used (4.2-12.6 s and 4.3 GiB for one document,
/// against 0.7 s and 230 MiB now). Servers back theirs at load instead (`prefault`).
///
/// Huge pages were tried and left out: no difference in decode speed beyond noise, and
/// backing 4 GiB of them took 2-11 s depending on how much the kernel had to compact.
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
                .map(|_| zeroed(layout.num_slots() * num_kv_heads * head_dim))
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

    /// Has the kernel back every page of the pools now rather than page by page as blocks
    /// are first used. MADV_POPULATE_WRITE faults pages in without writing them; on kernels
    /// without it (before 5.14) or other systems, pages come in on first use.
    pub fn prefault(&self) {
        #[cfg(target_os = "linux")]
        for pool in self.k.iter().chain(&self.v) {
            // madvise wants page-aligned ranges: the pool's partial first page comes in on use.
            let start = pool.as_ptr() as usize;
            let aligned = start.next_multiple_of(4096);
            let len = (start + std::mem::size_of_val(&pool[..])).saturating_sub(aligned) / 4096 * 4096;
            // SAFETY: the range lies inside the pool's allocation; populating changes no
            // contents and no mapping.
            let r = unsafe { libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
            if r != 0 {
                return;
            }
        }
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

    /// Entries one block holds in one layer's K (or V) pool: a block is one contiguous run.
    fn block_len(&self) -> usize {
        self.layout.block_size * self.num_kv_heads * self.head_dim
    }

    /// Bytes `gather` gives for one block.
    pub fn block_bytes(&self) -> usize {
        2 * self.k.len() * self.block_len() * std::mem::size_of::<bf16>()
    }

    /// Each block's keys then values, layer after layer, block after block, as raw bf16 bytes
    /// (both ends of a link lay blocks out alike: the same model on the same kind of backend).
    pub fn gather(&self, blocks: &[u32]) -> Vec<u8> {
        let n = self.block_len();
        let mut out = Vec::with_capacity(blocks.len() * self.block_bytes());
        for &b in blocks {
            let at = b as usize * n;
            for (k, v) in self.k.iter().zip(&self.v) {
                for pool in [k, v] {
                    out.extend(pool[at..at + n].iter().flat_map(|x| x.to_bits().to_le_bytes()));
                }
            }
        }
        out
    }

    /// Writes what `gather` gave for as many blocks into `blocks`.
    pub fn scatter(&mut self, blocks: &[u32], bytes: &[u8]) {
        let n = self.block_len();
        let mut pieces = bytes.chunks_exact(2 * n);
        for &b in blocks {
            let at = b as usize * n;
            for layer in 0..self.k.len() {
                for pool in [&mut self.k[layer], &mut self.v[layer]] {
                    let piece = pieces.next().expect("the caller checked the length");
                    for (x, p) in pool[at..at + n].iter_mut().zip(piece.chunks_exact(2)) {
                        *x = bf16::from_bits(u16::from_le_bytes([p[0], p[1]]));
                    }
                }
            }
        }
    }
}
