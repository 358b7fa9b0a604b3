//! AVX2 activation quantizers: Q8_0 and Q8_K blocks, the same values as the portable code in
//! `quant::legacy` and `quant::kquants` bit for bit (the same f32 operations per element: the multiply,
//! the round to nearest even by adding and subtracting 1.5·2²³, Q8_K's clamp; maxima are exact in any
//! order). A prompt quantizes every activation row of every matrix product, which on a model of small
//! matrices is a few percent of its time in scalar code.

use core::arch::x86_64::*;

/// `(v + 1.5·2²³) − 1.5·2²³` per lane: `v` rounded to an integer, ties to even (`|v| < 2²²`), as
/// `quant::legacy::round_ties_even`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn round_even(v: __m256) -> __m256 {
    let magic = _mm256_set1_ps(12_582_912.0);
    _mm256_sub_ps(_mm256_add_ps(v, magic), magic)
}

/// The largest `|x|` of the `8·k` values at `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn abs_max(x: *const f32, k: usize) -> f32 {
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for i in 0..k {
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x.add(8 * i))));
    }
    let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)))
}

/// Sixteen integer-valued lanes (`a`, `b`: values 0..8, 8..16) in -128..=127 as sixteen bytes, in order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes16(a: __m256, b: __m256) -> (__m128i, __m256i) {
    let w = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
    // packs works per 128-bit half: [a0-3 b0-3 | a4-7 b4-7] → [a0-7 | b0-7].
    let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(w);
    let bytes = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256::<1>(w));
    (bytes, w)
}

/// `quant::legacy::quantize_q8_0` for `nb` blocks of 32 values at `x` into `out` (34 bytes per block).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x` readable for `32·nb` values, `out` writable for `34·nb`
/// bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_0(nb: usize, x: *const f32, out: *mut u8) {
    for b in 0..nb {
        let (xb, ob) = (x.add(32 * b), out.add(34 * b));
        let amax = abs_max(xb, 4);
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let dh = _mm_cvtsi128_si32(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(d))) as u16;
        (ob as *mut u16).write_unaligned(dh.to_le());
        let idv = _mm256_set1_ps(id);
        for h in 0..2 {
            let q =
                |i: usize| round_even(_mm256_mul_ps(_mm256_loadu_ps(xb.add(16 * h + 8 * i)), idv));
            let (bytes, _) = bytes16(q(0), q(1));
            _mm_storeu_si128(ob.add(2 + 16 * h) as *mut __m128i, bytes);
        }
    }
}

/// `quant::kquants::quantize_q8_k` for `nb` blocks of 256 values at `x` into `out` (292 bytes per block).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x` readable for `256·nb` values, `out` writable for
/// `292·nb` bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_k(nb: usize, x: *const f32, out: *mut u8) {
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let ones = _mm256_set1_epi16(1);
    for b in 0..nb {
        let (xb, ob) = (x.add(256 * b), out.add(292 * b));
        let amax = abs_max(xb, 32);
        let iscale = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let d = if amax != 0.0 { 1.0 / iscale } else { 0.0 };
        (ob as *mut f32).write_unaligned(d);
        let iv = _mm256_set1_ps(iscale);
        let mut sums = [0i16; 16];
        for (g, sum) in sums.iter_mut().enumerate() {
            let q = |i: usize| {
                let v = round_even(_mm256_mul_ps(_mm256_loadu_ps(xb.add(16 * g + 8 * i)), iv));
                _mm256_min_ps(_mm256_max_ps(v, lo), hi)
            };
            let (bytes, words) = bytes16(q(0), q(1));
            _mm_storeu_si128(ob.add(4 + 16 * g) as *mut __m128i, bytes);
            // Σ of the sixteen quants (exact: at most 16·127 in magnitude).
            let s = _mm256_madd_epi16(words, ones);
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s));
            *sum = _mm_cvtsi128_si32(s) as i16;
        }
        std::ptr::copy_nonoverlapping(sums.as_ptr() as *const u8, ob.add(260), 32);
    }
}

#[cfg(test)]
mod tests {
    use crate::quant::{has_avx2_fma, kquants, legacy};
    use crate::rng::Rng;

    /// Rows of random values at several magnitudes, with an all-zero block, exact ties (halves after
    /// scaling) and a block whose largest element is positive, another negative.
    fn rows() -> Vec<Vec<f32>> {
        let mut rng = Rng::new(21);
        let mut out = Vec::new();
        for scale in [1e-6f32, 0.03, 1.0, 700.0] {
            let mut x: Vec<f32> = (0..1024).map(|_| rng.normal() * scale).collect();
            x[256..512].iter_mut().for_each(|v| *v = 0.0);
            // Values k/2 against a maximum of 127: the multiply is exact and lands on ties.
            for (i, v) in x[512..768].iter_mut().enumerate() {
                *v = (i as f32 - 128.0) * 0.5;
            }
            x[512] = 127.0;
            x[900] = -3.0 * scale * 10.0;
            out.push(x);
        }
        out
    }

    #[test]
    fn quantizers_equal_the_portable_code_bit_for_bit() {
        if !has_avx2_fma() {
            return;
        }
        for x in rows() {
            let (mut a, mut b) = (vec![0u8; 1024 / 32 * 34], vec![0u8; 1024 / 32 * 34]);
            legacy::quantize_q8_0(&x, &mut a);
            legacy::quantize_q8_0_portable(&x, &mut b);
            assert_eq!(a, b, "Q8_0");
            let (mut a, mut b) = (vec![0u8; 4 * 292], vec![0u8; 4 * 292]);
            kquants::quantize_q8_k(&x, &mut a);
            kquants::quantize_q8_k_portable(&x, &mut b);
            assert_eq!(a, b, "Q8_K");
        }
    }
}
