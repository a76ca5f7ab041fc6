//! Q4_1 weights times Q8_1-quantized activations, the layout llama.cpp uses (ggml's
//! `vec_dot_q4_1_q8_1`). candle reads Q4_1 but only has a scalar dot product for it, and nearly
//! every weight of the default model is Q4_1, so this one kernel gets SIMD here.

use half::f16;

pub const QK: usize = 32;

/// 32 weights: `w = d * q + m` with 4-bit `q`; byte `j` holds element `j` (low nibble) and
/// element `j + 16` (high nibble).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);

/// 32 activations: `x = d * q` with 8-bit `q`; `s = d * sum(q)` carries the Q4_1 offset term.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == 36);

impl BlockQ8_1 {
    pub const ZERO: BlockQ8_1 = BlockQ8_1 {
        d: f16::ZERO,
        s: f16::ZERO,
        qs: [0; QK],
    };
}

/// Parses raw GGUF bytes of a Q4_1 tensor.
pub fn blocks_from_bytes(bytes: &[u8]) -> Option<Vec<BlockQ4_1>> {
    if !bytes.len().is_multiple_of(20) {
        return None;
    }
    Some(
        bytes
            .chunks_exact(20)
            .map(|c| {
                let mut qs = [0u8; 16];
                qs.copy_from_slice(&c[4..20]);
                BlockQ4_1 {
                    d: f16::from_le_bytes([c[0], c[1]]),
                    m: f16::from_le_bytes([c[2], c[3]]),
                    qs,
                }
            })
            .collect(),
    )
}

/// ggml's `quantize_row_q8_1` as its x86 build computes it (scale `127 / amax`, ties to even):
/// this model's activations are large enough that a different rounding of a few values moves
/// its log-probabilities visibly, so we round exactly as the reference does.
pub fn quantize_row_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
        // SAFETY: the CPU has the features; the lengths match.
        unsafe { x86::quantize_row_q8_1(x, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has the features; the lengths match.
        unsafe { x86::quantize_row_q8_1_avx2(x, out) };
        return;
    }
    quantize_row_q8_1_scalar(x, out);
}

fn quantize_row_q8_1_scalar(x: &[f32], out: &mut [BlockQ8_1]) {
    for (xb, yb) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in yb.qs.iter_mut().zip(xb) {
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            sum += r;
        }
        yb.d = f16::from_f32(d);
        yb.s = f16::from_f32(d * sum as f32);
    }
}

pub fn vec_dot_scalar(w: &[BlockQ4_1], x: &[BlockQ8_1]) -> f32 {
    let mut sum = 0f32;
    for (wb, xb) in w.iter().zip(x) {
        let mut isum = 0i32;
        for j in 0..QK / 2 {
            let lo = (wb.qs[j] & 0x0f) as i32;
            let hi = (wb.qs[j] >> 4) as i32;
            isum += lo * xb.qs[j] as i32 + hi * xb.qs[j + QK / 2] as i32;
        }
        sum += isum as f32 * wb.d.to_f32() * xb.d.to_f32() + wb.m.to_f32() * xb.s.to_f32();
    }
    sum
}

/// Four consecutive weight rows' blocks at one block index, interleaved so that one load and
/// one f16 conversion give all four scales and offsets. Same bytes as four `BlockQ4_1`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4_1x4 {
    pub d: [f16; 4],
    pub m: [f16; 4],
    pub qs: [[u8; QK / 2]; 4],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1x4>() == 80);

/// Regroups row-major blocks (`rows * kb`) into row quads: quad `q`, block `b` at `q * kb + b`.
pub fn interleave4(blocks: &[BlockQ4_1], rows: usize, kb: usize) -> Vec<BlockQ4_1x4> {
    debug_assert_eq!(rows % 4, 0);
    let mut out = Vec::with_capacity(rows / 4 * kb);
    for q in 0..rows / 4 {
        for b in 0..kb {
            let at = |r: usize| &blocks[(4 * q + r) * kb + b];
            out.push(BlockQ4_1x4 {
                d: [at(0).d, at(1).d, at(2).d, at(3).d],
                m: [at(0).m, at(1).m, at(2).m, at(3).m],
                qs: [at(0).qs, at(1).qs, at(2).qs, at(3).qs],
            });
        }
    }
    out
}

/// Dot products of one weight quad (its `kb` interleaved blocks) with up to `MAX_ROWS`
/// activation rows; `out[i][r]` is activation row `i` times weight row `r`.
pub type QuadKernel = fn(&[BlockQ4_1x4], &[&[BlockQ8_1]], &mut [[f32; 4]]);

/// Activation rows one kernel call handles: each expanded weight block is reused this often.
pub const MAX_ROWS: usize = 4;

fn quad_scalar(w: &[BlockQ4_1x4], xs: &[&[BlockQ8_1]], out: &mut [[f32; 4]]) {
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        for (r, o) in o.iter_mut().enumerate() {
            let row: Vec<BlockQ4_1> = w
                .iter()
                .map(|b| BlockQ4_1 {
                    d: b.d[r],
                    m: b.m[r],
                    qs: b.qs[r],
                })
                .collect();
            *o = vec_dot_scalar(&row, x);
        }
    }
}

/// The fastest kernel this CPU runs, picked once.
pub fn quad_kernel() -> QuadKernel {
    use std::sync::OnceLock;
    static PICK: OnceLock<QuadKernel> = OnceLock::new();
    *PICK.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            if avx2 && is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
                return x86::quad_vnni_safe;
            }
            if avx2 {
                return x86::quad_avx2_safe;
            }
        }
        quad_scalar
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BlockQ4_1x4, BlockQ8_1, MAX_ROWS};
    use std::arch::x86_64::*;

    /// The kernel body, shared by the AVX2 and VNNI variants, which differ only in the u8 x i8
    /// multiply-accumulate: target features must be on the function the intrinsics inline into.
    ///
    /// Per activation row and block, the four weight rows' integer products are summed into
    /// one vector by two horizontal adds (each half holds the four rows' partial sums), so one
    /// conversion and two FMAs (scale, then offset) do the float work of all four, and one
    /// accumulator per activation row stays in a register. Four accumulators per row had
    /// spilled to the stack with 16 vector registers: this kernel was then two thirds of a
    /// prefill's time on an AVX2 CPU. A row's arithmetic is the same whatever it is batched with.
    macro_rules! quad_kernel {
        ($name:ident, $features:literal, $mul_sum:expr) => {
            #[target_feature(enable = $features)]
            unsafe fn $name(w: &[BlockQ4_1x4], xs: &[&[BlockQ8_1]], out: &mut [[f32; 4]]) {
                let rows = xs.len().min(MAX_ROWS);
                let mask = _mm256_set1_epi8(0x0f);
                let mut acc = [_mm256_setzero_ps(); MAX_ROWS];
                for (b, wb) in w.iter().enumerate() {
                    // d0..d3 in the low half, m0..m3 in the high half; then the scales in both
                    // halves, and the offsets in the low half only (the sums' halves add up).
                    let dm = _mm256_cvtph_ps(_mm_loadu_si128(wb.d.as_ptr() as *const __m128i));
                    let wd = _mm256_permute2f128_ps::<0x00>(dm, dm);
                    let wm = _mm256_permute2f128_ps::<0x81>(dm, dm);
                    let mut q = [_mm256_setzero_si256(); 4];
                    for r in 0..4 {
                        let packed = _mm_loadu_si128(wb.qs[r].as_ptr() as *const __m128i);
                        q[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), mask);
                    }
                    for i in 0..rows {
                        let xb = xs[i].get_unchecked(b);
                        let y = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
                        let p: [__m256i; 4] = std::array::from_fn(|r| $mul_sum(q[r], y));
                        let sums = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
                        let ds = _mm_cvtph_ps(_mm_cvtsi32_si128(
                            (xb.d.to_bits() as u32 | ((xb.s.to_bits() as u32) << 16)) as i32,
                        ));
                        let scale = _mm256_mul_ps(wd, _mm256_broadcastss_ps(ds));
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[i]);
                        acc[i] = _mm256_fmadd_ps(wm, _mm256_broadcastss_ps(_mm_movehdup_ps(ds)), acc[i]);
                    }
                }
                for i in 0..rows {
                    let halves = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps::<1>(acc[i]));
                    _mm_storeu_ps(out[i].as_mut_ptr(), halves);
                }
            }
        };
    }

    quad_kernel!(quad_avx2, "avx2,fma,f16c", |q, y| _mm256_madd_epi16(
        _mm256_maddubs_epi16(q, y),
        _mm256_set1_epi16(1)
    ));
    quad_kernel!(quad_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", |q, y| {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, y)
    });

    pub fn quad_avx2_safe(w: &[BlockQ4_1x4], xs: &[&[BlockQ8_1]], out: &mut [[f32; 4]]) {
        // SAFETY: selected only after the CPU reported these features.
        unsafe { quad_avx2(w, xs, out) }
    }

    pub fn quad_vnni_safe(w: &[BlockQ4_1x4], xs: &[&[BlockQ8_1]], out: &mut [[f32; 4]]) {
        // SAFETY: selected only after the CPU reported these features.
        unsafe { quad_vnni(w, xs, out) }
    }

    /// The scalar version's arithmetic, 32 values at a time: the same products, the same
    /// ties-to-even rounding, an exact integer sum, so the blocks are bit for bit the same.
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    pub unsafe fn quantize_row_q8_1(x: &[f32], out: &mut [super::BlockQ8_1]) {
        for (xb, yb) in x.chunks_exact(super::QK).zip(out.iter_mut()) {
            let a = _mm512_loadu_ps(xb.as_ptr());
            let b = _mm512_loadu_ps(xb.as_ptr().add(16));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            let d = amax / 127.0;
            let id = _mm512_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let qa = _mm512_cvtps_epi32(_mm512_roundscale_ps::<NEAREST>(_mm512_mul_ps(a, id)));
            let qb = _mm512_cvtps_epi32(_mm512_roundscale_ps::<NEAREST>(_mm512_mul_ps(b, id)));
            _mm_storeu_si128(yb.qs.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(qa));
            _mm_storeu_si128(yb.qs.as_mut_ptr().add(16) as *mut __m128i, _mm512_cvtepi32_epi8(qb));
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
            yb.d = half::f16::from_f32(d);
            yb.s = half::f16::from_f32(d * sum as f32);
        }
    }

    /// The same, 8 values at a time, for CPUs without AVX-512.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn quantize_row_q8_1_avx2(x: &[f32], out: &mut [super::BlockQ8_1]) {
        let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        for (xb, yb) in x.chunks_exact(super::QK).zip(out.iter_mut()) {
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xb.as_ptr().add(8 * i)));
            let m = v.map(|v| _mm256_and_ps(v, magnitude));
            let m = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), m);
            let amax = lanes.iter().fold(0f32, |a, &v| a.max(v));
            let d = amax / 127.0;
            let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let q = v.map(|v| _mm256_cvtps_epi32(_mm256_round_ps::<NEAREST>(_mm256_mul_ps(v, id))));
            let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let mut sums = [0i32; 8];
            _mm256_storeu_si256(sums.as_mut_ptr() as *mut __m256i, sum);
            // |q| <= 127, so the saturating packs are exact; they interleave 128-bit lanes,
            // which the final permute puts back in order.
            let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(yb.qs.as_mut_ptr() as *mut __m256i, bytes);
            yb.d = half::f16::from_f32(d);
            yb.s = half::f16::from_f32(d * sums.iter().sum::<i32>() as f32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    }

    #[test]
    fn quantization_is_the_same_bit_for_bit_on_every_path() {
        let mut seed = 3;
        let mut x: Vec<f32> = (0..32 * 40).map(|_| lcg(&mut seed) * 9.0).collect();
        x[..32].fill(0.0);
        // Exact ties (k + 0.5 after scaling) must round to even on both paths.
        for (i, v) in x[32..64].iter_mut().enumerate() {
            *v = i as f32 + 0.5;
        }
        x[63] = 127.0;
        let (mut a, mut b) = (vec![BlockQ8_1::ZERO; 40], vec![BlockQ8_1::ZERO; 40]);
        quantize_row_q8_1_scalar(&x, &mut b);
        let same = |a: &[BlockQ8_1]| {
            for (p, q) in a.iter().zip(&b) {
                assert_eq!(
                    (p.d.to_bits(), p.s.to_bits(), p.qs),
                    (q.d.to_bits(), q.s.to_bits(), q.qs)
                );
            }
        };
        quantize_row_q8_1(&x, &mut a);
        same(&a);
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
            a.fill(BlockQ8_1::ZERO);
            // SAFETY: the CPU has the features; the lengths match.
            unsafe { x86::quantize_row_q8_1_avx2(&x, &mut a) };
            same(&a);
        }
    }

    #[test]
    fn simd_dot_matches_scalar_and_float_reference() {
        let mut seed = 7;
        let k = 576;
        let rows: Vec<Vec<BlockQ4_1>> = (0..4)
            .map(|_| {
                (0..k / QK)
                    .map(|_| {
                        let mut qs = [0u8; 16];
                        for q in qs.iter_mut() {
                            *q = ((lcg(&mut seed) + 0.5) * 255.0) as u8;
                        }
                        BlockQ4_1 {
                            d: f16::from_f32(lcg(&mut seed) * 0.1),
                            m: f16::from_f32(lcg(&mut seed) * 0.2),
                            qs,
                        }
                    })
                    .collect()
            })
            .collect();
        let xf: Vec<f32> = (0..k).map(|_| lcg(&mut seed) * 4.0).collect();
        let mut xq = vec![BlockQ8_1::ZERO; k / QK];
        quantize_row_q8_1(&xf, &mut xq);
        let flat: Vec<BlockQ4_1> = rows.concat();
        let quad = interleave4(&flat, 4, k / QK);
        let mut outs = [[0f32; 4]; 3];
        let xq2: Vec<BlockQ8_1> = xq
            .iter()
            .map(|b| BlockQ8_1 {
                d: b.d,
                s: -b.s,
                qs: b.qs.map(|q| q.saturating_neg()),
            })
            .collect();
        quad_kernel()(&quad, &[&xq, &xq2, &xq], &mut outs);
        assert_eq!(outs[2], outs[0], "activation rows are independent");
        for (neg, pos) in outs[1].iter().zip(&outs[0]) {
            assert!((neg + pos).abs() <= 1e-3 * pos.abs().max(1.0), "negated activation row");
        }
        let got = outs[0];
        for r in 0..4 {
            let scalar = vec_dot_scalar(&rows[r], &xq);
            assert!(
                (got[r] - scalar).abs() <= 1e-3 * scalar.abs().max(1.0),
                "{} vs {}",
                got[r],
                scalar
            );
            // Against the dequantized weights in f32: only the activations' rounding remains,
            // at most half a quantization step (amax / 127 per block, f16 scale aside) each.
            let (mut exact, mut bound) = (0f32, 0f32);
            for (b, wb) in rows[r].iter().enumerate() {
                let xs = &xf[b * QK..(b + 1) * QK];
                let step = xs.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                for j in 0..16 {
                    let lo = (wb.qs[j] & 15) as f32 * wb.d.to_f32() + wb.m.to_f32();
                    let hi = (wb.qs[j] >> 4) as f32 * wb.d.to_f32() + wb.m.to_f32();
                    exact += lo * xs[j] + hi * xs[j + 16];
                    bound += (lo.abs() + hi.abs()) * step * 0.51;
                }
            }
            assert!(
                (got[r] - exact).abs() <= bound,
                "{} vs {} (bound {bound})",
                got[r],
                exact
            );
        }
    }
}
