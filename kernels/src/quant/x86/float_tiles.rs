//! Register tiles of llamafile tinyBLAS's F16 and F32 products (`quant::float_tiles`): `RM` weight rows
//! by `RN` activation rows of accumulators, each one `__m256` of eight lanes fed by fused multiply-adds
//! over `k` in steps of 8, reduced at the end in the order of `sum_lanes8`. Each output's operations are
//! those of `float_ggml`'s one-row kernels (the tile only shares the loads), so they equal them bit for bit.
//!
//! The AVX2 tile is 4×2 (8 accumulators of the 16 registers: 4×3 spilt one); the AVX-512 one is 4×6 (24 accumulators,
//! the same eight-lane `__m256` vectors, in the 32 registers AVX-512VL gives them: the order stays the
//! eight lanes of tinyBLAS's AVX2 build, which `f16_tinyblas_order` follows).

use core::arch::x86_64::*;

/// Reduces eight accumulators at once: lane `i` (`i < 4`) of the result is `v[i]`'s eight lanes summed,
/// lane `4 + i` is `v[4 + i]`'s, each in the order of `sum_lanes8`:
/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn reduce8(v: [__m256; 8]) -> __m256 {
    // [s_i | s_{i+4}] with s = (l0 + l4, l1 + l5, l2 + l6, l3 + l7).
    let t04 = halves(v[0], v[4]);
    let t15 = halves(v[1], v[5]);
    let t26 = halves(v[2], v[6]);
    let t37 = halves(v[3], v[7]);
    // [b, c] of two accumulators per half, b = a0 + a2, c = a1 + a3.
    let p = _mm256_add_ps(
        _mm256_shuffle_ps::<0x44>(t04, t15),
        _mm256_shuffle_ps::<0xEE>(t04, t15),
    );
    let q = _mm256_add_ps(
        _mm256_shuffle_ps::<0x44>(t26, t37),
        _mm256_shuffle_ps::<0xEE>(t26, t37),
    );
    // b + c, the accumulators' lanes in order.
    _mm256_add_ps(
        _mm256_shuffle_ps::<0x88>(p, q),
        _mm256_shuffle_ps::<0xDD>(p, q),
    )
}

/// `[a.lo + a.hi | b.lo + b.hi]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves(a: __m256, b: __m256) -> __m256 {
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(a, b),
        _mm256_permute2f128_ps::<0x31>(a, b),
    )
}

/// Eight weights at `p` as f32: f16 (`F16`) or f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_w<const F16: bool>(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees eight values of the weight type at `p`; the loads are unaligned ones.
    unsafe {
        if F16 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        } else {
            _mm256_loadu_ps(p as *const f32)
        }
    }
}

/// Defines a tile kernel: `out[j][i] = w_i · x_j` for 4 weight rows `w` (each `k` values of the weight
/// type) and `$rn` activation rows `x` (each `k` floats), `k` a multiple of 8. A macro rather than a
/// generic body, so every intrinsic is compiled inside the function that enables its features.
macro_rules! tile_kernel {
    ($(#[$doc:meta])* $name:ident, $features:literal, $rn:literal) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $name<const F16: bool>(
            k: usize,
            w: [*const u8; 4],
            x: [*const f32; $rn],
            out: &mut [[f32; 4]; $rn],
        ) {
            const RM: usize = 4;
            const RN: usize = $rn;
            let wb = if F16 { 2 } else { 4 };
            // SAFETY: (whole body) the caller guarantees `k` values behind every pointer and the CPU
            // features this function enables.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); RM]; RN];
                let mut l = 0;
                while l < k {
                    // The activations' vectors held, each weight vector used as it is converted:
                    // RM·RN accumulators + RN + 1 registers.
                    let mut b = [_mm256_setzero_ps(); RN];
                    for (j, b) in b.iter_mut().enumerate() {
                        *b = _mm256_loadu_ps(x[j].add(l));
                    }
                    for (i, &wi) in w.iter().enumerate() {
                        let a = load_w::<F16>(wi.add(l * wb));
                        for (acc, &b) in acc.iter_mut().zip(&b) {
                            acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
                        }
                    }
                    l += 8;
                }
                let mut j = 0;
                while j < RN {
                    let second = if j + 1 < RN {
                        acc[j + 1]
                    } else {
                        [_mm256_setzero_ps(); RM]
                    };
                    let r = reduce8([
                        acc[j][0], acc[j][1], acc[j][2], acc[j][3], second[0], second[1], second[2],
                        second[3],
                    ]);
                    _mm_storeu_ps(out[j].as_mut_ptr(), _mm256_castps256_ps128(r));
                    if j + 1 < RN {
                        _mm_storeu_ps(out[j + 1].as_mut_ptr(), _mm256_extractf128_ps::<1>(r));
                    }
                    j += 2;
                }
            }
        }
    };
}

tile_kernel!(
    /// The AVX2 tile: 4 weight rows by 2 activation rows (4×3 spilt an accumulator: half the speed).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; every pointer is followed by `k` values (f16 or f32
    /// weights, f32 activations), `k` a multiple of 8.
    tile_avx2,
    "avx2,fma,f16c",
    2
);

tile_kernel!(
    /// The AVX-512 tile: 4 weight rows by 6 activation rows, in `__m256` vectors (AVX-512VL's 32
    /// registers).
    ///
    /// # Safety
    /// As [`tile_avx2`], and the CPU must support AVX-512F and AVX-512VL.
    tile_avx512,
    "avx2,fma,f16c,avx512f,avx512vl",
    6
);
