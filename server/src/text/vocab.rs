//! The tokenizer arrays of a GGUF file and llama.cpp's reading of them.
//!
//! llama.cpp derives more than the arrays say: which tokens end generation (by their text), which tokens
//! count as control tokens, and whether BOS/EOS are added (a default per tokenizer model and pre-tokenizer,
//! overridden by `tokenizer.ggml.add_bos_token` / `add_eos_token`). This module repeats those rules
//! (`src/llama-vocab.cpp`, `llama_vocab::impl::load`) so that the server tokenizes and stops as llama.cpp
//! does.

use super::{Result, TextError};
use poly_models::GgufFile;
use std::collections::HashMap;
use std::path::Path;

/// Token types as GGUF stores them (llama.cpp's `llama_token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenKind {
    /// The kind of a GGUF `token_type` value; unknown values read as `Normal`, as llama.cpp's attributes do.
    pub fn from_gguf(t: i32) -> TokenKind {
        match t {
            0 => TokenKind::Undefined,
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            _ => TokenKind::Normal,
        }
    }

    /// The name written in the tokenizer config.
    pub fn name(self) -> &'static str {
        match self {
            TokenKind::Undefined => "undefined",
            TokenKind::Normal => "normal",
            TokenKind::Unknown => "unknown",
            TokenKind::Control => "control",
            TokenKind::UserDefined => "user_defined",
            TokenKind::Unused => "unused",
            TokenKind::Byte => "byte",
        }
    }

    /// Tokens that are split out of the text before the tokenizer model runs (llama.cpp's special-token
    /// cache: control, user-defined and unknown tokens).
    pub fn is_special(self) -> bool {
        matches!(
            self,
            TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown
        )
    }
}

/// Which tokenizer model the GGUF names (`tokenizer.ggml.model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VocabModel {
    /// `gpt2`: byte-level BPE with ranked merges.
    BytePairGpt2,
    /// `llama`: SentencePiece with scores and byte fallback.
    SentencePiece,
    /// `gemma4`: BPE with ranked merges over raw UTF-8 (no byte alphabet), spaces as `▁`, byte
    /// fallback, the text split only at runs of newlines (llama.cpp's SentencePiece-style BPE).
    BytePairSpm,
}

/// Token texts llama.cpp treats as end of generation (`special_eog_ids`), whatever their type.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// FIM tokens llama.cpp also ends generation on (pad, repo, file separator).
const EOG_FIM_TEXTS: &[&str] = &[
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "[PAD]",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

/// The tokenizer of a GGUF file as llama.cpp reads it.
#[derive(Clone, Debug)]
pub struct GgufVocab {
    pub model: VocabModel,
    /// `tokenizer.ggml.pre` (`"default"` when absent, as llama.cpp assumes).
    pub pre: String,
    pub tokens: Vec<String>,
    pub kinds: Vec<TokenKind>,
    /// SentencePiece scores (empty for BPE files without them).
    pub scores: Vec<f32>,
    /// BPE merges, `"left right"`, in rank order.
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    /// SentencePiece: a space is put before text that follows a special token or starts the input.
    pub add_space_prefix: bool,
    /// Tokens that end generation, ascending.
    pub eog_ids: Vec<u32>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
    /// `tokenizer.chat_template.<name>` (e.g. `tool_use`), by name.
    pub named_templates: Vec<(String, String)>,
    /// `general.architecture`.
    pub architecture: String,
    /// `general.name`.
    pub name: Option<String>,
}

fn gguf_err(path: &Path, e: impl std::fmt::Display) -> TextError {
    TextError::new(format!("{}: {e}", path.display()))
}

impl GgufVocab {
    /// Opens `path` (memory-mapped; only metadata is read) and reads its tokenizer.
    pub fn open(path: &Path) -> Result<GgufVocab> {
        let file = GgufFile::open(path).map_err(|e| gguf_err(path, e))?;
        GgufVocab::from_file(&file).map_err(|e| gguf_err(path, e))
    }

    /// Reads the tokenizer of an open GGUF file.
    pub fn from_file(file: &GgufFile) -> Result<GgufVocab> {
        let md = file.metadata();
        let e = |e: poly_models::GgufError| TextError::new(e.to_string());
        let model_name = md.tokenizer_model().map_err(e)?;
        let model = match model_name {
            "gpt2" => VocabModel::BytePairGpt2,
            "llama" => VocabModel::SentencePiece,
            "gemma4" => VocabModel::BytePairSpm,
            other => {
                return Err(TextError::new(format!(
                    "tokenizer model '{other}' is not supported (gpt2, llama and gemma4 are)"
                )))
            }
        };
        let pre = md
            .tokenizer_pre()
            .map_err(e)?
            .unwrap_or("default")
            .to_string();
        let tokens = md.tokenizer_tokens().map_err(e)?.to_vec();
        let n = tokens.len();
        let mut kinds: Vec<TokenKind> = match md.tokenizer_token_types().map_err(e)? {
            Some(t) if t.len() == n => t.iter().map(|&t| TokenKind::from_gguf(t)).collect(),
            Some(t) => {
                return Err(TextError::new(format!(
                    "{} token types for {n} tokens",
                    t.len()
                )))
            }
            None => vec![TokenKind::Normal; n],
        };
        let scores = match md.tokenizer_scores().map_err(e)? {
            Some(s) if s.len() == n => s.to_vec(),
            Some(s) => return Err(TextError::new(format!("{} scores for {n} tokens", s.len()))),
            None => Vec::new(),
        };
        let merges = md.tokenizer_merges().map_err(e)?.unwrap_or(&[]).to_vec();
        if model != VocabModel::SentencePiece && merges.is_empty() {
            return Err(TextError::new(format!(
                "a {model_name} tokenizer without tokenizer.ggml.merges"
            )));
        }
        let id = |key: &str| -> Result<Option<u32>> {
            let v = md.get_u32(key).map_err(e)?;
            Ok(v.filter(|&v| (v as usize) < n))
        };
        let bos_id = id("tokenizer.ggml.bos_token_id")?;
        let eos_id = id("tokenizer.ggml.eos_token_id")?;
        let unk_id = id("tokenizer.ggml.unknown_token_id")?;
        let pad_id = id("tokenizer.ggml.padding_token_id")?;
        let eot_id = id("tokenizer.ggml.eot_token_id")?;
        let eom_id = id("tokenizer.ggml.eom_token_id")?;

        // llama.cpp's defaults by model and pre-tokenizer, then the file's own keys.
        let (mut add_bos, mut add_space_prefix) = match model {
            VocabModel::SentencePiece => (true, true),
            VocabModel::BytePairGpt2 => (super::pretokenize::adds_bos(&pre), false),
            VocabModel::BytePairSpm => (false, false),
        };
        let mut add_eos = false;
        if let Some(v) = md.get_bool("tokenizer.ggml.add_bos_token").map_err(e)? {
            add_bos = v;
        }
        if let Some(v) = md.get_bool("tokenizer.ggml.add_eos_token").map_err(e)? {
            add_eos = v;
        }
        if let Some(v) = md.get_bool("tokenizer.ggml.add_space_prefix").map_err(e)? {
            add_space_prefix = v;
        }
        // llama.cpp adds BOS for Gemma 4's vocabulary whatever the file says (its "workaround for
        // Gemma 4"), and a BPE vocabulary never gets a space prefix.
        if model == VocabModel::BytePairSpm {
            add_bos = true;
            add_space_prefix = false;
        }

        // End of generation: by text (marking such tokens control, as llama.cpp does), plus EOS/EOT/EOM.
        let mut eog_ids = Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            let t = t.as_str();
            if EOG_TEXTS.contains(&t) || EOG_FIM_TEXTS.contains(&t) {
                eog_ids.push(i as u32);
                if kinds[i] != TokenKind::Control {
                    kinds[i] = TokenKind::Control;
                }
            }
        }
        for extra in [eos_id, eot_id, eom_id].into_iter().flatten() {
            eog_ids.push(extra);
        }
        eog_ids.sort_unstable();
        eog_ids.dedup();

        let chat_template = md.chat_template().map_err(e)?.map(str::to_string);
        let mut named_templates = Vec::new();
        for (key, _) in md.entries() {
            if let Some(name) = key.strip_prefix("tokenizer.chat_template.") {
                if let Some(t) = md.get_str(key).map_err(e)? {
                    named_templates.push((name.to_string(), t.to_string()));
                }
            }
        }
        Ok(GgufVocab {
            model,
            pre,
            tokens,
            kinds,
            scores,
            merges,
            bos_id,
            eos_id,
            unk_id,
            pad_id,
            add_bos,
            add_eos,
            add_space_prefix,
            eog_ids,
            chat_template,
            named_templates,
            architecture: md.architecture().map_err(e)?.to_string(),
            name: md.name().map_err(e)?.map(str::to_string),
        })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the vocabulary is empty.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Token id by text; when a text appears twice the later id wins, as in llama.cpp's `token_to_id`.
    pub fn token_to_id(&self) -> HashMap<&str, u32> {
        let mut m = HashMap::with_capacity(self.tokens.len());
        for (i, t) in self.tokens.iter().enumerate() {
            m.insert(t.as_str(), i as u32);
        }
        m
    }

    /// The text of token `id`, if it exists.
    pub fn text(&self, id: Option<u32>) -> Option<&str> {
        id.and_then(|i| self.tokens.get(i as usize))
            .map(String::as_str)
    }
}
