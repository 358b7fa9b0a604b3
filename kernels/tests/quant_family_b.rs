//! Family B formats (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, MXFP4): checks
//! beyond the per-type properties of `quant_properties.rs`.
//!
//! - The dot product equals the f64 dot product of the dequantized weights with the *dequantized*
//!   activations up to f32 rounding: `|dot − Σ w_i·x'_i| ≤ 1e-5·Σ|w_i·x'_i| + 1e-30`. Both sides see the
//!   same quantized activations, so this catches any mis-indexed value, sign or scale that the looser
//!   bound against exact activations could hide.
//! - Against the *exact* activations the dot product is within the error activation quantization allows:
//!   each `x_i` becomes `x'_i` with `|x_i − x'_i| ≤ e_i`, `e_i = 0.5·amax/127` for Q8_K (f32 scale) and
//!   `0.57·amax/127` for Q8_0 (its f16 scale adds at most 127·2⁻¹¹ of a step), `amax` the largest |x| of
//!   the activation block; so `|dot − Σ w_i·x_i| ≤ Σ|w_i|·e_i + 1e-4·Σ|w_i·x_i|`, the last term for f32
//!   rounding.
//! - The SIMD and portable dot products agree within `1e-5·Σ|w_i·x'_i|` on every row length (odd numbers of
//!   blocks exercise the SIMD tails), on blocks of arbitrary bytes (negative scales, every index, sign
//!   and sub-scale pattern), and on activations of full magnitude (±127, where 16-bit pair sums come
//!   closest to saturating).
//! - `fill_random` is deterministic, writes finite values for RMS targets across eight decades, and over a
//!   large sample its mean is under 2% and its RMS within 5% of the target.

use poly_kernels::quant::{dequantize, fill_random, vec_dot, ActType, GgmlType};
use poly_kernels::rng::Rng;

const FAMILY_B: &[GgmlType] = &[
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
];

/// Dequantizes Q8_0 or Q8_K activation blocks.
fn dequantize_act(act: ActType, bytes: &[u8]) -> Vec<f32> {
    let mut out = Vec::new();
    match act {
        ActType::Q8_0 => {
            for b in bytes.chunks_exact(34) {
                let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                out.extend(b[2..].iter().map(|&q| d * q as i8 as f32));
            }
        }
        ActType::Q8_K => {
            for b in bytes.chunks_exact(292) {
                let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                out.extend(b[4..260].iter().map(|&q| d * q as i8 as f32));
            }
        }
        other => panic!("family B does not use {other:?} activations"),
    }
    out
}

/// Σ w·x' and Σ|w·x'| in f64.
fn reference_dot(w: &[f32], x: &[f32]) -> (f64, f64) {
    w.iter().zip(x).fold((0.0, 0.0), |(s, m), (&a, &b)| {
        let p = a as f64 * b as f64;
        (s + p, m + p.abs())
    })
}

/// Σ|w_i|·e_i: the most that quantizing the activations `x` to `act` can move the dot product.
fn activation_error(act: ActType, w: &[f32], x: &[f32]) -> f64 {
    let (block, step) = match act {
        ActType::Q8_0 => (32, 0.57 / 127.0),
        ActType::Q8_K => (256, 0.5 / 127.0),
        other => panic!("family B does not use {other:?} activations"),
    };
    w.chunks(block)
        .zip(x.chunks(block))
        .map(|(wb, xb)| {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
            wb.iter().map(|&v| (v as f64).abs()).sum::<f64>() * amax * step
        })
        .sum()
}

/// Row lengths to try: single blocks, odd block counts, and a typical hidden size.
fn lengths(ty: GgmlType) -> Vec<usize> {
    let be = ty.block_elems();
    let mut v = vec![be, 2 * be, 3 * be, 7 * be, 2048];
    v.retain(|n| n % be == 0);
    v
}

/// Random blocks made of arbitrary bytes, with the scale fields set to finite values of either sign.
fn arbitrary_blocks(ty: GgmlType, rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut row = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
    rng.fill_bytes(&mut row);
    for b in row.chunks_exact_mut(ty.block_bytes()) {
        let d = half::f16::from_f32((rng.f32() - 0.5) * 0.01).to_bits();
        match ty {
            GgmlType::MXFP4 => b[0] = 100 + (b[0] % 40),
            GgmlType::IQ1_M => {
                for w in 0..4 {
                    b[49 + 2 * w] = (b[49 + 2 * w] & 0x0f) | (((d >> (4 * w)) & 15) as u8) << 4;
                }
            }
            _ => b[..2].copy_from_slice(&d.to_le_bytes()),
        }
    }
    row
}

fn activations(rng: &mut Rng, n: usize, kind: usize) -> Vec<f32> {
    (0..n)
        .map(|i| match kind {
            // Gaussian with outliers.
            0 => rng.normal() * if i % 61 == 5 { 30.0 } else { 1.0 },
            // Full-scale quants: every activation quantizes to ±127.
            _ => {
                if rng.next_u64() & 1 == 0 {
                    3.0
                } else {
                    -3.0
                }
            }
        })
        .collect()
}

#[test]
fn dot_equals_dequantized_dot_and_simd_equals_portable() {
    let mut rng = Rng::new(0xB);
    for &ty in FAMILY_B {
        let ops = ty.ops().unwrap_or_else(|| panic!("{ty} has no operations"));
        for n in lengths(ty) {
            for (trial, kind) in [(0, 0), (1, 0), (2, 1)] {
                let row = if trial == 1 {
                    arbitrary_blocks(ty, &mut rng, n)
                } else {
                    let mut r = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
                    fill_random(ty, &mut rng, 0.03, &mut r).unwrap();
                    r
                };
                let mut w = vec![0f32; n];
                dequantize(ty, &row, &mut w).unwrap();
                let x = activations(&mut rng, n, kind);
                let mut act = vec![0u8; ops.act.bytes_for(n)];
                ops.act.quantize(&x, &mut act);
                let xq = dequantize_act(ops.act, &act);
                let (exact, magnitude) = reference_dot(&w, &xq);
                let tolerance = 1e-5 * magnitude + 1e-30;
                let fast = vec_dot(ty, n, &row, &act).unwrap() as f64;
                let (exact_x, magnitude_x) = reference_dot(&w, &x);
                let bound = activation_error(ops.act, &w, &x) + 1e-4 * magnitude_x;
                assert!(
                    (fast - exact_x).abs() <= bound,
                    "{ty} n={n} trial {trial}: vec_dot {fast} vs exact {exact_x} (bound {bound})"
                );
                let portable = (ops.vec_dot_portable)(n, &row, &act) as f64;
                assert!(
                    (portable - exact).abs() <= tolerance,
                    "{ty} n={n} trial {trial}: portable {portable} vs {exact} (tolerance {tolerance})"
                );
                assert!(
                    (fast - exact).abs() <= tolerance,
                    "{ty} n={n} trial {trial}: vec_dot {fast} vs {exact} (tolerance {tolerance})"
                );
                assert!(
                    (fast - portable).abs() <= tolerance,
                    "{ty} n={n} trial {trial}: vec_dot {fast} vs portable {portable}"
                );
            }
        }
    }
}

#[test]
fn fill_random_is_deterministic_finite_and_on_target() {
    for &ty in FAMILY_B {
        let n = 1 << 18;
        let bytes = ty.bytes_for(n as u64).unwrap() as usize;
        let (mut a, mut b) = (vec![0u8; bytes], vec![0u8; bytes]);
        fill_random(ty, &mut Rng::new(3), 0.5, &mut a).unwrap();
        fill_random(ty, &mut Rng::new(3), 0.5, &mut b).unwrap();
        assert!(a == b, "{ty}: same seed, different blocks");

        for rms in [1e-4f32, 0.01, 0.5, 1e4] {
            fill_random(ty, &mut Rng::new(rms.to_bits() as u64), rms, &mut a).unwrap();
            let mut w = vec![0f32; n];
            dequantize(ty, &a, &mut w).unwrap();
            assert!(
                w.iter().all(|v| v.is_finite()),
                "{ty}: non-finite value at rms {rms}"
            );
            let mean = w.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
            let got = (w.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / n as f64).sqrt();
            assert!(
                (got / rms as f64 - 1.0).abs() < 0.05,
                "{ty}: rms {got} for target {rms}"
            );
            assert!(
                mean.abs() < 0.02 * rms as f64,
                "{ty}: mean {mean} at rms {rms}"
            );
        }
    }
}

#[test]
fn family_b_uses_llama_cpp_activation_formats() {
    for &ty in FAMILY_B {
        let want = match ty {
            GgmlType::IQ4_NL | GgmlType::MXFP4 => ActType::Q8_0,
            _ => ActType::Q8_K,
        };
        assert_eq!(ty.ops().map(|o| o.act), Some(want), "{ty}");
    }
}
