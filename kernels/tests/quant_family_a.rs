//! Dot products and random blocks of the family-A formats (F32, F16, BF16, Q4_0 … Q8_0, Q2_K … Q6_K).
//!
//! - The run-time chosen `vec_dot` (AVX2 where the CPU has it) equals `vec_dot_portable` bit for bit, on
//!   random blocks, on blocks with every field random, and on extreme blocks (largest quants and
//!   activations, the cases where 16-bit intermediate sums could saturate).
//! - Both are within a stated bound of the exact f64 dot product of the dequantized weights with the
//!   unquantized activations (see [`error_bound`]).
//! - `fill_random` writes finite values with zero mean, the asked root-mean-square and a symmetric
//!   distribution.

use poly_kernels::quant::{dequantize, fill_random, vec_dot, ActType, GgmlType};
use poly_kernels::rng::Rng;

const FAMILY_A: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Byte offsets of the f16 scale fields inside a block (for writing sane scales into random bytes).
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

/// Activation lengths to test: several super-blocks, plus lengths that leave a tail for the SIMD loops.
fn lengths(ty: GgmlType) -> Vec<usize> {
    match ty.block_elems() {
        1 => vec![1, 31, 32, 100, 4096, 4096 + 7],
        32 => vec![32, 32 * 7, 32 * 8, 32 * 13, 4096],
        _ => vec![256, 256 * 3, 4096],
    }
}

/// Activations: mostly normal, with a few large outliers as real hidden states have.
fn activations(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let v = rng.normal();
            if rng.below(100) == 0 {
                v * 20.0
            } else {
                v
            }
        })
        .collect()
}

/// Weights whose every byte is random, except f16 scales, which are finite and of either sign.
fn random_field_weights(ty: GgmlType, rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut w = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
    match ty {
        GgmlType::F32 => {
            for c in w.chunks_exact_mut(4) {
                c.copy_from_slice(&(rng.normal() * 0.1).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&half::f16::from_f32(rng.normal() * 0.1).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&half::bf16::from_f32(rng.normal() * 0.1).to_le_bytes());
            }
        }
        _ => {
            rng.fill_bytes(&mut w);
            for b in w.chunks_exact_mut(ty.block_bytes()) {
                for &o in f16_fields(ty) {
                    let v = (0.5 + rng.f32()) * 1e-3 * if rng.below(2) == 0 { 1.0 } else { -1.0 };
                    b[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                }
            }
        }
    }
    w
}

fn quantize_act(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let act = ty.ops().unwrap().act;
    let mut q = vec![0u8; act.bytes_for(x.len())];
    act.quantize(x, &mut q);
    q
}

fn f16_at(b: &[u8]) -> f64 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f64()
}

/// The bound on `|dot − Σ wᵢ·xᵢ|` (exact, in f64, with `w` dequantized and `x` unquantized) that the dot
/// products must meet:
///
/// `Σ |wᵢ|·errᵢ + Σ_blocks |m|·|s − d·Σq| + 1e-4 · Σ |wᵢ·xᵢ|`, where
/// - `errᵢ` bounds how far activation `i` moves when quantized: 0 for f32 activations;
///   `0.57 · amax/127` for Q8_0/Q8_1 (`amax` of its 32-block: half a step, plus the f16 rounding of the
///   step, at most 127 · 2⁻¹¹ ≈ 0.062 steps); `0.5 · amax/127` for Q8_K (f32 step);
/// - the middle term (Q4_1/Q5_1 only) is the error of Q8_1's stored `s`, an f16 rounding of `d·Σq` that
///   the formats with a minimum `m` multiply by `m` instead of the sum of the quantized activations;
/// - the last term covers f32 rounding of scale products and of the summation (at most a few hundred
///   roundings of 2⁻²⁴ each, far below 1e-4).
fn error_bound(ty: GgmlType, w: &[f32], x: &[f32], act: &[u8], row: &[u8]) -> f64 {
    let kind = ty.ops().unwrap().act;
    let (block, c) = match kind {
        ActType::F32 => (1, 0.0),
        ActType::Q8_0 | ActType::Q8_1 => (32, 0.57),
        ActType::Q8_K => (256, 0.5),
    };
    let mut bound = 0f64;
    for (wb, xb) in w.chunks(block).zip(x.chunks(block)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        let err = c * amax / 127.0;
        bound += wb.iter().map(|&v| v.abs() as f64 * err).sum::<f64>();
    }
    if kind == ActType::Q8_1 {
        for (yb, xb) in act.chunks_exact(36).zip(row.chunks_exact(ty.block_bytes())) {
            let qsum: f64 = yb[4..].iter().map(|&q| q as i8 as f64).sum();
            let d = f16_at(&yb[0..2]);
            bound += f16_at(&xb[2..4]).abs() * (f16_at(&yb[2..4]) - d * qsum).abs();
        }
    }
    bound
        + 1e-4
            * w.iter()
                .zip(x)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum::<f64>()
}

/// The activations as the dot product sees them (quantized, then dequantized exactly in f64), and for
/// Q8_1 each block's stored `s` (used instead of `d·Σq` by the formats with a minimum).
fn dequantize_act(ty: GgmlType, act: &[u8], n: usize) -> (Vec<f64>, Vec<f64>) {
    match ty.ops().unwrap().act {
        ActType::F32 => (
            act.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
                .collect(),
            vec![],
        ),
        ActType::Q8_0 => {
            let x = act
                .chunks_exact(34)
                .flat_map(|b| b[2..].iter().map(move |&q| f16_at(b) * q as i8 as f64))
                .collect();
            (x, vec![])
        }
        ActType::Q8_1 => {
            let x = act
                .chunks_exact(36)
                .flat_map(|b| b[4..].iter().map(move |&q| f16_at(b) * q as i8 as f64))
                .collect();
            (x, act.chunks_exact(36).map(|b| f16_at(&b[2..4])).collect())
        }
        ActType::Q8_K => {
            let x: Vec<f64> = act
                .chunks_exact(292)
                .flat_map(|b| {
                    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64;
                    b[4..260].iter().map(move |&q| d * q as i8 as f64)
                })
                .collect();
            assert_eq!(x.len(), n);
            (x, vec![])
        }
    }
}

/// The exact dot product with the quantized activations, and the sum of the magnitudes of its terms.
///
/// With the activations' own rounding taken out, only f32 rounding separates `vec_dot` from this: scale
/// products, at most 256 sequential additions per lane (n = 4096 gives 128 for floats, 16 for legacy
/// lanes, 16 super-blocks for K-quants) and the final combination, each rounding by at most 2⁻²⁴ of a
/// partial sum bounded by the sum of magnitudes. So `|dot − exact| ≤ 2e-5 · Σ|wᵢ·x̂ᵢ|`.
fn dot_with_quantized_act(ty: GgmlType, w: &[f32], act: &[u8], row: &[u8]) -> (f64, f64) {
    let (xq, s) = dequantize_act(ty, act, w.len());
    let mut exact: f64 = w.iter().zip(&xq).map(|(&a, &b)| a as f64 * b).sum();
    let mut magnitude: f64 = w.iter().zip(&xq).map(|(&a, &b)| (a as f64 * b).abs()).sum();
    if !s.is_empty() {
        // Formats with a minimum: Σ m·x̂ over a block uses the stored s instead of d·Σq.
        for (b, (xb, &sb)) in row.chunks_exact(ty.block_bytes()).zip(&s).enumerate() {
            let m = f16_at(&xb[2..4]);
            let dsum: f64 = xq[32 * b..32 * b + 32].iter().sum();
            exact += m * (sb - dsum);
            magnitude += (m * sb).abs();
        }
    }
    (exact, magnitude)
}

/// Checks one row: SIMD equals portable bit for bit, and both are within [`error_bound`] of the exact dot.
fn check_row(ty: GgmlType, row: &[u8], x: &[f32], what: &str) {
    let n = x.len();
    let ops = ty.ops().unwrap();
    let act = quantize_act(ty, x);
    let fast = vec_dot(ty, n, row, &act).unwrap();
    let portable = (ops.vec_dot_portable)(n, row, &act);
    assert_eq!(
        fast.to_bits(),
        portable.to_bits(),
        "{ty} n={n} {what}: vec_dot {fast} != portable {portable}"
    );
    let mut w = vec![0f32; n];
    dequantize(ty, row, &mut w).unwrap();
    let exact: f64 = w.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum();
    let bound = error_bound(ty, &w, x, &act, row);
    let err = (fast as f64 - exact).abs();
    assert!(
        err <= bound,
        "{ty} n={n} {what}: dot {fast} exact {exact} error {err} above bound {bound}"
    );
    let (exact_q, magnitude) = dot_with_quantized_act(ty, &w, &act, row);
    let err_q = (fast as f64 - exact_q).abs();
    assert!(
        err_q <= 2e-5 * magnitude,
        "{ty} n={n} {what}: dot {fast} vs exact with quantized activations {exact_q}: error {err_q}, magnitude {magnitude}"
    );
}

#[test]
fn simd_equals_portable_and_both_are_near_the_exact_dot() {
    let mut rng = Rng::new(0xA11CE);
    for &ty in FAMILY_A {
        for n in lengths(ty) {
            for trial in 0..3 {
                let x = activations(&mut rng, n);
                let mut row = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
                fill_random(ty, &mut rng, 0.05, &mut row).unwrap();
                check_row(ty, &row, &x, &format!("fill_random #{trial}"));
                let row = random_field_weights(ty, &mut rng, n);
                check_row(ty, &row, &x, &format!("random fields #{trial}"));
            }
        }
    }
}

/// Largest quants against largest activations (all of one sign, then alternating): where `maddubs`
/// pair sums are largest, so any saturation in the SIMD code would show.
#[test]
fn extreme_blocks_do_not_saturate() {
    let mut rng = Rng::new(7);
    for &ty in FAMILY_A {
        if ty.block_elems() == 1 {
            continue;
        }
        let n = 512;
        for fill in [0xFFu8, 0x00, 0x80, 0x7F, 0x55, 0xAA] {
            let mut row = vec![fill; ty.bytes_for(n as u64).unwrap() as usize];
            for b in row.chunks_exact_mut(ty.block_bytes()) {
                for &o in f16_fields(ty) {
                    b[o..o + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
                }
            }
            for pattern in 0..3 {
                let x: Vec<f32> = (0..n)
                    .map(|i| match pattern {
                        0 => 1.0,
                        1 => -1.0,
                        _ => {
                            if (i + rng.below(2) as usize).is_multiple_of(2) {
                                1.0
                            } else {
                                -1.0
                            }
                        }
                    })
                    .collect();
                check_row(ty, &row, &x, &format!("fill {fill:#x} pattern {pattern}"));
            }
        }
    }
}

#[test]
fn vec_dot_rejects_mismatched_lengths() {
    let ty = GgmlType::Q4_K;
    let row = vec![0u8; 144];
    let act = vec![0u8; 292];
    assert!(vec_dot(ty, 256, &row, &act).is_ok());
    assert!(vec_dot(ty, 512, &row, &act).is_err());
    assert!(vec_dot(ty, 256, &row[..143], &act).is_err());
    assert!(vec_dot(ty, 256, &row, &act[..291]).is_err());
}

/// Moments of the dequantized values of `n` random values of `ty` at root-mean-square `rms`.
fn moments(ty: GgmlType, rms: f32, n: usize, seed: u64) -> (Vec<f32>, f64, f64, f64, f64) {
    let mut rng = Rng::new(seed);
    let mut buf = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
    fill_random(ty, &mut rng, rms, &mut buf).unwrap();
    let mut v = vec![0f32; n];
    dequantize(ty, &buf, &mut v).unwrap();
    let nf = n as f64;
    let mean = v.iter().map(|&a| a as f64).sum::<f64>() / nf;
    let ms = v.iter().map(|&a| (a as f64).powi(2)).sum::<f64>() / nf;
    let third = v.iter().map(|&a| (a as f64 - mean).powi(3)).sum::<f64>() / nf;
    let positive = v.iter().filter(|&&a| a > 0.0).count() as f64 / nf;
    (v, mean, ms.sqrt(), third, positive)
}

#[test]
fn fill_random_has_zero_mean_the_asked_rms_and_symmetric_values() {
    for &ty in FAMILY_A {
        for rms in [0.02f32, 1.0] {
            let n = 256 * 512;
            let (v, mean, got, third, positive) = moments(ty, rms, n, 99);
            assert!(v.iter().all(|a| a.is_finite()), "{ty}: non-finite value");
            let rms = rms as f64;
            assert!(mean.abs() < 0.02 * rms, "{ty} rms {rms}: mean {mean}");
            assert!(
                (got / rms - 1.0).abs() < 0.2,
                "{ty}: rms {got}, asked {rms}"
            );
            let skew = third / got.powi(3);
            assert!(skew.abs() < 0.1, "{ty} rms {rms}: skewness {skew}");
            // Values of zero exist (quant grids contain 0); the rest split evenly between the signs.
            let zero = v.iter().filter(|&&a| a == 0.0).count() as f64 / n as f64;
            let negative = 1.0 - positive - zero;
            assert!(
                (positive - negative).abs() < 0.03,
                "{ty} rms {rms}: {positive} > 0, {negative} < 0"
            );
        }
    }
}

#[test]
fn fill_random_is_reproducible_and_covers_every_block() {
    for &ty in FAMILY_A {
        let n = 4096;
        let bytes = ty.bytes_for(n).unwrap() as usize;
        let mut a = vec![0u8; bytes];
        // Starts with other bytes, so equality shows every byte was written.
        let mut b = vec![0xEEu8; bytes];
        fill_random(ty, &mut Rng::new(5), 0.1, &mut a).unwrap();
        fill_random(ty, &mut Rng::new(5), 0.1, &mut b).unwrap();
        assert_eq!(a, b, "{ty}: same seed gave different blocks");
        let mut c = vec![0u8; bytes];
        fill_random(ty, &mut Rng::new(6), 0.1, &mut c).unwrap();
        assert_ne!(a, c, "{ty}: different seeds gave the same blocks");
    }
}

#[test]
fn fill_random_with_tiny_rms_keeps_scales_normal() {
    // An rms far below what normal f16 block scales reach: values come out larger than asked, but
    // never denormal-scaled, never zero, never non-finite.
    for &ty in FAMILY_A {
        if ty.block_elems() == 1 {
            continue;
        }
        let (v, _, got, _, _) = moments(ty, 1e-7, 256 * 16, 3);
        assert!(v.iter().all(|a| a.is_finite()), "{ty}");
        assert!(got > 1e-7, "{ty}: rms {got}");
        let smallest_nonzero = v
            .iter()
            .filter(|&&a| a != 0.0)
            .fold(f32::MAX, |m, &a| m.min(a.abs()));
        assert!(
            smallest_nonzero >= 1.0 / 16384.0 / 4.0,
            "{ty}: value {smallest_nonzero} from a denormal scale"
        );
    }
}
