//! Arbitrary bytes as an HTTP/1.1 request stream to an in-process server (no model installed): every
//! answer is an HTTP response and `/health` still answers after.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../src/targets.rs"]
mod targets;

fuzz_target!(|data: &[u8]| targets::http_request(data));
