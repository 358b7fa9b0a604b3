//! The `polystrata` server as a library: the binary (`src/main.rs`) and the integration tests call it.
//!
//! - [`text`]: everything about text: tokenizer directories from GGUF files, chat templates, and the
//!   reasoning / tool-call parsers of each model family.

pub mod text;
