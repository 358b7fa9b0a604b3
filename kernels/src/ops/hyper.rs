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
///   destinations, then over the sources (every sum starting from eps).
///
/// `pre` and `post` as ggml's unfused operations compute them (`mul`, `add`, `sigmoid`, `scale_bias`),
/// `comb` as ggml's fused CPU `dsv4_hc_comb` (which llama.cpp's CPU backend runs): sums in f32 in order,
/// each normalization a multiplication by `1/sum`, the logits' `m·s2 + b` and `v·inv + eps` fused
/// (GCC contracts them to FMAs; checked against that loop compiled with and without contraction).
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
    let logits = (&mix[2 * hc..], scale[2], &base[2 * hc..]);
    if super::act::fma_available() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: fma_available checked that the CPU has FMA.
        return unsafe { sinkhorn_fma(comb, logits, hc, iters, eps) };
    }
    sinkhorn(comb, logits, hc, iters, eps)
}

/// [`sinkhorn`] compiled with FMA, so `mul_add` is one instruction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn sinkhorn_fma(
    comb: &mut [f32],
    logits: (&[f32], f32, &[f32]),
    hc: usize,
    iters: usize,
    eps: f32,
) {
    sinkhorn(comb, logits, hc, iters, eps)
}

/// The combination matrix (`comb[src·hc + dst]`) from its logits `mix·scale + base` (fused, as GCC
/// compiles ggml's loop; so are `v·inv + eps`).
#[inline(always)]
fn sinkhorn(
    comb: &mut [f32],
    (mix, scale, base): (&[f32], f32, &[f32]),
    hc: usize,
    iters: usize,
    eps: f32,
) {
    for (c, (&m, &b)) in comb.iter_mut().zip(mix.iter().zip(base)) {
        *c = m.mul_add(scale, b);
    }
    // A softmax over the destinations of each source, then eps.
    for row in comb.chunks_exact_mut(hc) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|v| *v = v.mul_add(inv, eps));
    }
    // Each destination's sum over its sources.
    let norm_dst = |comb: &mut [f32]| {
        for dst in 0..hc {
            let mut sum = eps;
            (0..hc).for_each(|src| sum += comb[src * hc + dst]);
            let inv = 1.0 / sum;
            (0..hc).for_each(|src| comb[src * hc + dst] *= inv);
        }
    };
    // Each source's sum over its destinations.
    let norm_src = |comb: &mut [f32]| {
        for row in comb.chunks_exact_mut(hc) {
            let mut sum = eps;
            row.iter().for_each(|&v| sum += v);
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|v| *v *= inv);
        }
    };
    norm_dst(comb);
    for _ in 1..iters {
        norm_src(comb);
        norm_dst(comb);
    }
}

/// A block's input from one token's streams (`hc·n_embd` values, stream after stream) and its `pre`
/// weights: `out = Σ_s pre[s]·stream[s]`, as ggml's fused CPU `dsv4_hc_pre` sums it (from zero, each
/// product fused into the sum).
pub fn hc_pre(streams: &[f32], pre: &[f32], out: &mut [f32]) {
    let n_embd = out.len();
    assert_eq!(streams.len(), pre.len() * n_embd, "hc_pre: wrong lengths");
    if super::act::fma_available() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: fma_available checked that the CPU has FMA.
        return unsafe { hc_pre_fma(streams, pre, out) };
    }
    hc_pre_body(streams, pre, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn hc_pre_fma(streams: &[f32], pre: &[f32], out: &mut [f32]) {
    hc_pre_body(streams, pre, out)
}

#[inline(always)]
fn hc_pre_body(streams: &[f32], pre: &[f32], out: &mut [f32]) {
    let n_embd = out.len();
    out.fill(0.0);
    for (stream, &w) in streams.chunks_exact(n_embd).zip(pre) {
        out.iter_mut()
            .zip(stream)
            .for_each(|(o, &x)| *o = x.mul_add(w, *o));
    }
}

/// One token's new streams from the block's output `x` (`n_embd`), the old `streams` and the token's
/// weights (`post` then `comb`, as [`hc_weights`] writes them after `pre`):
/// `out[d] = post[d]·x + Σ_s comb(d, s)·stream[s]`, as ggml's fused CPU `dsv4_hc_post` sums it (the
/// first product rounded, the others fused into the sum in source order).
pub fn hc_post(x: &[f32], streams: &[f32], post_comb: &[f32], out: &mut [f32]) {
    let n_embd = x.len();
    let hc = streams.len() / n_embd.max(1);
    assert!(
        streams.len() == hc * n_embd
            && out.len() == streams.len()
            && post_comb.len() == hc + hc * hc,
        "hc_post: wrong lengths"
    );
    if super::act::fma_available() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: fma_available checked that the CPU has FMA.
        return unsafe { hc_post_fma(x, streams, post_comb, out) };
    }
    hc_post_body(x, streams, post_comb, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn hc_post_fma(x: &[f32], streams: &[f32], post_comb: &[f32], out: &mut [f32]) {
    hc_post_body(x, streams, post_comb, out)
}

#[inline(always)]
fn hc_post_body(x: &[f32], streams: &[f32], post_comb: &[f32], out: &mut [f32]) {
    let n_embd = x.len();
    let hc = streams.len() / n_embd;
    let (post, comb) = post_comb.split_at(hc);
    for (dst, o) in out.chunks_exact_mut(n_embd).enumerate() {
        o.iter_mut().zip(x).for_each(|(o, &v)| *o = v * post[dst]);
        for (src, stream) in streams.chunks_exact(n_embd).enumerate() {
            let w = comb[src * hc + dst];
            o.iter_mut()
                .zip(stream)
                .for_each(|(o, &v)| *o = v.mul_add(w, *o));
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
