//! CUDA graphs for steps of a regular shape: every sequence with the same number of query
//! tokens (one for decode, the drafts plus one for a speculative check) and every row's logits
//! wanted. Such a step is padded up a ladder of sequence counts and its contexts up a ladder of
//! attention partitions, so that a few shapes cover every step; each shape's forward is captured
//! once and replayed with its metadata copied to one fixed device buffer, which is what makes a
//! replay valid: a graph's kernels keep the addresses, grids and sizes of their capture.
//!
//! Padded sequences read and write one reserved KV block that the engine never hands out, and
//! their rows' logits are never read. The attention of a real row is the same whatever the
//! padding (fixed partitions at absolute positions, attention.rs), and the GEMVs give a row the
//! same bits for one to eight rows, so a replay gives the tokens eager execution gives for the
//! same padded shape; where padding takes a batch across the GEMV/cuBLAS boundary its rows may
//! round differently, as a batch of that size would eagerly.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DevicePtr};

use super::attention::{FLASH_BLOCK, FLASH_PART};
use crate::runtime::batch::ForwardBatch;
use crate::runtime::error::{Result, RuntimeError};

/// Query tokens per sequence a graph takes at most: a padded sequence writes that many slots
/// of the reserved block.
pub const MAX_PER_SEQ: usize = FLASH_BLOCK;

/// A captured step's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Sequences, the real ones and the padding.
    pub seqs: usize,
    /// Query tokens of each.
    pub per_seq: usize,
    /// Attention partitions of `FLASH_PART` keys that the longest context may fill.
    pub parts: usize,
}

impl Shape {
    /// The longest context the shape takes.
    pub fn max_len(&self) -> usize {
        self.parts * FLASH_PART
    }

    /// Block-table entries per sequence: every block such a context can use.
    pub fn table_width(&self) -> usize {
        self.max_len() / FLASH_BLOCK
    }
}

/// The padded batch counts a graph is captured for: 1, 2, 4, 8, then every multiple of 8.
pub fn ladder(max_seqs: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> = [1, 2, 4].into_iter().filter(|&s| s < max_seqs).collect();
    sizes.extend((8..max_seqs).step_by(8));
    sizes.push(max_seqs);
    sizes.dedup();
    sizes
}

/// Where a step's shape is regular, the shape that covers it: its sequences padded up `ladder`
/// and its longest context up powers of two of partitions, at most `max_parts`.
pub fn shape_of(batch: &ForwardBatch, ladder: &[usize], max_parts: usize) -> Option<Shape> {
    let n = batch.num_seqs();
    let per_seq = *batch.query_start.get(1)? as usize;
    if per_seq == 0 || per_seq > MAX_PER_SEQ || batch.num_tokens() != n * per_seq {
        return None;
    }
    if batch.query_start.windows(2).any(|w| (w[1] - w[0]) as usize != per_seq) {
        return None;
    }
    let every_row = batch.logits_rows.len() == batch.num_tokens()
        && batch.logits_rows.iter().enumerate().all(|(i, &r)| r as usize == i);
    if !every_row {
        return None;
    }
    let seqs = *ladder.iter().find(|&&s| s >= n)?;
    let longest = batch.context_lens.iter().copied().max().unwrap_or(1) as usize;
    let parts = longest.max(1).div_ceil(FLASH_PART).next_power_of_two();
    (parts <= max_parts).then_some(Shape { seqs, per_seq, parts })
}

/// The batch a captured shape runs: `batch`'s sequences (block tables cut to the shape's
/// width: only the blocks its contexts fill are read), then padded ones of the same number
/// of tokens at position 0 on the reserved block.
pub fn padded(batch: &ForwardBatch, shape: Shape, reserved_block: u32) -> ForwardBatch {
    let width = shape.table_width();
    let mut out = ForwardBatch::default();
    for s in 0..batch.num_seqs() {
        let (lo, hi) = (batch.query_start[s] as usize, batch.query_start[s + 1] as usize);
        let table = &batch.block_tables[s];
        out.push_sequence(
            &batch.token_ids[lo..hi],
            batch.positions[lo] as usize,
            &table[..table.len().min(width)],
            FLASH_BLOCK,
        );
        // push_sequence derives slots from the cut table; the batch's own are the truth.
        out.slot_mapping[lo..hi].copy_from_slice(&batch.slot_mapping[lo..hi]);
    }
    let pad = vec![0u32; shape.per_seq];
    for _ in batch.num_seqs()..shape.seqs {
        out.push_sequence(&pad, 0, &[reserved_block], FLASH_BLOCK);
    }
    out.logits_rows = (0..out.num_tokens() as u32).collect();
    out
}

/// A graph moves with its backend between threads, one call at a time (`&mut` access only):
/// the driver asks only that no two threads use a graph at once.
struct Captured(CudaGraph);

// SAFETY: see above; `Graphs` hands out no reference to a graph.
unsafe impl Send for Captured {}

/// The graphs captured so far and the buffer their metadata lives in.
pub struct Graphs {
    pub ladder: Vec<usize>,
    pub max_parts: usize,
    captured: HashMap<Shape, Captured>,
    /// Shapes whose capture failed: they run eagerly.
    refused: HashSet<Shape>,
    replays: u64,
    /// The fixed home of a replayed step's metadata (every shape's layout starts at word 0).
    meta: CudaSlice<u32>,
}

impl Graphs {
    pub fn new(stream: &Arc<CudaStream>, max_seqs: usize, max_parts: usize, meta_words: usize) -> Result<Self> {
        let meta = stream
            .alloc_zeros::<u32>(meta_words)
            .map_err(|e| RuntimeError::Device(format!("the graphs' metadata buffer: {e}")))?;
        Ok(Graphs {
            ladder: ladder(max_seqs),
            max_parts: max_parts.max(1).next_power_of_two(),
            captured: HashMap::new(),
            refused: HashSet::new(),
            replays: 0,
            meta,
        })
    }

    pub fn meta_words(&self) -> usize {
        self.meta.len()
    }

    pub fn meta_addr(&self, stream: &Arc<CudaStream>) -> u64 {
        self.meta.device_ptr(stream).0
    }

    pub fn ready(&self, shape: Shape) -> bool {
        self.captured.contains_key(&shape)
    }

    pub fn refused(&self, shape: Shape) -> bool {
        self.refused.contains(&shape)
    }

    /// Every captured graph's addresses die with the activations they were captured over.
    pub fn forget(&mut self) {
        self.captured.clear();
    }

    pub fn count(&self) -> usize {
        self.captured.len()
    }

    pub fn replays(&self) -> u64 {
        self.replays
    }

    /// Records what `queue` queues on `stream` as `shape`'s graph; a shape whose capture fails
    /// is refused from then on (the caller runs it eagerly) and the error returned.
    pub fn capture(
        &mut self,
        stream: &Arc<CudaStream>,
        shape: Shape,
        queue: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let err = |what: &str, e: String| RuntimeError::Backend(format!("capturing a graph of {shape:?}: {what}: {e}"));
        if let Err(e) = stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) {
            self.refused.insert(shape);
            return Err(err("begin", e.to_string()));
        }
        let queued = queue();
        // The capture must end whatever happened inside it, or the stream stays capturing.
        let ended = stream.end_capture(CUgraphInstantiate_flags(0));
        let graph = match (queued, ended) {
            (Ok(()), Ok(Some(g))) => Ok(g),
            (Err(e), _) => Err(e),
            (_, Err(e)) => Err(err("end", e.to_string())),
            (_, Ok(None)) => Err(err("end", "no graph".into())),
        }
        .inspect_err(|_| {
            self.refused.insert(shape);
        })?;
        graph.upload().map_err(|e| err("upload", e.to_string()))?;
        self.captured.insert(shape, Captured(graph));
        Ok(())
    }

    pub fn launch(&mut self, shape: Shape) -> Result<()> {
        self.replays += 1;
        let graph = self
            .captured
            .get(&shape)
            .ok_or_else(|| RuntimeError::Backend(format!("no graph captured for {shape:?}")))?;
        graph
            .0
            .launch()
            .map_err(|e| RuntimeError::Backend(format!("replaying the graph of {shape:?}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_batch(lens: &[usize], per_seq: usize) -> ForwardBatch {
        let mut b = ForwardBatch::default();
        let mut next = 0u32;
        for &len in lens {
            let blocks = len.div_ceil(FLASH_BLOCK) as u32 + 1;
            let table: Vec<u32> = (next..next + blocks).collect();
            next += blocks;
            b.push_sequence(&vec![5; per_seq], len - per_seq, &table, FLASH_BLOCK);
        }
        b.logits_rows = (0..b.num_tokens() as u32).collect();
        b
    }

    #[test]
    fn the_ladder_covers_every_count_up_to_the_largest() {
        assert_eq!(ladder(1), vec![1]);
        assert_eq!(ladder(6), vec![1, 2, 4, 6]);
        assert_eq!(ladder(20), vec![1, 2, 4, 8, 16, 20]);
        let l = ladder(256);
        assert_eq!(&l[..5], &[1, 2, 4, 8, 16]);
        assert_eq!(*l.last().unwrap(), 256);
        assert!(l.windows(2).all(|w| w[0] < w[1] && w[1] - w[0] <= 8));
    }

    #[test]
    fn regular_steps_get_a_shape_and_others_run_eagerly() {
        let l = ladder(64);
        let shape = shape_of(&decode_batch(&[100, 700, 20], 1), &l, 16).unwrap();
        assert_eq!(
            shape,
            Shape {
                seqs: 4,
                per_seq: 1,
                parts: 2
            }
        );
        // Speculative checks of 4 tokens each; a 1,100-token context takes 4 partitions.
        let shape = shape_of(&decode_batch(&[1100, 30], 4), &l, 16).unwrap();
        assert_eq!(
            shape,
            Shape {
                seqs: 2,
                per_seq: 4,
                parts: 4
            }
        );
        // Mixed query lengths (a prefill chunk beside decode tokens).
        let mut mixed = decode_batch(&[100], 1);
        mixed.push_sequence(&[1, 2, 3], 0, &[90], FLASH_BLOCK);
        mixed.logits_rows = (0..4).collect();
        assert_eq!(shape_of(&mixed, &l, 16), None);
        // Only some rows' logits wanted.
        let mut some = decode_batch(&[100, 200], 2);
        some.logits_rows = vec![1, 3];
        assert_eq!(shape_of(&some, &l, 16), None);
        // More sequences than the ladder holds, or a context past its partitions.
        assert_eq!(shape_of(&decode_batch(&[10; 65], 1), &l, 16), None);
        assert_eq!(shape_of(&decode_batch(&[9000], 1), &l, 16), None);
    }

    #[test]
    fn padding_keeps_the_real_rows_and_parks_the_rest_on_the_reserved_block() {
        let b = decode_batch(&[40, 1000, 7], 2);
        let shape = shape_of(&b, &ladder(16), 8).unwrap();
        assert_eq!(
            shape,
            Shape {
                seqs: 4,
                per_seq: 2,
                parts: 2
            }
        );
        let p = padded(&b, shape, 999);
        assert_eq!(p.num_seqs(), 4);
        assert_eq!(&p.token_ids[..6], &b.token_ids[..]);
        assert_eq!(&p.positions[..6], &b.positions[..]);
        assert_eq!(&p.slot_mapping[..6], &b.slot_mapping[..]);
        assert_eq!(&p.context_lens[..3], &b.context_lens[..]);
        assert_eq!(p.positions[6..], [0, 1]);
        assert_eq!(p.slot_mapping[6..], [999 * 16, 999 * 16 + 1]);
        assert_eq!(p.block_tables[3], vec![999]);
        assert!(p.block_tables.iter().all(|t| t.len() <= shape.table_width()));
        assert_eq!(p.logits_rows, (0..8).collect::<Vec<u32>>());
    }
}
