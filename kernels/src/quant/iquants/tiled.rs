//! llama.cpp's batch order for IQ2_XS, IQ3_XXS and IQ4_XS: its CPU backend multiplies batches of 8
//! activation rows or more (`MUL_MAT` and each expert of `MUL_MAT_ID`) with ggml's tiled matmul
//! (`ggml-cpu/tiled`), which takes these formats too. Per super-block it forms the exact integer total
//! `T = Σ_g scale_g · Σ_{e ∈ g} value_e · q8_e` and adds `fma(xd·T, yd, acc)`, where `xd` is the block's
//! f16 scale times the format's constant (IQ2_XS: 1/8, IQ3_XXS: 1/4, IQ4_XS: 1) and `scale_g` the odd
//! multiplier `2s + 1` (IQ2, IQ3) or `ls − 32` (IQ4_XS); the AVX2 build fuses the last step.
//!
//! [`block`] decodes a super-block into its signed values and scales, which the portable dot product here
//! and the AVX-512 tile kernel (`x86::ktile_avx512`) share.

use super::iq2::IQ2_XS_BYTES;
use super::iq3::IQ3_XXS_BYTES;
pub(crate) use super::iq4::iq4xs_scale;
use super::iq4::IQ4_XS_BYTES;
use super::tables::{IQ2XS_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS, KVALUES_IQ4NL};
use super::{q8k_d, u16_at, u32_at, Q8K_BYTES, QK_K};
use crate::quant::{f16_at, BatchDot, GgmlType};

/// The IQ formats with a tiled batch order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IqKind {
    Iq2Xs,
    Iq3Xxs,
    Iq4Xs,
}

impl IqKind {
    pub(crate) fn of(ty: GgmlType) -> Option<IqKind> {
        match ty {
            GgmlType::IQ2_XS => Some(IqKind::Iq2Xs),
            GgmlType::IQ3_XXS => Some(IqKind::Iq3Xxs),
            GgmlType::IQ4_XS => Some(IqKind::Iq4Xs),
            _ => None,
        }
    }

    pub(crate) const fn block_bytes(self) -> usize {
        match self {
            IqKind::Iq2Xs => IQ2_XS_BYTES,
            IqKind::Iq3Xxs => IQ3_XXS_BYTES,
            IqKind::Iq4Xs => IQ4_XS_BYTES,
        }
    }
}

/// Eight grid magnitudes (bytes of `g`) with the signs of `signs` (bit `j`: value `j` negative).
#[inline(always)]
fn signed8(out: &mut [i8], g: u64, signs: u8) {
    for (j, o) in out[..8].iter_mut().enumerate() {
        let v = (g >> (8 * j)) as u8 as i8;
        *o = if signs >> j & 1 != 0 { -v } else { v };
    }
}

/// The 256 signed values of super-block `b`, the scale of each 16-value group (a 32-value sub-block's
/// scale in both of its groups) and `xd`.
#[inline(always)]
pub(crate) fn block(kind: IqKind, b: &[u8]) -> ([i8; QK_K], [i32; 16], f32) {
    let mut v = [0i8; QK_K];
    let mut sc = [0i32; 16];
    let xd = match kind {
        IqKind::Iq2Xs => {
            for k in 0..32 {
                let q = u16_at(b, 2 + 2 * k);
                let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
                signed8(&mut v[8 * k..], IQ2XS_GRID[(q & 511) as usize], signs);
            }
            for ib in 0..8 {
                sc[2 * ib] = 2 * (b[66 + ib] & 15) as i32 + 1;
                sc[2 * ib + 1] = 2 * (b[66 + ib] >> 4) as i32 + 1;
            }
            f16_at(b) * 0.125
        }
        IqKind::Iq3Xxs => {
            for ib in 0..8 {
                let aux = u32_at(b, 66 + 4 * ib);
                let ls = 2 * (aux >> 28) as i32 + 1;
                sc[2 * ib] = ls;
                sc[2 * ib + 1] = ls;
                for l in 0..4 {
                    let signs = KSIGNS_IQ2XS[(aux >> (7 * l) & 127) as usize];
                    let g1 = IQ3XXS_GRID[b[2 + 8 * ib + 2 * l] as usize] as u64;
                    let g2 = IQ3XXS_GRID[b[3 + 8 * ib + 2 * l] as usize] as u64;
                    signed8(&mut v[32 * ib + 8 * l..], g1 | g2 << 32, signs);
                }
            }
            f16_at(b) * 0.25
        }
        IqKind::Iq4Xs => {
            for ib in 0..8 {
                let ls = iq4xs_scale(b, ib);
                sc[2 * ib] = ls;
                sc[2 * ib + 1] = ls;
                for j in 0..16 {
                    let q = b[8 + 16 * ib + j];
                    v[32 * ib + j] = KVALUES_IQ4NL[(q & 15) as usize];
                    v[32 * ib + 16 + j] = KVALUES_IQ4NL[(q >> 4) as usize];
                }
            }
            f16_at(b)
        }
    };
    (v, sc, xd)
}

/// The tiled order's dot product of one row with one activation row (portable).
fn tiled_portable(kind: IqKind, n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = n / QK_K;
    let bb = kind.block_bytes();
    assert!(
        row.len() >= nb * bb && act.len() >= nb * Q8K_BYTES,
        "{kind:?} row or activations shorter than {n} values"
    );
    let mut acc = 0f32;
    for (x, y) in row
        .chunks_exact(bb)
        .zip(act.chunks_exact(Q8K_BYTES))
        .take(nb)
    {
        let (v, sc, xd) = block(kind, x);
        let mut t = 0i32;
        for (g, &s) in sc.iter().enumerate() {
            let dot: i32 = (16 * g..16 * g + 16)
                .map(|e| v[e] as i32 * y[4 + e] as i8 as i32)
                .sum();
            t += s * dot;
        }
        acc = (xd * t as f32).mul_add(q8k_d(y), acc);
    }
    acc
}

macro_rules! iq_tiled {
    ($name:ident, $kind:expr, $dot:ident, $portable:ident, $avx2:ident) => {
        fn $dot(n: usize, row: &[u8], act: &[u8]) -> f32 {
            #[cfg(target_arch = "x86_64")]
            if crate::quant::has_avx2_fma() {
                let nb = n / QK_K;
                assert!(
                    row.len() >= nb * $kind.block_bytes() && act.len() >= nb * Q8K_BYTES,
                    "{:?} row or activations shorter than {n} values",
                    $kind
                );
                // SAFETY: `has_avx2_fma` confirmed AVX2, FMA and F16C at run time; the kernel reads
                // `n / 256` blocks of each slice (checked above; it also bounds-checks its slices).
                return unsafe { crate::quant::x86::iquants_avx2::$avx2::<true>(n, row, act) };
            }
            tiled_portable($kind, n, row, act)
        }
        fn $portable(n: usize, row: &[u8], act: &[u8]) -> f32 {
            tiled_portable($kind, n, row, act)
        }
        /// The format's batch order (`quant::BatchDot`): ggml's tiled matmul, batches of 8 rows or more.
        /// Batches take the tile kernel where there is one (AVX-512 VNNI), else the row kernel `dot`.
        pub(crate) static $name: BatchDot = BatchDot {
            dot: $dot,
            portable: $portable,
            applies: |n, _| n >= 8,
            dot4: None,
        };
    };
}

iq_tiled!(
    IQ2XS_TILED,
    IqKind::Iq2Xs,
    iq2xs_tiled,
    iq2xs_tiled_portable,
    vec_dot_iq2_xs_order
);
iq_tiled!(
    IQ3XXS_TILED,
    IqKind::Iq3Xxs,
    iq3xxs_tiled,
    iq3xxs_tiled_portable,
    vec_dot_iq3_xxs_order
);
iq_tiled!(
    IQ4XS_TILED,
    IqKind::Iq4Xs,
    iq4xs_tiled,
    iq4xs_tiled_portable,
    vec_dot_iq4_xs_order
);

/// The batch order of `ty`, for the IQ formats that have one.
pub(crate) fn batch_dot(ty: GgmlType) -> Option<&'static BatchDot> {
    match ty {
        GgmlType::IQ2_XS => Some(&IQ2XS_TILED),
        GgmlType::IQ3_XXS => Some(&IQ3XXS_TILED),
        GgmlType::IQ4_XS => Some(&IQ4XS_TILED),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{fill_random, ActType};
    use crate::rng::Rng;

    /// The values and scales [`block`] decodes are the format's: the tiled order agrees with the
    /// single-row dot product to rounding.
    #[test]
    fn tiled_order_agrees_with_the_single_row_order() {
        let mut rng = Rng::new(7);
        for ty in [GgmlType::IQ2_XS, GgmlType::IQ3_XXS, GgmlType::IQ4_XS] {
            let n = 2048;
            let mut row = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
            fill_random(ty, &mut rng, 0.05, &mut row).unwrap();
            let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
            let mut a = vec![0u8; ActType::Q8_K.bytes_for(n)];
            ActType::Q8_K.quantize(&x, &mut a);
            let single = (ty.ops().unwrap().vec_dot_portable)(n, &row, &a);
            let tiled = (batch_dot(ty).unwrap().portable)(n, &row, &a);
            let mut deq = vec![0f32; n];
            crate::quant::dequantize(ty, &row, &mut deq).unwrap();
            let mag: f32 = deq.iter().zip(&x).map(|(w, x)| (w * x).abs()).sum();
            assert!(
                (single - tiled).abs() <= 1e-5 * mag,
                "{ty}: single {single} tiled {tiled}"
            );
            assert_ne!(single, 0.0);
            let fast = (batch_dot(ty).unwrap().dot)(n, &row, &a);
            assert_eq!(
                fast.to_bits(),
                tiled.to_bits(),
                "{ty}: row kernel {fast} portable {tiled}"
            );
        }
    }
}
