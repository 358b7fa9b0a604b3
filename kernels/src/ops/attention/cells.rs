//! Attention over the cells a sparse-attention indexer selected (glm5-next's k-pool indexer), in
//! llama.cpp's two arithmetics for it: its masked flash attention over the f16 cache
//! ([`attention_ggml_f16_cells`]: the vector and tiled paths of the parent module, skipping the masked
//! cells) and, for calls of at most 16 tokens, its attention over the gathered cells
//! ([`attention_gathered_ggml`]: f32 `mul_mat`, softmax and `mul_mat`).

use rayon::prelude::*;

use super::{
    check_shapes, online_softmax, round_f16, tiled_task, vector_query, AttnParams, F16Steps,
    PortableF16, VectorQuery, GGML_FA_TILE_Q,
};
#[cfg(target_arch = "x86_64")]
use super::{tiled_task_fma, vector_query_fma};

/// llama.cpp's flash attention over an F16 cache where each query sees only the cells a mask leaves
/// (`cells[offsets[i]..offsets[i + 1]]`, ascending, within causality): the vector path of
/// [`super::attention_ggml_f16`] for fewer than [`GGML_FA_TILE_Q`] queries, the tiled path of
/// [`super::attention_ggml_f16_tiled`] from there, each skipping the masked cells as ggml's kernels do.
pub fn attention_ggml_f16_cells(
    q: &[f32],
    positions: &[u32],
    (cells, offsets): (&[u32], &[usize]),
    k: &[f32],
    v: &[f32],
    p: &AttnParams,
    out: &mut [f32],
) {
    let (dk, dv) = (p.head_dim_k, p.head_dim_v);
    check_shapes(q, positions, k, v, p, out);
    assert_eq!(
        offsets.len(),
        positions.len() + 1,
        "attention: one cell list per query"
    );
    let (k_row, v_row) = (p.n_head_kv * dk, p.n_head_kv * dv);
    let group = p.n_head / p.n_head_kv;
    let n_q = positions.len();
    if n_q >= GGML_FA_TILE_Q {
        let tasks: Vec<(usize, usize)> = (0..p.n_head)
            .flat_map(|h| (0..n_q).step_by(GGML_FA_TILE_Q).map(move |i0| (h, i0)))
            .collect();
        let mask = Some((cells, offsets));
        let results: Vec<Vec<f32>> = tasks
            .par_iter()
            .map(|&(h, i0)| {
                let rows = i0..(i0 + GGML_FA_TILE_Q).min(n_q);
                #[cfg(target_arch = "x86_64")]
                if crate::quant::has_avx2_fma() {
                    // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
                    return unsafe { tiled_task_fma(q, positions, k, v, p, h, rows, (mask, None)) };
                }
                tiled_task(q, positions, k, v, p, h, rows, (mask, None))
            })
            .collect();
        for (&(h, i0), res) in tasks.iter().zip(&results) {
            for (r, o) in res.chunks_exact(dv).enumerate() {
                out[((i0 + r) * p.n_head + h) * dv..][..dv].copy_from_slice(o);
            }
        }
        return;
    }
    out.par_chunks_mut(dv).enumerate().for_each_init(
        || (Vec::new(), Vec::new()),
        |(qh16, acc): &mut (Vec<f32>, Vec<f32>), (idx, o)| {
            let (i, h) = (idx / p.n_head, idx % p.n_head);
            let one = VectorQuery {
                q: &q[(i * p.n_head + h) * dk..][..dk],
                k: &k[(h / group) * dk..],
                v: &v[(h / group) * dv..],
                k_row,
                v_row,
                first: 0,
                last: positions[i] as usize,
                chunk: usize::MAX,
                split: false,
                cells: Some(&cells[offsets[i]..offsets[i + 1]]),
            };
            #[cfg(target_arch = "x86_64")]
            if crate::quant::has_avx2_fma() {
                // SAFETY: the CPU supports AVX2, FMA and F16C (checked at run time).
                return unsafe { vector_query_fma(&one, p, qh16, acc, o) };
            }
            vector_query::<PortableF16>(&one, p, qh16, acc, o);
        },
    );
}

/// llama.cpp's attention over gathered cells (its sparse-attention path for calls of at most 16
/// tokens): query `i` sees the `n_sel` slots `slots[i·n_sel..]`, a cell each or −1 for a slot its mask
/// kills, in that order. Per query and head, as ggml's F32 `mul_mat`, `soft_max_ext` and `mul_mat`
/// compute it: the query in f32, each slot's score one `ggml_vec_dot_f32` times `scale` (a dead slot
/// −∞), the softmax of [`crate::ops::softmax::softmax_ggml`] over the slots, each output value one
/// `ggml_vec_dot_f32` over the slots of the values and the weights (a dead slot's weight 0). A query
/// without live slots gets zeros.
pub fn attention_gathered_ggml(
    q: &[f32],
    (slots, n_sel): (&[i64], usize),
    k: &[f32],
    v: &[f32],
    p: &AttnParams,
    out: &mut [f32],
) {
    let (dk, dv) = (p.head_dim_k, p.head_dim_v);
    let n_q = slots.len() / n_sel.max(1);
    assert!(
        p.softcap.is_none() && n_sel > 0 && slots.len() == n_q * n_sel,
        "attention_gathered: slots are not n_sel per query, or a softcap"
    );
    assert_eq!(
        q.len(),
        n_q * p.n_head * dk,
        "attention_gathered: q has the wrong length"
    );
    assert_eq!(
        out.len(),
        n_q * p.n_head * dv,
        "attention_gathered: out has the wrong length"
    );
    let (k_row, v_row) = (p.n_head_kv * dk, p.n_head_kv * dv);
    let n_kv = k.len() / k_row.max(1);
    assert!(
        slots.iter().all(|&c| c < n_kv as i64),
        "attention_gathered: a cell is past the cache"
    );
    let group = p.n_head / p.n_head_kv;
    out.par_chunks_mut(dv).enumerate().for_each_init(
        || (Vec::new(), Vec::new()),
        |scratch: &mut (Vec<f32>, Vec<f32>), (idx, o)| {
            let (i, h) = (idx / p.n_head, idx % p.n_head);
            let hk = h / group;
            let one = Gathered {
                q: &q[(i * p.n_head + h) * dk..][..dk],
                slots: &slots[i * n_sel..(i + 1) * n_sel],
                k: &k[hk * dk..],
                v: &v[hk * dv..],
                k_row,
                v_row,
            };
            #[cfg(target_arch = "x86_64")]
            if crate::quant::has_avx2_fma() {
                // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
                return unsafe { gathered_query_fma(&one, p, scratch, o) };
            }
            gathered_query(&one, p, scratch, o)
        },
    );
}

/// One query and head of [`attention_gathered_ggml`].
struct Gathered<'a> {
    q: &'a [f32],
    slots: &'a [i64],
    k: &'a [f32],
    v: &'a [f32],
    k_row: usize,
    v_row: usize,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gathered_query_fma(
    one: &Gathered<'_>,
    p: &AttnParams,
    scratch: &mut (Vec<f32>, Vec<f32>),
    o: &mut [f32],
) {
    gathered_query(one, p, scratch, o)
}

/// `scratch`: the worker's buffers for the slots' weights and one value column (reused, not allocated per
/// query and head).
#[inline(always)]
fn gathered_query(
    one: &Gathered<'_>,
    p: &AttnParams,
    (w, col): &mut (Vec<f32>, Vec<f32>),
    o: &mut [f32],
) {
    use crate::ops::recurrent::dot_ggml;
    let dk = p.head_dim_k;
    w.clear();
    w.extend(one.slots.iter().map(|&c| match c {
        c if c >= 0 => dot_ggml(&one.k[c as usize * one.k_row..][..dk], one.q) * p.scale,
        _ => f32::NEG_INFINITY,
    }));
    if one.slots.iter().all(|&c| c < 0) {
        o.fill(0.0);
        return;
    }
    crate::ops::softmax::softmax_ggml(w);
    col.clear();
    col.resize(one.slots.len(), 0.0);
    for (d, y) in o.iter_mut().enumerate() {
        for (x, &c) in col.iter_mut().zip(one.slots) {
            *x = if c >= 0 {
                one.v[c as usize * one.v_row + d]
            } else {
                0.0
            };
        }
        *y = dot_ggml(col, w);
    }
}

/// llama.cpp's flash attention of one query and head with an attention sink (DeepSeek V4's), in its
/// vector path (calls of fewer than [`GGML_FA_TILE_Q`] queries): the query rounded to f16, the cells
/// `one.cells` in order with the f16 accumulator, then, on the accumulator widened to f32, the sink as a
/// logit without a value (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`'s `sinks`), and the
/// division by the sum. `o` gets the head's output.
pub fn attention_ggml_f16_cells_sink(
    (q, cells): (&[f32], &[u32]),
    (k, v, row): (&[f32], &[f32], usize),
    p: &AttnParams,
    sink: f32,
    o: &mut [f32],
) {
    assert!(
        p.n_head_kv == 1 && p.head_dim_k == row && p.head_dim_v == row && q.len() == row,
        "attention with a sink: one K/V head of the rows' width"
    );
    let one = VectorQuery {
        q,
        k,
        v,
        k_row: row,
        v_row: row,
        first: 0,
        last: usize::MAX,
        chunk: usize::MAX,
        split: false,
        cells: Some(cells),
    };
    let (mut qh16, mut acc) = (Vec::with_capacity(row), vec![0f32; row]);
    #[cfg(target_arch = "x86_64")]
    if crate::quant::has_avx2_fma() {
        // SAFETY: the CPU supports AVX2, FMA and F16C (checked at run time).
        return unsafe { sink_query_fma(&one, p, (&mut qh16, &mut acc), sink, o) };
    }
    sink_query::<PortableF16>(&one, p, (&mut qh16, &mut acc), sink, o);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sink_query_fma(
    one: &VectorQuery<'_>,
    p: &AttnParams,
    bufs: (&mut Vec<f32>, &mut Vec<f32>),
    sink: f32,
    o: &mut [f32],
) {
    sink_query::<super::x86_f16::F16c>(one, p, bufs, sink, o)
}

#[inline(always)]
fn sink_query<F: F16Steps>(
    one: &VectorQuery<'_>,
    p: &AttnParams,
    (qh16, acc): (&mut Vec<f32>, &mut Vec<f32>),
    sink: f32,
    o: &mut [f32],
) {
    qh16.clear();
    qh16.extend(one.q.iter().map(|&x| round_f16(x)));
    let cells = one.cells.unwrap_or(&[]);
    let (m, mut s) = online_softmax::<F>(one, p, qh16, acc, cells.iter().map(|&j| j as usize));
    // Unlike the loop's, GCC does not fuse this `S = S*ms + vs`: it moves `S*ms` into the branch
    // where the sink is the new maximum (vs = 1) and adds there, two roundings (the AVX2 + FMA
    // libggml-cpu: `vmulss` then `vaddss`); the other branch (ms = 1) adds exactly. The tiled path's
    // does fuse.
    if sink > m {
        let ms = (m - sink).exp();
        acc.iter_mut().for_each(|a| *a *= ms);
        s = s * ms + 1.0;
    } else {
        s += (sink - m).exp();
    }
    let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
    o.iter_mut().zip(acc.iter()).for_each(|(y, a)| *y = a * inv);
}

/// [`attention_ggml_f16_cells`]' tiled path (calls of [`GGML_FA_TILE_Q`] queries or more) with a sink
/// logit per head (`sinks`, `[n_head]`), as ggml's tiled flash attention applies it. Query `i` sees
/// `cells[offsets[i]..offsets[i + 1]]` (ascending) and `last[i]` is its last cell (`k`'s rows may hold
/// more than a cache: DeepSeek V4's compressed entries after its window, tile-aligned as llama.cpp's
/// concatenation of the caches aligns them).
pub fn attention_ggml_f16_cells_sinks_tiled(
    q: &[f32],
    (last, cells, offsets): (&[u32], &[u32], &[usize]),
    (k, v): (&[f32], &[f32]),
    p: &AttnParams,
    sinks: &[f32],
    out: &mut [f32],
) {
    let dv = p.head_dim_v;
    let n_q = last.len();
    assert!(
        offsets.len() == n_q + 1 && sinks.len() == p.n_head && out.len() == n_q * p.n_head * dv,
        "attention with sinks: one cell list per query, one sink per head"
    );
    let tasks: Vec<(usize, usize)> = (0..p.n_head)
        .flat_map(|h| (0..n_q).step_by(GGML_FA_TILE_Q).map(move |i0| (h, i0)))
        .collect();
    let mask = Some((cells, offsets));
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(h, i0)| {
            let rows = i0..(i0 + GGML_FA_TILE_Q).min(n_q);
            let m = (mask, Some(sinks[h]));
            #[cfg(target_arch = "x86_64")]
            if crate::quant::has_avx2_fma() {
                // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
                return unsafe { tiled_task_fma(q, last, k, v, p, h, rows, m) };
            }
            tiled_task(q, last, k, v, p, h, rows, m)
        })
        .collect();
    for (&(h, i0), res) in tasks.iter().zip(&results) {
        for (r, o) in res.chunks_exact(dv).enumerate() {
            out[((i0 + r) * p.n_head + h) * dv..][..dv].copy_from_slice(o);
        }
    }
}
