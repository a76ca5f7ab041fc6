//! Q4_1 weights regrouped 16 rows at a time for AVX-512 VNNI, the kernel that carries prefill
//! and batched decode. One 64-byte vector holds four consecutive weights of each of the 16
//! rows, so one `vpdpbusd` with four activation bytes broadcast does 16 x 4 multiply-adds;
//! every unpacked weight vector is reused by several activation rows, and where two groups are
//! taken together each broadcast feeds both (broadcast loads had been a quarter of the
//! kernel's time: the pair kernel made prefill projections 8-15% faster). The per-block float
//! work (scale, offset) is then two FMAs per 512 multiply-adds instead of one per 32, as in
//! the row-quad kernel (`q4_1`), which stays as the fallback for CPUs without AVX-512.
//!
//! Each output is computed by the same operations in the same order whatever the number of
//! activation rows in the call, so a request's logits do not depend on what it is batched with.

use half::f16;

use super::q4_1::{BlockQ4_1, BlockQ8_1};

/// One block (32 weights) of 16 consecutive rows. `qs[p]` byte `4 * r + j` holds row `r`'s
/// weight `4 * p + j` in its low nibble and weight `4 * p + j + 16` in its high nibble.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub struct BlockQ4_1x16 {
    pub qs: [[u8; 64]; 4],
    pub d: [f16; 16],
    pub m: [f16; 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1x16>() == 320);

/// Activation rows per kernel call.
pub const TILE: usize = 8;

/// Where a kernel writes its results: the 16 floats of activation row `i` at
/// `ptr + i * stride` (straight into the output matrix: no staging copy to stall on).
#[derive(Clone, Copy)]
pub struct OutRows {
    pub ptr: *mut f32,
    pub stride: usize,
}

impl OutRows {
    pub fn skip(self, rows: usize) -> Self {
        OutRows {
            ptr: self.ptr.wrapping_add(rows * self.stride),
            ..self
        }
    }

    pub fn row(self, i: usize) -> *mut f32 {
        self.ptr.wrapping_add(i * self.stride)
    }
}

/// Whether this CPU runs the kernel.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Regroups row-major blocks (`rows * kb`) into 16-row groups: group `g`, block `b` at
/// `g * kb + b`.
pub fn interleave16(blocks: &[BlockQ4_1], rows: usize, kb: usize) -> Vec<BlockQ4_1x16> {
    debug_assert_eq!(rows % 16, 0);
    let mut out = Vec::with_capacity(rows / 16 * kb);
    for g in 0..rows / 16 {
        for b in 0..kb {
            let mut x = BlockQ4_1x16 {
                qs: [[0; 64]; 4],
                d: [f16::ZERO; 16],
                m: [f16::ZERO; 16],
            };
            for r in 0..16 {
                let src = &blocks[(16 * g + r) * kb + b];
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

/// The activation scales of a row, as f32: `d` and `s` of every block.
pub fn scales_into(x: &[BlockQ8_1], out: &mut [[f32; 2]]) {
    for (o, b) in out.iter_mut().zip(x) {
        *o = [b.d.to_f32(), b.s.to_f32()];
    }
}

#[cfg(test)]
pub fn scales(x: &[BlockQ8_1]) -> Vec<[f32; 2]> {
    let mut out = vec![[0.0; 2]; x.len()];
    scales_into(x, &mut out);
    out
}

/// Row `i` of `out`, lane `r` = activation row `i` times weight row `r` of the group `w` (its
/// `kb` blocks), for up to `TILE` activation rows laid end to end in `xs` and `sc` (`kb`
/// blocks each): rows are passed as one slice, since building slice arrays per call stalled
/// on store forwarding. `w` may hold two consecutive groups (`2 * kb` blocks): their 32
/// outputs per row then come from one pass, each activation byte loaded once for both.
///
/// # Safety
/// `out` must hold `xs.len() / kb` rows of `w.len() / kb * 16` writable floats that nothing
/// else touches meanwhile.
pub unsafe fn group_dot(w: &[BlockQ4_1x16], kb: usize, xs: &[BlockQ8_1], sc: &[[f32; 2]], out: OutRows) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `Linear` builds this layout only after `available()` said yes; the caller
    // vouches for `out`.
    unsafe {
        if w.len() == 2 * kb {
            let kernels: [(usize, TileKernel<_, _>); 3] = [
                (4, x86::pair_dot::<4>),
                (2, x86::pair_dot::<2>),
                (1, x86::pair_dot::<1>),
            ];
            return run_tiles(&kernels, kb, w, xs, sc, out);
        }
        debug_assert_eq!(w.len(), kb);
        let kernels: [(usize, TileKernel<_, _>); 4] = [
            (8, x86::group_dot::<8>),
            (4, x86::group_dot::<4>),
            (2, x86::group_dot::<2>),
            (1, x86::group_dot::<1>),
        ];
        run_tiles(&kernels, kb, w, xs, sc, out)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("BlockQ4_1x16 weights exist only where the kernel runs");
}

/// A kernel instance for a fixed number of activation rows.
pub type TileKernel<W, X> = unsafe fn(&[W], &[X], &[[f32; 2]], OutRows);

/// Runs the activation rows of `xs` (`kb` blocks each, at most `TILE` rows) through
/// `kernels`, each `(rows it takes, kernel)`, largest first.
///
/// # Safety
/// The kernels' own conditions, and `out` holds a row of outputs per activation row.
pub unsafe fn run_tiles<W, X>(
    kernels: &[(usize, TileKernel<W, X>)],
    kb: usize,
    w: &[W],
    xs: &[X],
    sc: &[[f32; 2]],
    out: OutRows,
) {
    let kb = kb.max(1);
    debug_assert!(xs.len() <= TILE * kb && xs.len() == sc.len() && xs.len().is_multiple_of(kb));
    let (mut done, rows) = (0, xs.len() / kb);
    for &(size, kernel) in kernels {
        while rows - done >= size {
            let range = done * kb..(done + size) * kb;
            kernel(w, &xs[range.clone()], &sc[range], out.skip(done));
            done += size;
        }
    }
}

/// `run_tiles` over each group of `w` (`kb` blocks of `group_rows` weight rows), each group's
/// outputs `group_rows` columns after the previous group's.
///
/// # Safety
/// As `run_tiles`, for `w.len() / kb * group_rows` outputs per activation row.
pub unsafe fn run_groups<W, X>(
    kernels: &[(usize, TileKernel<W, X>)],
    kb: usize,
    group_rows: usize,
    w: &[W],
    xs: &[X],
    sc: &[[f32; 2]],
    out: OutRows,
) {
    for (g, wg) in w.chunks_exact(kb).enumerate() {
        let out = OutRows {
            ptr: out.ptr.wrapping_add(group_rows * g),
            ..out
        };
        // SAFETY: the caller's conditions, for this group's columns.
        unsafe { run_tiles(kernels, kb, wg, xs, sc, out) };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BlockQ4_1x16, BlockQ8_1, OutRows};
    use std::arch::x86_64::*;

    // Indexing by row keeps the accumulators of one row visibly in step.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn group_dot<const R: usize>(w: &[BlockQ4_1x16], xs: &[BlockQ8_1], sc: &[[f32; 2]], out: OutRows) {
        let mask = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); R];
        for (b, wb) in w.iter().enumerate() {
            let d = _mm512_cvtph_ps(_mm256_load_si256(wb.d.as_ptr() as *const __m256i));
            let m = _mm512_cvtph_ps(_mm256_load_si256(wb.m.as_ptr() as *const __m256i));
            let mut isum = [_mm512_setzero_si512(); R];
            for p in 0..4 {
                let packed = _mm512_load_si512(wb.qs[p].as_ptr() as *const _);
                let lo = _mm512_and_si512(packed, mask);
                let hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
                for i in 0..R {
                    let x = xs.get_unchecked(i * w.len() + b).qs.as_ptr();
                    let x_lo = _mm512_set1_epi32((x.add(4 * p) as *const i32).read_unaligned());
                    let x_hi = _mm512_set1_epi32((x.add(4 * p + 16) as *const i32).read_unaligned());
                    isum[i] = _mm512_dpbusd_epi32(isum[i], lo, x_lo);
                    isum[i] = _mm512_dpbusd_epi32(isum[i], hi, x_hi);
                }
            }
            for i in 0..R {
                let [xd, xsum] = *sc.get_unchecked(i * w.len() + b);
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(xd));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), scale, acc[i]);
                acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum), acc[i]);
            }
        }
        for i in 0..R {
            _mm512_storeu_ps(out.row(i), acc[i]);
        }
    }

    /// `group_dot` over two consecutive groups (`w` holds both, `kb` blocks each): every
    /// output takes exactly the operations, in the same order, that `group_dot` gives it.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn pair_dot<const R: usize>(w: &[BlockQ4_1x16], xs: &[BlockQ8_1], sc: &[[f32; 2]], out: OutRows) {
        let kb = w.len() / 2;
        let mask = _mm512_set1_epi8(0x0f);
        let mut acc = [[_mm512_setzero_ps(); R]; 2];
        for b in 0..kb {
            let wb = [w.get_unchecked(b), w.get_unchecked(kb + b)];
            let mut isum = [[_mm512_setzero_si512(); R]; 2];
            for p in 0..4 {
                let mut lo = [_mm512_setzero_si512(); 2];
                let mut hi = [_mm512_setzero_si512(); 2];
                for g in 0..2 {
                    let packed = _mm512_load_si512(wb[g].qs[p].as_ptr() as *const _);
                    lo[g] = _mm512_and_si512(packed, mask);
                    hi[g] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
                }
                for i in 0..R {
                    let x = xs.get_unchecked(i * kb + b).qs.as_ptr();
                    let x_lo = _mm512_set1_epi32((x.add(4 * p) as *const i32).read_unaligned());
                    let x_hi = _mm512_set1_epi32((x.add(4 * p + 16) as *const i32).read_unaligned());
                    for g in 0..2 {
                        isum[g][i] = _mm512_dpbusd_epi32(isum[g][i], lo[g], x_lo);
                        isum[g][i] = _mm512_dpbusd_epi32(isum[g][i], hi[g], x_hi);
                    }
                }
            }
            for g in 0..2 {
                let d = _mm512_cvtph_ps(_mm256_load_si256(wb[g].d.as_ptr() as *const __m256i));
                let m = _mm512_cvtph_ps(_mm256_load_si256(wb[g].m.as_ptr() as *const __m256i));
                for i in 0..R {
                    let [xd, xsum] = *sc.get_unchecked(i * kb + b);
                    let scale = _mm512_mul_ps(d, _mm512_set1_ps(xd));
                    acc[g][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[g][i]), scale, acc[g][i]);
                    acc[g][i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum), acc[g][i]);
                }
            }
        }
        for i in 0..R {
            _mm512_storeu_ps(out.row(i), acc[0][i]);
            _mm512_storeu_ps(out.row(i).add(16), acc[1][i]);
        }
    }
}

/// A fixed pseudo-random stream of u32 for the kernel tests.
#[cfg(test)]
pub(crate) fn test_rng(mut seed: u64) -> impl FnMut() -> u32 {
    move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    }
}

/// `TILE + 3` rows of `k` activations quantized to Q8_1, at the extremes too: every third row
/// all at the top of its range (+127 after quantization), every third with each block's first
/// value at the bottom, the rest random.
#[cfg(test)]
pub(crate) fn test_activations(next: &mut impl FnMut() -> u32, k: usize) -> Vec<Vec<BlockQ8_1>> {
    (0..TILE + 3)
        .map(|a| {
            let x: Vec<f32> = (0..k)
                .map(|j| match a % 3 {
                    0 => 2.0,
                    1 if j % 32 == 0 => -2.0,
                    _ => (next() % 2000) as f32 / 500.0 - 2.0,
                })
                .collect();
            let mut q = vec![BlockQ8_1::ZERO; k / 32];
            super::q4_1::quantize_row_q8_1(&x, &mut q);
            q
        })
        .collect()
}

/// `dot(activation rows, their scales, where 16 outputs per row go)` for every row of `acts`
/// alone, and for tiles of 1 to `TILE` rows from row 3 on, each of which must give every row
/// bit for bit what it gave alone. The rows' results alone.
#[cfg(test)]
pub(crate) fn alone_and_in_tiles(
    acts: &[Vec<BlockQ8_1>],
    dot: impl Fn(&[BlockQ8_1], &[[f32; 2]], OutRows),
) -> Vec<[f32; 16]> {
    let scs: Vec<Vec<[f32; 2]>> = acts.iter().map(|a| scales(a)).collect();
    let alone: Vec<[f32; 16]> = (0..acts.len())
        .map(|i| {
            let mut o = [0f32; 16];
            dot(
                &acts[i],
                &scs[i],
                OutRows {
                    ptr: o.as_mut_ptr(),
                    stride: 16,
                },
            );
            o
        })
        .collect();
    for n in 1..=TILE {
        let xs: Vec<BlockQ8_1> = acts[3..3 + n].concat();
        let sc: Vec<[f32; 2]> = scs[3..3 + n].concat();
        let mut out = vec![[0f32; 16]; n];
        dot(
            &xs,
            &sc,
            OutRows {
                ptr: out.as_mut_ptr() as *mut f32,
                stride: 16,
            },
        );
        for (i, o) in out.iter().enumerate() {
            assert_eq!(*o, alone[3 + i], "row {i} of {n}: bitwise the same as alone");
        }
    }
    alone
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::cpu::q4_1::{quantize_row_q8_1, vec_dot_scalar, QK};

    #[test]
    fn tiles_match_the_scalar_dot_product_for_any_row_count() {
        if !available() {
            eprintln!("skipping: no AVX-512 VNNI here");
            return;
        }
        let (rows, k) = (48, 256);
        let kb = k / QK;
        let mut next = test_rng(11);
        let blocks: Vec<BlockQ4_1> = (0..rows * kb)
            .map(|_| BlockQ4_1 {
                d: f16::from_f32((next() % 1000) as f32 / 1e4),
                m: f16::from_f32((next() % 1000) as f32 / 1e4 - 0.05),
                qs: std::array::from_fn(|_| next() as u8),
            })
            .collect();
        let w = interleave16(&blocks, rows, kb);
        let acts: Vec<Vec<BlockQ8_1>> = (0..TILE + 3)
            .map(|_| {
                let x: Vec<f32> = (0..k).map(|_| (next() % 2000) as f32 / 500.0 - 2.0).collect();
                let mut q = vec![BlockQ8_1::ZERO; kb];
                quantize_row_q8_1(&x, &mut q);
                q
            })
            .collect();
        let scs: Vec<Vec<[f32; 2]>> = acts.iter().map(|a| scales(a)).collect();
        // Groups 1 and 2, each alone, one activation row at a time.
        let alone: Vec<[f32; 32]> = (0..acts.len())
            .map(|i| {
                let mut o = [0f32; 32];
                for g in 0..2 {
                    let out = OutRows {
                        ptr: o[16 * g..].as_mut_ptr(),
                        stride: 32,
                    };
                    unsafe { group_dot(&w[(1 + g) * kb..(2 + g) * kb], kb, &acts[i], &scs[i], out) };
                }
                o
            })
            .collect();
        for n in 1..=TILE {
            let xs: Vec<BlockQ8_1> = acts[3..3 + n].concat();
            let sc: Vec<[f32; 2]> = scs[3..3 + n].concat();
            for groups in 1..=2 {
                let mut out = vec![[0f32; 32]; n];
                let rows = OutRows {
                    ptr: out.as_mut_ptr() as *mut f32,
                    stride: 32,
                };
                unsafe { group_dot(&w[kb..(1 + groups) * kb], kb, &xs, &sc, rows) };
                for i in 0..n {
                    assert_eq!(
                        out[i][..16 * groups],
                        alone[3 + i][..16 * groups],
                        "row {i} of {n}, {groups} groups: bitwise the same as alone"
                    );
                }
            }
        }
        for (i, a) in acts.iter().enumerate() {
            for r in 0..32 {
                let row = &blocks[(16 + r) * kb..(17 + r) * kb];
                let want = vec_dot_scalar(row, a);
                let got = alone[i][r];
                assert!((got - want).abs() <= 1e-3 * want.abs().max(1.0), "{got} vs {want}");
            }
        }
    }
}
