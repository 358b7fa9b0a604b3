//! The IQ formats of llama.cpp: the lattice-grid codes IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S
//! (super-blocks of 256 values), and the non-linear 4-bit formats IQ4_NL (blocks of 32) and IQ4_XS
//! (super-blocks of 256).
//!
//! Each format's layout, dequantization (bit for bit what the `gguf` package computes, operation by
//! operation in f32), portable dot product (integer sums as llama.cpp's `*_generic` code) and random block
//! writer live in the submodules [`iq1`], [`iq2`], [`iq3`] and [`iq4`]; the grids are the generated
//! [`tables`] (see `iquants/gen_tables.py`). The AVX2 dot products are in `quant/x86/iquants_avx2.rs`.
//!
//! Activation formats follow llama.cpp's `vec_dot_type`: IQ4_NL multiplies Q8_0 activations, every other
//! IQ format Q8_K.

mod iq1;
mod iq2;
mod iq3;
mod iq4;
pub(crate) mod tables;
pub(crate) mod tiled;

use super::{GgmlType, QuantOps};
use crate::rng::Rng;

/// The operations of this family's types.
pub(crate) fn ops(ty: GgmlType) -> Option<&'static QuantOps> {
    match ty {
        GgmlType::IQ1_S => Some(&iq1::IQ1_S),
        GgmlType::IQ1_M => Some(&iq1::IQ1_M),
        GgmlType::IQ2_XXS => Some(&iq2::IQ2_XXS),
        GgmlType::IQ2_XS => Some(&iq2::IQ2_XS),
        GgmlType::IQ2_S => Some(&iq2::IQ2_S),
        GgmlType::IQ3_XXS => Some(&iq3::IQ3_XXS),
        GgmlType::IQ3_S => Some(&iq3::IQ3_S),
        GgmlType::IQ4_NL => Some(&iq4::IQ4_NL),
        GgmlType::IQ4_XS => Some(&iq4::IQ4_XS),
        _ => None,
    }
}

/// Values per super-block.
pub(crate) const QK_K: usize = 256;

/// Bytes of one Q8_K activation block: f32 scale, 256 × i8, 16 × i16 sums of 16 quants.
pub(crate) const Q8K_BYTES: usize = 292;

/// The f32 scale of a Q8_K block.
#[inline(always)]
pub(crate) fn q8k_d(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Quant `i` (0..256) of a Q8_K block.
#[inline(always)]
pub(crate) fn q8k_q(b: &[u8], i: usize) -> i32 {
    b[4 + i] as i8 as i32
}

/// Sum `g` (0..16) of quants `16g..16g+16` of a Q8_K block.
#[inline(always)]
pub(crate) fn q8k_bsum(b: &[u8], g: usize) -> i32 {
    i16::from_le_bytes([b[260 + 2 * g], b[261 + 2 * g]]) as i32
}

/// Reads a little-endian u16 at `b[i..i + 2]`.
#[inline(always)]
pub(crate) fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

/// Reads a little-endian u32 at `b[i..i + 4]`.
#[inline(always)]
pub(crate) fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// `+1.0` or `-1.0` for sign bit `j` of a sign byte: dequantization multiplies by it, as numpy does.
#[inline(always)]
pub(crate) fn sign_f32(signs: u8, j: usize) -> f32 {
    if signs >> j & 1 != 0 {
        -1.0
    } else {
        1.0
    }
}

/// Mean square of the bytes of a grid of 8-byte entries (`signed`: bytes are i8).
pub(crate) const fn grid_mean_square_u64(grid: &[u64], signed: bool) -> f64 {
    let mut sum = 0.0;
    let mut i = 0;
    while i < grid.len() {
        let mut j = 0;
        while j < 8 {
            let b = (grid[i] >> (8 * j)) as u8;
            let v = if signed { b as i8 as f64 } else { b as f64 };
            sum += v * v;
            j += 1;
        }
        i += 1;
    }
    sum / (grid.len() * 8) as f64
}

/// Mean square of the bytes of a grid of 4-byte entries.
pub(crate) const fn grid_mean_square_u32(grid: &[u32]) -> f64 {
    let mut sum = 0.0;
    let mut i = 0;
    while i < grid.len() {
        let mut j = 0;
        while j < 4 {
            let v = ((grid[i] >> (8 * j)) as u8) as f64;
            sum += v * v;
            j += 1;
        }
        i += 1;
    }
    sum / (grid.len() * 4) as f64
}

/// Mean of `(2s + 1)²` over the `2^bits` values of a scale field `s`: the odd sub-block multipliers the
/// grid formats use (IQ2/IQ3 write them as `0.5 + s`, which is half of `2s + 1`).
pub(crate) const fn odd_scale_mean_square(bits: u32) -> f64 {
    let n = 1u32 << bits;
    let mut sum = 0.0;
    let mut s = 0;
    while s < n {
        let m = (2 * s + 1) as f64;
        sum += m * m;
        s += 1;
    }
    sum / n as f64
}

/// Fills `dst` (whole blocks of `block_bytes`) with random bytes, then lets `fix` rewrite each block's
/// scale fields. Every bit pattern of the IQ formats' index, sign and sub-scale fields is a valid code
/// (the ksigns formats store a 7-bit index whose eighth sign follows from parity), so only the scales
/// need choosing; the random bytes `fix` overwrites serve it as coins.
pub(crate) fn fill_blocks(
    rng: &mut Rng,
    dst: &mut [u8],
    block_bytes: usize,
    fix: impl FnMut(&mut [u8]),
) {
    random_bytes(rng, dst);
    dst.chunks_exact_mut(block_bytes).for_each(fix);
}

/// Fills `dst` with random bytes, eight per `next_u64` (several times faster than `Rng::fill_bytes`,
/// whose variable-length copies do not vectorize; synthetic models are tens of gigabytes).
pub(crate) fn random_bytes(rng: &mut Rng, dst: &mut [u8]) {
    let mut chunks = dst.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    let rest = chunks.into_remainder();
    let last = rng.next_u64().to_le_bytes();
    rest.copy_from_slice(&last[..rest.len()]);
}

/// A positive scale written as f16 without bias in its square: each block takes one of the two f16 values
/// around the wanted `d`, the upper with the probability that makes the mean of `d'^2` equal `d^2`. (A plain
/// rounding would miss small targets badly: below 6e-5, f16 values are 6e-8 apart.)
pub(crate) struct DitheredF16 {
    lo: u16,
    hi: u16,
    /// Probability of `hi`, in units of 2^-15.
    threshold: u32,
}

impl DitheredF16 {
    pub(crate) fn new(d: f32) -> Self {
        let d = d.clamp(0.0, half::f16::MAX.to_f32());
        let near = half::f16::from_f32(d);
        let (lo, hi) = if near.to_f32() > d {
            (near.to_bits() - 1, near.to_bits())
        } else if near == half::f16::MAX {
            (near.to_bits(), near.to_bits())
        } else {
            (near.to_bits(), near.to_bits() + 1)
        };
        let sq = |b: u16| (half::f16::from_bits(b).to_f64()).powi(2);
        let span = sq(hi) - sq(lo);
        let p = if span > 0.0 {
            (d as f64 * d as f64 - sq(lo)) / span
        } else {
            0.0
        };
        DitheredF16 {
            lo,
            hi,
            threshold: (p.clamp(0.0, 1.0) * 32768.0).round() as u32,
        }
    }

    /// The f16 bits for a block, chosen by the 15 random bits `coin`.
    #[inline(always)]
    pub(crate) fn pick(&self, coin: u16) -> u16 {
        if ((coin & 0x7fff) as u32) < self.threshold {
            self.hi
        } else {
            self.lo
        }
    }

    /// Writes the scale as a little-endian f16 at `b[0..2]`, using the random bits there as the coin.
    #[inline(always)]
    pub(crate) fn put(&self, b: &mut [u8]) {
        let bits = self.pick(u16_at(b, 0));
        b[..2].copy_from_slice(&bits.to_le_bytes());
    }
}

/// Dispatches a dot product to its AVX2 version when the CPU has AVX2, FMA and F16C, else to the portable
/// one.
macro_rules! simd_dispatch {
    ($name:ident, $avx2:ident, $portable:path) => {
        /// Dot product of a weight row with quantized activations (AVX2 when available).
        pub(crate) fn $name(n: usize, row: &[u8], act: &[u8]) -> f32 {
            #[cfg(target_arch = "x86_64")]
            if crate::quant::has_avx2_fma() {
                // SAFETY: has_avx2_fma() confirmed at run time that the CPU supports AVX2, FMA and F16C,
                // the features the callee is compiled for; the callee bounds-checks its slices itself.
                return unsafe { crate::quant::x86::iquants_avx2::$avx2(n, row, act) };
            }
            $portable(n, row, act)
        }
    };
}
pub(crate) use simd_dispatch;

#[cfg(test)]
mod tests {
    use super::tables::*;

    #[test]
    fn ksigns_follow_the_parity_rule() {
        for (i, &s) in KSIGNS_IQ2XS.iter().enumerate() {
            assert_eq!(s & 127, i as u8);
            assert_eq!(
                s.count_ones() % 2,
                0,
                "index {i}: odd number of minus signs"
            );
        }
    }

    #[test]
    fn grids_hold_only_their_levels() {
        let bytes = |g: u64| (0..8).map(move |j| (g >> (8 * j)) as u8);
        for g in IQ2XXS_GRID.iter().chain(&IQ2XS_GRID).chain(&IQ2S_GRID) {
            assert!(
                bytes(*g).all(|b| [0x08, 0x19, 0x2b].contains(&b)),
                "{g:#018x}"
            );
        }
        for g in &IQ3XXS_GRID {
            assert!(
                bytes(*g as u64).take(4).all(|b| b % 8 == 4 || b == 0x3e),
                "{g:#010x}"
            );
        }
        for g in &IQ3S_GRID {
            assert!(
                bytes(*g as u64).take(4).all(|b| b % 2 == 1 && b <= 15),
                "{g:#010x}"
            );
        }
        for g in &IQ1S_GRID {
            assert!(
                bytes(*g).all(|b| [0xff, 0x00, 0x01].contains(&b)),
                "{g:#018x}"
            );
        }
        // Each grid lists distinct points.
        fn distinct<T: Ord + Copy>(g: &[T]) -> bool {
            let mut v = g.to_vec();
            v.sort_unstable();
            v.windows(2).all(|w| w[0] != w[1])
        }
        assert!(distinct(&IQ2XXS_GRID) && distinct(&IQ2XS_GRID) && distinct(&IQ2S_GRID));
        assert!(distinct(&IQ3XXS_GRID) && distinct(&IQ3S_GRID) && distinct(&IQ1S_GRID));
        assert!(KVALUES_IQ4NL.windows(2).all(|w| w[0] < w[1]));
    }
}
