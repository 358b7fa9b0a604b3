//! The PolyStrata engine as a library: a loaded model ([`model`]), its CPU backend ([`cpu`]), sequence
//! state ([`state`]), sampling ([`sample`]), the generation loop ([`generate`]) and the engine process
//! serving the line protocol ([`serve`]), the calibration of synthetic models' routers on their own
//! forward pass ([`calibrate`]) and the measured agreement of a model's draft block with it
//! ([`draft_agreement`]). The `poly-engine` binary's command line is built on it.

pub mod calibrate;
pub mod cpu;
pub mod draft_agreement;
pub mod generate;
pub mod gpu;
pub mod knobs;
pub mod model;
pub mod sample;
pub mod serve;
pub mod state;

pub use model::{EngineError, Model};
