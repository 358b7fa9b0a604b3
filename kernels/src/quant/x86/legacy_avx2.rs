//! AVX2 dot products of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 rows with Q8_0/Q8_1 activations.
//!
//! llama.cpp's AVX2 kernels: each block's eight exact integer sums of four neighbouring products come from
//! `maddubs` and `madd`, and are accumulated with `fma(dx·dy, sums, acc)` into eight f32 lanes (the
//! minimum terms `m·s` into one scalar): the order `quant::legacy` defines, so the result equals the
//! portable code (and ggml) bit for bit.

use core::arch::x86_64::*;

use crate::quant::legacy::{LegacyKind, TILE_ACTS, TILE_ROWS};

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
pub(crate) unsafe fn nibbles(p: *const u8) -> __m256i {
    let t = _mm_loadu_si128(p as *const __m128i);
    let both = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// The 32 bits at `p` spread to 32 bytes: 0xFF where the bit is set, 0 elsewhere.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn bits_to_bytes(p: *const u8) -> __m256i {
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

/// The f16 at `p` as f32 (F16C; exact, as the portable conversion).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16(p: *const u8) -> f32 {
    let bits = (p as *const u16).read_unaligned() as i32;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_impl<const K: u8, const XB: usize, const YB: usize, const MIN: bool>(
    nb: usize,
    mut x: *const u8,
    mut y: *const u8,
) -> ([f32; 8], f32) {
    let mut acc = _mm256_setzero_ps();
    let mut mins = 0f32;
    // Eight blocks at a time, their scale products `dx·dy` formed together (the same products, one per
    // lane), then each block's fused step in order.
    let mut scales = [0f32; 8];
    for _ in 0..nb / 8 {
        _mm256_storeu_ps(
            scales.as_mut_ptr(),
            _mm256_mul_ps(f16x8(x, XB), f16x8(y, YB)),
        );
        for &d in &scales {
            let sums = _mm256_cvtepi32_ps(block_sums::<K>(x, y));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), sums, acc);
            if MIN {
                mins = f16(x.add(2)).mul_add(f16(y.add(2)), mins);
            }
            x = x.add(XB);
            y = y.add(YB);
        }
    }
    for _ in 0..nb % 8 {
        let sums = _mm256_cvtepi32_ps(block_sums::<K>(x, y));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(x) * f16(y)), sums, acc);
        if MIN {
            mins = f16(x.add(2)).mul_add(f16(y.add(2)), mins);
        }
        x = x.add(XB);
        y = y.add(YB);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    (lanes, mins)
}

/// The eight lanes and the minimum terms of the dot product of `nb` blocks of a row `x` with
/// activations `y`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x` must be readable for `nb` blocks of `kind` and `y` for
/// as many activation blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot(
    kind: LegacyKind,
    nb: usize,
    x: *const u8,
    y: *const u8,
) -> ([f32; 8], f32) {
    match kind {
        LegacyKind::Q4_0 => dot_impl::<0, 18, 34, false>(nb, x, y),
        LegacyKind::Q4_1 => dot_impl::<1, 20, 36, true>(nb, x, y),
        LegacyKind::Q5_0 => dot_impl::<2, 22, 34, false>(nb, x, y),
        LegacyKind::Q5_1 => dot_impl::<3, 24, 36, true>(nb, x, y),
        LegacyKind::Q8_0 => dot_impl::<4, 34, 34, false>(nb, x, y),
    }
}

/// One weight block's 32 quants as bytes ready for [`mul_sums`]: signed for Q4_0/Q5_0/Q8_0 (their
/// absolute values, the signs applied to the activations there), unsigned below 32 for Q4_1/Q5_1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_quants<const K: u8>(x: *const u8) -> __m256i {
    match K {
        0 => _mm256_sub_epi8(nibbles(x.add(2)), _mm256_set1_epi8(8)),
        1 => nibbles(x.add(4)),
        2 => {
            let high = _mm256_andnot_si256(bits_to_bytes(x.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
            _mm256_or_si256(nibbles(x.add(6)), high)
        }
        3 => {
            let high = _mm256_and_si256(bits_to_bytes(x.add(4)), _mm256_set1_epi8(0x10));
            _mm256_or_si256(nibbles(x.add(8)), high)
        }
        _ => _mm256_loadu_si256(x.add(2) as *const __m256i),
    }
}

/// The eight i32 sums of four products of a decoded block `qx` ([`block_quants`]) with the activation
/// block at `y`: the same exact integers as [`block_sums`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul_sums<const K: u8>(qx: __m256i, y: *const u8) -> __m256i {
    match K {
        1 | 3 => mul_sum_u8_i8(qx, _mm256_loadu_si256(y.add(4) as *const __m256i)),
        _ => mul_sum_i8(qx, _mm256_loadu_si256(y.add(2) as *const __m256i)),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4_impl<const K: u8, const XB: usize, const YB: usize, const MIN: bool>(
    nb: usize,
    mut x: *const u8,
    ys: [*const u8; 4],
) -> [([f32; 8], f32); 4] {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut mins = [0f32; 4];
    let mut y = ys;
    // Each activation row takes exactly the steps of `dot_impl`; only the weight block's decoding is
    // shared, and the four rows' chains interleave.
    let mut scales = [[0f32; 8]; 4];
    for _ in 0..nb / 8 {
        let xs = f16x8(x, XB);
        for k in 0..4 {
            _mm256_storeu_ps(scales[k].as_mut_ptr(), _mm256_mul_ps(xs, f16x8(y[k], YB)));
        }
        for b in 0..8 {
            let qx = block_quants::<K>(x);
            for (k, sk) in scales.iter().enumerate() {
                let sums = _mm256_cvtepi32_ps(mul_sums::<K>(qx, y[k]));
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(sk[b]), sums, acc[k]);
                if MIN {
                    mins[k] = f16(x.add(2)).mul_add(f16(y[k].add(2)), mins[k]);
                }
                y[k] = y[k].add(YB);
            }
            x = x.add(XB);
        }
    }
    for _ in 0..nb % 8 {
        let qx = block_quants::<K>(x);
        for k in 0..4 {
            let sums = _mm256_cvtepi32_ps(mul_sums::<K>(qx, y[k]));
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(f16(x) * f16(y[k])), sums, acc[k]);
            if MIN {
                mins[k] = f16(x.add(2)).mul_add(f16(y[k].add(2)), mins[k]);
            }
            y[k] = y[k].add(YB);
        }
        x = x.add(XB);
    }
    std::array::from_fn(|k| {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc[k]);
        (lanes, mins[k])
    })
}

/// [`dot`] of one row `x` with four activation rows at once (the same result for each; the row's
/// blocks are decoded once).
///
/// # Safety
/// As [`dot`], for each of the four activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot4(
    kind: LegacyKind,
    nb: usize,
    x: *const u8,
    ys: [*const u8; 4],
) -> [([f32; 8], f32); 4] {
    match kind {
        LegacyKind::Q4_0 => dot4_impl::<0, 18, 34, false>(nb, x, ys),
        LegacyKind::Q4_1 => dot4_impl::<1, 20, 36, true>(nb, x, ys),
        LegacyKind::Q5_0 => dot4_impl::<2, 22, 34, false>(nb, x, ys),
        LegacyKind::Q5_1 => dot4_impl::<3, 24, 36, true>(nb, x, ys),
        LegacyKind::Q8_0 => dot4_impl::<4, 34, 34, false>(nb, x, ys),
    }
}

/// The f16 at `p + k·stride` for `k < count` (at most 8) as f32, zero in the lanes above.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16xn(p: *const u8, stride: usize, count: usize) -> __m256 {
    if count == 8 {
        return f16x8(p, stride);
    }
    let mut h = [0u16; 8];
    for (k, v) in h.iter_mut().enumerate().take(count) {
        *v = (p.add(k * stride) as *const u16).read_unaligned();
    }
    _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr() as *const __m128i))
}

/// The eight sums of lanes of `acc`, each in ggml's `hsum_float_8` order (the order of
/// [`crate::quant::float::sum_lanes8`]: `((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7))`), as lane `i` of
/// the result for `acc[i]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum8x8(acc: &[__m256; 8]) -> __m256 {
    // Per 128-bit half, `l_k + l_{k+4}` (k = 0..4) of acc[i] (low half) and acc[i + 4] (high half).
    let halves = |i: usize| {
        _mm256_add_ps(
            _mm256_permute2f128_ps(acc[i], acc[i + 4], 0x20),
            _mm256_permute2f128_ps(acc[i], acc[i + 4], 0x31),
        )
    };
    let (u0, u1, u2, u3) = (halves(0), halves(1), halves(2), halves(3));
    // Per half: `[v0+v2, v1+v3]` of two accumulators side by side (ggml's movehl step).
    let pairs = |a: __m256, b: __m256| {
        _mm256_add_ps(
            _mm256_shuffle_ps(a, b, 0b01_00_01_00),
            _mm256_shuffle_ps(a, b, 0b11_10_11_10),
        )
    };
    let (z01, z23) = (pairs(u0, u1), pairs(u2, u3));
    // `(v0+v2) + (v1+v3)` (ggml's movehdup step; the two terms swap places, which addition allows).
    _mm256_add_ps(
        _mm256_shuffle_ps(z01, z23, 0b10_00_10_00),
        _mm256_shuffle_ps(z01, z23, 0b11_01_11_01),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_impl<const K: u8, const XB: usize, const YB: usize, const MIN: bool>(
    nb: usize,
    mut xs: [*const u8; TILE_ROWS],
    mut ys: [*const u8; TILE_ACTS],
) -> [f32; TILE_ROWS * TILE_ACTS] {
    // acc[r·TILE_ACTS + t]: weight row r with activation row t, each the lanes of `dot_impl`.
    let mut acc = [_mm256_setzero_ps(); TILE_ROWS * TILE_ACTS];
    let mut mins = [0f32; TILE_ROWS * TILE_ACTS];
    // The scale products `dx·dy` of up to eight blocks: scales[r·TILE_ACTS + t][block].
    let mut scales = [[0f32; 8]; TILE_ROWS * TILE_ACTS];
    let mut first = 0;
    while first < nb {
        let count = (nb - first).min(8);
        let dy: [__m256; TILE_ACTS] = std::array::from_fn(|t| f16xn(ys[t], YB, count));
        for (r, &x) in xs.iter().enumerate() {
            let dx = f16xn(x, XB, count);
            for (t, &d) in dy.iter().enumerate() {
                _mm256_storeu_ps(scales[r * TILE_ACTS + t].as_mut_ptr(), _mm256_mul_ps(dx, d));
            }
        }
        // `b` indexes the inner dimension of `scales` (one block of every pair of rows).
        #[allow(clippy::needless_range_loop)]
        for b in 0..count {
            for (r, x) in xs.iter_mut().enumerate() {
                let qx = block_quants::<K>(*x);
                for (t, &y) in ys.iter().enumerate() {
                    let i = r * TILE_ACTS + t;
                    let sums = _mm256_cvtepi32_ps(mul_sums::<K>(qx, y));
                    acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(scales[i][b]), sums, acc[i]);
                    if MIN {
                        mins[i] = f16(x.add(2)).mul_add(f16(y.add(2)), mins[i]);
                    }
                }
                *x = x.add(XB);
            }
            for y in ys.iter_mut() {
                *y = y.add(YB);
            }
        }
        first += count;
    }
    let mut out = [0f32; TILE_ROWS * TILE_ACTS];
    _mm256_storeu_ps(out.as_mut_ptr(), hsum8x8(&acc));
    if MIN {
        for (o, m) in out.iter_mut().zip(mins) {
            *o += m;
        }
    }
    out
}

/// The dot products of [`TILE_ROWS`] weight rows `xs` with [`TILE_ACTS`] activation rows `ys`, each
/// equal to [`dot`]'s lanes summed by `sum_lanes8` plus its minimum terms (the single-row result, bit for
/// bit): `out[r·TILE_ACTS + t]` for row `r` and activation row `t`. Each weight block is decoded once for
/// all activation rows and each activation block loaded once for all weight rows; the eight lane sums
/// are done together.
///
/// # Safety
/// As [`dot`], for each pair of a weight row and an activation row.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile(
    kind: LegacyKind,
    nb: usize,
    xs: [*const u8; TILE_ROWS],
    ys: [*const u8; TILE_ACTS],
) -> [f32; TILE_ROWS * TILE_ACTS] {
    match kind {
        LegacyKind::Q4_0 => tile_impl::<0, 18, 34, false>(nb, xs, ys),
        LegacyKind::Q4_1 => tile_impl::<1, 20, 36, true>(nb, xs, ys),
        LegacyKind::Q5_0 => tile_impl::<2, 22, 34, false>(nb, xs, ys),
        LegacyKind::Q5_1 => tile_impl::<3, 24, 36, true>(nb, xs, ys),
        LegacyKind::Q8_0 => tile_impl::<4, 34, 34, false>(nb, xs, ys),
    }
}
