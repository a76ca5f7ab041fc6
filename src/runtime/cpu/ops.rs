//! The element-wise steps of a transformer layer, on plain slices: candle's versions would
//! allocate a tensor per call, a real cost at ~200 calls per decoded token of a small model.
//! The row-wise ones run on every core: in prefill they are a tenth of the work, and on one
//! thread the other cores would idle through them.

use super::pool::{parallel_for, SyncPtr};
use crate::runtime::config::RopeStyle;

/// Runs `f(input row, output row)` over every row, rows shared out among the threads.
fn rows_parallel(x: &[f32], x_width: usize, out: &mut [f32], out_width: usize, f: impl Fn(&[f32], &mut [f32]) + Sync) {
    let rows = x.len() / x_width;
    debug_assert_eq!(out.len(), rows * out_width);
    let dst = SyncPtr(out.as_mut_ptr());
    parallel_for(rows, |range| {
        for r in range {
            // SAFETY: each row of `out` is handed to exactly one call.
            let o = unsafe { std::slice::from_raw_parts_mut(dst.at(r * out_width), out_width) };
            f(&x[r * x_width..][..x_width], o);
        }
    });
}

pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    rows_parallel(x, d, out, d, |xr, or| norm_row(xr, weight, eps, or));
}

fn norm_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    // Squares in f32, summed in f64, as ggml does; in eight partial sums, since one running
    // sum is a chain of dependent additions (norms were ~4% of prefill). In f64 the order
    // moves the sum by ~1e-16, far below what reaches the f32 scale.
    let mut partial = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&v| (v * v) as f64).sum();
    for c in chunks {
        for (p, &v) in partial.iter_mut().zip(c) {
            *p += (v * v) as f64;
        }
    }
    let ss = partial.iter().sum::<f64>() + tail;
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

/// Rotates the query and key heads of every token's `[q | k | v]` row in place, tokens
/// shared out among the threads.
pub fn rope_rows(rope: &Rope, qkv: &mut [f32], width: usize, rotated: usize, positions: &[u32]) {
    let rows = SyncPtr(qkv.as_mut_ptr());
    debug_assert_eq!(qkv.len(), positions.len() * width);
    parallel_for(positions.len(), |tokens| {
        for t in tokens {
            // SAFETY: each row is handed to exactly one call.
            let row = unsafe { std::slice::from_raw_parts_mut(rows.at(t * width), rotated) };
            rope.apply(row, positions[t] as usize);
        }
    });
}

/// `x += y` (the residual connection), then `out = rms_norm(x)`, in one pass over the rows.
pub fn add_rms_norm(x: &mut [f32], y: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    let (xs, os) = (SyncPtr(x.as_mut_ptr()), SyncPtr(out.as_mut_ptr()));
    debug_assert!(x.len() == y.len() && x.len() == out.len());
    parallel_for(y.len() / d, |rows| {
        for r in rows {
            // SAFETY: each row of `x` and `out` is handed to exactly one call.
            let (xr, or) = unsafe {
                (
                    std::slice::from_raw_parts_mut(xs.at(r * d), d),
                    std::slice::from_raw_parts_mut(os.at(r * d), d),
                )
            };
            xr.iter_mut().zip(&y[r * d..][..d]).for_each(|(a, b)| *a += b);
            norm_row(xr, weight, eps, or);
        }
    });
}

/// `gate_up` rows hold `[gate | up]`; writes `silu(gate) * up` (`exp` says how).
pub fn silu_mul(gate_up: &[f32], width: usize, out: &mut [f32]) {
    rows_parallel(gate_up, 2 * width, out, width, |gu, o| {
        let (g, u) = gu.split_at(width);
        super::exp::silu_mul_row(g, u, o);
    });
}

/// Rotary position embedding tables: `cos[pos * half + i]`, `sin[...]`.
pub struct Rope {
    half: usize,
    style: RopeStyle,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// cos and sin of every (position, pair) angle, `[max_positions, head_dim / 2]` each. Angles
/// are built as ggml builds them (an f32 running product of the per-pair ratio), so positions
/// rotate exactly as in the reference implementation; the CUDA backend uploads the same tables.
pub fn rope_tables(head_dim: usize, theta: f32, max_positions: usize) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(max_positions * half);
    let mut sin = Vec::with_capacity(max_positions * half);
    let ratio = theta.powf(-2.0 / head_dim as f32);
    for p in 0..max_positions {
        let mut angle = p as f32;
        for _ in 0..half {
            cos.push(angle.cos());
            sin.push(angle.sin());
            angle *= ratio;
        }
    }
    (cos, sin)
}

impl Rope {
    pub fn new(head_dim: usize, theta: f32, max_positions: usize, style: RopeStyle) -> Self {
        let (cos, sin) = rope_tables(head_dim, theta, max_positions);
        let half = head_dim / 2;
        Rope { half, style, cos, sin }
    }

    /// Rotates every head of one token's row in place.
    pub fn apply(&self, row: &mut [f32], pos: usize) {
        let (c, s) = (
            &self.cos[pos * self.half..][..self.half],
            &self.sin[pos * self.half..][..self.half],
        );
        for head in row.chunks_exact_mut(2 * self.half) {
            for i in 0..self.half {
                let (a, b) = match self.style {
                    RopeStyle::AdjacentPairs => (2 * i, 2 * i + 1),
                    RopeStyle::Halves => (i, i + self.half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c[i] - x1 * s[i];
                head[b] = x0 * s[i] + x1 * c[i];
            }
        }
    }
}
