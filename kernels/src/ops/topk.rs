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

/// The indices of the `k` largest values of `x` as ggml's CPU `top_k` chooses them: libstdc++'s
/// `std::partial_sort` of the indices `0..n` with the comparator "value greater", whose selection
/// (`__heap_select`: a heap of the first `k`, each later index replacing the heap's top only when its
/// value is strictly greater) keeps, among equal values at the cut, the ones its heap happens to hold.
/// The set is what llama.cpp's sparse-attention indexer keeps; returned ascending.
pub fn top_k_partial_sort(x: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(x.len());
    let mut idx: Vec<usize> = (0..x.len()).collect();
    if k == 0 {
        return Vec::new();
    }
    // comp(a, b): a goes before b (a's value is greater).
    let comp = |a: usize, b: usize| x[a] > x[b];
    // libstdc++'s __push_heap: moves `value` up from `hole` towards `top`.
    let push_heap = |h: &mut [usize], mut hole: usize, top: usize, value: usize| {
        let mut parent = hole.wrapping_sub(1) / 2;
        while hole > top && comp(h[parent], value) {
            h[hole] = h[parent];
            hole = parent;
            parent = hole.wrapping_sub(1) / 2;
        }
        h[hole] = value;
    };
    // libstdc++'s __adjust_heap.
    let adjust_heap = |h: &mut [usize], mut hole: usize, len: usize, value: usize| {
        let top = hole;
        let mut second = hole;
        while len >= 2 && second < (len - 1) / 2 {
            second = 2 * (second + 1);
            if comp(h[second], h[second - 1]) {
                second -= 1;
            }
            h[hole] = h[second];
            hole = second;
        }
        if len.is_multiple_of(2) && len >= 2 && second == (len - 2) / 2 {
            second = 2 * (second + 1);
            h[hole] = h[second - 1];
            hole = second - 1;
        }
        push_heap(h, hole, top, value);
    };
    // __make_heap over the first k.
    if k >= 2 {
        let mut parent = (k - 2) / 2;
        loop {
            let value = idx[parent];
            adjust_heap(&mut idx[..k], parent, k, value);
            if parent == 0 {
                break;
            }
            parent -= 1;
        }
    }
    // __heap_select: a later index replaces the top (the least kept) when comp says it goes first.
    for i in k..idx.len() {
        if comp(idx[i], idx[0]) {
            // __pop_heap(first, middle, i): the old top goes to i, i's index sifts in from the top.
            let value = idx[i];
            idx[i] = idx[0];
            adjust_heap(&mut idx[..k], 0, k, value);
        }
    }
    let mut kept = idx[..k].to_vec();
    kept.sort_unstable();
    kept
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

    #[test]
    fn partial_sort_top_k_keeps_the_largest_and_breaks_ties_as_its_heap_does() {
        let x = [0.5f32, 3.0, 1.0, 2.0, 0.0, 4.0];
        assert_eq!(top_k_partial_sort(&x, 3), vec![1, 3, 5]);
        assert_eq!(top_k_partial_sort(&x, 10), vec![0, 1, 2, 3, 4, 5]);
        // Equal values: the later ones never replace a kept one of the same value.
        assert_eq!(top_k_partial_sort(&[0.0; 6], 2), vec![0, 1]);
        assert_eq!(top_k_partial_sort(&[0.0, 0.0, 1.0, 0.0], 2), vec![0, 2]);
        // Every distinct-value case agrees with a full sort.
        let y: Vec<f32> = (0..40).map(|i| ((i * 37) % 41) as f32).collect();
        for k in 0..=40 {
            let mut want = top_k(&y, k);
            want.sort_unstable();
            assert_eq!(top_k_partial_sort(&y, k), want, "k {k}");
        }
    }
}
