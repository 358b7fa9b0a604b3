//! `poly-engine`: one child process per loaded model.
fn main() {}
