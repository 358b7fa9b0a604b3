//! The non-linear 4-bit formats: IQ4_NL (blocks of 32, 4.5 bits per weight) and IQ4_XS (super-blocks of
//! 256, 4.25 bits per weight).
//!
//! Each value is one of 16 fixed levels ([`KVALUES_IQ4NL`]) times a scale: the block's f16 `d` for IQ4_NL,
//! `d · (ls − 32)` with a 6-bit `ls` per 32 values for IQ4_XS. Within 32 values, the low nibbles of 16
//! bytes hold values 0..16 and the high nibbles values 16..32.

use super::tables::KVALUES_IQ4NL;
use super::{fill_blocks, q8k_d, simd_dispatch, u16_at, DitheredF16, Q8K_BYTES, QK_K};
use crate::quant::{f16_at, ActType, QuantOps};
use crate::rng::Rng;

/// IQ4_NL block: f16 `d`, 16 bytes of nibbles.
pub(crate) const IQ4_NL_BYTES: usize = 18;
/// IQ4_XS block: f16 `d`, u16 of 8 × 2 high scale bits, 4 bytes of 8 × 4 low scale bits, 128 bytes of
/// nibbles.
pub(crate) const IQ4_XS_BYTES: usize = 136;
/// Bytes of a Q8_0 activation block: f16 scale, 32 × i8.
pub(crate) const Q8_0_BYTES: usize = 34;

pub(crate) static IQ4_NL: QuantOps = QuantOps {
    dequantize: dequantize_iq4_nl,
    act: ActType::Q8_0,
    vec_dot: vec_dot_iq4_nl,
    vec_dot_portable: vec_dot_iq4_nl_portable,
    fill_random: fill_random_iq4_nl,
};

pub(crate) static IQ4_XS: QuantOps = QuantOps {
    dequantize: dequantize_iq4_xs,
    act: ActType::Q8_K,
    vec_dot: vec_dot_iq4_xs,
    vec_dot_portable: vec_dot_iq4_xs_portable,
    fill_random: fill_random_iq4_xs,
};

simd_dispatch!(vec_dot_iq4_nl, vec_dot_iq4_nl, vec_dot_iq4_nl_portable);
simd_dispatch!(vec_dot_iq4_xs, vec_dot_iq4_xs, vec_dot_iq4_xs_portable);

/// Writes the 32 values `scale · level` of 16 nibble bytes (low nibbles first).
#[inline(always)]
fn put_nibbles32(out: &mut [f32], scale: f32, qs: &[u8]) {
    let (lo, hi) = out[..32].split_at_mut(16);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&qs[..16]) {
        *l = scale * KVALUES_IQ4NL[(q & 15) as usize] as f32;
        *h = scale * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
    }
}

/// Σ level · q8 over 32 values: 16 nibble bytes against 32 i8 quants.
#[inline(always)]
fn nibbles32_dot(qs: &[u8], q8: &[u8]) -> i32 {
    let mut sum = 0;
    for j in 0..16 {
        sum += KVALUES_IQ4NL[(qs[j] & 15) as usize] as i32 * q8[j] as i8 as i32;
        sum += KVALUES_IQ4NL[(qs[j] >> 4) as usize] as i32 * q8[j + 16] as i8 as i32;
    }
    sum
}

fn dequantize_iq4_nl(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(IQ4_NL_BYTES).zip(dst.chunks_exact_mut(32)) {
        put_nibbles32(y, f16_at(b), &b[2..]);
    }
}

/// The signed sub-block scale `ls − 32` of sub-block `ib` (0..8) of an IQ4_XS block.
#[inline(always)]
pub(crate) fn iq4xs_scale(b: &[u8], ib: usize) -> i32 {
    let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 15;
    let hi = (u16_at(b, 2) >> (2 * ib)) & 3;
    (lo as u16 | hi << 4) as i32 - 32
}

fn dequantize_iq4_xs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ4_XS_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b);
        for ib in 0..8 {
            let dl = d * iq4xs_scale(b, ib) as f32;
            put_nibbles32(&mut y[32 * ib..], dl, &b[8 + 16 * ib..]);
        }
    }
}

/// Portable IQ4_NL × Q8_0 dot product (llama.cpp's `ggml_vec_dot_iq4_nl_q8_0_generic`).
pub(crate) fn vec_dot_iq4_nl_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (b, a) in row
        .chunks_exact(IQ4_NL_BYTES)
        .zip(act.chunks_exact(Q8_0_BYTES))
        .take(n / 32)
    {
        let d = f16_at(a) * f16_at(b);
        sumf += d * nibbles32_dot(&b[2..], &a[2..]) as f32;
    }
    sumf
}

/// Portable IQ4_XS × Q8_K dot product (llama.cpp's `ggml_vec_dot_iq4_xs_q8_K_generic`).
pub(crate) fn vec_dot_iq4_xs_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (b, a) in row
        .chunks_exact(IQ4_XS_BYTES)
        .zip(act.chunks_exact(Q8K_BYTES))
        .take(n / QK_K)
    {
        let d4d8 = f16_at(b) * q8k_d(a);
        for ib in 0..8 {
            let dl = d4d8 * iq4xs_scale(b, ib) as f32;
            sumf += dl * nibbles32_dot(&b[8 + 16 * ib..], &a[4 + 32 * ib..]) as f32;
        }
    }
    sumf
}

/// Mean and mean square of the 16 levels.
const fn levels_moments() -> (f64, f64) {
    let (mut s, mut s2) = (0.0, 0.0);
    let mut i = 0;
    while i < 16 {
        let v = KVALUES_IQ4NL[i] as f64;
        s += v;
        s2 += v * v;
        i += 1;
    }
    (s / 16.0, s2 / 16.0)
}

/// Mean square of the IQ4_XS sub-block scale `ls − 32` over uniform 6-bit `ls`.
const IQ4XS_SCALE_MS: f64 = {
    let mut sum = 0.0;
    let mut ls = 0;
    while ls < 64 {
        let v = (ls - 32) as f64;
        sum += v * v;
        ls += 1;
    }
    sum / 64.0
};

/// Writes each block's `d` with a random sign: the levels are not symmetric (their mean is −5.9 against a
/// root-mean-square of 67), and llama.cpp's quantizer produces both signs too. The random bytes in the
/// scale field are the coins: bit 15 for the sign, the rest for the dithering.
fn fill_signed_d(rng: &mut Rng, dst: &mut [u8], block_bytes: usize, d: f32) {
    let d = DitheredF16::new(d);
    fill_blocks(rng, dst, block_bytes, |b| {
        let coin = u16_at(b, 0);
        let bits = d.pick(coin) | (coin & 0x8000);
        b[..2].copy_from_slice(&bits.to_le_bytes());
    });
}

fn fill_random_iq4_nl(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    let d = (rms as f64 / levels_moments().1.sqrt()) as f32;
    fill_signed_d(rng, dst, IQ4_NL_BYTES, d);
}

fn fill_random_iq4_xs(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    let d = (rms as f64 / (IQ4XS_SCALE_MS * levels_moments().1).sqrt()) as f32;
    fill_signed_d(rng, dst, IQ4_XS_BYTES, d);
}
