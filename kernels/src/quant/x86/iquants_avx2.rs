//! AVX2/FMA dot products of the IQ formats (with Q8_K or Q8_0 activations) and of MXFP4 (with Q8_0), after
//! llama.cpp's `ggml-cpu/arch/x86/quants.c`.
//!
//! Every function here is compiled for AVX2, FMA and F16C and may only be called once the CPU is known to
//! have them (`quant::has_avx2_fma`); that is their one safety condition. Memory is reached through
//! slices: blocks come from `chunks_exact` as fixed-size arrays and every vector load goes through
//! [`load128`]/[`load256`], which slice (and so bounds-check) the bytes they read. The integer sums are
//! exactly the portable code's; only the order of the f32 accumulation differs.

use std::arch::x86_64::*;

use crate::quant::iquants::tables::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
    KVALUES_IQ4NL,
};
use crate::quant::mxfp4::KVALUES_MXFP4;

/// Values per super-block.
const QK_K: usize = 256;
/// Bytes of a Q8_K activation block (f32 d, 256 × i8, 16 × i16 sums).
const Q8K: usize = 292;
/// Bytes of a Q8_0 activation block (f16 d, 32 × i8).
const Q8_0: usize = 34;

/// The 8 signs of each 7-bit ksigns index as ±1 bytes (llama.cpp's `keven_signs_q2xs`), for
/// `_mm256_sign_epi8`.
static KEVEN_SIGNS: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        let s = KSIGNS_IQ2XS[i];
        let mut v = 0u64;
        let mut j = 0;
        while j < 8 {
            let byte: u64 = if s >> j & 1 != 0 { 0xff } else { 0x01 };
            v |= byte << (8 * j);
            j += 1;
        }
        t[i] = v;
        i += 1;
    }
    t
};

/// Bit `j % 8` selectors for 32 bytes, to expand sign bytes into byte masks.
static BIT_SELECT: [u8; 32] = [
    0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80,
    0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80,
];

/// Byte `j / 8` of a broadcast u32 into every byte `j` (for expanding 4 sign bytes to 32 lanes).
static SIGN_BYTE_SPREAD: [u8; 32] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
];

/// Loads `b[at..at + 16]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load128(b: &[u8], at: usize) -> __m128i {
    let s = &b[at..at + 16];
    // SAFETY: `s` is 16 readable bytes; the unaligned load has no alignment requirement.
    unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
}

/// Loads `b[at..at + 32]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load256(b: &[u8], at: usize) -> __m256i {
    let s = &b[at..at + 32];
    // SAFETY: `s` is 32 readable bytes; the unaligned load has no alignment requirement.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// Whole blocks of `N` bytes of `s`, as arrays (so offsets within a block need no run-time checks).
#[inline(always)]
fn blocks<const N: usize>(s: &[u8]) -> impl Iterator<Item = &[u8; N]> {
    // chunks_exact yields exactly N bytes each time, so first_chunk never returns None.
    s.chunks_exact(N).filter_map(|c| c.first_chunk::<N>())
}

/// f16 at `b[at..at + 2]` to f32, without F16C.
///
/// Converting one f16 with F16C (`_mm_cvtph_ps` on a lone 16-bit lane) lets LLVM insert the value into
/// whatever register is free, often an accumulator, making every block wait for the previous block's sums;
/// this conversion has no such hidden dependency.
#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16_at(b, at))
}

/// f16 bits to f32, exactly, with selects rather than branches, and without ever computing with an f32
/// subnormal (those cost a microcode assist, and IQ4_XS scales are often f16 subnormals).
#[inline(always)]
fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let em = h & 0x7fff;
    // Normal values: move exponent and mantissa into place and rebias the exponent by 127 − 15; infinities
    // and NaNs (exponent 31) rebias to 255 instead.
    let rebias = if em >= 0x7c00 { 224 << 23 } else { 112 << 23 };
    let shifted = (em << 13) + rebias;
    // Zero and subnormals: mantissa × 2^-24, exact (the product is an f32 normal).
    let small = (em as f32 * f32::from_bits(0x3380_0000)).to_bits();
    let magnitude = if em < 0x400 { small } else { shifted };
    f32::from_bits(magnitude | (h & 0x8000) << 16)
}

/// Little-endian u16 at `b[at..at + 2]`, as one load.
#[inline(always)]
fn u16_at(b: &[u8], at: usize) -> u16 {
    let s = &b[at..at + 2];
    // SAFETY: `s` is 2 readable bytes; read_unaligned has no alignment requirement.
    u16::from_le(unsafe { s.as_ptr().cast::<u16>().read_unaligned() })
}

/// Little-endian u32 at `b[at..at + 4]`, as one load (built from bytes, LLVM splits it into four byte
/// loads when only bit fields of it are used).
#[inline(always)]
fn u32_at(b: &[u8], at: usize) -> u32 {
    let s = &b[at..at + 4];
    // SAFETY: `s` is 4 readable bytes; read_unaligned has no alignment requirement.
    u32::from_le(unsafe { s.as_ptr().cast::<u32>().read_unaligned() })
}

#[inline(always)]
fn q8k_d(y: &[u8; Q8K]) -> f32 {
    f32::from_le_bytes([y[0], y[1], y[2], y[3]])
}

/// Sum of the 8 f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_f32x8(x: __m256) -> f32 {
    let mut r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// Signed i8 × i8 products, summed in adjacent pairs to i16 (|x| · sign(x)·y, so `maddubs` applies).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul_add_epi8(x: __m256i, y: __m256i) -> __m256i {
    _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

/// Four 8-byte grid rows as one vector (row 0 in the low lane).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn set_u64x4(a: u64, b: u64, c: u64, d: u64) -> __m256i {
    _mm256_set_epi64x(d as i64, c as i64, b as i64, a as i64)
}

/// Eight 4-byte grid rows as one vector (row 0 in the low lane).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn set_u32x8(g: [u32; 8]) -> __m256i {
    _mm256_set_epi32(
        g[7] as i32,
        g[6] as i32,
        g[5] as i32,
        g[4] as i32,
        g[3] as i32,
        g[2] as i32,
        g[1] as i32,
        g[0] as i32,
    )
}

/// `q8` with byte `j` negated where bit `j` of the 32 sign bits `signs` is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn apply_sign_bits(q8: __m256i, signs: u32) -> __m256i {
    let spread = load256(&SIGN_BYTE_SPREAD, 0);
    let select = load256(&BIT_SELECT, 0);
    let bytes = _mm256_and_si256(
        _mm256_shuffle_epi8(_mm256_set1_epi32(signs as i32), spread),
        select,
    );
    let neg = _mm256_cmpeq_epi8(bytes, select);
    _mm256_sub_epi8(_mm256_xor_si256(q8, neg), neg)
}

/// Sign vector of four 7-bit ksigns indices packed at bits 0, 7, 14 and 21 of `aux`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn ksigns_x4(aux: u32) -> __m256i {
    set_u64x4(
        KEVEN_SIGNS[(aux & 127) as usize],
        KEVEN_SIGNS[(aux >> 7 & 127) as usize],
        KEVEN_SIGNS[(aux >> 14 & 127) as usize],
        KEVEN_SIGNS[(aux >> 21 & 127) as usize],
    )
}

/// IQ2_XXS × Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_iq2_xxs(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut accumf = _mm256_setzero_ps();
    for (x, y) in blocks::<66>(row).zip(blocks::<Q8K>(act)).take(n / QK_K) {
        let d = f16_at(x, 0) * q8k_d(y);
        let mut sumi1 = _mm256_setzero_si256();
        let mut sumi2 = _mm256_setzero_si256();
        for ib in (0..8).step_by(2) {
            let q8_1 = load256(y, 4 + 32 * ib);
            let q8_2 = load256(y, 36 + 32 * ib);
            let g = &x[2 + 8 * ib..18 + 8 * ib];
            let (s1, s2) = (u32_at(g, 4), u32_at(g, 12));
            let q2_1 = set_u64x4(
                IQ2XXS_GRID[g[0] as usize],
                IQ2XXS_GRID[g[1] as usize],
                IQ2XXS_GRID[g[2] as usize],
                IQ2XXS_GRID[g[3] as usize],
            );
            let q2_2 = set_u64x4(
                IQ2XXS_GRID[g[8] as usize],
                IQ2XXS_GRID[g[9] as usize],
                IQ2XXS_GRID[g[10] as usize],
                IQ2XXS_GRID[g[11] as usize],
            );
            let dot1 = _mm256_maddubs_epi16(q2_1, _mm256_sign_epi8(q8_1, ksigns_x4(s1)));
            let dot2 = _mm256_maddubs_epi16(q2_2, _mm256_sign_epi8(q8_2, ksigns_x4(s2)));
            let p1 = _mm256_madd_epi16(dot1, _mm256_set1_epi16((2 * (s1 >> 28) + 1) as i16));
            let p2 = _mm256_madd_epi16(dot2, _mm256_set1_epi16((2 * (s2 >> 28) + 1) as i16));
            sumi1 = _mm256_add_epi32(sumi1, p1);
            sumi2 = _mm256_add_epi32(sumi2, p2);
        }
        accumf = _mm256_fmadd_ps(
            _mm256_set1_ps(d),
            _mm256_cvtepi32_ps(_mm256_add_epi32(sumi1, sumi2)),
            accumf,
        );
    }
    0.125 * hsum_f32x8(accumf)
}

/// The sixteen odd multipliers `2s + 1` of the 4-bit scales at `x[at..at + 8]` (two per 32 values) as
/// 16-bit lanes: lane `ib` of the low 128 bits holds the first half's (low nibble of byte `ib`), lane
/// `ib` of the high 128 bits the second half's, matching the halves of a 32-value `maddubs` result; so
/// `pshufb` with [`I16_BROADCAST`]`[ib]` gives the multipliers of sub-block `ib`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq2_scales(x: &[u8], at: usize) -> __m256i {
    let m4 = _mm_set1_epi8(0x0f);
    let bytes = &x[at..at + 8];
    // SAFETY: `bytes` is 8 readable bytes, what the unaligned 64-bit load reads.
    let v = unsafe { _mm_loadl_epi64(bytes.as_ptr().cast()) };
    let nibbles = _mm_unpacklo_epi64(
        _mm_and_si128(v, m4),
        _mm_and_si128(_mm_srli_epi16(v, 4), m4),
    );
    let odd = _mm_add_epi8(_mm_slli_epi16(nibbles, 1), _mm_set1_epi8(1));
    _mm256_cvtepu8_epi16(odd)
}

/// IQ2_XS × Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_iq2_xs(n: usize, row: &[u8], act: &[u8]) -> f32 {
    vec_dot_iq2_xs_order::<false>(n, row, act)
}

/// [`vec_dot_iq2_xs`] (`TILED = false`) or the tiled batch order of `iquants::tiled` (`true`): the same integer
/// sums per super-block, their total `T` finished as `fma(xd·T, yd, acc)`.
///
/// # Safety
/// As [`vec_dot_iq2_xs`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_iq2_xs_order<const TILED: bool>(
    n: usize,
    row: &[u8],
    act: &[u8],
) -> f32 {
    let mut tacc = 0f32;
    let mut accumf = _mm256_setzero_ps();
    for (x, y) in blocks::<74>(row).zip(blocks::<Q8K>(act)).take(n / QK_K) {
        let scales = iq2_scales(x, 66);
        // The scaled pair sums of sub-block `ib` (32 values, four grid entries of 9-bit index and 7-bit
        // ksigns index each).
        let sub = |ib: usize| {
            let q = [0, 1, 2, 3].map(|l| u16_at(x, 2 + 8 * ib + 2 * l));
            let q2 = set_u64x4(
                IQ2XS_GRID[(q[0] & 511) as usize],
                IQ2XS_GRID[(q[1] & 511) as usize],
                IQ2XS_GRID[(q[2] & 511) as usize],
                IQ2XS_GRID[(q[3] & 511) as usize],
            );
            let s2 = set_u64x4(
                KEVEN_SIGNS[(q[0] >> 9) as usize],
                KEVEN_SIGNS[(q[1] >> 9) as usize],
                KEVEN_SIGNS[(q[2] >> 9) as usize],
                KEVEN_SIGNS[(q[3] >> 9) as usize],
            );
            let dot = _mm256_maddubs_epi16(q2, _mm256_sign_epi8(load256(y, 4 + 32 * ib), s2));
            _mm256_madd_epi16(
                dot,
                _mm256_shuffle_epi8(scales, load256(&I16_BROADCAST[ib], 0)),
            )
        };
        let mut sumi1 = _mm256_setzero_si256();
        let mut sumi2 = _mm256_setzero_si256();
        for ib in (0..8).step_by(2) {
            sumi1 = _mm256_add_epi32(sumi1, sub(ib));
            sumi2 = _mm256_add_epi32(sumi2, sub(ib + 1));
        }
        let d = f16_at(x, 0) * q8k_d(y);
        if TILED {
            let t = hsum_i32x8(_mm256_add_epi32(sumi1, sumi2));
            tacc = (f16_at(x, 0) * 0.125 * t as f32).mul_add(q8k_d(y), tacc);
            continue;
        }
        accumf = _mm256_fmadd_ps(
            _mm256_set1_ps(d),
            _mm256_cvtepi32_ps(_mm256_add_epi32(sumi1, sumi2)),
            accumf,
        );
    }
    if TILED {
        return tacc;
    }
    0.125 * hsum_f32x8(accumf)
}

/// IQ2_S × Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_iq2_s(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut accumf = _mm256_setzero_ps();
    for (x, y) in blocks::<82>(row).zip(blocks::<Q8K>(act)).take(n / QK_K) {
        let scales = iq2_scales(x, 74);
        // The scaled pair sums of sub-block `ib` (32 values, four grid entries of 10-bit index).
        let sub = |ib: usize| {
            let qh = x[66 + ib] as usize;
            let qs = &x[2 + 4 * ib..6 + 4 * ib];
            let q2 = set_u64x4(
                IQ2S_GRID[qs[0] as usize | (qh << 8 & 0x300)],
                IQ2S_GRID[qs[1] as usize | (qh << 6 & 0x300)],
                IQ2S_GRID[qs[2] as usize | (qh << 4 & 0x300)],
                IQ2S_GRID[qs[3] as usize | (qh << 2 & 0x300)],
            );
            let q8s = apply_sign_bits(load256(y, 4 + 32 * ib), u32_at(x, 34 + 4 * ib));
            let dot = _mm256_maddubs_epi16(q2, q8s);
            _mm256_madd_epi16(
                dot,
                _mm256_shuffle_epi8(scales, load256(&I16_BROADCAST[ib], 0)),
            )
        };
        let mut sumi1 = _mm256_setzero_si256();
        let mut sumi2 = _mm256_setzero_si256();
        for ib in (0..8).step_by(2) {
            sumi1 = _mm256_add_epi32(sumi1, sub(ib));
            sumi2 = _mm256_add_epi32(sumi2, sub(ib + 1));
        }
        let d = f16_at(x, 0) * q8k_d(y);
        accumf = _mm256_fmadd_ps(
            _mm256_set1_ps(d),
            _mm256_cvtepi32_ps(_mm256_add_epi32(sumi1, sumi2)),
            accumf,
        );
    }
    0.125 * hsum_f32x8(accumf)
}

/// IQ3_XXS × Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_iq3_xxs(n: usize, row: &[u8], act: &[u8]) -> f32 {
    vec_dot_iq3_xxs_order::<false>(n, row, act)
}

/// [`vec_dot_iq3_xxs`] (`TILED = false`) or the tiled batch order of `iquants::tiled` (`true`): the same integer
/// sums per super-block, their total `T` finished as `fma(xd·T, yd, acc)`.
///
/// # Safety
/// As [`vec_dot_iq3_xxs`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_iq3_xxs_order<const TILED: bool>(
    n: usize,
    row: &[u8],
    act: &[u8],
) -> f32 {
    let mut tacc = 0f32;
    let mut accumf = _mm256_setzero_ps();
    for (x, y) in blocks::<98>(row).zip(blocks::<Q8K>(act)).take(n / QK_K) {
        let d = f16_at(x, 0) * q8k_d(y);
        let mut sumi1 = _mm256_setzero_si256();
        let mut sumi2 = _mm256_setzero_si256();
        for ib in (0..8).step_by(2) {
            let q8_1 = load256(y, 4 + 32 * ib);
            let q8_2 = load256(y, 36 + 32 * ib);
            let q3 = &x[2 + 8 * ib..18 + 8 * ib];
            let q3_1 = set_u32x8([0, 1, 2, 3, 4, 5, 6, 7].map(|j| IQ3XXS_GRID[q3[j] as usize]));
            let q3_2 =
                set_u32x8([8, 9, 10, 11, 12, 13, 14, 15].map(|j| IQ3XXS_GRID[q3[j] as usize]));
            let (s1, s2) = (u32_at(x, 66 + 4 * ib), u32_at(x, 70 + 4 * ib));
            let dot1 = _mm256_maddubs_epi16(q3_1, _mm256_sign_epi8(q8_1, ksigns_x4(s1)));
            let dot2 = _mm256_maddubs_epi16(q3_2, _mm256_sign_epi8(q8_2, ksigns_x4(s2)));
            let p1 = _mm256_madd_epi16(dot1, _mm256_set1_epi16((2 * (s1 >> 28) + 1) as i16));
            let p2 = _mm256_madd_epi16(dot2, _mm256_set1_epi16((2 * (s2 >> 28) + 1) as i16));
            sumi1 = _mm256_add_epi32(sumi1, p1);
            sumi2 = _mm256_add_epi32(sumi2, p2);
        }
        if TILED {
            let t = hsum_i32x8(_mm256_add_epi32(sumi1, sumi2));
            tacc = (f16_at(x, 0) * 0.25 * t as f32).mul_add(q8k_d(y), tacc);
            continue;
        }
        accumf = _mm256_fmadd_ps(
            _mm256_set1_ps(d),
            _mm256_cvtepi32_ps(_mm256_add_epi32(sumi1, sumi2)),
            accumf,
        );
    }
    if TILED {
        return tacc;
    }
    0.25 * hsum_f32x8(accumf)
}

/// IQ3_S × Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_iq3_s(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut accumf = _mm256_setzero_ps();
    for (x, y) in blocks::<110>(row).zip(blocks::<Q8K>(act)).take(n / QK_K) {
        // The scaled pair sums of sub-block `ib` (32 values, eight grid entries of 9-bit index).
        let sub = |ib: usize| {
            let qs = &x[2 + 8 * ib..10 + 8 * ib];
            let qh = x[66 + ib] as usize;
            let q3 = set_u32x8(
                [0, 1, 2, 3, 4, 5, 6, 7].map(|j| IQ3S_GRID[qs[j] as usize | (qh << (8 - j) & 256)]),
            );
            let q8s = apply_sign_bits(load256(y, 4 + 32 * ib), u32_at(x, 74 + 4 * ib));
            let dot = _mm256_maddubs_epi16(q3, q8s);
            let ls = (x[106 + ib / 2] >> (4 * (ib % 2))) & 15;
            _mm256_madd_epi16(dot, _mm256_set1_epi16((2 * ls + 1) as i16))
        };
        let mut sumi1 = _mm256_setzero_si256();
        let mut sumi2 = _mm256_setzero_si256();
        for ib in (0..8).step_by(2) {
            sumi1 = _mm256_add_epi32(sumi1, sub(ib));
            sumi2 = _mm256_add_epi32(sumi2, sub(ib + 1));
        }
        let d = f16_at(x, 0) * q8k_d(y);
        accumf = _mm256_fmadd_ps(
            _mm256_set1_ps(d),
            _mm256_cvtepi32_ps(_mm256_add_epi32(sumi1, sumi2)),
            accumf,
        );
    }
    hsum_f32x8(accumf)
}

/// IQ1_S × Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_iq1_s(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut accum = _mm256_setzero_ps();
    let mut accum_delta = _mm256_setzero_ps();
    for (x, y) in blocks::<50>(row).zip(blocks::<Q8K>(act)).take(n / QK_K) {
        // The eight qh words: 4 × 3 high index bits, the 3-bit scale, the sign of the shift.
        let qh = load128(x, 34);
        let ls = _mm_or_si128(
            _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qh, 12), _mm_set1_epi16(7)), 1),
            _mm_set1_epi16(1),
        );
        let scales = _mm256_broadcastsi128_si256(ls);
        // The shift term Σ ±ls · q8 over each 32 values, from the Q8_K sums of 16.
        let signed_ls = _mm_sign_epi16(ls, _mm_or_si128(qh, _mm_set1_epi16(1)));
        let per_sum = _mm256_set_m128i(
            _mm_unpackhi_epi16(signed_ls, signed_ls),
            _mm_unpacklo_epi16(signed_ls, signed_ls),
        );
        let delta = _mm256_madd_epi16(load256(y, 260), per_sum);
        let sub = |ib: usize| {
            let qh = u16_at(x, 34 + 2 * ib) as usize;
            let qs = &x[2 + 4 * ib..6 + 4 * ib];
            let q1 = set_u64x4(
                IQ1S_GRID[qs[0] as usize | (qh << 8 & 0x700)],
                IQ1S_GRID[qs[1] as usize | (qh << 5 & 0x700)],
                IQ1S_GRID[qs[2] as usize | (qh << 2 & 0x700)],
                IQ1S_GRID[qs[3] as usize | (qh >> 1 & 0x700)],
            );
            let dot = mul_add_epi8(q1, load256(y, 4 + 32 * ib));
            _mm256_madd_epi16(
                dot,
                _mm256_shuffle_epi8(scales, load256(&I16_BROADCAST[ib], 0)),
            )
        };
        let mut sumi1 = _mm256_setzero_si256();
        let mut sumi2 = _mm256_setzero_si256();
        for ib in (0..8).step_by(2) {
            sumi1 = _mm256_add_epi32(sumi1, sub(ib));
            sumi2 = _mm256_add_epi32(sumi2, sub(ib + 1));
        }
        let d = _mm256_set1_ps(q8k_d(y) * f16_at(x, 0));
        accum = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(sumi1, sumi2)), accum);
        accum_delta = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(delta), accum_delta);
    }
    hsum_f32x8(accum) + 0.125 * hsum_f32x8(accum_delta)
}

/// IQ1_M × Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_iq1_m(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mask = _mm256_set1_epi16(7);
    let mone = _mm256_set1_epi16(1);
    let mone8 = _mm256_set1_epi8(1);
    let mtwo8 = _mm256_set1_epi8(2);
    // Shifting the four u16 scale words right by 0, 6, 3 and 9 puts scale 4w + {0, 2, 1, 3} in 16-bit lane
    // w of 64-bit lanes 0..4: the low 128 bits hold the first halves of 32-value groups, the high 128 bits
    // the second halves (pshufb cannot cross the 128-bit lanes).
    let scales_shift = _mm256_set_epi64x(9, 3, 6, 0);
    // Byte j of 64 values' shift-sign vectors comes from qh byte (j / 16) (+ 2 for the second 32), bit 3
    // for the first 8 of each 16 bytes and bit 7 for the second.
    let spread_lo = _mm256_set_epi64x(0x0101_0101_0101_0101, 0x0101_0101_0101_0101, 0, 0);
    let spread_hi = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0202_0202_0202_0202,
    );
    let delta_select = _mm256_set_epi64x(
        0x8080_8080_8080_8080u64 as i64,
        0x0808_0808_0808_0808,
        0x8080_8080_8080_8080u64 as i64,
        0x0808_0808_0808_0808,
    );
    let mut accum1 = _mm256_setzero_ps();
    let mut accum2 = _mm256_setzero_ps();
    for (x, y) in blocks::<56>(row).zip(blocks::<Q8K>(act)).take(n / QK_K) {
        let sc = [0, 1, 2, 3].map(|w| u16_at(x, 48 + 2 * w));
        let d_bits =
            (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000);
        let d16 = f16_to_f32(d_bits);
        let sc64 = u64::from_le_bytes([x[48], x[49], x[50], x[51], x[52], x[53], x[54], x[55]]);
        let mut scales = _mm256_srlv_epi64(_mm256_set1_epi64x(sc64 as i64), scales_shift);
        scales = _mm256_add_epi16(_mm256_slli_epi16(_mm256_and_si256(scales, mask), 1), mone);
        let mut scales_idx1 = _mm256_set1_epi16(0x0100);
        let mut scales_idx2 = _mm256_add_epi8(scales_idx1, _mm256_set1_epi8(8));
        let mut sumi1 = _mm256_setzero_si256();
        let mut sumi2 = _mm256_setzero_si256();
        for ib in (0..8).step_by(2) {
            let qs = &x[4 * ib..4 * ib + 8];
            let qh = &x[32 + 2 * ib..36 + 2 * ib];
            let idx =
                |k: usize| qs[k] as usize | ((qh[k / 2] as usize) << (8 - 4 * (k % 2)) & 0x700);
            let q1b_1 = set_u64x4(
                IQ1S_GRID[idx(0)],
                IQ1S_GRID[idx(1)],
                IQ1S_GRID[idx(2)],
                IQ1S_GRID[idx(3)],
            );
            let q1b_2 = set_u64x4(
                IQ1S_GRID[idx(4)],
                IQ1S_GRID[idx(5)],
                IQ1S_GRID[idx(6)],
                IQ1S_GRID[idx(7)],
            );
            // Shift signs as ±1 bytes: group k's sign is bit 3 (k even) or 7 (k odd) of qh[k / 2].
            let qh4 = _mm256_set1_epi32(u32_at(x, 32 + 2 * ib) as i32);
            let delta = |spread: __m256i| {
                let bits = _mm256_and_si256(_mm256_shuffle_epi8(qh4, spread), delta_select);
                _mm256_or_si256(_mm256_cmpeq_epi8(bits, delta_select), mone8)
            };
            let delta1 = delta(spread_lo);
            let delta2 = delta(spread_hi);
            let q8b_1 = load256(y, 4 + 32 * ib);
            let q8b_2 = load256(y, 36 + 32 * ib);
            let dot1 = mul_add_epi8(q1b_1, q8b_1);
            let dot2 = mul_add_epi8(q1b_2, q8b_2);
            let dot3 = _mm256_maddubs_epi16(mone8, _mm256_sign_epi8(q8b_1, delta1));
            let dot4 = _mm256_maddubs_epi16(mone8, _mm256_sign_epi8(q8b_2, delta2));
            let scale1 = _mm256_shuffle_epi8(scales, scales_idx1);
            let scale2 = _mm256_shuffle_epi8(scales, scales_idx2);
            scales_idx1 = _mm256_add_epi8(scales_idx1, mtwo8);
            scales_idx2 = _mm256_add_epi8(scales_idx2, mtwo8);
            let p1 = _mm256_madd_epi16(dot1, scale1);
            let p2 = _mm256_madd_epi16(dot2, scale2);
            let p3 = _mm256_madd_epi16(dot3, scale1);
            let p4 = _mm256_madd_epi16(dot4, scale2);
            sumi1 = _mm256_add_epi32(sumi1, _mm256_add_epi32(p1, p2));
            sumi2 = _mm256_add_epi32(sumi2, _mm256_add_epi32(p3, p4));
        }
        let d = _mm256_set1_ps(q8k_d(y) * d16);
        accum1 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi1), accum1);
        accum2 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi2), accum2);
    }
    hsum_f32x8(accum1) + 0.125 * hsum_f32x8(accum2)
}

/// The 32 levels of 16 nibble bytes at `x[at..at + 16]`: low nibbles in the low 128 bits, high nibbles in
/// the high 128 bits, each looked up in the 16-entry table `values`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibble_levels(values: __m128i, x: &[u8], at: usize) -> __m256i {
    let m4b = _mm_set1_epi8(0x0f);
    let bits = load128(x, at);
    _mm256_set_m128i(
        _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(bits, 4), m4b)),
        _mm_shuffle_epi8(values, _mm_and_si128(bits, m4b)),
    )
}

/// Shared body of IQ4_NL and MXFP4 × Q8_0 for `N`-byte weight blocks whose 16 nibble bytes start at
/// `qs_at`. Blocks go in pairs; `scales(x1, y1, x2, y2)` gives the two products of weight and activation
/// scales in lanes 0 and 1 (converted together, as vectors: per-block scalar conversions would cost
/// as much as the integer work of a 32-value block).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_nibbles_q8_0<const N: usize>(
    n: usize,
    row: &[u8],
    act: &[u8],
    levels: &[i8; 16],
    qs_at: usize,
    scales: impl Fn(&[u8], &[u8], &[u8], &[u8]) -> __m128,
) -> f32 {
    // SAFETY: `levels` is 16 readable bytes; the unaligned load has no alignment requirement.
    let values = unsafe { _mm_loadu_si128(levels.as_ptr().cast()) };
    let mone = _mm256_set1_epi16(1);
    let block_dot = |x: &[u8], y: &[u8]| {
        // SAFETY: the enclosing function's contract (AVX2, FMA and F16C present) covers these calls.
        unsafe {
            _mm256_madd_epi16(
                mul_add_epi8(nibble_levels(values, x, qs_at), load256(y, 2)),
                mone,
            )
        }
    };
    let nb = n / 32;
    let mut accum1 = _mm256_setzero_ps();
    let mut accum2 = _mm256_setzero_ps();
    let pairs = row
        .chunks_exact(2 * N)
        .zip(act.chunks_exact(2 * Q8_0))
        .take(nb / 2);
    for (xp, yp) in pairs {
        let ((x1, x2), (y1, y2)) = (xp.split_at(N), yp.split_at(Q8_0));
        let d = scales(x1, y1, x2, y2);
        let p_1 = block_dot(x1, y1);
        let p_2 = block_dot(x2, y2);
        accum1 = _mm256_fmadd_ps(_mm256_broadcastss_ps(d), _mm256_cvtepi32_ps(p_1), accum1);
        accum2 = _mm256_fmadd_ps(
            _mm256_broadcastss_ps(_mm_movehdup_ps(d)),
            _mm256_cvtepi32_ps(p_2),
            accum2,
        );
    }
    let mut sumf = hsum_f32x8(_mm256_add_ps(accum1, accum2));
    if nb % 2 == 1 {
        // An odd last block: summed as the portable code does.
        let x = row.chunks_exact(N).nth(nb - 1);
        let y = act.chunks_exact(Q8_0).nth(nb - 1);
        if let (Some(x), Some(y)) = (x, y) {
            sumf += _mm_cvtss_f32(scales(x, y, x, y)) * hsum_i32x8(block_dot(x, y)) as f32;
        }
    }
    sumf
}

/// Sum of the 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i32x8(a: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// IQ4_NL × Q8_0.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_iq4_nl(n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_nibbles_q8_0::<18>(n, row, act, &KVALUES_IQ4NL, 2, |x1, y1, x2, y2| {
        let halves = [u16_at(y1, 0), u16_at(y2, 0), u16_at(x1, 0), u16_at(x2, 0)];
        let bits = halves
            .iter()
            .rev()
            .fold(0u64, |acc, &h| acc << 16 | h as u64);
        // The closure inherits the enclosing function's target features and unsafe context.
        let v = _mm_cvtph_ps(_mm_cvtsi64_si128(bits as i64)); // [y1, y2, x1, x2]
        _mm_mul_ps(v, _mm_movehl_ps(v, v))
    })
}

/// Half of each E8M0 scale as f32 bits (`mxfp4::e8m0_to_f32_half`, tabulated).
static E8M0_HALF_BITS: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut e = 0;
    while e < 256 {
        t[e] = if e < 2 {
            0x0020_0000 << e
        } else {
            ((e - 1) as u32) << 23
        };
        e += 1;
    }
    t
};

/// MXFP4 × Q8_0.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_mxfp4(n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_nibbles_q8_0::<17>(n, row, act, &KVALUES_MXFP4, 1, |x1, y1, x2, y2| {
        let yd = u16_at(y1, 0) as u32 | (u16_at(y2, 0) as u32) << 16;
        let e =
            E8M0_HALF_BITS[x1[0] as usize] as u64 | (E8M0_HALF_BITS[x2[0] as usize] as u64) << 32;
        // The closure inherits the enclosing function's target features and unsafe context.
        let y = _mm_cvtph_ps(_mm_cvtsi32_si128(yd as i32));
        _mm_mul_ps(y, _mm_castsi128_ps(_mm_cvtsi64_si128(e as i64)))
    })
}

/// `pshufb` masks that broadcast 16-bit lane `i` (0..8) of each 128-bit half to the whole half.
static I16_BROADCAST: [[u8; 32]; 8] = {
    let mut t = [[0u8; 32]; 8];
    let mut i = 0;
    while i < 8 {
        let mut j = 0;
        while j < 32 {
            t[i][j] = (2 * i + j % 2) as u8;
            j += 1;
        }
        i += 1;
    }
    t
};

/// The eight signed sub-block scales `ls − 32` of an IQ4_XS block as 16-bit lanes, repeated in both
/// 128-bit halves: low 4 bits from the nibbles at `x[4..8]`, high 2 bits from the u16 at `x[2..4]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4xs_scales(x: &[u8; 136]) -> __m256i {
    let m4 = _mm_set1_epi8(0x0f);
    let low = _mm_cvtsi32_si128(u32_at(x, 4) as i32);
    let low = _mm_unpacklo_epi8(
        _mm_and_si128(low, m4),
        _mm_and_si128(_mm_srli_epi16(low, 4), m4),
    );
    // (sh << (14 − 2i)) >> 10 puts bits 2i, 2i+1 of sh at bits 4, 5 of lane i.
    let sh = _mm_set1_epi16(u16_at(x, 2) as i16);
    let shifts = _mm_setr_epi16(1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 1 << 4, 1 << 2, 1);
    let high = _mm_and_si128(
        _mm_srli_epi16(_mm_mullo_epi16(sh, shifts), 10),
        _mm_set1_epi16(0x30),
    );
    let scales = _mm_sub_epi16(
        _mm_or_si128(_mm_cvtepu8_epi16(low), high),
        _mm_set1_epi16(32),
    );
    _mm256_broadcastsi128_si256(scales)
}

/// IQ4_XS × Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_iq4_xs(n: usize, row: &[u8], act: &[u8]) -> f32 {
    vec_dot_iq4_xs_order::<false>(n, row, act)
}

/// [`vec_dot_iq4_xs`] (`TILED = false`) or the tiled batch order of `iquants::tiled` (`true`): the same integer
/// sums per super-block, their total `T` finished as `fma(xd·T, yd, acc)`.
///
/// # Safety
/// As [`vec_dot_iq4_xs`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot_iq4_xs_order<const TILED: bool>(
    n: usize,
    row: &[u8],
    act: &[u8],
) -> f32 {
    let mut tacc = 0f32;
    let values = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast());
    let mut accum = _mm256_setzero_ps();
    for (x, y) in blocks::<136>(row).zip(blocks::<Q8K>(act)).take(n / QK_K) {
        let scales = iq4xs_scales(x);
        let mut sumi1 = _mm256_setzero_si256();
        let mut sumi2 = _mm256_setzero_si256();
        for ib in (0..8).step_by(2) {
            let q4b_1 = nibble_levels(values, x, 8 + 16 * ib);
            let q4b_2 = nibble_levels(values, x, 24 + 16 * ib);
            let p16_1 = mul_add_epi8(q4b_1, load256(y, 4 + 32 * ib));
            let p16_2 = mul_add_epi8(q4b_2, load256(y, 36 + 32 * ib));
            let ls1 = _mm256_shuffle_epi8(scales, load256(&I16_BROADCAST[ib], 0));
            let ls2 = _mm256_shuffle_epi8(scales, load256(&I16_BROADCAST[ib + 1], 0));
            sumi1 = _mm256_add_epi32(_mm256_madd_epi16(p16_1, ls1), sumi1);
            sumi2 = _mm256_add_epi32(_mm256_madd_epi16(p16_2, ls2), sumi2);
        }
        let d = f16_at(x, 0) * q8k_d(y);
        if TILED {
            let t = hsum_i32x8(_mm256_add_epi32(sumi1, sumi2));
            tacc = (f16_at(x, 0) * t as f32).mul_add(q8k_d(y), tacc);
            continue;
        }
        accum = _mm256_fmadd_ps(
            _mm256_set1_ps(d),
            _mm256_cvtepi32_ps(_mm256_add_epi32(sumi1, sumi2)),
            accum,
        );
    }
    if TILED {
        return tacc;
    }
    hsum_f32x8(accum)
}

#[cfg(test)]
mod tests {
    //! The AVX2 kernels called directly (whatever `--cpu-simd` says), against the portable ones.

    use super::*;
    use crate::quant::GgmlType;
    use crate::rng::Rng;

    type Kernel = unsafe fn(usize, &[u8], &[u8]) -> f32;

    fn dequantized(ty: GgmlType, row: &[u8]) -> Vec<f32> {
        let mut w = vec![0f32; row.len() / ty.block_bytes() * ty.block_elems()];
        crate::quant::dequantize(ty, row, &mut w).expect("whole blocks");
        w
    }

    #[test]
    fn keven_signs_expand_ksigns() {
        for (i, &v) in KEVEN_SIGNS.iter().enumerate() {
            for j in 0..8 {
                let byte = (v >> (8 * j)) as u8 as i8;
                let negative = KSIGNS_IQ2XS[i] >> j & 1 != 0;
                assert_eq!(byte, if negative { -1 } else { 1 });
            }
        }
    }

    #[test]
    fn f16_conversion_is_exact_for_every_value() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_at(&h.to_le_bytes(), 0);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{h:#06x}"
            );
        }
    }

    #[test]
    fn avx2_kernels_equal_portable_kernels() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            eprintln!("no AVX2/FMA/F16C here: AVX2 kernels not tested");
            return;
        }
        let kernels: [(GgmlType, Kernel); 10] = [
            (GgmlType::IQ1_S, vec_dot_iq1_s),
            (GgmlType::IQ1_M, vec_dot_iq1_m),
            (GgmlType::IQ2_XXS, vec_dot_iq2_xxs),
            (GgmlType::IQ2_XS, vec_dot_iq2_xs),
            (GgmlType::IQ2_S, vec_dot_iq2_s),
            (GgmlType::IQ3_XXS, vec_dot_iq3_xxs),
            (GgmlType::IQ3_S, vec_dot_iq3_s),
            (GgmlType::IQ4_NL, vec_dot_iq4_nl),
            (GgmlType::IQ4_XS, vec_dot_iq4_xs),
            (GgmlType::MXFP4, vec_dot_mxfp4),
        ];
        let mut rng = Rng::new(21);
        for (ty, kernel) in kernels {
            let ops = ty.ops().expect("family B type has operations");
            for blocks in [1usize, 2, 5] {
                let n = blocks * ty.block_elems();
                let mut row = vec![0u8; ty.bytes_for(n as u64).expect("whole blocks") as usize];
                (ops.fill_random)(&mut rng, 0.1, &mut row);
                let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
                let mut act = vec![0u8; ops.act.bytes_for(n)];
                ops.act.quantize(&x, &mut act);
                // SAFETY: the CPU was just found to support AVX2, FMA and F16C.
                let simd = unsafe { kernel(n, &row, &act) };
                let portable = (ops.vec_dot_portable)(n, &row, &act);
                // Both sum the same integers; only the order of the f32 accumulation differs.
                let w = dequantized(ty, &row);
                let magnitude: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
                let tolerance = 1e-5 * magnitude;
                assert!(
                    (simd - portable).abs() <= tolerance,
                    "{ty} ×{blocks}: {simd} vs {portable}"
                );
            }
        }
    }
}
