//! The `k` largest values of a vector, and mixture-of-experts routing (llama.cpp's `build_moe_ffn`:
//! probabilities from the router logits, top-k, optional renormalization and scale).

use super::act::sigmoid;
use super::softmax::softmax_ggml;

/// The indices of the `k` largest values of `x` (at most `x.len()`), largest first; equal values in index
/// order. NaN sorts below every number.
pub fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(x.len());
    let key = |i: usize| {
        if x[i].is_nan() {
            f32::NEG_INFINITY
        } else {
            x[i]
        }
    };
    let cmp = |&a: &usize, &b: &usize| key(b).total_cmp(&key(a)).then(a.cmp(&b));
    let mut idx: Vec<usize> = (0..x.len()).collect();
    if k < idx.len() && k > 0 {
        idx.select_nth_unstable_by(k - 1, cmp);
    }
    idx.truncate(k);
    idx.sort_unstable_by(cmp);
    idx
}

/// How router logits become expert probabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

/// Smallest sum the chosen weights are divided by when renormalized (the smallest normal f16, as
/// llama.cpp clamps it).
const MIN_WEIGHT_SUM: f32 = 6.103_515_6e-5;

/// Routes one token: from the router `logits` (one per expert) chooses the `k` likeliest experts and their
/// weights. `norm` renormalizes the chosen weights to sum to one; `scale` then multiplies them.
/// Returns `(expert, weight)` pairs, likeliest first.
///
/// The arithmetic is ggml's CPU backend's, op for op: `ggml_soft_max` ([`softmax_ggml`]) or
/// `ggml_sigmoid`, the chosen probabilities summed in f64 and rounded (`ggml_sum_rows`), clamped, and
/// each divided by the sum (`ggml_div`), then multiplied by `scale` (`ggml_scale`).
pub fn route(logits: &[f32], gating: Gating, k: usize, norm: bool, scale: f32) -> Vec<(u32, f32)> {
    route_biased(logits, gating, None, k, norm, scale)
}

/// [`route`] with a selection bias (one per expert, DeepSeek V3's and LFM2's `exp_probs_b`): the experts
/// are chosen by probability plus bias (`ggml_add`), their weights are still the unbiased probabilities.
pub fn route_biased(
    logits: &[f32],
    gating: Gating,
    bias: Option<&[f32]>,
    k: usize,
    norm: bool,
    scale: f32,
) -> Vec<(u32, f32)> {
    let mut probs = logits.to_vec();
    match gating {
        Gating::Softmax => softmax_ggml(&mut probs),
        Gating::Sigmoid => probs.iter_mut().for_each(|v| *v = sigmoid(*v)),
    }
    let chosen = match bias {
        Some(b) => {
            assert_eq!(b.len(), probs.len(), "route: one selection bias per expert");
            let biased: Vec<f32> = probs.iter().zip(b).map(|(p, b)| p + b).collect();
            top_k(&biased, k)
        }
        None => top_k(&probs, k),
    };
    let mut out: Vec<(u32, f32)> = chosen.iter().map(|&e| (e as u32, probs[e])).collect();
    if norm {
        let sum = out.iter().map(|p| p.1 as f64).sum::<f64>() as f32;
        let sum = sum.max(MIN_WEIGHT_SUM);
        out.iter_mut().for_each(|p| p.1 /= sum);
    }
    if scale != 1.0 {
        out.iter_mut().for_each(|p| p.1 *= scale);
    }
    out
}

/// Which of [`route_biased`]'s choices the bias made: bit `j` set when its `j`-th chosen expert is not
/// among the `k` that [`route`] chooses from the same `logits` (the card's `changed` output, for its
/// tests and the engine's figures). At most 32 choices.
pub fn changed_by_bias(logits: &[f32], gating: Gating, bias: &[f32], k: usize) -> u32 {
    let biased = route_biased(logits, gating, Some(bias), k, false, 1.0);
    let plain = route(logits, gating, k, false, 1.0);
    biased
        .iter()
        .take(32)
        .enumerate()
        .filter(|(_, (e, _))| !plain.iter().any(|(p, _)| p == e))
        .fold(0, |mask, (j, _)| mask | 1 << j)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::normals;
    use crate::rng::Rng;

    #[test]
    fn top_k_is_a_sorted_prefix_of_a_full_sort() {
        let mut rng = Rng::new(8);
        for n in [1, 5, 64, 300] {
            let x = normals(&mut rng, n);
            let mut full: Vec<usize> = (0..n).collect();
            full.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap());
            for k in [0, 1, 3, n] {
                assert_eq!(top_k(&x, k), full[..k.min(n)].to_vec(), "n={n} k={k}");
            }
        }
        assert_eq!(top_k(&[1.0, 2.0, 2.0, f32::NAN], 3), vec![1, 2, 0]);
    }

    #[test]
    fn routing_weights_follow_the_gating_and_normalization() {
        let logits = [0.1f32, 2.0, -1.0, 1.5];
        let z: f64 = logits.iter().map(|&v| (v as f64).exp()).sum();
        let p = |i: usize| (logits[i] as f64).exp() / z;
        let r = route(&logits, Gating::Softmax, 2, false, 1.0);
        assert_eq!((r[0].0, r[1].0), (1, 3));
        assert!((r[0].1 as f64 - p(1)).abs() < 1e-6 && (r[1].1 as f64 - p(3)).abs() < 1e-6);
        let r = route(&logits, Gating::Softmax, 2, true, 2.0);
        let s = p(1) + p(3);
        assert!((r[0].1 as f64 - 2.0 * p(1) / s).abs() < 1e-6);
        assert!((r[1].1 as f64 - 2.0 * p(3) / s).abs() < 1e-6);
        let r = route(&logits, Gating::Sigmoid, 1, false, 1.0);
        assert_eq!(r[0].0, 1);
        assert!((r[0].1 as f64 - 1.0 / (1.0 + (-2.0f64).exp())).abs() < 1e-6);
    }

    #[test]
    fn a_selection_bias_chooses_the_experts_but_not_their_weights() {
        let logits = [0.1f32, 2.0, -1.0, 1.5];
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        // Unbiased the two likeliest are experts 1 and 3; a bias of 0.7 lifts expert 2 (sigmoid(-1) = 0.27)
        // above both.
        let bias = [0.0f32, 0.0, 0.7, 0.0];
        let r = route_biased(&logits, Gating::Sigmoid, Some(&bias), 2, false, 1.0);
        // Biased scores: 0.52, 0.88, 0.97, 0.82: experts 2 then 1.
        assert_eq!((r[0].0, r[1].0), (2, 1));
        // Their weights are the unbiased probabilities.
        assert!((r[0].1 - sig(-1.0)).abs() < 1e-6 && (r[1].1 - sig(2.0)).abs() < 1e-6);
        // Renormalized over the chosen experts' unbiased probabilities.
        let r = route_biased(&logits, Gating::Sigmoid, Some(&bias), 2, true, 1.0);
        let s = sig(-1.0) + sig(2.0);
        assert!((r[0].1 - sig(-1.0) / s).abs() < 1e-6 && (r[1].1 - sig(2.0) / s).abs() < 1e-6);
        // Expert 2 was brought in by the bias (choice 0), expert 1 would have been chosen anyway.
        assert_eq!(changed_by_bias(&logits, Gating::Sigmoid, &bias, 2), 0b01);
        assert_eq!(changed_by_bias(&logits, Gating::Sigmoid, &[0.0; 4], 2), 0);
        // No bias is route's choice.
        assert_eq!(
            route_biased(&logits, Gating::Sigmoid, None, 2, true, 1.0),
            route(&logits, Gating::Sigmoid, 2, true, 1.0)
        );
    }
}
