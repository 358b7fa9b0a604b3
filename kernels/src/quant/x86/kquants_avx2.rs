//! AVX2 dot products of Q2_K … Q6_K rows with Q8_K activations.
//!
//! The integer work follows llama.cpp's AVX2 kernels (`maddubs` of unsigned quants with signed activation
//! bytes, `madd` with the sub-block scales, the activation's `bsums` for minimums and offsets), and so
//! does the float work, per format as `quant::kquants` defines it (Q6_K fused into eight lanes, Q4_K
//! per super-block or per pair of sub-blocks as llama.cpp's repacked kernels, the others multiply then
//! add into eight lanes), so the result equals the portable code bit for bit.

use core::arch::x86_64::*;

use crate::quant::float::sum_lanes8;
use crate::quant::kquants::{tiled_step, KKind, Q8K_BYTES};

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

/// `vpshufb` masks spreading i16 number `c` of a 128-bit half over the whole half (mask `c`).
static SPLAT_I16: [[u8; 32]; 8] = {
    let mut m = [[0u8; 32]; 8];
    let mut i = 0;
    while i < 8 {
        let mut b = 0;
        while b < 32 {
            m[i][b] = (2 * i + b % 2) as u8;
            b += 1;
        }
        i += 1;
    }
    m
};

/// The scale lanes and min lanes of one Q4_K (`FIVE = false`) or Q5_K super-block.
///
/// The mins are applied as `madd(bsums, 1) · min` (no shuffle). Each sub-block scale is spread over a
/// vector with one `vpshufb`, as llama.cpp does; the masks come from a table the optimizer cannot see
/// into, because LLVM otherwise rewrites these splat shuffles as shift + broadcast (two shuffle µops,
/// and shuffles are the scarce resource here: about 10% slower).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sums_q45_k<const FIVE: bool>(x: *const u8, y: *const u8) -> (__m256i, __m256i) {
    sums_q45_k_with::<FIVE>(x, y, |_, _| {})
}

/// The eight 6-bit scales and eight 6-bit minimums of the Q4_K/Q5_K super-block at `xb` (bytes 4..16), as
/// eight bytes each (u64, little-endian), unpacked as ggml's `get_scale_min_k4` does for all eight at once.
///
/// # Safety
/// `xb` must be readable for 16 bytes.
#[inline(always)]
pub(super) unsafe fn q4k_scales_mins(xb: *const u8) -> (u64, u64) {
    const KMASK1: u32 = 0x3f3f3f3f;
    const KMASK2: u32 = 0x0f0f0f0f;
    const KMASK3: u32 = 0x03030303;
    let u = xb.add(4) as *const u32;
    let (u0, u1, u2) = (
        u.read_unaligned(),
        u.add(1).read_unaligned(),
        u.add(2).read_unaligned(),
    );
    let scales =
        (u0 & KMASK1) as u64 | (((u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4)) as u64) << 32;
    let mins =
        (u1 & KMASK1) as u64 | ((((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4)) as u64) << 32;
    (scales, mins)
}

/// [`sums_q45_k`], also handing `pair(j, v)` the scale lanes of the `j`-th pair of 32-value sub-blocks.
#[inline(always)]
unsafe fn sums_q45_k_with<const FIVE: bool>(
    x: *const u8,
    y: *const u8,
    mut pair: impl FnMut(usize, __m256i),
) -> (__m256i, __m256i) {
    let (scales, mins) = q4k_scales_mins(x);

    let sc16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(scales as i64));
    let sc = _mm256_set_m128i(sc16, sc16);
    let masks = core::hint::black_box(&SPLAT_I16);
    let bsums = _mm256_loadu_si256(y.add(260) as *const __m256i);
    let sums32 = _mm256_madd_epi16(bsums, _mm256_set1_epi16(1));
    let mprod = _mm256_mullo_epi32(sums32, _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mins as i64)));

    let m4 = _mm256_set1_epi8(0x0F);
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
        let p_lo = scaled_dot(
            lo,
            q8.add(64 * j),
            _mm256_shuffle_epi8(
                sc,
                _mm256_loadu_si256(masks[2 * j].as_ptr() as *const __m256i),
            ),
        );
        let p_hi = scaled_dot(
            hi,
            q8.add(64 * j + 32),
            _mm256_shuffle_epi8(
                sc,
                _mm256_loadu_si256(masks[2 * j + 1].as_ptr() as *const __m256i),
            ),
        );
        let p = _mm256_add_epi32(p_lo, p_hi);
        pair(j, p);
        sumi = _mm256_add_epi32(sumi, p);
    }
    (sumi, mprod)
}

/// `isum` of one Q6_K super-block (quants 0..63 against the activations, less 32·Σ scale·bsum).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sums_q6_k(x: *const u8, y: *const u8) -> (__m256i, __m256i) {
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
    (sumi, _mm256_setzero_si256())
}

/// `isum` of one Q3_K super-block: quants `low | high << 2` (0..7) against the activations, less
/// 4·Σ scale·bsum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sums_q3_k(x: *const u8, y: *const u8) -> (__m256i, __m256i) {
    const KMASK1: u32 = 0x03030303;
    const KMASK2: u32 = 0x0f0f0f0f;
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm256_set1_epi8(4);
    let u = x.add(96) as *const u32;
    let (a0, a1, a2) = (
        u.read_unaligned(),
        u.add(1).read_unaligned(),
        u.add(2).read_unaligned(),
    );
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
    (sumi, _mm256_setzero_si256())
}

/// `(isum, msum)` of one Q2_K super-block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sums_q2_k(x: *const u8, y: *const u8) -> (__m256i, __m256i) {
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm_set1_epi8(0x0F);
    let packed = _mm_loadu_si128(x as *const __m128i);
    let scales16 = _mm256_cvtepu8_epi16(_mm_and_si128(packed, m4));
    let mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(packed), m4));
    let bsums = _mm256_loadu_si256(y.add(260) as *const __m256i);
    let mprod = _mm256_madd_epi16(mins16, bsums);
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
    (sumi, mprod)
}

/// The f16 super-block scale at `p` and, when `MIN`, the min scale after it, as f32 (F16C; exact, the
/// same values as the portable conversion).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales_f16<const MIN: bool>(p: *const u8) -> (f32, f32) {
    let bits = if MIN {
        (p as *const i32).read_unaligned()
    } else {
        (p as *const u16).read_unaligned() as i32
    };
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// The integer vectors and the f16 scales of super-block `x` against `y`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn block<const K: u8>(
    x: *const u8,
    y: *const u8,
) -> (__m256i, __m256i, (f32, f32)) {
    let ((i, m), s) = match K {
        0 => (sums_q2_k(x, y), scales_f16::<true>(x.add(80))),
        1 => (sums_q3_k(x, y), scales_f16::<false>(x.add(108))),
        2 => (sums_q45_k::<false>(x, y), scales_f16::<true>(x)),
        3 => (sums_q45_k::<true>(x, y), scales_f16::<true>(x)),
        _ => (sums_q6_k(x, y), scales_f16::<false>(x.add(208))),
    };
    (i, m, s)
}

/// The eight 6-bit sub-block minimums (bytes of `mins`) each twice, as i16: `madd` with the activation's
/// sixteen `bsums` then gives lane `c` = `min_c · (bsum_2c + bsum_2c+1)`, the exact integers of
/// `madd(bsums, 1) · min_c` in one instruction instead of three.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn min_pairs(mins: u64) -> __m256i {
    let m = _mm_cvtsi64_si128(mins as i64);
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m))
}

/// The sum of the eight i32 lanes of `v` (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s));
    _mm_cvtsi128_si32(s)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_impl<const K: u8, const BB: usize, const MIN: bool>(
    nb: usize,
    x: *const u8,
    y: *const u8,
) -> f32 {
    if K == 2 {
        // Q4_K: llama.cpp's repacked gemv, one fused step per super-block on its integer totals.
        let (mut acc, mut acc_min) = (0f32, 0f32);
        for i in 0..nb {
            let (xb, yb) = (x.add(i * BB), y.add(i * Q8K_BYTES));
            let (lanes, min_lanes, (xd, xdmin)) = block::<K>(xb, yb);
            let yd = (yb as *const f32).read_unaligned();
            acc = (hsum_i32(lanes) as f32).mul_add(xd * yd, acc);
            acc_min = (hsum_i32(min_lanes) as f32).mul_add(xdmin * yd, acc_min);
        }
        return acc - acc_min;
    }
    let mut acc = _mm256_setzero_ps();
    let mut acc_min = _mm256_setzero_ps();
    for i in 0..nb {
        let (xb, yb) = (x.add(i * BB), y.add(i * Q8K_BYTES));
        let (lanes, min_lanes, (xd, xdmin)) = block::<K>(xb, yb);
        let yd = (yb as *const f32).read_unaligned();
        if K == 4 {
            // Q6_K: fused, as ggml_vec_dot_q6_K_q8_K.
            acc = _mm256_fmadd_ps(_mm256_set1_ps(yd * xd), _mm256_cvtepi32_ps(lanes), acc);
            continue;
        }
        acc = _mm256_add_ps(
            acc,
            _mm256_mul_ps(_mm256_set1_ps(yd * xd), _mm256_cvtepi32_ps(lanes)),
        );
        if MIN {
            let m = _mm256_mul_ps(_mm256_set1_ps(yd * xdmin), _mm256_cvtepi32_ps(min_lanes));
            acc_min = _mm256_add_ps(acc_min, m);
        }
    }
    let (mut a, mut m) = ([0f32; 8], [0f32; 8]);
    _mm256_storeu_ps(a.as_mut_ptr(), acc);
    _mm256_storeu_ps(m.as_mut_ptr(), acc_min);
    sum_lanes8(&a) - sum_lanes8(&m)
}

/// Dot product of `nb` super-blocks of `kind` at `x` with `nb` Q8_K blocks at `y`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x` must be readable for `nb` blocks of `kind` and `y` for `nb`
/// Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot(kind: KKind, nb: usize, x: *const u8, y: *const u8) -> f32 {
    match kind {
        KKind::Q2K => dot_impl::<0, 84, true>(nb, x, y),
        KKind::Q3K => dot_impl::<1, 110, false>(nb, x, y),
        KKind::Q4K => dot_impl::<2, 144, true>(nb, x, y),
        KKind::Q5K => dot_impl::<3, 176, true>(nb, x, y),
        KKind::Q6K => dot_impl::<4, 210, false>(nb, x, y),
    }
}

/// The dot product in the order of ggml's tiled K-quant matmul (`quant::kquants::tiled_step` per
/// super-block, on the integer totals of the lanes).
///
/// # Safety
/// As [`dot`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_tiled(kind: KKind, nb: usize, x: *const u8, y: *const u8) -> f32 {
    unsafe fn run<const K: u8, const BB: usize>(
        kind: KKind,
        nb: usize,
        x: *const u8,
        y: *const u8,
    ) -> f32 {
        let mut acc = 0f32;
        for i in 0..nb {
            let (xb, yb) = (x.add(i * BB), y.add(i * Q8K_BYTES));
            let (lanes, min_lanes, (xd, xdmin)) = block::<K>(xb, yb);
            let yd = (yb as *const f32).read_unaligned();
            acc = tiled_step(
                kind,
                hsum_i32(lanes),
                hsum_i32(min_lanes),
                xd,
                xdmin,
                yd,
                acc,
            );
        }
        acc
    }
    match kind {
        KKind::Q2K => run::<0, 84>(kind, nb, x, y),
        KKind::Q3K => run::<1, 110>(kind, nb, x, y),
        KKind::Q4K => run::<2, 144>(kind, nb, x, y),
        KKind::Q5K => run::<3, 176>(kind, nb, x, y),
        KKind::Q6K => run::<4, 210>(kind, nb, x, y),
    }
}

/// [`dot_tiled`] for Q6_K of one row `x` with four activation rows `ys`: each super-block's quants and
/// scales are unpacked once for the four, and their fused steps run side by side in one vector (lane
/// `k`: row `ys[k]`, `fma(xd · total, yd, acc)` on the same exact totals as alone).
///
/// # Safety
/// As [`dot`], for Q6_K, for each of the four activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q6k_dot_tiled_x4(nb: usize, x: *const u8, ys: [*const u8; 4]) -> [f32; 4] {
    let m3 = _mm256_set1_epi8(3);
    let m15 = _mm256_set1_epi8(15);
    let mut acc = _mm_setzero_ps();
    for i in 0..nb {
        let xb = x.add(i * 210);
        let (ql, qh) = (xb, xb.add(128));
        let (xd, _) = scales_f16::<false>(xb.add(208));
        let scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(xb.add(192) as *const __m128i));
        // The 256 quants (0..63) as eight vectors of 32 (c = 4j + k: values 128j + 32k ..), and each
        // one's 16-value scales as i16 pairs, as `sums_q6_k` forms them.
        let mut q = [_mm256_setzero_si256(); 8];
        let mut s = [_mm256_setzero_si256(); 8];
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
            q[4 * j] = _mm256_or_si256(_mm256_and_si256(bits1, m15), h0);
            q[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(bits2, m15), h1);
            q[4 * j + 2] =
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(bits1), m15), h2);
            q[4 * j + 3] =
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(bits2), m15), h3);
            for k in 0..4 {
                s[4 * j + k] = _mm256_shuffle_epi8(sc, pair_mask(k as i16));
            }
        }
        let mut sums = [_mm256_setzero_si256(); 4];
        let mut yd = [0f32; 4];
        for (k, &y) in ys.iter().enumerate() {
            let yb = y.add(i * Q8K_BYTES);
            let q8 = yb.add(4);
            let bsums = _mm256_loadu_si256(yb.add(260) as *const __m256i);
            let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, scales16));
            let mut sumi = _mm256_sub_epi32(_mm256_setzero_si256(), offset);
            for c in 0..8 {
                sumi = _mm256_add_epi32(sumi, scaled_dot(q[c], q8.add(32 * c), s[c]));
            }
            sums[k] = sumi;
            yd[k] = (yb as *const f32).read_unaligned();
        }
        // The four totals side by side (exact integer sums, so any grouping gives hsum_i32's value).
        let h = _mm256_hadd_epi32(
            _mm256_hadd_epi32(sums[0], sums[1]),
            _mm256_hadd_epi32(sums[2], sums[3]),
        );
        let totals = _mm_cvtepi32_ps(_mm_add_epi32(
            _mm256_castsi256_si128(h),
            _mm256_extracti128_si256::<1>(h),
        ));
        let r = _mm_mul_ps(_mm_set1_ps(xd), totals);
        acc = _mm_fmadd_ps(r, _mm_loadu_ps(yd.as_ptr()), acc);
    }
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), acc);
    out
}

/// The Q4_K dot product in llama.cpp's repacked gemm order: one fused step per pair of 32-value
/// sub-blocks, on its integer totals.
///
/// # Safety
/// As [`dot`], for Q4_K.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4k_dot_gemm4(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for i in 0..nb {
        let (xb, yb) = (x.add(i * 144), y.add(i * Q8K_BYTES));
        let (pairs, min_lanes) = q4k_pair_sums(xb, yb);
        let (xd, xdmin) = scales_f16::<true>(xb);
        let yd = (yb as *const f32).read_unaligned();
        let mut m = [0i32; 8];
        _mm256_storeu_si256(m.as_mut_ptr() as *mut __m256i, min_lanes);
        for (p, &t) in pairs.iter().enumerate() {
            acc = (t as f32).mul_add(xd * yd, acc);
            acc_min = ((m[2 * p] + m[2 * p + 1]) as f32).mul_add(xdmin * yd, acc_min);
        }
    }
    acc - acc_min
}

/// [`q4k_dot_gemm4`] of one row `x` with four activation rows `ys`: the weights of each super-block are
/// unpacked once for the four, and their fused steps interleave in one vector (lane `k`: row `ys[k]`,
/// the same operations as alone).
///
/// # Safety
/// As [`q4k_dot_gemm4`], for each of the four activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4k_dot_gemm4_x4(nb: usize, x: *const u8, ys: [*const u8; 4]) -> [f32; 4] {
    q4k_dot_gemm4_groups::<1>(nb, x, [ys])[0]
}

/// [`q4k_dot_gemm4_x4`] for eight activation rows (two groups of four), each super-block unpacked once
/// for the eight.
///
/// # Safety
/// As [`q4k_dot_gemm4`], for each of the eight activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4k_dot_gemm4_x8(nb: usize, x: *const u8, ys: [*const u8; 8]) -> [f32; 8] {
    join_fours(q4k_dot_gemm4_groups::<2>(nb, x, fours(ys)))
}

/// Eight activation rows as two groups of four (the `G = 2` form of the group kernels).
#[inline(always)]
fn fours(ys: [*const u8; 8]) -> [[*const u8; 4]; 2] {
    [[ys[0], ys[1], ys[2], ys[3]], [ys[4], ys[5], ys[6], ys[7]]]
}

/// Two groups' four results as the eight, in order.
#[inline(always)]
fn join_fours([a, b]: [[f32; 4]; 2]) -> [f32; 8] {
    [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
}

/// [`q4k_dot_gemm4_x4`] for `G` groups of four activation rows, the super-block unpacked once for all.
#[inline(always)]
unsafe fn q4k_dot_gemm4_groups<const G: usize>(
    nb: usize,
    x: *const u8,
    ys: [[*const u8; 4]; G],
) -> [[f32; 4]; G] {
    let mut acc = [_mm_setzero_ps(); G];
    let mut acc_min = [_mm_setzero_ps(); G];
    let masks = core::hint::black_box(&SPLAT_I16);
    for i in 0..nb {
        let xb = x.add(i * 144);
        let (xd, xdmin) = scales_f16::<true>(xb);
        let (q, s, mins16) = q4k_unpack(xb, masks);
        for (g, ys) in ys.iter().enumerate() {
            // Per activation row k: the lanes of the four 64-value pairs (p[k][j]) and of the minimums.
            let mut p = [[_mm256_setzero_si256(); 4]; 4];
            let mut mprod = [_mm256_setzero_si256(); 4];
            let mut yd = [0f32; 4];
            for (k, &y) in ys.iter().enumerate() {
                let yb = y.add(i * Q8K_BYTES);
                let q8 = yb.add(4);
                for (j, pj) in p[k].iter_mut().enumerate() {
                    *pj = _mm256_add_epi32(
                        scaled_dot(q[2 * j], q8.add(64 * j), s[2 * j]),
                        scaled_dot(q[2 * j + 1], q8.add(64 * j + 32), s[2 * j + 1]),
                    );
                }
                let bsums = _mm256_loadu_si256(yb.add(260) as *const __m256i);
                mprod[k] = _mm256_madd_epi16(bsums, mins16);
                yd[k] = (yb as *const f32).read_unaligned();
            }
            // Pair j's totals of the four rows side by side (lane k: row k; exact integer sums, so any
            // grouping gives the same totals): pairwise adds down to one vector per half, then the halves.
            let pair_totals = |j: usize| {
                let h = _mm256_hadd_epi32(
                    _mm256_hadd_epi32(p[0][j], p[1][j]),
                    _mm256_hadd_epi32(p[2][j], p[3][j]),
                );
                _mm_cvtepi32_ps(_mm_add_epi32(
                    _mm256_castsi256_si128(h),
                    _mm256_extracti128_si256::<1>(h),
                ))
            };
            // The minimum totals per pair: lane c of mprod is sub-block c, so one round of pairwise adds
            // gives [k0: pairs 0 1, k1: pairs 0 1 | k0: pairs 2 3, k1: pairs 2 3] (rows 2, 3 likewise),
            // and two shuffles put the four rows of pairs 0 (2) and 1 (3) side by side.
            let (h01, h23) = (
                _mm256_castsi256_ps(_mm256_hadd_epi32(mprod[0], mprod[1])),
                _mm256_castsi256_ps(_mm256_hadd_epi32(mprod[2], mprod[3])),
            );
            let m02 = _mm256_cvtepi32_ps(_mm256_castps_si256(_mm256_shuffle_ps(
                h01,
                h23,
                0b10_00_10_00,
            )));
            let m13 = _mm256_cvtepi32_ps(_mm256_castps_si256(_mm256_shuffle_ps(
                h01,
                h23,
                0b11_01_11_01,
            )));
            let mins = [
                _mm256_castps256_ps128(m02),
                _mm256_castps256_ps128(m13),
                _mm256_extractf128_ps::<1>(m02),
                _mm256_extractf128_ps::<1>(m13),
            ];
            let ydv = _mm_loadu_ps(yd.as_ptr());
            let (d, dmin) = (
                _mm_mul_ps(_mm_set1_ps(xd), ydv),
                _mm_mul_ps(_mm_set1_ps(xdmin), ydv),
            );
            for (j, &m) in mins.iter().enumerate() {
                acc[g] = _mm_fmadd_ps(pair_totals(j), d, acc[g]);
                acc_min[g] = _mm_fmadd_ps(m, dmin, acc_min[g]);
            }
        }
    }
    std::array::from_fn(|g| {
        let mut out = [0f32; 4];
        _mm_storeu_ps(out.as_mut_ptr(), _mm_sub_ps(acc[g], acc_min[g]));
        out
    })
}

/// One Q4_K super-block's weights unpacked for several activation rows: the quants of sub-block
/// `c = 2j + h` (low nibbles for h = 0, high for h = 1), each sub-block's scale spread over 16 i16
/// lanes, and the minimums each twice as i16 ([`min_pairs`]). `masks` is [`SPLAT_I16`] behind
/// `black_box` (see [`sums_q45_k`]).
#[inline(always)]
unsafe fn q4k_unpack(
    xb: *const u8,
    masks: &[[u8; 32]; 8],
) -> ([__m256i; 8], [__m256i; 8], __m256i) {
    let (scales, mins) = q4k_scales_mins(xb);
    let sc16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(scales as i64));
    let sc = _mm256_set_m128i(sc16, sc16);
    let m4 = _mm256_set1_epi8(0x0F);
    let mut q = [_mm256_setzero_si256(); 8];
    let mut s = [_mm256_setzero_si256(); 8];
    for j in 0..4 {
        let bits = _mm256_loadu_si256(xb.add(16 + 32 * j) as *const __m256i);
        q[2 * j] = _mm256_and_si256(bits, m4);
        q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
    }
    for (c, sc_c) in s.iter_mut().enumerate() {
        *sc_c = _mm256_shuffle_epi8(sc, _mm256_loadu_si256(masks[c].as_ptr() as *const __m256i));
    }
    (q, s, min_pairs(mins))
}

/// The integer totals of the four 64-value pairs of sub-blocks of one Q4_K super-block, and its min
/// lanes (lane `c`: sub-block `c`'s `min · bsum`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_pair_sums(x: *const u8, y: *const u8) -> ([i32; 4], __m256i) {
    let mut p = [_mm256_setzero_si256(); 4];
    let (_, mins) = sums_q45_k_with::<false>(x, y, |j, v| p[j] = v);
    // Horizontal totals of the four vectors at once: pairwise adds, then the two halves.
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    let t = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
    let mut pairs = [0i32; 4];
    _mm_storeu_si128(pairs.as_mut_ptr() as *mut __m128i, t);
    (pairs, mins)
}

/// [`dot`] for Q4_K (llama.cpp's repacked gemv order: one fused step per super-block on its integer
/// totals) of one row `x` with four activation rows `ys`: each super-block's weights are unpacked once for
/// the four, and their fused steps run side by side in one vector (lane `k`: row `ys[k]`, the same
/// operations on the same exact totals as alone).
///
/// # Safety
/// As [`dot`], for Q4_K, for each of the four activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4k_dot_x4(nb: usize, x: *const u8, ys: [*const u8; 4]) -> [f32; 4] {
    q4k_dot_groups::<1>(nb, x, [ys])[0]
}

/// [`q4k_dot_x4`] for eight activation rows (two groups of four), each super-block unpacked once for
/// the eight.
///
/// # Safety
/// As [`dot`], for Q4_K, for each of the eight activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4k_dot_x8(nb: usize, x: *const u8, ys: [*const u8; 8]) -> [f32; 8] {
    join_fours(q4k_dot_groups::<2>(nb, x, fours(ys)))
}

/// [`q4k_dot_x4`] for `G` groups of four activation rows, the super-block unpacked once for all.
#[inline(always)]
unsafe fn q4k_dot_groups<const G: usize>(
    nb: usize,
    x: *const u8,
    ys: [[*const u8; 4]; G],
) -> [[f32; 4]; G] {
    let mut acc = [_mm_setzero_ps(); G];
    let mut acc_min = [_mm_setzero_ps(); G];
    let masks = core::hint::black_box(&SPLAT_I16);
    for i in 0..nb {
        let xb = x.add(i * 144);
        let (xd, xdmin) = scales_f16::<true>(xb);
        let (q, s, mins16) = q4k_unpack(xb, masks);
        for (g, ys) in ys.iter().enumerate() {
            // Per activation row: the integer lanes of the whole super-block and of its minimums.
            let mut sums = [_mm256_setzero_si256(); 4];
            let mut mprods = [_mm256_setzero_si256(); 4];
            let mut yd = [0f32; 4];
            for (k, &y) in ys.iter().enumerate() {
                let yb = y.add(i * Q8K_BYTES);
                let q8 = yb.add(4);
                let mut sumi = _mm256_setzero_si256();
                for c in 0..8 {
                    sumi = _mm256_add_epi32(sumi, scaled_dot(q[c], q8.add(32 * c), s[c]));
                }
                sums[k] = sumi;
                let bsums = _mm256_loadu_si256(yb.add(260) as *const __m256i);
                mprods[k] = _mm256_madd_epi16(bsums, mins16);
                yd[k] = (yb as *const f32).read_unaligned();
            }
            // The four totals side by side (exact integer sums: any grouping gives hsum_i32's value).
            let totals = |v: [__m256i; 4]| {
                let h =
                    _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
                _mm_cvtepi32_ps(_mm_add_epi32(
                    _mm256_castsi256_si128(h),
                    _mm256_extracti128_si256::<1>(h),
                ))
            };
            let ydv = _mm_loadu_ps(yd.as_ptr());
            acc[g] = _mm_fmadd_ps(totals(sums), _mm_mul_ps(_mm_set1_ps(xd), ydv), acc[g]);
            acc_min[g] = _mm_fmadd_ps(
                totals(mprods),
                _mm_mul_ps(_mm_set1_ps(xdmin), ydv),
                acc_min[g],
            );
        }
    }
    std::array::from_fn(|g| {
        let mut out = [0f32; 4];
        _mm_storeu_ps(out.as_mut_ptr(), _mm_sub_ps(acc[g], acc_min[g]));
        out
    })
}

/// The integer lanes of one Q4_K super-block `xb` against the activation bytes `q8`, and its minimum
/// lanes against the activation's `bsums` (lane `c`: `min_c · (bsum_2c + bsum_2c+1)`).
#[inline(always)]
unsafe fn q4k_row_lanes(xb: *const u8, q8: *const u8, bsums: __m256i) -> (__m256i, __m256i) {
    let (scales, mins) = q4k_scales_mins(xb);
    let mprod = _mm256_madd_epi16(bsums, min_pairs(mins));
    // Each sub-block's scale as 16 i16 lanes: the scales twice (both halves), then one shuffle each.
    let sc16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(scales as i64));
    let sc = _mm256_set_m128i(sc16, sc16);
    // The masks from a table the optimizer cannot see into, as in `sums_q45_k`.
    let masks = core::hint::black_box(&SPLAT_I16);
    let splat =
        |c: usize| _mm256_shuffle_epi8(sc, _mm256_loadu_si256(masks[c].as_ptr() as *const __m256i));
    let m4 = _mm256_set1_epi8(0x0F);
    let mut sumi = _mm256_setzero_si256();
    for j in 0..4 {
        let bits = _mm256_loadu_si256(xb.add(16 + 32 * j) as *const __m256i);
        let lo = _mm256_and_si256(bits, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
        let p_lo = scaled_dot(lo, q8.add(64 * j), splat(2 * j));
        let p_hi = scaled_dot(hi, q8.add(64 * j + 32), splat(2 * j + 1));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p_lo, p_hi));
    }
    (sumi, mprod)
}

/// [`dot`] for Q4_K (the repacked gemv order) of four weight rows `xs` with one activation row `y`, as
/// llama.cpp's gemv runs its interleaved rows side by side: per super-block, each row's integer lanes and
/// minimum lanes, their eight totals in one vector (lanes 0..4: the rows' totals, 4..8: their minimum
/// totals; exact integer sums, so any grouping gives `hsum_i32`'s value), then one fused step for all of
/// them (lane `r` < 4: `fma(total, xd_r·yd, acc_r)`, lane `4 + r`: the same with `xdmin_r`), which is each
/// row's own sequence of float operations alone.
///
/// # Safety
/// As [`dot`], for Q4_K, for each of the four weight rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4k_rows_x4(nb: usize, xs: [*const u8; 4], y: *const u8) -> [f32; 4] {
    // The f16 pairs (d, dmin) of the four rows, read as four u32, to [d0 d1 d2 d3 dmin0 .. dmin3].
    let scale_order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    let mut acc = _mm256_setzero_ps();
    let [x0, x1, x2, x3] = xs;
    for i in 0..nb {
        let yb = y.add(i * Q8K_BYTES);
        let q8 = yb.add(4);
        let bsums = _mm256_loadu_si256(yb.add(260) as *const __m256i);
        let yd = (yb as *const f32).read_unaligned();
        let (b0, b1, b2, b3) = (
            x0.add(i * 144),
            x1.add(i * 144),
            x2.add(i * 144),
            x3.add(i * 144),
        );
        // The next four rows (where rows are consecutive, as in a matrix×vector product): short rows
        // end before the hardware prefetchers ramp up on four interleaved streams, so fetch them a group
        // ahead, 576 bytes (nine cache lines) per super-block. Prefetching never faults.
        let ahead = x3.wrapping_add(nb * 144 + i * 576);
        for line in 0..9 {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line) as *const i8);
        }
        let (s0, m0) = q4k_row_lanes(b0, q8, bsums);
        let (s1, m1) = q4k_row_lanes(b1, q8, bsums);
        let (s2, m2) = q4k_row_lanes(b2, q8, bsums);
        let (s3, m3) = q4k_row_lanes(b3, q8, bsums);
        // [s0 s1 s2 s3 | s0' s1' s2' s3'] (halves' totals), the same for the minimums, then both halves.
        let hs = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
        let hm = _mm256_hadd_epi32(_mm256_hadd_epi32(m0, m1), _mm256_hadd_epi32(m2, m3));
        let totals = _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(hs, hm),
            _mm256_permute2x128_si256::<0x31>(hs, hm),
        );
        let dpairs = _mm_setr_epi32(
            (b0 as *const i32).read_unaligned(),
            (b1 as *const i32).read_unaligned(),
            (b2 as *const i32).read_unaligned(),
            (b3 as *const i32).read_unaligned(),
        );
        let d16 = _mm_shuffle_epi8(dpairs, scale_order);
        let scales = _mm256_mul_ps(_mm256_cvtph_ps(d16), _mm256_set1_ps(yd));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals), scales, acc);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    [
        lanes[0] - lanes[4],
        lanes[1] - lanes[5],
        lanes[2] - lanes[6],
        lanes[3] - lanes[7],
    ]
}
