//! The incremental parser of a model's reply: text chunks in, events out (content, reasoning, tool calls).
//!
//! Streaming and non-streaming use the same [`ReplyParser`]: a non-streaming reply is one chunk followed by
//! [`ReplyParser::finish`]. The parser holds back only what could still be the start of a marker (`<thi`
//! may become `<think>`) and a tool-call block until it is closed; so the events of a reply do not depend on
//! how it was cut into chunks, except that text deltas may be split differently ([`coalesce`] joins them).
//!
//! A tool-call block that does not parse, or that the reply ends inside, is given back as content text,
//! exactly as the model wrote it: nothing the model wrote is lost.
//!
//! The markers and block formats of each [`Family`] are in [`formats`].

pub mod formats;

use super::family::Family;
use formats::FormatSpec;
use serde_json::Value;

/// What the parser found in the reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParseEvent {
    /// Answer text.
    Content(String),
    /// Reasoning text (OpenAI `reasoning_content`, Anthropic `thinking`).
    Reasoning(String),
    /// A tool call begins; `index` counts the calls of this reply from 0.
    ToolCallStart { index: usize, name: String },
    /// The call's arguments as JSON object text.
    ToolCallArgs { index: usize, arguments: String },
    /// The call is complete.
    ToolCallEnd { index: usize },
}

/// How a reply starts and which tools the request declared.
#[derive(Clone, Debug, Default)]
pub struct ParserOptions {
    /// The prompt ended inside reasoning (its generation prompt opened `<think>`), so the reply starts
    /// as reasoning. See [`prompt_opens_reasoning`].
    pub starts_in_reasoning: bool,
    /// The request's tools (OpenAI `tools` entries): a parameter declared `string` keeps its text as a
    /// string, others are read as JSON when they parse.
    pub tools: Vec<Value>,
}

/// Whether a rendered prompt ends inside an open reasoning block of `family` (e.g. Qwen3.6's generation
/// prompt ends with `<think>\n`).
pub fn prompt_opens_reasoning(family: Family, prompt: &str) -> bool {
    let spec = FormatSpec::of(family);
    let trimmed = prompt.trim_end();
    match (
        trimmed.rfind(spec.think_start),
        spec.think_ends
            .iter()
            .filter_map(|e| trimmed.rfind(e))
            .max(),
    ) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Content,
    Reasoning,
    /// Inside a tool-call block: index into the spec's blocks.
    Block(usize),
}

/// The incremental reply parser of one reply.
#[derive(Debug)]
pub struct ReplyParser {
    spec: FormatSpec,
    tools: Vec<Value>,
    state: State,
    /// Text not yet turned into events.
    buf: String,
    /// Whitespace at the start of the next content / reasoning text is dropped (after a reasoning
    /// marker, as llama.cpp's parsers do).
    skip_ws: bool,
    n_calls: usize,
}

impl ReplyParser {
    /// A parser for a reply of `family`.
    pub fn new(family: Family, options: ParserOptions) -> ReplyParser {
        let state = if options.starts_in_reasoning {
            State::Reasoning
        } else {
            State::Content
        };
        ReplyParser {
            spec: FormatSpec::of(family),
            tools: options.tools,
            state,
            buf: String::new(),
            skip_ws: options.starts_in_reasoning,
            n_calls: 0,
        }
    }

    /// Adds a chunk of the reply; returns the events it completes.
    pub fn feed(&mut self, chunk: &str) -> Vec<ParseEvent> {
        self.buf.push_str(chunk);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out
    }

    /// Ends the reply: what was held back is given out (an unclosed tool-call block as content text).
    pub fn finish(&mut self) -> Vec<ParseEvent> {
        let mut out = Vec::new();
        while self.step(&mut out) {}
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            State::Content => self.emit_text(&mut out, false, &rest),
            State::Reasoning => self.emit_text(&mut out, true, &rest),
            State::Block(b) => {
                let raw = format!("{}{}", self.spec.blocks[b].open, rest);
                self.skip_ws = false;
                self.emit_text(&mut out, false, &raw);
            }
        }
        self.state = State::Content;
        out
    }

    /// One transition if the buffer allows it; false when more text is needed.
    fn step(&mut self, out: &mut Vec<ParseEvent>) -> bool {
        match self.state {
            State::Content | State::Reasoning => {
                let reasoning = self.state == State::Reasoning;
                let mut markers: Vec<(&'static str, State)> = Vec::new();
                if reasoning {
                    for e in self.spec.think_ends {
                        markers.push((e, State::Content));
                    }
                } else if !self.spec.think_start.is_empty() {
                    markers.push((self.spec.think_start, State::Reasoning));
                }
                if !reasoning || self.spec.tools_end_reasoning {
                    for (i, b) in self.spec.blocks.iter().enumerate() {
                        markers.push((b.open, State::Block(i)));
                    }
                }
                // The earliest marker; at equal positions the longest.
                let found = markers
                    .iter()
                    .filter_map(|&(m, s)| self.buf.find(m).map(|p| (p, m, s)))
                    .min_by(|a, b| a.0.cmp(&b.0).then(b.1.len().cmp(&a.1.len())));
                match found {
                    Some((pos, marker, next)) => {
                        let before: String = self.buf[..pos].to_string();
                        self.emit_text(out, reasoning, &before);
                        self.buf.drain(..pos + marker.len());
                        self.skip_ws = matches!(next, State::Reasoning | State::Content);
                        self.state = next;
                        true
                    }
                    None => {
                        let hold = markers
                            .iter()
                            .map(|(m, _)| partial_suffix(&self.buf, m))
                            .max()
                            .unwrap_or(0);
                        let cut = self.buf.len() - hold;
                        if cut > 0 {
                            let text: String = self.buf[..cut].to_string();
                            self.emit_text(out, reasoning, &text);
                            self.buf.drain(..cut);
                        }
                        false
                    }
                }
            }
            State::Block(b) => {
                let block = &self.spec.blocks[b];
                let Some(pos) = self.buf.find(block.close) else {
                    return false;
                };
                let inner: String = self.buf[..pos].to_string();
                self.buf.drain(..pos + block.close.len());
                self.state = State::Content;
                match formats::parse_block(block.kind, &inner, &self.tools) {
                    Some(calls) if !calls.is_empty() => {
                        for call in calls {
                            let index = self.n_calls;
                            self.n_calls += 1;
                            out.push(ParseEvent::ToolCallStart {
                                index,
                                name: call.name,
                            });
                            out.push(ParseEvent::ToolCallArgs {
                                index,
                                arguments: call.arguments.to_string(),
                            });
                            out.push(ParseEvent::ToolCallEnd { index });
                        }
                        self.skip_ws = true;
                    }
                    _ => {
                        let raw = format!("{}{}{}", block.open, inner, block.close);
                        self.skip_ws = false;
                        self.emit_text(out, false, &raw);
                    }
                }
                true
            }
        }
    }

    fn emit_text(&mut self, out: &mut Vec<ParseEvent>, reasoning: bool, text: &str) {
        let text = if self.skip_ws {
            text.trim_start()
        } else {
            text
        };
        if text.is_empty() {
            return;
        }
        self.skip_ws = false;
        // Adjacent deltas of one kind are joined, so a chunk gives at most one event per run.
        match (out.last_mut(), reasoning) {
            (Some(ParseEvent::Content(s)), false) | (Some(ParseEvent::Reasoning(s)), true) => {
                s.push_str(text)
            }
            _ => out.push(if reasoning {
                ParseEvent::Reasoning(text.to_string())
            } else {
                ParseEvent::Content(text.to_string())
            }),
        }
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `marker` (on character boundaries).
fn partial_suffix(text: &str, marker: &str) -> usize {
    let max = marker.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// Joins adjacent text deltas of the same kind (events of differently cut streams compare equal).
pub fn coalesce(events: impl IntoIterator<Item = ParseEvent>) -> Vec<ParseEvent> {
    let mut out: Vec<ParseEvent> = Vec::new();
    for e in events {
        match (out.last_mut(), e) {
            (Some(ParseEvent::Content(a)), ParseEvent::Content(b)) => a.push_str(&b),
            (Some(ParseEvent::Reasoning(a)), ParseEvent::Reasoning(b)) => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}

/// A whole reply, parsed (non-streaming responses).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedReply {
    pub content: String,
    pub reasoning: String,
    /// (name, arguments as JSON object text), in order.
    pub tool_calls: Vec<(String, String)>,
}

/// Parses a complete reply with the same parser streaming uses.
pub fn parse_reply(family: Family, options: ParserOptions, text: &str) -> ParsedReply {
    let mut p = ReplyParser::new(family, options);
    let mut events = p.feed(text);
    events.extend(p.finish());
    let mut reply = ParsedReply::default();
    for e in events {
        match e {
            ParseEvent::Content(s) => reply.content.push_str(&s),
            ParseEvent::Reasoning(s) => reply.reasoning.push_str(&s),
            ParseEvent::ToolCallStart { name, .. } => reply.tool_calls.push((name, String::new())),
            ParseEvent::ToolCallArgs { arguments, .. } => {
                if let Some(last) = reply.tool_calls.last_mut() {
                    last.1 = arguments;
                }
            }
            ParseEvent::ToolCallEnd { .. } => {}
        }
    }
    reply
}

pub use formats::ToolCall;
