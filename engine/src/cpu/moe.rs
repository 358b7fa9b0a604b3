//! The mixture-of-experts block on the CPU, as llama.cpp's `build_moe_ffn` computes it: router logits,
//! probabilities (softmax or sigmoid), the top-k experts per token, their weights (renormalized and
//! scaled when asked), then each chosen expert's `down(act(gate·x) ⊙ up·x)` summed with those weights.
//!
//! Tokens are grouped by expert, so each expert's three matrices (sub-matrices of the `*_exps` tensors)
//! stream once per call for all the tokens routed to it; experts run in parallel. A token's expert outputs
//! are summed in its routing order, so its result does not depend on the rest of the batch.
//!
//! The arithmetic is llama.cpp's CPU backend's: the router is an ordinary matrix product ([`super::mat_mul`]),
//! routing is [`route`] (ggml's softmax, f64 sum, division), the expert products take the order of
//! ggml's `MUL_MAT_ID` ([`mul_mat_id_order`]), SwiGLU is ggml's vectorized one. [`moe_with`] takes
//! [`Arithmetic::BatchInvariant`]'s orders instead.

use poly_kernels::matmul::matmul_ordered;
use poly_kernels::matmul::QuantMatrix;
use poly_kernels::ops::act;
use poly_kernels::ops::topk::{route, Gating as KGating};
use poly_kernels::quant::{batch_dot, unrepacked_order, BatchDot, GgmlType};
use poly_models::compute::{Gating, Moe, Unary};
use rayon::prelude::*;

use super::{apply_unary, llama_repacks, mat_mul_with, Arithmetic, CpuWeights, Mat};

/// The block's output for `x` (`[n, n_embd]`), in llama.cpp's orders.
pub fn moe(w: &CpuWeights, x: &Mat, m: &Moe) -> Mat {
    moe_with(w, x, m, Arithmetic::LlamaCpp)
}

/// The block's output for `x` (`[n, n_embd]`) in the orders `arith` chooses. Batch-invariant: the
/// router and every expert product in the order of one routed row, so a token's result depends neither
/// on how many tokens the call has nor on how many of them share its experts.
pub fn moe_with(w: &CpuWeights, x: &Mat, m: &Moe, arith: Arithmetic) -> Mat {
    let (n, n_embd) = (x.rows, x.cols);
    let k = m.n_expert_used;
    let mut out = Mat::zeros(n, n_embd);
    if n == 0 || k == 0 {
        return out;
    }
    let logits = mat_mul_with(&w.matrix(m.router), x, arith);
    assert_eq!(
        logits.cols, m.n_expert,
        "moe: router width differs from n_expert"
    );
    let gating = match m.gating {
        Gating::Softmax => KGating::Softmax,
        Gating::Sigmoid => KGating::Sigmoid,
    };
    let routes: Vec<Vec<(u32, f32)>> = (0..n)
        .map(|t| route(logits.row(t), gating, k, m.norm_weights, m.weights_scale))
        .collect();

    // For every expert, the (token, slot) pairs routed to it.
    let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); m.n_expert];
    for (t, r) in routes.iter().enumerate() {
        for (slot, &(e, _)) in r.iter().enumerate() {
            by_expert[e as usize].push((t, slot));
        }
    }
    let active: Vec<usize> = (0..m.n_expert)
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
            expert(w, m, e, &xs, arith)
        })
        .collect();

    // Each token's expert outputs, by routing slot, then summed in slot order.
    let mut slots = vec![0f32; n * k * n_embd];
    for (&e, y) in active.iter().zip(&outputs) {
        for (i, &(t, slot)) in by_expert[e].iter().enumerate() {
            slots[(t * k + slot) * n_embd..][..n_embd].copy_from_slice(y.row(i));
        }
    }
    for (t, r) in routes.iter().enumerate() {
        let o = out.row_mut(t);
        for (slot, &(_, weight)) in r.iter().enumerate() {
            let y = &slots[(t * k + slot) * n_embd..][..n_embd];
            o.iter_mut().zip(y).for_each(|(a, b)| *a += weight * b);
        }
    }
    out
}

/// The order llama.cpp's `MUL_MAT_ID` (AVX2 build) sums an expert's dot products in, for `rows_routed`
/// activation rows routed to it: weights it repacks go through the repacked gemv, one row at a time, which
/// is the format's single-row order (`None`); the K-quants it does not repack take the tiled matmul for 8
/// routed rows or more (Q4_K: [`unrepacked_order`]); everything else the single-row order.
pub fn mul_mat_id_order(m: &QuantMatrix<'_>, rows_routed: usize) -> Option<&'static BatchDot> {
    if llama_repacks(m.ty, m.rows) {
        return None;
    }
    if let Some(order) = unrepacked_order(m.ty, rows_routed) {
        return Some(order);
    }
    match m.ty {
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q5_K | GgmlType::Q6_K if rows_routed >= 8 => {
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
    let mut gate = expert_mul(&w.sub_matrix(m.gate_exps, e), xs, arith);
    let up = expert_mul(&w.sub_matrix(m.up_exps, e), xs, arith);
    match m.act {
        Unary::Silu => act::swiglu_ggml_rows(&mut gate.data, &up.data, gate.cols),
        Unary::Gelu => act::geglu_in_place(&mut gate.data, &up.data),
        f => gate
            .data
            .iter_mut()
            .zip(&up.data)
            .for_each(|(g, u)| *g = apply_unary(f, *g) * u),
    }
    expert_mul(&w.sub_matrix(m.down_exps, e), &gate, arith)
}
