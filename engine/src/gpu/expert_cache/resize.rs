//! A cache resized in place ([`ExpertCache::set_slots_ranked`]): slots given up for a long prompt's scratch
//! or for KV rows, and taken back after. The pool frees its last allocations or adds some
//! ([`SlotPool::truncate`], [`SlotPool::grow`]); the experts that stay in the cache keep their slots, those
//! in freed slots that the ranking keeps move over on the card, and only experts new to the cache cross
//! the bus. Before, every resize allocated the pool again and copied all of it from the host: 4.5 GB and
//! 122 ms on an H100 to take back 466 slots after a 2,000-token prompt (qwen35moe at 8 GB), about as
//! much to give them up before it.

use poly_kernels::cuda::expert_slots::{SlotPool, POOL_CHUNK_SLOTS};
use poly_kernels::cuda::{CudaError, CudaResult, Device};

use super::policy::{CachePolicy, ExpertKey};
use super::{Dest, ExpertCache};
use crate::cpu::CpuWeights;

/// Where each expert of a resized cache comes from.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct ResizePlan {
    /// `(slot, expert)` of the experts that keep their slots.
    pub stay: Vec<(usize, ExpertKey)>,
    /// `(from slot, to slot, expert)`: resident in a slot that goes, copied on the card.
    pub moves: Vec<(usize, usize, ExpertKey)>,
    /// `(slot, expert)`: not resident, copied from the host.
    pub uploads: Vec<(usize, ExpertKey)>,
}

/// The plan that makes the cache hold `wanted` (at most `n_new` experts) in `n_new` slots, of which the
/// first `kept` (≤ both sizes) are the old pool's slots that remain: `resident` says where an expert is
/// now (its old slot, possibly past `kept`: a slot that goes). Free slots are taken in rising order.
pub(super) fn plan_resize(
    wanted: &[ExpertKey],
    n_new: usize,
    kept: usize,
    resident: impl Fn(ExpertKey) -> Option<usize>,
) -> ResizePlan {
    let mut plan = ResizePlan::default();
    let mut taken = vec![false; n_new];
    let mut incoming = Vec::new();
    for &key in wanted.iter().take(n_new) {
        match resident(key) {
            Some(s) if s < kept => {
                taken[s] = true;
                plan.stay.push((s, key));
            }
            from => incoming.push((from, key)),
        }
    }
    let mut free = (0..n_new).filter(|&s| !taken[s]);
    for (from, key) in incoming {
        let Some(to) = free.next() else { break };
        match from {
            Some(from) => plan.moves.push((from, to, key)),
            None => plan.uploads.push((to, key)),
        }
    }
    plan
}

impl ExpertCache {
    /// Gives the cache `n_slots` slots and fills them with the experts `ranking` ranks highest (an earlier
    /// [`ExpertCache::ranking`]: slots taken back after a long prompt are filled as the cache was before
    /// it, not with the prompt's favourites). Fewer slots free the pool's last allocations, so the count
    /// is rounded down to their boundary; more add allocations (an allocation that fails gives fewer).
    /// The run's figures, counts and scores go on (fill's reset of them to its ranking made newcomers
    /// overtake the residents). Copies complete before it returns.
    pub fn set_slots_ranked(
        &mut self,
        dev: &Device,
        cpu: &CpuWeights,
        n_slots: usize,
        ranking: &[Vec<u64>],
    ) -> CudaResult<()> {
        let old = self.policy.n_slots();
        if n_slots == old {
            return Ok(());
        }
        self.quiesce(dev)?;
        let sizes: Vec<usize> = self.layers.iter().map(|l| l.n_expert).collect();
        let n_slots = n_slots.min(sizes.iter().sum());
        // The slots of the old pool that remain, and the new size.
        let (kept, n_new) = match self.pool.as_mut() {
            _ if n_slots == 0 => (0, 0),
            Some(pool) if n_slots < old => {
                let kept = pool.boundary_at_or_below(n_slots);
                (kept, kept)
            }
            Some(pool) => match pool.grow(dev, n_slots - old) {
                // An allocation that fails gives fewer slots, not an error.
                Ok(()) | Err(CudaError::Driver(_)) => (old, pool.n_slots()),
                Err(e) => return Err(e),
            },
            None => {
                let chunk = chunk_slots(sizes.iter().sum());
                self.pool = alloc_fewer(dev, (self.slot_bytes, chunk), n_slots)?;
                (0, self.pool.as_ref().map_or(0, SlotPool::n_slots))
            }
        };
        let mut policy = CachePolicy::new(&sizes, n_new);
        policy.set_rule(self.rule);
        let wanted = policy.initial_set(ranking);
        let plan = plan_resize(&wanted, n_new, kept, |k| self.policy.resident(k));
        if let Some(pool) = &self.pool {
            for &(from, to, _) in &plan.moves {
                dev.copy_slot((pool, from), (pool, to))?;
            }
        }
        for &(slot, key) in &plan.uploads {
            self.upload(cpu, key, slot, Dest::Cache)?;
        }
        self.copy.synchronize()?;
        // The moves read the slots that go on the compute stream, and a freed allocation is released in
        // that stream's order: no wait before the truncation.
        match self.pool.as_mut() {
            Some(_) if n_new == 0 => self.pool = None,
            Some(pool) => pool.truncate(n_new)?,
            None => {}
        }
        for &(slot, key) in plan.stay.iter().chain(&plan.uploads) {
            policy.place(slot, key);
        }
        for &(_, slot, key) in &plan.moves {
            policy.place(slot, key);
        }
        // A resize is not a new start: what the policy learned and counted goes on.
        policy.add_counts(&self.policy.take_counts());
        policy.restore_history(self.policy.history());
        self.policy = policy;
        for l in 0..self.layers.len() {
            self.point_tables(dev, l)?;
        }
        dev.synchronize()
    }

    /// Waits for every copy and launch, and drops what was under way (as a fill does): staged layers,
    /// copies ahead, uploads not yet made visible.
    pub(super) fn quiesce(&mut self, dev: &Device) -> CudaResult<()> {
        self.copy.synchronize()?;
        dev.synchronize()?;
        self.pending.clear();
        if let Some(held) = self.bus_later.as_mut() {
            held.clear();
        }
        self.staged = None;
        self.prefetch = None;
        self.prefetch_plan = None;
        self.filled = true;
        Ok(())
    }
}

/// Slots of one allocation of a cache's pool for a model of `total` routed experts: [`POOL_CHUNK_SLOTS`],
/// or an eighth of the experts for small models, so that they too resize in steps.
pub(super) fn chunk_slots(total: usize) -> usize {
    (total / 8).clamp(1, POOL_CHUNK_SLOTS)
}

/// A pool of `n` slots of `slot_bytes` in allocations of `chunk` slots, or fewer slots where the card has
/// no room for them all (`None`: not one).
pub(super) fn alloc_fewer(
    dev: &Device,
    (slot_bytes, chunk): (usize, usize),
    n: usize,
) -> CudaResult<Option<SlotPool>> {
    let mut want = n;
    while want > 0 {
        match SlotPool::alloc_in(dev, (slot_bytes, chunk), want) {
            Ok(p) => return Ok(Some(p)),
            Err(CudaError::Driver(_)) => want -= want.div_ceil(8),
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(layer: usize, expert: usize) -> ExpertKey {
        ExpertKey { layer, expert }
    }

    #[test]
    fn experts_kept_stay_in_their_slots_and_only_newcomers_are_uploaded() {
        // Slots 0-5 hold experts 0-5 of layer 0; the cache grows to 8 and wants 5, 4, 9, 1, 7, 0, 8, 2.
        let resident = |k: ExpertKey| (k.layer == 0 && k.expert < 6).then_some(k.expert);
        let wanted: Vec<_> = [5, 4, 9, 1, 7, 0, 8, 2].map(|e| key(0, e)).into();
        let plan = plan_resize(&wanted, 8, 6, resident);
        let stay: Vec<_> = plan.stay.iter().map(|&(s, k)| (s, k.expert)).collect();
        assert_eq!(stay, [(5, 5), (4, 4), (1, 1), (0, 0), (2, 2)]);
        assert!(plan.moves.is_empty());
        // Slot 3 (expert 3, no longer wanted) and the new slots 6 and 7 take the newcomers.
        let up: Vec<_> = plan.uploads.iter().map(|&(s, k)| (s, k.expert)).collect();
        assert_eq!(up, [(3, 9), (6, 7), (7, 8)]);
    }

    #[test]
    fn a_shrink_moves_wanted_experts_out_of_the_freed_slots_on_the_card() {
        // Slots 0-7 hold experts 0-7; the pool keeps slots 0-3 and wants 7, 1, 6, 2 (by rank).
        let resident = |k: ExpertKey| (k.expert < 8).then_some(k.expert);
        let wanted: Vec<_> = [7, 1, 6, 2, 0, 3].map(|e| key(1, e)).into();
        let plan = plan_resize(&wanted, 4, 4, resident);
        let stay: Vec<_> = plan.stay.iter().map(|&(s, k)| (s, k.expert)).collect();
        assert_eq!(stay, [(1, 1), (2, 2)]);
        let moves: Vec<_> = plan
            .moves
            .iter()
            .map(|&(f, t, k)| (f, t, k.expert))
            .collect();
        assert_eq!(moves, [(7, 0, 7), (6, 3, 6)]);
        assert!(plan.uploads.is_empty());
    }

    #[test]
    fn every_slot_holds_one_expert_and_every_expert_one_slot() {
        // Random plans: the slots written and kept are distinct and below the new size, the experts
        // distinct, and every wanted expert that fits is placed.
        let mut seed = 7u64;
        let mut next = |m: usize| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as usize % m
        };
        for _ in 0..200 {
            let (old, n_new) = (next(40), next(40));
            let kept = old.min(n_new);
            let mut shuffled = |n: usize| {
                let mut order: Vec<(usize, usize)> = (0..n).map(|e| (next(1 << 20), e)).collect();
                order.sort();
                order.into_iter().map(|(_, e)| e).collect::<Vec<usize>>()
            };
            let held: Vec<usize> = shuffled(60).into_iter().take(old).collect();
            let resident = |k: ExpertKey| held.iter().position(|&e| e == k.expert);
            let wanted: Vec<ExpertKey> = shuffled(60).into_iter().map(|e| key(0, e)).collect();
            let plan = plan_resize(&wanted, n_new, kept, resident);
            let mut slots: Vec<usize> = plan.stay.iter().map(|p| p.0).collect();
            slots.extend(plan.moves.iter().map(|m| m.1));
            slots.extend(plan.uploads.iter().map(|u| u.0));
            let mut experts: Vec<usize> = plan.stay.iter().map(|p| p.1.expert).collect();
            experts.extend(plan.moves.iter().map(|m| m.2.expert));
            experts.extend(plan.uploads.iter().map(|u| u.1.expert));
            assert_eq!(slots.len(), n_new.min(60));
            assert!(slots.iter().all(|&s| s < n_new));
            slots.sort();
            slots.dedup();
            assert_eq!(slots.len(), n_new.min(60));
            experts.sort();
            experts.dedup();
            assert_eq!(experts.len(), n_new.min(60));
            assert!(plan
                .moves
                .iter()
                .all(|&(from, _, _)| from >= kept && from < old));
        }
    }
}
