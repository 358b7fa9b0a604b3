//! AVX2 dot products of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 rows with Q8_0/Q8_1 activations.
//!
//! Eight blocks at a time: each block's exact integer sum is computed with `maddubs` (llama.cpp's
//! approach), the eight sums are gathered into one vector by a horizontal-add transpose, and the eight
//! contributions `(dx·dy)·sum [+ m·s]` are added to eight lanes, block `b` to lane `b % 8`: the order
//! `quant::legacy` defines, so the result equals the portable code bit for bit.

use core::arch::x86_64::*;

use crate::quant::legacy::LegacyKind;

/// `Σ x·y` of signed bytes, as eight i32 sums of four neighbours (llama.cpp's sign trick: `|x|` is
/// unsigned for `maddubs`, the sign moves to `y`; exact because `y` is never −128).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256i {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
}

/// `Σ x·y` of unsigned `x` (below 32) and signed `y`, as eight i32 sums of four neighbours.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul_sum_u8_i8(x: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
}

/// The 32 nibbles at `p` (16 bytes) as bytes: low nibbles first, then high nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let t = _mm_loadu_si128(p as *const __m128i);
    let both = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// The 32 bits at `p` spread to 32 bytes: 0xFF where the bit is set, 0 elsewhere.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bits_to_bytes(p: *const u8) -> __m256i {
    let bits = (p as *const i32).read_unaligned();
    let shuf = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// Eight i32 partial sums (of four products each) of one block's `Σ qx·qy`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_sums<const K: u8>(x: *const u8, y: *const u8) -> __m256i {
    match K {
        // Q4_0: nibbles − 8, against Q8_0.
        0 => {
            let qx = _mm256_sub_epi8(nibbles(x.add(2)), _mm256_set1_epi8(8));
            mul_sum_i8(qx, _mm256_loadu_si256(y.add(2) as *const __m256i))
        }
        // Q4_1: nibbles, against Q8_1.
        1 => mul_sum_u8_i8(
            nibbles(x.add(4)),
            _mm256_loadu_si256(y.add(4) as *const __m256i),
        ),
        // Q5_0: nibbles | 0xF0 where the fifth bit is clear (that is, q − 16 as a signed byte).
        2 => {
            let high = _mm256_andnot_si256(bits_to_bytes(x.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
            let qx = _mm256_or_si256(nibbles(x.add(6)), high);
            mul_sum_i8(qx, _mm256_loadu_si256(y.add(2) as *const __m256i))
        }
        // Q5_1: nibbles | 0x10 where the fifth bit is set.
        3 => {
            let high = _mm256_and_si256(bits_to_bytes(x.add(4)), _mm256_set1_epi8(0x10));
            let qx = _mm256_or_si256(nibbles(x.add(8)), high);
            mul_sum_u8_i8(qx, _mm256_loadu_si256(y.add(4) as *const __m256i))
        }
        // Q8_0 against Q8_0.
        _ => mul_sum_i8(
            _mm256_loadu_si256(x.add(2) as *const __m256i),
            _mm256_loadu_si256(y.add(2) as *const __m256i),
        ),
    }
}

/// Eight vectors of partial sums to one vector of their totals (lane `k` = total of `p[k]`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose_sum(p: [__m256i; 8]) -> __m256i {
    let h01 = _mm256_hadd_epi32(p[0], p[1]);
    let h23 = _mm256_hadd_epi32(p[2], p[3]);
    let h45 = _mm256_hadd_epi32(p[4], p[5]);
    let h67 = _mm256_hadd_epi32(p[6], p[7]);
    // Per 128-bit half: [p0, p1, p2, p3] partial totals (low half: elements 0..16, high: 16..32).
    let h0123 = _mm256_hadd_epi32(h01, h23);
    let h4567 = _mm256_hadd_epi32(h45, h67);
    let lo = _mm256_permute2x128_si256(h0123, h4567, 0x20);
    let hi = _mm256_permute2x128_si256(h0123, h4567, 0x31);
    _mm256_add_epi32(lo, hi)
}

/// The f16 at `p + k·stride` for k = 0..8, as f32 (exact, as the portable conversion).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x8(p: *const u8, stride: usize) -> __m256 {
    let h = |k: usize| (p.add(k * stride) as *const i16).read_unaligned();
    _mm256_cvtph_ps(_mm_set_epi16(
        h(7),
        h(6),
        h(5),
        h(4),
        h(3),
        h(2),
        h(1),
        h(0),
    ))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_groups_impl<const K: u8, const XB: usize, const YB: usize, const MIN: bool>(
    groups: usize,
    mut x: *const u8,
    mut y: *const u8,
) -> [f32; 8] {
    let mut acc = _mm256_setzero_ps();
    for _ in 0..groups {
        let mut p = [_mm256_setzero_si256(); 8];
        for (k, pk) in p.iter_mut().enumerate() {
            *pk = block_sums::<K>(x.add(k * XB), y.add(k * YB));
        }
        let sums = _mm256_cvtepi32_ps(transpose_sum(p));
        let scale = _mm256_mul_ps(f16x8(x, XB), f16x8(y, YB));
        let mut c = _mm256_mul_ps(scale, sums);
        if MIN {
            c = _mm256_add_ps(c, _mm256_mul_ps(f16x8(x.add(2), XB), f16x8(y.add(2), YB)));
        }
        acc = _mm256_add_ps(acc, c);
        x = x.add(8 * XB);
        y = y.add(8 * YB);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    lanes
}

/// The eight lanes after the first `8·groups` blocks of a row `x` with activations `y`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x` must be readable for `8·groups` blocks of `kind` and `y`
/// for as many activation blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_groups(
    kind: LegacyKind,
    groups: usize,
    x: *const u8,
    y: *const u8,
) -> [f32; 8] {
    match kind {
        LegacyKind::Q4_0 => dot_groups_impl::<0, 18, 34, false>(groups, x, y),
        LegacyKind::Q4_1 => dot_groups_impl::<1, 20, 36, true>(groups, x, y),
        LegacyKind::Q5_0 => dot_groups_impl::<2, 22, 34, false>(groups, x, y),
        LegacyKind::Q5_1 => dot_groups_impl::<3, 24, 36, true>(groups, x, y),
        LegacyKind::Q8_0 => dot_groups_impl::<4, 34, 34, false>(groups, x, y),
    }
}
