//! Numeric primitives of PolyStrata: quantization formats, dot products, matrix products, and (later) the
//! CUDA kernels under `kernels/cuda/`.
//!
//! This crate knows no model. It speaks of blocks, rows, matrices and vectors; which tensor of which
//! architecture a matrix is belongs to `poly-models` and the engine.
//!
//! - [`quant`]: every GGML block format the engine reads (layout, dequantization, activation quantization,
//!   dot products with run-time chosen AVX2/FMA code and a portable fallback, random valid blocks).
//! - [`hot_pool`]: worker threads that spin between jobs for a bounded time (a token's CPU share of
//!   experts, which must start within microseconds).
//! - [`matmul`]: matrix×vector and matrix×matrix over many threads for any of those formats.
//! - [`ops`]: norms, RoPE, softmax, attention, activations, top-k routing, recurrent steps.
//! - [`rng`]: a small deterministic generator, so synthetic models and tests are reproducible.
//! - [`options`]: the kernel-level knobs (variant and launch-shape switches), set once from the engine's
//!   flags.
//! - [`ggml_type`]: the GGML type table (ids, names, block sizes), the one part compiled without the default
//!   `compute` feature, for readers of GGUF files that never compute (the server).

pub mod ggml_type;
#[cfg(feature = "compute")]
pub mod hot_pool;
#[cfg(feature = "compute")]
pub mod matmul;
#[cfg(feature = "compute")]
pub mod ops;
pub mod options;
#[cfg(feature = "compute")]
pub mod quant;
#[cfg(feature = "compute")]
pub mod rng;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use ggml_type::GgmlType;
