//! The activation of a forward call on the card ([`DevAct`]): a `[rows, cols]` f32 buffer from the call's
//! pool, named by an id unique within the call (the key of the quantized-input cache).

use std::rc::Rc;

use poly_kernels::cuda::{CudaError, CudaResult, DeviceBuffer};

use super::super::pool::Pool;

/// A `[rows, cols]` f32 activation on the card; its buffer goes back to the pool when dropped.
pub struct DevAct {
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Unique within the call: names the activation in the quantized-input cache.
    pub(super) id: u64,
    pub(super) buf: Option<DeviceBuffer<f32>>,
    pub(super) pool: Rc<Pool>,
}

impl Drop for DevAct {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.put_f32(b);
        }
    }
}

impl DevAct {
    pub(super) fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub(super) fn buf(&self) -> CudaResult<&DeviceBuffer<f32>> {
        self.buf
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("an activation without data".into()))
    }

    pub(super) fn buf_mut(&mut self) -> CudaResult<&mut DeviceBuffer<f32>> {
        self.buf
            .as_mut()
            .ok_or_else(|| CudaError::Invalid("an activation without data".into()))
    }
}
