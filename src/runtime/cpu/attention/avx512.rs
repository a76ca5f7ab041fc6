//! The AVX-512 BF16 kernels: `vdpbf16ps` multiplies bf16 pairs and accumulates in f32.

use super::{Values, BLOCK};
use crate::runtime::cpu::pool::SyncPtr;
use half::bf16;
use std::arch::x86_64::*;

#[inline(always)]
unsafe fn pairs(p: *const bf16) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const _))
}

/// The bf16 pair at `p`, in every lane.
#[inline(always)]
unsafe fn pair_everywhere(p: *const bf16) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32((p as *const i32).read_unaligned()))
}

/// Two accumulators per query (even and odd channel pairs) keep enough multiply-adds in
/// flight when there are few queries, and make each score's summation order independent
/// of N.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bf16")]
pub unsafe fn qk<const N: usize>(q: *const bf16, kt: *const bf16, hd: usize, scale: f32, out: *mut f32, stride: usize) {
    let (mut even, mut odd) = ([_mm512_setzero_ps(); N], [_mm512_setzero_ps(); N]);
    for d in (0..hd).step_by(4) {
        // Channels d, d + 1 of the 16 keys, then d + 2, d + 3.
        let k0 = pairs(kt.add(d * BLOCK));
        let k1 = pairs(kt.add((d + 2) * BLOCK));
        for i in 0..N {
            even[i] = _mm512_dpbf16_ps(even[i], pair_everywhere(q.add(i * hd + d)), k0);
            odd[i] = _mm512_dpbf16_ps(odd[i], pair_everywhere(q.add(i * hd + d + 2)), k1);
        }
    }
    let scale = _mm512_set1_ps(scale);
    for i in 0..N {
        _mm512_storeu_ps(
            out.add(i * stride),
            _mm512_mul_ps(_mm512_add_ps(even[i], odd[i]), scale),
        );
    }
}

/// `C` vectors of 16 channels per output row, `N` rows: each pair of value rows is
/// loaded once for all of them.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub unsafe fn pv<const C: usize, const N: usize>(p: &[bf16], stride: usize, values: &Values, outs: &[SyncPtr<f32>]) {
    let hd = C * 16;
    let mut acc = [[_mm512_setzero_ps(); C]; N];
    let p = p.as_ptr();
    for (b, block, slots) in values.blocks() {
        let base = block.as_ptr();
        let step = |acc: &mut [[__m512; C]; N], pair: usize, v: [__m512bh; C]| {
            let s = b * BLOCK + 2 * pair;
            for i in 0..N {
                let w = pair_everywhere(p.add(i * stride + s));
                for c in 0..C {
                    acc[i][c] = _mm512_dpbf16_ps(acc[i][c], w, v[c]);
                }
            }
        };
        let whole = slots / 2;
        for pair in 0..whole {
            let row = base.add(pair * hd * 2);
            step(&mut acc, pair, std::array::from_fn(|c| pairs(row.add(32 * c))));
        }
        if slots % 2 == 1 {
            // A lone last slot: its partner was never written for this sequence, so it is
            // not read (a stale NaN times a zero weight would still be NaN).
            let row = base.add(whole * hd * 2);
            let v = std::array::from_fn(|c| {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(
                    0x5555_5555,
                    row.add(32 * c) as *const i16,
                ))
            });
            step(&mut acc, whole, v);
        }
    }
    for i in 0..N {
        for c in 0..C {
            _mm512_storeu_ps(outs.get_unchecked(i).0.add(16 * c), acc[i][c]);
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

/// Scores `s` to weights `p`, 16 at a time; the tail is masked. `s` is left holding the
/// unnormalized exponentials.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn softmax(s: &mut [f32], p: &mut [bf16]) {
    let n = s.len();
    debug_assert_eq!(p.len(), n);
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
        let x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s.as_ptr().add(i)), inv);
        let h = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(x));
        _mm256_mask_storeu_epi16(p.as_mut_ptr().add(i) as *mut i16, k, h);
    }
}
