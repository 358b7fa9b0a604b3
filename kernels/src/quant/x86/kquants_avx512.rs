//! AVX-512 VNNI dot products of Q4_K rows with Q8_K activations (the decode expert products), equal bit for
//! bit to the AVX2 and portable code.
//!
//! The integer work is exact whatever its grouping, so it is done the cheapest way 512-bit registers allow:
//! a super-block's 128 quant bytes are two `zmm` loads whose low and high nibbles are four vectors of two
//! 32-value sub-blocks each; `vpdpbusd` multiplies them with the activation bytes (rearranged once per
//! super-block to match, shared by the four rows) into sums of four products (at most 4·15·128, so they
//! fit i16); `vpackssdw` packs two such vectors into one of i16 and `vpdpwssd` multiplies by the sub-block
//! scales and accumulates: 8 multiply µops per row and super-block where AVX2 needs 16. The float work is
//! the same fused step per super-block as `kquants_avx2::q4k_rows_x4` (lane `r`: row `r`'s total, lane
//! `4 + r` its minimum total), so results are the same bits.
//!
//! Callers check `super::super::has_avx512_vnni()` first.

use core::arch::x86_64::*;

use crate::quant::float::sum_lanes8;
use crate::quant::kquants::Q8K_BYTES;

use super::kquants_avx2::q4k_scales_mins as scales_mins;

/// `vpshufb` masks building the i16 scale vectors of the packed sums from the eight 6-bit scales
/// broadcast as one u64 (bytes 0..8 of each 128-bit lane; index `0x80` writes zero, the high byte).
///
/// `vpackssdw(D0, D1)` holds, in 128-bit lane `k`, four sums of `D0` then four of `D1` from the same lane;
/// `D0`'s lanes 0..8 are its first sub-block, 8..16 its second. So mask `h` (0: sub-blocks 0..4, 1: 4..8)
/// gives lane `k` slots 0..4 the scale of sub-block `4h + 2·(k / 2)` and slots 4..8 that of the next one.
static SCALE_MASKS: [[u8; 64]; 2] = {
    let mut m = [[0u8; 64]; 2];
    let mut h = 0;
    while h < 2 {
        let mut b = 0;
        while b < 64 {
            let (lane, slot) = (b / 16, (b % 16) / 2);
            let sub = 4 * h + 2 * (lane / 2) + slot / 4;
            m[h][b] = if b % 2 == 0 { sub as u8 } else { 0x80 };
            b += 1;
        }
        h += 1;
    }
    m
};

/// `vpshufb` mask spreading the eight minimums (a u64 broadcast) as i16 pairs `[m0 m0 m1 m1 .. | m4 m4 ..]`,
/// for `vpmaddwd` with the activation's sixteen `bsums` (lane `c`: `min_c · (bsum_2c + bsum_2c+1)`).
static MIN_MASK: [u8; 32] = {
    let mut m = [0u8; 32];
    let mut b = 0;
    while b < 32 {
        let c = 4 * (b / 16) + (b % 16) / 4;
        m[b] = if b % 2 == 0 { c as u8 } else { 0x80 };
        b += 1;
    }
    m
};

/// The activation bytes of one Q8_K block rearranged to the nibble vectors' order: vector `v` holds
/// sub-blocks `(v % 2) + 4·(v / 2)` and the one two after it.
#[inline(always)]
unsafe fn act_vectors(q8: *const u8) -> [__m512i; 4] {
    let pair = |a: usize, b: usize| {
        let lo = _mm512_castsi256_si512(_mm256_loadu_si256(q8.add(a) as *const __m256i));
        _mm512_inserti64x4::<1>(lo, _mm256_loadu_si256(q8.add(b) as *const __m256i))
    };
    [pair(0, 64), pair(32, 96), pair(128, 192), pair(160, 224)]
}

/// The per-block constants the row kernels share.
struct Consts {
    m4: __m512i,
    scale_masks: [__m512i; 2],
    min_mask: __m256i,
}

#[inline(always)]
unsafe fn consts() -> Consts {
    Consts {
        m4: _mm512_set1_epi8(0x0F),
        scale_masks: [
            _mm512_loadu_si512(SCALE_MASKS[0].as_ptr() as *const __m512i),
            _mm512_loadu_si512(SCALE_MASKS[1].as_ptr() as *const __m512i),
        ],
        min_mask: _mm256_loadu_si256(MIN_MASK.as_ptr() as *const __m256i),
    }
}

/// One Q4_K super-block unpacked: its four nibble vectors (two sub-blocks each, in [`act_vectors`]'
/// order), its two i16 scale vectors for the packed sums, and its minimums as i16 pairs.
struct Q4kBlock {
    q: [__m512i; 4],
    scales: [__m512i; 2],
    min_pairs: __m256i,
}

#[inline(always)]
unsafe fn unpack_q4k(xb: *const u8, k: &Consts) -> Q4kBlock {
    let (scales, mins) = scales_mins(xb);
    let sc = _mm512_set1_epi64(scales as i64);
    let bits01 = _mm512_loadu_si512(xb.add(16) as *const __m512i);
    let bits23 = _mm512_loadu_si512(xb.add(80) as *const __m512i);
    Q4kBlock {
        q: [
            _mm512_and_si512(bits01, k.m4),
            _mm512_and_si512(_mm512_srli_epi16::<4>(bits01), k.m4),
            _mm512_and_si512(bits23, k.m4),
            _mm512_and_si512(_mm512_srli_epi16::<4>(bits23), k.m4),
        ],
        scales: [
            _mm512_shuffle_epi8(sc, k.scale_masks[0]),
            _mm512_shuffle_epi8(sc, k.scale_masks[1]),
        ],
        min_pairs: _mm256_shuffle_epi8(_mm256_set1_epi64x(mins as i64), k.min_mask),
    }
}

/// The integer lanes of an unpacked Q4_K super-block `b` against the rearranged activation `a` (eight
/// i32 lanes whose sum is `Σ_c scale_c · Σ q·q8` over the super-block), and its minimum lanes against
/// `bsums` (lane `c`: `min_c · (bsum_2c + bsum_2c+1)`).
#[inline(always)]
unsafe fn block_lanes(b: &Q4kBlock, a: &[__m512i; 4], bsums: __m256i) -> (__m256i, __m256i) {
    let mprod = _mm256_madd_epi16(bsums, b.min_pairs);
    let zero = _mm512_setzero_si512();
    let d0 = _mm512_dpbusd_epi32(zero, b.q[0], a[0]);
    let d1 = _mm512_dpbusd_epi32(zero, b.q[1], a[1]);
    let d2 = _mm512_dpbusd_epi32(zero, b.q[2], a[2]);
    let d3 = _mm512_dpbusd_epi32(zero, b.q[3], a[3]);
    // Sums of four products are at most 4·15·128 in magnitude: the packs are exact.
    let acc = _mm512_dpwssd_epi32(zero, _mm512_packs_epi32(d0, d1), b.scales[0]);
    let acc = _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(d2, d3), b.scales[1]);
    let lanes = _mm256_add_epi32(
        _mm512_castsi512_si256(acc),
        _mm512_extracti64x4_epi64::<1>(acc),
    );
    (lanes, mprod)
}

/// [`block_lanes`] of the Q4_K super-block at `xb`.
#[inline(always)]
unsafe fn row_lanes(
    xb: *const u8,
    a: &[__m512i; 4],
    bsums: __m256i,
    k: &Consts,
) -> (__m256i, __m256i) {
    block_lanes(&unpack_q4k(xb, k), a, bsums)
}

/// The Q4_K dot product of one row `x` with four activation rows `ys` (as `kquants_avx2::q4k_dot_x4`:
/// each super-block unpacked once for the four, their fused steps side by side in one vector, lane `k`
/// the same operations on the same exact totals as row `ys[k]` alone).
///
/// # Safety
/// As [`q4k_rows_x4`], for one row and each of the four activation rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q4k_dot_x4(nb: usize, x: *const u8, ys: [*const u8; 4]) -> [f32; 4] {
    let k = consts();
    let (mut acc, mut acc_min) = (_mm_setzero_ps(), _mm_setzero_ps());
    for i in 0..nb {
        let xb = x.add(i * 144);
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128((xb as *const i32).read_unaligned()));
        let (xd, xdmin) = (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)));
        let b = unpack_q4k(xb, &k);
        let mut sums = [_mm256_setzero_si256(); 4];
        let mut mprods = [_mm256_setzero_si256(); 4];
        let mut yd = [0f32; 4];
        for (r, &y) in ys.iter().enumerate() {
            let yb = y.add(i * Q8K_BYTES);
            let bsums = _mm256_loadu_si256(yb.add(260) as *const __m256i);
            (sums[r], mprods[r]) = block_lanes(&b, &act_vectors(yb.add(4)), bsums);
            yd[r] = (yb as *const f32).read_unaligned();
        }
        // The four totals side by side (exact integer sums, so any grouping gives the same value).
        let totals = |v: [__m256i; 4]| {
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            _mm_cvtepi32_ps(_mm_add_epi32(
                _mm256_castsi256_si128(h),
                _mm256_extracti128_si256::<1>(h),
            ))
        };
        let ydv = _mm_loadu_ps(yd.as_ptr());
        acc = _mm_fmadd_ps(totals(sums), _mm_mul_ps(_mm_set1_ps(xd), ydv), acc);
        acc_min = _mm_fmadd_ps(totals(mprods), _mm_mul_ps(_mm_set1_ps(xdmin), ydv), acc_min);
    }
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), _mm_sub_ps(acc, acc_min));
    out
}

/// The Q4_K dot product (the repacked gemv order: `kquants_avx2::q4k_rows_x4`) of four weight rows `xs`
/// with one activation row `y`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C; each row must be readable for `nb`
/// Q4_K blocks and `y` for `nb` Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q4k_rows_x4(nb: usize, xs: [*const u8; 4], y: *const u8) -> [f32; 4] {
    let k = consts();
    // The f16 pairs (d, dmin) of the four rows, read as four u32, to [d0 d1 d2 d3 dmin0 .. dmin3].
    let scale_order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    let mut acc = _mm256_setzero_ps();
    let [x0, x1, x2, x3] = xs;
    for i in 0..nb {
        let yb = y.add(i * Q8K_BYTES);
        let a = act_vectors(yb.add(4));
        let bsums = _mm256_loadu_si256(yb.add(260) as *const __m256i);
        let yd = (yb as *const f32).read_unaligned();
        let (b0, b1, b2, b3) = (
            x0.add(i * 144),
            x1.add(i * 144),
            x2.add(i * 144),
            x3.add(i * 144),
        );
        // The next four rows, a group ahead, as the AVX2 kernel does (prefetching never faults).
        let ahead = x3.wrapping_add(nb * 144 + i * 576);
        for line in 0..9 {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line) as *const i8);
        }
        let (s0, m0) = row_lanes(b0, &a, bsums, &k);
        let (s1, m1) = row_lanes(b1, &a, bsums, &k);
        let (s2, m2) = row_lanes(b2, &a, bsums, &k);
        let (s3, m3) = row_lanes(b3, &a, bsums, &k);
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

/// The Q4_K dot product of one row `x` with one activation row `y` (the repacked gemv order: one fused
/// step per super-block on its integer totals, as `kquants_avx2::dot` for Q4_K).
///
/// # Safety
/// As [`q4k_rows_x4`], for one row.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q4k_dot(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let k = consts();
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for i in 0..nb {
        let (xb, yb) = (x.add(i * 144), y.add(i * Q8K_BYTES));
        let a = act_vectors(yb.add(4));
        let bsums = _mm256_loadu_si256(yb.add(260) as *const __m256i);
        let (s, m) = row_lanes(xb, &a, bsums, &k);
        // Both totals at once: [s halves | m halves] then pairwise adds (exact integers).
        let h = _mm256_hadd_epi32(s, m);
        let h = _mm256_hadd_epi32(h, h);
        let t = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        let (total, min_total) = (_mm_cvtsi128_si32(t), _mm_extract_epi32::<1>(t));
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128((xb as *const i32).read_unaligned()));
        let (xd, xdmin) = (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)));
        let yd = (yb as *const f32).read_unaligned();
        acc = (total as f32).mul_add(xd * yd, acc);
        acc_min = (min_total as f32).mul_add(xdmin * yd, acc_min);
    }
    acc - acc_min
}

/// The Q4_K dot product in llama.cpp's repacked gemm order (`kquants_avx2::q4k_dot_gemm4_x4`: one fused
/// step per pair of 32-value sub-blocks, on its integer totals) of one row `x` with four activation rows
/// `ys`. The two scaled vectors of a super-block hold one pair per 256-bit half (`vpackssdw` keeps 128-bit
/// lanes 0, 1 for the first sub-blocks of its inputs and 2, 3 for the second ones), so the halves are the
/// four pairs' lanes.
///
/// # Safety
/// As [`q4k_dot_x4`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q4k_dot_gemm4_x4(nb: usize, x: *const u8, ys: [*const u8; 4]) -> [f32; 4] {
    let k = consts();
    let (mut acc, mut acc_min) = (_mm_setzero_ps(), _mm_setzero_ps());
    let zero = _mm512_setzero_si512();
    for i in 0..nb {
        let xb = x.add(i * 144);
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128((xb as *const i32).read_unaligned()));
        let (xd, xdmin) = (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)));
        let b = unpack_q4k(xb, &k);
        // Per activation row: its four pair totals, and its minimum products summed per pair.
        let mut t = [_mm_setzero_si128(); 4];
        let mut m = [_mm_setzero_si128(); 4];
        let mut yd = [0f32; 4];
        for (r, &y) in ys.iter().enumerate() {
            let yb = y.add(i * Q8K_BYTES);
            let a = act_vectors(yb.add(4));
            let d: [__m512i; 4] = core::array::from_fn(|v| _mm512_dpbusd_epi32(zero, b.q[v], a[v]));
            let acc01 = _mm512_dpwssd_epi32(zero, _mm512_packs_epi32(d[0], d[1]), b.scales[0]);
            let acc23 = _mm512_dpwssd_epi32(zero, _mm512_packs_epi32(d[2], d[3]), b.scales[1]);
            let p = [
                _mm512_castsi512_si256(acc01),
                _mm512_extracti64x4_epi64::<1>(acc01),
                _mm512_castsi512_si256(acc23),
                _mm512_extracti64x4_epi64::<1>(acc23),
            ];
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
            t[r] = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
            let bsums = _mm256_loadu_si256(yb.add(260) as *const __m256i);
            let mprod = _mm256_madd_epi16(bsums, b.min_pairs);
            // [m0+m1, m2+m3, ..] per half: pairs 0, 1 low, pairs 2, 3 high.
            let mh = _mm256_hadd_epi32(mprod, mprod);
            m[r] = _mm_unpacklo_epi64(
                _mm256_castsi256_si128(mh),
                _mm256_extracti128_si256::<1>(mh),
            );
            yd[r] = (yb as *const f32).read_unaligned();
        }
        // Transpose so vector p holds pair p of the four rows.
        let tr = |v: [__m128i; 4]| -> [__m128; 4] {
            let (a, b, c, d) = (
                _mm_castsi128_ps(v[0]),
                _mm_castsi128_ps(v[1]),
                _mm_castsi128_ps(v[2]),
                _mm_castsi128_ps(v[3]),
            );
            let (ab_lo, ab_hi) = (_mm_unpacklo_ps(a, b), _mm_unpackhi_ps(a, b));
            let (cd_lo, cd_hi) = (_mm_unpacklo_ps(c, d), _mm_unpackhi_ps(c, d));
            [
                _mm_movelh_ps(ab_lo, cd_lo),
                _mm_movehl_ps(cd_lo, ab_lo),
                _mm_movelh_ps(ab_hi, cd_hi),
                _mm_movehl_ps(cd_hi, ab_hi),
            ]
        };
        let (tp, mp) = (tr(t), tr(m));
        let ydv = _mm_loadu_ps(yd.as_ptr());
        let (d, dmin) = (
            _mm_mul_ps(_mm_set1_ps(xd), ydv),
            _mm_mul_ps(_mm_set1_ps(xdmin), ydv),
        );
        for p in 0..4 {
            acc = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_castps_si128(tp[p])), d, acc);
            acc_min = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_castps_si128(mp[p])), dmin, acc_min);
        }
    }
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), _mm_sub_ps(acc, acc_min));
    out
}

/// `vpermw` indices of the Q6_K scale vectors: vector `m` (chunks `2m`, `2m + 1` of 32 values) gives i32
/// lane `L` the scale of 16-value group `4m + L/4` in its low i16 (even slots; the odd ones are zeroed by
/// the mask, so `vpdpwssd` multiplies the lane's sum, which fits i16, by its scale).
static Q6K_SCALE_IDX: [[u16; 32]; 4] = {
    let mut m = [[0u16; 32]; 4];
    let mut v = 0;
    while v < 4 {
        let mut t = 0;
        while t < 32 {
            m[v][t] = (4 * v + t / 8) as u16;
            t += 1;
        }
        v += 1;
    }
    m
};

/// The Q6_K dot product of one row `x` with one activation row `y`, with the lanes of
/// `kquants_avx2::dot` (lane `l`: `Σ_c scale · Σ_{4l..4l+4} q·q8` less `32·Σ scale·bsum` of groups `2l`,
/// `2l + 1`) and its fused float step per super-block into eight lanes, so the same bits.
///
/// A 64-byte load of `ql` holds chunks `4j`, `4j + 1` (low nibbles) and `4j + 2`, `4j + 3` (high); their
/// two high bits come from the 32 `qh` bytes, in both halves, masked and shifted per half. `vpdpbusd`
/// sums four products (at most 4·63·128: fits i16), `vpdpwssd` scales them; the two halves of the sum
/// are the two chunks' lanes, added as the AVX2 code adds its chunks.
///
/// # Safety
/// As [`q4k_rows_x4`], for one Q6_K row.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q6k_dot(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let m15 = _mm512_set1_epi8(15);
    // Per 256-bit half: the qh bits of the low-nibble chunks (0x03, then 0x0C) and of the high ones
    // (0x30, then 0xC0), and the shifts bringing them to bits 4..6.
    let half = |lo: i64, hi: i64| _mm512_setr_epi64(lo, lo, lo, lo, hi, hi, hi, hi);
    let mask_lo = half(0x0303_0303_0303_0303, 0x0C0C_0C0C_0C0C_0C0C);
    let mask_hi = half(0x3030_3030_3030_3030, 0xC0C0_C0C0_C0C0_C0C0_u64 as i64);
    let shl_lo = half(0x0004_0004_0004_0004, 0x0002_0002_0002_0002);
    let shr_hi = half(0, 0x0002_0002_0002_0002);
    let idx: [__m512i; 4] =
        core::array::from_fn(|m| _mm512_loadu_si512(Q6K_SCALE_IDX[m].as_ptr() as *const __m512i));
    let zero = _mm512_setzero_si512();
    let mut acc = _mm256_setzero_ps();
    // Rows of a matrix×vector product are consecutive: fetch the row about 4 KiB ahead at the pace of
    // this one (the hardware prefetchers ramp up too late on rows of a few cache lines; measured on the
    // Xeon host: single-row Q4_K decode products 48 GB/s on 16 threads without, 72 with the four-row
    // kernel's prefetch). Prefetching never faults.
    let ahead = x.wrapping_add((4096 / (nb * 210).max(1)).max(1) * nb * 210);
    for i in 0..nb {
        let (xb, yb) = (x.add(i * 210), y.add(i * Q8K_BYTES));
        for off in [0, 64, 128, 192, 209] {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(i * 210 + off) as *const i8);
        }
        let q8 = yb.add(4);
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(xb.add(192) as *const __m128i));
        let bsums = _mm256_loadu_si256(yb.add(260) as *const __m256i);
        let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, sc16));
        let sc = _mm512_castsi256_si512(sc16);
        let mut sum = zero;
        for j in 0..2 {
            let ql = _mm512_loadu_si512(xb.add(64 * j) as *const __m512i);
            let qh =
                _mm512_broadcast_i64x4(_mm256_loadu_si256(xb.add(128 + 32 * j) as *const __m256i));
            let q_lo = _mm512_or_si512(
                _mm512_and_si512(ql, m15),
                _mm512_sllv_epi16(_mm512_and_si512(qh, mask_lo), shl_lo),
            );
            let q_hi = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m15),
                _mm512_srlv_epi16(_mm512_and_si512(qh, mask_hi), shr_hi),
            );
            for (h, q) in [q_lo, q_hi].into_iter().enumerate() {
                let a = _mm512_loadu_si512(q8.add(128 * j + 64 * h) as *const __m512i);
                let d = _mm512_dpbusd_epi32(zero, q, a);
                let s = _mm512_maskz_permutexvar_epi16(0x5555_5555, idx[2 * j + h], sc);
                sum = _mm512_dpwssd_epi32(sum, d, s);
            }
        }
        let lanes = _mm256_sub_epi32(
            _mm256_add_epi32(
                _mm512_castsi512_si256(sum),
                _mm512_extracti64x4_epi64::<1>(sum),
            ),
            offset,
        );
        let xd = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            (xb.add(208) as *const u16).read_unaligned() as i32,
        )));
        let yd = (yb as *const f32).read_unaligned();
        acc = _mm256_fmadd_ps(_mm256_set1_ps(yd * xd), _mm256_cvtepi32_ps(lanes), acc);
    }
    let mut a = [0f32; 8];
    _mm256_storeu_ps(a.as_mut_ptr(), acc);
    sum_lanes8(&a) - sum_lanes8(&[0f32; 8])
}

#[cfg(test)]
mod tests {
    use crate::quant::kquants::Q8K_BYTES;
    use crate::quant::{fill_random, has_avx512_vnni, ActType, GgmlType};
    use crate::rng::Rng;

    /// Random Q4_K rows (`rows × n` values, several scale ranges) and a random Q8_K activation row.
    fn case(rng: &mut Rng, rows: usize, n: usize, rms: f32) -> (Vec<u8>, Vec<u8>) {
        let mut w = vec![0u8; rows * n / 256 * 144];
        fill_random(GgmlType::Q4_K, rng, rms, &mut w).expect("fill");
        // Activations with outliers, so the Q8_K bytes reach ±127.
        let x: Vec<f32> = (0..n)
            .map(|i| rng.normal() * if i % 37 == 0 { 20.0 } else { 1.0 })
            .collect();
        let mut act = vec![0u8; n / 256 * Q8K_BYTES];
        ActType::Q8_K.quantize(&x, &mut act);
        (w, act)
    }

    /// The kernel's data layout (rearranged activations, nibble vectors, packs, scale and minimum masks),
    /// replayed with the instructions' definitions on plain arrays, gives the exact integer totals of the
    /// portable code: checks the layout on CPUs without AVX-512 too.
    #[test]
    fn q4k_layout_model_gives_exact_totals() {
        use crate::quant::kquants::scales_mins_k4;
        let mut rng = Rng::new(3);
        let (w, act) = case(&mut rng, 8, 256, 0.05);
        let shuffle = |src: &[u8], mask: &[u8]| -> Vec<u8> {
            (0..mask.len())
                .map(|b| {
                    let m = mask[b];
                    if m & 0x80 != 0 {
                        0
                    } else {
                        src[16 * (b / 16) + (m & 15) as usize]
                    }
                })
                .collect()
        };
        let i16s = |v: &[u8]| -> Vec<i32> {
            v.chunks_exact(2)
                .map(|p| i16::from_le_bytes([p[0], p[1]]) as i32)
                .collect()
        };
        let q8 = &act[4..260];
        let bsums: Vec<i32> = i16s(&act[260..292]);
        for xb in w.chunks_exact(144) {
            // SAFETY: `xb` holds one Q4_K block (reads bytes 4..16).
            let (scales, mins) = unsafe { super::scales_mins(xb.as_ptr()) };
            let (sc, mn) = scales_mins_k4(&xb[4..16]);
            assert_eq!(scales.to_le_bytes(), sc);
            assert_eq!(mins.to_le_bytes(), mn);
            let a: Vec<Vec<u8>> = [(0, 64), (32, 96), (128, 192), (160, 224)]
                .iter()
                .map(|&(p, q)| [&q8[p..p + 32], &q8[q..q + 32]].concat())
                .collect();
            let qs = &xb[16..144];
            let nib = |h: usize, hi: bool| -> Vec<u8> {
                qs[64 * h..64 * h + 64]
                    .iter()
                    .map(|&b| if hi { b >> 4 } else { b & 15 })
                    .collect()
            };
            let dpbusd = |u: &[u8], s: &[u8]| -> Vec<i32> {
                (0..16)
                    .map(|l| {
                        (0..4)
                            .map(|j| u[4 * l + j] as i32 * s[4 * l + j] as i8 as i32)
                            .sum()
                    })
                    .collect()
            };
            let d = [
                dpbusd(&nib(0, false), &a[0]),
                dpbusd(&nib(0, true), &a[1]),
                dpbusd(&nib(1, false), &a[2]),
                dpbusd(&nib(1, true), &a[3]),
            ];
            let packs = |d0: &[i32], d1: &[i32]| -> Vec<i32> {
                (0..32)
                    .map(|i| {
                        let (k, t) = (i / 8, i % 8);
                        let v = if t < 4 {
                            d0[4 * k + t]
                        } else {
                            d1[4 * k + t - 4]
                        };
                        assert!(v.abs() < 32768, "pack saturates");
                        v
                    })
                    .collect()
            };
            let bcast: Vec<u8> = (0..64).map(|b| scales.to_le_bytes()[b % 8]).collect();
            let mut total = 0i32;
            // Pair totals from the 256-bit halves (i16 slots 0..16 and 16..32) of the two scaled vectors.
            let mut pairs = [0i32; 4];
            for h in 0..2 {
                let p = packs(&d[2 * h], &d[2 * h + 1]);
                let s = i16s(&shuffle(&bcast, &super::SCALE_MASKS[h]));
                for (i, (a, b)) in p.iter().zip(&s).enumerate() {
                    total += a * b;
                    pairs[2 * h + i / 16] += a * b;
                }
            }
            let mbcast: Vec<u8> = (0..32).map(|b| mins.to_le_bytes()[b % 8]).collect();
            let mpairs = i16s(&shuffle(&mbcast, &super::MIN_MASK));
            let min_total: i32 = mpairs.iter().zip(&bsums).map(|(a, b)| a * b).sum();
            let sub = |c: usize| -> i32 {
                let dot: i32 = (0..32)
                    .map(|e| {
                        let q = (qs[32 * (c / 2) + e] >> (4 * (c % 2))) & 15;
                        q as i32 * q8[32 * c + e] as i8 as i32
                    })
                    .sum();
                sc[c] as i32 * dot
            };
            let want_pairs: Vec<i32> = (0..4).map(|p| sub(2 * p) + sub(2 * p + 1)).collect();
            assert_eq!(pairs.to_vec(), want_pairs, "pair totals per 256-bit half");
            let want: i32 = (0..8)
                .map(|c| {
                    let dot: i32 = (0..32)
                        .map(|e| {
                            let v = 32 * c + e;
                            let q = (qs[32 * (c / 2) + e] >> (4 * (c % 2))) & 15;
                            q as i32 * q8[v] as i8 as i32
                        })
                        .sum();
                    sc[c] as i32 * dot
                })
                .sum();
            let want_min: i32 = (0..8)
                .map(|c| mn[c] as i32 * (bsums[2 * c] + bsums[2 * c + 1]))
                .sum();
            assert_eq!((total, min_total), (want, want_min));
        }
    }

    /// The AVX-512 kernels give the portable code's bits on random blocks (skipped without AVX-512 VNNI).
    #[test]
    fn q4k_avx512_equals_portable() {
        if !has_avx512_vnni() {
            eprintln!("skipped: this CPU lacks AVX-512 VNNI (or --cpu-avx512 off)");
            return;
        }
        let ops = GgmlType::Q4_K.ops().expect("Q4_K computes");
        let mut rng = Rng::new(17);
        for (n, rms) in [(256, 0.02f32), (2048, 1.0), (768, 1e-3), (4096, 0.05)] {
            let rows = 16;
            let (w, act) = case(&mut rng, rows, n, rms);
            let rb = n / 256 * 144;
            let row = |r: usize| &w[r * rb..(r + 1) * rb];
            for r in (0..rows).step_by(4) {
                // SAFETY: AVX-512 VNNI checked above; rows and activation hold n / 256 blocks each.
                let got = unsafe {
                    super::q4k_rows_x4(
                        n / 256,
                        [row(r), row(r + 1), row(r + 2), row(r + 3)].map(|x| x.as_ptr()),
                        act.as_ptr(),
                    )
                };
                for (j, &g) in got.iter().enumerate() {
                    let want = (ops.vec_dot_portable)(n, row(r + j), &act);
                    assert_eq!(g.to_bits(), want.to_bits(), "rows_x4 n {n} row {}", r + j);
                    // SAFETY: as above.
                    let one = unsafe { super::q4k_dot(n / 256, row(r + j).as_ptr(), act.as_ptr()) };
                    assert_eq!(one.to_bits(), want.to_bits(), "dot n {n} row {}", r + j);
                }
            }
            // One row against four activation rows: the Q8_K rows of four random vectors.
            let acts: Vec<Vec<u8>> = (0..4).map(|_| case(&mut rng, 0, n, 1.0).1).collect();
            for r in 0..rows {
                // SAFETY: as above, for each of the four activation rows.
                let got = unsafe {
                    super::q4k_dot_x4(
                        n / 256,
                        row(r).as_ptr(),
                        std::array::from_fn(|k| acts[k].as_ptr()),
                    )
                };
                for (k, &g) in got.iter().enumerate() {
                    let want = (ops.vec_dot_portable)(n, row(r), &acts[k]);
                    assert_eq!(g.to_bits(), want.to_bits(), "dot_x4 n {n} row {r} act {k}");
                }
                // The repacked gemm order.
                let gemm4 = crate::quant::batch_dot(GgmlType::Q4_K).expect("Q4_K batch order");
                // SAFETY: as above.
                let got = unsafe {
                    super::q4k_dot_gemm4_x4(
                        n / 256,
                        row(r).as_ptr(),
                        std::array::from_fn(|k| acts[k].as_ptr()),
                    )
                };
                for (k, &g) in got.iter().enumerate() {
                    let want = (gemm4.portable)(n, row(r), &acts[k]);
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "gemm4_x4 n {n} row {r} act {k}"
                    );
                }
            }
        }
    }

    /// The Q6_K kernel gives the portable code's bits on random blocks (skipped without AVX-512 VNNI).
    #[test]
    fn q6k_avx512_equals_portable() {
        if !has_avx512_vnni() {
            eprintln!("skipped: this CPU lacks AVX-512 VNNI (or --cpu-avx512 off)");
            return;
        }
        let ops = GgmlType::Q6_K.ops().expect("Q6_K computes");
        let mut rng = Rng::new(19);
        for (n, rms) in [(256, 0.02f32), (2048, 1.0), (768, 1e-3), (4096, 0.05)] {
            let mut w = vec![0u8; 8 * n / 256 * 210];
            fill_random(GgmlType::Q6_K, &mut rng, rms, &mut w).expect("fill");
            let x: Vec<f32> = (0..n)
                .map(|i| rng.normal() * if i % 41 == 0 { 20.0 } else { 1.0 })
                .collect();
            let mut act = vec![0u8; n / 256 * Q8K_BYTES];
            ActType::Q8_K.quantize(&x, &mut act);
            for row in w.chunks_exact(n / 256 * 210) {
                let want = (ops.vec_dot_portable)(n, row, &act);
                // SAFETY: AVX-512 VNNI checked above; the row and activation hold n / 256 blocks each.
                let got = unsafe { super::q6k_dot(n / 256, row.as_ptr(), act.as_ptr()) };
                assert_eq!(got.to_bits(), want.to_bits(), "n {n}: {got} vs {want}");
            }
        }
    }

    /// The Q6_K kernel's layout (per-half qh masks and shifts, the `vpermw` scale vectors, the halves'
    /// fold), replayed with the instructions' definitions on plain arrays, gives the portable lanes.
    #[test]
    fn q6k_layout_model_gives_exact_lanes() {
        use crate::quant::kquants::{block_lanes, KKind};
        let mut rng = Rng::new(23);
        let mut w = vec![0u8; 4 * 210];
        fill_random(GgmlType::Q6_K, &mut rng, 0.05, &mut w).expect("fill");
        let x: Vec<f32> = (0..256).map(|_| rng.normal()).collect();
        let mut act = vec![0u8; Q8K_BYTES];
        ActType::Q8_K.quantize(&x, &mut act);
        let q8 = &act[4..260];
        let bsums: Vec<i32> = (0..16)
            .map(|k| i16::from_le_bytes([act[260 + 2 * k], act[261 + 2 * k]]) as i32)
            .collect();
        for xb in w.chunks_exact(210) {
            let sc: Vec<i32> = xb[192..208].iter().map(|&b| b as i8 as i32).collect();
            let mut sum = [0i32; 16];
            for j in 0..2 {
                let ql = &xb[64 * j..64 * j + 64];
                let qh = &xb[128 + 32 * j..160 + 32 * j];
                for h in 0..2 {
                    // Byte b: half b / 32; masks 0x03/0x0C (h = 0, shifted left 4/2), 0x30/0xC0 (right 0/2).
                    let q: Vec<u8> = (0..64)
                        .map(|b| {
                            let (half, hb) = (b / 32, qh[b % 32]);
                            let high = if h == 0 {
                                (hb & [0x03, 0x0C][half]) << [4, 2][half]
                            } else {
                                (hb & [0x30, 0xC0][half]) >> [0, 2][half]
                            };
                            let low = if h == 0 { ql[b] & 15 } else { ql[b] >> 4 };
                            low | high
                        })
                        .collect();
                    let a = &q8[128 * j + 64 * h..128 * j + 64 * h + 64];
                    let idx = &super::Q6K_SCALE_IDX[2 * j + h];
                    for (l, s) in sum.iter_mut().enumerate() {
                        let d: i32 = (0..4)
                            .map(|k| q[4 * l + k] as i32 * a[4 * l + k] as i8 as i32)
                            .sum();
                        assert!(d.abs() < 32768);
                        *s += d * sc[idx[2 * l] as usize];
                    }
                }
            }
            let lanes: Vec<i32> = (0..8)
                .map(|l| {
                    let off = sc[2 * l] * bsums[2 * l] + sc[2 * l + 1] * bsums[2 * l + 1];
                    sum[l] + sum[l + 8] - 32 * off
                })
                .collect();
            assert_eq!(lanes, block_lanes(KKind::Q6K, xb, &act).0.to_vec());
        }
    }
}
