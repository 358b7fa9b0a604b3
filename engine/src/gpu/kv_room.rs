//! Attention caches that grow with the conversation on a card held to a budget.
//!
//! Reserving the KV rows of the whole `--max-context` at load takes from the expert cache what most
//! conversations never use: a qwen3moe 30B-A3B shape's 48 caches of 34,000 rows are 3.3 GB, over half of
//! an 8 GB card's room for experts. Held to a reserve, the cache is sized at load beside the rows of a
//! warm-up call ([`super::seq::KV_GROWTH_ROWS`] rounded); a call that needs more rows grows the buffers in
//! place ([`super::seq::DeviceSeq::follow`]), the expert cache giving up the slots the rows take beyond
//! the free memory above the reserve; a new conversation that needs fewer rows than the buffers hold gets
//! smaller buffers and the cache takes those slots back (filled again with its best-scored experts). With
//! a fixed expert budget (`--expert-budget-mib`) the whole context is reserved at load, as counted there.

use poly_kernels::cuda::CudaResult;

use super::seq::{kv_rows_for, DeviceSeq};
use super::{lock, GpuBackend};
use crate::cpu::CpuWeights;
use crate::model::EngineError;
use crate::state::SeqState;

/// Bytes of a KV row (f16 keys and values) of each of `state`'s layers (0 for a recurrent one).
fn layer_row_bytes(state: &SeqState) -> impl Iterator<Item = usize> + '_ {
    (0..state.n_layers()).map(|il| match state.layer(il) {
        crate::state::LayerState::Kv(c) => (c.k_width() + c.v_width()) * 2,
        crate::state::LayerState::Recurrent(_) => 0,
    })
}

impl GpuBackend {
    /// Makes the card hold `state` in buffers of the KV rows `n` more tokens need ([`GpuBackend::kv_room`]),
    /// before a call's scratch is lent (so the lending sees the memory the rows took) or before a prompt
    /// is read in several calls (`n` its length: one growth, not one a call).
    pub(super) fn fit_kv(
        &self,
        cpu: &CpuWeights,
        state: &mut SeqState,
        n: usize,
    ) -> CudaResult<()> {
        if self.reserve.get().is_none() {
            return Ok(());
        }
        let mut slot = lock(&self.seq);
        let rows = self.kv_room(cpu, &mut slot, state, n)?;
        DeviceSeq::follow(&self.dev, &mut slot, state, rows).map(|_| ())
    }

    /// [`GpuBackend::fit_kv`] before a prompt of `n` tokens is read in several calls.
    pub fn expect_tokens(
        &self,
        cpu: &CpuWeights,
        state: &mut SeqState,
        n: usize,
    ) -> Result<(), EngineError> {
        self.fit_kv(cpu, state, n).map_err(super::cuda_err)
    }

    /// Before a call of `n` tokens of `state` (the card's sequence in `slot`): the KV rows its buffers
    /// are to have. On a card held to a reserve these are the rows the call needs rounded up to the
    /// growth step; the expert cache gives up slots for rows beyond the free memory above the reserve,
    /// and a new sequence needing fewer rows than the card's buffers hold gets smaller buffers (the old
    /// ones saved and dropped here, the slots taken back). Else the whole context.
    pub(super) fn kv_room(
        &self,
        cpu: &CpuWeights,
        slot: &mut Option<DeviceSeq>,
        state: &SeqState,
        n: usize,
    ) -> CudaResult<usize> {
        let n_ctx = state.n_ctx().max(1);
        let Some(&reserve) = self.reserve.get() else {
            return Ok(n_ctx);
        };
        let want = kv_rows_for(state.n_past() + n, n_ctx);
        let have = slot
            .as_ref()
            .filter(|s| s.same_shapes(state))
            .map(DeviceSeq::rows);
        if have == Some(want) {
            return Ok(want);
        }
        // Bytes of a position over every attention layer (0 without any: then nothing to make room for).
        let row_bytes: usize = layer_row_bytes(state).sum();
        match have {
            Some(rows) if rows > want => {
                // Buffers of at least twice the rows needed (a new conversation after a long one, which
                // for a model without recurrent layers counts as a prefix of it) are made smaller when
                // the cache gave slots up for them; else they stay.
                if rows < 2 * want || *lock(&self.kv_lent) == 0 {
                    return Ok(rows);
                }
                return self
                    .shrink_kv(cpu, slot, (want * row_bytes, reserve))
                    .map(|()| want);
            }
            _ => {}
        }
        // A growth allocates a layer's new buffers before it frees the old ones: one layer's worth
        // lives twice for a moment.
        let had = have.unwrap_or(0);
        let twice = layer_row_bytes(state).max().unwrap_or(0) * had;
        let grow = want.saturating_sub(had) * row_bytes;
        self.make_room(cpu, (grow, twice), reserve, want)?;
        Ok(want)
    }

    /// The expert cache gives up the slots `bytes` of new KV rows (for buffers of `rows`; `twice` of
    /// them for a moment) need beyond the free memory above `reserve`.
    fn make_room(
        &self,
        cpu: &CpuWeights,
        (bytes, twice): (usize, usize),
        reserve: usize,
        rows: usize,
    ) -> CudaResult<()> {
        let need = bytes + twice;
        if need == 0 {
            return Ok(());
        }
        // Free memory the scratch may still take up to its cap is not room: a long call's loan counted
        // it for the scratch (counting it for rows too took an 8 GB card 150 MiB over its budget).
        let (free, _) = self.dev.memory_info()?;
        let room = free
            .saturating_sub(reserve)
            .saturating_sub(self.scratch_headroom());
        if need <= room {
            return Ok(());
        }
        let mut experts = lock(&self.experts);
        let Some(cache) = experts.as_mut() else {
            return Ok(());
        };
        let n = (need - room)
            .div_ceil(cache.slot_bytes().max(1))
            .min(cache.n_slots());
        if n == 0 {
            return Ok(());
        }
        let n = cache.give_up(&self.dev, cpu, n)?;
        *lock(&self.kv_lent) += n;
        eprintln!(
            "expert cache: gave up {n} slots ({} MiB) for KV rows up to {rows} ({} MiB more); {} \
             experts in VRAM",
            (n * cache.slot_bytes()) >> 20,
            bytes >> 20,
            cache.experts_resident()
        );
        Ok(())
    }

    /// Drops the card's sequence (its pending copies saved whole first) so that the next one gets
    /// buffers of `new_bytes`, and takes back what of the slots given up for KV rows now fits above the
    /// reserve beside them.
    fn shrink_kv(
        &self,
        cpu: &CpuWeights,
        slot: &mut Option<DeviceSeq>,
        (new_bytes, reserve): (usize, usize),
    ) -> CudaResult<()> {
        if let Some(old) = slot.as_mut() {
            old.settle_all(&self.dev, false)?;
        }
        *slot = None;
        // The freed buffers return to the driver once the stream has passed their last use.
        self.dev.synchronize()?;
        let (free, _) = self.dev.memory_info()?;
        let room = free
            .saturating_sub(reserve)
            .saturating_sub(new_bytes)
            .saturating_sub(self.scratch_headroom());
        let mut experts = lock(&self.experts);
        let Some(cache) = experts.as_mut() else {
            return Ok(());
        };
        let mut lent = lock(&self.kv_lent);
        let n = (room / cache.slot_bytes().max(1)).min(*lent);
        if n == 0 {
            return Ok(());
        }
        let clock = std::time::Instant::now();
        let target = cache.n_slots() + n;
        cache.set_slots(&self.dev, cpu, target)?;
        *lent -= n;
        eprintln!(
            "expert cache: took back {n} slots from KV rows in {:.1} ms (a new sequence needs {} MiB of \
             them); {} experts in VRAM",
            clock.elapsed().as_secs_f64() * 1e3,
            new_bytes >> 20,
            cache.experts_resident()
        );
        Ok(())
    }
}
