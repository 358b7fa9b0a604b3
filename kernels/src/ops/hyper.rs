//! Hyper-connection residual streams with Sinkhorn-normalized mixing (mHC, as ggml's `dsv4_hc_*`
//! operations and their unfused graph compute them): a token carries `hc` streams of `n_embd` values; a
//! block reads one weighted sum of them and writes its output back spread over them, mixed with the old
//! streams by a doubly-normalized `hc × hc` matrix.
//!
//! One token's weights are `(2 + hc)·hc` values: `pre[hc]`, `post[hc]`, then `comb` with element
//! `(dst, src)` at `2·hc + src·hc + dst` (ggml's `[dst, src]` tensor, `dst` contiguous).

/// The mixing weights of one token from its `mix` (`(2 + hc)·hc` values: the flattened streams' RMS norm
/// times the block's mixing matrix), the three scales `scale` (pre, post, combination) and the bias
/// `base` (`(2 + hc)·hc`):
/// - `pre = sigmoid(s0·m + b) + eps`,
/// - `post = 2·sigmoid(s1·m + b)`,
/// - `comb` from `s2·m + b`: for each source a softmax over the destinations, plus eps; each
///   destination's sum over the sources normalized to one; then `iters − 1` times the sums over the
///   destinations, then over the sources (every sum plus eps before it divides).
pub fn hc_weights(
    mix: &[f32],
    scale: &[f32],
    base: &[f32],
    (hc, iters, eps): (usize, usize, f32),
    out: &mut [f32],
) {
    let n = (2 + hc) * hc;
    assert!(
        mix.len() == n && base.len() == n && out.len() == n && scale.len() == 3,
        "hc_weights: wrong lengths"
    );
    let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
    for i in 0..hc {
        out[i] = sigmoid(mix[i] * scale[0] + base[i]) + eps;
        out[hc + i] = 2.0 * sigmoid(mix[hc + i] * scale[1] + base[hc + i]);
    }
    let comb = &mut out[2 * hc..];
    for (c, (&m, &b)) in comb
        .iter_mut()
        .zip(mix[2 * hc..].iter().zip(&base[2 * hc..]))
    {
        *c = m * scale[2] + b;
    }
    // A softmax over the destinations of each source (ggml's soft_max over ne0), then eps.
    for row in comb.chunks_exact_mut(hc) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f64;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v as f64;
        }
        let inv = (1.0 / sum) as f32;
        row.iter_mut().for_each(|v| *v = *v * inv + eps);
    }
    // Each destination's sum over its sources.
    let norm_dst = |comb: &mut [f32]| {
        for dst in 0..hc {
            let sum: f32 = (0..hc).map(|src| comb[src * hc + dst]).sum::<f32>() + eps;
            (0..hc).for_each(|src| comb[src * hc + dst] /= sum);
        }
    };
    // Each source's sum over its destinations.
    let norm_src = |comb: &mut [f32]| {
        for row in comb.chunks_exact_mut(hc) {
            let sum: f32 = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|v| *v /= sum);
        }
    };
    norm_dst(comb);
    for _ in 1..iters {
        norm_src(comb);
        norm_dst(comb);
    }
}

/// A block's input from one token's streams (`hc·n_embd` values, stream after stream) and its `pre`
/// weights: `out = Σ_s pre[s]·stream[s]`.
pub fn hc_pre(streams: &[f32], pre: &[f32], out: &mut [f32]) {
    let n_embd = out.len();
    assert_eq!(streams.len(), pre.len() * n_embd, "hc_pre: wrong lengths");
    for (s, (stream, &w)) in streams.chunks_exact(n_embd).zip(pre).enumerate() {
        if s == 0 {
            out.iter_mut().zip(stream).for_each(|(o, &x)| *o = x * w);
        } else {
            out.iter_mut().zip(stream).for_each(|(o, &x)| *o += x * w);
        }
    }
}

/// One token's new streams from the block's output `x` (`n_embd`), the old `streams` and the token's
/// weights (`post` then `comb`, as [`hc_weights`] writes them after `pre`):
/// `out[d] = post[d]·x + Σ_s comb(d, s)·stream[s]`.
pub fn hc_post(x: &[f32], streams: &[f32], post_comb: &[f32], out: &mut [f32]) {
    let n_embd = x.len();
    let hc = streams.len() / n_embd.max(1);
    assert!(
        streams.len() == hc * n_embd
            && out.len() == streams.len()
            && post_comb.len() == hc + hc * hc,
        "hc_post: wrong lengths"
    );
    let (post, comb) = post_comb.split_at(hc);
    for (dst, o) in out.chunks_exact_mut(n_embd).enumerate() {
        o.iter_mut().zip(x).for_each(|(o, &v)| *o = v * post[dst]);
        for (src, stream) in streams.chunks_exact(n_embd).enumerate() {
            let w = comb[src * hc + dst];
            o.iter_mut().zip(stream).for_each(|(o, &v)| *o += v * w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinkhorn_makes_the_mixing_matrix_doubly_stochastic() {
        let hc = 4;
        let n = (2 + hc) * hc;
        let mix: Vec<f32> = (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3).collect();
        let base: Vec<f32> = (0..n).map(|i| (i % 3) as f32 * 0.1).collect();
        let mut w = vec![0f32; n];
        hc_weights(&mix, &[1.0, 0.5, 2.0], &base, (hc, 20, 1e-6), &mut w);
        let comb = &w[2 * hc..];
        for k in 0..hc {
            let by_src: f32 = (0..hc).map(|d| comb[k * hc + d]).sum();
            let by_dst: f32 = (0..hc).map(|s| comb[s * hc + k]).sum();
            assert!((by_src - 1.0).abs() < 1e-3 && (by_dst - 1.0).abs() < 1e-5);
        }
        assert!(w[..hc].iter().all(|&p| p > 0.0 && p < 1.0 + 1e-5));
        assert!(w[hc..2 * hc].iter().all(|&p| p > 0.0 && p < 2.0));
    }

    #[test]
    fn pre_and_post_weigh_and_spread_the_streams() {
        let streams = [1.0f32, 2.0, 10.0, 20.0];
        let mut x = [0f32; 2];
        hc_pre(&streams, &[0.5, 0.25], &mut x);
        assert_eq!(x, [3.0, 6.0]);
        // post [1, 2], comb(d, s): identity.
        let mut out = [0f32; 4];
        hc_post(
            &[1.0, 1.0],
            &streams,
            &[1.0, 2.0, 1.0, 0.0, 0.0, 1.0],
            &mut out,
        );
        assert_eq!(out, [2.0, 3.0, 12.0, 22.0]);
    }
}
