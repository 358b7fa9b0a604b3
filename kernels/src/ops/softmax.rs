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

/// Softmax in place as ggml's CPU backend computes `ggml_soft_max` of one row (AVX2 + FMA build): the
/// maximum, then for whole groups of eight `ggml_v_expf(x − max)` with each group's sum (lanes added as
/// `hsum` does) added to an f64 total, libm `expf` for the rest, then every value times `(f32)(1/total)`.
pub fn softmax_ggml(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::quant::has_avx2_fma() {
        // SAFETY: this CPU has AVX2 and FMA (checked just above), all the function is compiled for.
        return unsafe { softmax_ggml_fma(x) };
    }
    softmax_ggml_rows(x);
}

/// [`softmax_ggml`] compiled for AVX2 and FMA: `ggml_v_expf`'s fused multiply-adds become FMA
/// instructions here (built without FMA, each is a call of the software `fmaf`; the same bits, many
/// times slower: a vision encoder's softmax took a third of its time so).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_ggml_fma(x: &mut [f32]) {
    softmax_ggml_rows(x);
}

/// [`softmax_ggml`]'s arithmetic, inlined into each caller so it takes the caller's target features.
#[inline(always)]
fn softmax_ggml_rows(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let main = x.len() - x.len() % 8;
    let mut sum = 0f64;
    for group in x[..main].chunks_exact_mut(8) {
        let mut lanes = [0f32; 8];
        for (l, v) in lanes.iter_mut().zip(group.iter_mut()) {
            *v = super::attention::ggml_v_expf(*v - max);
            *l = *v;
        }
        sum += crate::quant::float::sum_lanes8(&lanes) as f64;
    }
    for v in &mut x[main..] {
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
    fn softmax_ggml_with_fma_instructions_equals_its_portable_arithmetic() {
        let mut rng = Rng::new(11);
        for n in [1, 7, 8, 9, 64, 1199, 1200] {
            // Scores from small to large spreads (ggml_v_expf's slow path past |x| > 126 included), and
            // masked entries.
            for spread in [0.1f32, 3.0, 60.0, 300.0] {
                let x: Vec<f32> = (0..n)
                    .map(|i| match i % 13 {
                        5 => f32::NEG_INFINITY,
                        _ => rng.normal() * spread,
                    })
                    .collect();
                let (mut dispatched, mut portable) = (x.clone(), x);
                softmax_ggml(&mut dispatched);
                softmax_ggml_rows(&mut portable);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&dispatched), bits(&portable), "n {n}, spread {spread}");
            }
        }
    }

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
    fn ggml_softmax_is_close_to_exact_and_sums_groups_of_eight() {
        let mut rng = Rng::new(9);
        let x: Vec<f32> = normals(&mut rng, 19).iter().map(|v| v * 4.0).collect();
        let mut p = x.clone();
        softmax_ggml(&mut p);
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
        let expect: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp() / z).collect();
        assert!(max_diff(&p, &expect) < 1e-6);
        // Spelled out: two groups of eight through ggml_v_expf, three through expf.
        let e: Vec<f32> = x
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let d = v - m as f32;
                if i < 16 {
                    crate::ops::attention::ggml_v_expf(d)
                } else {
                    d.exp()
                }
            })
            .collect();
        let hsum = |l: &[f32]| ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
        let mut total = hsum(&e[..8]) as f64 + hsum(&e[8..16]) as f64;
        for &v in &e[16..] {
            total += v as f64;
        }
        let inv = (1.0 / total) as f32;
        for i in 0..19 {
            assert_eq!(p[i].to_bits(), (e[i] * inv).to_bits(), "element {i}");
        }
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
