//! The GGUF file format and the model architectures PolyStrata runs.
//!
//! - `gguf`: reading files in place (memory-mapped, tensor views borrow the mapping), split files, typed
//!   metadata accessors, and a writer.
//! - `arch`: one file per architecture (hyperparameters from metadata, tensor name tables, and later the
//!   layer math as hooks the engine calls).
//! - `synth`: synthetic models of the real layouts, written directly in their target types.
//! - `vision`: the vision encoders of projector (`mmproj`) files, one file per projector type, and picture
//!   decoding and resizing.
//!
//! This crate knows no process, protocol or device: it describes files and models, the engine runs them.

//!
//! Without the default `compute` feature only `gguf` and `summary` compile (and poly-kernels without its
//! numeric code): what a process that reads GGUF metadata but never runs a model needs (the server).

#[cfg(feature = "compute")]
pub mod arch;
pub mod gguf;
#[cfg(feature = "compute")]
pub mod synth;
#[cfg(feature = "compute")]
pub mod vision;

pub use gguf::{GgufError, GgufFile, GgufWriter, TensorInfo, Value};
#[cfg(feature = "compute")]
pub mod compute;
pub mod summary;

/// The architectures the engine runs, by `general.architecture`: also without `compute`, so that the
/// server's registry can mark other files unavailable. Kept equal to `arch::ARCH_NAMES` (tested).
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "qwen3moe",
    "qwen35moe",
    "clover_moe",
    "gemma3",
    "llama",
    "lfm2moe",
    "gemma4",
    "glm5-next",
    "deepseek4",
];

#[cfg(all(test, feature = "compute"))]
mod tests {
    #[test]
    fn supported_architectures_match_the_arch_modules() {
        assert_eq!(super::SUPPORTED_ARCHITECTURES, super::arch::ARCH_NAMES);
    }
}
