//! Arbitrary bytes as a picture (JPEG, PNG, WebP): an error or a well-formed picture, never a panic, an
//! unbounded allocation or a hang.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../src/targets.rs"]
mod targets;

fuzz_target!(|data: &[u8]| targets::picture(data));
