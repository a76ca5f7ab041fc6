//! Q8_0 weights (the output head of small models) regrouped 16 rows at a time for AVX-512
//! VNNI, like `q4_1_x16`. `vpdpbusd` multiplies unsigned by signed bytes, so the activations
//! go in shifted by 128 (a sign-bit flip) and each block's `128 * sum(w)` is taken back out of
//! the integer sum: exact. With a 49k vocabulary the head is the biggest matrix of a batched
//! decode step, which candle's one-row-at-a-time Q8_0 dot product made the slowest part.

use half::f16;

use super::q4_1::{BlockQ8_1, QK};
pub use super::q4_1_x16::{available, OutRows, TILE};
use super::q4_1_x16::{run_tiles, TileKernel};

/// One block (32 weights) of 16 consecutive rows. `qs[p]` bytes `4 * r..4 * r + 4` are row
/// `r`'s weights `4 * p..4 * p + 4`; `corr[r]` is `128 * sum(row r's 32 weights)`.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub struct BlockQ8_0x16 {
    pub qs: [[i8; 64]; 8],
    pub d: [f16; 16],
    pub corr: [i32; 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0x16>() == 640);

/// Regroups raw GGUF Q8_0 data (`rows * kb` blocks of 34 bytes: f16 scale, 32 i8) into
/// 16-row groups: group `g`, block `b` at `g * kb + b`. `None` when the size is wrong.
pub fn interleave16(bytes: &[u8], rows: usize, kb: usize) -> Option<Vec<BlockQ8_0x16>> {
    if !rows.is_multiple_of(16) || bytes.len() != rows * kb * 34 {
        return None;
    }
    let mut out = Vec::with_capacity(rows / 16 * kb);
    for g in 0..rows / 16 {
        for b in 0..kb {
            let mut x = BlockQ8_0x16 {
                qs: [[0; 64]; 8],
                d: [f16::ZERO; 16],
                corr: [0; 16],
            };
            for r in 0..16 {
                let src = &bytes[((16 * g + r) * kb + b) * 34..][..34];
                x.d[r] = f16::from_le_bytes([src[0], src[1]]);
                let q = &src[2..34];
                for (p, qs) in x.qs.iter_mut().enumerate() {
                    for j in 0..4 {
                        qs[4 * r + j] = q[4 * p + j] as i8;
                    }
                }
                x.corr[r] = 128 * q.iter().map(|&v| v as i8 as i32).sum::<i32>();
            }
            out.push(x);
        }
    }
    Some(out)
}

/// Activation quants with the sign bit flipped (`q + 128` as unsigned bytes), per block.
pub fn shift_into(x: &[BlockQ8_1], out: &mut [[u8; QK]]) {
    for (o, b) in out.iter_mut().zip(x) {
        *o = b.qs.map(|q| (q as u8) ^ 0x80);
    }
}

/// Row `i` of `out`, lane `r` = activation row `i` times weight row `r` of the group `w`, for
/// up to `TILE` rows; `xs` from `shifted`, `sc` from `scales` (only `d` is used: Q8_0 has no
/// offset).
///
/// # Safety
/// As `q4_1_x16::group_dot`.
pub unsafe fn group_dot(w: &[BlockQ8_0x16], xs: &[[u8; QK]], sc: &[[f32; 2]], out: OutRows) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `Linear` builds this layout only after `available()` said yes; the caller
    // vouches for `out`.
    unsafe {
        let kernels: [(usize, TileKernel<_, _>); 4] = [
            (8, x86::group_dot::<8>),
            (4, x86::group_dot::<4>),
            (2, x86::group_dot::<2>),
            (1, x86::group_dot::<1>),
        ];
        run_tiles(&kernels, w.len(), w, xs, sc, out)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("BlockQ8_0x16 weights exist only where the kernel runs");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BlockQ8_0x16, OutRows, QK};
    use std::arch::x86_64::*;

    // Indexing by row keeps the accumulators of one row visibly in step.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn group_dot<const R: usize>(w: &[BlockQ8_0x16], xs: &[[u8; QK]], sc: &[[f32; 2]], out: OutRows) {
        let mut acc = [_mm512_setzero_ps(); R];
        for (b, wb) in w.iter().enumerate() {
            let d = _mm512_cvtph_ps(_mm256_load_si256(wb.d.as_ptr() as *const __m256i));
            let corr = _mm512_loadu_si512(wb.corr.as_ptr() as *const _);
            let mut isum = [_mm512_setzero_si512(); R];
            for p in 0..8 {
                let wq = _mm512_load_si512(wb.qs[p].as_ptr() as *const _);
                for i in 0..R {
                    let x = xs.get_unchecked(i * w.len() + b).as_ptr();
                    let xv = _mm512_set1_epi32((x.add(4 * p) as *const i32).read_unaligned());
                    isum[i] = _mm512_dpbusd_epi32(isum[i], xv, wq);
                }
            }
            for i in 0..R {
                let [xd, _] = *sc.get_unchecked(i * w.len() + b);
                let exact = _mm512_sub_epi32(isum[i], corr);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(d, _mm512_set1_ps(xd)), acc[i]);
            }
        }
        for i in 0..R {
            _mm512_storeu_ps(out.row(i), acc[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::cpu::q4_1::quantize_row_q8_1;
    use crate::runtime::cpu::q4_1_x16::scales;

    #[test]
    fn tiles_match_a_plain_dot_product_for_any_row_count() {
        if !available() {
            eprintln!("skipping: no AVX-512 VNNI here");
            return;
        }
        let (rows, k) = (32, 128);
        let kb = k / QK;
        let mut next = crate::runtime::cpu::q4_1_x16::test_rng(5);
        let mut raw = Vec::new();
        for _ in 0..rows * kb {
            raw.extend(f16::from_f32((next() % 1000) as f32 / 1e4 + 1e-3).to_le_bytes());
            // The extremes included: -128 and 127.
            raw.extend((0..QK).map(|j| {
                if j == 0 {
                    0x80
                } else if j == 1 {
                    0x7f
                } else {
                    next() as u8
                }
            }));
        }
        let w = interleave16(&raw, rows, kb).unwrap();
        let acts: Vec<Vec<BlockQ8_1>> = (0..TILE + 2)
            .map(|_| {
                let x: Vec<f32> = (0..k).map(|_| (next() % 2000) as f32 / 500.0 - 2.0).collect();
                let mut q = vec![BlockQ8_1::ZERO; kb];
                quantize_row_q8_1(&x, &mut q);
                q
            })
            .collect();
        let sh: Vec<Vec<[u8; QK]>> = acts
            .iter()
            .map(|a| {
                let mut out = vec![[0; QK]; a.len()];
                shift_into(a, &mut out);
                out
            })
            .collect();
        let sc: Vec<Vec<[f32; 2]>> = acts.iter().map(|a| scales(a)).collect();
        let one = |i: usize| {
            let mut o = [0f32; 16];
            let out = OutRows {
                ptr: o.as_mut_ptr(),
                stride: 16,
            };
            unsafe { group_dot(&w[kb..2 * kb], &sh[i], &sc[i], out) };
            o
        };
        for n in 1..=TILE {
            let xs: Vec<[u8; QK]> = sh[2..2 + n].concat();
            let ss: Vec<[f32; 2]> = sc[2..2 + n].concat();
            let mut out = vec![[0f32; 16]; n];
            let rows = OutRows {
                ptr: out.as_mut_ptr() as *mut f32,
                stride: 16,
            };
            unsafe { group_dot(&w[kb..2 * kb], &xs, &ss, rows) };
            for (i, o) in out.iter().enumerate() {
                assert_eq!(*o, one(2 + i), "row {i} of {n}: bitwise the same as alone");
            }
        }
        for (i, a) in acts.iter().enumerate() {
            let got = one(i);
            for r in 0..16 {
                let mut want = 0f32;
                for (b, xb) in a.iter().enumerate() {
                    let src = &raw[((16 + r) * kb + b) * 34..][..34];
                    let dw = f16::from_le_bytes([src[0], src[1]]).to_f32();
                    let isum: i32 = src[2..]
                        .iter()
                        .zip(&xb.qs)
                        .map(|(&w, &x)| w as i8 as i32 * x as i32)
                        .sum();
                    want += isum as f32 * dw * xb.d.to_f32();
                }
                assert!(
                    (got[r] - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{} vs {want}",
                    got[r]
                );
            }
        }
    }
}
