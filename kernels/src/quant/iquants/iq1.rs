//! The 1-bit lattice formats: IQ1_S (1.56 bits per weight) and IQ1_M (1.75).
//!
//! Both code groups of 8 values as an 11-bit index into a grid of values in {-1, 0, 1}, shifted by a
//! per-group `±1/8` and scaled by `d · (2s + 1)` with a 3-bit `s`. IQ1_S has one scale and one shift sign
//! per 32 values and an f16 `d`; IQ1_M has a scale per 16 values, a shift sign per 8, and scatters its f16
//! `d` over the top nibbles of the four scale words.

use super::tables::IQ1S_GRID;
use super::{
    fill_blocks, grid_mean_square_u64, odd_scale_mean_square, q8k_bsum, q8k_d, q8k_q,
    simd_dispatch, u16_at, DitheredF16, Q8K_BYTES, QK_K,
};
use crate::quant::{f16_at, ActType, QuantOps};
use crate::rng::Rng;

/// IQ1_S block: f16 `d`, 32 grid index low bytes, 8 × u16 (4 × 3 high index bits, 3-bit scale, shift sign).
pub(crate) const IQ1_S_BYTES: usize = 50;
/// IQ1_M block: 32 grid index low bytes, 16 bytes of (3 high index bits, shift sign) nibbles, 4 × u16 of
/// four 3-bit scales each with a nibble of the f16 `d` on top.
pub(crate) const IQ1_M_BYTES: usize = 56;

/// The shift added to every grid value (`IQ1S_DELTA`, `IQ1M_DELTA`).
pub(crate) const IQ1_DELTA: f32 = 0.125;

pub(crate) static IQ1_S: QuantOps = QuantOps {
    dequantize: dequantize_iq1_s,
    act: ActType::Q8_K,
    vec_dot: vec_dot_iq1_s,
    vec_dot_portable: vec_dot_iq1_s_portable,
    fill_random: fill_random_iq1_s,
};

pub(crate) static IQ1_M: QuantOps = QuantOps {
    dequantize: dequantize_iq1_m,
    act: ActType::Q8_K,
    vec_dot: vec_dot_iq1_m,
    vec_dot_portable: vec_dot_iq1_m_portable,
    fill_random: fill_random_iq1_m,
};

simd_dispatch!(vec_dot_iq1_s, vec_dot_iq1_s, vec_dot_iq1_s_portable);
simd_dispatch!(vec_dot_iq1_m, vec_dot_iq1_m, vec_dot_iq1_m_portable);

/// Writes `dl · (grid[j] + delta)` for the 8 values of one group, as numpy computes it.
#[inline(always)]
fn put_group8(out: &mut [f32], dl: f32, grid: u64, delta: f32) {
    for (j, o) in out[..8].iter_mut().enumerate() {
        *o = dl * ((grid >> (8 * j)) as u8 as i8 as f32 + delta);
    }
}

/// Σ grid[j] · q8[j] over one group of 8.
#[inline(always)]
fn group8_dot(grid: u64, a: &[u8], base: usize) -> i32 {
    (0..8)
        .map(|j| (grid >> (8 * j)) as u8 as i8 as i32 * q8k_q(a, base + j))
        .sum()
}

fn dequantize_iq1_s(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ1_S_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b);
        for ib in 0..8 {
            let qh = u16_at(b, 34 + 2 * ib);
            let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
            let delta = if qh & 0x8000 == 0 {
                IQ1_DELTA
            } else {
                -IQ1_DELTA
            };
            for l in 0..4 {
                let idx = b[2 + 4 * ib + l] as usize | (((qh >> (3 * l)) & 7) as usize) << 8;
                put_group8(&mut y[32 * ib + 8 * l..], dl, IQ1S_GRID[idx], delta);
            }
        }
    }
}

/// The f16 super-block scale of an IQ1_M block, gathered from the top nibbles of its scale words.
#[inline(always)]
pub(crate) fn iq1m_d(b: &[u8]) -> f32 {
    let sc = |w: usize| u16_at(b, 48 + 2 * w);
    let bits = (sc(0) >> 12) | ((sc(1) >> 8) & 0x00f0) | ((sc(2) >> 4) & 0x0f00) | (sc(3) & 0xf000);
    half::f16::from_bits(bits).to_f32()
}

/// The odd multiplier `2s + 1` of 16-value half `t` (0..16) of an IQ1_M block.
#[inline(always)]
fn iq1m_scale(b: &[u8], t: usize) -> u16 {
    2 * ((u16_at(b, 48 + 2 * (t / 4)) >> (3 * (t % 4))) & 7) + 1
}

fn dequantize_iq1_m(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ1_M_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = iq1m_d(b);
        for t in 0..16 {
            let dl = d * iq1m_scale(b, t) as f32;
            for g in 0..2 {
                let k = 2 * t + g;
                let qh = b[32 + k / 2] >> (4 * (k % 2));
                let idx = b[k] as usize | ((qh & 7) as usize) << 8;
                let delta = if qh & 8 == 0 { IQ1_DELTA } else { -IQ1_DELTA };
                put_group8(&mut y[8 * k..], dl, IQ1S_GRID[idx], delta);
            }
        }
    }
}

/// Portable IQ1_S × Q8_K dot product (llama.cpp's `ggml_vec_dot_iq1_s_q8_K_generic`).
pub(crate) fn vec_dot_iq1_s_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (b, a) in row
        .chunks_exact(IQ1_S_BYTES)
        .zip(act.chunks_exact(Q8K_BYTES))
        .take(n / QK_K)
    {
        let (mut sumi, mut sumi1) = (0i32, 0i32);
        for ib in 0..8 {
            let qh = u16_at(b, 34 + 2 * ib);
            let ls = 2 * ((qh >> 12) & 7) as i32 + 1;
            let delta = if qh & 0x8000 != 0 { -1 } else { 1 };
            let mut lsum = 0;
            for l in 0..4 {
                let idx = b[2 + 4 * ib + l] as usize | (((qh >> (3 * l)) & 7) as usize) << 8;
                lsum += group8_dot(IQ1S_GRID[idx], a, 32 * ib + 8 * l);
            }
            sumi += ls * lsum;
            sumi1 += ls * delta * (q8k_bsum(a, 2 * ib) + q8k_bsum(a, 2 * ib + 1));
        }
        sumf += f16_at(b) * q8k_d(a) * (sumi as f32 + IQ1_DELTA * sumi1 as f32);
    }
    sumf
}

/// Portable IQ1_M × Q8_K dot product (llama.cpp's `ggml_vec_dot_iq1_m_q8_K_generic`).
pub(crate) fn vec_dot_iq1_m_portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (b, a) in row
        .chunks_exact(IQ1_M_BYTES)
        .zip(act.chunks_exact(Q8K_BYTES))
        .take(n / QK_K)
    {
        let (mut sumi1, mut sumi2) = (0i32, 0i32);
        for t in 0..16 {
            let ls = iq1m_scale(b, t) as i32;
            let (mut sum1, mut sum2) = (0i32, 0i32);
            for g in 0..2 {
                let k = 2 * t + g;
                let qh = b[32 + k / 2] >> (4 * (k % 2));
                let idx = b[k] as usize | ((qh & 7) as usize) << 8;
                sum1 += group8_dot(IQ1S_GRID[idx], a, 8 * k);
                let qsum: i32 = (0..8).map(|j| q8k_q(a, 8 * k + j)).sum();
                sum2 += if qh & 8 != 0 { -qsum } else { qsum };
            }
            sumi1 += sum1 * ls;
            sumi2 += sum2 * ls;
        }
        sumf += iq1m_d(b) * q8k_d(a) * (sumi1 as f32 + IQ1_DELTA * sumi2 as f32);
    }
    sumf
}

/// Mean square of `g + delta` over uniform grid entries and shift signs.
const IQ1_VALUE_MS: f64 =
    grid_mean_square_u64(&IQ1S_GRID, true) + (IQ1_DELTA as f64) * (IQ1_DELTA as f64);

/// The `d` giving values `d · (2s + 1) · (g ± 1/8)` of root-mean-square `rms` (uniform 3-bit `s`).
fn iq1_d(rms: f32) -> DitheredF16 {
    DitheredF16::new((rms as f64 / (odd_scale_mean_square(3) * IQ1_VALUE_MS).sqrt()) as f32)
}

fn fill_random_iq1_s(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    let d = iq1_d(rms);
    fill_blocks(rng, dst, IQ1_S_BYTES, |b| d.put(b));
}

fn fill_random_iq1_m(rng: &mut Rng, rms: f32, dst: &mut [u8]) {
    let d = iq1_d(rms);
    fill_blocks(rng, dst, IQ1_M_BYTES, |b| {
        // The random scale bits (low bits of the first word) serve as the coin.
        let bits = d.pick(u16_at(b, 48));
        for w in 0..4 {
            let at = 48 + 2 * w;
            let word = (u16_at(b, at) & 0x0fff) | ((bits >> (4 * w)) & 15) << 12;
            b[at..at + 2].copy_from_slice(&word.to_le_bytes());
        }
    });
}
