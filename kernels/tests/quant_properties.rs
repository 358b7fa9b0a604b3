//! Properties every weight format must have, checked over [`WEIGHT_TYPES`]:
//!
//! - `fill_random` writes valid blocks: finite values, mean near zero, RMS within 20% of the target.
//! - The run-time chosen dot product (`vec_dot`, SIMD where the CPU has it) agrees with the portable one.
//! - The dot product agrees with f64 arithmetic on the dequantized weights and the exact activations within
//!   the bound that activation quantization allows. Each activation `x_i` is replaced by `d·q_i` with
//!   `|x_i − d·q_i| ≤ e_i`, where `e_i = 0.5·amax/127` for Q8_K (f32 scale) and `0.57·amax/127` for Q8_0/Q8_1
//!   (the f16 scale adds at most 127·2⁻¹¹ of a step), `amax` being the largest |x| of `x_i`'s block; F32
//!   activations are exact. So `|dot − exact| ≤ Σ|w_i|·e_i + 1e-4·Σ|w_i·x_i| + 1e-6`, the last terms for f32
//!   rounding of the sums.
//!
//! Environment: `POLY_QUANT_TYPES=Q4_K,...` tests only those formats (a test selection, for working on one).

use poly_kernels::quant::{dequantize, fill_random, vec_dot, ActType, GgmlType, WEIGHT_TYPES};
use poly_kernels::rng::Rng;

const N: usize = 4096;

/// The types under test: all of [`WEIGHT_TYPES`], or those named in `POLY_QUANT_TYPES` (comma-separated),
/// for working on one format at a time.
fn types_under_test() -> Vec<GgmlType> {
    match std::env::var("POLY_QUANT_TYPES") {
        Ok(names) => names
            .split(',')
            .map(|n| GgmlType::from_name(n.trim()).unwrap_or_else(|| panic!("unknown type {n}")))
            .collect(),
        Err(_) => WEIGHT_TYPES.to_vec(),
    }
}

fn random_row(ty: GgmlType, rng: &mut Rng, rms: f32) -> Vec<u8> {
    let mut row = vec![0u8; ty.bytes_for(N as u64).unwrap() as usize];
    fill_random(ty, rng, rms, &mut row).unwrap();
    row
}

#[test]
fn fill_random_writes_valid_zero_mean_blocks() {
    for ty in types_under_test() {
        let mut rng = Rng::new(1);
        for rms in [0.02f32, 1.0] {
            let row = random_row(ty, &mut rng, rms);
            let mut w = vec![0f32; N];
            dequantize(ty, &row, &mut w).unwrap();
            assert!(w.iter().all(|v| v.is_finite()), "{ty}: non-finite value");
            let mean = w.iter().map(|&v| v as f64).sum::<f64>() / N as f64;
            let got = (w.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / N as f64).sqrt();
            assert!(
                (got / rms as f64 - 1.0).abs() < 0.2,
                "{ty}: rms {got} for target {rms}"
            );
            assert!(
                mean.abs() < 0.1 * rms as f64,
                "{ty}: mean {mean} at rms {rms}"
            );
        }
    }
}

fn activation_error_bound(act: ActType, x: &[f32], i: usize) -> f64 {
    let block = act.block_elems();
    let start = i / block * block;
    let amax = x[start..start + block]
        .iter()
        .fold(0f32, |m, v| m.max(v.abs())) as f64;
    match act {
        ActType::F32 => 0.0,
        ActType::Q8_K => 0.5 * amax / 127.0,
        ActType::Q8_0 | ActType::Q8_1 => 0.57 * amax / 127.0,
    }
}

#[test]
fn dot_products_agree_with_f64_within_the_stated_bound() {
    for ty in types_under_test() {
        let ops = ty.ops().unwrap();
        let mut rng = Rng::new(2);
        for trial in 0..4 {
            let row = random_row(ty, &mut rng, 0.05);
            let mut w = vec![0f32; N];
            dequantize(ty, &row, &mut w).unwrap();
            // Activations with outliers, as real hidden states have.
            let x: Vec<f32> = (0..N)
                .map(|i| rng.normal() * if i % 97 == trial { 20.0 } else { 1.0 })
                .collect();
            let mut act = vec![0u8; ops.act.bytes_for(N)];
            ops.act.quantize(&x, &mut act);

            let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let magnitude: f64 = w
                .iter()
                .zip(&x)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            let bound: f64 = (0..N)
                .map(|i| (w[i] as f64).abs() * activation_error_bound(ops.act, &x, i))
                .sum::<f64>()
                + 1e-4 * magnitude
                + 1e-6;

            let fast = vec_dot(ty, N, &row, &act).unwrap() as f64;
            let portable = (ops.vec_dot_portable)(N, &row, &act) as f64;
            assert!(
                (fast - exact).abs() <= bound,
                "{ty}: dot {fast} vs exact {exact}, bound {bound}"
            );
            assert!(
                (portable - exact).abs() <= bound,
                "{ty}: portable dot {portable} vs exact {exact}, bound {bound}"
            );
            assert!(
                (fast - portable).abs() <= 1e-5 * magnitude + 1e-6,
                "{ty}: SIMD dot {fast} vs portable {portable}"
            );
        }
    }
}
