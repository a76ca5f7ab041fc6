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

impl KvCache {
    pub fn new(layout: KvLayout, num_layers: usize, slot_width: usize) -> Self {
        let alloc = || {
            (0..num_layers)
                .map(|_| vec![0f32; layout.num_slots() * slot_width])
                .collect()
        };
        KvCache {
            layout,
            slot_width,
            k: alloc(),
            v: alloc(),
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
