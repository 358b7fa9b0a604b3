//! Causal grouped-query attention of a block of queries over a key/value sequence.
//!
//! Keys and values are rows indexed by position (`k[j]` is position `j`), as a KV cache stores them; query
//! `i` sits at position `positions[i]` and sees the positions `j ≤ positions[i]` (and, with a sliding
//! window `w`, only `positions[i] - j < w`). Query head `h` reads key/value head `h / (n_head /
//! n_head_kv)`, as ggml broadcasts. Work is spread over (query, head) pairs with rayon.

use super::{axpy, dot};
use rayon::prelude::*;

/// The shape and options of an attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Multiplies `q·k`.
    pub scale: f32,
    /// Sliding window: a query at position `p` sees positions `> p - window`.
    pub window: Option<u32>,
    /// `cap·tanh(s/cap)` on the scaled scores `s` (as ggml's flash attention applies it).
    pub softcap: Option<f32>,
}

impl AttnParams {
    /// The first position a query at `pos` sees.
    #[inline]
    pub fn first_visible(&self, pos: u32) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w) as usize,
            None => 0,
        }
    }
}

/// `out[i, h] = Σ_j softmax_j(s_ij) · v[j, h_kv]` with `s_ij = scale · q[i, h]·k[j, h_kv]`.
///
/// `q` is `[n_q, n_head·head_dim_k]`, `k` `[n_kv, n_head_kv·head_dim_k]`, `v` `[n_kv,
/// n_head_kv·head_dim_v]`, `out` `[n_q, n_head·head_dim_v]`; every query position must be below `n_kv`.
pub fn attention(
    q: &[f32],
    positions: &[u32],
    k: &[f32],
    v: &[f32],
    p: &AttnParams,
    out: &mut [f32],
) {
    let (dk, dv) = (p.head_dim_k, p.head_dim_v);
    assert!(
        p.n_head > 0 && p.n_head_kv > 0 && p.n_head.is_multiple_of(p.n_head_kv) && dk > 0 && dv > 0,
        "attention: bad head counts"
    );
    let n_q = positions.len();
    assert_eq!(
        q.len(),
        n_q * p.n_head * dk,
        "attention: q has the wrong length"
    );
    assert_eq!(
        out.len(),
        n_q * p.n_head * dv,
        "attention: out has the wrong length"
    );
    let (k_row, v_row) = (p.n_head_kv * dk, p.n_head_kv * dv);
    assert_eq!(k.len() % k_row, 0, "attention: k is not whole rows");
    let n_kv = k.len() / k_row;
    assert_eq!(v.len(), n_kv * v_row, "attention: v has the wrong length");
    assert!(
        positions.iter().all(|&pos| (pos as usize) < n_kv),
        "attention: a query position is past the keys"
    );
    let group = p.n_head / p.n_head_kv;

    out.par_chunks_mut(dv).enumerate().for_each_init(
        Vec::new,
        |scores: &mut Vec<f32>, (idx, o)| {
            let (i, h) = (idx / p.n_head, idx % p.n_head);
            let hk = h / group;
            let pos = positions[i];
            let first = p.first_visible(pos);
            let last = pos as usize;
            let qh = &q[(i * p.n_head + h) * dk..][..dk];
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for j in first..=last {
                let mut s = p.scale * dot(qh, &k[j * k_row + hk * dk..][..dk]);
                if let Some(cap) = p.softcap {
                    s = cap * (s / cap).tanh();
                }
                max = max.max(s);
                scores.push(s);
            }
            o.fill(0.0);
            let mut sum = 0f32;
            for (j, s) in (first..=last).zip(scores.iter()) {
                let w = (s - max).exp();
                sum += w;
                axpy(w, &v[j * v_row + hk * dv..][..dv], o);
            }
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|x| *x *= inv);
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_diff, normals};
    use crate::rng::Rng;

    fn reference(q: &[f32], positions: &[u32], k: &[f32], v: &[f32], p: &AttnParams) -> Vec<f64> {
        let (dk, dv) = (p.head_dim_k, p.head_dim_v);
        let mut out = vec![0f64; positions.len() * p.n_head * dv];
        for (i, &pos) in positions.iter().enumerate() {
            for h in 0..p.n_head {
                let hk = h * p.n_head_kv / p.n_head;
                let mut s = Vec::new();
                for j in 0..=pos as usize {
                    if let Some(w) = p.window {
                        if pos as usize - j >= w as usize {
                            s.push(f64::NEG_INFINITY);
                            continue;
                        }
                    }
                    let mut d = 0f64;
                    for t in 0..dk {
                        d += q[(i * p.n_head + h) * dk + t] as f64
                            * k[(j * p.n_head_kv + hk) * dk + t] as f64;
                    }
                    let mut x = d * p.scale as f64;
                    if let Some(c) = p.softcap {
                        x = c as f64 * (x / c as f64).tanh();
                    }
                    s.push(x);
                }
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for (j, x) in s.iter().enumerate() {
                    let w = (x - m).exp() / z;
                    for t in 0..dv {
                        out[(i * p.n_head + h) * dv + t] +=
                            w * v[(j * p.n_head_kv + hk) * dv + t] as f64;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn attention_matches_f64_reference() {
        let mut rng = Rng::new(9);
        let n_kv = 40;
        for (n_head, n_head_kv, dk, dv, window, softcap) in [
            (4, 2, 16, 16, None, None),
            (6, 3, 8, 12, Some(5), None),
            (2, 2, 32, 8, None, Some(0.5)),
            (8, 1, 16, 16, Some(1), None),
        ] {
            let p = AttnParams {
                n_head,
                n_head_kv,
                head_dim_k: dk,
                head_dim_v: dv,
                scale: 1.0 / (dk as f32).sqrt(),
                window,
                softcap,
            };
            let k: Vec<f32> = normals(&mut rng, n_kv * n_head_kv * dk)
                .iter()
                .map(|x| x * 2.0)
                .collect();
            let v = normals(&mut rng, n_kv * n_head_kv * dv);
            let positions: Vec<u32> = (30..40).chain([0, 3]).collect();
            let q = normals(&mut rng, positions.len() * n_head * dk);
            let mut out = vec![0f32; positions.len() * n_head * dv];
            attention(&q, &positions, &k, &v, &p, &mut out);
            let expect = reference(&q, &positions, &k, &v, &p);
            assert!(max_diff(&out, &expect) < 1e-5, "{p:?}");
        }
    }

    #[test]
    fn a_query_reads_only_its_past() {
        // Keys past the query's position must not change its output.
        let mut rng = Rng::new(10);
        let p = AttnParams {
            n_head: 2,
            n_head_kv: 1,
            head_dim_k: 4,
            head_dim_v: 4,
            scale: 0.5,
            window: None,
            softcap: None,
        };
        let q = normals(&mut rng, 8);
        let mut k = normals(&mut rng, 4 * 10);
        let mut v = normals(&mut rng, 4 * 10);
        let mut a = vec![0f32; 8];
        attention(&q, &[5], &k, &v, &p, &mut a);
        for x in k[6 * 4..].iter_mut().chain(v[6 * 4..].iter_mut()) {
            *x = 100.0;
        }
        let mut b = vec![0f32; 8];
        attention(&q, &[5], &k, &v, &p, &mut b);
        assert_eq!(a, b);
    }
}
