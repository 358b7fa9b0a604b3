//! Messages the engine sends to the server: `READY`, `T`, `DONE`, `ERR`, `STATS`, `PROGRESS`.

use serde::{Deserialize, Serialize, Serializer};
use std::collections::BTreeMap;

use crate::to_engine::truncate;
use crate::{format_line, parse_object, split_verb, ErrorCode, ProtocolError};

/// A message from the engine.
#[derive(Debug, Clone, PartialEq)]
pub enum FromEngine {
    /// `READY {...}`: once, after the model is loaded.
    Ready(Ready),
    /// `T {...}`: one or more generated tokens of a request, in order.
    Tokens(Tokens),
    /// `DONE {...}`: a request ended.
    Done(Done),
    /// `ERR {...}`: a request (or, with a null id, a line or the engine itself) cannot be served.
    Err(ErrorReply),
    /// `STATS {...}`: the answer to `STATS`.
    Stats(Stats),
    /// `PROGRESS {...}`: how far a long prompt has been read (between its forward calls), so that the
    /// server can tell a slow read from a stopped engine.
    Progress(Progress),
}

/// `PROGRESS`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub id: String,
    /// Prompt tokens read so far (kept-state tokens included).
    pub prompt_read: u32,
    /// The prompt's length.
    pub prompt_tokens: u32,
}

/// `READY`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ready {
    pub protocol: u32,
    /// The model file the engine loaded.
    pub model: String,
    /// The GGUF's `general.architecture`.
    pub arch: String,
    pub n_vocab: u32,
    /// The context the engine serves (prompt plus generated tokens of a request).
    pub n_ctx: u32,
    pub bos: Option<u32>,
    /// The tokens that end an answer by default.
    pub eos: Vec<u32>,
    /// `cpu` or `cuda:0 <name>`.
    pub device: String,
    /// Routed experts in the model (layers × experts; 0 for a dense model).
    pub experts_total: u64,
    /// Of those, how many live in VRAM.
    pub experts_vram: u64,
    /// How the engine splits a prompt into forward calls (absent from engines before it said).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_calls: Option<PromptCalls>,
    /// Where answers take guessed tokens from: `repeats` (the conversation's own, on the CPU for models
    /// whose state can be cut back), `draft` (a draft model's), `draft-block` (the model's own MTP block)
    /// or `off` (absent from engines before it said).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guesses: Option<String>,
    /// The execution knobs (`poly-engine` flags such as `--mmq off`) that differ from their defaults, by
    /// flag name without `--`; empty (and absent from the line) when every one is the default.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub knobs: BTreeMap<String, String>,
    /// The projector that reads a GEN's pictures (`--mmproj`); absent: the engine reads text only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vision: Option<Vision>,
}

/// READY's `vision`: the projector file and its type (`qwen3vl_merger`), which says how a picture's
/// placeholder is written around (Qwen-VL: `<|vision_start|>`, the placeholder, `<|vision_end|>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vision {
    pub mmproj: String,
    pub projector: String,
}

/// How a prompt is read: in calls of `ubatch` tokens, or `long_ubatch` while more than `ubatch` remain
/// (0: never), with a checkpoint of the recurrent layers every `checkpoint_every` tokens (0: only where a
/// request asks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptCalls {
    pub ubatch: u32,
    pub long_ubatch: u32,
    pub checkpoint_every: u32,
}

/// `T`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tokens {
    pub id: String,
    pub tokens: Vec<u32>,
    /// The log-probability of each token in `tokens` (before sampling's truncation and temperature).
    #[serde(serialize_with = "finite_vec")]
    pub logprobs: Vec<f32>,
    /// Per token, the likeliest tokens with their log-probabilities, when the request asked for them.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "finite_top"
    )]
    pub top: Option<Vec<Vec<(u32, f32)>>>,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// A stop token was written.
    Stop,
    /// `max_tokens` were written.
    Length,
    /// `CANCEL` arrived.
    Cancel,
}

/// `DONE`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Done {
    pub id: String,
    pub reason: StopReason,
    pub prompt_tokens: u32,
    /// Prompt tokens not read again thanks to a kept state.
    pub cached_tokens: u32,
    pub generated: u32,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    /// The share of routed-expert uses served from VRAM (null on the CPU or for a dense model), over the
    /// whole request: for a long prompt mostly the prompt's.
    pub experts_vram_share: Option<f64>,
    /// The same over the answer's tokens alone (after the prompt was read); absent where there is no
    /// cache or no answer token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts_vram_share_answer: Option<f64>,
    #[serde(default)]
    pub draft_proposed: u32,
    #[serde(default)]
    pub draft_accepted: u32,
    /// What an approximate mode (`--tail-skip`, `--skip-weight`, `--cold-mass`) left out of this
    /// request's answer; absent when none is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts_left_out: Option<LeftOut>,
    /// The routed choices of this request's answer that `--cache-bias` made (cached experts chosen in
    /// place of uncached ones); absent when it is off or no answer token met the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts_swapped_in: Option<SwappedIn>,
}

/// Routed choices `--cache-bias` made in a request's answer tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SwappedIn {
    /// Choices it made (a cached expert chosen where the unbiased top-k had an uncached one).
    pub experts: u64,
    /// The mean share of a token's routed weight (per MoE layer) that those experts carry.
    pub weight_share: f64,
}

/// Uncached experts an approximate mode left out of a request's answer tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LeftOut {
    /// Experts left out (one token's routing each).
    pub experts: u64,
    /// The mean share of a token's routed weight (per MoE layer) they carried.
    pub weight_share: f64,
    /// Expert bytes not read.
    pub bytes: u64,
}

/// `ERR`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub id: Option<String>,
    pub code: ErrorCode,
    pub message: String,
}

impl From<ProtocolError> for ErrorReply {
    fn from(e: ProtocolError) -> ErrorReply {
        ErrorReply {
            id: e.id,
            code: e.code,
            message: e.message,
        }
    }
}

/// One kept conversation in `STATS`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConversationInfo {
    pub id: String,
    /// Tokens its state holds.
    pub tokens: u32,
    /// The active conversation (in the engine's working state) rather than parked in RAM.
    pub active: bool,
    /// Memory its state and checkpoints take.
    pub bytes: u64,
    /// Checkpoints kept for it.
    #[serde(default)]
    pub checkpoints: u32,
}

/// `STATS`. Fields beyond these (cache figures, timings) are carried in `extra`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Resident memory of the engine process.
    pub rss_bytes: u64,
    /// VRAM the engine holds (null without a GPU).
    pub vram_bytes: Option<u64>,
    pub conversations: Vec<ConversationInfo>,
    /// Memory the parked conversations take, and its bound (`--park-mib`).
    pub parked_bytes: u64,
    pub park_limit_bytes: u64,
    /// Requests waiting behind the running one.
    #[serde(default)]
    pub queued: u32,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl FromEngine {
    /// Reads one line (with or without its newline).
    pub fn parse(line: &str) -> Result<FromEngine, ProtocolError> {
        let (verb, body) = split_verb(line);
        let value = match verb {
            "READY" | "T" | "DONE" | "ERR" | "STATS" | "PROGRESS" => parse_object(verb, body)?,
            _ => {
                return Err(ProtocolError::bad_request(
                    None,
                    format!("unknown engine verb `{}`", truncate(verb, 40)),
                ))
            }
        };
        fn read<T: serde::de::DeserializeOwned>(
            verb: &str,
            value: serde_json::Value,
        ) -> Result<T, ProtocolError> {
            let id = value.get("id").and_then(|v| v.as_str()).map(str::to_owned);
            serde_json::from_value(value)
                .map_err(|e| ProtocolError::new(id, ErrorCode::BadRequest, format!("{verb}: {e}")))
        }
        Ok(match verb {
            "READY" => FromEngine::Ready(read(verb, value)?),
            "T" => FromEngine::Tokens(read(verb, value)?),
            "DONE" => FromEngine::Done(read(verb, value)?),
            "ERR" => FromEngine::Err(read(verb, value)?),
            "PROGRESS" => FromEngine::Progress(read(verb, value)?),
            _ => FromEngine::Stats(read(verb, value)?),
        })
    }

    /// The line, without its newline.
    pub fn to_line(&self) -> String {
        match self {
            FromEngine::Ready(m) => format_line("READY", m),
            FromEngine::Tokens(m) => format_line("T", m),
            FromEngine::Done(m) => format_line("DONE", m),
            FromEngine::Err(m) => format_line("ERR", m),
            FromEngine::Stats(m) => format_line("STATS", m),
            FromEngine::Progress(m) => format_line("PROGRESS", m),
        }
    }

    /// The request this message belongs to, if any.
    pub fn request_id(&self) -> Option<&str> {
        match self {
            FromEngine::Tokens(m) => Some(&m.id),
            FromEngine::Done(m) => Some(&m.id),
            FromEngine::Err(m) => m.id.as_deref(),
            FromEngine::Progress(m) => Some(&m.id),
            FromEngine::Ready(_) | FromEngine::Stats(_) => None,
        }
    }
}

/// JSON has no infinities: an impossible token's log-probability (−∞) is written as the lowest f32, and
/// NaN (which a correct engine never produces) likewise, so the line always parses.
fn finite(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else if x > 0.0 {
        f32::MAX
    } else {
        f32::MIN
    }
}

fn finite_vec<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|&x| finite(x)))
}

fn finite_top<S: Serializer>(v: &Option<Vec<Vec<(u32, f32)>>>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        None => s.serialize_none(),
        Some(steps) => s.collect_seq(steps.iter().map(|step| {
            step.iter()
                .map(|&(t, p)| (t, finite(p)))
                .collect::<Vec<_>>()
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(m: FromEngine) {
        let line = m.to_line();
        assert!(!line.contains('\n'));
        assert_eq!(FromEngine::parse(&line).unwrap(), m, "{line}");
    }

    #[test]
    fn every_engine_message_round_trips() {
        round_trip(FromEngine::Ready(Ready {
            protocol: 1,
            model: "/m/a b.gguf".into(),
            arch: "qwen35moe".into(),
            n_vocab: 2048,
            n_ctx: 4096,
            bos: None,
            eos: vec![1, 2],
            device: "cpu".into(),
            experts_total: 96,
            experts_vram: 0,
            guesses: Some("repeats".into()),
            prompt_calls: Some(PromptCalls {
                ubatch: 2048,
                long_ubatch: 8192,
                checkpoint_every: 8192,
            }),
            knobs: [("mmq".to_string(), "off".to_string())].into(),
            vision: Some(Vision {
                mmproj: "/m/mmproj.gguf".into(),
                projector: "qwen3vl_merger".into(),
            }),
        }));
        round_trip(FromEngine::Tokens(Tokens {
            id: "r1".into(),
            tokens: vec![3, 4],
            logprobs: vec![-0.5, -1.25],
            top: Some(vec![
                vec![(3, -0.5), (9, -2.0)],
                vec![(4, -1.25), (8, -1.5)],
            ]),
        }));
        round_trip(FromEngine::Done(Done {
            id: "r1".into(),
            reason: StopReason::Length,
            prompt_tokens: 10,
            cached_tokens: 4,
            generated: 2,
            prefill_ms: 1.5,
            decode_ms: 3.25,
            experts_vram_share: None,
            experts_vram_share_answer: None,
            draft_proposed: 0,
            draft_accepted: 0,
            experts_left_out: None,
            experts_swapped_in: None,
        }));
        round_trip(FromEngine::Err(ErrorReply {
            id: None,
            code: ErrorCode::ContextOverflow,
            message: "a \"quoted\"\nmessage".into(),
        }));
        round_trip(FromEngine::Progress(Progress {
            id: "r1".into(),
            prompt_read: 512,
            prompt_tokens: 3000,
        }));
        let mut extra = serde_json::Map::new();
        extra.insert("cache".into(), serde_json::json!({"hits": 3}));
        round_trip(FromEngine::Stats(Stats {
            rss_bytes: 1 << 30,
            vram_bytes: None,
            conversations: vec![ConversationInfo {
                id: "c1".into(),
                tokens: 12,
                active: true,
                bytes: 4096,
                checkpoints: 1,
            }],
            parked_bytes: 0,
            park_limit_bytes: 1 << 30,
            queued: 0,
            extra,
        }));
    }

    #[test]
    fn the_wire_names_are_the_specified_ones() {
        let done = FromEngine::Done(Done {
            id: "r1".into(),
            reason: StopReason::Cancel,
            prompt_tokens: 1,
            cached_tokens: 0,
            generated: 0,
            prefill_ms: 0.0,
            decode_ms: 0.0,
            experts_vram_share: None,
            experts_vram_share_answer: None,
            draft_proposed: 0,
            draft_accepted: 0,
            experts_left_out: None,
            experts_swapped_in: None,
        });
        assert_eq!(
            done.to_line(),
            r#"DONE {"id":"r1","reason":"cancel","prompt_tokens":1,"cached_tokens":0,"generated":0,"prefill_ms":0.0,"decode_ms":0.0,"experts_vram_share":null,"draft_proposed":0,"draft_accepted":0}"#
        );
        let err = FromEngine::Err(ErrorReply {
            id: Some("r2".into()),
            code: ErrorCode::Busy,
            message: "queue full".into(),
        });
        assert_eq!(
            err.to_line(),
            r#"ERR {"id":"r2","code":"busy","message":"queue full"}"#
        );
    }

    #[test]
    fn impossible_tokens_still_make_a_parseable_line() {
        let t = FromEngine::Tokens(Tokens {
            id: "r".into(),
            tokens: vec![1],
            logprobs: vec![f32::NEG_INFINITY],
            top: Some(vec![vec![(1, f32::NAN)]]),
        });
        let FromEngine::Tokens(back) = FromEngine::parse(&t.to_line()).unwrap() else {
            panic!("not T")
        };
        assert_eq!(back.logprobs, vec![f32::MIN]);
        assert_eq!(back.top, Some(vec![vec![(1, f32::MIN)]]));
    }

    #[test]
    fn unknown_codes_and_fields_from_a_newer_engine_are_read() {
        let m = FromEngine::parse(r#"ERR {"id":null,"code":"melted","message":"x","extra":1}"#)
            .unwrap();
        assert_eq!(
            m,
            FromEngine::Err(ErrorReply {
                id: None,
                code: ErrorCode::Unknown,
                message: "x".into()
            })
        );
        assert!(FromEngine::parse("HELLO {}").is_err());
        assert!(FromEngine::parse(r#"T {"id":"r"}"#).is_err());
    }
}
