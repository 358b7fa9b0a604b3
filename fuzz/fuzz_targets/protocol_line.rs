//! Arbitrary bytes as a protocol line, read by both sides (`ToEngine`, `FromEngine`) and by the bounded
//! line reader: never a panic; whatever parses round-trips.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../src/targets.rs"]
mod targets;

fuzz_target!(|data: &[u8]| targets::protocol_line(data));
