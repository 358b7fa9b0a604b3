//! Parses arbitrary bytes as a GGUF header: never a panic, an out-of-bounds read or an absurd allocation;
//! whatever parses satisfies the header invariants and survives a round trip through the writer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use poly_models::gguf::parse_gguf_bytes;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = parse_gguf_bytes(data, "fuzz") {
        poly_fuzz::check_parsed(data, &h);
        poly_fuzz::exercise_accessors(&h.metadata);
    }
});
