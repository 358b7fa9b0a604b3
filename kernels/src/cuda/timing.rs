//! Timing on the card: events recorded on the compute stream between operations, whose differences are the
//! device time spent between them (the engine's `POLY_GPU_PROFILE` mode reads them after a call's final
//! synchronization), and the count of kernel launches the device has queued.

use super::{CudaResult, Device};
use cudarc::driver::{sys, CudaEvent};

/// A timing event of one device.
pub struct TimingEvent {
    event: CudaEvent,
}

impl std::fmt::Debug for TimingEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TimingEvent")
    }
}

impl TimingEvent {
    /// Marks the point the compute stream has reached (everything queued before completes first).
    pub fn record(&self, dev: &Device) -> CudaResult<()> {
        Ok(self.event.record(dev.stream())?)
    }

    /// Milliseconds of device time from `self` to `end`, both recorded; waits for both.
    pub fn elapsed_ms(&self, end: &TimingEvent) -> CudaResult<f32> {
        Ok(self.event.elapsed_ms(&end.event)?)
    }
}

impl Device {
    /// A new timing event (not recorded yet).
    pub fn timing_event(&self) -> CudaResult<TimingEvent> {
        let event = self
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        Ok(TimingEvent { event })
    }
}
