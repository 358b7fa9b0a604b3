//! The batch summation orders of llama.cpp's CPU matrix products (`quant::batch_dot`): Q4_K's repacked
//! gemm for groups of four rows, the tiled K-quant matmul for batches of eight rows or more.
//!
//! - Each order's run-time chosen code equals its portable code bit for bit.
//! - Each is as accurate as the single-row order (the same exact integer sums, another float order) and
//!   really differs from it somewhere (else the matrix product's choice would not matter).
//! - `matmul` picks the order llama.cpp uses for every row of a batch.

use poly_kernels::matmul::{matmul, QuantMatrix};
use poly_kernels::quant::{batch_dot, dequantize, fill_random, vec_dot, GgmlType};
use poly_kernels::rng::Rng;

const K_QUANTS: &[GgmlType] = &[
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

fn row(ty: GgmlType, rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut w = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
    fill_random(ty, rng, 0.05, &mut w).unwrap();
    w
}

fn activations(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal()).collect()
}

fn quantize(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let act = ty.ops().unwrap().act;
    let mut q = vec![0u8; act.bytes_for(x.len())];
    act.quantize(x, &mut q);
    q
}

#[test]
fn batch_orders_equal_their_portable_code_and_the_single_row_sum() {
    let mut rng = Rng::new(0x0DE5);
    let n = 2048;
    for &ty in K_QUANTS {
        let b = batch_dot(ty).expect("K-quants have a batch order");
        let mut differs = 0;
        for _ in 0..40 {
            let (w, x) = (row(ty, &mut rng, n), activations(&mut rng, n));
            let act = quantize(ty, &x);
            let fast = (b.dot)(n, &w, &act);
            let portable = (b.portable)(n, &w, &act);
            assert_eq!(
                fast.to_bits(),
                portable.to_bits(),
                "{ty}: {fast} != {portable}"
            );
            let single = vec_dot(ty, n, &w, &act).unwrap();
            let mut wf = vec![0f32; n];
            dequantize(ty, &w, &mut wf).unwrap();
            let magnitude: f64 = wf.iter().zip(&x).map(|(a, b)| (a * b).abs() as f64).sum();
            assert!(
                ((fast - single) as f64).abs() <= 1e-5 * magnitude,
                "{ty}: batch order {fast} and single-row order {single} disagree"
            );
            differs += usize::from(fast.to_bits() != single.to_bits());
        }
        assert!(differs > 0, "{ty}: the two orders never differed");
    }
    assert!(batch_dot(GgmlType::Q8_0).is_none());
}

#[test]
fn matmul_takes_llama_cpps_order_for_each_row_of_a_batch() {
    let mut rng = Rng::new(0xBA7C);
    let (rows, cols) = (16, 512);
    for (ty, n, batch_rows) in [
        // Q4_K: groups of four take the gemm order, the remainder the gemv (single-row) order.
        (GgmlType::Q4_K, 6, 0..4),
        (GgmlType::Q4_K, 3, 0..0),
        // Tiled K-quants: all rows of a batch of 8 or more, none below.
        (GgmlType::Q6_K, 8, 0..8),
        (GgmlType::Q6_K, 7, 0..0),
        (GgmlType::Q5_K, 9, 0..9),
        // Batches of 8 or more take the tile kernel on AVX-512 VNNI machines (Q4_K: both its orders).
        (GgmlType::Q4_K, 10, 0..8),
        (GgmlType::Q2_K, 12, 0..12),
        (GgmlType::Q3_K, 8, 0..8),
    ] {
        let data: Vec<u8> = (0..rows).flat_map(|_| row(ty, &mut rng, cols)).collect();
        let w = QuantMatrix::new(ty, rows, cols, &data).unwrap();
        let x = activations(&mut rng, n * cols);
        let mut y = vec![0f32; n * rows];
        matmul(&w, &x, n, &mut y);
        let b = batch_dot(ty).unwrap();
        for j in 0..n {
            let act = quantize(ty, &x[j * cols..(j + 1) * cols]);
            for r in 0..rows {
                let want = if batch_rows.contains(&j) {
                    (b.dot)(cols, w.row(r), &act)
                } else {
                    vec_dot(ty, cols, w.row(r), &act).unwrap()
                };
                assert_eq!(
                    y[j * rows + r].to_bits(),
                    want.to_bits(),
                    "{ty} n={n} token {j} row {r}"
                );
            }
        }
    }
}
