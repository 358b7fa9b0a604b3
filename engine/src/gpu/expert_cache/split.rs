//! The split of a token's missing experts between copies to the card and the CPU: what each way costs,
//! measured and fitted ([`MissingCosts`], [`split_missing`]), and the share the CPU computes
//! ([`CpuShare`]: its input rounded as the card rounds its own, its threads, its sum).

use std::sync::Arc;

use poly_kernels::cuda::{CudaError, CudaResult};
use poly_kernels::hot_pool::HotPool;
use poly_kernels::quant::GgmlType;
use poly_models::compute::Moe;

use super::ExpertCache;
use crate::cpu::{CpuWeights, Mat};

/// What a single token's missing experts cost each way, measured: the CPU's time for `c` of them is
/// `cpu_overhead + c · cpu_per_expert` (fitted over the tokens answered so far: fetching the activation,
/// starting the thread pool and returning the sum cost the same for one expert as for eight), a copy's
/// `copy_latency + j · copy_per_expert` (the rate from the bulk copy that filled the cache).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MissingCosts {
    pub cpu_overhead: f64,
    pub cpu_per_expert: f64,
    pub copy_per_expert: f64,
    pub copy_latency: f64,
}

impl MissingCosts {
    /// First guesses for experts of `slot_bytes` until measured: the CPU at 30 GB/s after 50 µs, copies
    /// at 25 GB/s after 20 µs.
    pub(super) fn guess(slot_bytes: usize) -> MissingCosts {
        MissingCosts {
            cpu_overhead: 50e-6,
            cpu_per_expert: slot_bytes as f64 / 30e9,
            copy_per_expert: slot_bytes as f64 / 25e9,
            copy_latency: 20e-6,
        }
    }
}

/// A least-squares line `seconds = a + b · experts` over the CPU's calls (or the card's waits at staged
/// flags), older calls fading (each new one weighs as much as the last ~50 together), so the split
/// follows the machine's load.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct CostFit {
    n: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
}

impl CostFit {
    const DECAY: f64 = 0.98;

    pub(super) fn add(&mut self, experts: usize, seconds: f64) {
        let x = experts as f64;
        let d = Self::DECAY;
        self.n = self.n * d + 1.0;
        self.sx = self.sx * d + x;
        self.sy = self.sy * d + seconds;
        self.sxx = self.sxx * d + x * x;
        self.sxy = self.sxy * d + x * seconds;
    }

    /// `(overhead, per expert)`, once the calls seen vary enough to tell them apart; else the mean time
    /// per expert alone.
    pub(super) fn line(&self) -> Option<(f64, f64)> {
        if self.n < 4.0 || self.sx <= 0.0 {
            return None;
        }
        let det = self.n * self.sxx - self.sx * self.sx;
        if det > 1e-6 * self.n * self.n {
            let b = (self.n * self.sxy - self.sx * self.sy) / det;
            let a = (self.sy - b * self.sx) / self.n;
            if b > 0.0 && a >= 0.0 {
                return Some((a, b));
            }
        }
        Some((0.0, self.sy / self.sx))
    }

    /// `(a, b)` of a line fitted to samples of varied counts, with a cost per count and an intercept
    /// that are not negative; else none (too few samples, all of one count, or noise that says a copy
    /// costs nothing), and the caller keeps its model.
    pub(super) fn fitted_line(&self) -> Option<(f64, f64)> {
        if self.n < 4.0 {
            return None;
        }
        let det = self.n * self.sxx - self.sx * self.sx;
        if det <= 1e-6 * self.n * self.n {
            return None;
        }
        let b = (self.n * self.sxy - self.sx * self.sy) / det;
        let a = (self.sy - b * self.sx) / self.n;
        (b > 0.0 && a >= 0.0).then_some((a, b))
    }
}

/// Keeps the CPU's measured cost current when the split stops giving it experts: a cost measured while
/// the file's pages were still being faulted in (hundreds of µs an expert, where 30–40 is usual) sends
/// every missing expert to the copies, and without new samples the fit would never learn better. Every
/// [`CpuProbe::EVERY`] MoE steps that copied all their missing experts, one goes to the CPU instead.
#[derive(Debug, Default)]
pub(super) struct CpuProbe {
    steps_without: u32,
}

impl CpuProbe {
    /// MoE steps between probes: about a token and a half of a 40–48-layer model, so a probe costs at
    /// most one slow expert in that many layers.
    pub(super) const EVERY: u32 = 64;

    /// `n_copy` of `missing` as the split chose it, or one fewer when a probe is due.
    pub(super) fn adjust(&mut self, n_copy: usize, missing: usize) -> usize {
        if missing == 0 || n_copy < missing {
            self.steps_without = 0;
            return n_copy;
        }
        self.steps_without += 1;
        if self.steps_without >= Self::EVERY {
            self.steps_without = 0;
            return n_copy - 1;
        }
        n_copy
    }
}

/// How many of a token's `missing` uncached experts to copy to the card (the rest go to the CPU) so that
/// both sides finish soonest: the `j` minimizing the later of the CPU's time for `missing - j` and the
/// copies' time for `j` (the card's own compute of them is small beside either).
pub fn split_missing(missing: usize, costs: &MissingCosts) -> usize {
    soonest(missing, |j| costs.finish((missing - j) as f64, j))
}

/// The `c` in `0..=n` whose `finish(c)` is least (the first of equals).
pub(super) fn soonest(n: usize, finish: impl Fn(usize) -> f64) -> usize {
    (0..=n)
        .min_by(|&a, &b| finish(a).total_cmp(&finish(b)))
        .unwrap_or(0)
}

impl MissingCosts {
    /// When both sides are done: the CPU computing `cpu_rows` expert products of one row each (its
    /// overhead once, nothing without any) and `copies` experts copied.
    pub(super) fn finish(&self, cpu_rows: f64, copies: usize) -> f64 {
        let cpu = if cpu_rows > 0.0 {
            self.cpu_overhead + cpu_rows * self.cpu_per_expert
        } else {
            0.0
        };
        let copy = if copies > 0 {
            self.copy_latency + copies as f64 * self.copy_per_expert
        } else {
            0.0
        };
        cpu.max(copy)
    }
}

/// The CPU's inputs from the card (`fetch`: the activations and the routing weights), checked against
/// the `n_ids` routings, with the seconds the fetch took.
pub(super) fn fetch_inputs(
    fetch: impl FnOnce() -> CudaResult<(Vec<f32>, Vec<f32>)>,
    n_ids: usize,
) -> CudaResult<(Vec<f32>, Vec<f32>, f64)> {
    let clock = std::time::Instant::now();
    let (x, weights) = fetch()?;
    if weights.len() != n_ids {
        return Err(CudaError::Invalid(
            "routing ids and weights differ in length".into(),
        ));
    }
    Ok((x, weights, clock.elapsed().as_secs_f64()))
}

/// The share the CPU computes: for a single token its activation and the (expert, weight) pairs of its
/// uncached routings (`items`); for a small prompt call ([`prompt_share`]) the call's activations
/// `[n_rows, n_embd]` and the `(row, expert, weight)` routings of its least-chosen uncached experts
/// (`rows`).
#[derive(Clone)]
pub struct CpuShare {
    pub x: Vec<f32>,
    pub items: Vec<(usize, f32)>,
    pub n_rows: usize,
    pub rows: Vec<(usize, usize, f32)>,
    /// Every routing of the token is in it (the card has nothing to compute).
    pub all: bool,
    /// The host's time fetching `x` and the weights from the card: part of the CPU's cost (the card
    /// waits meanwhile), counted with its compute time in the split's measured costs.
    pub fetch_seconds: f64,
    /// The threads that compute it ([`share_pool`]); rayon's when `None`.
    pub pool: Option<Arc<HotPool>>,
}

/// A single token's choices for a layer of a segmented decode step ([`ExpertCache::prepare_step`]):
/// the CPU's share, the experts to copy on demand ([`ExpertCache::stage_step`]), and whether it routes
/// to experts copied ahead (`--copy-ahead`), whose copies the card's experts must wait for like those on
/// demand.
pub struct StepPrep {
    pub share: Option<CpuShare>,
    pub copies: Vec<usize>,
    pub ahead: bool,
}

impl StepPrep {
    pub(super) fn new(share: Option<CpuShare>, copies: Vec<usize>, ahead: bool) -> StepPrep {
        StepPrep {
            share,
            copies,
            ahead,
        }
    }

    /// The card's experts read slots that copies fill (on demand or ahead).
    pub fn waits_for_copies(&self) -> bool {
        self.ahead || !self.copies.is_empty()
    }
}

/// How long the CPU share's workers spin after a share before they park: a token's MoE layers come every
/// 100–400 µs and the gap between tokens (sampling, the next token's dense layers) is under a
/// millisecond, so they stay awake through an answer and sleep soon after it.
pub(super) const SHARE_SPIN: std::time::Duration = std::time::Duration::from_millis(3);

/// The CPU share's threads, started at the first share: as many as rayon's pool (`--threads`).
/// `--cpu-share rayon` or `per-expert` (to compare) leaves the share on rayon's pool.
pub(super) fn share_pool(slot: &mut Option<Arc<HotPool>>) -> Option<Arc<HotPool>> {
    if crate::knobs::forward().cpu_share != crate::knobs::CpuShareThreads::Hot {
        return None;
    }
    Some(
        slot.get_or_insert_with(|| {
            Arc::new(HotPool::new(rayon::current_num_threads(), SHARE_SPIN))
        })
        .clone(),
    )
}

impl CpuShare {
    /// `x` as `[n_rows, n_embd]`, rounded to q8_1 for quantized experts as the card rounds it for its
    /// own, so an expert gives nearly the same output wherever it is computed.
    pub(super) fn input(&self, cpu: &CpuWeights, m: &Moe) -> Mat {
        let _span = crate::cpu::profile::span("share input");
        let n_rows = self.n_rows.max(1);
        let mut xs = Mat::from_vec(n_rows, self.x.len() / n_rows, self.x.clone());
        if !matches!(
            cpu.info(m.gate_exps).ty,
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16
        ) {
            poly_kernels::quant::legacy::round_to_q8_1_grid(&mut xs.data);
        }
        xs
    }

    /// A single token's items as the CPU's MoE takes a routing: (expert, weight).
    fn route(&self) -> Vec<(u32, f32)> {
        self.items.iter().map(|&(e, w)| (e as u32, w)).collect()
    }

    /// [`CpuShare::compute`], its count and time added to `cache`'s figures.
    pub fn compute_for(
        &self,
        cache: Option<&mut ExpertCache>,
        cpu: &CpuWeights,
        m: &Moe,
    ) -> Vec<f32> {
        let (sum, (), seconds) = self.compute_beside(cpu, m, || ());
        if let Some(c) = cache {
            self.record(c, seconds);
        }
        sum
    }

    /// The share's sum, with `beside` run on this thread meanwhile: a single token's share on its own
    /// threads ([`share_pool`]) starts at once and `beside` (the copies on demand, the card's launches)
    /// runs while it computes; elsewhere `beside` runs first. Also returns the share's own seconds of
    /// compute, for [`CpuShare::record`].
    pub fn compute_beside<R>(
        &self,
        cpu: &CpuWeights,
        m: &Moe,
        beside: impl FnOnce() -> R,
    ) -> (Vec<f32>, R, f64) {
        let per_expert =
            crate::knobs::forward().cpu_share == crate::knobs::CpuShareThreads::PerExpert;
        match self.pool.as_deref() {
            Some(pool) if self.rows.is_empty() && !per_expert => {
                let xs = self.input(cpu, m);
                let (sum, r, seconds) = crate::cpu::expert_job::decode_experts_beside(
                    cpu,
                    &xs,
                    m,
                    &self.route(),
                    pool,
                    beside,
                );
                (sum.data, r, seconds)
            }
            _ => {
                let r = beside();
                let t = std::time::Instant::now();
                let sum = if self.rows.is_empty() {
                    self.compute(cpu, m)
                } else {
                    self.compute_rows(cpu, m)
                };
                (sum, r, t.elapsed().as_secs_f64())
            }
        }
    }

    /// The share's count and its `seconds` of compute (with the fetch of its inputs) added to `cache`'s
    /// figures, and a single token's to the CPU's cost line.
    pub fn record(&self, c: &mut ExpertCache, seconds: f64) {
        let seconds = seconds + self.fetch_seconds;
        c.stats.cpu_seconds += seconds;
        if !self.rows.is_empty() {
            let mut experts: Vec<usize> = self.rows.iter().map(|&(_, e, _)| e).collect();
            experts.sort_unstable();
            experts.dedup();
            c.stats.cpu_experts += experts.len() as u64;
            return;
        }
        c.stats.cpu_experts += self.items.len() as u64;
        if !self.items.is_empty() {
            c.cpu_fit.add(self.items.len(), seconds);
            if let Some((overhead, per_expert)) = c.cpu_fit.line() {
                c.costs.cpu_overhead = overhead;
                c.costs.cpu_per_expert = per_expert;
            }
        }
    }

    /// `Σ weight · expert(x)` over the items, on the CPU (experts in parallel, summed in routing order).
    /// For quantized experts `x` is first rounded to q8_1 as the card rounds it for its experts, so an
    /// expert gives nearly the same output wherever it is computed (the answer does not depend on what
    /// the cache holds beyond the CPU's own rounding of the inner activation).
    pub fn compute(&self, cpu: &CpuWeights, m: &Moe) -> Vec<f32> {
        let n_embd = self.x.len();
        let xs = self.input(cpu, m);
        let _span = crate::cpu::profile::span("share experts");
        // The decode step's expert path: the gate and up products of all items in one parallel region
        // and their down products in another, rows split over the pool (a parallel region per expert
        // left threads idle when fewer experts than threads were missing). Its dot products are those
        // of `expert` with `Arithmetic::BatchInvariant` for one row, summed in routing order: the same bits.
        // `--cpu-share per-expert` keeps the former path (a parallel region per expert), to compare.
        if crate::knobs::forward().cpu_share == crate::knobs::CpuShareThreads::PerExpert {
            use rayon::prelude::*;
            let outs: Vec<Mat> = self
                .items
                .par_iter()
                .map(|&(e, _)| {
                    crate::cpu::moe::expert(cpu, m, e, &xs, crate::cpu::Arithmetic::BatchInvariant)
                })
                .collect();
            let mut sum = vec![0f32; n_embd];
            for (&(_, w), y) in self.items.iter().zip(&outs) {
                sum.iter_mut().zip(y.row(0)).for_each(|(a, b)| *a += w * b);
            }
            return sum;
        }
        crate::cpu::moe::decode_experts(cpu, &xs, m, &self.route()).data
    }
}
