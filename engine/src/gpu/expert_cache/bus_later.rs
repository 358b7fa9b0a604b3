//! Admissions over the bus queued after the next layer's copies (`--bus-admissions-at ahead`).
//!
//! A one-graph token finishes layer `i − 1` before layer `i`'s choices (right after its own sum, or at
//! layer `i`'s route point: `--finish-layers-at`), where the admissions layer `i − 1` earned are
//! planned: victims chosen and taken out of the cache's residents, so layer `i`'s choices that follow
//! already treat them as missing. Their copies over the bus, though, would go on the
//! copy stream ahead of layer `i`'s copies on demand and ahead — and the card's experts of layer `i` wait
//! on a flag the copy stream sets after those. So the copies wait here until the host has queued layer
//! `i`'s flag and its copies ahead, then go while the card computes (measured on an H100 host: about
//! 8 of them a token on q3u, 58 µs each over PCIe, that sat in front of the staged flags).
//!
//! Safe to delay: a victim's slot is overwritten only after the card passed every launch that may read it
//! (its old owner's layer is behind the card, or the owner is no longer resident when its layer's
//! choices are made), and a newcomer becomes resident only once the copy stream passed its copy, as at
//! once.

use poly_kernels::cuda::CudaResult;

use super::ExpertCache;
use crate::cpu::CpuWeights;

impl ExpertCache {
    /// Holds the admissions over the bus planned from here on until [`ExpertCache::queue_bus_admissions`]
    /// (`later`), or queues them as they are planned.
    pub fn hold_bus_admissions(&mut self, later: bool) {
        match (later, self.bus_later.is_some()) {
            (true, false) => self.bus_later = Some(Vec::new()),
            (false, true) => {
                // Nothing held may be lost: a caller stops holding only after queueing them.
                if let Some(held) = self.bus_later.take() {
                    for u in held {
                        self.policy.abandon(u.slot);
                    }
                }
            }
            _ => {}
        }
    }

    /// Queues the admissions held since the last call (none while not holding).
    pub fn queue_bus_admissions(&mut self, cpu: &CpuWeights) -> CudaResult<()> {
        let Some(held) = self.bus_later.as_mut() else {
            return Ok(());
        };
        if held.is_empty() {
            return Ok(());
        }
        let plan = std::mem::take(held);
        self.queue_uploads(cpu, &plan)
    }
}
