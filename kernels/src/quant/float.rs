//! Plain float weight formats: F32, F16 and BF16 (one value per "block"), dotted with f32 activations.
//!
//! Also owns [`sum_lanes8`], the fixed order in which eight partial sums are added. Every dot product of
//! this crate that keeps eight (or 32) float lanes finishes with it, in the portable and the AVX2 code
//! alike, which is what makes those two bit-identical.
//!
//! Dot products of float rows use 32 lanes (four AVX2 accumulators): element `i` of the first
//! `n - n % 32` goes to lane `i % 32` (`lane += w * x`, multiply then add, not fused: so the portable code
//! matches the SIMD code exactly, and on aligned data it measured as fast as FMA), lanes `j + 8k` are
//! combined as `(l[j] + l[j+16]) + (l[j+8] + l[j+24])`, those eight are summed by [`sum_lanes8`], and the
//! remaining `n % 32` products are added one by one to a separate scalar that is added last.

use super::{ActType, GgmlType, QuantOps};
use crate::rng::Rng;

// F32 rows take ggml's own order (`float_ggml`): llama.cpp computes MoE routers with them.
static F32_OPS: QuantOps = QuantOps {
    dequantize: dequantize_f32,
    act: ActType::F32,
    vec_dot: super::float_ggml::vec_dot_f32,
    vec_dot_portable: super::float_ggml::vec_dot_f32_portable,
    fill_random: fill_random_f32,
};

static F16_OPS: QuantOps = QuantOps {
    dequantize: dequantize_f16,
    act: ActType::F32,
    vec_dot: vec_dot_f16,
    vec_dot_portable: vec_dot_f16_portable,
    fill_random: fill_random_f16,
};

static BF16_OPS: QuantOps = QuantOps {
    dequantize: dequantize_bf16,
    act: ActType::F32,
    vec_dot: vec_dot_bf16,
    vec_dot_portable: vec_dot_bf16_portable,
    fill_random: fill_random_bf16,
};

/// The operations of this family's types.
pub(crate) fn ops(ty: GgmlType) -> Option<&'static QuantOps> {
    match ty {
        GgmlType::F32 => Some(&F32_OPS),
        GgmlType::F16 => Some(&F16_OPS),
        GgmlType::BF16 => Some(&BF16_OPS),
        _ => None,
    }
}

/// Adds eight lanes in the order AVX2 code reduces a `__m256`: halves first, then pairs, then the last two:
/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
#[inline(always)]
pub(crate) fn sum_lanes8(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// Lanes of the float dot products.
pub(crate) const FLOAT_LANES: usize = 32;

/// Combines the float dot product's lanes as described in the module documentation.
#[inline(always)]
pub(crate) fn sum_float_lanes(l: &[f32; FLOAT_LANES]) -> f32 {
    let mut v = [0f32; 8];
    for (j, o) in v.iter_mut().enumerate() {
        let a = |k: usize| l[j + 8 * k];
        *o = (a(0) + a(2)) + (a(1) + a(3));
    }
    sum_lanes8(&v)
}

#[inline(always)]
fn f32_le(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

#[inline(always)]
fn bf16_to_f32(b: &[u8]) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
}

fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (o, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *o = f32_le(b);
    }
}

/// f16 bits to f32 exactly as numpy converts them: NaN payloads are kept as they are (hardware and the
/// `half` crate set the quiet bit of signalling NaNs; gguf-py's reference does not).
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    // Branch-free (so loops over it vectorize): exponent and mantissa moved into place, then scaled by
    // 2¹¹² to rebias, which also normalizes subnormals exactly; infinities and NaNs are assembled bit by
    // bit so payloads stay as they are.
    let magnitude = ((h & 0x7FFF) as u32) << 13;
    let finite = f32::from_bits(magnitude) * f32::from_bits(0x7780_0000);
    let bits = if h & 0x7C00 == 0x7C00 {
        magnitude | 0x7F80_0000
    } else {
        finite.to_bits()
    };
    f32::from_bits(bits | ((h as u32 & 0x8000) << 16))
}

/// f32 to f16 bits, rounding to nearest even as hardware and the `half` crate do (values from 65520 up
/// become infinity, NaN stays NaN); inline, because `half`'s conversion is a call through a run-time
/// dispatch, too slow for writing gigabytes of random weights.
#[inline(always)]
pub fn f32_to_f16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    let sign = ((x >> 16) & 0x8000) as u16;
    let abs = x & 0x7FFF_FFFF;
    if abs > 0x7F80_0000 {
        // NaN: keep it a (quiet) NaN with the top of its payload.
        sign | 0x7E00 | ((abs >> 13) & 0x3FF) as u16
    } else if abs >= 0x477F_F000 {
        sign | 0x7C00
    } else if abs < 0x3880_0000 {
        // Below f16's smallest normal: a multiple of 2⁻²⁴. Scaled by 2²⁴ (exact) and added to 2²³, the
        // value is rounded to an integer, ties to even, by the addition itself (`round_ties_even` would be
        // a libm call on the baseline target).
        let rounded = f32::from_bits(abs) * 16_777_216.0 + 8_388_608.0;
        sign | (rounded.to_bits() - 0x4B00_0000) as u16
    } else {
        let rounded = abs + 0x0FFF + ((abs >> 13) & 1);
        sign | ((rounded >> 13) - (112 << 10)) as u16
    }
}

fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *o = f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *o = bf16_to_f32(b);
    }
}

/// The portable float dot product in the canonical lane order; `W` bytes per weight, decoded by `decode`.
#[inline(always)]
fn dot_lanes<const W: usize>(
    n: usize,
    row: &[u8],
    act: &[u8],
    decode: impl Fn(&[u8]) -> f32,
) -> f32 {
    let (row, act) = (&row[..n * W], &act[..n * 4]);
    let main = n - n % FLOAT_LANES;
    let mut lanes = [0f32; FLOAT_LANES];
    for (wc, xc) in row[..main * W]
        .chunks_exact(FLOAT_LANES * W)
        .zip(act[..main * 4].chunks_exact(FLOAT_LANES * 4))
    {
        let mut w = [0f32; FLOAT_LANES];
        let mut x = [0f32; FLOAT_LANES];
        for j in 0..FLOAT_LANES {
            w[j] = decode(&wc[j * W..j * W + W]);
            x[j] = f32_le(&xc[j * 4..j * 4 + 4]);
        }
        for j in 0..FLOAT_LANES {
            lanes[j] += w[j] * x[j];
        }
    }
    let mut tail = 0f32;
    for (wb, xb) in row[main * W..]
        .chunks_exact(W)
        .zip(act[main * 4..].chunks_exact(4))
    {
        tail += decode(wb) * f32_le(xb);
    }
    sum_float_lanes(&lanes) + tail
}

fn vec_dot_f16_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_lanes::<2>(n, row, act, |b| {
        f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]))
    })
}

fn vec_dot_bf16_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_lanes::<2>(n, row, act, bf16_to_f32)
}

/// Which float format a row holds (selects the AVX2 loader).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum FloatKind {
    F32,
    F16,
    Bf16,
}

#[inline]
fn vec_dot_float(kind: FloatKind, n: usize, row: &[u8], act: &[u8]) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        let w = if kind == FloatKind::F32 { 4 } else { 2 };
        assert!(
            row.len() >= n * w && act.len() >= n * 4,
            "float row or activations too short"
        );
        if super::has_avx2_fma() {
            // SAFETY: `has_avx2_fma` confirmed AVX2, FMA and F16C at run time; the lengths were checked
            // just above, which is all the kernel reads.
            return Some(unsafe {
                super::x86::float_avx2::dot(kind, n, row.as_ptr(), act.as_ptr())
            });
        }
    }
    let _ = (kind, n, row, act);
    None
}

fn vec_dot_f16(n: usize, row: &[u8], act: &[u8]) -> f32 {
    vec_dot_float(FloatKind::F16, n, row, act).unwrap_or_else(|| vec_dot_f16_portable(n, row, act))
}

fn vec_dot_bf16(n: usize, row: &[u8], act: &[u8]) -> f32 {
    vec_dot_float(FloatKind::Bf16, n, row, act)
        .unwrap_or_else(|| vec_dot_bf16_portable(n, row, act))
}

/// The half-width of the uniform distribution with root-mean-square `rms` (0 for unusable targets).
fn uniform_half_width(rms: f32) -> f32 {
    if rms.is_finite() && rms > 0.0 {
        rms * 3f32.sqrt()
    } else {
        0.0
    }
}

/// Two independent values uniform in `[-a, a)` from 64 random bits (mean `-a·2⁻³¹`, negligible).
#[inline(always)]
fn two_uniform(bits: u64, a: f32) -> [f32; 2] {
    let scale = a * (1.0 / 2147483648.0);
    [
        (bits as u32 as i32) as f32 * scale,
        ((bits >> 32) as u32 as i32) as f32 * scale,
    ]
}

/// Values uniform in `[-√3·rms, √3·rms)`, so the mean is zero and the root-mean-square is `rms`.
fn fill_random_f32(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    let a = uniform_half_width(rms);
    let mut pairs = dst.chunks_exact_mut(8);
    for p in &mut pairs {
        let [v0, v1] = two_uniform(rng.next_u64(), a);
        p[..4].copy_from_slice(&v0.to_le_bytes());
        p[4..].copy_from_slice(&v1.to_le_bytes());
    }
    for v in pairs.into_remainder().chunks_exact_mut(4) {
        v.copy_from_slice(&two_uniform(rng.next_u64(), a)[0].to_le_bytes());
    }
}

/// As [`fill_random_f32`], rounded to f16 (values beyond f16's range are impossible for sane `rms`; they
/// would saturate to infinity, so `rms` is capped at 10 000).
fn fill_random_f16(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    let a = uniform_half_width(rms.min(10_000.0));
    let mut pairs = dst.chunks_exact_mut(4);
    for p in &mut pairs {
        let [v0, v1] = two_uniform(rng.next_u64(), a);
        p[..2].copy_from_slice(&f32_to_f16_bits(v0).to_le_bytes());
        p[2..].copy_from_slice(&f32_to_f16_bits(v1).to_le_bytes());
    }
    for v in pairs.into_remainder().chunks_exact_mut(2) {
        v.copy_from_slice(&f32_to_f16_bits(two_uniform(rng.next_u64(), a)[0]).to_le_bytes());
    }
}

/// Rounds a finite f32 to bf16 bits, to nearest even.
#[inline(always)]
fn f32_to_bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// As [`fill_random_f32`], rounded to bf16.
fn fill_random_bf16(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    let a = uniform_half_width(rms.min(1e30));
    let mut pairs = dst.chunks_exact_mut(4);
    for p in &mut pairs {
        let [v0, v1] = two_uniform(rng.next_u64(), a);
        p[..2].copy_from_slice(&f32_to_bf16_bits(v0).to_le_bytes());
        p[2..].copy_from_slice(&f32_to_bf16_bits(v1).to_le_bytes());
    }
    for v in pairs.into_remainder().chunks_exact_mut(2) {
        v.copy_from_slice(&f32_to_bf16_bits(two_uniform(rng.next_u64(), a)[0]).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversions_match_the_half_crate() {
        // Every f16 to f32 (NaNs compared as NaNs: ours keeps signalling payloads, as numpy does).
        for h in 0..=u16::MAX {
            let (ours, theirs) = (f16_bits_to_f32(h), half::f16::from_bits(h).to_f32());
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "{h:#06x}"
            );
        }
        // f32 to f16 over a sweep of bit patterns covering every exponent, ties and the overflow edge.
        let mut rng = crate::rng::Rng::new(3);
        let specials = [
            0.0f32,
            -0.0,
            65504.0,
            65519.99,
            65520.0,
            1e-8,
            2.9802322e-8,
            5.9604645e-8,
            6.1035156e-5,
        ];
        let randoms = (0..2_000_000).map(|_| f32::from_bits(rng.next_u32()));
        for v in specials.into_iter().chain(randoms) {
            let (ours, theirs) = (f32_to_f16_bits(v), half::f16::from_f32(v).to_bits());
            let both_nan = v.is_nan() && (ours & 0x7C00) == 0x7C00 && (ours & 0x3FF) != 0;
            assert!(
                ours == theirs || both_nan,
                "{v:e} ({:#010x}): {ours:#06x} vs {theirs:#06x}",
                v.to_bits()
            );
        }
    }
}
