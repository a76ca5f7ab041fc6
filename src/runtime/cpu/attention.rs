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
    pub k_pool: &'a [f32],
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
    // One item per (token, query head): a decode step still has enough items for every thread.
    parallel_for(tokens * shape.num_heads, |items| {
        SCORES.with(|cell| {
            let mut scores = cell.borrow_mut();
            for item in items {
                let (t, h) = (item / shape.num_heads, item % shape.num_heads);
                let g = h / group;
                let ctx = input.positions[t] as usize + 1;
                let slots = &input.seq_slots[input.token_seq[t] as usize][..ctx];
                let q = &input.q[t * input.q_stride + h * hd..][..hd];
                scores.clear();
                scores.extend(
                    slots
                        .iter()
                        .map(|&slot| dot(q, &input.k_pool[slot as usize * slot_width + g * hd..][..hd]) * scale),
                );
                softmax(&mut scores);
                // SAFETY: (token, head) output rows are disjoint across work items.
                let o = unsafe { std::slice::from_raw_parts_mut(dst.at(t * out_width + h * hd), hd) };
                o.fill(0.0);
                for (&p, &slot) in scores.iter().zip(slots) {
                    axpy(p, &input.v_pool[slot as usize * slot_width + g * hd..][..hd], o);
                }
            }
        })
    });
}

/// Eight independent accumulators so the compiler vectorizes the reduction.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    acc.iter().sum::<f32>() + tail
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
