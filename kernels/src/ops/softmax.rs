//! Softmax and log-softmax of a vector (ggml's `soft_max`: subtract the maximum, exponentiate in f32, sum
//! in f64).

/// `x ← e^{x - max} / Σ e^{x - max}` in place. Entries of `-∞` get probability 0; an empty slice or one of
/// only `-∞` is left unchanged.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return;
    }
    let mut sum = 0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `log softmax(x)`: `x - max - ln Σ e^{x - max}`, into `out`.
pub fn log_softmax(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "log_softmax: out has the wrong length");
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        out.copy_from_slice(x);
        return;
    }
    let sum: f64 = x.iter().map(|&v| ((v - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v as f64 - log_z) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_diff, normals};
    use crate::rng::Rng;

    #[test]
    fn softmax_and_log_softmax_match_f64() {
        let mut rng = Rng::new(7);
        let x: Vec<f32> = normals(&mut rng, 1000).iter().map(|v| v * 8.0).collect();
        let m = x
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
        let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
        let expect: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp() / z).collect();
        let expect_log: Vec<f64> = x.iter().map(|&v| v as f64 - m - z.ln()).collect();
        let mut p = x.clone();
        softmax(&mut p);
        assert!(max_diff(&p, &expect) < 1e-6);
        let mut lp = vec![0f32; x.len()];
        log_softmax(&x, &mut lp);
        assert!(max_diff(&lp, &expect_log) < 1e-4);
        let total: f64 = p.iter().map(|&v| v as f64).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    #[test]
    fn masked_entries_get_zero_probability() {
        let mut x = [1.0f32, f32::NEG_INFINITY, 1.0];
        softmax(&mut x);
        assert_eq!(x, [0.5, 0.0, 0.5]);
        let mut all_masked = [f32::NEG_INFINITY; 2];
        softmax(&mut all_masked);
        assert!(all_masked.iter().all(|v| *v == f32::NEG_INFINITY));
    }
}
