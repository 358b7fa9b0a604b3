//! Router weights of synthetic MoE blocks, their calibration on a forward pass's hidden states, and the
//! estimate of how tokens spread over experts.
//!
//! Row `e` of a router (`ffn_gate_inp`, `[n_embd, n_expert]`) scores expert `e`: `logit_e = w_e · x`. With
//! no skew every row is Gaussian of RMS `λ/sqrt(n_embd)`, so on any hidden state of unit RMS the logits are
//! i.i.d. N(0, λ²) and every expert is equally likely. The blocks have no router bias, so a skew `S`
//! shapes popularity through the rows themselves, by a per-block random ranking of the experts (rank `r`,
//! `x = (r + 0.5) / n_expert`):
//! - row scale `s(x) ∝ (x + 0.03)^(-0.15 S)`: a larger logit spread wins the top-k more often;
//! - a shared bias direction `u` (a random unit vector per block) with weight `b(x) = S · ln(1.05 / (x +
//!   0.05))`: the logits get `λ · b(x) · (u · x̂)`, so whenever a token's hidden state leans along `u` the
//!   popular experts gain together; when it leans away the tail takes over, which keeps every expert in use.
//!
//! With `S = 1` the top 10% of 128 or 256 experts take about 25–32% of the routings, as in real models
//! (measured by simulation). [`simulate`] measures the spread on random unit-RMS hidden states, which is
//! an estimate: the real forward pass feeds states that are not isotropic. A forward pass's states share
//! a common part (the mean over all sequences, and one of each sequence that grows with depth through
//! attention's averaging), so the drawn routers alone do not route as the skew says in a forward pass
//! (the qwen3moe 30B-A3B shape written with skew 0 sent 52% of its routings to each layer's top tenth).
//! `poly-engine synth --route-skew S` therefore writes the model with quieter token mixing
//! ([`super::Synthesis::with_mixing_gain`]) and then re-aims each router at the states the model feeds it
//! ([`calibrate`], from [`RouterParts`]), and reports the routing it measures in a forward pass.

use poly_kernels::matmul::{matmul, QuantMatrix};
use poly_kernels::quant::{dequantize, QuantError};
use poly_kernels::rng::Rng;
use rayon::prelude::*;

/// Spread of the router logits on a unit-RMS hidden state (λ).
pub const LOGIT_SCALE: f32 = 1.5;

/// A router's shape and skew.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterSpec {
    pub n_embd: usize,
    pub n_expert: usize,
    pub n_used: usize,
    /// `--route-skew` (0 = uniform).
    pub skew: f32,
}

/// A router before it is put together: the draws of [`router_weights`], kept apart so that
/// [`calibrate`] can re-aim them at the hidden states a forward pass actually feeds the router.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterParts {
    pub n_embd: usize,
    pub n_expert: usize,
    /// `n_expert` rows of `n_embd` standard normal values (row `e` for expert `e`).
    pub noise: Vec<f32>,
    /// Each expert's logit spread before normalization (`(x + 0.03)^(-0.15 S)`), and their RMS.
    pub raw_scale: Vec<f32>,
    pub scale_rms: f32,
    /// The skew `S` and each expert's `ln(1.05 / (x + 0.05))`: its weight on the shared bias direction is
    /// `S` times that, in units of [`LOGIT_SCALE`].
    pub skew: f32,
    pub bias_log: Vec<f32>,
    /// The block's shared bias direction (unit vector).
    pub direction: Vec<f32>,
}

impl RouterParts {
    /// The rows for random unit-RMS hidden states: `λ · scale_e / sqrt(n_embd) · noise_e + λ · bias_e · u`.
    pub fn weights(&self) -> Vec<f32> {
        let n = self.n_embd;
        let mut w = self.noise.clone();
        for (e, row) in w.chunks_exact_mut(n).enumerate() {
            // The same operations in the same order as ever: the files' bytes do not change.
            let row_rms = LOGIT_SCALE * self.raw_scale[e] / self.scale_rms / (n as f32).sqrt();
            let bias = LOGIT_SCALE * self.skew * self.bias_log[e];
            row.iter_mut()
                .zip(&self.direction)
                .for_each(|(v, &ui)| *v = *v * row_rms + bias * ui);
        }
        w
    }
}

/// The parts of a router of `spec`, drawn from `rng` (the draws [`router_weights`] makes, in its order).
pub fn router_parts(spec: &RouterSpec, rng: &mut Rng) -> RouterParts {
    let (n, m) = (spec.n_embd, spec.n_expert);
    // Popularity rank of each expert: a random permutation, so each block favours different experts.
    let mut rank_of: Vec<usize> = (0..m).collect();
    for i in (1..m).rev() {
        let j = rng.below(i as u32 + 1) as usize;
        rank_of.swap(i, j);
    }
    let x = |e: usize| (rank_of[e] as f32 + 0.5) / m as f32;
    let s = spec.skew.max(0.0);
    let raw_scale: Vec<f32> = (0..m).map(|e| (x(e) + 0.03).powf(-0.15 * s)).collect();
    let ms = (raw_scale.iter().map(|v| v * v).sum::<f32>() / m as f32).sqrt();
    let mut u = vec![0f32; n];
    fill_normal(rng, &mut u);
    let norm = u
        .iter()
        .map(|v| v * v)
        .sum::<f32>()
        .sqrt()
        .max(f32::MIN_POSITIVE);
    u.iter_mut().for_each(|v| *v /= norm);
    let mut noise = vec![0f32; n * m];
    for row in noise.chunks_exact_mut(n) {
        fill_normal(rng, row);
    }
    RouterParts {
        n_embd: n,
        n_expert: m,
        noise,
        raw_scale,
        scale_rms: ms,
        skew: s,
        bias_log: (0..m).map(|e| (1.05 / (x(e) + 0.05)).ln()).collect(),
        direction: u,
    }
}

/// Router rows (`n_expert` rows of `n_embd` values, row `e` for expert `e`), drawn from `rng`.
pub fn router_weights(spec: &RouterSpec, rng: &mut Rng) -> Vec<f32> {
    router_parts(spec, rng).weights()
}

/// The router `parts` re-aimed at `states` (`n_states` rows of `n_embd`: what a forward pass feeds this
/// router), so that its logits have, on the model's own states, the spread and skew [`router_weights`]
/// gives on random isotropic ones.
///
/// The states share a mean (the norm's weights, attention's averaging), and `w_e · mean` is a
/// per-expert offset every token shares, so the experts whose rows happen to lean along it win most
/// tokens. So:
/// - the states' mean direction is projected out of every row and of the bias direction: the logits
///   depend on the token-specific part of the state (the calibration states' mean logit is 0 for every
///   expert);
/// - one factor common to all rows sets their logits' mean variance over the states to `λ²` times the
///   skew's `scale_e²` (the rows keep the relative spreads they were drawn with: a factor per row,
///   measured on a few hundred states, would add its own noise to the routing), and the bias direction
///   is scaled to unit deviation, so the logits are `λ · scale_e · z_e + λ · bias_e · ζ` with `z_e`, `ζ`
///   of unit variance on average, as on isotropic states.
///
/// Sums are in f64 and in a fixed order, so the result depends only on the states' values.
pub fn calibrate(parts: &RouterParts, states: &[f32], n_states: usize) -> Vec<f32> {
    let n = parts.n_embd;
    assert_eq!(
        states.len(),
        n_states * n,
        "calibrate: states are not n_states × n_embd"
    );
    let count = n_states.max(1) as f64;
    let mut mean = vec![0f64; n];
    for x in states.chunks_exact(n) {
        mean.iter_mut().zip(x).for_each(|(a, &v)| *a += v as f64);
    }
    mean.iter_mut().for_each(|a| *a /= count);
    let mean_norm = mean.iter().map(|v| v * v).sum::<f64>().sqrt();
    let mean_dir: Vec<f64> = mean
        .iter()
        .map(|v| if mean_norm > 0.0 { v / mean_norm } else { 0.0 })
        .collect();
    // The token-specific parts of the states, to measure deviations on.
    let centered: Vec<f64> = states
        .chunks_exact(n)
        .flat_map(|x| x.iter().zip(&mean).map(|(&v, &mu)| v as f64 - mu))
        .collect();
    // `v` without its component along the mean, and the variance of `v · (x − mean)` over the states.
    let project = |v: &[f32]| -> (Vec<f64>, f64) {
        let along: f64 = v.iter().zip(&mean_dir).map(|(&a, &b)| a as f64 * b).sum();
        let p: Vec<f64> = v
            .iter()
            .zip(&mean_dir)
            .map(|(&a, &b)| a as f64 - along * b)
            .collect();
        let var = centered
            .chunks_exact(n)
            .map(|d| d.iter().zip(&p).map(|(a, b)| a * b).sum::<f64>().powi(2))
            .sum::<f64>()
            / count;
        (p, var)
    };
    let lambda = LOGIT_SCALE as f64;
    let (direction, dir_var) = project(&parts.direction);
    let dir_k = if dir_var > 0.0 {
        1.0 / dir_var.sqrt()
    } else {
        1.0
    };
    let rows: Vec<(Vec<f64>, f64)> = parts.noise.par_chunks_exact(n).map(project).collect();
    let mean_var = rows.iter().map(|(_, v)| v).sum::<f64>() / rows.len().max(1) as f64;
    // Unit-variance noise rows on average (left as drawn if the states do not vary, e.g. one state).
    let row_k = if mean_var > 0.0 {
        1.0 / mean_var.sqrt()
    } else {
        1.0 / (n as f64).sqrt()
    };
    rows.into_iter()
        .enumerate()
        .flat_map(|(e, (row, _))| {
            let scale = lambda * row_k * parts.raw_scale[e] as f64 / parts.scale_rms as f64;
            let bias = lambda * dir_k * parts.skew as f64 * parts.bias_log[e] as f64;
            row.into_iter()
                .zip(&direction)
                .map(move |(v, &u)| (v * scale + bias * u) as f32)
                .collect::<Vec<f32>>()
        })
        .collect()
}

/// Fills `dst` with standard normal values (Box-Muller in f32, both values of each pair used: cheaper
/// than one f64 draw per value, and the simulation draws millions).
pub fn fill_normal(rng: &mut Rng, dst: &mut [f32]) {
    for pair in dst.chunks_mut(2) {
        let u1 =
            (rng.next_u32() >> 8) as f32 * (1.0 / (1u32 << 24) as f32) + 0.5 / (1u32 << 24) as f32;
        let u2 = (rng.next_u32() >> 8) as f32 * (1.0 / (1u32 << 24) as f32);
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
        pair[0] = r * c;
        if let Some(second) = pair.get_mut(1) {
            *second = r * s;
        }
    }
}

/// How routings spread over one block's experts.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteStats {
    /// Routings each expert received.
    pub counts: Vec<u64>,
    /// Share of all routings that went to the most-chosen 10% of experts (at least one expert).
    pub top10_share: f64,
    /// Whether every expert was chosen at least once.
    pub all_reached: bool,
}

impl RouteStats {
    /// Statistics of `counts`.
    pub fn from_counts(counts: Vec<u64>) -> RouteStats {
        let mut sorted = counts.clone();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let top = sorted.len().div_ceil(10).max(1);
        let total: u64 = sorted.iter().sum();
        let top_sum: u64 = sorted.iter().take(top).sum();
        RouteStats {
            all_reached: counts.iter().all(|&c| c > 0),
            top10_share: if total > 0 {
                top_sum as f64 / total as f64
            } else {
                0.0
            },
            counts,
        }
    }
}

/// Hidden states to simulate for a router: enough that a uniform router gives each expert about 64
/// routings (an expert a quarter as popular as the average is then missed with probability e^-16).
pub fn default_samples(n_expert: usize, n_used: usize) -> usize {
    (64 * n_expert / n_used.max(1)).max(256)
}

/// Routes `n_samples` random unit-RMS hidden states through the router `w` (`n_expert` rows of `n_embd`,
/// in the type the file stores) with softmax top-`n_used` — the top-k of the logits, since softmax keeps
/// their order — and counts the choices.
///
/// The hidden states are standard Gaussian (isotropic, unit RMS), so the logits `W·h` are Gaussian with
/// covariance `W·Wᵀ`; they are drawn as `L·z` with `L` the Cholesky factor of that Gram matrix, which
/// costs `n_expert²` per state instead of `n_expert · n_embd` and gives exactly the same distribution.
/// (When the Gram matrix is singular — more experts than dimensions — the states are drawn directly.)
pub fn simulate(
    w: &QuantMatrix<'_>,
    n_used: usize,
    n_samples: usize,
    seed: u64,
) -> Result<RouteStats, QuantError> {
    let (m, n) = (w.rows, w.cols);
    let k = n_used.clamp(1, m.max(1));
    let mut wf = vec![0f32; m * n];
    dequantize(w.ty, w.data, &mut wf)?;
    let mut gram = vec![0f32; m * m];
    matmul(w, &wf, m, &mut gram);
    let factor = cholesky(&gram, m);
    // Samples in fixed groups, each group from its own generator: the result does not depend on the number
    // of threads.
    const GROUP: usize = 64;
    let counts = (0..n_samples.div_ceil(GROUP))
        .into_par_iter()
        .fold(
            || vec![0u64; m],
            |mut counts, g| {
                let mut rng = Rng::new(seed ^ (g as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                let mut z = vec![0f32; if factor.is_some() { m } else { n }];
                let mut order: Vec<(f32, usize)> = Vec::with_capacity(m);
                for _ in 0..GROUP.min(n_samples - g * GROUP) {
                    fill_normal(&mut rng, &mut z);
                    order.clear();
                    match &factor {
                        Some(l) => order
                            .extend((0..m).map(|i| (dot(&l[i * m..i * m + i + 1], &z[..=i]), i))),
                        None => order.extend(
                            wf.chunks_exact(n)
                                .enumerate()
                                .map(|(i, row)| (dot(row, &z), i)),
                        ),
                    }
                    order.select_nth_unstable_by(k - 1, |a, b| b.0.total_cmp(&a.0));
                    for &(_, e) in &order[..k] {
                        counts[e] += 1;
                    }
                }
                counts
            },
        )
        .reduce(
            || vec![0u64; m],
            |mut a, b| {
                a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
                a
            },
        );
    Ok(RouteStats::from_counts(counts))
}

/// The lower-triangular Cholesky factor of the symmetric `m × m` matrix `a` (row-major), computed in f64;
/// `None` unless `a` is positive definite.
fn cholesky(a: &[f32], m: usize) -> Option<Vec<f32>> {
    let mut l = vec![0f64; m * m];
    for i in 0..m {
        for j in 0..=i {
            let s: f64 = (0..j).map(|p| l[i * m + p] * l[j * m + p]).sum();
            let v = a[i * m + j] as f64 - s;
            if i == j {
                if v <= 0.0 || !v.is_finite() {
                    return None;
                }
                l[i * m + i] = v.sqrt();
            } else {
                l[i * m + j] = v / l[j * m + j];
            }
        }
    }
    Some(l.into_iter().map(|v| v as f32).collect())
}

/// Dot product in 8 independent lanes (vectorizable).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use poly_kernels::quant::GgmlType;

    fn share(n_expert: usize, n_used: usize, skew: f32) -> RouteStats {
        let spec = RouterSpec {
            n_embd: 128,
            n_expert,
            n_used,
            skew,
        };
        let w = router_weights(&spec, &mut Rng::new(5));
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let m = QuantMatrix::new(GgmlType::F32, n_expert, 128, &bytes).expect("f32 matrix");
        simulate(&m, n_used, 4 * default_samples(n_expert, n_used), 9).expect("f32 router")
    }

    #[test]
    fn uniform_router_reaches_every_expert_evenly() {
        let s = share(128, 8, 0.0);
        assert!(s.all_reached);
        assert!(s.top10_share < 0.16, "{}", s.top10_share);
    }

    #[test]
    fn skew_one_looks_like_a_real_model() {
        let s = share(128, 8, 1.0);
        assert!(s.all_reached);
        assert!((0.2..0.4).contains(&s.top10_share), "{}", s.top10_share);
        let s2 = share(128, 8, 2.0);
        assert!(s2.top10_share > s.top10_share + 0.05);
    }

    #[test]
    fn normals_have_unit_variance() {
        let mut v = vec![0f32; 100_001];
        fill_normal(&mut Rng::new(3), &mut v);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(
            mean.abs() < 0.01 && (var - 1.0).abs() < 0.02,
            "{mean} {var}"
        );
    }

    #[test]
    fn gram_sampling_matches_direct_sampling() {
        // 64 experts in 32 dimensions: the Gram matrix is singular, so states are drawn directly; with 48
        // experts in 64 dimensions the Cholesky path runs. Both must find the same skew.
        for (n_embd, n_expert) in [(32, 64), (64, 48)] {
            let spec = RouterSpec {
                n_embd,
                n_expert,
                n_used: 4,
                skew: 1.5,
            };
            let w = router_weights(&spec, &mut Rng::new(1));
            let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            let m = QuantMatrix::new(GgmlType::F32, n_expert, n_embd, &bytes).expect("f32 matrix");
            let s = simulate(&m, 4, 20_000, 2).expect("f32 router");
            // Direct reference.
            let mut counts = vec![0u64; n_expert];
            let mut rng = Rng::new(77);
            let mut h = vec![0f32; n_embd];
            for _ in 0..20_000 {
                fill_normal(&mut rng, &mut h);
                let mut l: Vec<(f32, usize)> = w
                    .chunks_exact(n_embd)
                    .map(|r| dot(r, &h))
                    .zip(0..)
                    .collect();
                l.sort_by(|a, b| b.0.total_cmp(&a.0));
                l[..4].iter().for_each(|&(_, e)| counts[e] += 1);
            }
            let r = RouteStats::from_counts(counts);
            assert!(
                (s.top10_share - r.top10_share).abs() < 0.03,
                "{} vs {}",
                s.top10_share,
                r.top10_share
            );
        }
    }

    #[test]
    fn stats_of_counts() {
        let s = RouteStats::from_counts(vec![10, 0, 5, 5, 5, 5, 5, 5, 5, 5, 5]);
        assert!(!s.all_reached);
        // 11 experts: the top 10% is 2 experts (10 + 5) of 55 routings.
        assert!((s.top10_share - 15.0 / 55.0).abs() < 1e-9);
    }
}
