//! The CPU's bodies of DeepSeek V4's own operations: RoPE of the heads' last values (and back), the
//! grouped output product, attention over a window and compressed KV with sinks and the lightning
//! indexer, and the sqrt-softplus / hash-routed experts with SwiGLU limits; in the arithmetic of
//! llama.cpp's CPU kernels for `src/models/deepseek4.cpp` (ggml's soft_max and sum_rows for the
//! entries, the Hadamard-turned indexer keys, flash attention's vector and tiled paths with sinks, the
//! fused RoPE rotation), so that its outputs follow llama.cpp's to the last bit where they can.
//!
//! A compressor's state is a KV cache of one head whose key row is a token's KV row followed, in the
//! last token of a compressed entry, by the entry, and whose value row is the token's gate row (with its
//! position bias), kept in f32 as llama.cpp keeps them: an entry is made once, by the call that
//! completes it, from its tokens' rows as the cache holds them, so a conversation read in several calls
//! gives what one call gives.

use poly_kernels::matmul::QuantMatrix;
use poly_kernels::ops::attention::{self, AttnParams, FA_TILE_KV, GGML_FA_TILE_Q};
use poly_kernels::ops::topk::top_k_partial_sort;
use poly_kernels::ops::{act, norm, recurrent, softmax};
use poly_kernels::quant::GgmlType;
use poly_models::compute::{Dsv4Attention, Dsv4AttnInputs, Dsv4Compressor, Dsv4Moe, TailRope};

use super::moe::{self, ExpertSet};
use super::{mat_mul_with, rows_of, Arithmetic, CpuWeights, Mat};
use crate::state::{KvPrecision, LayerState, SeqState};

/// YaRN's correction dimensions (ggml's `ggml_rope_yarn_corr_dims`).
fn yarn_corr_dims(r: &TailRope) -> [f32; 2] {
    let n_dims = r.n_rot as f32;
    let dim = |beta: f32| {
        n_dims * (r.n_ctx_orig as f32 / (beta * 2.0 * std::f32::consts::PI)).ln()
            / (2.0 * r.freq_base.ln())
    };
    [
        dim(r.beta_fast).floor().max(0.0),
        dim(r.beta_slow).ceil().min(n_dims - 1.0),
    ]
}

/// Turns the last `n_rot` values of `head` by position `pos` (back when `inverse`), as ggml's CPU
/// `rope_f32` in normal mode with YaRN (`rope_yarn`; its magnitude correction times llama.cpp's
/// attention factor, which cancels it).
pub(crate) fn rotate_tail(head: &mut [f32], pos: f32, r: &TailRope, inverse: bool) {
    let off = r.head_dim - r.n_rot;
    let theta_scale = r.freq_base.powf(-2.0 / r.n_rot as f32);
    let corr = if r.ext_factor != 0.0 {
        yarn_corr_dims(r)
    } else {
        [0.0; 2]
    };
    let mscale = if r.ext_factor != 0.0 {
        let k = 1.0 + 0.1 * (1.0 / r.freq_scale).ln();
        (1.0 / k) * k
    } else {
        1.0
    };
    let mut theta_extrap = pos;
    for i0 in (0..r.n_rot).step_by(2) {
        let theta_interp = r.freq_scale * theta_extrap;
        let theta = if r.ext_factor != 0.0 {
            let y = (i0 as f32 / 2.0 - corr[0]) / (corr[1] - corr[0]).max(0.001);
            let ramp = (1.0 - y.clamp(0.0, 1.0)) * r.ext_factor;
            theta_interp * (1.0 - ramp) + theta_extrap * ramp
        } else {
            theta_interp
        };
        let (cos, mut sin) = (theta.cos() * mscale, theta.sin() * mscale);
        if inverse {
            sin = -sin;
        }
        let (x0, x1) = (head[off + i0], head[off + i0 + 1]);
        // As GCC contracts ggml's rotation (poly_kernels::ops::rope).
        head[off + i0] = x0.mul_add(cos, -(x1 * sin));
        head[off + i0 + 1] = x0.mul_add(sin, x1 * cos);
        theta_extrap *= theta_scale;
    }
}

/// [`rotate_tail`] on every head of every row of `x`, row `i` at `positions[i]`.
pub(super) fn rope_tail(x: &Mat, positions: &[u32], r: &TailRope, inverse: bool) -> Mat {
    assert!(
        x.cols.is_multiple_of(r.head_dim) && r.n_rot <= r.head_dim && r.n_rot.is_multiple_of(2),
        "rope_tail: rows are not whole heads"
    );
    let mut out = x.clone();
    for (row, &pos) in out.data.chunks_mut(x.cols.max(1)).zip(positions) {
        for head in row.chunks_mut(r.head_dim) {
            rotate_tail(head, pos as f32, r, inverse);
        }
    }
    out
}

/// Group `g` of each row times rows `g·out..(g+1)·out` of `w` (`[in, groups·out]`): one matrix product
/// per group in llama.cpp's orders for its `mul_mat` of a 3-D weight and a permuted activation (an F32
/// weight: one `ggml_vec_dot_f32` per output; a quantized one: the activation quantized, as an ordinary
/// product).
pub(super) fn matmul_groups(
    w: &CpuWeights,
    id: poly_models::compute::WeightId,
    x: &Mat,
    (groups, arith): (usize, Arithmetic),
) -> Mat {
    let full = w.matrix(id);
    let n_in = full.cols;
    assert!(
        groups > 0 && x.cols == n_in * groups && full.rows.is_multiple_of(groups),
        "matmul_groups: the activation is not {groups} groups of the matrix's width"
    );
    let n_out = full.rows / groups;
    let rb = full.row_bytes();
    let mut out = Mat::zeros(x.rows, full.rows);
    if full.ty == GgmlType::F32 {
        // An F32 matrix with llama.cpp's permuted (non-contiguous) activation never takes tinyBLAS:
        // every output one ggml_vec_dot_f32.
        let m = w.f32(id);
        for r in 0..x.rows {
            for g in 0..groups {
                recurrent::dot_rows_ggml(
                    &m[g * n_out * n_in..(g + 1) * n_out * n_in],
                    n_in,
                    &x.row(r)[g * n_in..(g + 1) * n_in],
                    &mut out.row_mut(r)[g * n_out..(g + 1) * n_out],
                );
            }
        }
        return out;
    }
    for g in 0..groups {
        let m = QuantMatrix::new(
            full.ty,
            n_out,
            n_in,
            &full.data[g * n_out * rb..(g + 1) * n_out * rb],
        )
        .expect("a group is whole rows of its matrix");
        let mut xg = Mat::zeros(x.rows, n_in);
        for (r, row) in xg.data.chunks_exact_mut(n_in).enumerate() {
            row.copy_from_slice(&x.row(r)[g * n_in..(g + 1) * n_in]);
        }
        let y = mat_mul_with(&m, &xg, arith);
        for r in 0..x.rows {
            out.row_mut(r)[g * n_out..(g + 1) * n_out].copy_from_slice(y.row(r));
        }
    }
    out
}

/// Turns `x` by the normalized Walsh-Hadamard matrix of its length (a power of two), in place, as ggml's
/// CPU `fwht` does: scaled by `1/sqrt(n)` first, then the butterflies.
fn hadamard(x: &mut [f32]) {
    let n = x.len();
    assert!(
        n.is_power_of_two(),
        "hadamard: length {n} is not a power of two"
    );
    let scale = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= scale);
    let mut len = 1;
    while len < n {
        for i in (0..n).step_by(2 * len) {
            for j in i..i + len {
                let (u, v) = (x[j], x[j + len]);
                x[j] = u + v;
                x[j + len] = u - v;
            }
        }
        len *= 2;
    }
}

/// The size of llama.cpp's Hadamard rotation of rows of `dim` (`build_input_k_rot`): the largest power
/// of two from 64 that divides it.
fn hadamard_size(dim: usize) -> usize {
    let mut n = 64;
    while dim.is_multiple_of(2 * n) {
        n *= 2;
    }
    n
}

/// Rounds as a cache of `precision` keeps values.
fn round(precision: KvPrecision, x: f32) -> f32 {
    match precision {
        KvPrecision::F16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Appends the batch's rows (`kv`, `gate` `[n, width]`, at positions `pos0..`) to the compressor's
/// state, with the entries the batch completes (rounded as the attention's cache keeps keys:
/// `entry_precision`), and returns every entry made so far (`dim` each).
fn compress(
    w: &CpuWeights,
    state: &mut SeqState,
    (pos0, entry_precision): (usize, KvPrecision),
    (kv, gate): (&[f32], &[f32]),
    c: &Dsv4Compressor,
) -> Vec<f32> {
    let LayerState::Kv(cache) = state.layer_mut(c.state) else {
        panic!(
            "dsv4 compressor on layer {}, whose state is not a cache",
            c.state
        );
    };
    if cache.is_empty() && cache.precision == KvPrecision::F16 {
        // llama.cpp keeps the compressors' token rows in f32 (its entries in the f16 cache): rounding
        // them would move the indexer's near ties.
        cache.precision = KvPrecision::F32;
    }
    let (width, dim, ratio) = (cache.head_dim_v, c.dim, c.ratio);
    assert!(
        cache.len() == pos0
            && cache.precision != KvPrecision::Q8_0
            && cache.head_dim_k == width + dim
            && width == if c.overlap { 2 * dim } else { dim },
        "dsv4 compressor: layer {}'s state is not at the batch or not of its rows",
        c.state
    );
    let n = kv.len() / width;
    let ape = w.f32(c.ape);
    let norm = w.f32(c.norm);
    let prec = cache.precision;
    // The rows of the previous block and the block in progress (cached), then the batch's as the
    // cache will hold them.
    let lo = (pos0 - pos0 % ratio).saturating_sub(ratio);
    let mut kvs = Vec::with_capacity((pos0 + n - lo) * width);
    let mut gates = Vec::with_capacity(kvs.capacity());
    for p in lo..pos0 {
        kvs.extend_from_slice(&cache.keys()[p * (width + dim)..][..width]);
        gates.extend_from_slice(&cache.values()[p * width..][..width]);
    }
    kvs.extend(kv.iter().map(|&x| round(prec, x)));
    for (i, row) in gate.chunks_exact(width).enumerate() {
        let bias = &ape[((pos0 + i) % ratio) * width..][..width];
        gates.extend(row.iter().zip(bias).map(|(&g, &b)| round(prec, g + b)));
    }
    let mut keys = vec![0f32; n * (width + dim)];
    for (i, row) in keys.chunks_exact_mut(width + dim).enumerate() {
        row[..width].copy_from_slice(&kvs[(pos0 - lo + i) * width..][..width]);
    }
    let n_members = if c.overlap { 2 * ratio } else { ratio };
    let (mut logits, mut values) = (vec![0f32; n_members], vec![0f32; n_members]);
    for p in pos0..pos0 + n {
        if (p + 1) % ratio != 0 {
            continue;
        }
        let start = p + 1 - ratio;
        let mut pooled = vec![0f32; dim];
        for (ch, e) in pooled.iter_mut().enumerate() {
            // The previous block's tokens by their first halves (zeros of gate −∞ before the first),
            // then the block's own by their second halves.
            let mut m = 0;
            if c.overlap {
                for t in start as isize - ratio as isize..start as isize {
                    (values[m], logits[m]) = if t < 0 {
                        (0.0, f32::NEG_INFINITY)
                    } else {
                        let r = t as usize - lo;
                        (kvs[r * width + ch], gates[r * width + ch])
                    };
                    m += 1;
                }
            }
            let half = if c.overlap { dim } else { 0 };
            for t in start..start + ratio {
                let r = t - lo;
                (values[m], logits[m]) = (kvs[r * width + half + ch], gates[r * width + half + ch]);
                m += 1;
            }
            // ggml's soft_max of the members, their product with the values, then sum_rows (in f64).
            softmax::softmax_ggml(&mut logits);
            let sum: f64 = values
                .iter()
                .zip(&logits)
                .map(|(&v, &w)| (v * w) as f64)
                .sum();
            *e = sum as f32;
        }
        let mut entry = vec![0f32; dim];
        norm::rms_norm(&pooled, dim, Some(norm), c.eps, &mut entry);
        rotate_tail(&mut entry, start as f32, &c.rope, false);
        if c.hadamard {
            entry
                .chunks_exact_mut(hadamard_size(dim))
                .for_each(hadamard);
        }
        entry
            .iter_mut()
            .for_each(|x| *x = round(entry_precision, *x));
        let i = p - pos0;
        keys[i * (width + dim) + width..(i + 1) * (width + dim)].copy_from_slice(&entry);
    }
    cache.append(&keys, &gates[(pos0 - lo) * width..]);
    let n_entries = (pos0 + n) / ratio;
    let mut entries = Vec::with_capacity(n_entries * dim);
    for e in 0..n_entries {
        let row = (e + 1) * ratio - 1;
        entries.extend_from_slice(&cache.keys()[row * (width + dim) + width..][..dim]);
    }
    entries
}

/// Each row's chosen entries: the `top_k` best of those it sees (`(p + 1) / 4` at position `p`) by
/// `Σ_h relu(q_h·k_e)·w_h` as ggml's CPU `lightning_indexer` sums it (each product one
/// `ggml_vec_dot_f32`, the heads in order), the queries turned as the keys were; ascending. Among
/// equal scores at the cut (the relu leaves many entries at exactly 0) the ones ggml's `top_k` keeps:
/// libstdc++'s `std::partial_sort` ([`top_k_partial_sort`]), not the lowest entries.
fn select(
    entries: &[f32],
    dim: usize,
    (q, wts): (&[f32], &[f32]),
    (n_head, top_k, ratio): (usize, usize, usize),
    pos0: usize,
) -> Vec<Vec<usize>> {
    let n = wts.len() / n_head;
    let mut q = q.to_vec();
    q.chunks_exact_mut(hadamard_size(dim)).for_each(hadamard);
    (0..n)
        .map(|i| {
            let visible = (pos0 + i + 1) / ratio;
            let scores: Vec<f32> = (0..visible)
                .map(|e| {
                    let k = &entries[e * dim..][..dim];
                    let mut score = 0f32;
                    let mut qk = [0f32];
                    for h in 0..n_head {
                        let qh = &q[(i * n_head + h) * dim..][..dim];
                        recurrent::dot_rows_ggml(k, dim, qh, &mut qk);
                        score += qk[0].max(0.0) * wts[i * n_head + h];
                    }
                    score
                })
                .collect();
            // ggml's `top_k` over the row (the entries not yet seen are -inf there and never
            // chosen over a seen one).
            top_k_partial_sort(&scores, top_k)
        })
        .collect()
}

/// [`poly_models::compute::Compute::dsv4_attention`] for every state of the call.
pub(super) fn dsv4_attention(
    w: &CpuWeights,
    seqs: super::sparse::Seqs<'_, '_>,
    layer: usize,
    x: &Dsv4AttnInputs<'_, Mat>,
    (a, arith): (&Dsv4Attention, Arithmetic),
) -> Mat {
    let (d, n_head) = (a.head_dim, a.n_head);
    assert!(
        x.q.cols == n_head * d && x.kv.cols == d,
        "dsv4_attention: q or kv is not of the heads' width"
    );
    let sinks = w.f32(a.sinks);
    let mut out = Mat::zeros(x.q.rows, n_head * d);
    for (state, rows) in seqs.iter_mut() {
        let pos0 = state.n_past();
        let n = rows.len();
        let rows_at = |m: &Mat| rows_of(m, rows).to_vec();
        let precision = match state.layer_mut(layer) {
            LayerState::Kv(cache) => cache.precision,
            _ => panic!("dsv4_attention on layer {layer}, whose state is not a cache"),
        };
        let comp_entries = match (a.comp.as_ref(), x.comp) {
            (Some(c), Some((kv, gate))) => Some(compress(
                w,
                state,
                (pos0, precision),
                (&rows_at(kv), &rows_at(gate)),
                c,
            )),
            _ => None,
        };
        let chosen = match (a.indexer.as_ref(), x.indexer.as_ref()) {
            (Some(ix), Some(inp)) => {
                let keys = compress(
                    w,
                    state,
                    (pos0, precision),
                    (&rows_at(inp.kv), &rows_at(inp.score)),
                    &ix.comp,
                );
                Some(select(
                    &keys,
                    ix.comp.dim,
                    (&rows_at(inp.q), &rows_at(inp.weights)),
                    (ix.n_head, ix.top_k, ix.comp.ratio),
                    pos0,
                ))
            }
            _ => None,
        };
        let LayerState::Kv(cache) = state.layer_mut(layer) else {
            panic!("dsv4_attention on layer {layer}, whose state is not a cache");
        };
        assert!(
            cache.len() == pos0 && cache.precision != KvPrecision::Q8_0 && cache.head_dim_k == d,
            "dsv4_attention: layer {layer}'s cache is not at the batch or not of its heads"
        );
        let kv = rows_at(x.kv);
        cache.append(&kv, &kv);
        let keys = cache.keys();
        let ratio = a.comp.map_or(1, |c| c.ratio);
        let q = rows_of(x.q, rows);
        let o = &mut out.data[rows.start * n_head * d..rows.end * n_head * d];
        // Each row's cells: its window, then the entries it attends (ascending), numbered after the
        // cache's rows from the next tile on, as llama.cpp's concatenation of the caches numbers them.
        let n_raw = pos0 + n;
        let base = n_raw.next_multiple_of(FA_TILE_KV);
        let no_entries = Vec::new();
        let entries = comp_entries.as_ref().unwrap_or(&no_entries);
        let mut cells = Vec::new();
        let mut offsets = vec![0usize];
        let mut last = Vec::with_capacity(n);
        for i in 0..n {
            let p = pos0 + i;
            cells.extend(((p + 1).saturating_sub(a.window)..=p).map(|j| j as u32));
            if comp_entries.is_some() {
                let mut es: Vec<usize> = match &chosen {
                    Some(sel) => sel[i].clone(),
                    None => (0..(p + 1) / ratio).collect(),
                };
                es.sort_unstable();
                cells.extend(es.into_iter().map(|e| (base + e) as u32));
            }
            last.push(*cells.last().expect("a row sees itself"));
            offsets.push(cells.len());
        }
        // The cache's rows and the entries side by side (K = V).
        let mut all = Vec::with_capacity(base * d + entries.len());
        all.extend_from_slice(&keys[..n_raw * d]);
        all.resize(base * d, 0.0);
        all.extend_from_slice(entries);
        let params = AttnParams {
            n_head,
            n_head_kv: 1,
            head_dim_k: d,
            head_dim_v: d,
            scale: a.scale,
            window: None,
            softcap: None,
            sees_together: None,
        };
        if n < GGML_FA_TILE_Q || arith == Arithmetic::BatchInvariant {
            // llama.cpp's vector path of flash attention (the query rounded to f16, the f16
            // accumulator).
            for i in 0..n {
                let mine = &cells[offsets[i]..offsets[i + 1]];
                for (h, &sink) in sinks.iter().enumerate().take(n_head) {
                    let at = (i * n_head + h) * d;
                    attention::attention_ggml_f16_cells_sink(
                        (&q[at..at + d], mine),
                        (&all, &all, d),
                        &params,
                        sink,
                        &mut o[at..at + d],
                    );
                }
            }
        } else {
            attention::attention_ggml_f16_cells_sinks_tiled(
                q,
                (&last, &cells, &offsets),
                (&all, &all),
                &params,
                &sinks[..n_head],
                o,
            );
        }
    }
    out
}

/// [`poly_models::compute::Compute::dsv4_moe`]: routed experts (by score plus bias, or by the token's
/// hash row) and the shared expert, each with its SwiGLU limit.
pub(super) fn dsv4_moe(
    w: &CpuWeights,
    x: &Mat,
    tokens: &[u32],
    m: &Dsv4Moe,
    arith: Arithmetic,
) -> Mat {
    let (n, k) = (x.rows, m.n_expert_used);
    assert_eq!(tokens.len(), n, "dsv4_moe: one token per row");
    let logits = mat_mul_with(&w.matrix(m.router), x, arith);
    let bias = m.selection_bias.map(|b| w.f32(b));
    let hash = m.hash.map(|h| w.bytes(h));
    let routes: Vec<Vec<(u32, f32)>> = (0..n)
        .map(|t| {
            let probs: Vec<f32> = logits
                .row(t)
                .iter()
                .map(|&l| act::softplus(l).sqrt())
                .collect();
            let chosen: Vec<usize> = match hash {
                Some(table) => (0..k)
                    .map(|j| {
                        let at = (tokens[t] as usize * k + j) * 4;
                        let id = i32::from_le_bytes(table[at..at + 4].try_into().expect("4 bytes"));
                        id as usize
                    })
                    .collect(),
                None => {
                    let mut order: Vec<usize> = (0..m.n_expert).collect();
                    let sel = |e: usize| probs[e] + bias.map_or(0.0, |b| b[e]);
                    order.sort_by(|&a, &b| sel(b).total_cmp(&sel(a)).then(a.cmp(&b)));
                    order.truncate(k);
                    order
                }
            };
            let mut weights: Vec<f32> = chosen.iter().map(|&e| probs[e]).collect();
            if m.norm_weights {
                let sum = weights.iter().sum::<f32>().max(6.103_515_6e-5);
                weights.iter_mut().for_each(|v| *v /= sum);
            }
            if m.weights_scale != 0.0 && m.weights_scale != 1.0 {
                weights.iter_mut().for_each(|v| *v *= m.weights_scale);
            }
            chosen
                .iter()
                .zip(weights)
                .map(|(&e, wt)| (e as u32, wt))
                .collect()
        })
        .collect();
    let set = ExpertSet::split((m.gate_exps, m.up_exps, m.down_exps), m.clamp);
    let mut out = moe::run_experts(w, x, &routes, &set, m.n_expert, arith);
    let s = &m.shared;
    let mut gate = mat_mul_with(&w.matrix(s.gate), x, arith);
    let up = mat_mul_with(&w.matrix(s.up), x, arith);
    let cols = gate.cols;
    for (g, u) in gate.data.chunks_mut(cols).zip(up.data.chunks(cols)) {
        if m.clamp_shared > 0.0 {
            moe::swiglu_clamp(g, u, m.clamp_shared);
        } else {
            moe::activate(s.act, g, u);
        }
    }
    let shared = mat_mul_with(&w.matrix(s.down), &gate, arith);
    out.data
        .iter_mut()
        .zip(&shared.data)
        .for_each(|(o, s)| *o += s);
    out
}
