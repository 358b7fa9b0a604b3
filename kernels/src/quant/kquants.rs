//! The K-quant formats (super-blocks of 256): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and the Q8_K activation format.
//!
//! Every K-quant row meets Q8_K activations (f32 `d`, 256 × i8, 16 × i16 sums of 16 quants). The dot
//! product keeps eight lanes, the eight i32 lanes of llama.cpp's AVX2 kernels: per super-block, lane `l`
//! holds the exact integer `Σ scale · q · q8` over elements `4l .. 4l+3` of each of the eight 32-value
//! chunks (quants taken without their offset), less, for Q3_K and Q6_K (offsets 4 and 32),
//! `offset · (scale₂ₗ·bsum₂ₗ + scale₂ₗ₊₁·bsum₂ₗ₊₁)` over the 16-value groups; for the formats with
//! minimums a second set of lanes holds `Σ min · bsum` (Q2_K: `min₂ₗ·bsum₂ₗ + min₂ₗ₊₁·bsum₂ₗ₊₁`;
//! Q4_K/Q5_K: `minₗ · (bsum₂ₗ + bsum₂ₗ₊₁)`).
//!
//! The float work is per format, each as llama.cpp computes it on an AVX2 CPU, so results are llama.cpp's
//! bit for bit where noted:
//!
//! - Q6_K (`ggml_vec_dot_q6_K_q8_K`): each super-block adds `fma(yd·xd, lane, acc)` to eight f32 lanes;
//!   the result is `sum_lanes8` of them. Bit for bit.
//! - Q4_K: llama.cpp repacks Q4_K matrices (`CPU_REPACK`, 8×8 interleaving) and multiplies with
//!   `ggml_gemv_q4_K_8x8_q8_K` for single activation rows and `ggml_gemm_q4_K_8x8_q8_K` for groups of
//!   four. The gemv order ([`vec_dot`] here) takes each super-block's integer total `T` and min total
//!   `M` and accumulates `acc = fma(T, xd·yd, acc)`, `accm = fma(M, xdmin·yd, accm)`; the gemm order
//!   ([`q4k_vec_dot_gemm4`]) does the same per 64-value half-pair of sub-blocks. The result is
//!   `acc − accm`. Bit for bit.
//! - Q5_K: `ggml_vec_dot_q5_K_q8_K`'s order, in `kquants_ggml`. Bit for bit.
//! - Q2_K, Q3_K: each super-block adds `(yd·xd) · lane` to eight f32 lanes and `(yd·xdmin) · lane`
//!   to eight more (multiply then add, never fused); the result is `sum_lanes8(scale lanes) −
//!   sum_lanes8(min lanes)`: close to llama.cpp's, not equal.
//!
//! The AVX2 code (`x86/kquants_avx2.rs`) holds exactly these lanes in its vectors and does the same float
//! work, so it equals the portable code bit for bit.

use super::float::sum_lanes8;
use super::{f16_at, put_f16, ActType, BatchDot, Dot4, GgmlType, QuantOps};
use crate::rng::Rng;

mod dot8;
mod rows8;
mod tile;
pub use dot8::{dot8, Dot8};
pub use rows8::{rows8, rows8_bytes, Rows8};
pub use tile::{ktile, KTile, Tiles, TILE_ROWS};

/// Values per super-block.
pub(crate) const QK_K: usize = 256;
/// Bytes per Q8_K activation block.
pub(crate) const Q8K_BYTES: usize = 292;

/// The K-quant formats of this family.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum KKind {
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl KKind {
    /// Bytes per super-block.
    pub(crate) const fn block_bytes(self) -> usize {
        match self {
            KKind::Q2K => 84,
            KKind::Q3K => 110,
            KKind::Q4K => 144,
            KKind::Q5K => 176,
            KKind::Q6K => 210,
        }
    }
}

macro_rules! k_ops {
    ($name:ident, $kind:expr, $deq:ident, $dot:ident, $portable:ident, $fill:ident) => {
        static $name: QuantOps = QuantOps {
            dequantize: $deq,
            act: ActType::Q8_K,
            vec_dot: $dot,
            vec_dot_portable: $portable,
            fill_random: $fill,
        };
        fn $dot(n: usize, row: &[u8], act: &[u8]) -> f32 {
            vec_dot($kind, n, row, act)
        }
        fn $portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
            vec_dot_portable($kind, n, row, act)
        }
        fn $fill(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
            fill_random($kind, rng, rms, dst)
        }
    };
}

k_ops!(
    Q2K_OPS,
    KKind::Q2K,
    dequantize_q2_k,
    dot_q2_k,
    portable_q2_k,
    fill_q2_k
);
k_ops!(
    Q3K_OPS,
    KKind::Q3K,
    dequantize_q3_k,
    dot_q3_k,
    portable_q3_k,
    fill_q3_k
);
k_ops!(
    Q4K_OPS,
    KKind::Q4K,
    dequantize_q4_k,
    dot_q4_k,
    portable_q4_k,
    fill_q4_k
);
k_ops!(
    Q5K_OPS,
    KKind::Q5K,
    dequantize_q5_k,
    dot_q5_k,
    portable_q5_k,
    fill_q5_k
);
k_ops!(
    Q6K_OPS,
    KKind::Q6K,
    dequantize_q6_k,
    dot_q6_k,
    portable_q6_k,
    fill_q6_k
);

/// The operations of this family's types.
pub(crate) fn ops(ty: GgmlType) -> Option<&'static QuantOps> {
    match ty {
        GgmlType::Q2_K => Some(&Q2K_OPS),
        GgmlType::Q3_K => Some(&Q3K_OPS),
        GgmlType::Q4_K => Some(&Q4K_OPS),
        GgmlType::Q5_K => Some(&Q5K_OPS),
        GgmlType::Q6_K => Some(&Q6K_OPS),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------------------
// Layout helpers.

/// The eight 6-bit scales and eight 6-bit mins of Q4_K/Q5_K, packed in 12 bytes.
#[inline(always)]
pub(crate) fn scales_mins_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        mn[j] = s[j + 4] & 0x3F;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

/// The sixteen 6-bit scales of Q3_K (0..63, stored with an offset of 32), packed in 12 bytes.
#[inline(always)]
pub(crate) fn scales_q3_k(s: &[u8]) -> [u8; 16] {
    std::array::from_fn(|k| {
        let low = if k < 8 { s[k] & 0x0F } else { s[k - 8] >> 4 };
        let high = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        low | (high << 4)
    })
}

/// The 256 quants of a super-block whose 2-bit fields are packed four to a byte in two 32-byte halves:
/// element `128h + 32s + l` is bits `2s..2s+2` of `qs[32h + l]`.
#[inline(always)]
fn crumbs(qs: &[u8]) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for h in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                q[128 * h + 32 * s + l] = (qs[32 * h + l] >> (2 * s)) & 3;
            }
        }
    }
    q
}

/// Bit `e / 32` of `bits[e % 32]` for each of the 256 elements (the high-bit planes of Q3_K and Q5_K).
#[inline(always)]
fn bit_planes(bits: &[u8]) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for b in 0..8 {
        for l in 0..32 {
            q[32 * b + l] = (bits[l] >> b) & 1;
        }
    }
    q
}

/// The 256 nibbles of Q4_K/Q5_K: sub-block `s` is the low (even `s`) or high (odd `s`) nibbles of bytes
/// `32·(s/2) .. 32·(s/2)+32`.
#[inline(always)]
fn nibbles_k(qs: &[u8]) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for c in 0..4 {
        for l in 0..32 {
            q[64 * c + l] = qs[32 * c + l] & 0x0F;
            q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
    }
    q
}

/// The 256 six-bit quants of Q6_K (0..63, stored with an offset of 32).
#[inline(always)]
fn sixes(ql: &[u8], qh: &[u8]) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for h in 0..2 {
        let (ql, qh) = (&ql[64 * h..64 * h + 64], &qh[32 * h..32 * h + 32]);
        let q = &mut q[128 * h..128 * h + 128];
        for l in 0..32 {
            q[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
            q[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
            q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    q
}

// ---------------------------------------------------------------------------------------------------------
// Dequantization: the same f32 operations, in the same order, as gguf-py's numpy code.

fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    for (b, o) in src.chunks_exact(84).zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (f16_at(&b[80..]), f16_at(&b[82..]));
        let q = crumbs(&b[16..80]);
        for (k, (o, q)) in o.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            let dl = d * (b[k] & 0x0F) as f32;
            let ml = dmin * (b[k] >> 4) as f32;
            for (o, &q) in o.iter_mut().zip(q) {
                *o = dl * q as f32 - ml;
            }
        }
    }
}

fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    for (b, o) in src.chunks_exact(110).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(&b[108..]);
        let sc = scales_q3_k(&b[96..108]);
        let (low, high) = (crumbs(&b[32..96]), bit_planes(&b[0..32]));
        for (k, o) in o.chunks_exact_mut(16).enumerate() {
            let dl = d * (sc[k] as i32 - 32) as f32;
            for (i, o) in o.iter_mut().enumerate() {
                let e = 16 * k + i;
                let q = low[e] as i32 - if high[e] == 0 { 4 } else { 0 };
                *o = dl * q as f32;
            }
        }
    }
}

fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    for (b, o) in src.chunks_exact(144).zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (f16_at(b), f16_at(&b[2..]));
        let (sc, mn) = scales_mins_k4(&b[4..16]);
        let q = nibbles_k(&b[16..144]);
        for (s, (o, q)) in o.chunks_exact_mut(32).zip(q.chunks_exact(32)).enumerate() {
            let (dl, ml) = (d * sc[s] as f32, dmin * mn[s] as f32);
            for (o, &q) in o.iter_mut().zip(q) {
                *o = dl * q as f32 - ml;
            }
        }
    }
}

fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    for (b, o) in src.chunks_exact(176).zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (f16_at(b), f16_at(&b[2..]));
        let (sc, mn) = scales_mins_k4(&b[4..16]);
        let (low, high) = (nibbles_k(&b[48..176]), bit_planes(&b[16..48]));
        for (s, o) in o.chunks_exact_mut(32).enumerate() {
            let (dl, ml) = (d * sc[s] as f32, dmin * mn[s] as f32);
            for (l, o) in o.iter_mut().enumerate() {
                let e = 32 * s + l;
                *o = dl * (low[e] | (high[e] << 4)) as f32 - ml;
            }
        }
    }
}

fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    for (b, o) in src.chunks_exact(210).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(&b[208..]);
        let q = sixes(&b[0..128], &b[128..192]);
        for (k, (o, q)) in o.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            let dl = d * (b[192 + k] as i8) as f32;
            for (o, &q) in o.iter_mut().zip(q) {
                *o = dl * (q as i32 - 32) as f32;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Dot products.

/// The activation's scale.
#[inline(always)]
pub(crate) fn q8k_d(y: &[u8]) -> f32 {
    f32::from_le_bytes([y[0], y[1], y[2], y[3]])
}

/// The activation's 16 sums of 16 quants.
#[inline(always)]
fn q8k_bsums(y: &[u8]) -> [i32; 16] {
    std::array::from_fn(|k| i16::from_le_bytes([y[260 + 2 * k], y[261 + 2 * k]]) as i32)
}

/// The scale lanes of one super-block: lane `l` = `Σ_c scale(c, l) · Σ_{p in 4l..4l+4} q[32c+p]·q8[32c+p]`,
/// where `scale(c, l)` is `group[2c + l/4]` (16-value groups) or `group[c]` (32-value sub-blocks,
/// `SUB32`).
#[inline(always)]
fn chunk_lanes<const SUB32: bool>(q: &[u8; QK_K], q8: &[u8], group: &[i32]) -> [i32; 8] {
    let mut prod = [0i32; QK_K];
    for (p, (&a, &b)) in prod.iter_mut().zip(q.iter().zip(&q8[..QK_K])) {
        *p = a as i32 * b as i8 as i32;
    }
    let mut lanes = [0i32; 8];
    for (c, chunk) in prod.chunks_exact(32).enumerate() {
        for (l, lane) in lanes.iter_mut().enumerate() {
            let dot4 = chunk[4 * l] + chunk[4 * l + 1] + chunk[4 * l + 2] + chunk[4 * l + 3];
            let scale = if SUB32 {
                group[c]
            } else {
                group[2 * c + l / 4]
            };
            *lane += scale * dot4;
        }
    }
    lanes
}

/// `Σ` over the two 16-value groups `2l, 2l+1` of `group scale · bsum`, for each lane `l`.
#[inline(always)]
fn group_pairs(group: &[i32; 16], bs: &[i32; 16]) -> [i32; 8] {
    std::array::from_fn(|l| group[2 * l] * bs[2 * l] + group[2 * l + 1] * bs[2 * l + 1])
}

/// The exact integer lanes `(scale lanes, min lanes)` of one super-block (see the module documentation).
#[inline(always)]
pub(crate) fn block_lanes(kind: KKind, x: &[u8], y: &[u8]) -> ([i32; 8], [i32; 8]) {
    let q8 = &y[4..260];
    let bs = q8k_bsums(y);
    match kind {
        KKind::Q2K => {
            let sc: [i32; 16] = std::array::from_fn(|g| (x[g] & 0x0F) as i32);
            let mn: [i32; 16] = std::array::from_fn(|g| (x[g] >> 4) as i32);
            let lanes = chunk_lanes::<false>(&crumbs(&x[16..80]), q8, &sc);
            (lanes, group_pairs(&mn, &bs))
        }
        KKind::Q3K => {
            // Quants stored as low | high << 2 (0..7) are q + 4.
            let packed = scales_q3_k(&x[96..108]);
            let sc: [i32; 16] = std::array::from_fn(|g| packed[g] as i32 - 32);
            let (mut q, high) = (crumbs(&x[32..96]), bit_planes(&x[0..32]));
            for (q, h) in q.iter_mut().zip(high) {
                *q |= h << 2;
            }
            let lanes = chunk_lanes::<false>(&q, q8, &sc);
            let offset = group_pairs(&sc, &bs);
            (std::array::from_fn(|l| lanes[l] - 4 * offset[l]), [0; 8])
        }
        KKind::Q4K | KKind::Q5K => {
            let (sc, mn) = scales_mins_k4(&x[4..16]);
            let q = if kind == KKind::Q4K {
                nibbles_k(&x[16..144])
            } else {
                let (mut q, high) = (nibbles_k(&x[48..176]), bit_planes(&x[16..48]));
                for (q, h) in q.iter_mut().zip(high) {
                    *q |= h << 4;
                }
                q
            };
            let lanes = chunk_lanes::<true>(&q, q8, &sc.map(|v| v as i32));
            (
                lanes,
                std::array::from_fn(|l| (bs[2 * l] + bs[2 * l + 1]) * mn[l] as i32),
            )
        }
        KKind::Q6K => {
            let sc: [i32; 16] = std::array::from_fn(|g| x[192 + g] as i8 as i32);
            let lanes = chunk_lanes::<false>(&sixes(&x[0..128], &x[128..192]), q8, &sc);
            let offset = group_pairs(&sc, &bs);
            (std::array::from_fn(|l| lanes[l] - 32 * offset[l]), [0; 8])
        }
    }
}

/// The f16 super-block scale and (for formats with minimums) min scale of a block.
#[inline(always)]
pub(crate) fn block_scales(kind: KKind, x: &[u8]) -> (f32, f32) {
    match kind {
        KKind::Q2K => (f16_at(&x[80..]), f16_at(&x[82..])),
        KKind::Q3K => (f16_at(&x[108..]), 0.0),
        KKind::Q4K | KKind::Q5K => (f16_at(x), f16_at(&x[2..])),
        KKind::Q6K => (f16_at(&x[208..]), 0.0),
    }
}

#[inline(always)]
pub(crate) fn check_lengths(kind: KKind, n: usize, row: &[u8], act: &[u8]) -> usize {
    let nb = n / QK_K;
    assert!(
        row.len() >= nb * kind.block_bytes() && act.len() >= nb * Q8K_BYTES,
        "{kind:?} row or activations shorter than {n} values"
    );
    nb
}

#[inline(always)]
fn vec_dot_portable(kind: KKind, n: usize, row: &[u8], act: &[u8]) -> f32 {
    if kind == KKind::Q5K {
        return super::kquants_ggml::q5k_vec_dot_portable(n, row, act);
    }
    let nb = check_lengths(kind, n, row, act);
    let bb = kind.block_bytes();
    let blocks = row
        .chunks_exact(bb)
        .zip(act.chunks_exact(Q8K_BYTES))
        .take(nb);
    if kind == KKind::Q4K {
        return q4k_portable::<false>(blocks);
    }
    let (mut acc, mut acc_min) = ([0f32; 8], [0f32; 8]);
    for (x, y) in blocks {
        let (lanes, min_lanes) = block_lanes(kind, x, y);
        let (xd, xdmin) = block_scales(kind, x);
        let (d, dmin) = (q8k_d(y) * xd, q8k_d(y) * xdmin);
        for l in 0..8 {
            if kind == KKind::Q6K {
                acc[l] = d.mul_add(lanes[l] as f32, acc[l]);
            } else {
                acc[l] += d * lanes[l] as f32;
                acc_min[l] += dmin * min_lanes[l] as f32;
            }
        }
    }
    sum_lanes8(&acc) - sum_lanes8(&acc_min)
}

/// Q4_K in llama.cpp's repacked orders (module documentation): per super-block (`GEMM4 = false`, gemv) or
/// per 64-value pair of sub-blocks (`GEMM4 = true`, gemm).
#[inline(always)]
fn q4k_portable<'a, const GEMM4: bool>(blocks: impl Iterator<Item = (&'a [u8], &'a [u8])>) -> f32 {
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for (x, y) in blocks {
        let (sc, mn) = scales_mins_k4(&x[4..16]);
        let q = nibbles_k(&x[16..144]);
        let (q8, bs) = (&y[4..260], q8k_bsums(y));
        let (xd, xdmin) = block_scales(KKind::Q4K, x);
        let (d, dmin) = (xd * q8k_d(y), xdmin * q8k_d(y));
        let chunk = |c: usize| -> (i32, i32) {
            let dot: i32 = (32 * c..32 * c + 32)
                .map(|e| q[e] as i32 * q8[e] as i8 as i32)
                .sum();
            (
                sc[c] as i32 * dot,
                mn[c] as i32 * (bs[2 * c] + bs[2 * c + 1]),
            )
        };
        if GEMM4 {
            for p in 0..4 {
                let ((a, am), (b, bm)) = (chunk(2 * p), chunk(2 * p + 1));
                acc = ((a + b) as f32).mul_add(d, acc);
                acc_min = ((am + bm) as f32).mul_add(dmin, acc_min);
            }
        } else {
            let (t, m) = (0..8)
                .map(chunk)
                .fold((0, 0), |(t, m), (a, b)| (t + a, m + b));
            acc = (t as f32).mul_add(d, acc);
            acc_min = (m as f32).mul_add(dmin, acc_min);
        }
    }
    acc - acc_min
}

#[inline(always)]
fn vec_dot(kind: KKind, n: usize, row: &[u8], act: &[u8]) -> f32 {
    if kind == KKind::Q5K {
        return super::kquants_ggml::q5k_vec_dot(n, row, act);
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(kind, KKind::Q4K | KKind::Q6K) && super::has_avx512_vnni() {
        let nb = check_lengths(kind, n, row, act);
        // SAFETY: `has_avx512_vnni` confirmed AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C at run time;
        // `check_lengths` showed that `row` and `act` hold `nb` blocks each, all the kernel reads.
        return unsafe {
            if kind == KKind::Q4K {
                super::x86::kquants_avx512::q4k_dot(nb, row.as_ptr(), act.as_ptr())
            } else {
                super::x86::kquants_avx512::q6k_dot(nb, row.as_ptr(), act.as_ptr())
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        let nb = check_lengths(kind, n, row, act);
        // SAFETY: `has_avx2_fma` confirmed AVX2, FMA and F16C at run time; `check_lengths` showed that
        // `row` and `act` hold `nb` blocks each, all the kernel reads.
        return unsafe { super::x86::kquants_avx2::dot(kind, nb, row.as_ptr(), act.as_ptr()) };
    }
    vec_dot_portable(kind, n, row, act)
}

/// The single-row dot product ([`QuantOps::vec_dot`]) of one weight row with four activation rows at
/// once, for the formats that have such a kernel (Q4_K): the same four results, each super-block unpacked
/// once. For batch rows that take the single-row order (remainders of Q4_K's groups of four; every row of
/// llama.cpp's `MUL_MAT_ID` over repacked weights).
pub fn single_row_dot4(ty: GgmlType) -> Option<Dot4> {
    fn q4k(n: usize, row: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
        #[cfg(target_arch = "x86_64")]
        if super::has_avx2_fma() {
            let nb = check_lengths(KKind::Q4K, n, row, acts[0]);
            for a in &acts[1..] {
                check_lengths(KKind::Q4K, n, row, a);
            }
            if super::has_avx512_vnni() {
                // SAFETY: `has_avx512_vnni` confirmed AVX-512 F/BW/VL/VNNI with AVX2, FMA and F16C;
                // the row and the four activation rows hold `nb` blocks each.
                return unsafe {
                    super::x86::kquants_avx512::q4k_dot_x4(
                        nb,
                        row.as_ptr(),
                        acts.map(|a| a.as_ptr()),
                    )
                };
            }
            // SAFETY: as in `vec_dot`, for each of the four activation rows.
            return unsafe {
                super::x86::kquants_avx2::q4k_dot_x4(nb, row.as_ptr(), acts.map(|a| a.as_ptr()))
            };
        }
        acts.map(|a| vec_dot_portable(KKind::Q4K, n, row, a))
    }
    match ty {
        GgmlType::Q4_K => Some(q4k),
        _ => None,
    }
}

/// Four dot products of four weight rows with one activation row, each in the single-row order
/// ([`QuantOps::vec_dot`]): what a matrix×vector product runs per group of four weight rows.
pub type Rows4 = fn(n: usize, rows: [&[u8]; 4], act: &[u8]) -> [f32; 4];

/// The single-row dot product ([`QuantOps::vec_dot`]) of four weight rows with one activation row at
/// once, for the formats that have such a kernel (Q4_K): the same four results, the activation read once
/// and the four rows' float steps side by side, as llama.cpp's repacked gemv (decode's products).
pub fn single_row_rows4(ty: GgmlType) -> Option<Rows4> {
    fn q4k(n: usize, rows: [&[u8]; 4], act: &[u8]) -> [f32; 4] {
        #[cfg(target_arch = "x86_64")]
        if super::has_avx2_fma() {
            let nb = check_lengths(KKind::Q4K, n, rows[0], act);
            for r in &rows[1..] {
                check_lengths(KKind::Q4K, n, r, act);
            }
            if super::has_avx512_vnni() {
                // SAFETY: `has_avx512_vnni` confirmed AVX-512 F/BW/VL/VNNI with AVX2, FMA and F16C;
                // the four rows and `act` hold `nb` blocks each.
                return unsafe {
                    super::x86::kquants_avx512::q4k_rows_x4(
                        nb,
                        rows.map(|r| r.as_ptr()),
                        act.as_ptr(),
                    )
                };
            }
            // SAFETY: as in `vec_dot`, for each of the four weight rows.
            return unsafe {
                super::x86::kquants_avx2::q4k_rows_x4(nb, rows.map(|r| r.as_ptr()), act.as_ptr())
            };
        }
        rows.map(|r| vec_dot_portable(KKind::Q4K, n, r, act))
    }
    // `--cpu-rows4 off` turns the four-row kernel off (each row alone, the same bits): an A/B switch
    // for its speed on a new CPU.
    let on = crate::options::get().cpu.rows4;
    match ty {
        GgmlType::Q4_K if on => Some(q4k),
        _ => None,
    }
}

/// The Q4_K dot product in the order of llama.cpp's repacked gemm (`ggml_gemm_q4_K_8x8_q8_K`), which
/// multiplies activation rows four at a time: what llama.cpp computes for the first `4·⌊n/4⌋` rows of a
/// batch of `n > 3` (the rest go through the gemv order of the plain Q4_K dot product).
fn q4k_vec_dot_gemm4(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = check_lengths(KKind::Q4K, n, row, act);
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: as in `vec_dot`.
        return unsafe { super::x86::kquants_avx2::q4k_dot_gemm4(nb, row.as_ptr(), act.as_ptr()) };
    }
    q4k_vec_dot_gemm4_portable(n, row, act)
}

pub(crate) fn q4k_vec_dot_gemm4_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = check_lengths(KKind::Q4K, n, row, act);
    q4k_portable::<true>(
        row.chunks_exact(144)
            .zip(act.chunks_exact(Q8K_BYTES))
            .take(nb),
    )
}

/// Q4_K's batch order (`quant::BatchDot`): the repacked gemm for the first `4·⌊n/4⌋` rows of `n > 3`.
pub(crate) static Q4K_GEMM4: BatchDot = BatchDot {
    dot: q4k_vec_dot_gemm4,
    portable: q4k_vec_dot_gemm4_portable,
    applies: |n, j| n > 3 && j < n - n % 4,
    dot4: Some(q4k_vec_dot_gemm4_x4),
};

/// [`q4k_vec_dot_gemm4`] of one row with four activation rows.
fn q4k_vec_dot_gemm4_x4(n: usize, row: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        let nb = check_lengths(KKind::Q4K, n, row, acts[0]);
        for a in &acts[1..] {
            check_lengths(KKind::Q4K, n, row, a);
        }
        if super::has_avx512_vnni() {
            // SAFETY: `has_avx512_vnni` confirmed AVX-512 F/BW/VL/VNNI with AVX2, FMA and F16C; the row
            // and the four activation rows hold `nb` blocks each.
            return unsafe {
                super::x86::kquants_avx512::q4k_dot_gemm4_x4(
                    nb,
                    row.as_ptr(),
                    acts.map(|a| a.as_ptr()),
                )
            };
        }
        // SAFETY: as in `vec_dot`, for each of the four activation rows.
        return unsafe {
            super::x86::kquants_avx2::q4k_dot_gemm4_x4(nb, row.as_ptr(), acts.map(|a| a.as_ptr()))
        };
    }
    acts.map(|a| q4k_vec_dot_gemm4_portable(n, row, a))
}

/// ggml's tiled K-quant matmul (`ggml-cpu/tiled`, batches of 8 rows or more), per output: each
/// super-block's integer totals `T` (scales) and `M` (mins) give `r = xd·T` (less `xdmin·M`, fused), and
/// `acc = fma(r, yd, acc)`.
#[inline(always)]
fn tiled_portable(kind: KKind, n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = check_lengths(kind, n, row, act);
    let mut acc = 0f32;
    for (x, y) in row
        .chunks_exact(kind.block_bytes())
        .zip(act.chunks_exact(Q8K_BYTES))
        .take(nb)
    {
        let (lanes, min_lanes) = block_lanes(kind, x, y);
        let (xd, xdmin) = block_scales(kind, x);
        acc = tiled_step(
            kind,
            lanes.iter().sum(),
            min_lanes.iter().sum(),
            xd,
            xdmin,
            q8k_d(y),
            acc,
        );
    }
    acc
}

/// One super-block of [`tiled_portable`].
#[inline(always)]
pub(crate) fn tiled_step(
    kind: KKind,
    t: i32,
    m: i32,
    xd: f32,
    xdmin: f32,
    yd: f32,
    acc: f32,
) -> f32 {
    let mut r = xd * t as f32;
    if matches!(kind, KKind::Q2K | KKind::Q4K | KKind::Q5K) {
        r = (-xdmin).mul_add(m as f32, r);
    }
    r.mul_add(yd, acc)
}

#[inline(always)]
fn tiled(kind: KKind, n: usize, row: &[u8], act: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        let nb = check_lengths(kind, n, row, act);
        // SAFETY: as in `vec_dot`.
        return unsafe {
            super::x86::kquants_avx2::dot_tiled(kind, nb, row.as_ptr(), act.as_ptr())
        };
    }
    tiled_portable(kind, n, row, act)
}

macro_rules! tiled_batch_dot {
    ($name:ident, $kind:expr, $dot:ident, $portable:ident, $dot4:expr) => {
        fn $dot(n: usize, row: &[u8], act: &[u8]) -> f32 {
            tiled($kind, n, row, act)
        }
        fn $portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
            tiled_portable($kind, n, row, act)
        }
        /// The format's batch order (`quant::BatchDot`): ggml's tiled matmul, batches of 8 rows or more.
        pub(crate) static $name: BatchDot = BatchDot {
            dot: $dot,
            portable: $portable,
            applies: |n, _| n >= 8,
            dot4: $dot4,
        };
    };
}

tiled_batch_dot!(Q2K_TILED, KKind::Q2K, q2k_tiled, q2k_tiled_portable, None);
tiled_batch_dot!(Q3K_TILED, KKind::Q3K, q3k_tiled, q3k_tiled_portable, None);
tiled_batch_dot!(Q4K_TILED, KKind::Q4K, q4k_tiled, q4k_tiled_portable, None);
tiled_batch_dot!(Q5K_TILED, KKind::Q5K, q5k_tiled, q5k_tiled_portable, None);
tiled_batch_dot!(
    Q6K_TILED,
    KKind::Q6K,
    q6k_tiled,
    q6k_tiled_portable,
    Some(q6k_tiled_x4)
);

/// [`Q6K_TILED`]'s dot product of one row with four activation rows at once (the same four results, each
/// super-block unpacked once).
fn q6k_tiled_x4(n: usize, row: &[u8], acts: [&[u8]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        let mut nb = 0;
        for a in acts {
            nb = check_lengths(KKind::Q6K, n, row, a);
        }
        // SAFETY: `has_avx2_fma` confirmed AVX2, FMA and F16C at run time; the row and the four
        // activation rows hold `nb` blocks each (checked above), all the kernel reads.
        return unsafe {
            super::x86::kquants_avx2::q6k_dot_tiled_x4(nb, row.as_ptr(), acts.map(|a| a.as_ptr()))
        };
    }
    acts.map(|a| tiled_portable(KKind::Q6K, n, row, a))
}

// ---------------------------------------------------------------------------------------------------------
// Random blocks.

/// The smallest super-block scale written: f16's smallest normal number, so scales are never denormal.
const MIN_SCALE: f32 = 1.0 / 16384.0;
/// The largest super-block scale written (its multiples by 15.5 stay far inside f16's range).
const MAX_SCALE: f32 = 2048.0;

/// Sub-block scale magnitudes are drawn uniformly from `[hi/2 + 1, hi]` (a power-of-two count, so a few
/// random bits pick one). `hi` starts at the format's largest scale and is halved while that would push the
/// super-block scale below [`MIN_SCALE`].
#[derive(Clone, Copy, Debug)]
struct ScaleRange {
    lo: u32,
    bits: u32,
    d: f32,
}

/// The scale range and super-block scale for values `d · s · q` with `s` from the range and `q` of mean
/// square `q_ms`, aiming at root-mean-square `rms`.
fn scale_range(rms: f32, q_ms: f32, max_scale: u32) -> ScaleRange {
    let mut hi = max_scale;
    loop {
        let lo = hi / 2 + 1;
        let count = hi - lo + 1;
        let s_ms = (lo..=hi).map(|s| (s * s) as f32).sum::<f32>() / count as f32;
        let d = if rms.is_finite() && rms > 0.0 {
            rms / (q_ms * s_ms).sqrt()
        } else {
            0.0
        };
        if d >= MIN_SCALE || hi == 1 || d == 0.0 {
            let d = if d == 0.0 {
                0.0
            } else {
                d.clamp(MIN_SCALE, MAX_SCALE)
            };
            return ScaleRange {
                lo,
                bits: count.trailing_zeros(),
                d,
            };
        }
        hi /= 2;
    }
}

/// Packs eight 6-bit scales and mins into Q4_K/Q5_K's 12 bytes (the inverse of [`scales_mins_k4`]).
fn pack_scales_mins_k4(sc: &[u8; 8], mn: &[u8; 8], out: &mut [u8]) {
    for j in 0..4 {
        out[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        out[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        out[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
    }
}

/// Packs sixteen 6-bit Q3_K scales into 12 bytes (the inverse of [`scales_q3_k`]).
fn pack_scales_q3_k(sc: &[u8; 16], out: &mut [u8]) {
    out[..12].fill(0);
    for (k, &s) in sc.iter().enumerate() {
        if k < 8 {
            out[k] |= s & 0x0F;
        } else {
            out[k - 8] |= (s & 0x0F) << 4;
        }
        out[8 + k % 4] |= (s >> 4) << (2 * (k / 4));
    }
}

/// Writes random super-blocks: uniformly random quants; sub-block scales drawn from a [`ScaleRange`];
/// for Q2_K/Q4_K/Q5_K each sub-block's min equals its scale and `dmin = 1.5·d` (`7.5·d`, `15.5·d`), the
/// mean of the quants, so every sub-block is centered; for Q3_K/Q6_K (quants with mean −½) each scale gets
/// a random sign, which keeps the mean at zero and every value's distribution symmetric. Scales never fall
/// below f16's smallest normal number, so a very small `rms` gives larger values than asked.
fn fill_random(kind: KKind, rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    // (mean square of the centered quant, largest sub-block scale, quant mean used as the min ratio)
    let (q_ms, max_scale, center) = match kind {
        KKind::Q2K => (1.25, 15, 1.5),
        KKind::Q3K => (5.5, 31, 0.0),
        KKind::Q4K => (21.25, 63, 7.5),
        KKind::Q5K => (85.25, 63, 15.5),
        KKind::Q6K => (341.5, 127, 0.0),
    };
    let range = scale_range(rms, q_ms, max_scale);
    let mut d_bytes = [0u8; 4];
    put_f16(&mut d_bytes[0..2], range.d);
    let dmin = center * f16_at(&d_bytes[0..2]);
    put_f16(&mut d_bytes[2..4], dmin);
    // Random bytes everywhere in one pass; then each block's scale fields are replaced, the choices drawn
    // from the random bytes they replace.
    rng.fill_bytes(dst);
    let mask = (1u32 << range.bits) - 1;
    let scale = |bits: u32| (range.lo + (bits & mask)) as u8;
    // A scale of random sign: magnitude from the low bits, sign from `sign_bit` (above them).
    let signed = |bits: u32, sign_bit: u32| {
        let v = scale(bits) as i32;
        if bits & sign_bit != 0 {
            -v
        } else {
            v
        }
    };
    for b in dst.chunks_exact_mut(kind.block_bytes()) {
        match kind {
            KKind::Q2K => {
                for s in &mut b[0..16] {
                    let v = scale(*s as u32);
                    *s = v | (v << 4);
                }
                b[80..84].copy_from_slice(&d_bytes);
            }
            KKind::Q3K => {
                // 16 choices from the 14 random bytes of the scale and d fields: consecutive 7-bit
                // windows, magnitude from bits 0..4 (Q3_K's scales need at most 4), sign from bit 6.
                let mut r = [0u8; 16];
                r[..14].copy_from_slice(&b[96..110]);
                let r = u128::from_le_bytes(r);
                let sc: [u8; 16] = std::array::from_fn(|k| {
                    (32 + signed((r >> (7 * k)) as u32 & 0x7F, 0x40)) as u8
                });
                pack_scales_q3_k(&sc, &mut b[96..108]);
                b[108..110].copy_from_slice(&d_bytes[0..2]);
            }
            KKind::Q4K | KKind::Q5K => {
                let r = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
                let sc: [u8; 8] = std::array::from_fn(|k| scale((r >> (8 * k)) as u32));
                b[0..4].copy_from_slice(&d_bytes);
                pack_scales_mins_k4(&sc, &sc, &mut b[4..16]);
            }
            KKind::Q6K => {
                for s in &mut b[192..208] {
                    *s = signed(*s as u32, 0x80) as i8 as u8;
                }
                b[208..210].copy_from_slice(&d_bytes[0..2]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Activation quantizer.

/// Quantizes `x` to Q8_K blocks as ggml does (`quantize_row_q8_K_ref`, which its x86 CPU backend uses, and
/// the AVX2 `ggml_quantize_mat_q8_K_4x8`): f32 scale, 256 × i8, 16 × i16 sums of 16 quants. ggml takes
/// `iscale = -127 / max` (`max` the element of largest magnitude, signed), `q = x · iscale` rounded to
/// nearest with ties to even, and `d = 1 / iscale`; we store the same values with the sign of `d` and of
/// every `q` flipped when `max` is positive (`d·q`, all the dot products read, is unchanged bit for bit).
pub(crate) fn quantize_q8_k(x: &[f32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        let nb = (x.len() / 256).min(out.len() / 292);
        // SAFETY: `has_avx2_fma` confirmed AVX2, FMA and F16C at run time; `x` holds `256·nb` values and
        // `out` `292·nb` bytes.
        unsafe { super::x86::act_avx2::quantize_q8_k(nb, x.as_ptr(), out.as_mut_ptr()) };
        return;
    }
    quantize_q8_k_portable(x, out)
}

/// [`quantize_q8_k`] in portable code (the AVX2 code computes the same bytes).
pub(crate) fn quantize_q8_k_portable(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(256).zip(out.chunks_exact_mut(292)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let iscale = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let d = if amax != 0.0 { 1.0 / iscale } else { 0.0 };
        ob[0..4].copy_from_slice(&d.to_le_bytes());
        let (qs, sums) = ob[4..].split_at_mut(256);
        for (g, (qg, xg)) in qs.chunks_exact_mut(16).zip(xb.chunks_exact(16)).enumerate() {
            let mut sum = 0i16;
            for (o, v) in qg.iter_mut().zip(xg) {
                let q = super::legacy::round_ties_even(v * iscale).clamp(-127.0, 127.0) as i8;
                sum += q as i16;
                *o = q as u8;
            }
            sums[2 * g..2 * g + 2].copy_from_slice(&sum.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_packing_round_trips() {
        let mut rng = Rng::new(11);
        for _ in 0..1000 {
            let sc: [u8; 8] = std::array::from_fn(|_| rng.below(64) as u8);
            let mn: [u8; 8] = std::array::from_fn(|_| rng.below(64) as u8);
            let mut packed = [0u8; 12];
            pack_scales_mins_k4(&sc, &mn, &mut packed);
            assert_eq!(scales_mins_k4(&packed), (sc, mn));
            let sc16: [u8; 16] = std::array::from_fn(|_| rng.below(64) as u8);
            pack_scales_q3_k(&sc16, &mut packed);
            assert_eq!(scales_q3_k(&packed), sc16);
        }
    }

    /// Every sub-block of the formats with minimums is centered: `dmin·min` equals `d·scale` times the
    /// mean quant, so the expected value of each element is zero (up to f16 rounding of `dmin`).
    #[test]
    fn random_blocks_with_minimums_are_centered() {
        for (kind, center) in [(KKind::Q2K, 1.5f32), (KKind::Q4K, 7.5), (KKind::Q5K, 15.5)] {
            for rms in [1e-3f32, 0.02, 1.0] {
                let mut buf = vec![0u8; 64 * kind.block_bytes()];
                fill_random(kind, &mut Rng::new(4), rms, &mut buf);
                for b in buf.chunks_exact(kind.block_bytes()) {
                    let (d, dmin) = block_scales(kind, b);
                    assert!(d >= MIN_SCALE, "{kind:?}: super-block scale {d}");
                    let pairs: Vec<(u8, u8)> = if kind == KKind::Q2K {
                        b[..16].iter().map(|&s| (s & 0x0F, s >> 4)).collect()
                    } else {
                        let (sc, mn) = scales_mins_k4(&b[4..16]);
                        sc.into_iter().zip(mn).collect()
                    };
                    for (sc, mn) in pairs {
                        assert!(sc > 0, "{kind:?}: zero scale");
                        let (mean, offset) = (d * sc as f32 * center, dmin * mn as f32);
                        assert!(
                            (mean - offset).abs() <= 1e-3 * mean.abs(),
                            "{kind:?}: {mean} vs {offset}"
                        );
                    }
                }
            }
        }
    }
}
