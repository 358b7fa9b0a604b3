//! The k-pool sparse-attention indexer (DeepSeek's DSA indexer in GLM5-Next's pooled form): the cache
//! positions are cut into pools of `kpool` consecutive cells, each complete pool gets one key (a
//! per-channel softmax-weighted sum of its members' keys), a query scores every complete pool it can see
//! and keeps the best ones; the cells of those pools, and optionally those of its own incomplete pool,
//! are all it attends to.

/// The shape of an indexer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KPoolShape {
    /// Query heads.
    pub n_head: usize,
    /// Key size.
    pub head_dim: usize,
    /// Cells per pool.
    pub kpool: usize,
    /// Pools a query keeps.
    pub top_pools: usize,
    /// A query also sees the cells of its own incomplete pool.
    pub select_tail: bool,
}

impl KPoolShape {
    /// Most cells one query selects.
    pub fn max_cells(&self) -> usize {
        self.top_pools * self.kpool + if self.select_tail { self.kpool - 1 } else { 0 }
    }
}

fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// The keys of the complete pools among `n_cells` cells: `keys` and `gates` are `[n_cells, head_dim]`,
/// `ape` `[kpool, head_dim]` (the pool position bias). Pool `p`'s key, channel `d`:
/// `Σ_m softmax_m(gate[m][d] + ape[m][d]) · key[m][d]` over its members `m` (cells `p·kpool + m`),
/// rounded to f16 as a cache of f16 rows holds it. Returns `[n_cells / kpool, head_dim]`.
pub fn pool_keys(
    keys: &[f32],
    gates: &[f32],
    ape: &[f32],
    kpool: usize,
    head_dim: usize,
) -> Vec<f32> {
    assert!(kpool > 0 && head_dim > 0, "pool_keys: empty shape");
    assert_eq!(keys.len(), gates.len(), "pool_keys: keys and gates differ");
    assert_eq!(
        ape.len(),
        kpool * head_dim,
        "pool_keys: ape has the wrong length"
    );
    let n_pool = keys.len() / head_dim / kpool;
    let mut out = vec![0f32; n_pool * head_dim];
    let mut logits = vec![0f32; kpool];
    for (p, o) in out.chunks_exact_mut(head_dim).enumerate() {
        for (d, o) in o.iter_mut().enumerate() {
            for (m, l) in logits.iter_mut().enumerate() {
                *l = gates[(p * kpool + m) * head_dim + d] + ape[m * head_dim + d];
            }
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f64;
            for l in logits.iter_mut() {
                *l = (*l - max).exp();
                sum += *l as f64;
            }
            let inv = (1.0 / sum) as f32;
            let acc: f32 = (0..kpool)
                .map(|m| logits[m] * inv * keys[(p * kpool + m) * head_dim + d])
                .sum();
            *o = round_f16(acc);
        }
    }
    out
}

/// Where the pooled keys are: pool `p`'s key is `data[p·stride + offset ..][..head_dim]` ([`pool_keys`]'
/// output is `(data, head_dim, 0)`; a cache that keeps each pool's key in its last cell's row has its own
/// stride and offset).
#[derive(Clone, Copy, Debug)]
pub struct PooledKeys<'a> {
    pub data: &'a [f32],
    pub stride: usize,
    pub offset: usize,
}

/// The cells a query at position `pos` attends to, in the slots llama.cpp gathers them into
/// (`max_cells` of them, −1 for a slot its mask kills): its best `top_pools` complete pools (those ending
/// at or before `pos`; all of them when there are no more), scored as `Σ_h relu(q_h · pool) · w[h]`
/// (`q` `[n_head, head_dim]`, `w` `[n_head]`; among equal scores at the cut those ggml's `top_k` keeps:
/// [`super::topk::top_k_partial_sort`]), in descending score (equal scores by pool), each pool's cells
/// in order, then −1 up to `top_pools` pools; with `select_tail` then the cells of its own incomplete
/// pool from `pos` backwards, −1 for the rest of the `kpool − 1` tail slots. `pooled` holds at least the
/// pools `pos` can see.
pub fn select_slots(
    q: &[f32],
    w: &[f32],
    pooled: PooledKeys<'_>,
    pos: usize,
    s: &KPoolShape,
) -> Vec<i64> {
    let (kp, dim) = (s.kpool, s.head_dim);
    assert_eq!(
        q.len(),
        s.n_head * dim,
        "select_slots: q has the wrong length"
    );
    assert_eq!(w.len(), s.n_head, "select_slots: w has the wrong length");
    let visible = (pos + 1) / kp;
    assert!(
        visible == 0 || (visible - 1) * pooled.stride + pooled.offset + dim <= pooled.data.len(),
        "select_slots: pools missing"
    );
    let scores: Vec<f32> = (0..visible)
        .map(|p| {
            let key = &pooled.data[p * pooled.stride + pooled.offset..][..dim];
            q.chunks_exact(dim)
                .zip(w)
                .map(|(qh, &wh)| super::dot(qh, key).max(0.0) * wh)
                .sum()
        })
        .collect();
    // llama.cpp's choice among equal scores at the cut (an all-zero relu score is common), then its
    // order: the chosen pools by descending score.
    let mut pools = super::topk::top_k_partial_sort(&scores, s.top_pools);
    pools.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut slots = Vec::with_capacity(s.max_cells());
    for &p in &pools {
        slots.extend((p * kp..(p + 1) * kp).map(|c| c as i64));
    }
    slots.resize(s.top_pools * kp, -1);
    if s.select_tail {
        let n_tail = (pos + 1) % kp;
        slots.extend((0..kp - 1).map(|k| if k < n_tail { (pos - k) as i64 } else { -1 }));
    }
    slots
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_with_equal_gates_is_the_mean_of_its_keys() {
        let (kp, dim) = (2, 3);
        let keys = [1.0f32, 2.0, 3.0, 3.0, 4.0, 5.0, 9.0, 9.0, 9.0];
        let gates = [0f32; 9];
        let pooled = pool_keys(&keys, &gates, &[0.0; 6], kp, dim);
        assert_eq!(pooled, vec![2.0, 3.0, 4.0]);
    }

    #[test]
    fn a_query_keeps_its_best_visible_pools_and_its_tail() {
        let s = KPoolShape {
            n_head: 1,
            head_dim: 1,
            kpool: 2,
            top_pools: 2,
            select_tail: true,
        };
        // Pools 0, 1, 2 with keys 1, 3, 2; one head of weight 1, query 1.
        let pooled = PooledKeys {
            data: &[1.0f32, 3.0, 2.0],
            stride: 1,
            offset: 0,
        };
        let sel = |pos| select_slots(&[1.0], &[1.0], pooled, pos, &s);
        // At position 4 pools 0 and 1 are complete: both, the better first; cell 4 is the tail.
        assert_eq!(sel(4), vec![2, 3, 0, 1, 4]);
        // At position 5 pool 2 completes: pools 1 and 2 win; no tail.
        assert_eq!(sel(5), vec![2, 3, 4, 5, -1]);
        // At position 1 the only pool is visible, the other slots dead.
        assert_eq!(sel(1), vec![0, 1, -1, -1, -1]);
        // At position 0 only the tail.
        assert_eq!(sel(0), vec![-1, -1, -1, -1, 0]);
        assert_eq!(s.max_cells(), 5);
    }
}
