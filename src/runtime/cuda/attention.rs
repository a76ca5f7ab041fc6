//! Paged attention over a flattened batch (kernels/attention.cu), and how its keys are split:
//! a batch of a few decode tokens over long contexts has too few (token, head) pairs to fill
//! the GPU, so their keys are cut into partitions computed by separate blocks and merged after.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::kernels::Kernels;
use crate::runtime::error::Result;

/// kernels/attention.cu's MAX_PARTS.
const MAX_PARTS: u32 = 1024;

/// Device addresses and shapes of one layer's attention.
pub struct AttentionArgs {
    pub qkv: u64,
    pub width: i32,
    pub out: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub token_seq: u64,
    pub positions: u64,
    pub tables: u64,
    pub max_blocks: i32,
    pub block_size: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub scale: f32,
}

/// Keys per partition (a multiple of 32, the kernel's tile) for `tokens` query tokens whose
/// longest context is `max_len`: one partition when the (token, head) pairs alone make
/// `target_blocks` blocks, else enough partitions of at least 64 keys to reach it.
pub fn partition_keys(tokens: usize, heads: usize, max_len: usize, target_blocks: usize) -> usize {
    let whole = max_len.max(1).next_multiple_of(32);
    let blocks = tokens * heads;
    if blocks >= target_blocks {
        return whole;
    }
    let parts = target_blocks.div_ceil(blocks).min(max_len.div_ceil(64)).max(1);
    max_len.div_ceil(parts).next_multiple_of(32)
}

/// Floats of scratch the partitions of `partition_keys(.., target_blocks)` need at most: fewer
/// than `2 * target_blocks` blocks write a record each.
pub fn scratch_len(target_blocks: usize, head_dim: usize) -> usize {
    2 * target_blocks * (head_dim + 2)
}

/// Queues the attention of `tokens` query tokens, `part_keys` keys per block; `partials` holds
/// `tokens * heads * ceil(max_len / part_keys) * (head_dim + 2)` floats when that is more than
/// one partition.
pub fn launch(
    stream: &Arc<CudaStream>,
    k: &Kernels,
    a: &AttentionArgs,
    tokens: usize,
    max_len: usize,
    part_keys: usize,
    partials: u64,
) -> Result<()> {
    let parts = max_len.max(1).div_ceil(part_keys) as u32;
    if parts > MAX_PARTS {
        return Err(crate::runtime::error::RuntimeError::InvalidBatch(format!(
            "{parts} attention partitions, the merge takes {MAX_PARTS}"
        )));
    }
    // A warp per tile of 32 keys, at most four.
    let threads = (part_keys / 32).clamp(1, 4) as u32 * 32;
    let part = part_keys as i32;
    let grid = (tokens as u32, a.heads as u32, parts);
    super::launch3(
        stream,
        &k.paged_attention,
        grid,
        threads,
        &[
            &a.qkv,
            &a.width,
            &a.out,
            &a.k_cache,
            &a.v_cache,
            &a.token_seq,
            &a.positions,
            &a.tables,
            &a.max_blocks,
            &a.block_size,
            &a.heads,
            &a.kv_heads,
            &a.head_dim,
            &a.scale,
            &part,
            &partials,
        ],
    )?;
    if parts > 1 {
        let p = parts as i32;
        super::launch(
            stream,
            &k.attention_merge,
            (tokens as u32, a.heads as u32),
            128,
            &[&partials, &a.out, &p, &a.heads, &a.head_dim],
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_contexts_of_few_tokens_are_split_and_big_batches_are_not() {
        // One decode token, 32 heads, 576 keys: 9 partitions of 64.
        assert_eq!(partition_keys(1, 32, 576, 528), 64);
        // 256 decode tokens already make 8,192 blocks.
        assert_eq!(partition_keys(256, 32, 576, 528), 576);
        // A short context stays whole, rounded to the tile.
        assert_eq!(partition_keys(1, 32, 40, 528), 64);
        assert_eq!(partition_keys(1, 32, 1, 528), 32);
        // Partitions cover the context.
        for (t, h, len) in [(1, 9, 3000), (3, 28, 100), (2, 4, 7)] {
            let keys = partition_keys(t, h, len, 528);
            assert_eq!(keys % 32, 0);
            let parts = len.div_ceil(keys);
            assert!(t * h * parts < 2 * 528, "{t} {h} {len}: {parts} parts");
        }
    }
}
