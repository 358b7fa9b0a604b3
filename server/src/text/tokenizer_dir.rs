//! The tokenizer directory of a model: written once from its GGUF (`polystrata tokenizer --gguf FILE
//! --out DIR`), loaded by the server when the model is switched in.
//!
//! - `tokenizer.json`: the vocabulary for the `tokenizers` crate (see [`super::hf_json`]).
//! - `chat_template.jinja` (and `chat_template.<name>.jinja` for named variants): the GGUF's templates.
//! - `tokenizer_config.json`: what llama.cpp derives beyond the arrays: the tokens that end a reply, the
//!   BOS/EOS rule, the pre-tokenizer name, the special tokens and the reasoning / tool-call family.

use super::family::Family;
use super::hf_json::{literal_tokenizer_json, tokenizer_json};
use super::vocab::{GgufVocab, TokenKind, VocabModel};
use super::{Result, TextError};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// File names inside a tokenizer directory.
pub const TOKENIZER_JSON: &str = "tokenizer.json";
/// For `gemma4` vocabularies: the tokenizer that leaves special-token texts as text
/// ([`super::hf_json::literal_tokenizer_json`]).
pub const TOKENIZER_LITERAL_JSON: &str = "tokenizer.literal.json";
pub const CONFIG_JSON: &str = "tokenizer_config.json";
pub const CHAT_TEMPLATE: &str = "chat_template.jinja";

fn io_err(path: &Path, e: impl std::fmt::Display) -> TextError {
    TextError::new(format!("{}: {e}", path.display()))
}

/// `polystrata tokenizer --gguf FILE --out DIR`: writes the tokenizer directory of `gguf` to `out`
/// (created if missing; files are replaced). Returns the config written.
pub fn tokenizer_command(gguf: &Path, out: &Path) -> Result<TokenizerConfig> {
    let vocab = GgufVocab::open(gguf)?;
    write_tokenizer_dir(&vocab, gguf, out)
}

/// Writes the tokenizer directory of an already read vocabulary.
pub fn write_tokenizer_dir(vocab: &GgufVocab, gguf: &Path, out: &Path) -> Result<TokenizerConfig> {
    std::fs::create_dir_all(out).map_err(|e| io_err(out, e))?;
    let doc = tokenizer_json(vocab)?;
    let text = serde_json::to_string(&doc).map_err(|e| TextError::new(e.to_string()))?;
    write_file(&out.join(TOKENIZER_JSON), text.as_bytes())?;
    let literal_path = out.join(TOKENIZER_LITERAL_JSON);
    match literal_tokenizer_json(vocab)? {
        Some(doc) => {
            let text = serde_json::to_string(&doc).map_err(|e| TextError::new(e.to_string()))?;
            write_file(&literal_path, text.as_bytes())?;
        }
        // A directory written again for another vocabulary keeps no stale one.
        None if literal_path.exists() => {
            std::fs::remove_file(&literal_path).map_err(|e| io_err(&literal_path, e))?
        }
        None => {}
    }
    let mut template_files = Vec::new();
    if let Some(t) = &vocab.chat_template {
        write_file(&out.join(CHAT_TEMPLATE), t.as_bytes())?;
    }
    for (name, t) in &vocab.named_templates {
        // Template names come from the file: keep them to a safe file-name alphabet.
        let safe: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let file = format!("chat_template.{safe}.jinja");
        write_file(&out.join(&file), t.as_bytes())?;
        template_files.push((name.clone(), file));
    }
    let config = TokenizerConfig::from_vocab(vocab, gguf, &template_files);
    let text = serde_json::to_string_pretty(&config.to_json())
        .map_err(|e| TextError::new(e.to_string()))?;
    write_file(&out.join(CONFIG_JSON), text.as_bytes())?;
    Ok(config)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    // Written beside and renamed, so a reader never sees half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(|e| io_err(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io_err(path, e))
}

/// A token named in the config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedToken {
    pub id: u32,
    pub text: String,
}

/// `tokenizer_config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerConfig {
    /// `gpt2` or `llama`.
    pub model: String,
    /// `tokenizer.ggml.pre`.
    pub pre: String,
    pub n_vocab: usize,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    pub bos: Option<NamedToken>,
    pub eos: Option<NamedToken>,
    /// Tokens that end a reply (llama.cpp's end-of-generation set).
    pub end_of_reply: Vec<NamedToken>,
    /// Control, user-defined and unknown tokens, with their kind name.
    pub special_tokens: Vec<(NamedToken, String)>,
    /// The template file, when the GGUF has one.
    pub chat_template_file: Option<String>,
    /// Named template variants: (name, file).
    pub named_templates: Vec<(String, String)>,
    /// The reasoning / tool-call family (see [`Family`]).
    pub family: Family,
    pub architecture: String,
    pub name: Option<String>,
    pub source_gguf: String,
}

impl TokenizerConfig {
    fn from_vocab(vocab: &GgufVocab, gguf: &Path, named: &[(String, String)]) -> TokenizerConfig {
        let named_token = |id: Option<u32>| {
            vocab.text(id).zip(id).map(|(t, id)| NamedToken {
                id,
                text: t.to_string(),
            })
        };
        TokenizerConfig {
            model: match vocab.model {
                VocabModel::BytePairGpt2 => "gpt2".into(),
                VocabModel::SentencePiece => "llama".into(),
                VocabModel::BytePairSpm => "gemma4".into(),
            },
            pre: vocab.pre.clone(),
            n_vocab: vocab.len(),
            add_bos: vocab.add_bos,
            add_eos: vocab.add_eos,
            add_space_prefix: vocab.add_space_prefix,
            bos: named_token(vocab.bos_id),
            eos: named_token(vocab.eos_id),
            end_of_reply: vocab
                .eog_ids
                .iter()
                .filter_map(|&id| named_token(Some(id)))
                .collect(),
            special_tokens: vocab
                .tokens
                .iter()
                .enumerate()
                .filter(|(i, _)| vocab.kinds[*i].is_special())
                .map(|(i, t)| {
                    (
                        NamedToken {
                            id: i as u32,
                            text: t.clone(),
                        },
                        vocab.kinds[i].name().to_string(),
                    )
                })
                .collect(),
            chat_template_file: vocab
                .chat_template
                .as_ref()
                .map(|_| CHAT_TEMPLATE.to_string()),
            named_templates: named.to_vec(),
            family: Family::detect(
                &vocab.pre,
                vocab.chat_template.as_deref(),
                &vocab.architecture,
            ),
            architecture: vocab.architecture.clone(),
            name: vocab.name.clone(),
            source_gguf: gguf.display().to_string(),
        }
    }

    /// The JSON document.
    pub fn to_json(&self) -> Value {
        let tok = |t: &NamedToken| json!({"id": t.id, "text": t.text});
        json!({
            "format": "polystrata-tokenizer/1",
            "model": self.model,
            "pre": self.pre,
            "n_vocab": self.n_vocab,
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "add_space_prefix": self.add_space_prefix,
            "bos": self.bos.as_ref().map(tok),
            "eos": self.eos.as_ref().map(tok),
            "end_of_reply": self.end_of_reply.iter().map(tok).collect::<Vec<_>>(),
            "special_tokens": self.special_tokens.iter().map(|(t, k)| json!({"id": t.id, "text": t.text, "kind": k})).collect::<Vec<_>>(),
            "chat_template": self.chat_template_file,
            "named_templates": self.named_templates.iter().map(|(n, f)| (n.clone(), json!(f))).collect::<serde_json::Map<_, _>>(),
            "family": self.family.name(),
            "architecture": self.architecture,
            "name": self.name,
            "source_gguf": self.source_gguf,
        })
    }

    /// Reads the JSON document back.
    pub fn from_json(v: &Value) -> Result<TokenizerConfig> {
        let bad = |what: &str| TextError::new(format!("tokenizer config: bad or missing '{what}'"));
        let s = |k: &str| {
            v.get(k)
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| bad(k))
        };
        let b = |k: &str| v.get(k).and_then(Value::as_bool).ok_or_else(|| bad(k));
        let tok = |t: &Value| -> Option<NamedToken> {
            Some(NamedToken {
                id: u32::try_from(t.get("id")?.as_u64()?).ok()?,
                text: t.get("text")?.as_str()?.to_string(),
            })
        };
        let opt_tok = |k: &str| -> Result<Option<NamedToken>> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(t) => tok(t).map(Some).ok_or_else(|| bad(k)),
            }
        };
        let list = |k: &str| v.get(k).and_then(Value::as_array).ok_or_else(|| bad(k));
        let end_of_reply = list("end_of_reply")?
            .iter()
            .map(|t| tok(t).ok_or_else(|| bad("end_of_reply")))
            .collect::<Result<Vec<_>>>()?;
        let special_tokens = list("special_tokens")?
            .iter()
            .map(|t| {
                let kind = t
                    .get("kind")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("special_tokens"))?;
                Ok((
                    tok(t).ok_or_else(|| bad("special_tokens"))?,
                    kind.to_string(),
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let named_templates = match v.get("named_templates") {
            Some(Value::Object(m)) => m
                .iter()
                .map(|(n, f)| {
                    Ok((
                        n.clone(),
                        f.as_str()
                            .ok_or_else(|| bad("named_templates"))?
                            .to_string(),
                    ))
                })
                .collect::<Result<Vec<_>>>()?,
            _ => Vec::new(),
        };
        let family = Family::from_name(&s("family")?).ok_or_else(|| bad("family"))?;
        Ok(TokenizerConfig {
            model: s("model")?,
            pre: s("pre")?,
            n_vocab: v
                .get("n_vocab")
                .and_then(Value::as_u64)
                .ok_or_else(|| bad("n_vocab"))? as usize,
            add_bos: b("add_bos")?,
            add_eos: b("add_eos")?,
            add_space_prefix: b("add_space_prefix")?,
            bos: opt_tok("bos")?,
            eos: opt_tok("eos")?,
            end_of_reply,
            special_tokens,
            chat_template_file: v
                .get("chat_template")
                .and_then(Value::as_str)
                .map(str::to_string),
            named_templates,
            family,
            architecture: s("architecture")?,
            name: v.get("name").and_then(Value::as_str).map(str::to_string),
            source_gguf: s("source_gguf")?,
        })
    }
}

/// A loaded tokenizer directory: encoding, decoding, the reply-ending tokens and the chat template.
pub struct TextTokenizer {
    dir: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    /// The same tokenizer with special-token texts left as text (llama.cpp's `parse_special = false`);
    /// made on first use, since most requests never need it.
    literal: OnceLock<tokenizers::Tokenizer>,
    pub config: TokenizerConfig,
    /// The GGUF's chat template, if the directory has one.
    pub chat_template: Option<String>,
    /// The GGUF's named template variants (name, source); llama.cpp uses `tool_use` for requests with
    /// tools when the model has one.
    pub named_templates: Vec<(String, String)>,
    /// Per token: its bytes when detokenized, and whether it is a control token.
    pieces: Vec<(Vec<u8>, bool)>,
    eog: Vec<bool>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("dir", &self.dir)
            .field("config", &self.config)
            .finish()
    }
}

/// The chat template file a tokenizer config names, read from its directory (a name reaching outside
/// it is refused).
fn template_file(dir: &Path, cfg_path: &Path, file: Option<&str>) -> Result<Option<String>> {
    match file {
        Some(f) if f.contains('/') || f.contains('\\') || f.starts_with('.') => Err(io_err(
            cfg_path,
            format!("template file '{f}' is outside the directory"),
        )),
        Some(f) => {
            let p = dir.join(f);
            Ok(Some(
                std::fs::read_to_string(&p).map_err(|e| io_err(&p, e))?,
            ))
        }
        None => Ok(None),
    }
}

/// The chat template of the tokenizer directory `dir` alone, without loading its vocabulary (for a
/// model's details while another model is in use).
pub fn read_chat_template(dir: &Path) -> Result<Option<String>> {
    let cfg_path = dir.join(CONFIG_JSON);
    let cfg_text = std::fs::read_to_string(&cfg_path).map_err(|e| io_err(&cfg_path, e))?;
    let cfg_json: Value = serde_json::from_str(&cfg_text).map_err(|e| io_err(&cfg_path, e))?;
    let config = TokenizerConfig::from_json(&cfg_json).map_err(|e| io_err(&cfg_path, e))?;
    template_file(dir, &cfg_path, config.chat_template_file.as_deref())
}

impl TextTokenizer {
    /// Loads the tokenizer directory `dir`.
    pub fn load(dir: &Path) -> Result<TextTokenizer> {
        let cfg_path = dir.join(CONFIG_JSON);
        let cfg_text = std::fs::read_to_string(&cfg_path).map_err(|e| io_err(&cfg_path, e))?;
        let cfg_json: Value = serde_json::from_str(&cfg_text).map_err(|e| io_err(&cfg_path, e))?;
        let config = TokenizerConfig::from_json(&cfg_json).map_err(|e| io_err(&cfg_path, e))?;
        let tok_path = dir.join(TOKENIZER_JSON);
        let tokenizer =
            tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| io_err(&tok_path, e))?;
        let literal = OnceLock::new();
        let literal_path = dir.join(TOKENIZER_LITERAL_JSON);
        if literal_path.exists() {
            let mut t = tokenizers::Tokenizer::from_file(&literal_path)
                .map_err(|e| io_err(&literal_path, e))?;
            t.set_encode_special_tokens(true);
            let _ = literal.set(t);
        }
        let chat_template = template_file(dir, &cfg_path, config.chat_template_file.as_deref())?;
        let mut named_templates = Vec::new();
        for (name, file) in &config.named_templates {
            // A config names files inside its own directory only.
            if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                return Err(io_err(
                    &cfg_path,
                    format!("template file '{file}' is outside the directory"),
                ));
            }
            let p = dir.join(file);
            named_templates.push((
                name.clone(),
                std::fs::read_to_string(&p).map_err(|e| io_err(&p, e))?,
            ));
        }
        let n = tokenizer.get_vocab_size(true).max(config.n_vocab);
        let mut pieces = Vec::with_capacity(n);
        let control: std::collections::HashSet<u32> = config
            .special_tokens
            .iter()
            .filter(|(_, k)| k != TokenKind::UserDefined.name())
            .map(|(t, _)| t.id)
            .collect();
        for id in 0..n as u32 {
            let text = tokenizer.id_to_token(id).unwrap_or_default();
            let is_control = control.contains(&id);
            let bytes = if is_control {
                text.into_bytes()
            } else {
                piece_bytes(&config.model, &text)
            };
            pieces.push((bytes, is_control));
        }
        let mut eog = vec![false; n];
        for t in &config.end_of_reply {
            if let Some(e) = eog.get_mut(t.id as usize) {
                *e = true;
            }
        }
        Ok(TextTokenizer {
            dir: dir.to_path_buf(),
            tokenizer,
            literal,
            config,
            chat_template,
            named_templates,
            pieces,
            eog,
        })
    }

    /// The ids of `text`. `add_special`: BOS/EOS as the model wants them (llama.cpp's `add_special`);
    /// `parse_special`: texts of special tokens become those tokens (a rendered chat prompt) rather than
    /// plain text (user input sent as a raw completion prompt may want `false`).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let tok = if parse_special {
            &self.tokenizer
        } else {
            self.literal.get_or_init(|| {
                let mut t = self.tokenizer.clone();
                t.set_encode_special_tokens(true);
                t
            })
        };
        let enc = tok
            .encode_fast(text, add_special)
            .map_err(|e| TextError::new(format!("tokenize: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The bytes token `id` stands for (llama.cpp's `token_to_piece`): control tokens give their text only
    /// when `render_special`; unknown ids give nothing.
    pub fn piece(&self, id: u32, render_special: bool) -> &[u8] {
        match self.pieces.get(id as usize) {
            Some((_, true)) if !render_special => &[],
            Some((b, _)) => b,
            None => &[],
        }
    }

    /// The most bytes one token stands for: a text longer than `n` times this cannot be `n` tokens or
    /// fewer, which bounds a prompt by its context before it is tokenized.
    pub fn max_piece_len(&self) -> usize {
        self.pieces
            .iter()
            .map(|(b, _)| b.len())
            .max()
            .unwrap_or(1)
            .max(1)
    }

    /// The text of `ids` (lossy where they end inside a character).
    pub fn decode(&self, ids: &[u32], render_special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.piece(id, render_special));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The template for a request: the `tool_use` variant when the request has tools and the model has
    /// one, else the default (as llama.cpp chooses).
    pub fn template_for(&self, has_tools: bool) -> Option<&str> {
        let tool_use = self
            .named_templates
            .iter()
            .find(|(n, _)| n == "tool_use")
            .map(|(_, t)| t.as_str());
        match (has_tools, tool_use) {
            (true, Some(t)) => Some(t),
            _ => self.chat_template.as_deref(),
        }
    }

    /// Whether `id` ends a reply.
    pub fn is_end_of_reply(&self, id: u32) -> bool {
        self.eog.get(id as usize).copied().unwrap_or(false)
    }

    /// The id of a token text, if the vocabulary has it.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.tokenizer.token_to_id(text)
    }

    /// Number of tokens.
    pub fn n_vocab(&self) -> usize {
        self.pieces.len()
    }

    /// The directory it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The bytes of a non-control token's text: GPT-2's byte alphabet back to bytes, or SentencePiece's `▁`
/// as a space and `<0xXX>` as that byte.
fn piece_bytes(model: &str, text: &str) -> Vec<u8> {
    if model == "gpt2" {
        let table = unicode_to_byte();
        let mut out = Vec::with_capacity(text.len());
        for c in text.chars() {
            match table.get(&c) {
                Some(&b) => out.push(b),
                // Not in the byte alphabet (a user-defined token written as plain text).
                None => out.extend_from_slice(c.to_string().as_bytes()),
            }
        }
        out
    } else {
        if let Some(hex) = text.strip_prefix("<0x").and_then(|t| t.strip_suffix('>')) {
            if hex.len() == 2 {
                if let Ok(b) = u8::from_str_radix(hex, 16) {
                    return vec![b];
                }
            }
        }
        text.replace('▁', " ").into_bytes()
    }
}

/// GPT-2's byte-to-unicode alphabet, inverted: printable bytes stand for themselves, the others were moved
/// to U+0100 onwards in byte order.
fn unicode_to_byte() -> &'static std::collections::HashMap<char, u8> {
    static TABLE: OnceLock<std::collections::HashMap<char, u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut m = std::collections::HashMap::new();
        let mut next = 0u32;
        for b in 0..=255u8 {
            let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
            let c = if printable {
                char::from(b)
            } else {
                next += 1;
                char::from_u32(255 + next).unwrap_or('\u{FFFD}')
            };
            m.insert(c, b);
        }
        m
    })
}

/// Turns a stream of token ids into text without splitting a UTF-8 character across chunks.
#[derive(Debug, Default)]
pub struct Detokenizer {
    pending: Vec<u8>,
}

impl Detokenizer {
    /// A detokenizer with nothing pending.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds token `id`; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32, render_special: bool) -> String {
        self.pending
            .extend_from_slice(tok.piece(id, render_special));
        self.take_complete()
    }

    fn take_complete(&mut self) -> String {
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                let s = s.to_string();
                self.pending.clear();
                s
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // Invalid bytes that no continuation can fix are replaced now; an incomplete tail waits.
                let cut = match e.error_len() {
                    Some(bad) => valid + bad,
                    None => valid,
                };
                let out = String::from_utf8_lossy(&self.pending[..cut]).into_owned();
                self.pending.drain(..cut);
                if e.error_len().is_some() {
                    out + &self.take_complete()
                } else {
                    out
                }
            }
        }
    }

    /// The rest at the end of the stream (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}
