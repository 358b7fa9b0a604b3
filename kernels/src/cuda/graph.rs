//! CUDA graphs of the compute stream: a fixed sequence of this crate's operations captured once and replayed
//! with one launch. The operations read everything that changes between replays (positions, expert ids,
//! routing weights, expert addresses, inputs) from device buffers, so a replay after [`Device::write`]s to
//! those buffers computes on the new values; the launch arguments themselves (buffer addresses, shapes) are
//! frozen in the graph, so the buffers must outlive it and keep their sizes.

use super::{CudaError, CudaResult, Device};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

/// A captured sequence of operations on a device's compute stream.
pub struct LaunchGraph {
    graph: CudaGraph,
}

impl std::fmt::Debug for LaunchGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LaunchGraph")
    }
}

// SAFETY: the graph's handles may be used from any thread (the launch binds the context first); CUDA
// forbids only concurrent use of one graph, which `&mut`-free replays still allow, so holders keep a graph
// behind a lock (the engine keeps it in its sequence slot's mutex) and it is not `Sync`.
unsafe impl Send for LaunchGraph {}

impl LaunchGraph {
    /// Queues one replay on the compute stream it was captured from.
    pub fn replay(&self) -> CudaResult<()> {
        Ok(self.graph.launch()?)
    }
}

impl Device {
    /// Captures the operations `record` queues on the compute stream into a graph (they do not run now).
    /// Every kernel module is loaded first, since loading is not allowed during a capture; `record` must
    /// not allocate, copy from the host or synchronize (the operations of [`super::ops`] do none of that). An
    /// error of `record` ends the capture and is returned.
    pub fn capture(
        &self,
        record: impl FnOnce(&Device) -> CudaResult<()>,
    ) -> CudaResult<LaunchGraph> {
        self.load_all_modules()?;
        if self.syncs_each_launch() {
            return Err(CudaError::Invalid(
                "graphs cannot be captured with POLY_CUDA_SYNC=1".into(),
            ));
        }
        // Relaxed: a kernel looked up for the first time during the capture is loaded then by the driver
        // (lazy module loading), which the stricter modes may refuse as an unsafe call during a capture.
        self.stream()
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let recorded = record(self);
        // End the capture whatever happened, so the stream is usable again.
        let ended = self.stream().end_capture(CUgraphInstantiate_flags(0));
        recorded?;
        match ended? {
            Some(graph) => Ok(LaunchGraph { graph }),
            None => Err(CudaError::Invalid("the capture recorded nothing".into())),
        }
    }

    /// Inside [`Device::capture`]'s `record`: ends the graph captured so far (returned) and starts the
    /// next one, so a sequence of operations with host work between some of them becomes consecutive
    /// graphs (the last is `capture`'s own). When the next capture cannot start, the stream is left
    /// outside capture and `capture` reports the failure.
    pub fn cut_capture(&self) -> CudaResult<LaunchGraph> {
        let ended = self.stream().end_capture(CUgraphInstantiate_flags(0))?;
        self.stream()
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        match ended {
            Some(graph) => Ok(LaunchGraph { graph }),
            None => Err(CudaError::Invalid(
                "a capture segment recorded nothing".into(),
            )),
        }
    }
}
