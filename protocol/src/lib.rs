//! The line protocol between `polystrata` (the server) and `poly-engine` (one child per model).
//!
//! This crate owns the wire format: one message per line, a verb, one space, a JSON object. Both sides use
//! it; neither writes its own parser. It knows nothing of tensors, kernels or HTTP.
//!
//! The format is specified by the issue "poly-engine as a process"; until that work lands this crate holds
//! only the protocol version, so that nothing pretends to speak a protocol that is not written yet.

/// The protocol version the engine announces in its `READY` line.
pub const PROTOCOL_VERSION: u32 = 1;
