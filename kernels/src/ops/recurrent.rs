//! The recurrent steps of linear-attention blocks: the causal depthwise convolution over time (ggml's
//! `ssm_conv`) and the gated delta rule (ggml's `gated_delta_net`), each advancing a carried state.

use super::{axpy, dot};
use rayon::prelude::*;

/// Causal depthwise convolution of `x` (`n` rows of `channels` values, one row per time step) with
/// `weight` (`channels` rows of `kernel` taps, ggml's `[kernel, channels]`), continuing from `state`
/// (the previous `kernel - 1` rows of input, oldest first), which the call advances:
/// `out[t][c] = Σ_i in[t - (kernel-1) + i][c] · weight[c][i]`, where inputs before `x` come from `state`.
pub fn conv1d_causal(
    x: &[f32],
    channels: usize,
    weight: &[f32],
    kernel: usize,
    state: &mut [f32],
    out: &mut [f32],
) {
    assert!(channels > 0 && kernel > 0, "conv1d: empty shape");
    assert_eq!(x.len() % channels, 0, "conv1d: x is not whole rows");
    assert_eq!(out.len(), x.len(), "conv1d: out has the wrong length");
    assert_eq!(
        weight.len(),
        channels * kernel,
        "conv1d: weight has the wrong length"
    );
    assert_eq!(
        state.len(),
        (kernel - 1) * channels,
        "conv1d: state has the wrong length"
    );
    let n = x.len() / channels;
    let mut buf = Vec::with_capacity(state.len() + x.len());
    buf.extend_from_slice(state);
    buf.extend_from_slice(x);
    for t in 0..n {
        let o = &mut out[t * channels..(t + 1) * channels];
        for (c, oc) in o.iter_mut().enumerate() {
            let taps = &weight[c * kernel..(c + 1) * kernel];
            let mut s = 0f32;
            for (i, &w) in taps.iter().enumerate() {
                s += buf[(t + i) * channels + c] * w;
            }
            *oc = s;
        }
    }
    state.copy_from_slice(&buf[n * channels..]);
}

/// The shape of a gated delta rule call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaShape {
    pub n_heads: usize,
    pub head_k: usize,
    pub head_v: usize,
}

/// The gated delta rule over `n` tokens, advancing `state` (`[n_heads][head_v][head_k]`: for each head
/// the matrix `S` with row `j` for value dimension `j`). For each token and head, with `g = e^{gate}`:
/// `S ← g·S`; `δ = β(v − S·k)`; `S ← S + δ·kᵀ`; `out = (S·q) / √head_k`.
///
/// `q` and `k` are `[n, n_heads·head_k]`, `v` and `out` `[n, n_heads·head_v]`, `gate` and `beta`
/// `[n, n_heads]`.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    gate: &[f32],
    beta: &[f32],
    shape: DeltaShape,
    state: &mut [f32],
    out: &mut [f32],
) {
    let DeltaShape {
        n_heads,
        head_k,
        head_v,
    } = shape;
    assert!(
        n_heads > 0 && head_k > 0 && head_v > 0,
        "delta rule: empty shape"
    );
    let n = gate.len() / n_heads;
    assert_eq!(
        gate.len(),
        n * n_heads,
        "delta rule: gate is not whole rows"
    );
    assert_eq!(
        beta.len(),
        n * n_heads,
        "delta rule: beta has the wrong length"
    );
    assert_eq!(
        q.len(),
        n * n_heads * head_k,
        "delta rule: q has the wrong length"
    );
    assert_eq!(k.len(), q.len(), "delta rule: k has the wrong length");
    assert_eq!(
        v.len(),
        n * n_heads * head_v,
        "delta rule: v has the wrong length"
    );
    assert_eq!(out.len(), v.len(), "delta rule: out has the wrong length");
    assert_eq!(
        state.len(),
        n_heads * head_v * head_k,
        "delta rule: state has the wrong length"
    );
    let scale = 1.0 / (head_k as f32).sqrt();
    // Each head's state evolves alone: heads in parallel, each writing its outputs to a buffer.
    let per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(head_v * head_k)
        .enumerate()
        .map(|(h, s)| {
            let mut o = vec![0f32; n * head_v];
            let mut delta = vec![0f32; head_v];
            for t in 0..n {
                let qt = &q[(t * n_heads + h) * head_k..][..head_k];
                let kt = &k[(t * n_heads + h) * head_k..][..head_k];
                let vt = &v[(t * n_heads + h) * head_v..][..head_v];
                let g = gate[t * n_heads + h].exp();
                let b = beta[t * n_heads + h];
                s.iter_mut().for_each(|x| *x *= g);
                for (j, d) in delta.iter_mut().enumerate() {
                    *d = (vt[j] - dot(&s[j * head_k..(j + 1) * head_k], kt)) * b;
                }
                for (j, &d) in delta.iter().enumerate() {
                    axpy(d, kt, &mut s[j * head_k..(j + 1) * head_k]);
                }
                for j in 0..head_v {
                    o[t * head_v + j] = dot(&s[j * head_k..(j + 1) * head_k], qt) * scale;
                }
            }
            o
        })
        .collect();
    for (h, o) in per_head.iter().enumerate() {
        for t in 0..n {
            out[(t * n_heads + h) * head_v..][..head_v].copy_from_slice(&o[t * head_v..][..head_v]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_diff, normals};
    use crate::rng::Rng;

    #[test]
    fn conv1d_matches_reference_and_chunked_calls_agree() {
        let mut rng = Rng::new(11);
        let (channels, kernel, n) = (5, 4, 9);
        let x = normals(&mut rng, n * channels);
        let w = normals(&mut rng, channels * kernel);
        let state0 = normals(&mut rng, (kernel - 1) * channels);
        let mut state = state0.clone();
        let mut out = vec![0f32; x.len()];
        conv1d_causal(&x, channels, &w, kernel, &mut state, &mut out);
        // Reference: the input sequence is state0 followed by x.
        let seq: Vec<f32> = state0.iter().chain(&x).copied().collect();
        let mut expect = vec![0f64; x.len()];
        for t in 0..n {
            for c in 0..channels {
                expect[t * channels + c] = (0..kernel)
                    .map(|i| seq[(t + i) * channels + c] as f64 * w[c * kernel + i] as f64)
                    .sum();
            }
        }
        assert!(max_diff(&out, &expect) < 1e-5);
        assert_eq!(&state[..], &seq[n * channels..]);
        // Token by token gives the same outputs and final state.
        let mut s2 = state0.clone();
        let mut o2 = vec![0f32; x.len()];
        for t in 0..n {
            let r = t * channels..(t + 1) * channels;
            conv1d_causal(&x[r.clone()], channels, &w, kernel, &mut s2, &mut o2[r]);
        }
        assert_eq!(o2, out);
        assert_eq!(s2, state);
    }

    #[test]
    fn delta_rule_matches_reference_and_chunked_calls_agree() {
        let mut rng = Rng::new(12);
        let shape = DeltaShape {
            n_heads: 3,
            head_k: 8,
            head_v: 6,
        };
        let n = 7;
        let q = normals(&mut rng, n * 3 * 8);
        let k: Vec<f32> = normals(&mut rng, n * 3 * 8)
            .iter()
            .map(|x| x * 0.3)
            .collect();
        let v = normals(&mut rng, n * 3 * 6);
        let gate: Vec<f32> = normals(&mut rng, n * 3).iter().map(|x| -x.abs()).collect();
        let beta: Vec<f32> = normals(&mut rng, n * 3)
            .iter()
            .map(|x| 1.0 / (1.0 + (-x).exp()))
            .collect();
        let s0 = normals(&mut rng, 3 * 6 * 8);
        let mut s = s0.clone();
        let mut out = vec![0f32; n * 3 * 6];
        gated_delta_rule(&q, &k, &v, &gate, &beta, shape, &mut s, &mut out);

        let mut sr: Vec<f64> = s0.iter().map(|&x| x as f64).collect();
        let mut expect = vec![0f64; out.len()];
        for t in 0..n {
            for h in 0..3 {
                let m = &mut sr[h * 48..(h + 1) * 48];
                let g = (gate[t * 3 + h] as f64).exp();
                m.iter_mut().for_each(|x| *x *= g);
                let kt: Vec<f64> = (0..8).map(|i| k[(t * 3 + h) * 8 + i] as f64).collect();
                let qt: Vec<f64> = (0..8).map(|i| q[(t * 3 + h) * 8 + i] as f64).collect();
                for j in 0..6 {
                    let sk: f64 = (0..8).map(|i| m[j * 8 + i] * kt[i]).sum();
                    let d = (v[(t * 3 + h) * 6 + j] as f64 - sk) * beta[t * 3 + h] as f64;
                    for i in 0..8 {
                        m[j * 8 + i] += d * kt[i];
                    }
                    let o: f64 = (0..8).map(|i| m[j * 8 + i] * qt[i]).sum();
                    expect[(t * 3 + h) * 6 + j] = o / 8f64.sqrt();
                }
            }
        }
        assert!(max_diff(&out, &expect) < 1e-4);
        assert!(max_diff(&s, &sr) < 1e-4);

        let mut s2 = s0.clone();
        let mut o2 = vec![0f32; out.len()];
        for t in 0..n {
            gated_delta_rule(
                &q[t * 24..(t + 1) * 24],
                &k[t * 24..(t + 1) * 24],
                &v[t * 18..(t + 1) * 18],
                &gate[t * 3..(t + 1) * 3],
                &beta[t * 3..(t + 1) * 3],
                shape,
                &mut s2,
                &mut o2[t * 18..(t + 1) * 18],
            );
        }
        assert_eq!(o2, out);
        assert_eq!(s2, s);
    }
}
