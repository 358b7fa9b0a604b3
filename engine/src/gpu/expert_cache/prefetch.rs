//! A prompt call's next layer copied ahead (issue 15 §3).
//!
//! A call of many tokens routes to most experts of a layer (2,048 tokens × 8 choices over 256 experts:
//! 64 routings per expert on even routing), so which of the next layer's uncached experts it needs is
//! largely known before its router runs: those whose share of the layer's routings so far predicts at
//! least one routing in this call (on skewed routing many get none, and copying them would cost the bus
//! what it saves; with no routings counted yet, all). While the card computes layer `L`'s experts from
//! one scratch pool, the copy stream fills the other with layer `L+1`'s; at `L+1`'s route point the
//! compute stream waits only for those copies, and the routed experts the prediction missed are staged
//! there as before. Without it a layer's copies and its launches alternate, and a prompt call is bound
//! by their sum instead of the larger of the two.
//!
//! Ordering: the plan is made at `L`'s route point, before `L`'s expert launches, with an event on the
//! compute stream there: the other pool's last readers (layer `L−1`'s launches) were queued before it.
//! The copies are queued when `L` finishes ([`ExpertCache::finish_layer`]), after `L`'s launches, so the
//! host queues them while the card computes; the copy stream waits for the event, not for `L`'s
//! launches. A prefetch that its call never reaches (a call that ended or failed first) is dropped at
//! the next route point; a later copy into its pool is queued after its copies on the one copy stream.
//!
//! A single token copies ahead too (`--copy-ahead N`, [`ExpertCache::copy_ahead`]). Its missing experts
//! are bound by host memory: the CPU's share and the copies on demand read the same memory, so splitting
//! them gains nothing, and between a layer's CPU sum and the next layer's router (the card's dense work,
//! some 45–85 µs) host memory sits idle. So once a layer's share is done, the next layer's router applied
//! to this layer's input guesses its experts (84% of the guessed missing ones are routed on the uniform
//! qwen3moe shape, 77% on the skewed qwen35moe one), and up to N of those not on the card are copied over
//! the bus meanwhile, into the next layer's half of the first scratch pool
//! ([`ExpertCache::token_slots`]). At its route point those it routes to are on the card; its card
//! experts wait for their copies as for copies on demand (the copy stream sets the staged flag after
//! them, or the compute stream waits for their event between cuts).
//!
//! Measured on an H100 host held to 8 GB (BENCHMARKS.md, "Copies ahead"): one expert a layer gains
//! 2–9% (its guess is right 92–98% of the time); two are 4–11% slower than one, since a second expert's
//! copy (35–50 µs) outlasts the card's stretch and holds the bus and host memory into the next layer's
//! share. The guess
//! runs on the share's threads once they are free: on one thread beside the share it read the f32
//! router at a single core's memory rate (~300 µs a qwen35moe layer) and halved the answers.

use poly_kernels::cuda::expert_slots::{CopyEvent, SlotPool};
use poly_kernels::cuda::{CudaError, CudaResult, Device};

use super::policy::ExpertKey;
use super::{Dest, ExpertCache, Staged};
use crate::cpu::CpuWeights;

/// Copy ahead when a call routes at least this many times per expert of the next layer: at 4 the chance
/// that a given expert goes unrouted is under 2% (`(1 − k/n)^(n_tokens)` ≈ `e^−4`), so few copies are
/// wasted; smaller calls stage what they route.
pub(super) const ROUTINGS_PER_EXPERT: usize = 4;

/// An expert is copied ahead when the routings counted so far predict at least this many of the call's
/// routings for it (a chance of ~63% that it is routed at all).
const MIN_EXPECTED_ROUTINGS: f64 = 1.0;

/// The next layer to copy ahead, into which scratch pool, once the current one (`from`) finishes.
pub(super) struct Plan {
    from: usize,
    layer: usize,
    pool: usize,
    /// The call's routings (tokens × experts per token).
    n_routings: usize,
    /// The compute stream's point after which the pool is no longer read.
    free: CopyEvent,
}

/// A layer's uncached experts being copied into scratch pool `pool` from slot `base` on: `(expert,
/// slot)` pairs; `repoint` when the layer's tables point there (a prompt call's; a single token reads
/// its step's own table).
pub(super) struct Prefetched {
    layer: usize,
    pool: usize,
    base: usize,
    map: Vec<(usize, usize)>,
    /// The copies' completion, for the compute stream to wait on; `None` for a one-graph token's, whose
    /// card waits at a flag the copy stream sets after them (an event costs two driver calls).
    done: Option<CopyEvent>,
    repoint: bool,
}

impl ExpertCache {
    /// At `layer`'s route point of a call with `n_routings` routings: plans to copy the next layer's
    /// uncached experts ahead when the call is large enough and the copies go straight from the
    /// page-locked file (through the staging buffers the host would copy them itself, serially).
    pub(super) fn plan_prefetch(
        &mut self,
        dev: &Device,
        layer: usize,
        n_routings: usize,
    ) -> CudaResult<()> {
        let next = layer + 1;
        let Some(n_expert) = self.layers.get(next).map(|l| l.n_expert) else {
            return Ok(());
        };
        if !self.direct_copies() || n_routings < ROUTINGS_PER_EXPERT * n_expert {
            return Ok(());
        }
        if self.scratch.len() < 2 {
            // Only before the cache is sized (the warm-up reads a call of the largest size), so the
            // second pool counts against the budget like every other scratch buffer.
            if self.filled {
                return Ok(());
            }
            let n_slots = self.scratch[0].n_slots();
            match SlotPool::alloc(dev, self.slot_bytes, n_slots) {
                Ok(p) => self.scratch.push(p),
                Err(CudaError::Driver(e)) => {
                    eprintln!(
                        "expert cache: no second scratch pool ({e}); prompts stage per layer"
                    );
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
        let current = self
            .staged
            .as_ref()
            .filter(|s| s.layer == layer)
            .map_or(0, |s| s.pool);
        self.prefetch_plan = Some(Plan {
            from: layer,
            layer: next,
            pool: 1 - current,
            n_routings,
            free: dev.record_compute()?,
        });
        Ok(())
    }

    /// When `layer` finishes (its launches queued): queues the planned copies of the next layer's
    /// uncached experts.
    pub(super) fn start_prefetch(&mut self, cpu: &CpuWeights, layer: usize) -> CudaResult<()> {
        let Some(plan) = self.prefetch_plan.take() else {
            return Ok(());
        };
        if plan.from != layer {
            return Ok(());
        }
        let l = plan.layer;
        let capacity = self.scratch[plan.pool].n_slots();
        let counts = &self.routed_counts[l];
        let counted: u64 = counts.iter().sum();
        let expected = |e: usize| match counted {
            0 => f64::INFINITY,
            n => plan.n_routings as f64 * counts[e] as f64 / n as f64,
        };
        let experts: Vec<usize> = (0..self.layers[l].n_expert)
            .filter(|&expert| {
                expected(expert) >= MIN_EXPECTED_ROUTINGS
                    && self
                        .policy
                        .resident(ExpertKey { layer: l, expert })
                        .is_none()
            })
            .take(capacity)
            .collect();
        if experts.is_empty() {
            return Ok(());
        }
        self.copy.wait_for(&plan.free)?;
        let mut map = Vec::with_capacity(experts.len());
        for (slot, &expert) in experts.iter().enumerate() {
            self.upload(
                cpu,
                ExpertKey { layer: l, expert },
                slot,
                Dest::Scratch(plan.pool),
            )?;
            map.push((expert, slot));
        }
        self.stats.staged += map.len() as u64;
        self.stats.prefetched += map.len() as u64;
        self.prefetch = Some(Prefetched {
            layer: l,
            pool: plan.pool,
            base: 0,
            map,
            done: Some(self.copy.record()?),
            repoint: true,
        });
        Ok(())
    }

    /// A single token's copies ahead (`--copy-ahead`): of `guess` (experts of `layer`, the next MoE
    /// layer, likeliest first: the card's guess or [`ExpertCache::guess_missing`]), the first `n` not on
    /// the card, as many as fit beside `k` copies on demand in the layer's half of the first scratch
    /// pool, copied over the bus (only straight from the page-locked file: through the staging buffers
    /// this thread would copy them itself). Called at the current layer's route point after its copies
    /// on demand, or once its CPU share is done. Returns how many were queued.
    /// How many guessed experts a layer copies ahead under `--copy-ahead n` and `--copy-ahead-us
    /// budget_us`: `n`, or as many as the budget holds at the measured copy rate, at least one.
    pub fn copies_ahead(&self, n: usize, budget_us: u32) -> usize {
        copies_in_budget(n, budget_us, self.costs.copy_per_expert)
    }

    pub fn copy_ahead(
        &mut self,
        cpu: &CpuWeights,
        (layer, k): (usize, usize),
        guess: &[usize],
        n: usize,
    ) -> CudaResult<usize> {
        self.prefetch = None;
        let Some(n_expert) = self.layers.get(layer).map(|l| l.n_expert) else {
            return Ok(0);
        };
        let (base, end) = self.token_slots(layer);
        let room = (end - base).saturating_sub(k);
        if room == 0 || !self.direct_copies() || self.reads_mapped() {
            return Ok(0);
        }
        let experts: Vec<usize> = guess
            .iter()
            .copied()
            .filter(|&expert| {
                expert < n_expert && self.policy.resident(ExpertKey { layer, expert }).is_none()
            })
            .take(room.min(n))
            .collect();
        if experts.is_empty() {
            return Ok(0);
        }
        let mut map = Vec::with_capacity(experts.len());
        for (i, &expert) in experts.iter().enumerate() {
            self.upload(cpu, ExpertKey { layer, expert }, base + i, Dest::Scratch(0))?;
            map.push((expert, base + i));
        }
        self.stats.ahead_copied += map.len() as u64;
        let n = map.len();
        self.prefetch = Some(Prefetched {
            layer,
            pool: 0,
            base,
            map,
            done: match self.linked {
                true => None,
                false => Some(self.copy.record()?),
            },
            repoint: false,
        });
        Ok(n)
    }

    /// At `layer`'s route point: the experts copied ahead for it become the layer's staged ones (the
    /// compute stream waits for their copies; a one-graph token's card waits at its staged flag, which
    /// the copy stream sets after them); a prefetch for another layer is dropped.
    pub(super) fn take_prefetch(&mut self, dev: &Device, layer: usize) -> CudaResult<()> {
        let Some(p) = self.prefetch.take() else {
            return Ok(());
        };
        if p.layer != layer {
            return Ok(());
        }
        match (&p.done, self.linked) {
            (Some(done), false) => dev.wait_for_copy(done)?,
            // Copied ahead for a one-graph token that did not reach this layer (it failed): nothing
            // to wait on, so dropped like a stale prefetch.
            (None, false) => return Ok(()),
            (_, true) => {}
        }
        if let Some(old) = self.staged.take().filter(|s| s.repointed) {
            self.mark_tables(old.layer);
        }
        self.staged = Some(Staged {
            layer,
            pool: p.pool,
            base: p.base,
            map: p.map,
            repointed: p.repoint,
        });
        if p.repoint {
            self.mark_tables(layer);
        }
        Ok(())
    }
}

/// `n` copies, or as many as `budget_us` holds at `per_copy` seconds a copy (at least one; `n` where the
/// budget is 0 or the rate unknown).
fn copies_in_budget(n: usize, budget_us: u32, per_copy: f64) -> usize {
    if n == 0 || budget_us == 0 || per_copy.is_nan() || per_copy <= 0.0 {
        return n;
    }
    let fit = (budget_us as f64 * 1e-6 / per_copy).floor() as usize;
    fit.clamp(1, n)
}

#[cfg(test)]
mod budget_tests {
    use super::copies_in_budget;

    #[test]
    fn the_bus_budget_sets_how_many_are_copied_ahead() {
        // The measured rates of the two shapes (2026-12-06): 58 µs a qwen3moe expert, 41.5 a qwen35moe one.
        assert_eq!(copies_in_budget(4, 140, 58e-6), 2);
        assert_eq!(copies_in_budget(4, 140, 41.5e-6), 3);
        // Never more than asked, never none when asked for some.
        assert_eq!(copies_in_budget(2, 140, 10e-6), 2);
        assert_eq!(copies_in_budget(4, 140, 500e-6), 1);
        assert_eq!(copies_in_budget(0, 140, 10e-6), 0);
        // No budget, or no measured rate: the count as asked.
        assert_eq!(copies_in_budget(3, 0, 58e-6), 3);
        assert_eq!(copies_in_budget(3, 140, 0.0), 3);
        assert_eq!(copies_in_budget(3, 140, f64::NAN), 3);
    }
}
