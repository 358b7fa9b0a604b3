//! RMS norm and L2 norm over consecutive groups of values (a whole row, or one head of a row).
//!
//! As ggml does, squares are formed in f32 and summed in f64, and the scale is computed in f32.

/// `out = x / sqrt(mean(x²) + eps) ⊙ weight` for every group of `weight.len()` (or `group`) values.
///
/// `x.len()` must be a multiple of `group`; `weight`, when given, has `group` values; `out` is as long as
/// `x`.
pub fn rms_norm(x: &[f32], group: usize, weight: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    assert!(
        group > 0 && x.len().is_multiple_of(group),
        "rms_norm: bad group"
    );
    assert_eq!(x.len(), out.len(), "rms_norm: out has the wrong length");
    if let Some(w) = weight {
        assert_eq!(w.len(), group, "rms_norm: weight has the wrong length");
    }
    for (xs, ys) in x.chunks_exact(group).zip(out.chunks_exact_mut(group)) {
        let sum: f64 = xs.iter().map(|&v| (v * v) as f64).sum();
        let mean = (sum / group as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        match weight {
            Some(w) => {
                for ((y, &v), &wi) in ys.iter_mut().zip(xs).zip(w) {
                    *y = v * scale * wi;
                }
            }
            None => {
                for (y, &v) in ys.iter_mut().zip(xs) {
                    *y = v * scale;
                }
            }
        }
    }
}

/// `out = x / max(‖x‖₂, eps)` for every group of `group` values (ggml's `l2_norm`).
pub fn l2_norm(x: &[f32], group: usize, eps: f32, out: &mut [f32]) {
    assert!(
        group > 0 && x.len().is_multiple_of(group),
        "l2_norm: bad group"
    );
    assert_eq!(x.len(), out.len(), "l2_norm: out has the wrong length");
    for (xs, ys) in x.chunks_exact(group).zip(out.chunks_exact_mut(group)) {
        let sum: f64 = xs.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0 / (sum.sqrt() as f32).max(eps);
        for (y, &v) in ys.iter_mut().zip(xs) {
            *y = v * scale;
        }
    }
}

/// `out = (x − mean) / sqrt(var + eps) ⊙ weight + bias` for every group of `group` values (ggml's `norm`:
/// mean and variance summed in f64, the scale in f32), `weight` and `bias` (`group` values each) when
/// given.
pub fn layer_norm(
    x: &[f32],
    group: usize,
    (weight, bias): (Option<&[f32]>, Option<&[f32]>),
    eps: f32,
    out: &mut [f32],
) {
    assert!(
        group > 0 && x.len().is_multiple_of(group),
        "layer_norm: bad group"
    );
    assert_eq!(x.len(), out.len(), "layer_norm: out has the wrong length");
    for (xs, ys) in x.chunks_exact(group).zip(out.chunks_exact_mut(group)) {
        let sum: f64 = xs.iter().map(|&v| v as f64).sum();
        let mean = (sum / group as f64) as f32;
        let mut sum2 = 0f64;
        for (y, &v) in ys.iter_mut().zip(xs) {
            *y = v - mean;
            sum2 += (*y * *y) as f64;
        }
        let scale = 1.0 / ((sum2 / group as f64) as f32 + eps).sqrt();
        for (i, y) in ys.iter_mut().enumerate() {
            *y *= scale;
            if let Some(w) = weight {
                *y *= w[i];
            }
            if let Some(b) = bias {
                *y += b[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_diff, normals};
    use crate::rng::Rng;

    #[test]
    fn rms_norm_matches_f64_reference_per_group() {
        let mut rng = Rng::new(2);
        let (rows, group, groups) = (3, 16, 4);
        let x: Vec<f32> = normals(&mut rng, rows * group * groups)
            .iter()
            .map(|v| v * 3.0 + 0.5)
            .collect();
        let w = normals(&mut rng, group);
        let eps = 1e-6;
        let mut out = vec![0f32; x.len()];
        rms_norm(&x, group, Some(&w), eps, &mut out);
        let mut plain = vec![0f32; x.len()];
        rms_norm(&x, group, None, eps, &mut plain);
        let mut expect = vec![0f64; x.len()];
        let mut expect_plain = vec![0f64; x.len()];
        for g in 0..x.len() / group {
            let xs = &x[g * group..(g + 1) * group];
            let ms: f64 = xs.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / group as f64;
            let s = 1.0 / (ms + eps as f64).sqrt();
            for i in 0..group {
                expect_plain[g * group + i] = xs[i] as f64 * s;
                expect[g * group + i] = xs[i] as f64 * s * w[i] as f64;
            }
        }
        assert!(max_diff(&out, &expect) < 1e-5);
        assert!(max_diff(&plain, &expect_plain) < 1e-5);
        // Each group has unit root-mean-square without a weight.
        for g in plain.chunks(group) {
            let ms: f32 = g.iter().map(|v| v * v).sum::<f32>() / group as f32;
            assert!((ms - 1.0).abs() < 1e-4);
        }
    }

    #[test]
    fn l2_norm_gives_unit_groups_and_respects_eps() {
        let mut rng = Rng::new(3);
        let x = normals(&mut rng, 64);
        let mut out = vec![0f32; 64];
        l2_norm(&x, 32, 1e-6, &mut out);
        let mut expect = vec![0f64; 64];
        for g in 0..2 {
            let n: f64 = x[g * 32..(g + 1) * 32]
                .iter()
                .map(|&v| (v as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            for i in 0..32 {
                expect[g * 32 + i] = x[g * 32 + i] as f64 / n;
            }
        }
        assert!(max_diff(&out, &expect) < 1e-6);
        // A group smaller than eps is divided by eps, not by its norm.
        let tiny = [1e-4f32, 0.0];
        let mut o = [0f32; 2];
        l2_norm(&tiny, 2, 1e-2, &mut o);
        assert!((o[0] - 1e-2).abs() < 1e-7);
    }

    #[test]
    fn layer_norm_centres_scales_and_shifts_each_group() {
        let x = [1.0f32, 2.0, 3.0, 4.0, -1.0, 1.0, -1.0, 1.0];
        let (w, b) = ([2.0f32, 2.0, 2.0, 2.0], [0.5f32; 4]);
        let mut out = [0f32; 8];
        layer_norm(&x, 4, (Some(&w), Some(&b)), 0.0, &mut out);
        let s = 1.0 / 1.25f32.sqrt();
        let want = [-1.5 * s, -0.5 * s, 0.5 * s, 1.5 * s, -1.0, 1.0, -1.0, 1.0];
        for (i, (&o, &wv)) in out.iter().zip(&want).enumerate() {
            assert!((o - (wv * 2.0 + 0.5)).abs() < 1e-5, "{i}: {o}");
        }
    }
}
