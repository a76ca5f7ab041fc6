//! Causal attention of each query token over its sequence's paged context. Keys, values,
//! queries and attention weights are bf16 in the products, accumulated in f32.
//!
//! Work is split by (run, kv head): a run is up to a few consecutive query tokens of one
//! sequence, so in prefill every key and value read from the pool serves all of the run's
//! tokens and all query heads sharing the kv head. Every score and every output is computed by
//! the same operations in the same order whatever it is batched or grouped with, so a
//! request's output does not depend on the rest of the batch or on how its prompt was chunked.

use std::cell::RefCell;

use half::bf16;

use super::pool::{parallel_for, SyncPtr};

pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Inputs of one layer's attention over the whole flattened batch.
pub struct AttentionInput<'a> {
    /// Rotated queries of every token: row `t` starts at `t * q_stride`.
    pub q: &'a [f32],
    pub q_stride: usize,
    /// Keys and values as `KvCache` lays them out.
    pub k_pool: &'a [bf16],
    pub v_pool: &'a [bf16],
    /// Per sequence, its block table.
    pub block_tables: &'a [Vec<u32>],
    pub runs: &'a [Run],
}

/// Consecutive query tokens of one sequence at consecutive positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub first_token: usize,
    pub len: usize,
    pub seq: usize,
    pub first_pos: usize,
}

/// Cuts the batch's query tokens into runs of at most `max_len` tokens.
pub fn runs(query_start: &[u32], positions: &[u32], max_len: usize) -> Vec<Run> {
    let mut out = Vec::new();
    for (seq, span) in query_start.windows(2).enumerate() {
        let mut t = span[0] as usize;
        while t < span[1] as usize {
            let first_pos = positions[t] as usize;
            let mut len = 1;
            while len < max_len && t + len < span[1] as usize && positions[t + len] as usize == first_pos + len {
                len += 1;
            }
            out.push(Run {
                first_token: t,
                len,
                seq,
                first_pos,
            });
            t += len;
        }
    }
    out
}

/// Query rows (token, head) one score kernel call handles: two accumulators each, plus the
/// key rows, fit the 32 vector registers.
const QK_ROWS: usize = 12;

/// Tokens per run for a model with `group` query heads per kv head.
pub fn run_len(group: usize) -> usize {
    (QK_ROWS / group.max(1)).max(1)
}

/// Query rows of one work item at most: a run's tokens times the group's heads.
const MAX_ROWS: usize = if QK_ROWS > MAX_GROUP { QK_ROWS } else { MAX_GROUP };

/// Per-thread buffers of one work item, kept between items and steps.
#[derive(Default)]
struct Scratch {
    /// The item's query rows in bf16, `head_dim` each.
    q: Vec<bf16>,
    /// Scores, `stride` per row.
    scores: Vec<f32>,
    /// Attention weights in bf16, `stride` per row, zero past each row's context.
    probs: Vec<bf16>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Writes `[tokens, num_heads * head_dim]` into `out`.
pub fn paged_attention(shape: &AttentionShape, input: &AttentionInput, out: &mut [f32]) {
    attend(Kernels::pick(shape.head_dim), shape, input, out)
}

fn attend(kernels: Kernels, shape: &AttentionShape, input: &AttentionInput, out: &mut [f32]) {
    let (hd, kvh) = (shape.head_dim, shape.num_kv_heads);
    let group = shape.num_heads / kvh;
    let out_width = shape.num_heads * hd;
    let block_stride = kvh * hd * BLOCK;
    let scale = 1.0 / (hd as f32).sqrt();
    let dst = SyncPtr(out.as_mut_ptr());
    parallel_for(input.runs.len() * kvh, |items| {
        SCRATCH.with(|cell| {
            let scratch = &mut *cell.borrow_mut();
            for item in items {
                let (run, g) = (input.runs[item / kvh], item % kvh);
                // Row r is token r / group of the run, query head g * group + r % group.
                let rows = run.len * group;
                let ctx = run.first_pos + run.len;
                let stride = ctx.next_multiple_of(BLOCK);
                scratch.q.clear();
                for r in 0..rows {
                    let at = (run.first_token + r / group) * input.q_stride + (g * group + r % group) * hd;
                    kernels.extend_bf16(&mut scratch.q, &input.q[at..at + hd]);
                }
                // Every score up to `stride` is written below, and every weight up to the row's
                // own context: only the weights past it need clearing, not whole buffers.
                grow(&mut scratch.scores, rows * stride, 0.0);
                grow(&mut scratch.probs, rows * stride, bf16::ZERO);
                let scores = &mut scratch.scores[..rows * stride];
                let probs = &mut scratch.probs[..rows * stride];
                let table = &input.block_tables[run.seq][..stride / BLOCK];
                for (b, &block) in table.iter().enumerate() {
                    let kt = &input.k_pool[block as usize * block_stride + g * hd * BLOCK..][..hd * BLOCK];
                    for (r0, qs) in scratch.q.chunks(QK_ROWS * hd).enumerate() {
                        let at = r0 * QK_ROWS * stride + b * BLOCK;
                        kernels.qk(qs, kt, scale, &mut scores[at..], stride);
                    }
                }
                for (r, (s, p)) in scores
                    .chunks_exact_mut(stride)
                    .zip(probs.chunks_exact_mut(stride))
                    .enumerate()
                {
                    // Causal: the token sees its own position and those before.
                    let own = run.first_pos + r / group + 1;
                    kernels.softmax(&mut s[..own], &mut p[..own]);
                    p[own..].fill(bf16::ZERO);
                }
                let mut outs = [SyncPtr(std::ptr::null_mut()); MAX_ROWS];
                for (r, o) in outs.iter_mut().enumerate().take(rows) {
                    // SAFETY: (token, head) output rows are disjoint across work items.
                    *o = SyncPtr(unsafe {
                        dst.at((run.first_token + r / group) * out_width + (g * group + r % group) * hd)
                    });
                }
                let values = Values {
                    pool: input.v_pool,
                    table,
                    offset: g * BLOCK * hd,
                    block_stride,
                    ctx,
                };
                kernels.pv(probs, stride, &values, &outs[..rows], hd);
            }
        })
    });
}

fn grow<T: Copy>(v: &mut Vec<T>, len: usize, fill: T) {
    if v.len() < len {
        v.resize(len, fill);
    }
}

/// Where one kv head's values of a sequence lie.
struct Values<'a> {
    pool: &'a [bf16],
    table: &'a [u32],
    /// Of the kv head within a block.
    offset: usize,
    block_stride: usize,
    /// Slots to read.
    ctx: usize,
}

impl Values<'_> {
    /// Channel `c` of the value of context position `s` (slot pairs interleaved, see
    /// `KvCache`).
    fn at(&self, s: usize, c: usize, hd: usize) -> bf16 {
        let (block, lane) = (self.table[s / BLOCK] as usize, s % BLOCK);
        self.pool[block * self.block_stride + self.offset + (lane / 2) * hd * 2 + c * 2 + lane % 2]
    }

    /// Per block of the context: its index, the kv head's values from the block's first
    /// slot pair on, and how many of its slots the context fills.
    fn blocks(&self) -> impl Iterator<Item = (usize, &[bf16], usize)> {
        self.table.iter().enumerate().map(|(b, &block)| {
            let values = &self.pool[block as usize * self.block_stride + self.offset..];
            (b, values, (self.ctx - b * BLOCK).min(BLOCK))
        })
    }
}

/// Channel `d` of key lane `lane` in one kv head's block (channel pairs interleaved).
fn key_at(kt: &[bf16], d: usize, lane: usize) -> bf16 {
    kt[(d / 2) * BLOCK * 2 + lane * 2 + d % 2]
}

/// The inner loops: scores of a block's keys, softmax, and the weighted sum of values.
/// The AVX-512 ones multiply bf16 pairs (`vdpbf16ps`: on this project's Zen 5 about three
/// times the multiply-adds per second of f32 FMAs) and accumulate in f32; the AVX2 ones widen
/// the pairs to f32 first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernels {
    Portable,
    Avx2,
    Avx512,
}

impl Kernels {
    fn pick(head_dim: usize) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bf16")
                && matches!(head_dim, 64 | 128)
            {
                return Kernels::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && head_dim.is_multiple_of(32) {
                return Kernels::Avx2;
            }
        }
        let _ = head_dim;
        Kernels::Portable
    }

    /// For each query row of `q` (`head_dim` each), its scaled dot products with the block's
    /// 16 keys into `scores[i * stride..][..BLOCK]`.
    fn qk(self, q: &[bf16], kt: &[bf16], scale: f32, scores: &mut [f32], stride: usize) {
        let hd = kt.len() / BLOCK;
        let n = q.len() / hd;
        assert!(n <= QK_ROWS && scores.len() >= (n - 1) * stride + BLOCK);
        #[cfg(target_arch = "x86_64")]
        match self {
            Kernels::Avx512 => {
                // SAFETY: `pick` checked the CPU and the head size; the rows of `scores` exist
                // (asserted above).
                unsafe {
                    macro_rules! call {
                        ($($n:literal)*) => {
                            match n {
                                $($n => avx512::qk::<$n>(q.as_ptr(), kt.as_ptr(), hd, scale, scores.as_mut_ptr(), stride),)*
                                _ => unreachable!("at most QK_ROWS queries"),
                            }
                        };
                    }
                    call!(1 2 3 4 5 6 7 8 9 10 11 12);
                }
                return;
            }
            Kernels::Avx2 => {
                // Three queries a call: their accumulators and the widened keys fill the 16
                // vector registers.
                for (c, q) in q.chunks(3 * hd).enumerate() {
                    let out = scores[c * 3 * stride..].as_mut_ptr();
                    // SAFETY: `pick` checked the CPU and the head size; the rows of `scores`
                    // exist (asserted above).
                    unsafe {
                        match q.len() / hd {
                            1 => avx2::qk::<1>(q.as_ptr(), kt.as_ptr(), hd, scale, out, stride),
                            2 => avx2::qk::<2>(q.as_ptr(), kt.as_ptr(), hd, scale, out, stride),
                            _ => avx2::qk::<3>(q.as_ptr(), kt.as_ptr(), hd, scale, out, stride),
                        }
                    }
                }
                return;
            }
            Kernels::Portable => {}
        }
        for (i, q) in q.chunks_exact(hd).enumerate() {
            for l in 0..BLOCK {
                let dot = (0..hd).fold(0f32, |a, d| q[d].to_f32().mul_add(key_at(kt, d, l).to_f32(), a));
                scores[i * stride + l] = dot * scale;
            }
        }
    }

    /// Appends the query row `x` to `out` as bf16.
    fn extend_bf16(self, out: &mut Vec<bf16>, x: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if self == Kernels::Avx2 {
            // SAFETY: `pick` checked the CPU.
            unsafe { avx2::extend_bf16(out, x) };
            return;
        }
        out.extend(x.iter().map(|&v| bf16::from_f32(v)));
    }

    /// Normalizes the scores `s` into the weights `p`.
    fn softmax(self, s: &mut [f32], p: &mut [bf16]) {
        #[cfg(target_arch = "x86_64")]
        if self == Kernels::Avx512 {
            // SAFETY: `pick` checked the CPU; the two rows have the same length.
            unsafe { avx512::softmax(s, p) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self == Kernels::Avx2 {
            // SAFETY: `pick` checked the CPU; the two rows have the same length.
            unsafe { avx2::softmax(s, p) };
            return;
        }
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut sum = 0f32;
        for v in s.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        for (p, &v) in p.iter_mut().zip(s.iter()) {
            *p = bf16::from_f32(v / sum);
        }
    }

    /// Output row `outs[i]` (`hd` floats) = sum over the context of the weight
    /// `p[i * stride + s]` times the value of position `s`.
    fn pv(self, p: &[bf16], stride: usize, values: &Values, outs: &[SyncPtr<f32>], hd: usize) {
        #[cfg(target_arch = "x86_64")]
        match self {
            Kernels::Avx512 => {
                // Rows share each loaded value pair, as many as the registers hold.
                let per_call = if hd == 64 { 6 } else { 3 };
                for (c, o) in outs.chunks(per_call).enumerate() {
                    let p = &p[c * per_call * stride..];
                    // SAFETY: `pick` checked the CPU and the head size; the caller owns the rows.
                    unsafe {
                        macro_rules! call {
                            ($c:literal: $($n:literal)*) => {
                                match o.len() {
                                    $($n => avx512::pv::<$c, $n>(p, stride, values, o),)*
                                    _ => unreachable!("at most {per_call} rows"),
                                }
                            };
                        }
                        if hd == 64 {
                            call!(4: 1 2 3 4 5 6)
                        } else {
                            call!(8: 1 2 3)
                        }
                    }
                }
                return;
            }
            Kernels::Avx2 => {
                for (c, o) in outs.chunks(2).enumerate() {
                    let p = &p[c * 2 * stride..];
                    // SAFETY: `pick` checked the CPU and the head size; the caller owns the rows.
                    unsafe {
                        match o.len() {
                            1 => avx2::pv::<1>(p, stride, values, o, hd),
                            _ => avx2::pv::<2>(p, stride, values, o, hd),
                        }
                    }
                }
                return;
            }
            Kernels::Portable => {}
        }
        let mut acc = vec![0f32; hd];
        for (i, o) in outs.iter().enumerate() {
            acc.fill(0.0);
            for s in 0..values.ctx {
                let w = p[i * stride + s].to_f32();
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = w.mul_add(values.at(s, c, hd).to_f32(), *a);
                }
            }
            // SAFETY: the caller owns `hd` floats at each output row.
            unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), o.0, hd) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

/// Most query heads per kv head (Qwen2.5-7B has 7, Llama-3-8B 4).
pub const MAX_GROUP: usize = 16;

/// Tokens per KV block: the keys of one block and one kv head are `head_dim` rows of `BLOCK`
/// lanes, so one query meets the whole block in `head_dim` vector FMAs, with no horizontal sums.
pub const BLOCK: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::batch::KvLayout;
    use crate::runtime::cpu::kv_cache::KvCache;
    use crate::runtime::cpu::q4_1_x16::test_rng;

    /// Two sequences in a shuffled pool: one with 7 query tokens at positions 30..37 (a
    /// prefill chunk past a cached prefix), one decoding at position 19.
    struct Case {
        shape: AttentionShape,
        kv: KvCache,
        q: Vec<f32>,
        tables: Vec<Vec<u32>>,
        query_start: Vec<u32>,
        positions: Vec<u32>,
    }

    fn case(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> Case {
        let mut next = test_rng(7);
        let mut uniform = move || (next() % 20001) as f32 / 10000.0 - 1.0;
        let layout = KvLayout {
            num_blocks: 8,
            block_size: BLOCK,
        };
        let mut kv = KvCache::new(layout, 1, num_kv_heads, head_dim);
        let tables = vec![vec![5, 2, 7], vec![0, 3]];
        let width = num_kv_heads * head_dim;
        for (table, ctx) in tables.iter().zip([37, 20]) {
            for pos in 0..ctx {
                let slot = table[pos / BLOCK] as usize * BLOCK + pos % BLOCK;
                let k: Vec<f32> = (0..width).map(|_| 3.0 * uniform()).collect();
                let v: Vec<f32> = (0..width).map(|_| uniform()).collect();
                kv.write(0, &[slot as u32], |_| &k, |_| &v);
            }
        }
        let positions: Vec<u32> = (30..37).chain([19]).collect();
        let q = (0..positions.len() * num_heads * head_dim).map(|_| uniform()).collect();
        Case {
            shape: AttentionShape {
                num_heads,
                num_kv_heads,
                head_dim,
            },
            kv,
            q,
            tables,
            query_start: vec![0, 7, 8],
            positions,
        }
    }

    fn run(c: &Case, kernels: Kernels, run_len: usize) -> Vec<f32> {
        let (k_pool, v_pool) = c.kv.layer(0);
        let runs = runs(&c.query_start, &c.positions, run_len);
        let input = AttentionInput {
            q: &c.q,
            q_stride: c.shape.num_heads * c.shape.head_dim,
            k_pool,
            v_pool,
            block_tables: &c.tables,
            runs: &runs,
        };
        let mut out = vec![0f32; c.q.len()];
        attend(kernels, &c.shape, &input, &mut out);
        out
    }

    /// Attention in f64 over the bf16-rounded queries, keys and values.
    fn reference(c: &Case) -> Vec<f32> {
        let (hd, kvh) = (c.shape.head_dim, c.shape.num_kv_heads);
        let group = c.shape.num_heads / kvh;
        let (k_pool, v_pool) = c.kv.layer(0);
        let round = |x: f32| bf16::from_f32(x).to_f64();
        let mut out = vec![0f32; c.q.len()];
        for t in 0..c.positions.len() {
            let seq = if t < 7 { 0 } else { 1 };
            let table = &c.tables[seq];
            let ctx = c.positions[t] as usize + 1;
            for h in 0..c.shape.num_heads {
                let g = h / group;
                let q = &c.q[(t * c.shape.num_heads + h) * hd..][..hd];
                let scores: Vec<f64> = (0..ctx)
                    .map(|s| {
                        let block = table[s / BLOCK] as usize;
                        let kt = &k_pool[block * kvh * hd * BLOCK + g * hd * BLOCK..][..hd * BLOCK];
                        (0..hd)
                            .map(|d| round(q[d]) * key_at(kt, d, s % BLOCK).to_f64())
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                let values = Values {
                    pool: v_pool,
                    table,
                    offset: g * BLOCK * hd,
                    block_stride: kvh * hd * BLOCK,
                    ctx,
                };
                for ch in 0..hd {
                    let o: f64 = (0..ctx).map(|s| e[s] / sum * values.at(s, ch, hd).to_f64()).sum();
                    out[(t * c.shape.num_heads + h) * hd + ch] = o as f32;
                }
            }
        }
        out
    }

    #[test]
    fn attention_matches_f64_and_does_not_depend_on_how_tokens_are_grouped() {
        // SmolLM2 (9 heads over 3, 64 wide) and Llama-3-8B's grouping (4 per kv head, 128 wide).
        for (heads, kv_heads, hd) in [(9, 3, 64), (8, 2, 128)] {
            let c = case(heads, kv_heads, hd);
            let want = reference(&c);
            let picked = Kernels::pick(hd);
            for kernels in [Kernels::Portable, picked] {
                let grouped = run(&c, kernels, run_len(heads / kv_heads));
                for (i, (&got, &want)) in grouped.iter().zip(&want).enumerate() {
                    // The weights are rounded to bf16 (8 significant bits) before the values.
                    assert!(
                        (got - want).abs() < 1e-2,
                        "{heads}/{kv_heads}x{hd} output {i}: {got} vs {want}"
                    );
                }
                assert_eq!(grouped, run(&c, kernels, 1), "one token at a time gives the same bits");
            }
            if picked == Kernels::Portable {
                eprintln!("no AVX2 or AVX-512 BF16 here: only the portable kernels were checked");
            }
        }
    }

    /// The vector conversion of query rows rounds as `bf16::from_f32` does, on every finite
    /// float whose bits are a multiple of 101, in rows of a length that leaves a tail.
    #[test]
    fn query_rows_round_to_bf16_as_the_scalar_conversion_does() {
        let kernels = Kernels::pick(64);
        let finite: Vec<f32> = (0..=u32::MAX / 101)
            .map(|i| f32::from_bits(i * 101))
            .filter(|x| x.is_finite())
            .collect();
        let mut out = Vec::new();
        for row in finite.chunks(67) {
            out.clear();
            kernels.extend_bf16(&mut out, row);
            for (&x, &got) in row.iter().zip(&out) {
                assert_eq!(got.to_bits(), bf16::from_f32(x).to_bits(), "{kernels:?}: {x:e}");
            }
        }
    }

    #[test]
    fn runs_split_sequences_at_the_length_limit_and_at_position_gaps() {
        // Sequence 0: positions 5..12 (7 tokens); sequence 1: one decode token at 40;
        // sequence 2: positions 0, 1, then 3 (not consecutive).
        let query_start = [0, 7, 8, 11];
        let positions = [5, 6, 7, 8, 9, 10, 11, 40, 0, 1, 3];
        let got = runs(&query_start, &positions, 4);
        let want = [(0, 4, 0, 5), (4, 3, 0, 9), (7, 1, 1, 40), (8, 2, 2, 0), (10, 1, 2, 3)];
        let got: Vec<_> = got.iter().map(|r| (r.first_token, r.len, r.seq, r.first_pos)).collect();
        assert_eq!(got, want);
    }
}
