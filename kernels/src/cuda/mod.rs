//! The CUDA backend of the kernels: a device with its stream ([`Device`]), typed device buffers
//! ([`DeviceBuffer`], [`BlockQ8_1`]), weights on the card ([`DeviceMatrix`], [`StackedExperts`] with the
//! [`ExpertTable`] the expert kernels read), the kernel modules compiled by NVRTC on first use with an on-disk
//! cache ([`module`]), the operations that launch them ([`ops`]), and CUDA graphs of them ([`LaunchGraph`],
//! [`Device::capture`]); the attention, recurrent (delta-net), prompt (matrix×matrix) and sampling
//! operations have modules of their own.
//!
//! cudarc loads the driver, NVRTC and cuBLAS at run time, so this module builds without a CUDA toolkit and
//! a program that has no GPU gets [`CudaError::NoDevice`] from [`Device::open`] instead of a failure to
//! start. The kernels' sources are `kernels/cuda/*.cu`; `kernels/cuda/README.md` explains the compilation
//! choice and how the engine will use this module.

pub mod attention;
pub mod attention_mma;
mod buffer;
mod device;
pub mod elementwise;
pub mod expert_slots;
mod formats;
pub mod fused;
mod graph;
mod host_flags;
mod launch;
pub mod module;
pub mod ops;
mod pinned;
pub mod prompt;
pub mod recurrent;
mod rope;
pub mod sample;
mod timing;

pub use buffer::{BlockQ8_1, DeviceBuffer, DeviceMatrix, ExpertTable, StackedExperts};
/// The element traits of device buffers (for code generic over what a buffer holds).
pub use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
pub use device::Device;
pub use formats::quantized_formats;
pub use graph::LaunchGraph;
pub use host_flags::HostFlags;
pub use module::{KernelModule, ModuleLoad, ModuleOrigin};
pub use pinned::{HostCopies, PinnedHost, HOST_COPIES_MAX};
pub use timing::TimingEvent;

use cudarc::driver::DriverError;

/// What can go wrong on the CUDA side.
#[derive(Debug)]
pub enum CudaError {
    /// There is no usable device: no driver library, no device, or no device of that ordinal. The one error
    /// a caller treats as "run on the CPU" (and tests as "skip").
    NoDevice(String),
    /// A driver call failed (launch, copy, allocation, or an earlier kernel's fault surfacing at a sync).
    Driver(DriverError),
    /// NVRTC could not compile a kernel module (the log says why) or could not be called.
    Compile { module: &'static str, log: String },
    /// Arguments that do not fit the operation (lengths, shapes, formats the GPU does not compute).
    Invalid(String),
}

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CudaError::NoDevice(why) => write!(f, "no CUDA device: {why}"),
            CudaError::Driver(e) => write!(f, "CUDA driver error: {e}"),
            CudaError::Compile { module, log } => {
                write!(f, "NVRTC could not compile {module}.cu: {log}")
            }
            CudaError::Invalid(why) => write!(f, "invalid CUDA operation: {why}"),
        }
    }
}

impl std::error::Error for CudaError {}

impl CudaError {
    /// Whether the driver ran out of device memory (an allocation that may succeed once some is freed).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, CudaError::Driver(d)
            if d.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)
    }
}

impl From<DriverError> for CudaError {
    fn from(e: DriverError) -> Self {
        CudaError::Driver(e)
    }
}

/// Result of the CUDA backend.
pub type CudaResult<T> = Result<T, CudaError>;
