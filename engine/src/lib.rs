//! The PolyStrata engine as a library: a loaded model ([`model`]), its CPU backend ([`cpu`]), sequence
//! state ([`state`]), sampling ([`sample`]) and the generation loop ([`generate`]). The `poly-engine`
//! binary's command line is built on it.

pub mod cpu;
pub mod generate;
pub mod model;
pub mod sample;
pub mod state;

pub use model::{EngineError, Model};
