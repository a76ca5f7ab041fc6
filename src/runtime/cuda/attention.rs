//! Paged attention over a flattened batch. Heads of 64 and 128 take the tensor-core kernel
//! (kernels/flash_attention.cu): rows of one sequence and one KV head in items of 64, keys in
//! fixed partitions of 512 at absolute positions, folded in order either inside the block or,
//! where too few blocks would fill the GPU, by a merge kernel; both give the same bits, so the
//! choice, made per batch, never changes a request's output. Other head sizes take the general
//! kernel (kernels/attention.cu), which splits keys by the batch's shape.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::CudaStream;

use super::kernels::Kernels;
use crate::runtime::batch::ForwardBatch;
use crate::runtime::error::{Result, RuntimeError};

/// kernels/attention.cu's MAX_PARTS.
const MAX_PARTS: u32 = 1024;

/// kernels/flash_attention.cu's FA_BLOCK, FA_ROWS, FA_KEYS, FA_PART, FA_SMALL, FA_SMALL_KEYS
/// and FA_THREADS.
pub const FLASH_BLOCK: usize = 16;
const FLASH_ROWS: usize = 64;
const FLASH_KEYS: usize = 64;
pub const FLASH_PART: usize = 512;
const FLASH_SMALL: usize = 128;
const FLASH_SMALL_KEYS: usize = 1024;
const FLASH_THREADS: u32 = 128;

/// Floats of scratch for split attention's partitions.
pub const SCRATCH_FLOATS: usize = 8 << 20;

/// The width of the block tables the flash kernel reads: each sequence's row padded to a
/// multiple of four entries (it reads a tile's four blocks at once).
pub fn table_width(longest: usize) -> usize {
    longest.max(1).next_multiple_of(4)
}

/// Whether the tensor-core kernel takes heads of this size.
pub fn flash_head(head_dim: usize) -> bool {
    head_dim == 64 || head_dim == 128
}

/// Shared memory of a flash block: two stages of a K and a V tile, and in whole mode each
/// warp's running total of 16 rows (both with rows padded by 8 elements).
fn flash_smem(head_dim: usize, whole: bool) -> u32 {
    let stages = 4 * FLASH_KEYS * (head_dim + 8) * 2;
    let running = if whole { 4 * 16 * (head_dim + 8) * 4 } else { 0 };
    (stages + running) as u32
}

/// Lets the flash kernels take the shared memory they need (over the 48 KB default).
pub fn prepare(k: &Kernels) -> Result<()> {
    for (f, dim) in [(&k.flash_attention_d64, 64), (&k.flash_attention_d128, 128)] {
        f.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            flash_smem(dim, true) as i32,
        )
        .map_err(|e| RuntimeError::Device(format!("shared memory for the attention kernel: {e}")))?;
    }
    Ok(())
}

/// The flash kernel's items for a batch, four words each: the sequence, its first token's
/// index, the item's first row and the sequence's number of rows (tokens times the group).
pub fn flash_items(batch: &ForwardBatch, group: usize) -> Vec<u32> {
    let mut items = Vec::new();
    for s in 0..batch.num_seqs() {
        let (lo, hi) = (batch.query_start[s] as usize, batch.query_start[s + 1] as usize);
        let rows = (hi - lo) * group;
        for row0 in (0..rows).step_by(FLASH_ROWS) {
            items.extend_from_slice(&[s as u32, lo as u32, row0 as u32, rows as u32]);
        }
    }
    items
}

/// The flash items of a sequence of `tokens` query tokens, `group` query heads a KV head.
pub fn items_of(tokens: usize, group: usize) -> usize {
    (tokens * group).div_ceil(FLASH_ROWS)
}

/// Device addresses and shapes of one layer's attention. `q` and `out` are bf16 `[tokens,
/// heads * head_dim]`.
pub struct AttentionArgs {
    pub q: u64,
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

/// How a step's attention runs, the same for every layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Plan {
    /// The tensor-core kernel over `items` (device address) of which there are `count`.
    Flash {
        items: u64,
        count: usize,
        split: Option<Split>,
    },
    /// The general kernel, `part_keys` keys per block.
    General { part_keys: usize },
}

/// Split mode: `parts` partitions a row at most, each computed by its own block, then merged.
/// A token's records sit at `bases` (device address, one word a token): the partitions its
/// keys reach are numbered on from those of the tokens before it, so the scratch holds what the
/// step's rows fill, not every row times the longest context.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Split {
    pub parts: usize,
    pub bases: u64,
}

/// The partition of the key at `position`, numbered as the kernel's `fa_part_of` does:
/// `FLASH_SMALL` keys each below `FLASH_SMALL_KEYS`, `FLASH_PART` after.
fn part_of(position: usize) -> usize {
    if position < FLASH_SMALL_KEYS {
        position / FLASH_SMALL
    } else {
        FLASH_SMALL_KEYS / FLASH_SMALL + (position - FLASH_SMALL_KEYS) / FLASH_PART
    }
}

/// The partitions a query token at `position` reads: those its keys reach.
pub fn partitions(position: u32) -> usize {
    part_of(position as usize) + 1
}

/// The partitions that a context of `len` keys spans.
pub fn partitions_within(len: usize) -> usize {
    part_of(len.max(1) - 1) + 1
}

/// A context of `len` keys in units of `FLASH_PART` keys, rounded up (at least one): the
/// measure of a whole block's chain, of a prefill's split, and of a captured shape's contexts.
pub fn part_units(len: usize) -> usize {
    len.max(1).div_ceil(FLASH_PART)
}

/// Split attention's record bases for query tokens at `positions`, written to `bases` (one
/// word a token): each token's partitions numbered after those of the tokens before it. The
/// partitions of all of them.
pub fn part_bases(positions: &[u32], bases: &mut [u32]) -> usize {
    let mut total = 0;
    for (base, &p) in bases.iter_mut().zip(positions) {
        *base = total as u32;
        total += partitions(p);
    }
    total
}

/// Whether a batch's longest contexts would set the pace of its attention: the kernel's
/// blocks walk their sequences' partitions, and where one sequence has many times the
/// partitions that the whole batch's share out over the GPU, its blocks run long after the
/// rest are done (a long document decoding among short requests). Splitting then spreads its
/// partitions over blocks of their own, at the cost of a merge.
pub fn long_rows_dominate(context_lens: &[u32], kv_heads: usize, target_blocks: usize) -> bool {
    // Chains in units of FLASH_PART keys: a whole block walks every tile, whatever the partitions.
    let parts = |len: u32| part_units(len as usize);
    let longest = context_lens.iter().map(|&l| parts(l)).max().unwrap_or(0);
    let total: usize = context_lens.iter().map(|&l| parts(l)).sum();
    // The GPU's share of every partition, against the longest chain a block walks alone.
    longest > 1 && longest * target_blocks.max(1) > 2 * total * kv_heads
}

/// What decides a step's split: the same rule for eager steps and for captured shapes, which
/// keep the choice of their capture.
#[derive(Clone, Copy, Debug)]
pub struct SplitRule {
    pub head_dim: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Blocks that fill the GPU.
    pub target_blocks: usize,
}

impl SplitRule {
    /// Whether `items` flash items of `seqs` sequences whose longest context is `max_len`
    /// keys, their query tokens reaching `partitions` partitions in all, are split: where the
    /// context spans more than one partition, whole blocks would not fill the GPU or `skewed`
    /// (`long_rows_dominate`), and the records fit the scratch (else whole mode, slower, never
    /// wrong). Where every sequence fits one item (decode, checks), its block holds a few rows
    /// and walks its tiles one after another, waiting on latency: the small partitions shorten
    /// that chain. A sequence of several items (a prefill chunk) fills its blocks with rows,
    /// and is split only past one large partition: there the records and their merge cost more
    /// than a shorter chain saves (a 512-token prompt of the 8B shape, split into its four
    /// small partitions, prefilled 12% slower on an H200).
    pub fn split(&self, items: usize, seqs: usize, max_len: usize, partitions: usize, skewed: bool) -> bool {
        let parts = match items <= seqs {
            true => partitions_within(max_len),
            false => part_units(max_len),
        };
        let few_blocks = items * self.kv_heads < self.target_blocks;
        let records = partitions * self.heads * (self.head_dim + 2);
        flash_head(self.head_dim) && parts > 1 && (few_blocks || skewed) && records <= SCRATCH_FLOATS
    }
}

impl Plan {
    /// The plan for `tokens` query tokens whose longest context is `max_len`, `count` flash
    /// items at `items`; `target_blocks` fill the GPU. `split`: `SplitRule`'s choice, with the
    /// tokens' record bases at `bases`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        head_dim: usize,
        heads: usize,
        tokens: usize,
        max_len: usize,
        items: u64,
        count: usize,
        target_blocks: usize,
        split: Option<u64>,
    ) -> Plan {
        if !flash_head(head_dim) {
            return Plan::General {
                part_keys: partition_keys(tokens, heads, max_len, target_blocks),
            };
        }
        let parts = partitions_within(max_len);
        let split = split.filter(|_| parts > 1).map(|bases| Split { parts, bases });
        Plan::Flash { items, count, split }
    }
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

/// Floats of scratch the general kernel's partitions need at most: fewer than
/// `2 * target_blocks` blocks write a record each.
pub fn general_scratch_len(target_blocks: usize, head_dim: usize) -> usize {
    2 * target_blocks * (head_dim + 2)
}

/// Queues the attention of `tokens` query tokens whose longest context is `max_len`.
pub fn launch(
    stream: &Arc<CudaStream>,
    k: &Kernels,
    a: &AttentionArgs,
    plan: Plan,
    tokens: usize,
    max_len: usize,
    partials: u64,
) -> Result<()> {
    match plan {
        Plan::Flash { items, count, split } => launch_flash(stream, k, a, items, count, split, tokens, partials),
        Plan::General { part_keys } => launch_general(stream, k, a, tokens, max_len, part_keys, partials),
    }
}

#[allow(clippy::too_many_arguments)]
fn launch_flash(
    stream: &Arc<CudaStream>,
    k: &Kernels,
    a: &AttentionArgs,
    items: u64,
    count: usize,
    split: Option<Split>,
    tokens: usize,
    partials: u64,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    if a.block_size as usize != FLASH_BLOCK || a.max_blocks % 4 != 0 {
        return Err(RuntimeError::Backend(format!(
            "the flash attention kernel reads blocks of {FLASH_BLOCK} tokens in tables padded to 4 entries, not {} in {}",
            a.block_size, a.max_blocks
        )));
    }
    let f = match a.head_dim {
        64 => &k.flash_attention_d64,
        128 => &k.flash_attention_d128,
        d => {
            return Err(RuntimeError::Backend(format!(
                "no flash attention kernel for heads of {d}"
            )))
        }
    };
    let scale_log2 = a.scale * std::f32::consts::LOG2_E;
    let (parts, scratch, bases) = match split {
        Some(s) => (s.parts, partials, s.bases),
        None => (1, 0u64, 0u64),
    };
    super::launch_smem(
        stream,
        f,
        (count as u32, a.kv_heads as u32, parts as u32),
        FLASH_THREADS,
        flash_smem(a.head_dim as usize, split.is_none()),
        &[
            &a.q,
            &a.out,
            &a.k_cache,
            &a.v_cache,
            &items,
            &a.positions,
            &a.tables,
            &a.max_blocks,
            &a.heads,
            &a.kv_heads,
            &scale_log2,
            &scratch,
            &bases,
        ],
    )?;
    if split.is_some() {
        super::launch(
            stream,
            &k.flash_merge,
            (tokens as u32, a.heads as u32),
            a.head_dim as u32,
            &[&partials, &a.positions, &bases, &a.out, &a.heads, &a.head_dim],
        )?;
    }
    Ok(())
}

fn launch_general(
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
        return Err(RuntimeError::InvalidBatch(format!(
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
            &a.q,
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

    /// The value of `#define NAME expr` in the kernel's source, for sums of products of
    /// integers and earlier defines.
    fn kernel_define(source: &str, name: &str) -> usize {
        let line = source
            .lines()
            .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("no #define {name}"));
        let expr = line
            .split("//")
            .next()
            .unwrap()
            .trim()
            .trim_start_matches('(')
            .trim_end_matches(')');
        expr.split('+')
            .map(|term| {
                term.split('*')
                    .map(|f| {
                        let f = f.trim();
                        f.parse().unwrap_or_else(|_| kernel_define(source, f))
                    })
                    .product::<usize>()
            })
            .sum()
    }

    /// The host's copies of the kernel's sizes: a wrong one would misplace items or cut
    /// partitions where the kernel does not.
    #[test]
    fn host_constants_match_the_flash_kernel() {
        let source = include_str!("../../../kernels/flash_attention.cu");
        assert_eq!(kernel_define(source, "FA_BLOCK"), FLASH_BLOCK);
        assert_eq!(kernel_define(source, "FA_ROWS"), FLASH_ROWS);
        assert_eq!(kernel_define(source, "FA_KEYS"), FLASH_KEYS);
        assert_eq!(kernel_define(source, "FA_PART"), FLASH_PART);
        assert_eq!(kernel_define(source, "FA_SMALL"), FLASH_SMALL);
        assert_eq!(kernel_define(source, "FA_SMALL_KEYS"), FLASH_SMALL_KEYS);
        assert_eq!(kernel_define(source, "FA_THREADS"), FLASH_THREADS as usize);
    }

    #[test]
    fn partitions_are_small_up_to_1024_keys_and_large_after() {
        let starts: Vec<u32> = (0..12u32)
            .map(|z| if z < 8 { z * 128 } else { 1024 + (z - 8) * 512 })
            .collect();
        for (z, &start) in starts.iter().enumerate() {
            assert_eq!(partitions(start), z + 1, "the key at {start} opens partition {z}");
            if start > 0 {
                assert_eq!(
                    partitions(start - 1),
                    z,
                    "the key before {start} closes partition {}",
                    z - 1
                );
            }
        }
        assert_eq!(partitions_within(1), 1);
        assert_eq!(partitions_within(128), 1);
        assert_eq!(partitions_within(576), 5);
        assert_eq!(partitions_within(1024), 8);
        assert_eq!(partitions_within(16384), 38);
        // Every partition is whole tiles: a tile never straddles two.
        assert!(starts.iter().all(|&s| (s as usize).is_multiple_of(FLASH_KEYS)));
    }

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

    #[test]
    fn flash_items_cover_every_row_of_every_sequence_in_tiles_of_64() {
        let mut batch = ForwardBatch::default();
        batch.push_sequence(&[1; 40], 0, &[0, 1, 2], 16); // 40 tokens x 4 heads = 160 rows
        batch.push_sequence(&[1], 99, &(3..10).collect::<Vec<_>>(), 16); // one decode token
        let items = flash_items(&batch, 4);
        assert_eq!(
            items,
            vec![0, 0, 0, 160, 0, 0, 64, 160, 0, 0, 128, 160, 1, 40, 0, 4],
            "items of 64 rows, the last one short; a decode token is one item"
        );
    }

    #[test]
    fn a_long_context_among_short_ones_sets_the_pace() {
        let mut lens = vec![700u32; 64];
        // 64 decoders of two partitions: 128 partitions x 8 KV heads over 528 blocks, about
        // 2 each; a chain of 2 sets no pace.
        assert!(!long_rows_dominate(&lens, 8, 528));
        // Two 8k documents among them: chains of 16 against about 2.4 a block.
        lens.extend([8192, 8200]);
        assert!(long_rows_dominate(&lens, 8, 528));
        // 64 x 2k decode: chains of 4 against about 3.9.
        assert!(!long_rows_dominate(&[2048; 64], 8, 528));
        // One partition each: nothing to split.
        assert!(!long_rows_dominate(&[300, 500], 8, 528));
        assert!(!long_rows_dominate(&[], 8, 528));
    }

    /// One decode token a sequence at each context of `lens`: the rule's choice, `skewed`
    /// computed as the backend does.
    fn decode_split(lens: &[u32], heads: usize) -> bool {
        let rule = SplitRule {
            head_dim: 128,
            heads,
            kv_heads: 8,
            target_blocks: 528,
        };
        let longest = lens.iter().copied().max().unwrap_or(1) as usize;
        let partitions = lens.iter().map(|&l| partitions(l - 1)).sum();
        let skewed = long_rows_dominate(lens, 8, 528);
        rule.split(lens.len(), lens.len(), longest, partitions, skewed)
    }

    #[test]
    fn split_only_where_whole_blocks_would_not_fill_the_gpu() {
        // One decode token over 16k keys: 8 blocks whole, 38 partitions split.
        assert!(decode_split(&[16384], 32));
        // 64 decode tokens at 2k: 512 blocks whole, still under 528: split in 10.
        assert!(decode_split(&[2048; 64], 32));
        // 72 decode tokens at 2k: 576 blocks whole fill the GPU.
        assert!(!decode_split(&[2048; 72], 32));
        // One partition: nothing to split.
        assert!(!decode_split(&[100], 32));
        // One decode token over 576 keys: 8 blocks whole, a chain of 9 tiles; split, chains of
        // at most 2.
        assert!(decode_split(&[576], 32));
        // 72 decoders, most short: whole, unless a long one would set the pace.
        assert!(!decode_split(&[700; 72], 32));
        let mut lens = vec![700; 70];
        lens.extend([8200, 8300]);
        assert!(decode_split(&lens, 32));
        // The records count what the rows reach: 73 rows of 32 heads under a longest context
        // of 38 partitions would need 11.5M floats as rows times that; these need 2.1M.
        lens.extend([16000]);
        assert!(decode_split(&lens, 32));
        // Past the scratch: whole mode.
        assert!(!decode_split(&[100_000; 16], 32));
        // A prefill of 4k tokens: 256 items of 16 tokens make 2,048 blocks.
        let rule = SplitRule {
            head_dim: 128,
            heads: 32,
            kv_heads: 8,
            target_blocks: 528,
        };
        assert!(!rule.split(256, 1, 4096, 4096 * 4, false));
        // A prompt of 512 tokens: 32 items, 256 blocks, but within one large partition.
        assert!(!rule.split(32, 1, 512, 1280, false));
        // Past it, split.
        assert!(rule.split(40, 1, 640, 1800, false));
        // Other head sizes take the general kernel, never split.
        assert!(!SplitRule { head_dim: 36, ..rule }.split(1, 1, 4096, 8, true));
        assert!(matches!(
            Plan::new(36, 4, 1, 100, 0, 1, 528, None),
            Plan::General { .. }
        ));
        assert_eq!(
            Plan::new(128, 32, 1, 16384, 0, 1, 528, Some(7)),
            Plan::Flash {
                items: 0,
                count: 1,
                split: Some(Split { parts: 38, bases: 7 })
            }
        );
    }
}
