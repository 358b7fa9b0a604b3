//! Matrix products whose per-row dot-product order the caller chooses, for products llama.cpp computes in
//! another order than [`crate::matmul::matmul`] picks from the weight format alone: expert matrices
//! (`MUL_MAT_ID`, which takes the single-row order for every row of repacked weights) and matrices llama.cpp
//! does not repack (too few rows).
//!
//! Same layout and threading as [`crate::matmul`]: activations quantized once per call, tasks own ranges of
//! weight rows.

use crate::matmul::QuantMatrix;
use crate::quant::BatchDot;

/// `Y = X·Wᵀ` for `n` activation vectors (`x` is `n × cols`, `y` gets `n × rows`), each dot product in
/// `batch`'s order where [`BatchDot::applies`] to its row of the batch, in the format's single-row order
/// ([`crate::quant::QuantOps::vec_dot`]) otherwise (always, when `batch` is `None`).
pub fn matmul_in_order(
    w: &QuantMatrix<'_>,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    batch: Option<&'static BatchDot>,
) {
    // `matmul_ordered` computes exactly these orders, four activation rows per weight row where a
    // four-row kernel of the order exists (bit-equal to the order's single dot products).
    crate::matmul::matmul_ordered(w, x, n, y, batch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::matmul;
    use crate::quant::{batch_dot, fill_random, GgmlType};
    use crate::rng::Rng;

    #[test]
    fn batch_order_matches_matmul_and_single_row_order_matches_matvec() {
        let (ty, rows, cols, n) = (GgmlType::Q4_K, 24, 512, 9);
        let mut rng = Rng::new(5);
        let mut data = vec![0u8; rows * ty.bytes_for(cols as u64).unwrap() as usize];
        fill_random(ty, &mut rng, 1.0, &mut data).unwrap();
        let w = QuantMatrix::new(ty, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
        let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
        matmul(&w, &x, n, &mut a);
        matmul_in_order(&w, &x, n, &mut b, batch_dot(ty));
        assert_eq!(a, b);
        matmul_in_order(&w, &x, n, &mut b, None);
        for j in 0..n {
            let mut one = vec![0f32; rows];
            crate::matmul::matvec(&w, &x[j * cols..(j + 1) * cols], &mut one);
            assert_eq!(&b[j * rows..(j + 1) * rows], &one[..], "row {j}");
        }
        // The gemm order of Q4_K differs from its gemv order on some element.
        assert_ne!(a, b);
    }
}
