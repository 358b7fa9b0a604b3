//! The server's text side: what turns a conversation into a prompt and the engine's tokens back into an
//! answer. The engine only sees token ids.
//!
//! - [`vocab`]: the tokenizer arrays of a GGUF file (`tokenizer.ggml.*`) and llama.cpp's reading of them
//!   (token kinds, end-of-generation tokens, the BOS/EOS rule).
//! - [`pretokenize`]: llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre` name.
//! - [`hf_json`]: the vocabulary as a Hugging Face `tokenizer.json` (byte-level BPE or SentencePiece).
//! - [`tokenizer_dir`]: `polystrata tokenizer --gguf FILE --out DIR` and loading such a directory back
//!   ([`tokenizer_dir::TextTokenizer`]).
//! - [`template`]: chat templates (minijinja, sandboxed) and the messages / tools they render.
//! - [`family`]: which reasoning and tool-call format a model writes.
//! - [`parse`]: the incremental parser of reasoning and tool calls, shared by streaming and non-streaming.

pub mod family;
pub mod hf_json;
pub mod parse;
pub mod pretokenize;
pub mod template;
pub mod tokenizer_dir;
pub mod vocab;

/// An error of the text side, with a message fit for a log or an API error body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextError(pub String);

impl std::fmt::Display for TextError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TextError {}

impl TextError {
    /// An error with this message.
    pub fn new(msg: impl Into<String>) -> Self {
        TextError(msg.into())
    }
}

/// Results of the text side.
pub type Result<T> = std::result::Result<T, TextError>;
