//! MXFP4 (OCP microscaling FP4, blocks of 32, 4.25 bits per weight): a shared power-of-two scale (E8M0)
//! and 32 E2M1 values.
//!
//! As in llama.cpp, the E2M1 values are kept doubled as integers ([`KVALUES_MXFP4`]) and the scale halved
//! ([`e8m0_to_f32_half`]), so the dot product with Q8_0 activations is an integer sum. Within a block,
//! the low nibbles of the 16 bytes hold values 0..16 and the high nibbles values 16..32.

use super::{f16_at, ActType, GgmlType, QuantOps};
use crate::rng::Rng;

/// MXFP4 block: E8M0 exponent byte, 16 bytes of nibbles.
pub(crate) const MXFP4_BYTES: usize = 17;
/// Bytes of a Q8_0 activation block: f16 scale, 32 × i8.
const Q8_0_BYTES: usize = 34;

/// The E2M1 values, doubled (ggml's `kvalues_mxfp4`; the generator in `iquants/gen_tables.py` checks
/// ggml-common.h and the `gguf` package agree on them).
pub(crate) static KVALUES_MXFP4: [i8; 16] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

static MXFP4: QuantOps = QuantOps {
    dequantize: dequantize_mxfp4,
    act: ActType::Q8_0,
    vec_dot: vec_dot_mxfp4,
    vec_dot_portable: vec_dot_mxfp4_portable,
    fill_random: fill_random_mxfp4,
};

/// The operations of this family's types.
pub(crate) fn ops(ty: GgmlType) -> Option<&'static QuantOps> {
    match ty {
        GgmlType::MXFP4 => Some(&MXFP4),
        _ => None,
    }
}

/// Half the value of an E8M0 scale, `2^(e − 128)`, built from its bits as ggml's
/// `ggml_e8m0_to_fp32_half` does (exponents 0 and 1 give f32 subnormals).
#[inline(always)]
pub(crate) fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e - 1) as u32) << 23
    };
    f32::from_bits(bits)
}

fn dequantize_mxfp4(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(MXFP4_BYTES).zip(dst.chunks_exact_mut(32)) {
        let d = e8m0_to_f32_half(b[0]);
        let (lo, hi) = y.split_at_mut(16);
        for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[1..]) {
            *l = d * KVALUES_MXFP4[(q & 15) as usize] as f32;
            *h = d * KVALUES_MXFP4[(q >> 4) as usize] as f32;
        }
    }
}

fn vec_dot_mxfp4(n: usize, row: &[u8], act: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: has_avx2_fma() confirmed at run time that the CPU supports AVX2, FMA and F16C, the
        // features the callee is compiled for; the callee bounds-checks its slices itself.
        return unsafe { super::x86::iquants_avx2::vec_dot_mxfp4(n, row, act) };
    }
    vec_dot_mxfp4_portable(n, row, act)
}

/// Portable MXFP4 × Q8_0 dot product (llama.cpp's `ggml_vec_dot_mxfp4_q8_0_generic`).
pub(crate) fn vec_dot_mxfp4_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (b, a) in row
        .chunks_exact(MXFP4_BYTES)
        .zip(act.chunks_exact(Q8_0_BYTES))
        .take(n / 32)
    {
        let d = f16_at(a) * e8m0_to_f32_half(b[0]);
        let mut sumi = 0i32;
        for j in 0..16 {
            sumi += a[2 + j] as i8 as i32 * KVALUES_MXFP4[(b[1 + j] & 15) as usize] as i32;
            sumi += a[18 + j] as i8 as i32 * KVALUES_MXFP4[(b[1 + j] >> 4) as usize] as i32;
        }
        sumf += d * sumi as f32;
    }
    sumf
}

/// Mean square of the doubled E2M1 values (their mean is zero).
const KVALUES_MS: f64 = {
    let mut sum = 0.0;
    let mut i = 0;
    while i < 16 {
        let v = KVALUES_MXFP4[i] as f64;
        sum += v * v;
        i += 1;
    }
    sum / 16.0
};

/// Writes random blocks: uniform nibbles, and per block one of the two powers of two around the wanted
/// scale, picked with the probability that makes the mean square exact.
fn fill_random_mxfp4(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    // Wanted half-scale h: values are h · k, so E[v²] = h² · E[k²].
    let h = (rms as f64 / KVALUES_MS.sqrt()).max(f64::MIN_POSITIVE);
    // h lies in [2^p, 2^(p+1)); choosing 2^(p+1) with probability q gives E[scale²] = 4^p (1 + 3q) = h².
    let p = h.log2().floor();
    let q = ((h * h / 4f64.powf(p) - 1.0) / 3.0).clamp(0.0, 1.0);
    // Half-scale 2^(e − 128) for e ≥ 2; clamp to the exponents E8M0 can hold with that formula.
    let e_lo = (p + 128.0).clamp(2.0, 253.0) as u8;
    // The exponent byte starts out uniformly random: it is its own coin, with q resolved to 1/256.
    let threshold = (q * 256.0).round() as u32;
    super::iquants::random_bytes(rng, dst);
    for b in dst.chunks_exact_mut(MXFP4_BYTES) {
        b[0] = if (b[0] as u32) < threshold {
            e_lo + 1
        } else {
            e_lo
        };
    }
}
