//! `e^x` for 8 or 16 floats at once (AVX2 or AVX-512), for SiLU, rounding exactly as the scalar `f32::exp` does here
//! (glibc's `expf`, FMA variant): one prefill's SiLU is hundreds of millions of calls, 7% of
//! prefill as function calls, and a polynomial of our own that differed by an ulp now and then
//! moved the golden log-probabilities by over a nat.
//!
//! The method (from ARM's optimized-routines, which glibc uses): with `N = 32`, write
//! `x * N / ln 2 = k + r`, `|r| <= 1/2`; then `e^x = 2^(k / N) * 2^(r / N)`. The first factor
//! is a table entry `2^((k mod N) / N)` with `k div N` added to its exponent bits, the second a
//! cubic in `r`; all in f64, rounded once to f32. Every f64 operation below is the one glibc's
//! code performs, fused where it fuses, so the results agree bit for bit: checked once over
//! all 2^32 inputs, and over every 61st in the tests. Inputs of magnitude 88 and over (overflow, underflow,
//! infinities, NaN) take the scalar function.

/// `2^(i / 32)` as f64 bits; the exponent of `k div 32` is added by integer arithmetic.
const TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3ff059b0d3158574,
    0x3ff0b5586cf9890f,
    0x3ff11301d0125b51,
    0x3ff172b83c7d517b,
    0x3ff1d4873168b9aa,
    0x3ff2387a6e756238,
    0x3ff29e9df51fdee1,
    0x3ff306fe0a31b715,
    0x3ff371a7373aa9cb,
    0x3ff3dea64c123422,
    0x3ff44e086061892d,
    0x3ff4bfdad5362a27,
    0x3ff5342b569d4f82,
    0x3ff5ab07dd485429,
    0x3ff6247eb03a5585,
    0x3ff6a09e667f3bcd,
    0x3ff71f75e8ec5f74,
    0x3ff7a11473eb0187,
    0x3ff82589994cce13,
    0x3ff8ace5422aa0db,
    0x3ff93737b0cdc5e5,
    0x3ff9c49182a3f090,
    0x3ffa5503b23e255d,
    0x3ffae89f995ad3ad,
    0x3ffb7f76f2fb5e47,
    0x3ffc199bdd85529c,
    0x3ffcb720dcef9069,
    0x3ffd5818dcfba487,
    0x3ffdfc97337b9b5f,
    0x3ffea4afa2a490da,
    0x3fff50765b6e4540,
];
/// `32 / ln 2`.
const INV_LN2_N: f64 = 46.16624130844683;
/// Adding this rounds to an integer held in the low mantissa bits.
const SHIFT: f64 = 6755399441055744.0;
/// The cubic for `2^(r / 32)`: `C0 r^3 + C1 r^2 + C2 r + 1`.
const C0: f64 = 1.6938359250920212e-6;
const C1: f64 = 2.3459809789509004e-4;
const C2: f64 = 2.1660849396613134e-2;

/// `silu(g) * u` for every lane: `out[i] = g[i] / (1 + e^-g[i]) * u[i]`, with the scalar
/// expression's operations in its order.
pub fn silu_mul_row(g: &[f32], u: &[f32], out: &mut [f32]) {
    silu_mul_with(Vector::pick(), g, u, out)
}

/// The vector width the CPU offers for this: both widths run the same f64 operations, so
/// they agree with the scalar expression, and with each other, bit for bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Vector {
    Scalar,
    Avx2,
    Avx512,
}

impl Vector {
    fn pick() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            // Bit-exact only beside an FMA libm, which both paths require.
            if is_x86_feature_detected!("fma") {
                if is_x86_feature_detected!("avx512f") {
                    return Vector::Avx512;
                }
                if is_x86_feature_detected!("avx2") {
                    return Vector::Avx2;
                }
            }
        }
        Vector::Scalar
    }

    fn lanes(self) -> usize {
        match self {
            Vector::Scalar => 1,
            Vector::Avx2 => 8,
            Vector::Avx512 => 16,
        }
    }
}

fn silu_mul_with(v: Vector, g: &[f32], u: &[f32], out: &mut [f32]) {
    debug_assert!(g.len() == u.len() && g.len() == out.len());
    let done = g.len() / v.lanes() * v.lanes();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `Vector::pick` found the features each path needs; the slices hold `done`
    // floats each.
    unsafe {
        match v {
            Vector::Avx512 => x86::silu_mul(&g[..done], &u[..done], &mut out[..done]),
            Vector::Avx2 => avx2::silu_mul(&g[..done], &u[..done], &mut out[..done]),
            Vector::Scalar => {}
        }
    }
    for ((o, &g), &u) in out[done..].iter_mut().zip(&g[done..]).zip(&u[done..]) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// Eight lanes, four f64 at a time: the table entry comes from a gather instead of a
/// two-register permute, every other operation is the AVX-512 path's.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
        let one = _mm256_set1_ps(1.0);
        let sign = _mm256_set1_ps(-0.0);
        for ((g, u), o) in g.chunks_exact(8).zip(u.chunks_exact(8)).zip(out.chunks_exact_mut(8)) {
            let gv = _mm256_loadu_ps(g.as_ptr());
            let e = exp8(_mm256_xor_ps(gv, sign));
            let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o.as_mut_ptr(), _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr())));
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp8(x: __m256) -> __m256 {
        // Exponent and top mantissa bits at or above 88's take the scalar path.
        let top = _mm256_and_si256(
            _mm256_srli_epi32::<20>(_mm256_castps_si256(x)),
            _mm256_set1_epi32(0x7ff),
        );
        let special = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(top, _mm256_set1_epi32(0x42a))));
        let lo = _mm256_cvtpd_ps(exp4(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
        let hi = _mm256_cvtpd_ps(exp4(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x))));
        let mut y = _mm256_set_m128(hi, lo);
        if special != 0 {
            let (mut xs, mut ys) = ([0f32; 8], [0f32; 8]);
            _mm256_storeu_ps(xs.as_mut_ptr(), x);
            _mm256_storeu_ps(ys.as_mut_ptr(), y);
            for i in (0..8).filter(|i| special & (1 << i) != 0) {
                ys[i] = xs[i].exp();
            }
            y = _mm256_loadu_ps(ys.as_ptr());
        }
        y
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp4(x: __m256d) -> __m256d {
        let shift = _mm256_set1_pd(SHIFT);
        let inv = _mm256_set1_pd(INV_LN2_N);
        let kd = _mm256_fmadd_pd(inv, x, shift);
        let ki = _mm256_castpd_si256(kd);
        let kd = _mm256_sub_pd(kd, shift);
        let r = _mm256_fmsub_pd(inv, x, kd);
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        let t = _mm256_i64gather_epi64::<8>(TABLE.as_ptr() as *const i64, idx);
        // Minus (k mod 32) << 47 and plus k << 47: the exponent gains k div 32.
        let unit = _mm256_sub_epi64(t, _mm256_slli_epi64::<47>(idx));
        let s = _mm256_castsi256_pd(_mm256_add_epi64(unit, _mm256_slli_epi64::<47>(ki)));
        let z = _mm256_fmadd_pd(_mm256_set1_pd(C0), r, _mm256_set1_pd(C1));
        let r2 = _mm256_mul_pd(r, r);
        let y = _mm256_fmadd_pd(r, _mm256_set1_pd(C2), _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(z, r2, y);
        _mm256_mul_pd(y, s)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
        let one = _mm512_set1_ps(1.0);
        for ((g, u), o) in g.chunks_exact(16).zip(u.chunks_exact(16)).zip(out.chunks_exact_mut(16)) {
            let gv = _mm512_loadu_ps(g.as_ptr());
            let sign = _mm512_set1_epi32(i32::MIN);
            let e = exp16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), sign)));
            let s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(s, _mm512_loadu_ps(u.as_ptr())));
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp16(x: __m512) -> __m512 {
        // Exponent and top mantissa bits at or above 88's take the scalar path.
        let top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 20), _mm512_set1_epi32(0x7ff));
        let special = _mm512_cmpgt_epi32_mask(top, _mm512_set1_epi32(0x42a));
        let lo = exp8(_mm512_cvtps_pd(_mm512_castps512_ps256(x)));
        let upper_half = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
        let hi = exp8(_mm512_cvtps_pd(upper_half));
        let lo = _mm512_castps256_ps512(_mm512_cvtpd_ps(lo));
        let hi = _mm256_castps_pd(_mm512_cvtpd_ps(hi));
        let mut y = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(lo), hi, 1));
        if special != 0 {
            let (mut xs, mut ys) = ([0f32; 16], [0f32; 16]);
            _mm512_storeu_ps(xs.as_mut_ptr(), x);
            _mm512_storeu_ps(ys.as_mut_ptr(), y);
            for i in (0..16).filter(|i| special & (1 << i) != 0) {
                ys[i] = xs[i].exp();
            }
            y = _mm512_loadu_ps(ys.as_ptr());
        }
        y
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn exp8(x: __m512d) -> __m512d {
        let table = |at: usize| _mm512_loadu_si512(TABLE[at..].as_ptr() as *const _);
        let shift = _mm512_set1_pd(SHIFT);
        let inv = _mm512_set1_pd(INV_LN2_N);
        let kd = _mm512_fmadd_pd(inv, x, shift);
        let ki = _mm512_castpd_si512(kd);
        let kd = _mm512_sub_pd(kd, shift);
        let r = _mm512_fmsub_pd(inv, x, kd);
        // Entry k mod 32: bits 0-3 pick among 16 in each half, bit 4 picks the half.
        let first = _mm512_permutex2var_epi64(table(0), ki, table(8));
        let second = _mm512_permutex2var_epi64(table(16), ki, table(24));
        let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
        let t = _mm512_mask_blend_epi64(upper, first, second);
        // Minus (k mod 32) << 47 and plus k << 47: the exponent gains k div 32.
        let idx = _mm512_and_si512(ki, _mm512_set1_epi64(31));
        let unit = _mm512_sub_epi64(t, _mm512_slli_epi64(idx, 47));
        let bits = _mm512_add_epi64(unit, _mm512_slli_epi64(ki, 47));
        let s = _mm512_castsi512_pd(bits);
        let z = _mm512_fmadd_pd(_mm512_set1_pd(C0), r, _mm512_set1_pd(C1));
        let r2 = _mm512_mul_pd(r, r);
        let y = _mm512_fmadd_pd(r, _mm512_set1_pd(C2), _mm512_set1_pd(1.0));
        let y = _mm512_fmadd_pd(z, r2, y);
        _mm512_mul_pd(y, s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every float whose bits are a multiple of 61 (70 million, across every exponent and
    /// special value) through each vector SiLU this CPU has and the scalar expression.
    #[test]
    fn vector_silu_matches_the_scalar_expression_bit_for_bit() {
        let paths = match Vector::pick() {
            Vector::Avx512 => vec![Vector::Avx2, Vector::Avx512],
            Vector::Avx2 => vec![Vector::Avx2],
            Vector::Scalar => vec![],
        };
        if paths.is_empty() {
            eprintln!("skipping: no AVX2 with FMA here, the scalar expression is all there is");
            return;
        }
        let (mut g, mut u) = (Vec::with_capacity(1 << 16), Vec::with_capacity(1 << 16));
        let mut out = vec![0f32; 1 << 16];
        let mut bits = 0u64;
        while bits <= u32::MAX as u64 {
            g.clear();
            u.clear();
            while g.len() < 1 << 16 && bits <= u32::MAX as u64 {
                g.push(f32::from_bits(bits as u32));
                u.push(1.0 + (bits % 7) as f32 * 0.25);
                bits += 61;
            }
            for &path in &paths {
                let n = g.len();
                silu_mul_with(path, &g, &u[..n], &mut out[..n]);
                for i in 0..n {
                    let want = g[i] / (1.0 + (-g[i]).exp()) * u[i];
                    let got = out[i];
                    assert!(
                        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                        "{path:?}: silu({:e}) = {got:e}, scalar {want:e}",
                        g[i]
                    );
                }
            }
        }
    }
}
