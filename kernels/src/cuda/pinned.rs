//! Page-locked host memory for downloads the host waits on every step (a decode's logits): a copy into it
//! runs at the bus's rate with no staging through a driver buffer, which pageable memory needs.

use super::module::KernelModule;
use super::{CudaError, CudaResult, Device, DeviceBuffer};
use cudarc::driver::{sys, DeviceRepr, LaunchConfig, PinnedHostSlice, ValidAsZeroBits};

/// `len` values of `T` in page-locked host memory of one device's context.
pub struct PinnedHost<T> {
    slice: PinnedHostSlice<T>,
    /// The host address of the first element, taken once: cudarc's accessors synchronize the slice's
    /// event on every call (a driver call, some 240 a partly resident token through the MoE steps'
    /// buffers), while every copy into or out of it that this crate queues is ordered by the caller (a
    /// synchronize or a flag), as the unsafe queueing functions require.
    host: *mut T,
    /// Where the card's kernels reach it (the same address under unified addressing).
    device_address: u64,
}

// SAFETY: `host` points into `slice`'s allocation, which the value owns (cudarc's `PinnedHostSlice` is
// Send and Sync); shared access gives only `&[T]` and writing takes `&mut self`, as for a `Vec<T>`.
unsafe impl<T: Send> Send for PinnedHost<T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for PinnedHost<T> {}

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
        self.context().bind_to_thread()?;
        let mut device_address: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is the start of a page-locked allocation of this (current) context; flags must
        // be 0.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_address, ptr.cast(), 0) }
            .result()?;
        Ok(PinnedHost {
            slice,
            host: ptr,
            device_address,
        })
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
        dst.as_slice()
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
    /// copy (a synchronize). No driver call.
    pub fn as_slice(&self) -> CudaResult<&[T]> {
        // SAFETY: `host` is the start of the slice's `len` initialized (zeroed at allocation) elements,
        // alive as long as `self`; the card's writes into it are ordered before this read by the caller
        // (the contract of the queueing functions), and `&self` excludes the host's own writes.
        Ok(unsafe { std::slice::from_raw_parts(self.host, self.slice.len()) })
    }

    /// The host's view, to write. After [`super::ExpertTable::queue_group_upload`] from it, write only once
    /// the stream passed the copy. No driver call.
    pub fn as_mut_slice(&mut self) -> CudaResult<&mut [T]> {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only view.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.host, self.slice.len()) })
    }

    /// The host address of the first element (for a copy queued from it).
    pub(crate) fn host_ptr(&self) -> CudaResult<*const T> {
        Ok(self.host.cast_const())
    }

    /// Where the card's kernels reach the first element.
    pub(crate) fn device_address(&self) -> u64 {
        self.device_address
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

/// At most this many copies in one [`HostCopies`] launch (elementwise.cu's `HOST_COPIES_MAX`): a
/// segmented token's route point hands down five (ids, weights, input, the next layer's guess and
/// `--cache-bias`'s choices).
pub const HOST_COPIES_MAX: usize = 6;

/// The kernel's argument struct (`HostCopyArgs` in elementwise.cu), field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct HostCopyArgs {
    src: [u64; HOST_COPIES_MAX],
    dst: [u64; HOST_COPIES_MAX],
    words: [i32; HOST_COPIES_MAX],
    n_copies: i32,
}

// Passed by its bytes: a plain `repr(C)` struct of 64- and 32-bit numbers, laid out as the kernel's.
super::launch::value_args!(HostCopyArgs);

/// Copies between device buffers and page-locked host memory made by one kernel (`copy_words`) on the
/// compute stream instead of copy-engine transfers: a partly resident token hands over to the host and
/// back at every MoE layer, a few kilobytes each way, where each transfer between the kernels costs a
/// hand-off between the copy and compute engines. A graph being captured records the launch, so every
/// replay repeats the copies (reading the host memory as it is then).
#[derive(Clone, Debug, Default)]
pub struct HostCopies {
    args: HostCopyArgs,
}

impl HostCopies {
    /// No copies yet.
    pub fn new() -> HostCopies {
        HostCopies::default()
    }

    /// Adds the copy of `len.0` elements of `T` at `src` to `dst`, which holds `len.1`.
    fn push<T>(
        &mut self,
        (src, dst): (u64, u64),
        (src_len, dst_len): (usize, usize),
    ) -> CudaResult<&mut HostCopies> {
        if src_len != dst_len {
            return Err(CudaError::Invalid(format!(
                "host copy of {src_len} elements into {dst_len}"
            )));
        }
        let bytes = src_len * std::mem::size_of::<T>();
        let i = self.args.n_copies as usize;
        if i == HOST_COPIES_MAX || !bytes.is_multiple_of(4) || bytes / 4 > i32::MAX as usize {
            return Err(CudaError::Invalid(format!(
                "host copy {i} of {bytes} bytes: at most {HOST_COPIES_MAX} copies of whole 32-bit words"
            )));
        }
        self.args.src[i] = src;
        self.args.dst[i] = dst;
        self.args.words[i] = (bytes / 4) as i32;
        self.args.n_copies += 1;
        Ok(self)
    }

    /// Adds the copy of `src` into the host's `dst` (the same length).
    ///
    /// # Safety
    /// As [`Device::queue_download`]: the host reads `dst` only once the stream passed the launch, and
    /// keeps it alive as long as a queued launch or a graph holding it may run.
    pub unsafe fn download<T: DeviceRepr + ValidAsZeroBits>(
        &mut self,
        src: &DeviceBuffer<T>,
        dst: &mut PinnedHost<T>,
    ) -> CudaResult<&mut HostCopies> {
        self.push::<T>((src.address(), dst.device_address), (src.len(), dst.len()))
    }

    /// Adds the copy of the host's `src` into `dst` (the same length).
    ///
    /// # Safety
    /// As [`Device::queue_upload`]: `src` stays alive and unwritten until the stream passed the launch.
    pub unsafe fn upload<T: DeviceRepr + ValidAsZeroBits>(
        &mut self,
        src: &PinnedHost<T>,
        dst: &mut DeviceBuffer<T>,
    ) -> CudaResult<&mut HostCopies> {
        self.push::<T>((src.device_address, dst.address()), (src.len(), dst.len()))
    }

    /// Adds the copy of the host's `src` to the device address `dst`.
    ///
    /// # Safety
    /// `dst` must be the start of at least `src.len()` elements of device memory of this context, besides
    /// [`HostCopies::upload`]'s contract.
    pub(crate) unsafe fn upload_to<T: DeviceRepr + ValidAsZeroBits>(
        &mut self,
        src: &PinnedHost<T>,
        dst: u64,
    ) -> CudaResult<&mut HostCopies> {
        self.push::<T>((src.device_address, dst), (src.len(), src.len()))
    }

    /// Queues the copies as one launch (nothing for none).
    pub fn queue(&self, dev: &Device) -> CudaResult<()> {
        let a = &self.args;
        if a.n_copies == 0 {
            return Ok(());
        }
        let most = a.words.iter().copied().max().unwrap_or(0).max(1) as u32;
        let f = dev.function(KernelModule::Elementwise, "copy_words")?;
        let mut b = dev.launch_builder(&f);
        b.arg(a);
        let cfg = LaunchConfig {
            grid_dim: (most.div_ceil(256).min(16), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every copy's two ranges hold its words (checked against the buffers' lengths when it
        // was added, or the caller's contract for `upload_to`), each in device memory or page-locked host
        // memory of this context at its device address; the adders' contracts keep the host sides alive
        // and untouched while the launch may run.
        unsafe { b.launch(cfg) }?;
        dev.after_launch("copy_words")
    }
}

#[cfg(test)]
mod tests {
    use super::HOST_COPIES_MAX;

    /// The kernel's argument struct has the Rust side's number of copies.
    #[test]
    fn the_kernel_takes_as_many_copies_as_the_host_gives() {
        let cu = include_str!("../../cuda/elementwise.cu");
        assert!(cu.contains(&format!("#define HOST_COPIES_MAX {HOST_COPIES_MAX}\n")));
        assert!(cu.contains("unsigned long long src[HOST_COPIES_MAX];"));
    }
}
