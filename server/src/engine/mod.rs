//! The engine side of the server: one child process ([`process`]) and the supervisor that owns the loaded
//! model, runs requests one at a time in arrival order and switches models ([`supervisor`]).

pub mod memory;
pub mod process;
pub mod supervisor;
