//! Long prompts in large calls on a card held to a budget: the expert cache lends VRAM to the call's
//! scratch and takes it back before the answer.
//!
//! A prompt call on a partly resident model copies every layer's uncached experts to the card once per
//! call (a few hundred milliseconds at the real shapes, whatever the call's length), so a long prompt
//! read in calls of the warm-up's size pays those copies once per 2,048 tokens. Read in calls of 8,192
//! it pays them a quarter as often, but its activations need about four times the scratch the budget
//! counted at load. The cache gives up its least-scored experts for that scratch while the prompt is
//! read, and takes the slots back (filled again with its best-scored experts, a bulk copy of about
//! 25 ms per GB) at the first call of the warm-up's size or smaller: the answer runs with the cache it
//! had. The budget holds throughout: the scratch a call of `n` tokens makes is estimated from the
//! warm-up's, which scales with the tokens of the call.

use poly_kernels::cuda::CudaResult;

use super::{lock, GpuBackend, LendRefill};
use crate::cpu::CpuWeights;

/// Scratch estimated beyond the warm-up's proportion (a quarter more, and this): the per-token share is
/// not exact (rounded tile counts, the expert launches' id lists; measured on the H200, q35s: 2,570 MiB
/// made for 8,000 tokens and 3,012 for 8,191 from a warm-up's 642 for 2,048), and an estimate short of
/// the need would take the card over its budget until the cache gives up the rest after the call.
const LEND_MARGIN: usize = 64 << 20;

/// What the cache lent, to be taken back.
#[derive(Debug)]
pub(super) struct Lent {
    /// Slots given up for the scratch.
    slots: usize,
    /// The largest call it was lent for, in tokens.
    tokens: usize,
    /// The scratch store's cap before.
    cap: Option<usize>,
    /// The cache's ranking before the first call it lent to (`--lend-refill before`; `resident`: the
    /// experts it held then ranked first), what the slots taken back are filled by; `None` (`now`): the
    /// ranking when they are taken back.
    ranking: Option<Vec<Vec<u64>>>,
}

/// The warm-up call the budget was measured with: its tokens and the scratch it left, and what the cache
/// fills the slots it lends to larger calls with when it takes them back (`--lend-refill`).
#[derive(Clone, Copy, Debug)]
pub(super) struct WarmCall {
    pub tokens: usize,
    pub scratch: usize,
    pub refill: LendRefill,
}

impl WarmCall {
    /// Scratch a call of `n` tokens makes, estimated: the warm-up's in proportion, with a margin.
    fn scratch_for(&self, n: usize) -> usize {
        let per_token = self.scratch.div_ceil(self.tokens.max(1));
        per_token.saturating_mul(n) + per_token.saturating_mul(n) / 4 + LEND_MARGIN
    }
}

impl GpuBackend {
    /// Before a prompt call of `n` tokens: when it is larger than the warm-up's call on a card held to a
    /// reserve, the kept scratch is freed and the cache gives up the slots the call's scratch needs
    /// beyond the free memory above the reserve.
    pub(super) fn lend_scratch(&self, cpu: &CpuWeights, n: usize) -> CudaResult<()> {
        let (Some(warm), Some(&reserve)) = (self.warm.get(), self.reserve.get()) else {
            return Ok(());
        };
        if n <= warm.tokens {
            return Ok(());
        }
        let mut lent = lock(&self.lent);
        if lent.as_ref().is_some_and(|l| l.tokens >= n) {
            return Ok(());
        }
        if lent.is_none() && self.room_for(warm.scratch_for(n), reserve)? {
            return Ok(());
        }
        let mut experts = lock(&self.experts);
        let Some(cache) = experts.as_mut() else {
            return Ok(());
        };
        if cache.n_slots() == 0 && lent.is_none() {
            return Ok(());
        }
        // The kept buffers are of the warm-up's sizes: free them (and let the driver's pool give the
        // memory back) so the free memory read next is what the call can have.
        let cap = {
            let mut pool = lock(&self.pool);
            let cap = pool.cap();
            *pool = pool.emptied();
            cap
        };
        self.dev.synchronize()?;
        let need = warm.scratch_for(n);
        let (free, _) = self.dev.memory_info()?;
        let room = free.saturating_sub(reserve);
        let give = need
            .saturating_sub(room)
            .div_ceil(cache.slot_bytes().max(1));
        let give = give.min(cache.n_slots());
        let before = cache.experts_resident();
        let earlier = lent.take();
        // What the slots taken back will be filled by, if it must be kept from now (`now` ranks then).
        let ranking = match &earlier {
            Some(l) => l.ranking.clone(),
            None => match warm.refill {
                LendRefill::Before => Some(cache.ranking()),
                LendRefill::Resident => Some(cache.resident_first_ranking()),
                LendRefill::Now => None,
            },
        };
        // The pool frees whole allocations: what was given may be a little more than asked.
        let give = cache.give_up(&self.dev, cpu, give)?;
        let (cap, slots) = match earlier {
            Some(l) => (l.cap, l.slots + give),
            None => (cap, give),
        };
        lock(&self.pool).set_cap(Some(need));
        eprintln!(
            "expert cache: lent {give} slots ({} MiB; {} experts in VRAM, {before} before) to the \
             scratch of a {n}-token call (estimated {} MiB, {} MiB free above the reserve)",
            (give * cache.slot_bytes()) >> 20,
            cache.experts_resident(),
            need >> 20,
            room >> 20
        );
        *lent = Some(Lent {
            slots,
            tokens: n,
            cap,
            ranking,
        });
        Ok(())
    }

    /// Where the free memory above the reserve holds `need` more scratch beside the kept buffers (a card
    /// with room, every weight in VRAM): the store may grow by that much for good, and nothing is lent
    /// or taken back. Whether it did.
    fn room_for(&self, need: usize, reserve: usize) -> CudaResult<bool> {
        let (free, _) = self.dev.memory_info()?;
        if free.saturating_sub(reserve) < need {
            return Ok(false);
        }
        let mut pool = lock(&self.pool);
        let grown = pool.bytes().saturating_add(need);
        if pool.cap().is_some_and(|c| c < grown) {
            pool.set_cap(Some(grown));
        }
        Ok(true)
    }

    /// Before a call of the warm-up's size or smaller: the scratch lent to larger calls is freed and the
    /// cache takes its slots back. Nothing when nothing was lent.
    pub(super) fn take_back(&self, cpu: &CpuWeights) -> CudaResult<()> {
        let Some(l) = lock(&self.lent).take() else {
            return Ok(());
        };
        let made = {
            let mut pool = lock(&self.pool);
            let made = pool.bytes();
            let mut emptied = pool.emptied();
            emptied.set_cap(l.cap);
            *pool = emptied;
            made
        };
        self.dev.synchronize()?;
        let mut experts = lock(&self.experts);
        let Some(cache) = experts.as_mut() else {
            return Ok(());
        };
        let clock = std::time::Instant::now();
        // The slots the budget gave up meanwhile (keep_budget) stay given up.
        let target = cache.n_slots() + l.slots;
        let ranking = l.ranking.unwrap_or_else(|| cache.ranking());
        cache.set_slots_ranked(&self.dev, cpu, target, &ranking)?;
        eprintln!(
            "expert cache: took back {} slots in {:.1} ms after calls of up to {} tokens (their scratch \
             {} MiB); {} experts in VRAM",
            l.slots,
            clock.elapsed().as_secs_f64() * 1e3,
            l.tokens,
            made >> 20,
            cache.experts_resident()
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_scales_with_the_call_and_keeps_a_margin() {
        let warm = WarmCall {
            tokens: 2048,
            scratch: 600 << 20,
            refill: LendRefill::Before,
        };
        let four = warm.scratch_for(8192);
        assert!(four >= 4 * (600 << 20) + LEND_MARGIN, "{four}");
        assert!(four <= 5 * (600 << 20) + LEND_MARGIN, "{four}");
        assert!(warm.scratch_for(4096) < four);
    }
}
