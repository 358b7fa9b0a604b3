//! A small prompt call's least-chosen uncached experts on the CPU (issue 15 §4).
//!
//! A call of a few dozen to a few hundred tokens (a conversation's turn) routes to most of a layer's
//! experts, many of them for one or two tokens. Staging every uncached one costs a copy each (~40 µs for
//! 1.7 MB), so a 40-token turn of a 256-expert model paid ~100 copies a layer, 4 ms, for a few hundred µs
//! of the card's compute. The CPU computes an expert for one or two rows at about a copy's cost, and at
//! the same time as the copies: the least-chosen uncached experts (those routed to the fewest tokens,
//! at most [`MAX_ROWS`]) go to the CPU and the rest are copied, so that both finish together by the
//! single tokens' measured costs ([`MissingCosts`]). Their table entries stay null, so the card's kernels
//! give zeros for them and the CPU's sum is added to the card's ([`super::CpuShare::rows`]).
//!
//! Large calls copy every layer's experts ahead instead ([`super::prefetch`]): for them copying is
//! hidden behind the card's compute, and the CPU's per-row cost grows with the rows.

use std::collections::BTreeMap;

use poly_models::compute::Moe;

use poly_kernels::cuda::CudaResult;

use super::{fetch_inputs, soonest, CpuShare, ExpertCache, MissingCosts, MissingExperts};
use crate::cpu::{CpuWeights, Mat};

/// Experts routed to more tokens than this stay on the card: the CPU's cost grows with the rows, a copy's
/// does not.
pub const MAX_ROWS: usize = 2;

/// Which of a prompt call's `needed` uncached experts (with `rows[e]` routings each) the CPU computes:
/// the least-routed ones (at most [`MAX_ROWS`] each), as many as make the CPU's time (its overhead, then
/// a single token's cost per expert and row) and the copies' time for the others finish soonest.
pub fn split_prompt(needed: &[usize], rows: &[usize], costs: &MissingCosts) -> Vec<usize> {
    let mut candidates: Vec<usize> = needed
        .iter()
        .copied()
        .filter(|&e| rows[e] <= MAX_ROWS)
        .collect();
    candidates.sort_by_key(|&e| (rows[e], e));
    // The CPU's rows for the first `c` candidates.
    let mut cpu_rows = vec![0usize; candidates.len() + 1];
    for (i, &e) in candidates.iter().enumerate() {
        cpu_rows[i + 1] = cpu_rows[i] + rows[e];
    }
    let best = soonest(candidates.len(), |c| {
        costs.finish(cpu_rows[c] as f64, needed.len() - c)
    });
    candidates.truncate(best);
    candidates.sort_unstable();
    candidates
}

impl ExpertCache {
    /// A prompt call's share for the CPU (`layer`'s `n_tokens` tokens routed as `ids`, `routed` the valid
    /// ones):
    /// when the call is small, copies go straight from the page-locked file and the split is by cost,
    /// its least-chosen uncached experts, taken out of `staged` (the uncached experts it needs, sorted),
    /// with the activations and weights `fetch` downloads.
    pub(super) fn prompt_share(
        &self,
        (layer, n_tokens, ids, routed): (usize, usize, &[i32], &[usize]),
        staged: &mut Vec<usize>,
        fetch: impl FnOnce() -> CudaResult<(Vec<f32>, Vec<f32>)>,
    ) -> CudaResult<Option<CpuShare>> {
        let n_expert = self.layers[layer].n_expert;
        let small = ids.len() < super::prefetch::ROUTINGS_PER_EXPERT * n_expert;
        // `--missing-experts` says where a single token's experts go; a small prompt call splits by
        // cost under `split` and `cpu` alike (`card` and `mapped` stage every one).
        if !matches!(self.missing, MissingExperts::Split | MissingExperts::Cpu)
            || !small
            || !self.direct_copies()
            || staged.is_empty()
        {
            return Ok(None);
        }
        let mut rows = vec![0usize; n_expert];
        routed.iter().for_each(|&e| rows[e] += 1);
        let on_cpu = split_prompt(staged, &rows, &self.costs);
        if on_cpu.is_empty() {
            return Ok(None);
        }
        let (x, weights, fetch_seconds) = fetch_inputs(fetch, ids.len())?;
        let k = (ids.len() / n_tokens.max(1)).max(1);
        let rows: Vec<(usize, usize, f32)> = (0..ids.len())
            .filter(|&j| on_cpu.binary_search(&(ids[j] as usize)).is_ok())
            .map(|j| (j / k, ids[j] as usize, weights[j]))
            .collect();
        staged.retain(|e| on_cpu.binary_search(e).is_err());
        Ok(Some(CpuShare {
            x,
            items: Vec::new(),
            n_rows: n_tokens,
            rows,
            all: false,
            fetch_seconds,
            pool: None,
        }))
    }
}

impl CpuShare {
    /// A prompt call's share: `Σ weight · expert(x_row)` per row over the `(row, expert, weight)`
    /// routings of [`CpuShare::rows`], `[n_rows, n_embd]`. The experts run in parallel, each on the rows
    /// routed to it (rounded to q8_1 first for quantized experts, as the card rounds them); each row's
    /// products are summed in expert order.
    pub(super) fn compute_rows(&self, cpu: &CpuWeights, m: &Moe) -> Vec<f32> {
        use rayon::prelude::*;
        let n_rows = self.n_rows.max(1);
        let n_embd = self.x.len() / n_rows;
        let xs = self.input(cpu, m);
        let mut by_expert: BTreeMap<usize, Vec<(usize, f32)>> = BTreeMap::new();
        for &(row, e, w) in &self.rows {
            by_expert.entry(e).or_default().push((row, w));
        }
        let groups: Vec<(usize, Vec<(usize, f32)>)> = by_expert.into_iter().collect();
        let outs: Vec<Mat> = groups
            .par_iter()
            .map(|(e, routed)| {
                let mut data = Vec::with_capacity(routed.len() * n_embd);
                for &(row, _) in routed {
                    data.extend_from_slice(xs.row(row));
                }
                let x_e = Mat::from_vec(routed.len(), n_embd, data);
                crate::cpu::moe::expert(cpu, m, *e, &x_e, crate::cpu::Arithmetic::BatchInvariant)
            })
            .collect();
        let mut sum = vec![0f32; n_rows * n_embd];
        for ((_, routed), y) in groups.iter().zip(&outs) {
            for (i, &(row, w)) in routed.iter().enumerate() {
                sum[row * n_embd..(row + 1) * n_embd]
                    .iter_mut()
                    .zip(y.row(i))
                    .for_each(|(a, b)| *a += w * b);
            }
        }
        sum
    }
}
