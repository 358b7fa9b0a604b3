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
