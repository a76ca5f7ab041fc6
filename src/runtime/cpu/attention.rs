//! Causal attention of each query token over its sequence's paged context, reading K and V
//! through the slots its block table names.

use std::cell::RefCell;

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
    /// Keys, transposed within each block (see `KvCache`).
    pub k_pool: &'a [f32],
    /// Values, one slot after another.
    pub v_pool: &'a [f32],
    /// Per sequence, the KV slot of every position of its context.
    pub seq_slots: &'a [Vec<u32>],
    /// Per token, its sequence and its position.
    pub token_seq: &'a [u32],
    pub positions: &'a [u32],
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Writes `[tokens, num_heads * head_dim]` into `out`.
pub fn paged_attention(shape: &AttentionShape, input: &AttentionInput, out: &mut [f32]) {
    let (hd, kvh) = (shape.head_dim, shape.num_kv_heads);
    let group = shape.num_heads / kvh;
    let slot_width = kvh * hd;
    let out_width = shape.num_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let dst = SyncPtr(out.as_mut_ptr());
    let tokens = input.token_seq.len();
    let kernels = Kernels::pick(hd);
    // One item per (token, kv head): the query heads that share a kv head read each key and
    // value once between them.
    parallel_for(tokens * kvh, |items| {
        SCORES.with(|cell| {
            let mut scores = cell.borrow_mut();
            for item in items {
                let (t, g) = (item / kvh, item % kvh);
                let ctx = input.positions[t] as usize + 1;
                let slots = &input.seq_slots[input.token_seq[t] as usize][..ctx];
                scores.clear();
                scores.resize(group * ctx, 0.0);
                let q_of = |j: usize| &input.q[t * input.q_stride + (g * group + j) * hd..][..hd];
                let mut heads: [&[f32]; MAX_GROUP] = [&[]; MAX_GROUP];
                for (j, h) in heads.iter_mut().enumerate().take(group) {
                    *h = q_of(j);
                }
                let (heads, mut lanes) = (&heads[..group], [[0f32; BLOCK]; MAX_GROUP]);
                let lanes = &mut lanes[..group];
                for (b, first) in slots.iter().step_by(BLOCK).enumerate() {
                    let block = *first as usize / BLOCK;
                    let kt = &input.k_pool[(block * slot_width + g * hd) * BLOCK..][..hd * BLOCK];
                    let valid = (ctx - b * BLOCK).min(BLOCK);
                    kernels.qk(heads, kt, lanes);
                    for (j, l) in lanes.iter().enumerate() {
                        for (s, l) in scores[j * ctx + b * BLOCK..][..valid].iter_mut().zip(l) {
                            *s = l * scale;
                        }
                    }
                }
                for p in scores.chunks_exact_mut(ctx) {
                    kernels.softmax(p);
                }
                // SAFETY: (token, head) output rows are disjoint across work items, and the
                // group's heads are consecutive.
                let o = unsafe { std::slice::from_raw_parts_mut(dst.at(t * out_width + g * group * hd), group * hd) };
                kernels.pv(&scores, ctx, slots, input.v_pool, slot_width, g * hd, o);
            }
        })
    });
}

/// The two inner loops of attention: scores of a block's keys, and the weighted sum of values.
/// Each computes every output with the same operations in the same order, whatever else is in
/// the batch.
#[derive(Clone, Copy)]
struct Kernels {
    avx512: bool,
}

impl Kernels {
    fn pick(head_dim: usize) -> Self {
        #[cfg(target_arch = "x86_64")]
        let avx512 = is_x86_feature_detected!("avx512f") && matches!(head_dim, 64 | 128);
        #[cfg(not(target_arch = "x86_64"))]
        let avx512 = false;
        Kernels { avx512 }
    }

    /// `out[j]` = each query `qs[j]` dotted with the block's 16 keys (`kt`: `head_dim` rows of
    /// `BLOCK` lanes).
    fn qk(self, qs: &[&[f32]], kt: &[f32], out: &mut [[f32; BLOCK]]) {
        #[cfg(target_arch = "x86_64")]
        if self.avx512 {
            // Up to four heads share each loaded key row.
            for (q, o) in qs.chunks(4).zip(out.chunks_mut(4)) {
                // SAFETY: `pick` checked the CPU.
                unsafe {
                    match q.len() {
                        1 => avx512::qk::<1>(q, kt, o),
                        2 => avx512::qk::<2>(q, kt, o),
                        3 => avx512::qk::<3>(q, kt, o),
                        _ => avx512::qk::<4>(q, kt, o),
                    }
                }
            }
            return;
        }
        for (q, o) in qs.iter().zip(out) {
            *o = block_scores(q, kt);
        }
    }

    /// For each head `j` of the group, `out[j * head_dim..]` = sum over the context of
    /// `p[j * ctx + s]` times the value row of `slots[s]` (its `head_dim` floats from `offset`
    /// in a slot of `stride` floats).
    #[allow(clippy::too_many_arguments)]
    fn pv(self, p: &[f32], ctx: usize, slots: &[u32], v_pool: &[f32], stride: usize, offset: usize, out: &mut [f32]) {
        let hd = out.len() / (p.len() / ctx);
        #[cfg(target_arch = "x86_64")]
        if self.avx512 {
            // Heads share each loaded value row, as many as the registers hold.
            let per_call = if hd == 64 { 3 } else { 1 };
            for (ps, o) in p.chunks(per_call * ctx).zip(out.chunks_mut(per_call * hd)) {
                // SAFETY: `pick` checked the CPU and the head size; slots index the pool.
                unsafe {
                    match (hd, ps.len() / ctx) {
                        (64, 3) => avx512::pv::<4, 3>(ps, ctx, slots, v_pool, stride, offset, o),
                        (64, 2) => avx512::pv::<4, 2>(ps, ctx, slots, v_pool, stride, offset, o),
                        (64, _) => avx512::pv::<4, 1>(ps, ctx, slots, v_pool, stride, offset, o),
                        _ => avx512::pv::<8, 1>(ps, ctx, slots, v_pool, stride, offset, o),
                    }
                }
            }
            return;
        }
        for (p, o) in p.chunks_exact(ctx).zip(out.chunks_exact_mut(hd)) {
            o.fill(0.0);
            for (&w, &slot) in p.iter().zip(slots) {
                axpy(w, &v_pool[slot as usize * stride + offset..][..hd], o);
            }
        }
    }

    fn softmax(self, s: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if self.avx512 {
            // SAFETY: `pick` checked the CPU.
            unsafe { avx512::softmax(s) };
            return;
        }
        softmax(s);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::BLOCK;
    use std::arch::x86_64::*;

    /// Two accumulators per head (even and odd channels) keep enough FMAs in flight.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn qk<const G: usize>(qs: &[&[f32]], kt: &[f32], out: &mut [[f32; BLOCK]]) {
        let hd = qs[0].len();
        debug_assert!(kt.len() >= hd * BLOCK && hd.is_multiple_of(2));
        let (mut even, mut odd) = ([_mm512_setzero_ps(); G], [_mm512_setzero_ps(); G]);
        for d in (0..hd).step_by(2) {
            let k0 = _mm512_loadu_ps(kt.as_ptr().add(d * BLOCK));
            let k1 = _mm512_loadu_ps(kt.as_ptr().add((d + 1) * BLOCK));
            for j in 0..G {
                let q = qs.get_unchecked(j).as_ptr();
                even[j] = _mm512_fmadd_ps(_mm512_set1_ps(*q.add(d)), k0, even[j]);
                odd[j] = _mm512_fmadd_ps(_mm512_set1_ps(*q.add(d + 1)), k1, odd[j]);
            }
        }
        for j in 0..G {
            _mm512_storeu_ps(out[j].as_mut_ptr(), _mm512_add_ps(even[j], odd[j]));
        }
    }

    /// `C` vectors of 16 per head, `G` heads: each value row is loaded once for all of them.
    #[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pv<const C: usize, const G: usize>(
        p: &[f32],
        ctx: usize,
        slots: &[u32],
        v_pool: &[f32],
        stride: usize,
        offset: usize,
        out: &mut [f32],
    ) {
        debug_assert_eq!(out.len(), G * C * 16);
        let mut acc = [[_mm512_setzero_ps(); C]; G];
        for s in 0..ctx {
            let v = v_pool.as_ptr().add(*slots.get_unchecked(s) as usize * stride + offset);
            let mut row = [_mm512_setzero_ps(); C];
            for c in 0..C {
                row[c] = _mm512_loadu_ps(v.add(16 * c));
            }
            for j in 0..G {
                let w = _mm512_set1_ps(*p.get_unchecked(j * ctx + s));
                for c in 0..C {
                    acc[j][c] = _mm512_fmadd_ps(w, row[c], acc[j][c]);
                }
            }
        }
        for j in 0..G {
            for c in 0..C {
                _mm512_storeu_ps(out.as_mut_ptr().add((j * C + c) * 16), acc[j][c]);
            }
        }
    }

    /// `exp(x)` for `x <= 0`: `2^n * e^r` with `|r| <= ln 2 / 2` and a degree-6 polynomial
    /// (relative error about 1e-7); below -87 the result is 0, as in f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn exp(x: __m512) -> __m512 {
        let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
        let mut y = _mm512_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(y, n)
    }

    /// In place, 16 scores at a time; the tail is masked.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn softmax(s: &mut [f32]) {
        let n = s.len();
        let tail = |i: usize| -> __mmask16 {
            if n - i >= 16 {
                0xffff
            } else {
                (1u16 << (n - i)) - 1
            }
        };
        let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in (0..n).step_by(16) {
            let x = _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), tail(i), s.as_ptr().add(i));
            max = _mm512_max_ps(max, x);
        }
        let max = _mm512_set1_ps(_mm512_reduce_max_ps(max));
        let mut sum = _mm512_setzero_ps();
        for i in (0..n).step_by(16) {
            let k = tail(i);
            let e = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s.as_ptr().add(i)), max));
            let e = _mm512_maskz_mov_ps(k, e);
            sum = _mm512_add_ps(sum, e);
            _mm512_mask_storeu_ps(s.as_mut_ptr().add(i), k, e);
        }
        let inv = _mm512_set1_ps(1.0 / _mm512_reduce_add_ps(sum));
        for i in (0..n).step_by(16) {
            let k = tail(i);
            let x = _mm512_maskz_loadu_ps(k, s.as_ptr().add(i));
            _mm512_mask_storeu_ps(s.as_mut_ptr().add(i), k, _mm512_mul_ps(x, inv));
        }
    }
}

/// Most query heads per kv head (Qwen2.5-7B has 7, Llama-3-8B 4).
pub const MAX_GROUP: usize = 16;

/// Tokens per KV block: the keys of one block and one kv head are `head_dim` rows of `BLOCK`
/// lanes, so one query meets the whole block in `head_dim` vector FMAs, with no horizontal sums.
pub const BLOCK: usize = 16;

/// `q` dotted with each of the block's keys (`kt`: `q.len()` rows of `BLOCK`).
#[inline]
fn block_scores(q: &[f32], kt: &[f32]) -> [f32; BLOCK] {
    let mut acc = [0f32; BLOCK];
    for (&qd, row) in q.iter().zip(kt.chunks_exact(BLOCK)) {
        for (a, &k) in acc.iter_mut().zip(row) {
            *a = qd.mul_add(k, *a);
        }
    }
    acc
}

#[inline]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y = a.mul_add(*x, *y);
    }
}

fn softmax(s: &mut [f32]) {
    let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0f32;
    for v in s.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    s.iter_mut().for_each(|v| *v *= inv);
}
