//! Matrix products whose per-row dot-product order the caller chooses, for products llama.cpp computes in
//! another order than [`crate::matmul::matmul`] picks from the weight format alone: expert matrices
//! (`MUL_MAT_ID`, which takes the single-row order for every row of repacked weights) and matrices llama.cpp
//! does not repack (too few rows).
//!
//! Same layout and threading as [`crate::matmul`]: activations quantized once per call, tasks own ranges of
//! weight rows.

use rayon::prelude::*;

use crate::matmul::QuantMatrix;
use crate::quant::BatchDot;

/// A dot product of one weight row with one quantized activation row.
type DotFn = fn(usize, &[u8], &[u8]) -> f32;

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
    assert_eq!(x.len(), n * w.cols, "matmul: x has the wrong length");
    assert_eq!(y.len(), n * w.rows, "matmul: y has the wrong length");
    if n == 0 || w.rows == 0 {
        return;
    }
    let ops = w.ty.ops().expect("checked in QuantMatrix::new");
    let act_bytes = ops.act.bytes_for(w.cols);
    let mut act = vec![0u8; n * act_bytes];
    act.par_chunks_mut(act_bytes)
        .zip(x.par_chunks(w.cols))
        .for_each(|(a, xs)| ops.act.quantize(xs, a));
    let dots: Vec<DotFn> = (0..n)
        .map(|j| match batch {
            Some(b) if (b.applies)(n, j) => b.dot,
            _ => ops.vec_dot,
        })
        .collect();

    // Tasks own ranges of weight rows and fill a row-major `[rows, n]` block each; transposed at the end.
    let threads = rayon::current_num_threads().max(1);
    let chunk = w.rows.div_ceil(threads * 4).clamp(1, 64);
    let mut by_row = vec![0f32; w.rows * n];
    by_row
        .par_chunks_mut(chunk * n)
        .enumerate()
        .for_each(|(t, out)| {
            let first = t * chunk;
            for (i, o) in out.chunks_exact_mut(n).enumerate() {
                let row = w.row(first + i);
                for (j, v) in o.iter_mut().enumerate() {
                    *v = dots[j](w.cols, row, &act[j * act_bytes..(j + 1) * act_bytes]);
                }
            }
        });
    for (r, vs) in by_row.chunks_exact(n).enumerate() {
        for (j, &v) in vs.iter().enumerate() {
            y[j * w.rows + r] = v;
        }
    }
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
