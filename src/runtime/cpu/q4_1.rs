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
    if bytes.len() % 20 != 0 {
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

/// Four weight rows against one activation row: the activation block is loaded once.
pub type Dot4 = fn([&[BlockQ4_1]; 4], &[BlockQ8_1]) -> [f32; 4];

fn dot4_scalar(w: [&[BlockQ4_1]; 4], x: &[BlockQ8_1]) -> [f32; 4] {
    w.map(|r| vec_dot_scalar(r, x))
}

/// The fastest kernel this CPU runs, picked once.
pub fn dot4() -> Dot4 {
    use std::sync::OnceLock;
    static PICK: OnceLock<Dot4> = OnceLock::new();
    *PICK.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return x86::dot4_avx2_safe;
            }
        }
        dot4_scalar
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BlockQ4_1, BlockQ8_1};
    use std::arch::x86_64::*;

    pub fn dot4_avx2_safe(w: [&[BlockQ4_1]; 4], x: &[BlockQ8_1]) -> [f32; 4] {
        // SAFETY: only selected after the CPU reported avx2, fma and f16c.
        unsafe { dot4_avx2(w, x) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibbles(qs: &[u8; 16]) -> __m256i {
        let packed = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
        let both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn h2f(h: half::f16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot4_avx2(w: [&[BlockQ4_1]; 4], x: &[BlockQ8_1]) -> [f32; 4] {
        let n = x.len();
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut summ = [0f32; 4];
        for b in 0..n {
            let xb = x.get_unchecked(b);
            let y = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
            let dy = h2f(xb.d);
            let sy = h2f(xb.s);
            for r in 0..4 {
                let wb = w[r].get_unchecked(b);
                // u8 nibbles times i8 activations: pairwise sums fit i16 (2 * 15 * 127).
                let p16 = _mm256_maddubs_epi16(nibbles(&wb.qs), y);
                let p32 = _mm256_madd_epi16(p16, ones);
                let scale = _mm256_set1_ps(h2f(wb.d) * dy);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), scale, acc[r]);
                summ[r] += h2f(wb.m) * sy;
            }
        }
        [
            hsum(acc[0]) + summ[0],
            hsum(acc[1]) + summ[1],
            hsum(acc[2]) + summ[2],
            hsum(acc[3]) + summ[3],
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
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
        let got = dot4()([&rows[0], &rows[1], &rows[2], &rows[3]], &xq);
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
