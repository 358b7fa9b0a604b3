//! Attention in which every query sees every key: a vision encoder's patches. Per head it is two matrix
//! products on the f32 matrix kernels ([`crate::matmul::matmul_ordered`]), `S = Q·Kᵀ` and `O = softmax(S)·V`,
//! instead of [`super::attention`]'s walk over the keys one query at a time: the key and value rows of a
//! head are read once per block of queries rather than once per query, so a picture of a thousand
//! patches is bounded by the products, not by strided reads.
//!
//! Queries go in blocks of [`QUERY_BLOCK`] rows, so the scores of a block (`QUERY_BLOCK × n` floats) stay
//! small however large the picture.

use super::AttnParams;
use crate::matmul::{matmul_ordered, QuantMatrix};
use crate::ops::softmax::softmax_ggml;
use crate::quant::{f32_tinyblas_order, GgmlType};
use rayon::prelude::*;

/// Queries whose scores are held at once, per head.
pub const QUERY_BLOCK: usize = 256;

/// `out[i, h] = Σ_j softmax_j(s_ij) · v[j, h_kv]` with `s_ij = scale · q[i, h]·k[j, h_kv]` over all `n`
/// keys for every query (no positions, no window); shapes as [`super::attention`]'s with `n` queries
/// and `n` keys.
pub fn attention_full(q: &[f32], k: &[f32], v: &[f32], n: usize, p: &AttnParams, out: &mut [f32]) {
    let (dk, dv) = (p.head_dim_k, p.head_dim_v);
    assert!(
        p.n_head > 0 && p.n_head_kv > 0 && p.n_head.is_multiple_of(p.n_head_kv) && dk > 0 && dv > 0,
        "attention_full: bad head counts"
    );
    assert!(
        p.window.is_none(),
        "attention_full: every query sees every key"
    );
    assert_eq!(
        q.len(),
        n * p.n_head * dk,
        "attention_full: q has the wrong length"
    );
    assert_eq!(
        k.len(),
        n * p.n_head_kv * dk,
        "attention_full: k has the wrong length"
    );
    assert_eq!(
        v.len(),
        n * p.n_head_kv * dv,
        "attention_full: v has the wrong length"
    );
    assert_eq!(
        out.len(),
        n * p.n_head * dv,
        "attention_full: out has the wrong length"
    );
    if n == 0 {
        return;
    }
    let group = p.n_head / p.n_head_kv;
    let (q_row, k_row, v_row, o_row) = (
        p.n_head * dk,
        p.n_head_kv * dk,
        p.n_head_kv * dv,
        p.n_head * dv,
    );
    // Each key/value head's keys `[n, dk]` and values transposed `[dv, n]`.
    let kv: Vec<(Vec<f32>, Vec<f32>)> = (0..p.n_head_kv)
        .into_par_iter()
        .map(|hk| {
            let mut keys = Vec::with_capacity(n * dk);
            for j in 0..n {
                keys.extend_from_slice(&k[j * k_row + hk * dk..][..dk]);
            }
            let mut values_t = vec![0f32; dv * n];
            for j in 0..n {
                for (d, &x) in v[j * v_row + hk * dv..][..dv].iter().enumerate() {
                    values_t[d * n + j] = x;
                }
            }
            (keys, values_t)
        })
        .collect();
    // (head, block of queries) tasks, each writing its own rows of its head's output.
    let blocks = n.div_ceil(QUERY_BLOCK);
    let results: Vec<(usize, usize, Vec<f32>)> = (0..p.n_head * blocks)
        .into_par_iter()
        .map(|task| {
            let (h, b) = (task / blocks, task % blocks);
            let (keys, values_t) = &kv[h / group];
            let first = b * QUERY_BLOCK;
            let rows = QUERY_BLOCK.min(n - first);
            let mut qh = Vec::with_capacity(rows * dk);
            for i in first..first + rows {
                qh.extend_from_slice(&q[i * q_row + h * dk..][..dk]);
            }
            let k_mat =
                QuantMatrix::new(GgmlType::F32, n, dk, as_bytes(keys)).expect("n rows of dk f32");
            let mut s = vec![0f32; rows * n];
            matmul_ordered(&k_mat, &qh, rows, &mut s, order(rows));
            for row in s.chunks_exact_mut(n) {
                softmax_scores(row, p);
            }
            let v_mat = QuantMatrix::new(GgmlType::F32, dv, n, as_bytes(values_t))
                .expect("dv rows of n f32");
            let mut o = vec![0f32; rows * dv];
            matmul_ordered(&v_mat, &s, rows, &mut o, order(rows));
            (h, first, o)
        })
        .collect();
    for (h, first, o) in results {
        for (r, o) in o.chunks_exact(dv).enumerate() {
            out[(first + r) * o_row + h * dv..][..dv].copy_from_slice(o);
        }
    }
}

/// `v`'s bytes, as an F32 matrix's data (little-endian: the matrix kernels read them as f32 again).
fn as_bytes(v: &[f32]) -> &[u8] {
    const { assert!(cfg!(target_endian = "little")) };
    // SAFETY: the slice covers exactly `v`'s memory, which lives as long as the borrow; every byte of an
    // f32 is initialized and u8 has no alignment requirement.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// The order of the f32 products: llamafile's tinyBLAS (four activation rows at once) for blocks of two
/// queries or more, as the engine's f32 products of batches.
fn order(rows: usize) -> Option<&'static crate::quant::BatchDot> {
    (rows >= 2).then(f32_tinyblas_order)
}

/// A row of raw `q·k` scores turned into softmax weights: scaled (and soft-capped), then
/// [`softmax_ggml`] (ggml's `soft_max`, which mtmd's encoders run without flash attention: the Qwen3.6
/// witness's F32 error 3.7e-5 → 2.0e-5 against the plain softmax, Gemma 4's unchanged).
fn softmax_scores(row: &mut [f32], p: &AttnParams) {
    for s in row.iter_mut() {
        *s *= p.scale;
        if let Some(cap) = p.softcap {
            *s = cap * (*s / cap).tanh();
        }
    }
    softmax_ggml(row);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::attention::attention;
    use crate::rng::Rng;

    /// Largest difference relative to the largest value.
    fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
            / scale
    }

    #[test]
    fn equals_the_causal_walk_with_every_query_at_the_last_position() {
        let mut rng = Rng::new(7);
        // Sizes across a query block's edge, grouped heads, head widths not a multiple of 8.
        for &(n, n_head, n_head_kv, dk, dv) in &[
            (1, 1, 1, 8, 8),
            (5, 2, 1, 12, 12),
            (QUERY_BLOCK + 3, 4, 2, 72, 72),
            (40, 3, 3, 16, 24),
        ] {
            let p = AttnParams {
                n_head,
                n_head_kv,
                head_dim_k: dk,
                head_dim_v: dv,
                scale: 1.0 / (dk as f32).sqrt(),
                window: None,
                softcap: None,
                sees_together: None,
            };
            let q: Vec<f32> = (0..n * n_head * dk).map(|_| rng.normal()).collect();
            let k: Vec<f32> = (0..n * n_head_kv * dk).map(|_| rng.normal()).collect();
            let v: Vec<f32> = (0..n * n_head_kv * dv).map(|_| rng.normal()).collect();
            let mut want = vec![0f32; n * n_head * dv];
            attention(&q, &vec![n as u32 - 1; n], &k, &v, &p, &mut want);
            let mut got = vec![f32::NAN; want.len()];
            attention_full(&q, &k, &v, n, &p, &mut got);
            let d = rel_diff(&got, &want);
            assert!(
                d < 1e-5,
                "n {n} heads {n_head}/{n_head_kv} dims {dk}/{dv}: {d}"
            );
        }
    }

    #[test]
    fn a_key_far_above_the_others_takes_all_the_weight() {
        // One key aligned with every query: each query's output is that key's value row.
        let (n, d) = (9, 8);
        let p = AttnParams {
            n_head: 1,
            n_head_kv: 1,
            head_dim_k: d,
            head_dim_v: d,
            scale: 1.0,
            window: None,
            softcap: None,
            sees_together: None,
        };
        let q = vec![1.0f32; n * d];
        let mut k = vec![0.0f32; n * d];
        k[4 * d..5 * d].fill(20.0);
        let v: Vec<f32> = (0..n * d).map(|i| i as f32).collect();
        let mut out = vec![0f32; n * d];
        attention_full(&q, &k, &v, n, &p, &mut out);
        for row in out.chunks_exact(d) {
            assert_eq!(row, &v[4 * d..5 * d]);
        }
    }
}
