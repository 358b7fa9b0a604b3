//! The 2-bit lattice formats: IQ2_XXS (2.06 bits per weight), IQ2_XS (2.31) and IQ2_S (2.56).
//!
//! All three code groups of 8 values as an index into a grid of magnitudes (values 8, 25, 43) and 8 signs,
//! scaled per 16 or 32 values by `d · (0.5 + s) / 4` with a 4-bit `s`.

use super::tables::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, KSIGNS_IQ2XS};
use super::{
    fill_blocks, grid_mean_square_u64, odd_scale_mean_square, q8k_d, q8k_q, sign_f32,
    simd_dispatch, u16_at, u32_at, DitheredF16, Q8K_BYTES, QK_K,
};
use crate::quant::{f16_at, ActType, QuantOps};
use crate::rng::Rng;

/// IQ2_XXS block: f16 `d`, then 8 × (4 grid indices as bytes, u32 of 4 × 7-bit sign indices and a 4-bit
/// scale in the top bits), one pair of u32 per 32 values.
pub(crate) const IQ2_XXS_BYTES: usize = 66;
/// IQ2_XS block: f16 `d`, 32 × u16 (9-bit grid index, 7-bit sign index), 8 bytes of two 4-bit scales.
pub(crate) const IQ2_XS_BYTES: usize = 74;
/// IQ2_S block: f16 `d`, 32 grid index low bytes, 32 sign bytes, 8 bytes of 4 × 2 high index bits, 8 bytes
/// of two 4-bit scales.
pub(crate) const IQ2_S_BYTES: usize = 82;

pub(crate) static IQ2_XXS: QuantOps = QuantOps {
    dequantize: dequantize_iq2_xxs,
    act: ActType::Q8_K,
    vec_dot: vec_dot_iq2_xxs,
    vec_dot_portable: vec_dot_iq2_xxs_portable,
    fill_random: fill_random_iq2_xxs,
};

pub(crate) static IQ2_XS: QuantOps = QuantOps {
    dequantize: dequantize_iq2_xs,
    act: ActType::Q8_K,
    vec_dot: vec_dot_iq2_xs,
    vec_dot_portable: vec_dot_iq2_xs_portable,
    fill_random: fill_random_iq2_xs,
};

pub(crate) static IQ2_S: QuantOps = QuantOps {
    dequantize: dequantize_iq2_s,
    act: ActType::Q8_K,
    vec_dot: vec_dot_iq2_s,
    vec_dot_portable: vec_dot_iq2_s_portable,
    fill_random: fill_random_iq2_s,
};

simd_dispatch!(vec_dot_iq2_xxs, vec_dot_iq2_xxs, vec_dot_iq2_xxs_portable);
simd_dispatch!(vec_dot_iq2_xs, vec_dot_iq2_xs, vec_dot_iq2_xs_portable);
simd_dispatch!(vec_dot_iq2_s, vec_dot_iq2_s, vec_dot_iq2_s_portable);

/// Byte `j` of grid entry `e`, as f32.
#[inline(always)]
fn grid_byte(e: u64, j: usize) -> f32 {
    (e >> (8 * j)) as u8 as f32
}

/// Writes `(db · grid[j]) · sign[j]` for the 8 values of one group, the order numpy multiplies in.
#[inline(always)]
fn put_group8(out: &mut [f32], db: f32, grid: u64, signs: u8) {
    for (j, o) in out[..8].iter_mut().enumerate() {
        *o = db * grid_byte(grid, j) * sign_f32(signs, j);
    }
}

fn dequantize_iq2_xxs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ2_XXS_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b);
        for ib in 0..8 {
            let idx = &b[2 + 8 * ib..6 + 8 * ib];
            let aux = u32_at(b, 6 + 8 * ib);
            let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
            for l in 0..4 {
                let signs = KSIGNS_IQ2XS[(aux >> (7 * l) & 127) as usize];
                put_group8(
                    &mut y[32 * ib + 8 * l..],
                    db,
                    IQ2XXS_GRID[idx[l] as usize],
                    signs,
                );
            }
        }
    }
}

fn dequantize_iq2_xs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ2_XS_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b);
        for k in 0..32 {
            let q = u16_at(b, 2 + 2 * k);
            let s = b[66 + k / 4] >> (4 * (k / 2 % 2)) & 15;
            let db = d * (0.5 + s as f32) * 0.25;
            let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
            put_group8(&mut y[8 * k..], db, IQ2XS_GRID[(q & 511) as usize], signs);
        }
    }
}

/// Grid index of group `k` (0..32) of an IQ2_S block: low byte in `qs`, two high bits in `qh`.
#[inline(always)]
fn iq2s_index(b: &[u8], k: usize) -> usize {
    b[2 + k] as usize | ((b[66 + k / 4] as usize >> (2 * (k % 4))) & 3) << 8
}

fn dequantize_iq2_s(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ2_S_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b);
        for k in 0..32 {
            let s = b[74 + k / 4] >> (4 * (k / 2 % 2)) & 15;
            let db = d * (0.5 + s as f32) * 0.25;
            put_group8(&mut y[8 * k..], db, IQ2S_GRID[iq2s_index(b, k)], b[34 + k]);
        }
    }
}

/// Σ grid[j] · ±q8[j] over one group of 8 (signs as a sign byte).
#[inline(always)]
fn group8_dot(grid: u64, signs: u8, a: &[u8], base: usize) -> i32 {
    let mut sum = 0;
    for j in 0..8 {
        let g = (grid >> (8 * j)) as u8 as i32;
        let q = q8k_q(a, base + j);
        sum += if signs >> j & 1 != 0 { -g * q } else { g * q };
    }
    sum
}

/// Portable IQ2_XXS × Q8_K dot product (llama.cpp's `ggml_vec_dot_iq2_xxs_q8_K_generic`).
pub(crate) fn vec_dot_iq2_xxs_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (b, a) in row
        .chunks_exact(IQ2_XXS_BYTES)
        .zip(act.chunks_exact(Q8K_BYTES))
        .take(n / QK_K)
    {
        let d = f16_at(b) * q8k_d(a);
        let mut bsum = 0i32;
        for ib in 0..8 {
            let aux = u32_at(b, 6 + 8 * ib);
            let ls = 2 * (aux >> 28) as i32 + 1;
            let mut sumi = 0;
            for l in 0..4 {
                let grid = IQ2XXS_GRID[b[2 + 8 * ib + l] as usize];
                let signs = KSIGNS_IQ2XS[(aux >> (7 * l) & 127) as usize];
                sumi += group8_dot(grid, signs, a, 32 * ib + 8 * l);
            }
            bsum += sumi * ls;
        }
        sumf += d * bsum as f32;
    }
    0.125 * sumf
}

/// Portable IQ2_XS × Q8_K dot product (llama.cpp's `ggml_vec_dot_iq2_xs_q8_K_generic`).
pub(crate) fn vec_dot_iq2_xs_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (b, a) in row
        .chunks_exact(IQ2_XS_BYTES)
        .zip(act.chunks_exact(Q8K_BYTES))
        .take(n / QK_K)
    {
        let d = f16_at(b) * q8k_d(a);
        let mut bsum = 0i32;
        for ib in 0..8 {
            let sc = b[66 + ib];
            for (half, ls) in [2 * (sc & 15) as i32 + 1, 2 * (sc >> 4) as i32 + 1]
                .into_iter()
                .enumerate()
            {
                let mut sumi = 0;
                for l in 0..2 {
                    let k = 4 * ib + 2 * half + l;
                    let q = u16_at(b, 2 + 2 * k);
                    sumi += group8_dot(
                        IQ2XS_GRID[(q & 511) as usize],
                        KSIGNS_IQ2XS[(q >> 9) as usize],
                        a,
                        8 * k,
                    );
                }
                bsum += sumi * ls;
            }
        }
        sumf += d * bsum as f32;
    }
    0.125 * sumf
}

/// Portable IQ2_S × Q8_K dot product (llama.cpp's `ggml_vec_dot_iq2_s_q8_K_generic`).
pub(crate) fn vec_dot_iq2_s_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (b, a) in row
        .chunks_exact(IQ2_S_BYTES)
        .zip(act.chunks_exact(Q8K_BYTES))
        .take(n / QK_K)
    {
        let d = f16_at(b) * q8k_d(a);
        let mut bsum = 0i32;
        for ib in 0..8 {
            let sc = b[74 + ib];
            let (ls1, ls2) = (1 + 2 * (sc & 15) as i32, 1 + 2 * (sc >> 4) as i32);
            let mut sumi = [0i32; 2];
            for l in 0..4 {
                let k = 4 * ib + l;
                sumi[l / 2] += group8_dot(IQ2S_GRID[iq2s_index(b, k)], b[34 + k], a, 8 * k);
            }
            bsum += ls1 * sumi[0] + ls2 * sumi[1];
        }
        sumf += d * bsum as f32;
    }
    0.125 * sumf
}

/// The `d` giving values of root-mean-square `rms` when scales `s` (4 bits), grid entries and signs are
/// uniform: values are `d · (2s + 1)/8 · g`.
fn iq2_d(rms: f32, grid_mean_square: f64) -> DitheredF16 {
    DitheredF16::new(
        (rms as f64 * 8.0 / (odd_scale_mean_square(4) * grid_mean_square).sqrt()) as f32,
    )
}

const IQ2XXS_GRID_MS: f64 = grid_mean_square_u64(&IQ2XXS_GRID, false);
const IQ2XS_GRID_MS: f64 = grid_mean_square_u64(&IQ2XS_GRID, false);
const IQ2S_GRID_MS: f64 = grid_mean_square_u64(&IQ2S_GRID, false);

fn fill_random_iq2_xxs(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    let d = iq2_d(rms, IQ2XXS_GRID_MS);
    fill_blocks(rng, dst, IQ2_XXS_BYTES, |b| d.put(b));
}

fn fill_random_iq2_xs(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    let d = iq2_d(rms, IQ2XS_GRID_MS);
    fill_blocks(rng, dst, IQ2_XS_BYTES, |b| d.put(b));
}

fn fill_random_iq2_s(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    let d = iq2_d(rms, IQ2S_GRID_MS);
    fill_blocks(rng, dst, IQ2_S_BYTES, |b| d.put(b));
}
