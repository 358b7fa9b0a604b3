//! The key–value metadata of a GGUF file, in file order with an index by key, and the typed accessors the
//! engine and the registry use (architecture, hyperparameters by suffix, tokenizer, chat template).
//!
//! Accessor conventions: a key whose absence makes a model unusable is read with a plain getter returning
//! `Result<T>` (a missing key is [`ErrorKind::MissingKey`]); optional keys return `Result<Option<T>>`.
//! Either way a key that is present with an unusable type or value is an error, never silently ignored.
//! Integers are accepted at any width when they fit the asked type.

use std::collections::HashMap;

use super::error::{ErrorKind, GgufError};
use super::value::{Array, Value};

/// Keys GGUF and llama.cpp define that this crate reads or writes.
pub mod keys {
    pub const GENERAL_ARCHITECTURE: &str = "general.architecture";
    pub const GENERAL_NAME: &str = "general.name";
    pub const GENERAL_SIZE_LABEL: &str = "general.size_label";
    pub const GENERAL_ALIGNMENT: &str = "general.alignment";
    pub const SPLIT_NO: &str = "split.no";
    pub const SPLIT_COUNT: &str = "split.count";
    pub const SPLIT_TENSORS_COUNT: &str = "split.tensors.count";
    pub const TOKENIZER_MODEL: &str = "tokenizer.ggml.model";
    pub const TOKENIZER_PRE: &str = "tokenizer.ggml.pre";
    pub const TOKENIZER_TOKENS: &str = "tokenizer.ggml.tokens";
    pub const TOKENIZER_SCORES: &str = "tokenizer.ggml.scores";
    pub const TOKENIZER_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
    pub const TOKENIZER_MERGES: &str = "tokenizer.ggml.merges";
    pub const TOKENIZER_BOS_ID: &str = "tokenizer.ggml.bos_token_id";
    pub const TOKENIZER_EOS_ID: &str = "tokenizer.ggml.eos_token_id";
    pub const CHAT_TEMPLATE: &str = "tokenizer.chat_template";
}

/// Metadata in file order, indexed by key. `source` names the file for error messages.
#[derive(Clone, Debug, Default)]
pub struct Metadata {
    source: String,
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

type Result<T> = std::result::Result<T, GgufError>;

impl Metadata {
    /// Empty metadata for the file `source`.
    pub fn new(source: impl Into<String>) -> Self {
        Metadata {
            source: source.into(),
            entries: Vec::new(),
            index: HashMap::new(),
        }
    }

    /// Adds a pair; returns `false` (and changes nothing) when the key is already present.
    pub(crate) fn insert_new(&mut self, key: String, value: Value) -> bool {
        if self.index.contains_key(&key) {
            return false;
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        true
    }

    pub(crate) fn reserve(&mut self, n: usize) {
        self.entries.reserve(n);
        self.index.reserve(n);
    }

    /// The file these pairs came from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// All pairs in file order.
    pub fn entries(&self) -> &[(String, Value)] {
        &self.entries
    }

    /// Number of pairs.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no pairs.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    fn err(&self, kind: ErrorKind) -> GgufError {
        GgufError::new(self.source.clone(), kind)
    }

    fn wrong_type(&self, key: &str, expected: &'static str, found: &Value) -> GgufError {
        self.err(ErrorKind::WrongType {
            key: key.to_string(),
            expected,
            found: found.type_description(),
        })
    }

    fn required<T>(&self, key: &str, v: Option<T>) -> Result<T> {
        v.ok_or_else(|| {
            self.err(ErrorKind::MissingKey {
                key: key.to_string(),
            })
        })
    }

    /// An integer of any width that fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        if !v.is_integer() {
            return Err(self.wrong_type(key, "an integer", v));
        }
        v.as_u32().map(Some).ok_or_else(|| {
            self.err(ErrorKind::OutOfRange {
                key: key.to_string(),
                value: format!("{v:?}"),
            })
        })
    }

    /// An integer of any width that fits in `u64`.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        if !v.is_integer() {
            return Err(self.wrong_type(key, "an integer", v));
        }
        v.as_u64().map(Some).ok_or_else(|| {
            self.err(ErrorKind::OutOfRange {
                key: key.to_string(),
                value: format!("{v:?}"),
            })
        })
    }

    /// An `f32` (an `f64` is narrowed).
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f32()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a float", v)),
        }
    }

    /// A bool.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a bool", v)),
        }
    }

    /// A string.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a string", v)),
        }
    }

    /// An array of any element type.
    pub fn get_array(&self, key: &str) -> Result<Option<&Array>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_array()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "an array", v)),
        }
    }

    /// An integer array of any width whose elements all fit in `u32`.
    pub fn get_u32_array(&self, key: &str) -> Result<Option<Vec<u32>>> {
        let Some(a) = self.get_array(key)? else {
            return Ok(None);
        };
        match a.to_u32_vec() {
            Some(v) => Ok(Some(v)),
            None if a.is_integer() => Err(self.err(ErrorKind::OutOfRange {
                key: key.to_string(),
                value: "an element outside u32".to_string(),
            })),
            None => Err(self.wrong_type(key, "an integer array", &Value::Array(a.clone()))),
        }
    }

    /// An `f32` array (an `f64` array is narrowed).
    pub fn get_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        let Some(a) = self.get_array(key)? else {
            return Ok(None);
        };
        a.to_f32_vec()
            .map(Some)
            .ok_or_else(|| self.wrong_type(key, "a float array", &Value::Array(a.clone())))
    }

    /// A bool array.
    pub fn get_bool_array(&self, key: &str) -> Result<Option<&[bool]>> {
        let Some(a) = self.get_array(key)? else {
            return Ok(None);
        };
        a.as_bools()
            .map(Some)
            .ok_or_else(|| self.wrong_type(key, "a bool array", &Value::Array(a.clone())))
    }

    /// A string array.
    pub fn get_str_array(&self, key: &str) -> Result<Option<&[String]>> {
        let Some(a) = self.get_array(key)? else {
            return Ok(None);
        };
        a.as_strings()
            .map(Some)
            .ok_or_else(|| self.wrong_type(key, "a string array", &Value::Array(a.clone())))
    }

    /// A value per layer: a scalar integer repeated `n_layers` times, or an integer array of exactly
    /// `n_layers` elements (llama.cpp's `get_key_or_arr`).
    pub fn get_u32_per_layer(&self, key: &str, n_layers: usize) -> Result<Option<Vec<u32>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let values = match v {
            Value::Array(_) => self.get_u32_array(key)?.unwrap_or_default(),
            _ => vec![self.get_u32(key)?.unwrap_or_default(); n_layers],
        };
        if values.len() != n_layers {
            return Err(self.err(ErrorKind::OutOfRange {
                key: key.to_string(),
                value: format!(
                    "an array of {} elements for {n_layers} layers",
                    values.len()
                ),
            }));
        }
        Ok(Some(values))
    }

    // ---- general ----

    /// `general.architecture` (e.g. `"qwen3moe"`); required.
    pub fn architecture(&self) -> Result<&str> {
        self.required(
            keys::GENERAL_ARCHITECTURE,
            self.get_str(keys::GENERAL_ARCHITECTURE)?,
        )
    }

    /// `general.name`.
    pub fn name(&self) -> Result<Option<&str>> {
        self.get_str(keys::GENERAL_NAME)
    }

    /// `general.size_label` (e.g. `"30B-A3B"`).
    pub fn size_label(&self) -> Result<Option<&str>> {
        self.get_str(keys::GENERAL_SIZE_LABEL)
    }

    // ---- architecture hyperparameters, by suffix: `arch_u32("block_count")` reads `<arch>.block_count` ----

    /// The full key `<architecture>.<suffix>`.
    pub fn arch_key(&self, suffix: &str) -> Result<String> {
        Ok(format!("{}.{suffix}", self.architecture()?))
    }

    /// `<arch>.<suffix>` as a `u32` (any integer width); required.
    pub fn arch_u32(&self, suffix: &str) -> Result<u32> {
        let key = self.arch_key(suffix)?;
        self.required(&key, self.get_u32(&key)?)
    }

    /// `<arch>.<suffix>` as a `u32`, if present.
    pub fn arch_u32_opt(&self, suffix: &str) -> Result<Option<u32>> {
        self.get_u32(&self.arch_key(suffix)?)
    }

    /// `<arch>.<suffix>` as a `u64` (any integer width), if present.
    pub fn arch_u64_opt(&self, suffix: &str) -> Result<Option<u64>> {
        self.get_u64(&self.arch_key(suffix)?)
    }

    /// `<arch>.<suffix>` as an `f32`; required.
    pub fn arch_f32(&self, suffix: &str) -> Result<f32> {
        let key = self.arch_key(suffix)?;
        self.required(&key, self.get_f32(&key)?)
    }

    /// `<arch>.<suffix>` as an `f32`, if present.
    pub fn arch_f32_opt(&self, suffix: &str) -> Result<Option<f32>> {
        self.get_f32(&self.arch_key(suffix)?)
    }

    /// `<arch>.<suffix>` as a bool, if present.
    pub fn arch_bool_opt(&self, suffix: &str) -> Result<Option<bool>> {
        self.get_bool(&self.arch_key(suffix)?)
    }

    /// `<arch>.<suffix>` as a string, if present.
    pub fn arch_str_opt(&self, suffix: &str) -> Result<Option<&str>> {
        let key = self.arch_key(suffix)?;
        self.get_str(&key)
    }

    /// `<arch>.<suffix>`, an integer array of any width; required.
    pub fn arch_u32_array(&self, suffix: &str) -> Result<Vec<u32>> {
        let key = self.arch_key(suffix)?;
        self.required(&key, self.get_u32_array(&key)?)
    }

    /// `<arch>.<suffix>`, an integer array of any width, if present.
    pub fn arch_u32_array_opt(&self, suffix: &str) -> Result<Option<Vec<u32>>> {
        self.get_u32_array(&self.arch_key(suffix)?)
    }

    /// `<arch>.<suffix>`, an `f32` array, if present.
    pub fn arch_f32_array_opt(&self, suffix: &str) -> Result<Option<Vec<f32>>> {
        self.get_f32_array(&self.arch_key(suffix)?)
    }

    /// `<arch>.<suffix>`, a bool array (e.g. a sliding-window layer pattern), if present.
    pub fn arch_bool_array_opt(&self, suffix: &str) -> Result<Option<Vec<bool>>> {
        let key = self.arch_key(suffix)?;
        Ok(self.get_bool_array(&key)?.map(<[bool]>::to_vec))
    }

    /// `<arch>.<suffix>` per layer (a scalar for all layers or an array of `n_layers`); required.
    pub fn arch_u32_per_layer(&self, suffix: &str, n_layers: usize) -> Result<Vec<u32>> {
        let key = self.arch_key(suffix)?;
        self.required(&key, self.get_u32_per_layer(&key, n_layers)?)
    }

    /// `<arch>.<suffix>` per layer, if present.
    pub fn arch_u32_per_layer_opt(
        &self,
        suffix: &str,
        n_layers: usize,
    ) -> Result<Option<Vec<u32>>> {
        self.get_u32_per_layer(&self.arch_key(suffix)?, n_layers)
    }

    // ---- tokenizer ----

    /// `tokenizer.ggml.model` (`"gpt2"`, `"llama"`, …); required.
    pub fn tokenizer_model(&self) -> Result<&str> {
        self.required(keys::TOKENIZER_MODEL, self.get_str(keys::TOKENIZER_MODEL)?)
    }

    /// `tokenizer.ggml.pre` (the pre-tokenizer name), if present.
    pub fn tokenizer_pre(&self) -> Result<Option<&str>> {
        self.get_str(keys::TOKENIZER_PRE)
    }

    /// `tokenizer.ggml.tokens`; required.
    pub fn tokenizer_tokens(&self) -> Result<&[String]> {
        self.required(
            keys::TOKENIZER_TOKENS,
            self.get_str_array(keys::TOKENIZER_TOKENS)?,
        )
    }

    /// `tokenizer.ggml.scores` (an `f32` array), if present.
    pub fn tokenizer_scores(&self) -> Result<Option<&[f32]>> {
        let key = keys::TOKENIZER_SCORES;
        let Some(a) = self.get_array(key)? else {
            return Ok(None);
        };
        a.as_f32s()
            .map(Some)
            .ok_or_else(|| self.wrong_type(key, "an f32 array", &Value::Array(a.clone())))
    }

    /// `tokenizer.ggml.token_type` (an `i32` array of llama.cpp's token attributes), if present.
    pub fn tokenizer_token_types(&self) -> Result<Option<&[i32]>> {
        let key = keys::TOKENIZER_TOKEN_TYPE;
        let Some(a) = self.get_array(key)? else {
            return Ok(None);
        };
        a.as_i32s()
            .map(Some)
            .ok_or_else(|| self.wrong_type(key, "an i32 array", &Value::Array(a.clone())))
    }

    /// `tokenizer.ggml.merges` (BPE merges, `"a b"` each), if present.
    pub fn tokenizer_merges(&self) -> Result<Option<&[String]>> {
        self.get_str_array(keys::TOKENIZER_MERGES)
    }

    /// `tokenizer.ggml.bos_token_id`, if present.
    pub fn bos_token_id(&self) -> Result<Option<u32>> {
        self.get_u32(keys::TOKENIZER_BOS_ID)
    }

    /// `tokenizer.ggml.eos_token_id`, if present.
    pub fn eos_token_id(&self) -> Result<Option<u32>> {
        self.get_u32(keys::TOKENIZER_EOS_ID)
    }

    /// `tokenizer.chat_template` (a Jinja template), if present.
    pub fn chat_template(&self) -> Result<Option<&str>> {
        self.get_str(keys::CHAT_TEMPLATE)
    }
}
