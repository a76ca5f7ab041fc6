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
