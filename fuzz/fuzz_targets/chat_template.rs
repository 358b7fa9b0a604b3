//! Arbitrary bytes as a chat template (to the first NUL) and its messages (JSON, after it): compiling,
//! probing and rendering return, within the output and string bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../src/targets.rs"]
mod targets;

fuzz_target!(|data: &[u8]| targets::chat_template(data));
