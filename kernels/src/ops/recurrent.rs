//! The recurrent steps of linear-attention blocks: the causal depthwise convolution over time (ggml's
//! `ssm_conv`) and the gated delta rule (ggml's `gated_delta_net`), each advancing a carried state.
//!
//! Both compute what llama.cpp's CPU backend computes bit for bit, given equal inputs (the tests hold
//! them to a step recorded from llama.cpp, `testdata/qwen35moe-recurrent-step.bin`): on the small random
//! models the witness uses, a last-bit difference here grows into visibly different probabilities.

use rayon::prelude::*;

/// Causal depthwise convolution of `x` (`n` rows of `channels` values, one row per time step) with
/// `weight` (`channels` rows of `kernel` taps, ggml's `[kernel, channels]`), continuing from `state`
/// (the previous `kernel - 1` rows of input, oldest first), which the call advances:
/// `out[t][c] = Σ_i in[t - (kernel-1) + i][c] · weight[c][i]`, where inputs before `x` come from `state`.
/// The products are added in tap order from zero as ggml's compiled `ssm_conv` (AVX2 + FMA build) adds
/// them: the taps of whole groups of four as rounded products, the remaining taps fused (`fma`).
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
    // The taps by position: [kernel][channels], so each tap is one pass over a row.
    let mut taps = vec![0f32; kernel * channels];
    for (c, w) in weight.chunks(kernel).enumerate() {
        for (i, &w) in w.iter().enumerate() {
            taps[i * channels + c] = w;
        }
    }
    // Output rows depend on input rows only: rows in parallel for long inputs. Each element still sums
    // its products from zero in tap order, as ggml's AVX2 + FMA build compiles `ggml_ssm_conv`'s loop:
    // the taps of whole groups of four as rounded products added in order (its vectorized body), the
    // rest fused (the scalar remainder, which the compiler contracts to FMA). So a kernel of 4 taps
    // (Qwen3.5's) adds rounded products, one of 3 (LFM2's) fuses all three.
    let rounded = kernel / 4 * 4;
    let fma = super::act::fma_available();
    let row = |t: usize, o: &mut [f32]| {
        o.fill(0.0);
        for i in 0..kernel {
            let (xs, ws) = (
                &buf[(t + i) * channels..(t + i + 1) * channels],
                &taps[i * channels..(i + 1) * channels],
            );
            if i < rounded {
                for ((o, &x), &w) in o.iter_mut().zip(xs).zip(ws) {
                    *o += x * w;
                }
            } else {
                fused_tap(o, xs, ws, fma);
            }
        }
    };
    let min_rows = (1 << 15) / channels + 1;
    out.par_chunks_mut(channels)
        .enumerate()
        .with_min_len(min_rows)
        .for_each(|(t, o)| row(t, o));
    state.copy_from_slice(&buf[n * channels..]);
}

/// `o ← fma(x, w, o)` element-wise (`fma`: FMA instructions are available; else `mul_add`'s library call,
/// the same values).
fn fused_tap(o: &mut [f32], xs: &[f32], ws: &[f32], fma: bool) {
    #[cfg(target_arch = "x86_64")]
    if fma {
        // SAFETY: the caller detected FMA at run time.
        return unsafe { fused_tap_fma(o, xs, ws) };
    }
    let _ = fma;
    fused_tap_body(o, xs, ws)
}

#[inline(always)]
fn fused_tap_body(o: &mut [f32], xs: &[f32], ws: &[f32]) {
    for ((o, &x), &w) in o.iter_mut().zip(xs).zip(ws) {
        *o = x.mul_add(w, *o);
    }
}

/// # Safety
/// The CPU must support FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fused_tap_fma(o: &mut [f32], xs: &[f32], ws: &[f32]) {
    fused_tap_body(o, xs, ws)
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
/// `q` and `k` are `[n, n_heads·head_k]`, `v` and `out` `[n, n_heads·head_v]`, `beta` `[n, n_heads]`,
/// `gate` `[n, n_heads]` (one decay per head) or `[n, n_heads·head_k]` (one per key channel, Kimi delta
/// attention's form: `S[j][i] ← e^{gate[i]}·S[j][i]`, as ggml's `gated_delta_net` with a `[head_k]` gate).
///
/// The arithmetic is that of ggml's CPU `gated_delta_net` on AVX2 + FMA, operation for operation, so the
/// results equal llama.cpp's bit for bit given equal inputs: the dot products of [`dot_ggml`], the rank-one
/// update as one fused multiply-add per element, the output scaled after its dot product. (On a CPU
/// without FMA the same fused operations are computed in software: slower, same results.)
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
    let n = beta.len() / n_heads;
    assert!(
        gate.len() == n * n_heads || gate.len() == n * n_heads * head_k,
        "delta rule: gate is neither one value per head nor one per key channel"
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
    let inputs = DeltaInputs {
        q,
        k,
        v,
        gate,
        beta,
        shape,
        n,
    };
    let fma = crate::quant::has_avx2_fma();
    // Each head's state evolves alone: heads in parallel, each writing its outputs to a buffer.
    let per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(head_v * head_k)
        .enumerate()
        .map(|(h, s)| {
            let mut o = vec![0f32; n * head_v];
            if fma {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `has_avx2_fma` checked that the CPU has FMA.
                unsafe {
                    delta_head_fma(&inputs, h, s, &mut o)
                };
            } else {
                delta_head(&inputs, h, s, &mut o);
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

/// The inputs of [`gated_delta_rule`], checked.
struct DeltaInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    gate: &'a [f32],
    beta: &'a [f32],
    shape: DeltaShape,
    n: usize,
}

/// [`delta_head`] compiled with FMA, so `mul_add` is one instruction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn delta_head_fma(x: &DeltaInputs<'_>, h: usize, s: &mut [f32], o: &mut [f32]) {
    delta_head(x, h, s, o)
}

/// Head `h` over every token: advances its state `s` (`[head_v][head_k]`) and writes its outputs `o`
/// (`[n][head_v]`).
#[inline(always)]
fn delta_head(x: &DeltaInputs<'_>, h: usize, s: &mut [f32], o: &mut [f32]) {
    let DeltaShape {
        n_heads,
        head_k,
        head_v,
    } = x.shape;
    let scale = 1.0 / (head_k as f32).sqrt();
    let mut delta = vec![0f32; head_v];
    let mut decay = vec![0f32; head_k];
    for t in 0..x.n {
        let qt = &x.q[(t * n_heads + h) * head_k..][..head_k];
        let kt = &x.k[(t * n_heads + h) * head_k..][..head_k];
        let vt = &x.v[(t * n_heads + h) * head_v..][..head_v];
        let b = x.beta[t * n_heads + h];
        if x.gate.len() == x.n * n_heads {
            let g = x.gate[t * n_heads + h].exp();
            s.iter_mut().for_each(|e| *e *= g);
        } else {
            // One decay per key channel: every value row's element i decays by e^{gate[i]}.
            let gt = &x.gate[(t * n_heads + h) * head_k..][..head_k];
            decay.iter_mut().zip(gt).for_each(|(d, &g)| *d = g.exp());
            for row in s.chunks_exact_mut(head_k) {
                row.iter_mut().zip(&decay).for_each(|(e, &d)| *e *= d);
            }
        }
        for (j, d) in delta.iter_mut().enumerate() {
            *d = (vt[j] - dot_ggml(&s[j * head_k..(j + 1) * head_k], kt)) * b;
        }
        for (j, &d) in delta.iter().enumerate() {
            for (e, &ki) in s[j * head_k..(j + 1) * head_k].iter_mut().zip(kt) {
                *e = ki.mul_add(d, *e);
            }
        }
        for j in 0..head_v {
            o[t * head_v + j] = dot_ggml(&s[j * head_k..(j + 1) * head_k], qt) * scale;
        }
    }
}

/// `out[r] = dot_ggml(m[r], x)` for every `cols`-long row `r` of `m`: ggml's F32 `mul_mat` on its vector
/// path (a non-contiguous activation, such as MLA's per-head products, never takes tinyBLAS), with FMA
/// instructions where the CPU has them.
pub fn dot_rows_ggml(m: &[f32], cols: usize, x: &[f32], out: &mut [f32]) {
    assert!(
        cols > 0 && x.len() == cols && m.len() == out.len() * cols,
        "dot_rows_ggml: wrong lengths"
    );
    if crate::quant::has_avx2_fma() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `has_avx2_fma` checked that the CPU has FMA.
        return unsafe { dot_rows_ggml_fma(m, cols, x, out) };
    }
    dot_rows_body(m, cols, x, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn dot_rows_ggml_fma(m: &[f32], cols: usize, x: &[f32], out: &mut [f32]) {
    dot_rows_body(m, cols, x, out)
}

#[inline(always)]
fn dot_rows_body(m: &[f32], cols: usize, x: &[f32], out: &mut [f32]) {
    for (o, row) in out.iter_mut().zip(m.chunks_exact(cols)) {
        *o = dot_ggml(row, x);
    }
}

/// Dot product in the order of ggml's `ggml_vec_dot_f32` on AVX2 + FMA: four accumulators of eight
/// lanes, each fed by fused multiply-adds over 32-element steps, summed pairwise (accumulators 0+2 and
/// 1+3, then those two; then the upper four lanes onto the lower four, then adjacent pairs), and the
/// elements past the last whole step added one by one (as GCC compiles that loop: rounded products, the
/// last `n mod 4` fused).
#[inline(always)]
pub fn dot_ggml(x: &[f32], y: &[f32]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let n = x.len();
    let np = n - n % 32;
    let mut acc = [[0f32; 8]; 4];
    for i in (0..np).step_by(32) {
        for (j, a) in acc.iter_mut().enumerate() {
            let (xs, ys) = (&x[i + 8 * j..][..8], &y[i + 8 * j..][..8]);
            for l in 0..8 {
                a[l] = xs[l].mul_add(ys[l], a[l]);
            }
        }
    }
    let mut r = [0f32; 8];
    for l in 0..8 {
        r[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let t0 = [r[0] + r[4], r[1] + r[5], r[2] + r[6], r[3] + r[7]];
    let mut sum = (t0[0] + t0[1]) + (t0[2] + t0[3]);
    // The compiled tail: products rounded and added in order, except the last `n mod 4`, fused.
    let fused_from = n - (n - np) % 4;
    for i in np..n {
        if i < fused_from {
            sum += x[i] * y[i];
        } else {
            sum = x[i].mul_add(y[i], sum);
        }
    }
    sum
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

    /// The sections of `testdata/qwen35moe-recurrent-step.bin` (see `testdata/make_recurrent_step.py`):
    /// llama.cpp's inputs and outputs of one decode step of block 0 of the qwen35moe fixture.
    fn llama_step() -> Vec<Vec<f32>> {
        let bytes: &[u8] = include_bytes!("../../testdata/qwen35moe-recurrent-step.bin");
        let mut sections = Vec::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
            let values = rest[4..4 + 4 * n]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            sections.push(values);
            rest = &rest[4 + 4 * n..];
        }
        assert_eq!(sections.len(), 12, "sections of the llama.cpp step");
        sections
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn conv1d_equals_llama_cpp_bit_for_bit() {
        let s = llama_step();
        let (channels, kernel) = (64, 4);
        // ggml keeps the state per channel ([channel][tap]); ours is per time step ([tap][channel]).
        let mut state = vec![0f32; (kernel - 1) * channels];
        for c in 0..channels {
            for t in 0..kernel - 1 {
                state[t * channels + c] = s[0][c * (kernel - 1) + t];
            }
        }
        let mut out = vec![0f32; channels];
        conv1d_causal(&s[1], channels, &s[2], kernel, &mut state, &mut out);
        assert_eq!(bits(&out), bits(&s[3]));
    }

    /// `testdata/ssm-conv-taps.bin` (`testdata/ssm_conv_taps.c`): ggml's `ggml_ssm_conv` on 32 channels
    /// and 4 tokens with kernels of 3 and 6 taps, where its compiled loop fuses the taps past the last
    /// whole group of four.
    #[test]
    fn conv1d_equals_llama_cpp_bit_for_bit_for_kernels_not_a_multiple_of_four() {
        let bytes: &[u8] = include_bytes!("../../testdata/ssm-conv-taps.bin");
        let mut sections = Vec::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
            let values: Vec<f32> = rest[4..4 + 4 * n]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            sections.push(values);
            rest = &rest[4 + 4 * n..];
        }
        assert_eq!(sections.len(), 6, "two kernels of three sections");
        let (channels, tokens) = (32, 4);
        for (k, kernel) in [3usize, 6].into_iter().enumerate() {
            let (window, weight, want) =
                (&sections[3 * k], &sections[3 * k + 1], &sections[3 * k + 2]);
            let len = kernel - 1 + tokens;
            // ggml's window is [channel][time]; ours is the state [tap][channel] then x [token][channel].
            let at = |t: usize, c: usize| window[c * len + t];
            let mut state = vec![0f32; (kernel - 1) * channels];
            for t in 0..kernel - 1 {
                for c in 0..channels {
                    state[t * channels + c] = at(t, c);
                }
            }
            let x: Vec<f32> = (0..tokens)
                .flat_map(|t| (0..channels).map(move |c| (t, c)))
                .map(|(t, c)| at(kernel - 1 + t, c))
                .collect();
            let mut out = vec![0f32; tokens * channels];
            conv1d_causal(&x, channels, weight, kernel, &mut state, &mut out);
            assert_eq!(bits(&out), bits(want), "{kernel} taps");
            // Every product rounded (the order for four taps) is not what ggml computes here.
            let plain: Vec<f32> = (0..tokens * channels)
                .map(|i| {
                    let (t, c) = (i / channels, i % channels);
                    (0..kernel).fold(0f32, |s, j| s + at(t + j, c) * weight[c * kernel + j])
                })
                .collect();
            assert_ne!(bits(&plain), bits(want), "{kernel} taps");
        }
    }

    #[test]
    fn delta_rule_equals_llama_cpp_bit_for_bit_with_tiled_key_heads() {
        let s = llama_step();
        let (q, k, v, gate, beta) = (&s[4], &s[5], &s[6], &s[7], &s[8]);
        let shape = DeltaShape {
            n_heads: 1,
            head_k: 64,
            head_v: 64,
        };
        // Value head 2 of 4 over 2 key heads: llama.cpp reads key head 2 mod 2 = 0.
        let run = |kh: usize| {
            let mut state = s[9].clone();
            let mut out = vec![0f32; 64];
            let (qh, kh) = (&q[kh * 64..][..64], &k[kh * 64..][..64]);
            gated_delta_rule(qh, kh, v, gate, beta, shape, &mut state, &mut out);
            (out, state)
        };
        let (out, state) = run(0);
        assert_eq!(bits(&out), bits(&s[10]));
        assert_eq!(bits(&state), bits(&s[11]));
        // The other order (value head h reading key head h / 2) is not what llama.cpp computes.
        let (other, _) = run(1);
        assert_ne!(bits(&other), bits(&s[10]));
    }

    #[test]
    fn dot_follows_ggml_lane_order() {
        // Terms of very different sizes, so the rounded sum depends on the order of the additions.
        let n = 70;
        let mut rng = Rng::new(13);
        let x: Vec<f32> = normals(&mut rng, n)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 10f32.powi(i as i32 % 7 - 3))
            .collect();
        let y = normals(&mut rng, n);
        // ggml_vec_dot_f32 on AVX2 + FMA, spelled out: lane l of accumulator j takes elements
        // 32·step + 8·j + l by fused multiply-add; the 6 past the last step of 32 come after the reduction,
        // four as rounded products, the last two fused.
        let mut acc = [[0f32; 8]; 4];
        for step in 0..2 {
            for (j, a) in acc.iter_mut().enumerate() {
                for (l, lane) in a.iter_mut().enumerate() {
                    let e = 32 * step + 8 * j + l;
                    *lane = x[e].mul_add(y[e], *lane);
                }
            }
        }
        let lane = |l: usize| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
        let half: Vec<f32> = (0..4).map(|l| lane(l) + lane(l + 4)).collect();
        let mut expect = (half[0] + half[1]) + (half[2] + half[3]);
        for e in 64..68 {
            expect += x[e] * y[e];
        }
        for e in 68..n {
            expect = x[e].mul_add(y[e], expect);
        }
        assert_eq!(dot_ggml(&x, &y).to_bits(), expect.to_bits());
        let naive: f32 = x.iter().zip(&y).map(|(a, b)| a * b).sum();
        assert_ne!(
            naive.to_bits(),
            expect.to_bits(),
            "the test input is order-blind"
        );
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
