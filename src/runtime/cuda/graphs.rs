//! CUDA graphs for steps of few query tokens per sequence: decode steps, speculative checks,
//! jump-forward's known tokens. Such a step is padded to a shape: its sequences up a ladder of
//! counts, each sequence's tokens to the step's most, its contexts up powers of two of attention
//! partitions and its rows of logits to one a sequence or all, so that a few shapes cover every
//! step. Each shape's forward is captured (a check's once its shape recurs, its first steps
//! eager; any other's at once, but one with known tokens on a model that keeps the device
//! busier than the host once it recurs too) and replayed with its metadata copied to one fixed
//! device buffer, which is what makes a replay valid: a graph's kernels keep the addresses,
//! grids and sizes of their capture.
//!
//! A sequence's padding goes before its tokens, at position 0, so that its real rows stay last
//! and keep their keys (the attention kernel reads an item's keys up to its last row's
//! position); padded tokens write their keys to one reserved KV block that the engine never
//! hands out, and their logits are never read: the wanted rows come first in the logits. A real
//! row's attention is the same whatever the padding (fixed partitions at absolute positions,
//! attention.rs), and the GEMVs give a row the same bits for one to eight rows, so a replay gives
//! what eager execution gives; where padding takes a batch across the GEMV/cuBLAS boundary its
//! rows may round as a batch of the padded size would.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DevicePtr};

use super::attention::{part_units, FLASH_BLOCK, FLASH_PART};
use crate::runtime::batch::ForwardBatch;
use crate::runtime::error::{Result, RuntimeError};

/// Query tokens per sequence a graph takes at most: a sequence's padding writes at most that
/// many slots of the reserved block.
pub const MAX_PER_SEQ: usize = FLASH_BLOCK;

/// Tokens a step may be padded to whatever its real count: below this the products read
/// their weights once either way (bandwidth-bound), so padding costs next to nothing.
const FREE_PADDING: usize = 64;

/// Multiply-adds that padding may add to a step of one logits row a sequence whatever its own
/// tokens: about what the device does, at a small product's pace, in the time the host takes
/// to queue a step's few hundred kernels one by one (near a millisecond for 32 sequences). For
/// a small model that is hundreds of tokens (jump-forward's known tokens in a few sequences,
/// the rest padded to their length); for an 8B one, a few.
const PADDING_MACS: usize = 50_000_000_000;

/// Tokens of padding a step of a model that costs `macs_per_token` may take on beyond its own
/// and still replay a graph rather than run eagerly.
pub fn free_padding(macs_per_token: usize) -> usize {
    PADDING_MACS / macs_per_token.max(1)
}

/// Graphs kept at most: each holds device memory for its kernels' parameters, and a server
/// meets a few hundred shapes at most (sequences x tokens each x partitions x rows); shapes
/// past this run eagerly.
const MAX_GRAPHS: usize = 1024;

/// Steps of a check's shape not captured yet that run eagerly before it is captured. A capture
/// takes what a dozen eager steps of a small model take (10-25 ms for SmolLM2 on an H200), and
/// a check's shape follows how many drafts each of its requests got that step, so most are met
/// a few times: 71-122 shapes were captured during a benchmark of SmolLM2's speculative
/// extraction at batch 32, 0.7-1.0 s in all, against runs of about 3 s. Steps of one logits
/// row a sequence (decode, known tokens) follow the batch's sequences and the grammar's forced
/// text, and recur: theirs are captured at once (delayed too, SmolLM2's plain decoding lost
/// 3-4%), except a step's with known tokens on a model whose steps keep the device busier than
/// the host (`Graphs::device_bound`): a replay there saves nothing the pipelined host does not
/// already hide, a capture costs 3-4 ms, and such a shape follows the longest run of known
/// tokens: 25 were captured during one 6.8 s pass of the 8B shape's extraction at 256
/// requests, most met once or twice. It waits as a check's does.
const EAGER_BEFORE_CAPTURE: u32 = 2;

/// How often each shape has been met while not captured.
#[derive(Debug, Default)]
struct Sightings(HashMap<Shape, u32>);

impl Sightings {
    /// Counts a step of `shape`; whether the shape is now worth capturing: a check's once it
    /// recurs; a step's of one row a sequence at once, but one with known tokens on a model
    /// whose steps keep the device busier than the host (`device_bound`) once it recurs. Counts
    /// are kept after the capture, so that a shape whose graph is forgotten is captured again
    /// at once.
    fn due(&mut self, shape: Shape, device_bound: bool) -> bool {
        if shape.rows == shape.seqs && (shape.per_seq == 1 || !device_bound) {
            return true;
        }
        let seen = self.0.entry(shape).or_insert(0);
        *seen += 1;
        *seen > EAGER_BEFORE_CAPTURE
    }
}

/// A captured step's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Sequences, the real ones and the padding.
    pub seqs: usize,
    /// Query tokens of each.
    pub per_seq: usize,
    /// The longest context it takes, in units of `FLASH_PART` keys (a power of two).
    pub parts: usize,
    /// Rows of logits.
    pub rows: usize,
    /// Attention split by partitions (`attention::SplitRule`'s choice for the step captured,
    /// kept by every replay).
    pub split: bool,
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

/// Padded counts (of sequences, of rows): 1, 2, 4, 8, then every multiple of 8, the last
/// `max` itself.
pub fn ladder(max: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> = [1, 2, 4].into_iter().filter(|&s| s < max).collect();
    sizes.extend((8..max).step_by(8));
    sizes.push(max);
    sizes.dedup();
    sizes
}

/// Where a step has few tokens per sequence, the shape that covers it: its sequences padded up
/// `ladder`, its tokens per sequence to the most any has, its longest context up powers of two
/// of partitions (at most `max_parts`), its rows to one a sequence or all; `split` decides its
/// attention's split. None where padding would add more work than the replay saves: on a
/// model whose launches outlast its products (`free_padding` of `FREE_PADDING` or more), past
/// the free ones, more than `free_padding` tokens and more than the step's own tokens; on one
/// whose steps keep the device busy, more than `free_padding` tokens within its sequences
/// (those up the ladder are padded whole, as every decode step's are). There a replay saves
/// nothing the pipelined host does not hide, and doubling a step's tokens is dearer: 512
/// sequences of the 8B shape, a few with jump-forward's known tokens, took 32-35 ms a step
/// padded to two tokens each, 26-30 eagerly, against 22-24 for a decode step of as many
/// sequences (one H100 lease, `scripts/step-shapes.py`).
pub fn shape_of(
    batch: &ForwardBatch,
    ladder: &[usize],
    max_parts: usize,
    free_padding: usize,
    split: impl FnOnce(&Shape) -> bool,
) -> Option<Shape> {
    let n = batch.num_seqs();
    let per_seq = batch.longest_query()?;
    if per_seq > MAX_PER_SEQ {
        return None;
    }
    let seqs = *ladder.iter().find(|&&s| s >= n)?;
    let tokens = seqs * per_seq;
    // One row a sequence (decode, known tokens) or every row (checks): two shapes, not one for
    // each count of rows.
    let rows = if batch.logits_rows.len() <= seqs { seqs } else { tokens };
    // A padded check computes and draws a row of logits for every padded token too; the free
    // padding is for steps of one row a sequence (known tokens beside decode tokens).
    let real = batch.num_tokens();
    let free = if rows == seqs { free_padding } else { 0 };
    let refused = match free_padding >= FREE_PADDING {
        true => tokens > FREE_PADDING.max(2 * real) && tokens - real > free,
        // The sequences up the ladder are what every step of that many pays, decode steps
        // among them; only the tokens padded within sequences are weighed.
        false => tokens > FREE_PADDING && tokens - real - (seqs - n) * per_seq > free,
    };
    if refused {
        return None;
    }
    let longest = batch.context_lens.iter().copied().max().unwrap_or(1) as usize;
    let parts = part_units(longest).next_power_of_two();
    if parts > max_parts {
        return None;
    }
    let mut shape = Shape {
        seqs,
        per_seq,
        parts,
        rows,
        split: false,
    };
    shape.split = split(&shape);
    Some(shape)
}

/// The batch a captured shape runs: each of `batch`'s sequences with its padding before its
/// tokens (at position 0, on the reserved block) and its block table cut to the shape's width
/// (only the blocks its contexts fill are read), then padded sequences; the wanted rows first,
/// in order, then filler rows up to the shape's.
pub fn padded(batch: &ForwardBatch, shape: Shape, reserved_block: u32) -> ForwardBatch {
    let (q, width) = (shape.per_seq, shape.table_width());
    let reserved_slot = |i: usize| reserved_block * FLASH_BLOCK as u32 + i as u32;
    let mut out = ForwardBatch::default();
    out.query_start.push(0);
    // Where each of the batch's tokens lands.
    let mut moved = vec![0u32; batch.num_tokens()];
    for s in 0..shape.seqs {
        let (lo, hi) = match s < batch.num_seqs() {
            true => (batch.query_start[s] as usize, batch.query_start[s + 1] as usize),
            false => (0, 0),
        };
        for i in 0..q - (hi - lo) {
            out.token_ids.push(0);
            out.positions.push(0);
            out.slot_mapping.push(reserved_slot(i));
        }
        for (t, slot) in moved.iter_mut().enumerate().take(hi).skip(lo) {
            *slot = out.token_ids.len() as u32;
            out.token_ids.push(batch.token_ids[t]);
            out.positions.push(batch.positions[t]);
            out.slot_mapping.push(batch.slot_mapping[t]);
        }
        out.query_start.push(out.token_ids.len() as u32);
        if s < batch.num_seqs() {
            let table = &batch.block_tables[s];
            out.block_tables.push(table[..table.len().min(width)].to_vec());
            out.context_lens.push(batch.context_lens[s]);
        } else {
            out.block_tables.push(vec![reserved_block]);
            out.context_lens.push(1);
        }
    }
    out.logits_rows = batch.logits_rows.iter().map(|&r| moved[r as usize]).collect();
    out.logits_rows.resize(shape.rows, 0);
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
    /// Tokens of padding this model's steps of one logits row a sequence may take on whatever
    /// their own count (`free_padding`).
    pub free_padding: usize,
    captured: HashMap<Shape, Captured>,
    /// Shapes whose capture failed: they run eagerly.
    refused: HashSet<Shape>,
    sightings: Sightings,
    /// Steps run eagerly while their shape was not yet worth capturing.
    eager_before_capture: u64,
    /// Whether the last `shape_for` left its step eager to wait for its shape's capture.
    awaited_last: bool,
    replays: u64,
    capture_time: Duration,
    /// The fixed home of a replayed step's metadata (every shape's layout starts at word 0).
    meta: CudaSlice<u32>,
}

impl Graphs {
    pub fn new(
        stream: &Arc<CudaStream>,
        max_seqs: usize,
        max_parts: usize,
        free_padding: usize,
        meta_words: usize,
    ) -> Result<Self> {
        let meta = stream
            .alloc_zeros::<u32>(meta_words)
            .map_err(|e| RuntimeError::Device(format!("the graphs' metadata buffer: {e}")))?;
        Ok(Graphs {
            ladder: ladder(max_seqs),
            max_parts: max_parts.max(1).next_power_of_two(),
            free_padding,
            captured: HashMap::new(),
            refused: HashSet::new(),
            sightings: Sightings::default(),
            eager_before_capture: 0,
            awaited_last: false,
            replays: 0,
            capture_time: Duration::ZERO,
            meta,
        })
    }

    pub fn meta_words(&self) -> usize {
        self.meta.len()
    }

    pub fn meta_addr(&self, stream: &Arc<CudaStream>) -> u64 {
        self.meta.device_ptr(stream).0
    }

    /// The shape `batch` replays as (captured first where it is new), unless it runs eagerly:
    /// no shape covers it, its shape is refused, or it is not yet worth capturing
    /// (`EAGER_BEFORE_CAPTURE`).
    pub fn shape_for(&mut self, batch: &ForwardBatch, split: impl FnOnce(&Shape) -> bool) -> Option<Shape> {
        self.awaited_last = false;
        let shape =
            shape_of(batch, &self.ladder, self.max_parts, self.free_padding, split).filter(|&s| !self.refused(s))?;
        if self.ready(shape) || self.sightings.due(shape, self.device_bound()) {
            return Some(shape);
        }
        self.eager_before_capture += 1;
        self.awaited_last = true;
        None
    }

    /// Whether this model's steps keep the device busier than the host: padding a step by a
    /// few dozen tokens is not free (`free_padding`), as for an 8B model, whose steps of many
    /// sequences are GPU-bound; a small one's (SmolLM2: hundreds of tokens) are host-bound.
    fn device_bound(&self) -> bool {
        self.free_padding < FREE_PADDING
    }

    /// Whether the last step asked of `shape_for` ran eagerly while its shape waits to be
    /// captured: a step that costs more than its shape's replays will.
    pub fn awaited_last(&self) -> bool {
        self.awaited_last
    }

    pub fn ready(&self, shape: Shape) -> bool {
        self.captured.contains_key(&shape)
    }

    /// Whether `shape` runs eagerly: its capture failed, or the graphs are all taken.
    fn refused(&self, shape: Shape) -> bool {
        self.refused.contains(&shape) || (self.captured.len() >= MAX_GRAPHS && !self.ready(shape))
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

    /// What the graphs cost and did so far, for the timing report.
    pub fn report(&self) -> String {
        format!(
            "CUDA graphs: {} captured in {:.0} ms, {} refused, {} steps replayed, {} run eagerly before their shape's capture",
            self.captured.len(),
            self.capture_time.as_secs_f64() * 1e3,
            self.refused.len(),
            self.replays,
            self.eager_before_capture
        )
    }

    /// Records what `queue` queues on `stream` as `shape`'s graph; a shape whose capture fails
    /// is refused from then on (the caller runs it eagerly) and the error returned.
    pub fn capture(
        &mut self,
        stream: &Arc<CudaStream>,
        shape: Shape,
        queue: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let started = Instant::now();
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
        self.capture_time += started.elapsed();
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

    /// Sequences of `per_seq[i]` query tokens ending at context `lens[i]`, every row wanted.
    fn step(lens: &[usize], per_seq: &[usize]) -> ForwardBatch {
        let mut b = ForwardBatch::default();
        let mut next = 0u32;
        for (&len, &q) in lens.iter().zip(per_seq) {
            let blocks = len.div_ceil(FLASH_BLOCK) as u32 + 1;
            let table: Vec<u32> = (next..next + blocks).collect();
            next += blocks;
            let tokens: Vec<u32> = (0..q as u32).map(|i| 7 + i).collect();
            b.push_sequence(&tokens, len - q, &table, FLASH_BLOCK);
        }
        b.logits_rows = (0..b.num_tokens() as u32).collect();
        b
    }

    #[test]
    fn a_checks_shape_is_captured_once_it_recurs_and_known_tokens_where_the_host_is_slower() {
        let shape = |per_seq, rows| Shape {
            seqs: 8,
            per_seq,
            parts: 1,
            rows,
            split: false,
        };
        let check = |per_seq| shape(per_seq, 8 * per_seq);
        for device_bound in [false, true] {
            let mut seen = Sightings::default();
            for _ in 0..EAGER_BEFORE_CAPTURE {
                assert!(!seen.due(check(3), device_bound), "met too rarely yet");
            }
            assert!(!seen.due(check(4), device_bound), "each shape counts apart");
            assert!(seen.due(check(3), device_bound));
            assert!(
                seen.due(check(3), device_bound),
                "and stays due, should its graph be forgotten"
            );
            assert!(seen.due(shape(1, 8), device_bound), "decode");
        }
        let mut seen = Sightings::default();
        assert!(
            seen.due(shape(5, 8), false),
            "known tokens where the host is the slower"
        );
        for _ in 0..EAGER_BEFORE_CAPTURE {
            assert!(!seen.due(shape(5, 8), true), "known tokens on a busy device: not yet");
        }
        assert!(
            seen.due(shape(5, 8), true),
            "known tokens on a busy device, once they recur"
        );
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
    fn steps_of_few_tokens_a_sequence_get_a_shape_and_others_run_eagerly() {
        let l = ladder(64);
        let shape = |lens: &[usize], q: &[usize]| shape_of(&step(lens, q), &l, 16, 0, |_| false);
        let decode = Shape {
            seqs: 4,
            per_seq: 1,
            parts: 2,
            rows: 4,
            split: false,
        };
        assert_eq!(shape(&[100, 700, 20], &[1, 1, 1]), Some(decode));
        // Speculative checks of 4 tokens each; a 1,100-token context takes 4 partitions.
        let checks = Shape {
            seqs: 2,
            per_seq: 4,
            parts: 4,
            rows: 8,
            split: false,
        };
        assert_eq!(shape(&[1100, 30], &[4, 4]), Some(checks));
        // Checks of different lengths, or jump-forward's known tokens beside decode tokens.
        let mixed = Shape {
            seqs: 4,
            per_seq: 5,
            parts: 1,
            rows: 20,
            split: false,
        };
        assert_eq!(shape(&[100, 200, 300], &[1, 5, 2]), Some(mixed));
        // Only the last row of each wanted.
        let mut known = step(&[100, 200], &[3, 1]);
        known.logits_rows = vec![2, 3];
        let last_rows = Shape {
            seqs: 2,
            per_seq: 3,
            parts: 1,
            rows: 2,
            split: false,
        };
        assert_eq!(shape_of(&known, &l, 16, 0, |_| false), Some(last_rows));
        // A prefill chunk, more tokens of padding than the step's own (past the free ones), more
        // sequences than the ladder holds, or a context past its partitions.
        assert_eq!(shape(&[100, 40], &[1, 40]), None);
        let forty = Shape {
            seqs: 40,
            per_seq: 1,
            parts: 1,
            rows: 40,
            split: false,
        };
        assert_eq!(shape(&[300; 40], &[1; 40]), Some(forty));
        let mut lopsided = vec![1; 40];
        lopsided[0] = 16;
        assert_eq!(shape(&[300; 40], &lopsided), None);
        // A model small enough that 585 tokens of padding cost less than running eagerly:
        // known tokens beside decode tokens (each sequence's last row wanted), not a check.
        let mut known = step(&[300; 40], &lopsided);
        known.logits_rows = known.query_start[1..].iter().map(|&end| end - 1).collect();
        let lopsided_shape = Shape {
            seqs: 40,
            per_seq: 16,
            parts: 1,
            rows: 40,
            split: false,
        };
        let small = |free| shape_of(&known, &l, 16, free, |_| false);
        assert_eq!(small(584), None);
        assert_eq!(small(585), Some(lopsided_shape));
        assert_eq!(shape_of(&step(&[300; 40], &lopsided), &l, 16, 585, |_| false), None);
        assert_eq!(shape(&[10; 65], &[1; 65]), None);
        assert_eq!(shape(&[9000], &[1]), None);
    }

    #[test]
    fn only_a_model_whose_launches_outlast_its_products_doubles_a_step_to_replay_it() {
        let l = ladder(512);
        // 512 sequences, eleven of them with jump-forward's second known token: 523 tokens,
        // 1,024 once every sequence is padded to two. Each sequence's last row wanted.
        let mut q = vec![1; 512];
        q[..11].fill(2);
        let mut known = step(&[600; 512], &q);
        known.logits_rows = known.query_start[1..].iter().map(|&end| end - 1).collect();
        let (eight_b, smol) = (6, 370);
        assert_eq!(shape_of(&known, &l, 16, eight_b, |_| false), None);
        let doubled = shape_of(&known, &l, 16, smol, |_| false).expect("a small model replays it");
        assert_eq!((doubled.seqs, doubled.per_seq, doubled.rows), (512, 2, 512));
        // Checks of up to five tokens in 32 sequences, 88 in all, padded to 160 (every row drawn,
        // so no padding is free): a small model replays them, an 8B one runs them eagerly.
        let drafts: Vec<usize> = (0..32).map(|i| if i % 4 == 0 { 5 } else { 2 }).collect();
        let checks = step(&[300; 32], &drafts);
        assert_eq!(checks.num_tokens(), 88);
        assert_eq!(shape_of(&checks, &l, 16, eight_b, |_| false), None);
        let replayed = shape_of(&checks, &l, 16, smol, |_| false).expect("a small model replays them");
        assert_eq!((replayed.seqs, replayed.per_seq, replayed.rows), (32, 5, 160));
        // However large the model, a step of at most FREE_PADDING tokens padded is replayed,
        // and a decode step's sequences go up the ladder whole: 249 of them as 256.
        let few = step(&[300; 8], &[1, 1, 1, 1, 1, 1, 1, 5]);
        assert!(shape_of(&few, &l, 16, eight_b, |_| false).is_some());
        let decode = shape_of(&step(&[300; 249], &[1; 249]), &l, 16, eight_b, |_| false);
        assert_eq!(decode.map(|s| (s.seqs, s.per_seq)), Some((256, 1)));
        // A second known token in one of them pads the 248 others within: eager.
        let mut q = vec![1; 249];
        q[0] = 2;
        let mut known = step(&[300; 249], &q);
        known.logits_rows = known.query_start[1..].iter().map(|&end| end - 1).collect();
        assert_eq!(known.num_tokens(), 250);
        assert_eq!(shape_of(&known, &l, 16, eight_b, |_| false), None);
    }

    #[test]
    fn a_small_model_pads_hundreds_of_tokens_and_an_8b_one_a_few_and_is_device_bound() {
        use crate::runtime::config::ModelConfig;
        let llama = ModelConfig::preset("llama-3.1-8b").expect("a preset");
        // Llama-3.1-8B's 8.03 billion parameters less its 525 million-entry embedding table,
        // which is looked up, not multiplied.
        let macs = llama.macs_per_token();
        assert!((7.4e9..7.6e9).contains(&(macs as f64)), "{macs}");
        assert!(free_padding(macs) < 8);
        // SmolLM2-135M: 30 layers of width 576 (heads of 64: 9 for queries, 3 for keys and
        // values), an MLP of 1,536, a 49,152-word head.
        let smol = ModelConfig::from_hf_json(
            r#"{"model_type":"llama","vocab_size":49152,"hidden_size":576,"intermediate_size":1536,
            "num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,"rope_theta":100000.0,
            "rms_norm_eps":1e-5,"max_position_embeddings":8192}"#,
        )
        .expect("SmolLM2's config");
        assert!((300..450).contains(&free_padding(smol.macs_per_token())));
        // So the 8B model's steps count as device-bound (`Graphs::device_bound`), SmolLM2's not.
        assert!(free_padding(macs) < FREE_PADDING);
        assert!(free_padding(smol.macs_per_token()) >= FREE_PADDING);
    }

    #[test]
    fn padding_goes_before_each_sequences_tokens_and_the_wanted_rows_come_first() {
        let mut b = step(&[40, 1000, 7], &[2, 1, 3]);
        b.logits_rows = vec![1, 2, 5];
        let shape = shape_of(&b, &ladder(16), 8, 0, |_| false).unwrap();
        assert_eq!(
            shape,
            Shape {
                seqs: 4,
                per_seq: 3,
                parts: 2,
                rows: 4,
                split: false,
            }
        );
        let p = padded(&b, shape, 999);
        assert_eq!(p.num_seqs(), 4);
        assert_eq!(p.query_start, vec![0, 3, 6, 9, 12]);
        // Sequence 0: one pad, then its two tokens; sequence 1: two pads, then its one.
        assert_eq!(&p.token_ids[..6], &[0, 7, 8, 0, 0, 7]);
        assert_eq!(&p.positions[..6], &[0, 38, 39, 0, 0, 999]);
        assert_eq!(&p.slot_mapping[1..3], &b.slot_mapping[0..2]);
        assert_eq!(p.slot_mapping[0], 999 * 16);
        assert_eq!(&p.slot_mapping[3..5], &[999 * 16, 999 * 16 + 1]);
        assert_eq!(&p.token_ids[6..9], &b.token_ids[3..6]);
        assert_eq!(&p.context_lens[..3], &b.context_lens[..]);
        // The padded sequence: three tokens on the reserved block.
        assert_eq!(p.slot_mapping[9..], [999 * 16, 999 * 16 + 1, 999 * 16 + 2]);
        assert_eq!(p.block_tables[3], vec![999]);
        assert!(p.block_tables.iter().all(|t| t.len() <= shape.table_width()));
        // Rows 1, 2 and 5 of the batch, in order, then filler.
        assert_eq!(p.logits_rows, vec![2, 5, 8, 0]);
        for (&old, &new) in b.logits_rows.iter().zip(&p.logits_rows) {
            assert_eq!(b.token_ids[old as usize], p.token_ids[new as usize]);
            assert_eq!(b.positions[old as usize], p.positions[new as usize]);
        }
    }
}
