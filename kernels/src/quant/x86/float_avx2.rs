//! AVX2 dot products of F32, F16 and BF16 rows with f32 activations, in the lane order of
//! `quant::float` (so they equal the portable code bit for bit).

use core::arch::x86_64::*;

use crate::quant::float::{sum_float_lanes, FloatKind, FLOAT_LANES};

/// Loads eight weights at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const KIND: u8>(p: *const u8) -> __m256 {
    match KIND {
        0 => _mm256_loadu_ps(p as *const f32),
        1 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
        _ => _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)),
            16,
        )),
    }
}

/// Reads one weight at `p` as f32 (the same exact conversion as the portable code).
#[inline(always)]
unsafe fn load1<const KIND: u8>(p: *const u8) -> f32 {
    match KIND {
        0 => (p as *const f32).read_unaligned(),
        1 => half::f16::from_bits((p as *const u16).read_unaligned()).to_f32(),
        _ => f32::from_bits(((p as *const u16).read_unaligned() as u32) << 16),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_impl<const KIND: u8, const W: usize>(n: usize, w: *const u8, x: *const u8) -> f32 {
    let x = x as *const f32;
    let mut acc = [_mm256_setzero_ps(); FLOAT_LANES / 8];
    let main = n - n % FLOAT_LANES;
    let mut i = 0;
    while i < main {
        for (k, a) in acc.iter_mut().enumerate() {
            let e = i + 8 * k;
            let prod = _mm256_mul_ps(load8::<KIND>(w.add(e * W)), _mm256_loadu_ps(x.add(e)));
            *a = _mm256_add_ps(*a, prod);
        }
        i += FLOAT_LANES;
    }
    let mut lanes = [0f32; FLOAT_LANES];
    for (k, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * k), *a);
    }
    let mut tail = 0f32;
    for e in main..n {
        tail += load1::<KIND>(w.add(e * W)) * x.add(e).read_unaligned();
    }
    sum_float_lanes(&lanes) + tail
}

/// Dot product of `n` weights of `kind` at `w` with `n` little-endian f32 at `x`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must be readable for `n` weights and `x` for `4·n` bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot(kind: FloatKind, n: usize, w: *const u8, x: *const u8) -> f32 {
    match kind {
        FloatKind::F32 => dot_impl::<0, 4>(n, w, x),
        FloatKind::F16 => dot_impl::<1, 2>(n, w, x),
        FloatKind::Bf16 => dot_impl::<2, 2>(n, w, x),
    }
}
