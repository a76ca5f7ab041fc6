//! The AVX2 kernels, for x86 CPUs without AVX-512 BF16 (Zen 2 and 3, most Intel clients): a
//! bf16 is the top half of an f32, so a 32-bit word holding a bf16 pair widens to two f32
//! vectors with a shift and a mask, and the products are f32 FMAs. The portable loops they
//! replace spent 72% of a batched extraction's time in attention on such a CPU.

use super::{Values, BLOCK};
use crate::runtime::cpu::pool::SyncPtr;
use half::bf16;
use std::arch::x86_64::*;

/// The first and the second bf16 of each 32-bit lane, as f32.
#[inline(always)]
unsafe fn widen(words: __m256i) -> (__m256, __m256) {
    let first = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(words));
    let second = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(0xffff_0000_u32 as i32)));
    (first, second)
}

/// The bf16 pair at `p`, widened, in every lane.
#[inline(always)]
unsafe fn pair_everywhere(p: *const bf16) -> (__m256, __m256) {
    widen(_mm256_set1_epi32((p as *const i32).read_unaligned()))
}

/// Scores of `N` query rows against a block's 16 keys. Per query, lanes 0-7 and 8-15 each
/// keep the even and the odd channel of a pair apart (four chains of FMAs in flight), so
/// each score's summation order is the same whatever `N` is.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn qk<const N: usize>(q: *const bf16, kt: *const bf16, hd: usize, scale: f32, out: *mut f32, stride: usize) {
    let mut acc = [[_mm256_setzero_ps(); 4]; N];
    for d in (0..hd).step_by(2) {
        // Channels d and d + 1 of the 16 keys: lanes 0-7, then 8-15.
        let k = kt.add(d * BLOCK);
        let (even_lo, odd_lo) = widen(_mm256_loadu_si256(k as *const __m256i));
        let (even_hi, odd_hi) = widen(_mm256_loadu_si256(k.add(16) as *const __m256i));
        for i in 0..N {
            let (qe, qo) = pair_everywhere(q.add(i * hd + d));
            acc[i][0] = _mm256_fmadd_ps(qe, even_lo, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(qo, odd_lo, acc[i][1]);
            acc[i][2] = _mm256_fmadd_ps(qe, even_hi, acc[i][2]);
            acc[i][3] = _mm256_fmadd_ps(qo, odd_hi, acc[i][3]);
        }
    }
    let scale = _mm256_set1_ps(scale);
    for i in 0..N {
        let lo = _mm256_mul_ps(_mm256_add_ps(acc[i][0], acc[i][1]), scale);
        let hi = _mm256_mul_ps(_mm256_add_ps(acc[i][2], acc[i][3]), scale);
        _mm256_storeu_ps(out.add(i * stride), lo);
        _mm256_storeu_ps(out.add(i * stride + 8), hi);
    }
}

/// Vectors of 8 channels one pass over the values keeps per output row.
const C: usize = 4;

/// Output rows `outs` (`hd` floats each, `hd` a multiple of 32) for `N` rows of weights:
/// `C * 8` channels per pass over the context, each pair of value rows loaded once for all
/// `N` rows.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn pv<const N: usize>(p: &[bf16], stride: usize, values: &Values, outs: &[SyncPtr<f32>], hd: usize) {
    let p = p.as_ptr();
    for c0 in (0..hd).step_by(8 * C) {
        let mut acc = [[_mm256_setzero_ps(); C]; N];
        for (b, block, slots) in values.blocks() {
            let base = block.as_ptr();
            for pair in 0..slots.div_ceil(2) {
                let s = b * BLOCK + 2 * pair;
                // A lone last slot's partner was never written for this sequence: it is not
                // used (a stale NaN times a zero weight would still be NaN).
                let lone = 2 * pair + 1 == slots;
                let row = base.add(pair * hd * 2 + 2 * c0);
                let w: [(__m256, __m256); N] = std::array::from_fn(|i| pair_everywhere(p.add(i * stride + s)));
                for c in 0..C {
                    let (first, second) = widen(_mm256_loadu_si256(row.add(16 * c) as *const __m256i));
                    for i in 0..N {
                        acc[i][c] = _mm256_fmadd_ps(w[i].0, first, acc[i][c]);
                        if !lone {
                            acc[i][c] = _mm256_fmadd_ps(w[i].1, second, acc[i][c]);
                        }
                    }
                }
            }
        }
        for i in 0..N {
            for c in 0..C {
                _mm256_storeu_ps(outs.get_unchecked(i).0.add(c0 + 8 * c), acc[i][c]);
            }
        }
    }
}

/// `exp(x)` for `x <= 0`, as the AVX-512 kernels compute it: `2^n * e^r` with
/// `|r| <= ln 2 / 2` and a degree-6 polynomial; below -87 the argument is clamped, so a masked
/// score's weight is tiny, and the caller zeroes it.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
    let mut y = _mm256_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    // 2^n as f32 bits: n >= -126 after the clamp, so the exponent field stays normal.
    let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
    _mm256_mul_ps(y, _mm256_castsi256_ps(two_n))
}

/// Lanes below `live` all ones, the rest zero.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn first_lanes(live: usize) -> __m256 {
    let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(live.min(8) as i32), iota))
}

/// Floats `i..i + 8` of `s`, those past its end `pad`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load(s: &[f32], i: usize, pad: f32) -> __m256 {
    if s.len() - i >= 8 {
        _mm256_loadu_ps(s.as_ptr().add(i))
    } else {
        let mut tail = [pad; 8];
        tail[..s.len() - i].copy_from_slice(&s[i..]);
        _mm256_loadu_ps(tail.as_ptr())
    }
}

/// Lanes of `x` into `s[i..]`, as many as fit.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store(s: &mut [f32], i: usize, x: __m256) {
    if s.len() - i >= 8 {
        _mm256_storeu_ps(s.as_mut_ptr().add(i), x)
    } else {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), x);
        let n = s.len() - i;
        s[i..].copy_from_slice(&lanes[..n]);
    }
}

/// Scores `s` to weights `p`, 8 at a time; the tail goes through a padded copy. `s` is left
/// holding the unnormalized exponentials.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn softmax(s: &mut [f32], p: &mut [bf16]) {
    let n = s.len();
    debug_assert_eq!(p.len(), n);
    let mut max = _mm256_set1_ps(f32::NEG_INFINITY);
    for i in (0..n).step_by(8) {
        max = _mm256_max_ps(max, load(s, i, f32::NEG_INFINITY));
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), max);
    let max = _mm256_set1_ps(lanes.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)));
    let mut sum = _mm256_setzero_ps();
    for i in (0..n).step_by(8) {
        let e = _mm256_and_ps(exp(_mm256_sub_ps(load(s, i, 0.0), max)), first_lanes(n - i));
        sum = _mm256_add_ps(sum, e);
        store(s, i, e);
    }
    _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
    let inv = _mm256_set1_ps(1.0 / lanes.iter().sum::<f32>());
    for i in (0..n).step_by(8) {
        let halves = round_to_bf16(_mm256_mul_ps(load(s, i, 0.0), inv));
        let n = (n - i).min(8);
        std::ptr::copy_nonoverlapping(halves.as_ptr(), p.as_mut_ptr().add(i) as *mut u16, n);
    }
}

/// Eight finite floats to bf16, rounding to nearest even as `bf16::from_f32` does (which
/// differs only on NaN).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn round_to_bf16(x: __m256) -> [u16; 8] {
    let x = _mm256_castps_si256(x);
    let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
    let biased = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), odd);
    // The top halves, in order: `packus` would saturate negative words, so shuffle instead.
    let tops = _mm256_shuffle_epi8(
        biased,
        _mm256_setr_epi8(
            2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, //
            2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
        ),
    );
    let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(tops);
    let mut halves = [0u16; 8];
    _mm_storeu_si128(halves.as_mut_ptr() as *mut __m128i, _mm256_castsi256_si128(packed));
    halves
}

/// Appends `x` as bf16 (finite values: the query rows).
#[target_feature(enable = "avx2")]
pub unsafe fn extend_bf16(out: &mut Vec<bf16>, x: &[f32]) {
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        let halves = round_to_bf16(_mm256_loadu_ps(c.as_ptr()));
        out.extend(halves.iter().map(|&h| bf16::from_bits(h)));
    }
    out.extend(rest.iter().map(|&v| bf16::from_f32(v)));
}
