//! One CUDA device as the kernels use it: its context, the compute stream every operation is queued on, the
//! kernel modules loaded into it (compiled on first use, see [`super::module`]), and host↔device copies.
//!
//! Ordering: every operation of this crate goes on the one compute stream, in call order, so no event
//! tracking is needed and cudarc's is turned off (it would record events around every launch and get in the
//! way of CUDA graph capture). Work on other streams (the expert cache's uploads, later) orders itself
//! against this stream with explicit events. Launch errors are checked at every launch; a kernel's fault
//! surfaces at the next synchronizing call. `POLY_CUDA_SYNC=1` synchronizes after every launch, so a fault
//! is reported by the launch that caused it.

use super::module::{self, KernelModule, ModuleLoad};
use super::{CudaError, CudaResult, DeviceBuffer};
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, ValidAsZeroBits,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Loaded modules and looked-up functions of one device.
#[derive(Default)]
struct Loaded {
    modules: [Option<Arc<CudaModule>>; KernelModule::ALL.len()],
    functions: HashMap<&'static str, CudaFunction>,
    log: Vec<ModuleLoad>,
}

/// A CUDA device with its compute stream.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    compute_capability: (i32, i32),
    total_memory: usize,
    sync_each_launch: bool,
    /// Kernel launches queued so far (for profiles: launches per forward call).
    launches: AtomicU64,
    /// Whether launches are programmatic dependent launches now ([`Device::set_launch_rows`]).
    overlap_launches: AtomicBool,
    loaded: Mutex<Loaded>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ctx.ordinal())
            .field("name", &self.name)
            .field("compute_capability", &self.compute_capability)
            .field("total_memory", &self.total_memory)
            .finish()
    }
}

fn driver_present() -> CudaResult<()> {
    // SAFETY: only tries to open the driver library by its usual names.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::NoDevice(
            "the CUDA driver library (libcuda) was not found".to_string(),
        ))
    }
}

impl Device {
    /// How many CUDA devices there are; 0 when there is no driver or no device.
    pub fn count() -> usize {
        if driver_present().is_err() {
            return 0;
        }
        // `device_count` initializes the driver; a machine without a GPU answers with an error.
        CudaContext::device_count()
            .map(|n| n.max(0) as usize)
            .unwrap_or(0)
    }

    /// Opens device `ordinal`: its primary context and a new compute stream. [`CudaError::NoDevice`] when
    /// there is no driver, no device, or no device of that number.
    pub fn open(ordinal: usize) -> CudaResult<Arc<Device>> {
        driver_present()?;
        let count = match CudaContext::device_count() {
            Ok(n) => n.max(0) as usize,
            Err(e) => return Err(CudaError::NoDevice(format!("the driver found none ({e})"))),
        };
        if ordinal >= count {
            return Err(CudaError::NoDevice(format!(
                "device {ordinal} asked for, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: every CudaSlice of this crate is used on `stream` only (see the module documentation);
        // other streams order themselves with explicit events.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let name = ctx.name()?;
        let compute_capability = ctx.compute_capability()?;
        let total_memory = ctx.total_mem()?;
        let sync_each_launch = std::env::var_os("POLY_CUDA_SYNC").is_some_and(|v| v == "1");
        Ok(Arc::new(Device {
            ctx,
            stream,
            name,
            compute_capability,
            total_memory,
            sync_each_launch,
            launches: AtomicU64::new(0),
            overlap_launches: AtomicBool::new(crate::options::get().gpu.launch_overlap.for_rows(1)),
            loaded: Mutex::new(Loaded::default()),
        }))
    }

    /// The device's number.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name (`"NVIDIA H200"`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `(major, minor)`, e.g. `(9, 0)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// The architecture NVRTC compiles for: `sm_90`.
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }

    /// Bytes of device memory.
    pub fn total_memory(&self) -> usize {
        self.total_memory
    }

    /// `(free, total)` bytes of device memory now.
    pub fn memory_info(&self) -> CudaResult<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// The compute stream (for callers that queue their own work in order with the kernels').
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Waits for everything queued on the compute stream; reports any fault of a kernel run since.
    pub fn synchronize(&self) -> CudaResult<()> {
        Ok(self.stream.synchronize()?)
    }

    fn loaded(&self) -> MutexGuard<'_, Loaded> {
        // A panic while holding the lock leaves the maps consistent (entries are inserted whole).
        self.loaded.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Loads `module` into the context (compiling or reading the cache) if it is not loaded yet.
    fn ensure_module(
        &self,
        loaded: &mut Loaded,
        module: KernelModule,
    ) -> CudaResult<Arc<CudaModule>> {
        if let Some(m) = &loaded.modules[module.index()] {
            return Ok(m.clone());
        }
        let arch = self.arch();
        let (bytes, load) = module::cubin(module, &arch, false)?;
        let loaded_module = match self.ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bytes)) {
            Ok(m) => {
                loaded.log.push(load);
                m
            }
            Err(e) if load.origin == module::ModuleOrigin::Cached => {
                // A damaged or foreign cache file: compile again (which overwrites it).
                let _ = e;
                let (bytes, load) = module::cubin(module, &arch, true)?;
                let m = self
                    .ctx
                    .load_module(cudarc::nvrtc::Ptx::from_binary(bytes))?;
                loaded.log.push(load);
                m
            }
            Err(e) => return Err(e.into()),
        };
        loaded.modules[module.index()] = Some(loaded_module.clone());
        Ok(loaded_module)
    }

    /// Compiles (or reads from the cache) and loads every module now rather than at first use.
    pub fn load_all_modules(&self) -> CudaResult<()> {
        let mut loaded = self.loaded();
        for m in KernelModule::ALL {
            self.ensure_module(&mut loaded, m)?;
        }
        Ok(())
    }

    /// What was loaded so far and from where.
    pub fn module_log(&self) -> Vec<ModuleLoad> {
        self.loaded().log.clone()
    }

    /// The kernel `name` of `module`, loading the module on first use.
    pub(crate) fn function(
        &self,
        module: KernelModule,
        name: &'static str,
    ) -> CudaResult<CudaFunction> {
        let mut loaded = self.loaded();
        if let Some(f) = loaded.functions.get(name) {
            return Ok(f.clone());
        }
        let m = self.ensure_module(&mut loaded, module)?;
        let f = m.load_function(name).map_err(|e| {
            CudaError::Invalid(format!(
                "kernel {name} not found in {}.cu: {e}",
                module.name()
            ))
        })?;
        loaded.functions.insert(name, f.clone());
        Ok(f)
    }

    /// Kernel launches queued on this device so far (every operation of this crate counts its launches).
    pub fn launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    /// Whether `POLY_CUDA_SYNC=1` is in force.
    pub(crate) fn syncs_each_launch(&self) -> bool {
        self.sync_each_launch
    }

    /// Makes this device's context current on the calling thread (before a driver call of its own).
    pub(crate) fn bind(&self) -> CudaResult<()> {
        Ok(self.ctx.bind_to_thread()?)
    }

    /// Says how many rows (tokens) the launches queued from now on compute, which decides with
    /// `--gpu-pdl` whether they are programmatic dependent launches (`launch.rs`): the engine calls it at
    /// the start of each forward call. Until the first call, launches are taken as one row's.
    pub fn set_launch_rows(&self, rows: usize) {
        let overlap = crate::options::get().gpu.launch_overlap.for_rows(rows);
        self.overlap_launches.store(overlap, Ordering::Relaxed);
    }

    /// Whether the next launch is a programmatic dependent launch: sm_90 and later, as
    /// [`Device::set_launch_rows`] last decided.
    pub(crate) fn programmatic_launch(&self) -> bool {
        self.compute_capability.0 >= 9 && self.overlap_launches.load(Ordering::Relaxed)
    }

    /// Called after every launch: with `POLY_CUDA_SYNC=1`, waits and reports the kernel's own fault.
    pub(crate) fn after_launch(&self, name: &str) -> CudaResult<()> {
        self.launches.fetch_add(1, Ordering::Relaxed);
        if self.sync_each_launch {
            self.stream
                .synchronize()
                .map_err(|e| CudaError::Invalid(format!("kernel {name} failed: {e}")))?;
        }
        Ok(())
    }

    /// A new buffer holding a copy of `data` (queued on the compute stream; `data` is copied before this
    /// returns, since it is pageable memory).
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> CudaResult<DeviceBuffer<T>> {
        if data.is_empty() {
            return Err(CudaError::Invalid("upload of an empty slice".into()));
        }
        Ok(DeviceBuffer::from_slice(self.stream.clone_htod(data)?))
    }

    /// A new buffer of `len` zeros.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> CudaResult<DeviceBuffer<T>> {
        if len == 0 {
            return Err(CudaError::Invalid("allocation of zero elements".into()));
        }
        Ok(DeviceBuffer::from_slice(self.stream.alloc_zeros::<T>(len)?))
    }

    /// Overwrites `dst` with `src` (same length), in stream order.
    pub fn write<T: DeviceRepr>(&self, src: &[T], dst: &mut DeviceBuffer<T>) -> CudaResult<()> {
        if src.len() != dst.len() {
            return Err(CudaError::Invalid(format!(
                "write of {} elements into a buffer of {}",
                src.len(),
                dst.len()
            )));
        }
        self.stream.memcpy_htod(src, dst.slice_mut())?;
        Ok(())
    }

    /// Overwrites `dst` with the device buffer `src` (same length), in stream order (a graph captures it).
    pub fn copy<T: DeviceRepr>(
        &self,
        src: &DeviceBuffer<T>,
        dst: &mut DeviceBuffer<T>,
    ) -> CudaResult<()> {
        if src.len() != dst.len() {
            return Err(CudaError::Invalid(format!(
                "copy of {} elements into a buffer of {}",
                src.len(),
                dst.len()
            )));
        }
        self.stream.memcpy_dtod(src.slice(), dst.slice_mut())?;
        Ok(())
    }

    /// Copies the first `len` elements of the device buffer `src` into the first `len` of `dst`, in
    /// stream order (a buffer grown into a larger one).
    pub fn copy_prefix<T: DeviceRepr>(
        &self,
        src: &DeviceBuffer<T>,
        dst: &mut DeviceBuffer<T>,
        len: usize,
    ) -> CudaResult<()> {
        if len > src.len() || len > dst.len() {
            return Err(CudaError::Invalid(format!(
                "copy of {len} elements from a buffer of {} into one of {}",
                src.len(),
                dst.len()
            )));
        }
        if len == 0 {
            return Ok(());
        }
        let from = src.slice().slice(0..len);
        let mut to = dst.slice_mut().slice_mut(0..len);
        self.stream.memcpy_dtod(&from, &mut to)?;
        Ok(())
    }

    /// Overwrites `dst[offset..offset + src.len()]` with `src`, in stream order.
    pub fn write_at<T: DeviceRepr>(
        &self,
        src: &[T],
        dst: &mut DeviceBuffer<T>,
        offset: usize,
    ) -> CudaResult<()> {
        if offset + src.len() > dst.len() {
            return Err(CudaError::Invalid(format!(
                "write of {} elements at {offset} into a buffer of {}",
                src.len(),
                dst.len()
            )));
        }
        if src.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice_mut().slice_mut(offset..offset + src.len());
        self.stream.memcpy_htod(src, &mut view)?;
        Ok(())
    }

    /// A host copy of `src[offset..offset + len]`, after everything queued before it.
    pub fn download_range<T: DeviceRepr + Clone + Default>(
        &self,
        src: &DeviceBuffer<T>,
        offset: usize,
        len: usize,
    ) -> CudaResult<Vec<T>> {
        if offset + len > src.len() {
            return Err(CudaError::Invalid(format!(
                "read of {len} elements at {offset} from a buffer of {}",
                src.len()
            )));
        }
        let mut out = vec![T::default(); len];
        if len > 0 {
            let view = src.slice().slice(offset..offset + len);
            self.stream.memcpy_dtoh(&view, &mut out)?;
            self.stream.synchronize()?;
        }
        Ok(out)
    }

    /// A host copy of `src`, after everything queued before it.
    pub fn download<T: DeviceRepr + Clone + Default>(
        &self,
        src: &DeviceBuffer<T>,
    ) -> CudaResult<Vec<T>> {
        Ok(self.stream.clone_dtoh(src.slice())?)
    }
}
