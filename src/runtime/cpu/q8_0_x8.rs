//! Q8_0 weights (the output head of small models) regrouped 8 rows at a time for AVX2, the
//! layout of `q4_1_x8` with whole bytes: one 32-byte vector holds four consecutive weights of
//! each of the 8 rows, and four activation bytes are broadcast against it. Candle's Q8_0 dot
//! product streams the whole head (30 MB for a 49k vocabulary) once per activation row, so
//! every row a decode step samples (a batched request, a draft token to check) cost about as
//! much as the step's whole body; here a tile of rows shares each weight load.
//!
//! `vpmaddubsw` multiplies unsigned by signed bytes, so each product is taken as
//! `|w| * (x with w's sign)` (as ggml's AVX2 code does): a pair of them is at most
//! 2 * 128 * 127 = 32,512 and fits its 16-bit lane; pairs are widened to 32 bits at once.
//! Each output is computed by the same operations in the same order whatever the number of
//! activation rows in the call.

use half::f16;

use super::q4_1::{BlockQ8_1, QK};
use super::q4_1_x16::{run_groups, OutRows, TileKernel};
pub use super::q4_1_x8::available;

/// Raw GGUF Q8_0 block: f16 scale, 32 signed quants.
const RAW_BLOCK: usize = 2 + QK;

/// One block (32 weights) of 8 consecutive rows. `qs[p]` bytes `4 * r..4 * r + 4` are row
/// `r`'s weights `4 * p..4 * p + 4`.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(16))]
pub struct BlockQ8_0x8 {
    pub qs: [[i8; 32]; 8],
    pub d: [f16; 8],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0x8>() == 272);

/// Regroups raw GGUF Q8_0 data (`rows * kb` blocks of 34 bytes) into 8-row groups: group
/// `g`, block `b` at `g * kb + b`. `None` when the size is wrong.
pub fn interleave8(bytes: &[u8], rows: usize, kb: usize) -> Option<Vec<BlockQ8_0x8>> {
    if !rows.is_multiple_of(8) || bytes.len() != rows * kb * RAW_BLOCK {
        return None;
    }
    let mut out = Vec::with_capacity(rows / 8 * kb);
    for g in 0..rows / 8 {
        for b in 0..kb {
            let mut x = BlockQ8_0x8 {
                qs: [[0; 32]; 8],
                d: [f16::ZERO; 8],
            };
            for r in 0..8 {
                let src = &bytes[((8 * g + r) * kb + b) * RAW_BLOCK..][..RAW_BLOCK];
                x.d[r] = f16::from_le_bytes([src[0], src[1]]);
                for (p, qs) in x.qs.iter_mut().enumerate() {
                    for j in 0..4 {
                        qs[4 * r + j] = src[2 + 4 * p + j] as i8;
                    }
                }
            }
            out.push(x);
        }
    }
    Some(out)
}

/// Row `i` of `out`, lane `r` = activation row `i` times weight row `r` of the groups in `w`
/// (`kb` blocks each, 8 outputs per group), for up to `q4_1_x16::TILE` activation rows laid
/// end to end in `xs` and `sc` (`kb` blocks each; only the quants and `d` are read: Q8_0 has
/// no offset).
///
/// # Safety
/// `out` must hold `xs.len() / kb` rows of `w.len() / kb * 8` writable floats that nothing
/// else touches meanwhile.
pub unsafe fn group_dot(w: &[BlockQ8_0x8], kb: usize, xs: &[BlockQ8_1], sc: &[[f32; 2]], out: OutRows) {
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
    unreachable!("BlockQ8_0x8 weights exist only where the kernel runs");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BlockQ8_0x8, BlockQ8_1, OutRows};
    use std::arch::x86_64::*;

    // Indexing by row keeps the accumulators of one row visibly in step.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_dot<const R: usize>(w: &[BlockQ8_0x8], xs: &[BlockQ8_1], sc: &[[f32; 2]], out: OutRows) {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, wb) in w.iter().enumerate() {
            let mut isum = [_mm256_setzero_si256(); R];
            for p in 0..8 {
                let wq = _mm256_loadu_si256(wb.qs[p].as_ptr() as *const __m256i);
                let magnitude = _mm256_abs_epi8(wq);
                for i in 0..R {
                    let x = xs.get_unchecked(i * w.len() + b).qs.as_ptr();
                    let xv = _mm256_set1_epi32((x.add(4 * p) as *const i32).read_unaligned());
                    let pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv, wq));
                    isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(pairs, ones));
                }
            }
            let d = _mm256_cvtph_ps(_mm_load_si128(wb.d.as_ptr() as *const __m128i));
            for i in 0..R {
                let [xd, _] = *sc.get_unchecked(i * w.len() + b);
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(xd));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), scale, acc[i]);
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
    use crate::runtime::cpu::q4_1_x16::{alone_and_in_tiles, test_activations, test_rng};

    #[test]
    fn tiles_match_a_plain_dot_product_for_any_row_count() {
        if !available() {
            eprintln!("skipping: no AVX2 with FMA and F16C here");
            return;
        }
        let (rows, k) = (24, 256);
        let kb = k / QK;
        let mut next = test_rng(17);
        let mut raw = Vec::new();
        for i in 0..rows * kb {
            raw.extend(f16::from_f32((next() % 1000) as f32 / 1e4 + 1e-3).to_le_bytes());
            // The extremes: blocks of -128 (|w| = 128 against x = 127, the activations'
            // all-top rows, is the largest pair) and blocks holding both ends.
            raw.extend((0..QK).map(|j| match (i % 4, j % 3) {
                (0, _) => 0x80,
                (1, 0) => 0x80,
                (1, 1) => 0x7f,
                _ => next() as u8,
            }));
        }
        let w = interleave8(&raw, rows, kb).unwrap();
        let acts = test_activations(&mut next, k);
        // Groups 1 and 2.
        let alone = alone_and_in_tiles(&acts, |xs, sc, out| unsafe {
            group_dot(&w[kb..3 * kb], kb, xs, sc, out)
        });
        for (i, a) in acts.iter().enumerate() {
            for r in 0..16 {
                let mut want = 0f64;
                for (b, xb) in a.iter().enumerate() {
                    let src = &raw[((8 + r) * kb + b) * RAW_BLOCK..][..RAW_BLOCK];
                    let dw = f16::from_le_bytes([src[0], src[1]]).to_f32() as f64;
                    let isum: i32 = src[2..]
                        .iter()
                        .zip(&xb.qs)
                        .map(|(&w, &x)| w as i8 as i32 * x as i32)
                        .sum();
                    want += isum as f64 * dw * xb.d.to_f32() as f64;
                }
                let got = alone[i][r] as f64;
                assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "{got} vs {want}");
            }
        }
    }
}
