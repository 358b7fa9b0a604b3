//! AVX2 dot products of Q2_K … Q6_K rows with Q8_K activations.
//!
//! The integer work follows llama.cpp's AVX2 kernels (`maddubs` of unsigned quants with signed activation
//! bytes, `madd` with the sub-block scales, the activation's `bsums` for minimums and offsets); per
//! super-block the exact integers are reduced to scalars and passed to `kquants::combine`, the same float
//! arithmetic as the portable code, so the results are bit-identical.

use core::arch::x86_64::*;

use crate::quant::kquants::{block_scales, combine, q8k_d, KKind, Q8K_BYTES};

/// Sum of the eight i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i32(a: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// Sum of the four i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i32_128(s: __m128i) -> i32 {
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// A shuffle mask broadcasting i16 number `i` of each 128-bit half to the whole half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn broadcast_i16_mask(i: i16) -> __m256i {
    _mm256_set1_epi16(((2 * i + 1) << 8) | (2 * i))
}

/// A shuffle mask taking i16 number `2k` of a half into the whole low half and `2k + 1` into the high half
/// (for vectors whose two halves hold the same eight scales: scales of 16-value groups).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pair_mask(k: i16) -> __m256i {
    let lo = ((4 * k + 1) << 8) | (4 * k);
    let hi = ((4 * k + 3) << 8) | (4 * k + 2);
    _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
}

/// `Σ scale·Σ q·q8` for 32 unsigned quants `q` (below 64) against the activation bytes at `q8`, with 16
/// i16 `scales` matching the 16 pairs `maddubs` produces.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scaled_dot(q: __m256i, q8: *const u8, scales: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(q, _mm256_loadu_si256(q8 as *const __m256i));
    _mm256_madd_epi16(scales, p)
}

/// The 8 scales then 8 mins of Q4_K/Q5_K (12 packed bytes at `p`) as 16 i16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales_mins_k4(p: *const u8) -> __m256i {
    const KMASK1: u32 = 0x3f3f3f3f;
    const KMASK2: u32 = 0x0f0f0f0f;
    const KMASK3: u32 = 0x03030303;
    let u = p as *const u32;
    let (u0, u1, u2) = (u.read_unaligned(), u.add(1).read_unaligned(), u.add(2).read_unaligned());
    let m3 = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let m2 = u1 & KMASK1;
    let s1 = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let s0 = u0 & KMASK1;
    _mm256_cvtepu8_epi16(_mm_set_epi32(m3 as i32, m2 as i32, s1 as i32, s0 as i32))
}

/// `Σ min·bsum` of Q4_K/Q5_K: mins (the high half of `scales_mins`) against sums of 32 activations.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mins_dot_k4(scales_mins: __m256i, y: *const u8) -> i32 {
    let bsums = _mm256_loadu_si256(y.add(260) as *const __m256i);
    let sums32 = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256::<1>(bsums));
    hsum_i32_128(_mm_madd_epi16(_mm256_extracti128_si256::<1>(scales_mins), sums32))
}

/// `(isum, msum)` of one Q4_K (`FIVE = false`) or Q5_K super-block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sums_q45_k<const FIVE: bool>(x: *const u8, y: *const u8) -> (i32, i32) {
    let m4 = _mm256_set1_epi8(0x0F);
    let scales_mins = scales_mins_k4(x.add(4));
    let msum = mins_dot_k4(scales_mins, y);
    let sc = _mm256_permute2x128_si256::<0x00>(scales_mins, scales_mins);
    let (qs, q8) = (x.add(if FIVE { 48 } else { 16 }), y.add(4));
    let mut hb = _mm256_loadu_si256(x.add(16) as *const __m256i);
    let mut sumi = _mm256_setzero_si256();
    for j in 0..4 {
        let bits = _mm256_loadu_si256(qs.add(32 * j) as *const __m256i);
        let mut lo = _mm256_and_si256(bits, m4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
        if FIVE {
            // Bit 2j (then 2j + 1) of each qh byte, moved to bit 4.
            let m16 = _mm256_set1_epi8(0x10);
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16::<4>(hb), m16));
            hb = _mm256_srli_epi16::<1>(hb);
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16::<4>(hb), m16));
            hb = _mm256_srli_epi16::<1>(hb);
        }
        let s_lo = _mm256_shuffle_epi8(sc, broadcast_i16_mask(2 * j as i16));
        let s_hi = _mm256_shuffle_epi8(sc, broadcast_i16_mask(2 * j as i16 + 1));
        let p_lo = scaled_dot(lo, q8.add(64 * j), s_lo);
        let p_hi = scaled_dot(hi, q8.add(64 * j + 32), s_hi);
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p_lo, p_hi));
    }
    (hsum_i32(sumi), msum)
}

/// `isum` of one Q6_K super-block (quants 0..63 against the activations, less 32·Σ scale·bsum).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sums_q6_k(x: *const u8, y: *const u8) -> (i32, i32) {
    let m3 = _mm256_set1_epi8(3);
    let m15 = _mm256_set1_epi8(15);
    let (ql, qh, q8) = (x, x.add(128), y.add(4));
    let scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(x.add(192) as *const __m128i));
    let bsums = _mm256_loadu_si256(y.add(260) as *const __m256i);
    let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, scales16));
    let mut sumi = _mm256_sub_epi32(_mm256_setzero_si256(), offset);
    for j in 0..2 {
        let sc = if j == 0 {
            _mm256_permute2x128_si256::<0x00>(scales16, scales16)
        } else {
            _mm256_permute2x128_si256::<0x11>(scales16, scales16)
        };
        let bits1 = _mm256_loadu_si256(ql.add(64 * j) as *const __m256i);
        let bits2 = _mm256_loadu_si256(ql.add(64 * j + 32) as *const __m256i);
        let h = _mm256_loadu_si256(qh.add(32 * j) as *const __m256i);
        let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(h, m3));
        let h1 = _mm256_slli_epi16::<2>(_mm256_and_si256(h, _mm256_set1_epi8(12)));
        let h2 = _mm256_and_si256(h, _mm256_set1_epi8(48));
        let h3 = _mm256_srli_epi16::<2>(_mm256_and_si256(h, _mm256_set1_epi8(-64)));
        let q = [
            _mm256_or_si256(_mm256_and_si256(bits1, m15), h0),
            _mm256_or_si256(_mm256_and_si256(bits2, m15), h1),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(bits1), m15), h2),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(bits2), m15), h3),
        ];
        for (k, &qk) in q.iter().enumerate() {
            let s = _mm256_shuffle_epi8(sc, pair_mask(k as i16));
            sumi = _mm256_add_epi32(sumi, scaled_dot(qk, q8.add(128 * j + 32 * k), s));
        }
    }
    (hsum_i32(sumi), 0)
}

/// `isum` of one Q3_K super-block: quants `low | high << 2` (0..7) against the activations, less
/// 4·Σ scale·bsum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sums_q3_k(x: *const u8, y: *const u8) -> (i32, i32) {
    const KMASK1: u32 = 0x03030303;
    const KMASK2: u32 = 0x0f0f0f0f;
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm256_set1_epi8(4);
    let u = x.add(96) as *const u32;
    let (a0, a1, a2) = (u.read_unaligned(), u.add(1).read_unaligned(), u.add(2).read_unaligned());
    let scales8 = _mm_set_epi32(
        (((a1 >> 4) & KMASK2) | (((a2 >> 6) & KMASK1) << 4)) as i32,
        (((a0 >> 4) & KMASK2) | (((a2 >> 4) & KMASK1) << 4)) as i32,
        ((a1 & KMASK2) | (((a2 >> 2) & KMASK1) << 4)) as i32,
        ((a0 & KMASK2) | ((a2 & KMASK1) << 4)) as i32,
    );
    let scales16 = _mm256_cvtepi8_epi16(_mm_sub_epi8(scales8, _mm_set1_epi8(32)));
    let bsums = _mm256_loadu_si256(y.add(260) as *const __m256i);
    let offset = _mm256_slli_epi32::<2>(_mm256_madd_epi16(bsums, scales16));
    let mut sumi = _mm256_sub_epi32(_mm256_setzero_si256(), offset);
    let mut hb = _mm256_loadu_si256(x as *const __m256i);
    let q8 = y.add(4);
    for j in 0..2 {
        let sc = if j == 0 {
            _mm256_permute2x128_si256::<0x00>(scales16, scales16)
        } else {
            _mm256_permute2x128_si256::<0x11>(scales16, scales16)
        };
        let bits = _mm256_loadu_si256(x.add(32 + 32 * j) as *const __m256i);
        let low = [
            _mm256_and_si256(bits, m3),
            _mm256_and_si256(_mm256_srli_epi16::<2>(bits), m3),
            _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m3),
            _mm256_and_si256(_mm256_srli_epi16::<6>(bits), m3),
        ];
        for (k, &lk) in low.iter().enumerate() {
            // Bit 4j + k of each hmask byte, moved to bit 2.
            let q = _mm256_or_si256(lk, _mm256_and_si256(_mm256_slli_epi16::<2>(hb), m4));
            hb = _mm256_srli_epi16::<1>(hb);
            let s = _mm256_shuffle_epi8(sc, pair_mask(k as i16));
            sumi = _mm256_add_epi32(sumi, scaled_dot(q, q8.add(128 * j + 32 * k), s));
        }
    }
    (hsum_i32(sumi), 0)
}

/// `(isum, msum)` of one Q2_K super-block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sums_q2_k(x: *const u8, y: *const u8) -> (i32, i32) {
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm_set1_epi8(0x0F);
    let packed = _mm_loadu_si128(x as *const __m128i);
    let scales16 = _mm256_cvtepu8_epi16(_mm_and_si128(packed, m4));
    let mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(packed), m4));
    let bsums = _mm256_loadu_si256(y.add(260) as *const __m256i);
    let msum = hsum_i32(_mm256_madd_epi16(mins16, bsums));
    let q8 = y.add(4);
    let mut sumi = _mm256_setzero_si256();
    for j in 0..2 {
        let sc = if j == 0 {
            _mm256_permute2x128_si256::<0x00>(scales16, scales16)
        } else {
            _mm256_permute2x128_si256::<0x11>(scales16, scales16)
        };
        let bits = _mm256_loadu_si256(x.add(16 + 32 * j) as *const __m256i);
        let q = [
            _mm256_and_si256(bits, m3),
            _mm256_and_si256(_mm256_srli_epi16::<2>(bits), m3),
            _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m3),
            _mm256_and_si256(_mm256_srli_epi16::<6>(bits), m3),
        ];
        for (k, &qk) in q.iter().enumerate() {
            let s = _mm256_shuffle_epi8(sc, pair_mask(k as i16));
            sumi = _mm256_add_epi32(sumi, scaled_dot(qk, q8.add(128 * j + 32 * k), s));
        }
    }
    (hsum_i32(sumi), msum)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_impl<const K: u8, const BB: usize>(kind: KKind, nb: usize, x: *const u8, y: *const u8) -> f32 {
    let mut acc = 0f32;
    for i in 0..nb {
        let (xb, yb) = (x.add(i * BB), y.add(i * Q8K_BYTES));
        let (isum, msum) = match K {
            0 => sums_q2_k(xb, yb),
            1 => sums_q3_k(xb, yb),
            2 => sums_q45_k::<false>(xb, yb),
            3 => sums_q45_k::<true>(xb, yb),
            _ => sums_q6_k(xb, yb),
        };
        // SAFETY: the caller guarantees `BB` readable bytes at `xb` and `Q8K_BYTES` at `yb`.
        let (xs, ys) = unsafe { (core::slice::from_raw_parts(xb, BB), core::slice::from_raw_parts(yb, Q8K_BYTES)) };
        let (xd, xdmin) = block_scales(kind, xs);
        acc = combine(acc, q8k_d(ys), xd, xdmin, isum, msum);
    }
    acc
}

/// Dot product of `nb` super-blocks of `kind` at `x` with `nb` Q8_K blocks at `y`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x` must be readable for `nb` blocks of `kind` and `y` for `nb`
/// Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot(kind: KKind, nb: usize, x: *const u8, y: *const u8) -> f32 {
    match kind {
        KKind::Q2K => dot_impl::<0, 84>(kind, nb, x, y),
        KKind::Q3K => dot_impl::<1, 110>(kind, nb, x, y),
        KKind::Q4K => dot_impl::<2, 144>(kind, nb, x, y),
        KKind::Q5K => dot_impl::<3, 176>(kind, nb, x, y),
        KKind::Q6K => dot_impl::<4, 210>(kind, nb, x, y),
    }
}
