//! Page-locked host memory for downloads the host waits on every step (a decode's logits): a copy into it
//! runs at the bus's rate with no staging through a driver buffer, which pageable memory needs.

use super::{CudaError, CudaResult, Device, DeviceBuffer};
use cudarc::driver::{DeviceRepr, PinnedHostSlice, ValidAsZeroBits};

/// `len` values of `T` in page-locked host memory of one device's context.
pub struct PinnedHost<T> {
    slice: PinnedHostSlice<T>,
}

impl<T> std::fmt::Debug for PinnedHost<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedHost[{}]", self.slice.len())
    }
}

impl Device {
    /// `len` zeros in page-locked host memory.
    pub fn pinned<T: DeviceRepr + ValidAsZeroBits + Copy>(
        &self,
        len: usize,
    ) -> CudaResult<PinnedHost<T>> {
        if len == 0 {
            return Err(CudaError::Invalid(
                "pinned allocation of zero elements".into(),
            ));
        }
        // SAFETY: flags 0 is plain page-locked memory (not write-combined: the host reads it); the memory
        // is zeroed below before anything reads it, and all-zero bytes are a valid `T`.
        let mut slice = unsafe { self.context().alloc_pinned_with_flags::<T>(len, 0) }?;
        let ptr = slice.as_mut_ptr()?;
        // SAFETY: `ptr` points to `len` elements just allocated for this slice.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedHost { slice })
    }

    /// Copies `src` into `dst` (the same length) after everything queued before, waits, and returns the
    /// host copy.
    pub fn download_pinned<'a, T: DeviceRepr + ValidAsZeroBits>(
        &self,
        src: &DeviceBuffer<T>,
        dst: &'a mut PinnedHost<T>,
    ) -> CudaResult<&'a [T]> {
        if src.len() != dst.slice.len() {
            return Err(CudaError::Invalid(format!(
                "download of {} elements into {} pinned",
                src.len(),
                dst.slice.len()
            )));
        }
        self.stream().memcpy_dtoh(src.slice(), &mut dst.slice)?;
        // Spin on the stream (the pinned slice's own event waits by yielding, which wakes later).
        self.synchronize()?;
        Ok(dst.slice.as_slice()?)
    }
}

impl<T: ValidAsZeroBits> PinnedHost<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// Whether it holds none (never: allocations are of at least one element).
    pub fn is_empty(&self) -> bool {
        self.slice.is_empty()
    }

    /// The host's view. After [`Device::queue_download`] into it, read only once the stream passed the
    /// copy (a synchronize).
    pub fn as_slice(&self) -> CudaResult<&[T]> {
        Ok(self.slice.as_slice()?)
    }

    /// The host's view, to write. After [`super::ExpertTable::queue_group_upload`] from it, write only once
    /// the stream passed the copy.
    pub fn as_mut_slice(&mut self) -> CudaResult<&mut [T]> {
        Ok(self.slice.as_mut_slice()?)
    }

    /// The host address of the first element (for a copy queued from it).
    pub(crate) fn host_ptr(&self) -> CudaResult<*const T> {
        Ok(self.slice.as_ptr()?)
    }
}

impl Device {
    /// Queues a copy of `src` into `dst` (the same length) on the compute stream and returns at once; a
    /// graph being captured records it as a node, so every replay repeats it.
    ///
    /// # Safety
    /// The host must not touch `dst`'s elements until the stream passed the copy (a synchronize after
    /// the call, or after the replay of the graph that holds it), and must keep `dst` alive as long as a
    /// queued copy or a graph holding it may still run.
    pub unsafe fn queue_download<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        src: &DeviceBuffer<T>,
        dst: &mut PinnedHost<T>,
    ) -> CudaResult<()> {
        if src.len() != dst.slice.len() {
            return Err(CudaError::Invalid(format!(
                "queued download of {} elements into {} pinned",
                src.len(),
                dst.slice.len()
            )));
        }
        let ptr = dst.slice.as_mut_ptr()?;
        // SAFETY: `ptr[..len]` is page-locked memory of this context of the same length as `src`; the
        // caller keeps it alive and untouched until the copy ran (this function's contract).
        unsafe {
            let host = std::slice::from_raw_parts_mut(ptr, src.len());
            cudarc::driver::result::memcpy_dtoh_async(
                host,
                src.address(),
                self.stream().cu_stream(),
            )?;
        }
        Ok(())
    }

    /// Queues a copy of the page-locked `src` into `dst` (the same length) on the stream, after
    /// everything queued before; a graph being captured records it as a node, which reads `src` when it
    /// runs.
    ///
    /// # Safety
    /// `src` must stay alive and unwritten until the copy ran (the stream passed it).
    pub unsafe fn queue_upload<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        src: &PinnedHost<T>,
        dst: &mut DeviceBuffer<T>,
    ) -> CudaResult<()> {
        if src.slice.len() != dst.len() {
            return Err(CudaError::Invalid(format!(
                "queued upload of {} pinned elements into {}",
                src.slice.len(),
                dst.len()
            )));
        }
        let ptr = src.host_ptr()?;
        // SAFETY: `ptr[..len]` is page-locked memory of this context of the same length as `dst`; the
        // caller keeps it alive and unwritten until the copy ran (this function's contract).
        unsafe {
            let host = std::slice::from_raw_parts(ptr, dst.len());
            cudarc::driver::result::memcpy_htod_async(
                dst.address(),
                host,
                self.stream().cu_stream(),
            )?;
        }
        Ok(())
    }
}
