//! The GGUF file format and the model architectures PolyStrata runs.
//!
//! - `gguf`: reading files in place (memory-mapped, tensor views borrow the mapping), split files, typed
//!   metadata accessors, and a writer.
//! - `arch`: one file per architecture (hyperparameters from metadata, tensor name tables, and later the
//!   layer math as hooks the engine calls).
//! - `synth`: synthetic models of the real layouts, written directly in their target types.
//!
//! This crate knows no process, protocol or device: it describes files and models, the engine runs them.

pub mod arch;
pub mod gguf;
pub mod synth;

pub use gguf::{GgufError, GgufFile, GgufWriter, TensorInfo, Value};
pub mod compute;
pub mod summary;
