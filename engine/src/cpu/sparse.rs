//! The CPU's bodies of the operations only it runs ([`Compute::layer_norm`], the hyper-connection
//! streams, per-head products, the k-pool indexer and attention over the cells it selects), in
//! llama.cpp's CPU arithmetic (its glm5-next witness matches to the references' precision). Each works
//! row by row except attention over the selected cells, which, as llama.cpp's, takes one form for calls
//! of at most 16 tokens and another for larger ones; in batch-invariant arithmetic it takes the first
//! always, so a conversation read in several calls gives, bit for bit, what one call gives.
//!
//! [`Compute::layer_norm`]: poly_models::compute::Compute::layer_norm

use std::ops::Range;

use poly_kernels::ops::{attention, hyper, indexer, norm, recurrent};
use poly_models::compute::{Attention, HyperConnection, KPoolIndexer, WeightId};

use super::{par_rows_map, rows_of, CpuWeights, Mat};
use crate::state::{KvPrecision, LayerState, SeqState};

/// `(x − mean)/sqrt(var + eps) ⊙ weight + bias` over each row.
pub(super) fn layer_norm(
    w: &CpuWeights,
    x: &Mat,
    (weight, bias): (Option<WeightId>, Option<WeightId>),
    eps: f32,
) -> Mat {
    let (weight, bias) = (weight.map(|id| w.f32(id)), bias.map(|id| w.f32(id)));
    let mut out = Mat::zeros(x.rows, x.cols);
    par_rows_map(&x.data, x.cols, &mut out.data, x.cols, |_, x, o| {
        norm::layer_norm(x, x.len(), (weight, bias), eps, o)
    });
    out
}

/// Each row's block input and mixing weights ([`poly_models::compute::Compute::hc_pre`]).
pub(super) fn hc_pre(w: &CpuWeights, streams: &Mat, mix: &Mat, hc: &HyperConnection) -> (Mat, Mat) {
    let (scale, base) = (w.f32(hc.scale), w.f32(hc.base));
    let n_mix = (2 + hc.hc) * hc.hc;
    assert!(
        mix.cols == n_mix && mix.rows == streams.rows && streams.cols.is_multiple_of(hc.hc),
        "hc_pre: the streams and mixes do not fit {} streams",
        hc.hc
    );
    let mut weights = Mat::zeros(mix.rows, n_mix);
    let shape = (hc.hc, hc.sinkhorn_iters, hc.eps);
    par_rows_map(&mix.data, n_mix, &mut weights.data, n_mix, |_, m, o| {
        hyper::hc_weights(m, scale, base, shape, o)
    });
    let n_embd = streams.cols / hc.hc;
    let mut x = Mat::zeros(streams.rows, n_embd);
    par_rows_map(
        &streams.data,
        streams.cols,
        &mut x.data,
        n_embd,
        |r, s, o| hyper::hc_pre(s, &weights.row(r)[..hc.hc], o),
    );
    (x, weights)
}

/// Each row's new streams ([`poly_models::compute::Compute::hc_post`]).
pub(super) fn hc_post(x: &Mat, streams: &Mat, weights: &Mat) -> Mat {
    let hc = streams.cols / x.cols.max(1);
    assert!(
        x.rows == streams.rows && weights.rows == x.rows && weights.cols == (2 + hc) * hc,
        "hc_post: shapes differ"
    );
    let mut out = Mat::zeros(streams.rows, streams.cols);
    par_rows_map(
        &streams.data,
        streams.cols,
        &mut out.data,
        streams.cols,
        |r, s, o| hyper::hc_post(x.row(r), s, &weights.row(r)[hc..], o),
    );
    out
}

/// Head `h` of each row times head `h`'s matrix of `w` (`[in, out, n_head]`).
pub(super) fn matmul_heads(w: &CpuWeights, id: WeightId, x: &Mat) -> Mat {
    let info = w.info(id);
    let dim = |i: usize| info.dims.get(i).copied().unwrap_or(1) as usize;
    let (n_in, n_out, n_head) = (dim(0), dim(1), dim(2));
    assert_eq!(
        x.cols,
        n_in * n_head,
        "matmul_heads: the activation is not n_head rows of the matrices' width"
    );
    let m = w.f32(id);
    let mut out = Mat::zeros(x.rows, n_out * n_head);
    par_rows_map(&x.data, x.cols, &mut out.data, n_out * n_head, |_, x, o| {
        // Each head's product as ggml's F32 mul_mat computes it for a permuted (non-contiguous)
        // activation: every output one ggml_vec_dot_f32, whatever the row count.
        for h in 0..n_head {
            recurrent::dot_rows_ggml(
                &m[h * n_out * n_in..(h + 1) * n_out * n_in],
                n_in,
                &x[h * n_in..(h + 1) * n_in],
                &mut o[h * n_out..(h + 1) * n_out],
            );
        }
    });
    out
}

/// The KV cache of `layer` in `state`, after appending `k` and `v` (`op` names the operation for the
/// panics a wrong state deserves; the graph's own layer states make them unreachable).
fn extend_cache<'s>(
    state: &'s mut SeqState,
    layer: usize,
    (k, v): (&[f32], &[f32]),
    op: &str,
) -> &'s crate::state::KvCache {
    let pos0 = state.n_past();
    let LayerState::Kv(cache) = state.layer_mut(layer) else {
        panic!("{op} on layer {layer}, whose state is not a cache");
    };
    assert_eq!(
        cache.len(),
        pos0,
        "{op}: layer {layer}'s cache is not at the batch's position"
    );
    assert_ne!(
        cache.precision,
        KvPrecision::Q8_0,
        "{op}: Q8_0 caches are refused at load for this graph"
    );
    cache.append(k, v);
    cache
}

/// The states of one call, each with the rows of the call it reads.
pub(super) type Seqs<'s, 'a> = &'s mut [(&'a mut SeqState, Range<usize>)];

/// [`poly_models::compute::Compute::kpool_select`] for every state of the call. The indexer's cache row
/// of a cell is its key then, in the last cell of a pool, that pool's key (zeros elsewhere), and its gate
/// as the value: a pool's key is computed once, when the call that completes it appends its last cell
/// (from its members' rows as the cache holds them), so a decoded token reads the pooled keys instead
/// of pooling the whole context again, and cutting the cache cuts the pools with it.
pub(super) fn kpool_select(
    w: &CpuWeights,
    seqs: Seqs<'_, '_>,
    positions: &[u32],
    layer: usize,
    (q, k, gate, wts): (&Mat, &Mat, &Mat, &Mat),
    idx: &KPoolIndexer,
) -> Mat {
    let shape = indexer::KPoolShape {
        n_head: idx.n_head,
        head_dim: idx.head_dim,
        kpool: idx.kpool,
        top_pools: idx.top_k / idx.kpool,
        select_tail: idx.select_tail,
    };
    let (dim, kp) = (idx.head_dim, idx.kpool);
    let width = shape.max_cells();
    let ape = w.f32(idx.ape);
    let mut out = Mat::from_vec(q.rows, width, vec![-1.0; q.rows * width]);
    for (state, rows) in seqs.iter_mut() {
        let pos0 = state.n_past();
        let LayerState::Kv(cache) = state.layer_mut(layer) else {
            panic!("kpool_select on layer {layer}, whose state is not a cache");
        };
        assert_eq!(
            cache.len(),
            pos0,
            "kpool_select: layer {layer}'s cache is not at the batch's position"
        );
        assert!(
            cache.precision != KvPrecision::Q8_0 && cache.head_dim_k == 2 * dim,
            "kpool_select: layer {layer}'s cache is not an f16/f32 cache of key and pooled key"
        );
        let round = |x: &f32| match cache.precision {
            KvPrecision::F16 => half::f16::from_f32(*x).to_f32(),
            _ => *x,
        };
        // The members of the pool in progress (cached), then the batch's rows as the cache will hold
        // them: the pools this call completes.
        let start = pos0 - pos0 % kp;
        let n = rows.len();
        let mut keys = Vec::with_capacity((pos0 + n - start) * dim);
        let mut gates = Vec::with_capacity(keys.capacity());
        for c in start..pos0 {
            keys.extend_from_slice(&cache.keys()[c * 2 * dim..][..dim]);
            gates.extend_from_slice(&cache.values()[c * dim..][..dim]);
        }
        keys.extend(rows_of(k, rows).iter().map(round));
        gates.extend(rows_of(gate, rows).iter().map(round));
        let completed = indexer::pool_keys(&keys, &gates, ape, kp, dim);
        let mut krows = vec![0f32; n * 2 * dim];
        for (i, row) in krows.chunks_exact_mut(2 * dim).enumerate() {
            row[..dim].copy_from_slice(&keys[(pos0 - start + i) * dim..][..dim]);
        }
        for (j, pooled) in completed.chunks_exact(dim).enumerate() {
            // Its last cell is in this call: the pool in progress was incomplete before it.
            let i = start + j * kp + kp - 1 - pos0;
            krows[i * 2 * dim + dim..(i + 1) * 2 * dim].copy_from_slice(pooled);
        }
        cache.append(&krows, &gates[(pos0 - start) * dim..]);
        let pooled = indexer::PooledKeys {
            data: cache.keys(),
            stride: kp * 2 * dim,
            offset: (kp - 1) * 2 * dim + dim,
        };
        let dst = &mut out.data[rows.start * width..rows.end * width];
        par_rows_map(rows_of(q, rows), q.cols, dst, width, |r, qr, o| {
            let i = rows.start + r;
            let pos = positions[i] as usize;
            let slots = indexer::select_slots(qr, wts.row(i), pooled, pos, &shape);
            for (o, c) in o.iter_mut().zip(slots) {
                *o = c as f32;
            }
        });
    }
    out
}

/// Calls of at most this many tokens take llama.cpp's gathered path (`build_inp_kpool`'s `max_ub`),
/// larger ones its masked flash attention.
const GATHER_MAX_TOKENS: usize = 16;

/// [`poly_models::compute::Compute::attention_cells`] for every state of the call, in llama.cpp's
/// arithmetic: a state reading at most 16 tokens (every state, in batch-invariant arithmetic, so a
/// prompt read in any split computes as decoding does) attends over its gathered slots, a larger read
/// takes the flash attention over the f16 cache with the unselected cells masked.
pub(super) fn attention_cells(
    seqs: Seqs<'_, '_>,
    layer: usize,
    (q, k, v): (&Mat, &Mat, &Mat),
    a: &Attention,
    sel: &Mat,
    arithmetic: super::Arithmetic,
) -> Mat {
    assert_eq!(sel.rows, q.rows, "attention_cells: a selection per row");
    let p = attention::AttnParams {
        n_head: a.n_head,
        n_head_kv: a.n_head_kv,
        head_dim_k: a.head_dim_k,
        head_dim_v: a.head_dim_v,
        scale: a.scale,
        window: a.window,
        softcap: a.softcap,
        sees_together: None,
    };
    let width = a.n_head * a.head_dim_v;
    let mut out = Mat::zeros(q.rows, width);
    for (state, rows) in seqs.iter_mut() {
        let pos0 = state.n_past() as u32;
        let cache = extend_cache(
            state,
            layer,
            (rows_of(k, rows), rows_of(v, rows)),
            "attention_cells",
        );
        let dst = &mut out.data[rows.start * width..rows.end * width];
        if arithmetic == super::Arithmetic::BatchInvariant || rows.len() <= GATHER_MAX_TOKENS {
            let slots: Vec<i64> = rows_of(sel, rows).iter().map(|&c| c as i64).collect();
            attention::attention_gathered_ggml(
                rows_of(q, rows),
                (&slots, sel.cols),
                cache.keys(),
                cache.values(),
                &p,
                dst,
            );
            continue;
        }
        // The mask's live cells of each query, ascending.
        let mut cells = Vec::new();
        let mut offsets = vec![0];
        for r in rows.clone() {
            let at = cells.len();
            cells.extend(sel.row(r).iter().filter(|&&c| c >= 0.0).map(|&c| c as u32));
            cells[at..].sort_unstable();
            offsets.push(cells.len());
        }
        let positions: Vec<u32> = (0..rows.len() as u32).map(|i| pos0 + i).collect();
        attention::attention_ggml_f16_cells(
            rows_of(q, rows),
            &positions,
            (&cells, &offsets),
            cache.keys(),
            cache.values(),
            &p,
            dst,
        );
    }
    out
}
