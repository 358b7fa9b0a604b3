//! Numeric operations of a forward pass that know no model: norms, rotary embedding, softmax, attention
//! over a key/value sequence, element-wise activations, top-k routing, and the recurrent steps (causal
//! depthwise convolution, gated delta rule).
//!
//! Every function works on plain `f32` slices in row-major layouts stated in its documentation, follows
//! the arithmetic of ggml's CPU backend where that matters for agreement with llama.cpp (accumulation
//! precision, the order RoPE angles are computed in), and is tested against a naive `f64` reference.
//!
//! - [`norm`]: RMS, L2 and layer norms over groups of columns.
//! - [`rope`]: rotary position embedding, normal and NeoX pairing, partial rotation, linear scaling.
//! - [`rope_multi`]: interleaved multi-section rotary embedding (four positions a row: Qwen3-VL's IMRoPE).
//! - [`rope_2d`]: the two-dimensional rotary embedding of vision encoders (a patch's row and column).
//! - [`resample`]: bilinear resampling of a grid of vectors (a position-embedding table to another grid).
//! - [`softmax`]: softmax, log-softmax, sigmoid-style squashing of router logits.
//! - [`attention`]: causal grouped-query attention of a block of queries over a K/V sequence.
//! - [`act`]: SiLU, GELU (tanh approximation), sigmoid, softplus.
//! - [`topk`]: the `k` largest values, and mixture-of-experts routing weights.
//! - [`recurrent`]: the causal conv1d step and the gated delta rule (a decay per head or per key channel).
//! - [`hyper`]: hyper-connection residual streams (mHC) and their Sinkhorn-normalized mixing.
//! - [`indexer`]: the k-pool sparse-attention indexer (pooled keys, the cells each query keeps).

pub mod act;
pub mod attention;
pub mod hyper;
pub mod indexer;
pub mod norm;
pub mod recurrent;
pub mod resample;
pub mod rope;
pub mod rope_2d;
pub mod rope_multi;
pub mod softmax;
pub mod topk;

/// Dot product of two equal-length slices in f32 with eight independent accumulators (vectorizes; the
/// summation order is fixed, so results do not depend on how callers batch their work).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// `y += a·x`.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    use crate::rng::Rng;

    /// `n` standard normal values.
    pub fn normals(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.normal()).collect()
    }

    /// Largest absolute difference.
    pub fn max_diff(a: &[f32], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y).abs())
            .fold(0.0, f64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn dot_matches_f64_for_every_tail_length() {
        let mut rng = Rng::new(1);
        for n in [0, 1, 7, 8, 9, 63, 64, 130] {
            let a = testutil::normals(&mut rng, n);
            let b = testutil::normals(&mut rng, n);
            let exact: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!(
                (dot(&a, &b) as f64 - exact).abs() < 1e-4 * (n as f64 + 1.0),
                "n={n}"
            );
            let mut y = b.clone();
            axpy(0.5, &a, &mut y);
            for i in 0..n {
                assert!((y[i] - (b[i] + 0.5 * a[i])).abs() < 1e-6);
            }
        }
    }
}
