//! Q4_1 weights regrouped 8 rows at a time for AVX2, the layout of `q4_1_x16` at half the
//! width: one 32-byte vector holds four consecutive weights of each of the 8 rows, so one
//! `vpmaddubsw` with four activation bytes broadcast does 8 x 4 multiply-adds, and no
//! horizontal adds are needed. The products of a block are summed in 16-bit lanes (eight
//! products of a 4-bit weight and a 7-bit activation, at most 8 * 2 * 15 * 127 = 30,480,
//! cannot overflow) and widened once per block. The row-quad kernel (`q4_1`), which spent a
//! third of its instructions on horizontal adds, stays for widths not a multiple of 8.
//!
//! Each output is computed by the same operations in the same order whatever the number of
//! activation rows in the call, so a request's logits do not depend on what it is batched with.

use half::f16;

use super::q4_1::{BlockQ4_1, BlockQ8_1};
use super::q4_1_x16::{run_groups, OutRows, TileKernel};

/// One block (32 weights) of 8 consecutive rows. `qs[p]` byte `4 * r + j` holds row `r`'s
/// weight `4 * p + j` in its low nibble and weight `4 * p + j + 16` in its high nibble.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub struct BlockQ4_1x8 {
    pub qs: [[u8; 32]; 4],
    pub d: [f16; 8],
    pub m: [f16; 8],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1x8>() == 160);

/// Whether this CPU runs the kernel.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Regroups row-major blocks (`rows * kb`) into 8-row groups: group `g`, block `b` at
/// `g * kb + b`.
pub fn interleave8(blocks: &[BlockQ4_1], rows: usize, kb: usize) -> Vec<BlockQ4_1x8> {
    debug_assert_eq!(rows % 8, 0);
    let mut out = Vec::with_capacity(rows / 8 * kb);
    for g in 0..rows / 8 {
        for b in 0..kb {
            let mut x = BlockQ4_1x8 {
                qs: [[0; 32]; 4],
                d: [f16::ZERO; 8],
                m: [f16::ZERO; 8],
            };
            for r in 0..8 {
                let src = &blocks[(8 * g + r) * kb + b];
                x.d[r] = src.d;
                x.m[r] = src.m;
                // Source byte j: weight j (low nibble), weight j + 16 (high nibble).
                for (p, qs) in x.qs.iter_mut().enumerate() {
                    qs[4 * r..4 * r + 4].copy_from_slice(&src.qs[4 * p..4 * p + 4]);
                }
            }
            out.push(x);
        }
    }
    out
}

/// Row `i` of `out`, lane `r` = activation row `i` times weight row `r` of the groups in `w`
/// (`kb` blocks each, 8 outputs per group), for up to `q4_1_x16::TILE` activation rows laid
/// end to end in `xs` and `sc` (`kb` blocks each).
///
/// # Safety
/// `out` must hold `xs.len() / kb` rows of `w.len() / kb * 8` writable floats that nothing
/// else touches meanwhile.
pub unsafe fn group_dot(w: &[BlockQ4_1x8], kb: usize, xs: &[BlockQ8_1], sc: &[[f32; 2]], out: OutRows) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `Linear` builds this layout only after `available()` said yes; the caller
    // vouches for `out`.
    unsafe {
        let kernels: [(usize, TileKernel<_, _>); 3] = [
            (4, x86::group_dot::<4>),
            (2, x86::group_dot::<2>),
            (1, x86::group_dot::<1>),
        ];
        run_groups(&kernels, kb, 8, w, xs, sc, out)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("BlockQ4_1x8 weights exist only where the kernel runs");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BlockQ4_1x8, BlockQ8_1, OutRows};
    use std::arch::x86_64::*;

    // Indexing by row keeps the accumulators of one row visibly in step.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_dot<const R: usize>(w: &[BlockQ4_1x8], xs: &[BlockQ8_1], sc: &[[f32; 2]], out: OutRows) {
        let mask = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, wb) in w.iter().enumerate() {
            let mut isum = [_mm256_setzero_si256(); R];
            for p in 0..4 {
                let packed = _mm256_load_si256(wb.qs[p].as_ptr() as *const __m256i);
                let lo = _mm256_and_si256(packed, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), mask);
                for i in 0..R {
                    let x = xs.get_unchecked(i * w.len() + b).qs.as_ptr();
                    let x_lo = _mm256_set1_epi32((x.add(4 * p) as *const i32).read_unaligned());
                    let x_hi = _mm256_set1_epi32((x.add(4 * p + 16) as *const i32).read_unaligned());
                    isum[i] = _mm256_add_epi16(isum[i], _mm256_maddubs_epi16(lo, x_lo));
                    isum[i] = _mm256_add_epi16(isum[i], _mm256_maddubs_epi16(hi, x_hi));
                }
            }
            let d = _mm256_cvtph_ps(_mm_load_si128(wb.d.as_ptr() as *const __m128i));
            let m = _mm256_cvtph_ps(_mm_load_si128(wb.m.as_ptr() as *const __m128i));
            for i in 0..R {
                let [xd, xsum] = *sc.get_unchecked(i * w.len() + b);
                let sums = _mm256_madd_epi16(isum[i], ones);
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(xd));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[i]);
                acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum), acc[i]);
            }
        }
        for i in 0..R {
            _mm256_storeu_ps(out.row(i), acc[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::cpu::q4_1::{vec_dot_scalar, QK};
    use crate::runtime::cpu::q4_1_x16::{alone_and_in_tiles, test_activations, test_rng};

    #[test]
    fn tiles_match_the_scalar_dot_product_for_any_row_count() {
        if !available() {
            eprintln!("skipping: no AVX2 with FMA and F16C here");
            return;
        }
        let (rows, k) = (24, 256);
        let kb = k / QK;
        let mut next = test_rng(13);
        // Weights and activations at the extremes too: nibbles of 15 against bytes of +-127
        // are where 16-bit sums would overflow if they could.
        let blocks: Vec<BlockQ4_1> = (0..rows * kb)
            .map(|i| BlockQ4_1 {
                d: f16::from_f32((next() % 1000) as f32 / 1e4),
                m: f16::from_f32((next() % 1000) as f32 / 1e4 - 0.05),
                qs: std::array::from_fn(|_| if i % 5 == 0 { 0xff } else { next() as u8 }),
            })
            .collect();
        let w = interleave8(&blocks, rows, kb);
        let acts = test_activations(&mut next, k);
        // Groups 1 and 2.
        let alone = alone_and_in_tiles(&acts, |xs, sc, out| unsafe {
            group_dot(&w[kb..3 * kb], kb, xs, sc, out)
        });
        for (i, a) in acts.iter().enumerate() {
            for r in 0..16 {
                let row = &blocks[(8 + r) * kb..(9 + r) * kb];
                let want = vec_dot_scalar(row, a);
                let got = alone[i][r];
                assert!((got - want).abs() <= 1e-3 * want.abs().max(1.0), "{got} vs {want}");
            }
        }
    }
}
