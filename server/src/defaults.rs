//! A model's generation defaults: what a request that leaves a sampling field out gets, and the
//! default answer length of a chat.
//!
//! Greedy decoding with no length limit made a small model's first chat loop for minutes, so a field
//! a request leaves out is taken, in this order, from the run config's `sampling`, from the GGUF's
//! `general.sampling.*` keys (llama.cpp writes them from a model's `generation_config.json`), from the
//! table of the model's architecture below (its authors' recommended settings), and last from
//! llama-server's own defaults. `/props` shows each value with where it came from.

use serde_json::{json, Map, Value};
use std::path::Path;

/// A chat answer's length when neither the request nor the run config gives one: long enough for a
/// reasoning model's thinking and answer, short enough that a model that does not stop is cut within
/// minutes on a CPU.
pub const CHAT_MAX_TOKENS: u32 = 4096;

/// The sampling fields a default may be given for (the run config's and the API's names).
pub const FIELDS: [&str; 7] = [
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
];

/// The GGUF keys of llama.cpp's `general.sampling.*`, by field.
const GGUF_KEYS: [(&str, &str); 5] = [
    ("temperature", "general.sampling.temp"),
    ("top_k", "general.sampling.top_k"),
    ("top_p", "general.sampling.top_p"),
    ("min_p", "general.sampling.min_p"),
    ("repeat_penalty", "general.sampling.penalty_repeat"),
];

/// The settings the model cards of these architectures recommend (a prefix of
/// `general.architecture`): Qwen3's for thinking mode, Gemma 3's, LFM2's.
fn family_table(arch: &str) -> Option<(&'static str, Value)> {
    if arch.starts_with("qwen3") || arch.starts_with("qwen35") {
        Some((
            "Qwen3",
            json!({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}),
        ))
    } else if arch.starts_with("gemma3") || arch.starts_with("gemma4") {
        Some((
            "Gemma 3",
            json!({"temperature": 1.0, "top_k": 64, "top_p": 0.95, "min_p": 0.0}),
        ))
    } else if arch.starts_with("lfm2") {
        Some((
            "LFM2",
            json!({"temperature": 0.3, "min_p": 0.15, "repeat_penalty": 1.05}),
        ))
    } else {
        None
    }
}

/// llama-server's defaults, for a field nothing else gives.
fn llama_server_defaults() -> Value {
    json!({
        "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
        "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    })
}

/// A model's defaults, each with where it came from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Defaults {
    /// Field → value, for every field of [`FIELDS`].
    pub values: Map<String, Value>,
    /// Field → `"run config"`, `"gguf"`, `"family table (NAME)"` or `"llama-server default"`.
    pub sources: Map<String, Value>,
    /// The answer length of any request that gives none (the run config's `sampling.max_tokens`);
    /// `None`: the room left in the context (chats: [`Defaults::chat_max_tokens`]).
    pub max_tokens: Option<u32>,
    /// A chat's answer length when neither the request nor the run config gives one.
    pub chat_max_tokens: u32,
}

impl Defaults {
    /// The defaults from a run config's `sampling`, the GGUF's metadata (`gguf`: `None` when it cannot
    /// be read) and the architecture.
    pub fn from_sources(
        config: &Map<String, Value>,
        gguf: &Map<String, Value>,
        arch: &str,
    ) -> Defaults {
        let table = family_table(arch);
        let fallback = llama_server_defaults();
        let mut d = Defaults {
            chat_max_tokens: CHAT_MAX_TOKENS,
            ..Defaults::default()
        };
        for field in FIELDS {
            let (value, source) = if let Some(v) = config.get(field).filter(|v| v.is_number()) {
                (v.clone(), "run config".to_string())
            } else if let Some(v) = gguf.get(field) {
                (v.clone(), "gguf".to_string())
            } else if let Some(v) = table.as_ref().and_then(|(_, t)| t.get(field)) {
                (
                    v.clone(),
                    format!("family table ({})", table.as_ref().map_or("", |t| t.0)),
                )
            } else {
                (fallback[field].clone(), "llama-server default".to_string())
            };
            d.values.insert(field.into(), value);
            d.sources.insert(field.into(), json!(source));
        }
        d.max_tokens = config
            .get("max_tokens")
            .and_then(Value::as_u64)
            .map(|v| v.min(u32::MAX as u64) as u32);
        if let Some(n) = d.max_tokens {
            d.chat_max_tokens = n;
        }
        d
    }

    /// The defaults of the model whose GGUF is `gguf_path` (read for its `general.sampling.*` keys).
    pub fn for_model(
        config: &Map<String, Value>,
        gguf_path: Option<&Path>,
        arch: &str,
    ) -> Defaults {
        let gguf = gguf_path.map(gguf_sampling).unwrap_or_default();
        Defaults::from_sources(config, &gguf, arch)
    }

    pub fn f32(&self, field: &str) -> Option<f32> {
        self.values
            .get(field)
            .and_then(Value::as_f64)
            .map(|v| v as f32)
    }

    pub fn u32(&self, field: &str) -> Option<u32> {
        self.values
            .get(field)
            .and_then(Value::as_f64)
            .map(|v| v.max(0.0) as u32)
    }

    /// `/props`' view: the values, their sources and the answer lengths.
    pub fn to_json(&self) -> Value {
        json!({
            "values": self.values,
            "sources": self.sources,
            "max_tokens": self.max_tokens,
            "chat_max_tokens": self.chat_max_tokens,
        })
    }
}

/// The GGUF's `general.sampling.*` values by field name (none when the file cannot be read: the other
/// sources still give every field).
fn gguf_sampling(path: &Path) -> Map<String, Value> {
    let mut out = Map::new();
    let Ok(file) = poly_models::GgufFile::open(path) else {
        return out;
    };
    let meta = file.metadata();
    for (field, key) in GGUF_KEYS {
        let number = meta
            .get(key)
            .and_then(|v| v.as_f64().or_else(|| v.as_i64().map(|x| x as f64)));
        if let Some(v) = number {
            if v.is_finite() {
                // Integers stay integers (top_k), as a run config writes them; an f32 widened is
                // rounded to the digits it holds (0.95, not 0.949999988).
                let value = if field == "top_k" {
                    json!(v.max(0.0) as u64)
                } else {
                    json!((v * 1e6).round() / 1e6)
                };
                out.insert(field.into(), value);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn run_config_then_gguf_then_family_then_llama_server() {
        let d = Defaults::from_sources(
            &map(json!({"temperature": 0.2, "max_tokens": 300})),
            &map(json!({"top_p": 0.8})),
            "qwen3moe",
        );
        assert_eq!(d.values["temperature"], 0.2);
        assert_eq!(d.sources["temperature"], "run config");
        assert_eq!(d.values["top_p"], 0.8);
        assert_eq!(d.sources["top_p"], "gguf");
        assert_eq!(d.values["top_k"], 20);
        assert_eq!(d.sources["top_k"], "family table (Qwen3)");
        assert_eq!(d.values["repeat_penalty"], 1.0);
        assert_eq!(d.sources["repeat_penalty"], "llama-server default");
        assert_eq!(d.max_tokens, Some(300));
        assert_eq!(d.chat_max_tokens, 300);
        let plain = Defaults::from_sources(&Map::new(), &Map::new(), "llama");
        assert_eq!(plain.values["temperature"], 0.8);
        assert_eq!(plain.max_tokens, None);
        assert_eq!(plain.chat_max_tokens, CHAT_MAX_TOKENS);
        assert_eq!(plain.u32("top_k"), Some(40));
        let gemma = Defaults::from_sources(&Map::new(), &Map::new(), "gemma3");
        assert_eq!(gemma.f32("temperature"), Some(1.0));
    }
}
