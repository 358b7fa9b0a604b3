//! The one launch path of every kernel: arguments collected as cudarc's builder collects them, the launch
//! made with `cuLaunchKernelEx` so it can carry *programmatic dependent launch* (PDL, sm_90+).
//!
//! Why: one token's forward is a chain of a thousand short dependent kernels, and on the H200 it is bound by
//! the gaps between them, not by memory (BENCHMARKS.md: 3.8 ms of device span a qwen3moe token for 1.3 GB,
//! 0.34 TB/s of the card's 4.3). A kernel launched with the programmatic-serialization attribute may start
//! as soon as the kernel before it on the stream has *triggered* (`griddepcontrol.launch_dependents`), not
//! when it has finished: its blocks are scheduled and their prologue runs while the previous kernel still
//! computes, and they block in `griddepcontrol.wait` until that kernel has completed and its writes are
//! visible. CUDA graph capture keeps these edges, so the decode graphs gain the same.
//!
//! The contract that keeps this exact: every kernel of this crate starts with `launch_prologue()`
//! (common.cuh), which waits first and then triggers, before it touches global memory. So a kernel never
//! reads what the one before it has not finished writing, nor writes what that one still reads; and because
//! each kernel's completion follows its own wait, completion is transitive along the stream (at most two
//! kernels are in flight: the running one and the next, waiting). One exception, which reads nothing:
//! `launch_prologue_prefetch(...)` first asks the L2 cache for the kernel's weights (a hint that changes no
//! value, `--gpu-prefetch`), so their fetch overlaps the kernel before it. The source test
//! `every_kernel_starts_with_the_launch_prologue` checks the contract on every `__global__` function.
//! Launches of other libraries (cuBLAS) and copies on the stream keep their full serialization: the
//! attribute relaxes only the edge into a kernel launched here, from the one before it.
//!
//! Which launches carry the attribute is `--gpu-pdl` ([`crate::options::LaunchOverlap`]): by default those
//! of one-token calls (the engine says a call's rows with `Device::set_launch_rows`), where it was measured
//! to pay; a launch without it is plain stream order and its prologue's wait returns at once.

use std::ffi::c_void;

use cudarc::driver::{sys, CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

use super::{CudaResult, Device};

/// One kernel argument: where its bytes are, or a device address to pass by value.
#[derive(Clone, Copy)]
pub(crate) enum Arg {
    /// A host value the caller keeps alive until the launch (scalars, argument structs).
    Value(*const c_void),
    /// A device buffer's address, stored here so the driver can read it at the launch.
    Address(sys::CUdeviceptr),
}

/// More parameters than any kernel of this crate takes (18 at most today).
const MAX_KERNEL_ARGS: usize = 32;

/// A launch's arguments, held inline: a launch allocates nothing (prompt calls queue ~1,700 of them).
pub(crate) struct Args {
    items: [Arg; MAX_KERNEL_ARGS],
    len: usize,
    /// More than [`MAX_KERNEL_ARGS`] were pushed: the launch refuses.
    overflow: bool,
}

impl Args {
    pub(crate) fn push(&mut self, arg: Arg) {
        match self.items.get_mut(self.len) {
            Some(slot) => {
                *slot = arg;
                self.len += 1;
            }
            None => self.overflow = true,
        }
    }
}

/// A kernel launch being built: [`Device::launch_builder`], then [`KernelLaunch::arg`] per parameter in the
/// kernel's order, then [`KernelLaunch::launch`].
pub(crate) struct KernelLaunch<'a> {
    dev: &'a Device,
    func: &'a CudaFunction,
    args: Args,
}

/// What can be passed to a kernel parameter: device buffers (their address) and plain values (their bytes,
/// which must match the parameter's C type).
pub(crate) trait KernelArg<'a> {
    fn push(self, stream: &cudarc::driver::CudaStream, args: &mut Args);
}

impl<'a, T> KernelArg<'a> for &'a CudaSlice<T> {
    fn push(self, stream: &cudarc::driver::CudaStream, args: &mut Args) {
        // With event tracking off (Device::open) the guard records nothing.
        let (ptr, _guard) = self.device_ptr(stream);
        args.push(Arg::Address(ptr));
    }
}

impl<'a, T> KernelArg<'a> for &'a mut CudaSlice<T> {
    fn push(self, stream: &cudarc::driver::CudaStream, args: &mut Args) {
        let (ptr, _guard) = self.device_ptr_mut(stream);
        args.push(Arg::Address(ptr));
    }
}

/// Plain values passed by their bytes: the scalars here, and the `#[repr(C)]` argument structs of the
/// kernels' own modules (each names itself with this macro where it is defined).
macro_rules! value_args {
    ($($t:ty),* $(,)?) => {
        $(impl<'a> $crate::cuda::launch::KernelArg<'a> for &'a $t {
            fn push(self, _stream: &cudarc::driver::CudaStream, args: &mut $crate::cuda::launch::Args) {
                args.push($crate::cuda::launch::Arg::Value(self as *const $t as *const std::ffi::c_void));
            }
        })*
    };
}
value_args!(i32, u32, i64, u64, f32);
pub(crate) use value_args;

impl Device {
    /// A launch of `func` on this device's compute stream.
    pub(crate) fn launch_builder<'a>(&'a self, func: &'a CudaFunction) -> KernelLaunch<'a> {
        KernelLaunch {
            dev: self,
            func,
            args: Args {
                items: [Arg::Address(0); MAX_KERNEL_ARGS],
                len: 0,
                overflow: false,
            },
        }
    }
}

impl<'a> KernelLaunch<'a> {
    /// The next kernel parameter.
    pub(crate) fn arg(&mut self, arg: impl KernelArg<'a>) -> &mut Self {
        arg.push(self.dev.stream(), &mut self.args);
        self
    }

    /// Queues the kernel on the compute stream, as a programmatic dependent launch where the device and
    /// `--gpu-pdl` allow it.
    ///
    /// # Safety
    /// The arguments must be the kernel's parameters, in order and of matching types, and every buffer
    /// the kernel reads or writes must be large enough for `cfg` (each caller checks its lengths).
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig) -> CudaResult<()> {
        if self.args.overflow {
            return Err(super::CudaError::Invalid(format!(
                "a kernel launch of more than {MAX_KERNEL_ARGS} arguments"
            )));
        }
        self.dev.bind()?;
        let mut params = [std::ptr::null_mut::<c_void>(); MAX_KERNEL_ARGS];
        for (param, arg) in params.iter_mut().zip(&self.args.items[..self.args.len]) {
            *param = match arg {
                Arg::Value(p) => *p as *mut c_void,
                Arg::Address(addr) => addr as *const sys::CUdeviceptr as *mut c_void,
            };
        }
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let pdl = self.dev.programmatic_launch();
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.dev.stream().cu_stream(),
            attrs: if pdl { &mut attr } else { std::ptr::null_mut() },
            numAttrs: u32::from(pdl),
        };
        // SAFETY: `params` points at one value per kernel parameter (the caller's contract), each alive
        // until this call returns (values borrowed for 'a, addresses stored in `self.args`, which is not
        // touched while `params` lives); the driver reads the first `len` and copies them before returning.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()?;
        }
        Ok(())
    }
}

/// The kernels of `source` whose body does not start with `launch_prologue();` (the contract above).
#[cfg(test)]
fn kernels_without_prologue(source: &str) -> Vec<String> {
    const KEY: &str = "__global__";
    let mut missing = Vec::new();
    let mut from = 0;
    while let Some(found) = source[from..].find(KEY) {
        let at = from + found;
        from = at + KEY.len();
        let line_start = source[..at].rfind('\n').map_or(0, |i| i + 1);
        if source[line_start..at].contains("//") {
            continue; // in a comment
        }
        let after = &source[from..];
        let Some(open) = after.find('{') else { break };
        if after[..open].contains(';') {
            continue; // a declaration
        }
        let body = after[open + 1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
        // launch_prologue_prefetch*(...): the weights' prefetch, then the prologue (common.cuh).
        if !body.starts_with("launch_prologue();") && !body.starts_with("launch_prologue_prefetch")
        {
            missing.push(
                after[..open]
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" "),
            );
        }
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::KernelModule;

    #[test]
    fn every_kernel_starts_with_the_launch_prologue() {
        let mut kernels = 0;
        for module in KernelModule::ALL {
            let src = module.source();
            kernels += src.matches("__global__").count();
            let missing = kernels_without_prologue(&src);
            assert!(missing.is_empty(), "{}: {missing:?}", module.name());
        }
        assert!(kernels > 50, "{kernels} kernels found");
    }

    #[test]
    fn a_kernel_without_the_prologue_is_found() {
        let src = "// a __global__ in a comment {\n\
                   extern \"C\" __global__ void good(int n) {\n    launch_prologue();\n}\n\
                   extern \"C\" __global__ void ahead(const float * w, int n) {\n    launch_prologue_prefetch(w, n);\n}\n\
                   #define E(x) extern \"C\" __global__ void m_##x(int n) { launch_prologue(); \\\n  f(n); }\n\
                   extern \"C\" __global__ void bad(const float * x,\n int n) {\n    float v = x[0];\n}\n\
                   extern __shared__ float s[];\n";
        assert_eq!(
            kernels_without_prologue(src),
            ["void bad(const float * x, int n)"]
        );
    }
}
