//! The 3-bit lattice formats: IQ3_XXS (3.06 bits per weight) and IQ3_S (3.44).
//!
//! Both code groups of 4 values as an index into a grid of magnitudes and carry one sign per value. IQ3_XXS
//! scales 32 values by `d · (0.5 + s) / 2` and stores signs as 7-bit ksigns indices; IQ3_S scales 32 values
//! by `d · (1 + 2s)`, has a 9-bit grid index and stores plain sign bytes.

use super::tables::{IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};
use super::{
    fill_blocks, grid_mean_square_u32, odd_scale_mean_square, q8k_d, q8k_q, sign_f32,
    simd_dispatch, u32_at, DitheredF16, Q8K_BYTES, QK_K,
};
use crate::quant::{f16_at, ActType, QuantOps};
use crate::rng::Rng;

/// IQ3_XXS block: f16 `d`, 64 grid indices (bytes), 8 × u32 (4 × 7-bit sign indices, 4-bit scale on top).
pub(crate) const IQ3_XXS_BYTES: usize = 98;
/// IQ3_S block: f16 `d`, 64 grid index low bytes, 8 bytes of high index bits, 32 sign bytes, 4 bytes of
/// two 4-bit scales.
pub(crate) const IQ3_S_BYTES: usize = 110;

pub(crate) static IQ3_XXS: QuantOps = QuantOps {
    dequantize: dequantize_iq3_xxs,
    act: ActType::Q8_K,
    vec_dot: vec_dot_iq3_xxs,
    vec_dot_portable: vec_dot_iq3_xxs_portable,
    fill_random: fill_random_iq3_xxs,
};

pub(crate) static IQ3_S: QuantOps = QuantOps {
    dequantize: dequantize_iq3_s,
    act: ActType::Q8_K,
    vec_dot: vec_dot_iq3_s,
    vec_dot_portable: vec_dot_iq3_s_portable,
    fill_random: fill_random_iq3_s,
};

simd_dispatch!(vec_dot_iq3_xxs, vec_dot_iq3_xxs, vec_dot_iq3_xxs_portable);
simd_dispatch!(vec_dot_iq3_s, vec_dot_iq3_s, vec_dot_iq3_s_portable);

/// Writes the 8 values of two grid entries (4 magnitudes each) under one sign byte:
/// `(db · grid) · sign`, the order numpy multiplies in.
#[inline(always)]
fn put_pair(out: &mut [f32], db: f32, g1: u32, g2: u32, signs: u8) {
    let g = (g1 as u64) | (g2 as u64) << 32;
    for (j, o) in out[..8].iter_mut().enumerate() {
        *o = db * ((g >> (8 * j)) as u8 as f32) * sign_f32(signs, j);
    }
}

fn dequantize_iq3_xxs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ3_XXS_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b);
        for ib in 0..8 {
            let aux = u32_at(b, 66 + 4 * ib);
            let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
            for l in 0..4 {
                let signs = KSIGNS_IQ2XS[(aux >> (7 * l) & 127) as usize];
                let g1 = IQ3XXS_GRID[b[2 + 8 * ib + 2 * l] as usize];
                let g2 = IQ3XXS_GRID[b[3 + 8 * ib + 2 * l] as usize];
                put_pair(&mut y[32 * ib + 8 * l..], db, g1, g2, signs);
            }
        }
    }
}

/// Grid index `i` (0..64) of an IQ3_S block: low byte in `qs`, ninth bit in `qh`.
#[inline(always)]
fn iq3s_index(b: &[u8], i: usize) -> usize {
    b[2 + i] as usize | ((b[66 + i / 8] as usize >> (i % 8)) & 1) << 8
}

fn dequantize_iq3_s(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ3_S_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b);
        for ib in 0..8 {
            let s = b[106 + ib / 2] >> (4 * (ib % 2)) & 15;
            let db = d * (1 + 2 * s) as f32;
            for l in 0..4 {
                let k = 4 * ib + l;
                let (g1, g2) = (
                    IQ3S_GRID[iq3s_index(b, 2 * k)],
                    IQ3S_GRID[iq3s_index(b, 2 * k + 1)],
                );
                put_pair(&mut y[8 * k..], db, g1, g2, b[74 + k]);
            }
        }
    }
}

/// Σ grid · ±q8 over 8 values given as two 4-value grid entries under one sign byte.
#[inline(always)]
fn pair_dot(g1: u32, g2: u32, signs: u8, a: &[u8], base: usize) -> i32 {
    let g = (g1 as u64) | (g2 as u64) << 32;
    let mut sum = 0;
    for j in 0..8 {
        let v = (g >> (8 * j)) as u8 as i32 * q8k_q(a, base + j);
        sum += if signs >> j & 1 != 0 { -v } else { v };
    }
    sum
}

/// Portable IQ3_XXS × Q8_K dot product (llama.cpp's `ggml_vec_dot_iq3_xxs_q8_K_generic`).
pub(crate) fn vec_dot_iq3_xxs_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (b, a) in row
        .chunks_exact(IQ3_XXS_BYTES)
        .zip(act.chunks_exact(Q8K_BYTES))
        .take(n / QK_K)
    {
        let d = f16_at(b) * q8k_d(a);
        let mut bsum = 0i32;
        for ib in 0..8 {
            let aux = u32_at(b, 66 + 4 * ib);
            let ls = 2 * (aux >> 28) as i32 + 1;
            let mut sumi = 0;
            for l in 0..4 {
                let signs = KSIGNS_IQ2XS[(aux >> (7 * l) & 127) as usize];
                let g1 = IQ3XXS_GRID[b[2 + 8 * ib + 2 * l] as usize];
                let g2 = IQ3XXS_GRID[b[3 + 8 * ib + 2 * l] as usize];
                sumi += pair_dot(g1, g2, signs, a, 32 * ib + 8 * l);
            }
            bsum += sumi * ls;
        }
        sumf += d * bsum as f32;
    }
    0.25 * sumf
}

/// Portable IQ3_S × Q8_K dot product (llama.cpp's `ggml_vec_dot_iq3_s_q8_K_generic`).
pub(crate) fn vec_dot_iq3_s_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (b, a) in row
        .chunks_exact(IQ3_S_BYTES)
        .zip(act.chunks_exact(Q8K_BYTES))
        .take(n / QK_K)
    {
        let d = f16_at(b) * q8k_d(a);
        let mut bsum = 0i32;
        for ib in 0..8 {
            let ls = 2 * (b[106 + ib / 2] >> (4 * (ib % 2)) & 15) as i32 + 1;
            let mut sumi = 0;
            for l in 0..4 {
                let k = 4 * ib + l;
                let (g1, g2) = (
                    IQ3S_GRID[iq3s_index(b, 2 * k)],
                    IQ3S_GRID[iq3s_index(b, 2 * k + 1)],
                );
                sumi += pair_dot(g1, g2, b[74 + k], a, 8 * k);
            }
            bsum += sumi * ls;
        }
        sumf += d * bsum as f32;
    }
    sumf
}

const IQ3XXS_GRID_MS: f64 = grid_mean_square_u32(&IQ3XXS_GRID);
const IQ3S_GRID_MS: f64 = grid_mean_square_u32(&IQ3S_GRID);

fn fill_random_iq3_xxs(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    // Values are d · (2s + 1)/4 · g with uniform 4-bit s, uniform grid entries and signs.
    let d = DitheredF16::new(
        (rms as f64 * 4.0 / (odd_scale_mean_square(4) * IQ3XXS_GRID_MS).sqrt()) as f32,
    );
    fill_blocks(rng, dst, IQ3_XXS_BYTES, |b| d.put(b));
}

fn fill_random_iq3_s(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    // Values are d · (2s + 1) · g with uniform 4-bit s, uniform grid entries and signs.
    let d =
        DitheredF16::new((rms as f64 / (odd_scale_mean_square(4) * IQ3S_GRID_MS).sqrt()) as f32);
    fill_blocks(rng, dst, IQ3_S_BYTES, |b| d.put(b));
}
