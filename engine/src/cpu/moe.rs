//! The mixture-of-experts block on the CPU, as llama.cpp's `build_moe_ffn` computes it: router logits,
//! probabilities (softmax or sigmoid), the top-k experts per token (by probability plus the selection bias
//! when the block has one), their weights (renormalized and scaled when asked), then each chosen expert's `down(act(gate·x) ⊙ up·x)` summed with those weights.
//!
//! Tokens are grouped by expert, so each expert's three matrices (sub-matrices of the `*_exps` tensors)
//! stream once per call for all the tokens routed to it; experts run in parallel. A token's expert outputs
//! are summed in its routing order, so its result does not depend on the rest of the batch.
//!
//! The arithmetic is llama.cpp's CPU backend's: the router is an ordinary matrix product ([`super::mat_mul`]),
//! routing is [`route`] (ggml's softmax, f64 sum, division), the expert products take the order of
//! ggml's `MUL_MAT_ID` ([`mul_mat_id_order`]), SwiGLU is ggml's vectorized one. [`moe_with`] takes
//! [`Arithmetic::BatchInvariant`]'s orders instead.
//!
//! [`fused_moe_observed`] is Gemma 4's form ([`FusedMoe`]): the router on an input of its own, each expert's
//! gate and up projections one matrix (one `MUL_MAT_ID` product, split after it, as llama.cpp's
//! `gate_up_exps` path), each expert's output times its scale before its routing weight.

use poly_kernels::matmul::QuantMatrix;
use poly_kernels::matmul::{matmul_ordered, matvec_many, MatvecJob};
use poly_kernels::ops::act;
use poly_kernels::ops::topk::{route_biased, Gating as KGating};
use poly_kernels::quant::{batch_dot, unrepacked_order, BatchDot, GgmlType};
use poly_models::compute::{FusedMoe, Gating, Moe, Unary, WeightId};
use rayon::prelude::*;
use std::sync::Mutex;

use super::{apply_unary, llama_repacks, mat_mul_with, profile, Arithmetic, CpuWeights, Mat};

/// The block's output for `x` (`[n, n_embd]`), in llama.cpp's orders.
pub fn moe(w: &CpuWeights, x: &Mat, m: &Moe) -> Mat {
    moe_with(w, x, m, Arithmetic::LlamaCpp)
}

/// The block's output for `x` (`[n, n_embd]`) in the orders `arith` chooses. Batch-invariant: the
/// router and every expert product in the order of one routed row, so a token's result depends neither
/// on how many tokens the call has nor on how many of them share its experts.
pub fn moe_with(w: &CpuWeights, x: &Mat, m: &Moe, arith: Arithmetic) -> Mat {
    moe_observed(w, x, m, arith, None, |_| {})
}

/// [`moe_with`], routing with `router` (`n_expert` rows of `n_embd`) instead of the file's when given (a
/// router being calibrated), and showing `observe` every token's route (expert, weight) before the
/// experts run.
pub fn moe_observed(
    w: &CpuWeights,
    x: &Mat,
    m: &Moe,
    arith: Arithmetic,
    router: Option<&QuantMatrix<'_>>,
    observe: impl FnOnce(&[Vec<(u32, f32)>]),
) -> Mat {
    let (n, k) = (x.rows, m.n_expert_used);
    if n == 0 || k == 0 {
        return Mat::zeros(n, x.cols);
    }
    let router_span = profile::span("moe.router");
    let logits = match router {
        Some(r) => mat_mul_with(r, x, arith),
        None => mat_mul_with(&w.matrix(m.router), x, arith),
    };
    assert_eq!(
        logits.cols, m.n_expert,
        "moe: router width differs from n_expert"
    );
    let bias = m.selection_bias.map(|b| w.f32(b));
    let routes = route_all(
        &logits,
        m.gating,
        bias,
        k,
        (m.norm_weights, m.weights_scale),
    );
    observe(&routes);

    drop(router_span);
    run_experts(w, x, &routes, &ExpertSet::of_moe(m), m.n_expert, arith)
}

/// Every token's route (expert, weight) from its router logits (`[n, n_expert]`); `(norm, scale)`: the
/// chosen weights renormalized, and their scale.
fn route_all(
    logits: &Mat,
    gating: Gating,
    bias: Option<&[f32]>,
    k: usize,
    (norm, scale): (bool, f32),
) -> Vec<Vec<(u32, f32)>> {
    let gating = match gating {
        Gating::Softmax => KGating::Softmax,
        Gating::Sigmoid => KGating::Sigmoid,
    };
    (0..logits.rows)
        .map(|t| route_biased(logits.row(t), gating, bias, k, norm, scale))
        .collect()
}

/// Gemma 4's MoE block ([`FusedMoe`]) for `x` (`[n, n_embd]`), routed by `router_x` (`[n, n_embd]`;
/// with `router` instead of the file's when given, a router being calibrated), showing `observe` every
/// token's route before the experts run: [`moe_observed`]'s arithmetic, with the router's own input, the
/// fused gate/up products and the per-expert scales.
pub fn fused_moe_observed(
    w: &CpuWeights,
    (x, router_x): (&Mat, &Mat),
    m: &FusedMoe,
    arith: Arithmetic,
    router: Option<&QuantMatrix<'_>>,
    observe: impl FnOnce(&[Vec<(u32, f32)>]),
) -> Mat {
    let (n, k) = (x.rows, m.n_expert_used);
    assert_eq!(
        router_x.rows, n,
        "fused_moe: the router's input has another row count"
    );
    if n == 0 || k == 0 {
        return Mat::zeros(n, x.cols);
    }
    let router_span = profile::span("moe.router");
    let logits = match router {
        Some(r) => mat_mul_with(r, router_x, arith),
        None => mat_mul_with(&w.matrix(m.router), router_x, arith),
    };
    assert_eq!(
        logits.cols, m.n_expert,
        "fused_moe: router width differs from n_expert"
    );
    let routes = route_all(
        &logits,
        m.gating,
        None,
        k,
        (m.norm_weights, m.weights_scale),
    );
    observe(&routes);
    drop(router_span);
    let set = ExpertSet {
        proj: Proj::Fused(m.gate_up_exps),
        down: m.down_exps,
        down_scale: m.down_scale.map(|s| w.f32(s)),
        act: m.act,
        clamp: 0.0,
    };
    run_experts(w, x, &routes, &set, m.n_expert, arith)
}

/// An expert's gate and up projections: two tensors, or one holding both (each expert's gate rows,
/// then its up rows).
#[derive(Clone, Copy, Debug)]
enum Proj {
    Split { gate: WeightId, up: WeightId },
    Fused(WeightId),
}

/// A block's experts as the CPU's products read them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ExpertSet<'a> {
    proj: Proj,
    down: WeightId,
    /// Each expert's output scale (`[n_expert]`), applied before its routing weight.
    down_scale: Option<&'a [f32]>,
    act: Unary,
    /// SwiGLU's limit (DeepSeek V4's `swiglu_clamp_exp`): the gate at most, the up part within ±;
    /// 0: none.
    clamp: f32,
}

impl ExpertSet<'static> {
    /// The experts of a [`Moe`] block.
    pub(crate) fn of_moe(m: &Moe) -> ExpertSet<'static> {
        ExpertSet {
            proj: Proj::Split {
                gate: m.gate_exps,
                up: m.up_exps,
            },
            down: m.down_exps,
            down_scale: None,
            act: m.act,
            clamp: 0.0,
        }
    }

    /// Experts of separate gate, up and down tensors, SwiGLU limited by `clamp` (0: none).
    pub(crate) fn split(
        (gate, up, down): (WeightId, WeightId, WeightId),
        clamp: f32,
    ) -> ExpertSet<'static> {
        ExpertSet {
            proj: Proj::Split { gate, up },
            down,
            down_scale: None,
            act: Unary::Silu,
            clamp,
        }
    }
}

impl ExpertSet<'_> {
    /// Expert `e`'s output scale, when the set has scales.
    fn scale(&self, e: usize) -> Option<f32> {
        self.down_scale.map(|s| s[e])
    }

    /// `gate ← act(gate) ⊙ up`, limited when the set has a limit.
    fn activate(&self, gate: &mut [f32], up: &[f32]) {
        if self.clamp > 0.0 {
            swiglu_clamp(gate, up, self.clamp);
        } else {
            activate(self.act, gate, up);
        }
    }
}

/// `gate ← silu(min(gate, limit)) · clamp(up, −limit, limit)`, as ggml's `swiglu_clamp` computes it.
pub(crate) fn swiglu_clamp(gate: &mut [f32], up: &[f32], limit: f32) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = g.min(limit);
        *g = x / (1.0 + (-x).exp()) * u.clamp(-limit, limit);
    }
}

/// The routed experts of every token of `x`, summed with their weights in each token's routing order.
pub(crate) fn run_experts(
    w: &CpuWeights,
    x: &Mat,
    routes: &[Vec<(u32, f32)>],
    set: &ExpertSet<'_>,
    n_expert: usize,
    arith: Arithmetic,
) -> Mat {
    let (n, n_embd) = (x.rows, x.cols);
    let k = routes.first().map_or(0, Vec::len);
    let mut out = Mat::zeros(n, n_embd);
    if n == 1 {
        let _span = profile::span("moe.decode_experts");
        return decode_set(w, x, set, &routes[0]);
    }
    let experts_span = profile::span("moe.experts");

    // For every expert, the (token, slot) pairs routed to it.
    let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n_expert];
    for (t, r) in routes.iter().enumerate() {
        for (slot, &(e, _)) in r.iter().enumerate() {
            by_expert[e as usize].push((t, slot));
        }
    }
    let active: Vec<usize> = (0..n_expert)
        .filter(|&e| !by_expert[e].is_empty())
        .collect();
    let outputs: Vec<Mat> = active
        .par_iter()
        .map(|&e| {
            let xs = Mat::from_vec(
                by_expert[e].len(),
                n_embd,
                by_expert[e]
                    .iter()
                    .flat_map(|&(t, _)| x.row(t).iter().copied())
                    .collect(),
            );
            expert_of(w, set, e, &xs, arith)
        })
        .collect();

    drop(experts_span);
    let _span = profile::span("moe.sum");
    // Where each token's expert output for each routing slot is: (index in `active`, row of its output).
    let mut at = vec![(0usize, 0usize); n * k];
    for (a, &e) in active.iter().enumerate() {
        for (i, &(t, slot)) in by_expert[e].iter().enumerate() {
            at[t * k + slot] = (a, i);
        }
    }
    // Each token's expert outputs summed in slot order; tokens in parallel.
    out.data
        .par_chunks_mut(n_embd)
        .enumerate()
        .with_min_len(16)
        .for_each(|(t, o)| {
            for (slot, &(_, weight)) in routes[t].iter().enumerate() {
                let (a, i) = at[t * k + slot];
                let y = outputs[a].row(i);
                o.iter_mut().zip(y).for_each(|(a, b)| *a += weight * b);
            }
        });
    out
}

/// The experts of one token (a decode step) routed as `route` (expert, weight): the gate and up
/// products of all of them in one parallel region, then their down products in another, instead of a
/// parallel region per product. Every dot product is the one [`expert`] computes for a single routed row
/// (the activation quantized once per format, each product in its `MUL_MAT_ID` order for one row), and
/// the outputs are summed in routing order, so the result is the same bits.
pub(crate) fn decode_experts(w: &CpuWeights, x: &Mat, m: &Moe, route: &[(u32, f32)]) -> Mat {
    decode_set(w, x, &ExpertSet::of_moe(m), route)
}

/// [`decode_experts`] for any [`ExpertSet`]: a fused gate/up matrix is one product per expert, split
/// after it; each expert's output is scaled before its weight when the set has scales.
fn decode_set(w: &CpuWeights, x: &Mat, set: &ExpertSet<'_>, route: &[(u32, f32)]) -> Mat {
    let n_embd = x.cols;
    let k = route.len();
    if k == 0 {
        return Mat::zeros(1, n_embd);
    }
    let mats = |id, e: u32| w.sub_matrix(id, e as usize);
    let quantized = |mat: &QuantMatrix<'_>, v: &[f32]| {
        let act = mat.ty.ops().expect("bound tensors compute").act;
        let mut q = vec![0u8; act.bytes_for(mat.cols)];
        act.quantize(v, &mut q);
        q
    };
    // [k, n_ff]: each expert's gated unit.
    let (hidden, n_ff) = match set.proj {
        Proj::Split { gate, up } => {
            let (gates, ups): (Vec<_>, Vec<_>) = route
                .iter()
                .map(|&(e, _)| (mats(gate, e), mats(up, e)))
                .unzip();
            let n_ff = gates[0].rows;
            let mut gate = vec![0f32; k * n_ff];
            let mut up = vec![0f32; k * n_ff];
            {
                // Experts of one tensor share the format, so one quantized activation per tensor.
                let (xg, xu) = (quantized(&gates[0], &x.data), quantized(&ups[0], &x.data));
                let mut jobs: Vec<MatvecJob<'_, '_>> = Vec::with_capacity(2 * k);
                for ((g, u), (yg, yu)) in gates
                    .iter()
                    .zip(&ups)
                    .zip(gate.chunks_mut(n_ff).zip(up.chunks_mut(n_ff)))
                {
                    jobs.push(MatvecJob {
                        w: *g,
                        order: mul_mat_id_order(g, 1),
                        act: &xg,
                        y: yg,
                    });
                    jobs.push(MatvecJob {
                        w: *u,
                        order: mul_mat_id_order(u, 1),
                        act: &xu,
                        y: yu,
                    });
                }
                let _span = profile::span(profile::typed("moe.decode gate+up", gates[0].ty));
                matvec_many(&mut jobs);
            }
            for (g, u) in gate.chunks_mut(n_ff).zip(up.chunks(n_ff)) {
                set.activate(g, u);
            }
            (gate, n_ff)
        }
        Proj::Fused(gate_up) => {
            let mats: Vec<_> = route.iter().map(|&(e, _)| mats(gate_up, e)).collect();
            let width = mats[0].rows;
            let n_ff = width / 2;
            let mut gu = vec![0f32; k * width];
            {
                let xq = quantized(&mats[0], &x.data);
                let mut jobs: Vec<MatvecJob<'_, '_>> = mats
                    .iter()
                    .zip(gu.chunks_mut(width))
                    .map(|(m, y)| MatvecJob {
                        w: *m,
                        order: mul_mat_id_order(m, 1),
                        act: &xq,
                        y,
                    })
                    .collect();
                let _span = profile::span(profile::typed("moe.decode gate_up", mats[0].ty));
                matvec_many(&mut jobs);
            }
            let mut hidden = Vec::with_capacity(k * n_ff);
            for row in gu.chunks_mut(width) {
                let (g, u) = row.split_at_mut(n_ff);
                set.activate(g, u);
                hidden.extend_from_slice(g);
            }
            (hidden, n_ff)
        }
    };
    let downs: Vec<_> = route.iter().map(|&(e, _)| mats(set.down, e)).collect();
    // [k, n_embd].
    let mut down = vec![0f32; k * n_embd];
    {
        let hidden: Vec<Vec<u8>> = downs
            .iter()
            .zip(hidden.chunks(n_ff))
            .map(|(d, h)| quantized(d, h))
            .collect();
        let mut jobs: Vec<MatvecJob<'_, '_>> = downs
            .iter()
            .zip(&hidden)
            .zip(down.chunks_mut(n_embd))
            .map(|((d, h), y)| MatvecJob {
                w: *d,
                order: mul_mat_id_order(d, 1),
                act: h,
                y,
            })
            .collect();
        let _span = profile::span(profile::typed("moe.decode down", downs[0].ty));
        matvec_many(&mut jobs);
    }
    let mut out = Mat::zeros(1, n_embd);
    for (&(e, weight), y) in route.iter().zip(down.chunks_mut(n_embd)) {
        if let Some(s) = set.scale(e as usize) {
            y.iter_mut().for_each(|v| *v *= s);
        }
        out.data
            .iter_mut()
            .zip(&*y)
            .for_each(|(a, b)| *a += weight * b);
    }
    out
}

/// `gate ← act(gate) ⊙ up`, as ggml computes the expert's gated unit.
pub(crate) fn activate(f: Unary, gate: &mut [f32], up: &[f32]) {
    match f {
        Unary::Silu => act::swiglu_ggml_rows(gate, up, gate.len()),
        Unary::Gelu => act::geglu_in_place(gate, up),
        f => gate
            .iter_mut()
            .zip(up)
            .for_each(|(g, u)| *g = apply_unary(f, *g) * u),
    }
}

/// The order llama.cpp's `MUL_MAT_ID` (AVX2 build) sums an expert's dot products in, for `rows_routed`
/// activation rows routed to it: weights it repacks go through the repacked gemv, one row at a time, which
/// is the format's single-row order (`None`); the K-quants it does not repack take the tiled matmul for 8
/// routed rows or more (Q4_K: [`unrepacked_order`]), as do IQ2_XS, IQ3_XXS and IQ4_XS; everything else
/// the single-row order.
pub fn mul_mat_id_order(m: &QuantMatrix<'_>, rows_routed: usize) -> Option<&'static BatchDot> {
    if llama_repacks(m.ty, m.rows) {
        return None;
    }
    if let Some(order) = unrepacked_order(m.ty, rows_routed) {
        return Some(order);
    }
    match m.ty {
        GgmlType::Q2_K
        | GgmlType::Q3_K
        | GgmlType::Q5_K
        | GgmlType::Q6_K
        | GgmlType::IQ2_XS
        | GgmlType::IQ3_XXS
        | GgmlType::IQ4_XS
            if rows_routed >= 8 =>
        {
            batch_dot(m.ty)
        }
        _ => None,
    }
}

/// `Y = X·Wᵀ` for expert matrix `m` as `MUL_MAT_ID` computes it ([`mul_mat_id_order`]; batch-invariant:
/// its order for one routed row, for every row).
fn expert_mul(m: &QuantMatrix<'_>, x: &Mat, arith: Arithmetic) -> Mat {
    assert_eq!(
        x.cols, m.cols,
        "moe: activation width differs from the expert's rows"
    );
    let _span = profile::span(profile::typed("moe.expert", m.ty));
    let mut y = Mat::zeros(x.rows, m.rows);
    let routed = match arith {
        Arithmetic::LlamaCpp => x.rows,
        Arithmetic::BatchInvariant => 1,
    };
    matmul_ordered(m, &x.data, x.rows, &mut y.data, mul_mat_id_order(m, routed));
    y
}

/// Expert `e` on the rows of `xs`: `down(act(gate·x) ⊙ up·x)`.
pub(crate) fn expert(w: &CpuWeights, m: &Moe, e: usize, xs: &Mat, arith: Arithmetic) -> Mat {
    expert_of(w, &ExpertSet::of_moe(m), e, xs, arith)
}

/// Expert `e` of `set` on the rows of `xs`: `down(act(gate·x) ⊙ up·x)`, times its scale when the set
/// has scales.
fn expert_of(w: &CpuWeights, set: &ExpertSet<'_>, e: usize, xs: &Mat, arith: Arithmetic) -> Mat {
    let hidden = match set.proj {
        Proj::Split { gate, up } => {
            let mut gate = expert_mul(&w.sub_matrix(gate, e), xs, arith);
            let up = expert_mul(&w.sub_matrix(up, e), xs, arith);
            let cols = gate.cols;
            for (g, u) in gate.data.chunks_mut(cols).zip(up.data.chunks(cols)) {
                set.activate(g, u);
            }
            gate
        }
        Proj::Fused(gate_up) => {
            let mut gu = expert_mul(&w.sub_matrix(gate_up, e), xs, arith);
            let (width, n_ff) = (gu.cols, gu.cols / 2);
            let mut hidden = Mat::zeros(xs.rows, n_ff);
            for (row, h) in gu.data.chunks_mut(width).zip(hidden.data.chunks_mut(n_ff)) {
                let (g, u) = row.split_at_mut(n_ff);
                set.activate(g, u);
                h.copy_from_slice(g);
            }
            hidden
        }
    };
    let mut y = expert_mul(&w.sub_matrix(set.down, e), &hidden, arith);
    if let Some(s) = set.scale(e) {
        y.data.iter_mut().for_each(|v| *v *= s);
    }
    y
}

/// Routings counted per (layer, expert) over the forward calls that were given it: the measured skew of a
/// model's routing on the CPU ([`top_tenth_share`]). One lock and one pass over the call's routes per MoE
/// layer and call, beside the layer's matrix products.
#[derive(Debug, Default)]
pub struct RouteCounts(Mutex<Vec<Vec<u64>>>);

impl RouteCounts {
    /// Adds `routes` (each token's (expert, weight) list) of MoE layer `layer` of `n_expert` experts.
    pub fn record(&self, layer: usize, n_expert: usize, routes: &[Vec<(u32, f32)>]) {
        // A panic elsewhere while counting leaves counts that are still counts.
        let mut c = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if c.len() <= layer {
            c.resize(layer + 1, Vec::new());
        }
        let layer = &mut c[layer];
        if layer.len() < n_expert {
            layer.resize(n_expert, 0);
        }
        for &(e, _) in routes.iter().flatten() {
            if let Some(n) = layer.get_mut(e as usize) {
                *n += 1;
            }
        }
    }

    /// `[layer][expert]` routings so far (an empty row for a layer without experts).
    pub fn counts(&self) -> Vec<Vec<u64>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Forgets the counts.
    pub fn reset(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// The share of `counts` (`[layer][expert]`) in each layer's most-counted tenth of experts (rounded up):
/// 0.1 for perfectly even routing (plus the sampling noise of few routings), 0 before any.
pub fn top_tenth_share(counts: &[Vec<u64>]) -> f64 {
    let (mut top, mut all) = (0u64, 0u64);
    for layer in counts {
        let mut c = layer.clone();
        c.sort_unstable_by(|a, b| b.cmp(a));
        top += c.iter().take(c.len().div_ceil(10)).sum::<u64>();
        all += c.iter().sum::<u64>();
    }
    if all == 0 {
        0.0
    } else {
        top as f64 / all as f64
    }
}
