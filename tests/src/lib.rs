//! Cross-crate integration tests and their fixtures.
//!
//! The tests live in `tests/tests/*.rs`; the fixtures (small GGUF files, reference values written by
//! independent implementations such as the `gguf` PyPI package and llama.cpp) live in `tests/fixtures/`.
//! This library locates the fixtures, so every test finds them the same way, and holds the llama.cpp
//! witness comparison ([`witness`]) that the CPU and GPU witness tests share.

use std::path::PathBuf;

/// The folder holding the committed fixtures.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

pub mod witness;
