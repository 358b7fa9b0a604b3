//! The markers and tool-call block formats of each [`Family`], as llama.cpp's parsers read them
//! (`common/parsers/*.cpp`, `common/chat.cpp`).
//!
//! - Qwen3 / Qwen3.6 / Ornith / Clover: `<tool_call>\n<function=NAME>\n<parameter=P>\nV\n</parameter>\n
//!   </function>\n</tool_call>` (Qwen3-Coder style) or `<tool_call>\n{"name": …, "arguments": {…}}\n
//!   </tool_call>` (Qwen3 style).
//! - GLM: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>`.
//! - Gemma 4: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`.
//! - DeepSeek V3.2 / V4: `<｜DSML｜tool_calls>` (V3.2: `function_calls`) holding
//!   `<｜DSML｜invoke name="NAME">` and `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`.
//! - LFM2: `<|tool_call_start|>[NAME(k='v', n=3), …]<|tool_call_end|>` (Python call syntax).
//! - JSON in a wrapper: `{"name": …, "arguments": {…}}` (or a list of them) in `<tool_call>…</tool_call>`
//!   or a ```` ```json ```` fence.

use crate::text::family::Family;
use serde_json::{Map, Value};

/// How a tool-call block's inside is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// Qwen3-Coder XML or JSON.
    Qwen,
    Glm,
    Gemma4,
    Dsml,
    Lfm2,
    Json,
}

/// A tool-call block: its opening and closing markers and how its inside is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub open: &'static str,
    pub close: &'static str,
    pub kind: BlockKind,
}

/// The markers of a family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FormatSpec {
    /// Opens reasoning (empty: the family has none).
    pub think_start: &'static str,
    /// Close reasoning.
    pub think_ends: &'static [&'static str],
    /// A tool-call block's opening marker also ends reasoning (the model called a tool while thinking).
    pub tools_end_reasoning: bool,
    pub blocks: &'static [Block],
}

const THINK: &str = "<think>";
const THINK_ENDS: &[&str] = &["</think>"];

impl FormatSpec {
    /// The markers of `family`.
    pub fn of(family: Family) -> FormatSpec {
        match family {
            Family::Qwen3 => FormatSpec {
                think_start: THINK,
                think_ends: THINK_ENDS,
                tools_end_reasoning: true,
                blocks: &[Block {
                    open: "<tool_call>",
                    close: "</tool_call>",
                    kind: BlockKind::Qwen,
                }],
            },
            Family::Glm => FormatSpec {
                think_start: THINK,
                think_ends: THINK_ENDS,
                tools_end_reasoning: false,
                blocks: &[Block {
                    open: "<tool_call>",
                    close: "</tool_call>",
                    kind: BlockKind::Glm,
                }],
            },
            Family::Gemma4 => FormatSpec {
                think_start: "<|channel>thought",
                think_ends: &["<channel|>"],
                tools_end_reasoning: false,
                blocks: &[Block {
                    open: "<|tool_call>",
                    close: "<tool_call|>",
                    kind: BlockKind::Gemma4,
                }],
            },
            Family::DeepSeekV4 => FormatSpec {
                think_start: THINK,
                think_ends: THINK_ENDS,
                tools_end_reasoning: true,
                blocks: &[
                    Block {
                        open: "<｜DSML｜tool_calls>",
                        close: "</｜DSML｜tool_calls>",
                        kind: BlockKind::Dsml,
                    },
                    Block {
                        open: "<｜DSML｜function_calls>",
                        close: "</｜DSML｜function_calls>",
                        kind: BlockKind::Dsml,
                    },
                ],
            },
            Family::Lfm2 => FormatSpec {
                think_start: THINK,
                think_ends: THINK_ENDS,
                tools_end_reasoning: false,
                blocks: &[Block {
                    open: "<|tool_call_start|>",
                    close: "<|tool_call_end|>",
                    kind: BlockKind::Lfm2,
                }],
            },
            Family::JsonWrapper => FormatSpec {
                think_start: THINK,
                think_ends: THINK_ENDS,
                tools_end_reasoning: false,
                blocks: &[
                    Block {
                        open: "<tool_call>",
                        close: "</tool_call>",
                        kind: BlockKind::Json,
                    },
                    Block {
                        open: "```json",
                        close: "```",
                        kind: BlockKind::Json,
                    },
                ],
            },
        }
    }
}

/// One parsed tool call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// A JSON object.
    pub arguments: Value,
}

/// Reads the inside of a block; `None` when it is not a well-formed call (it then stays text).
pub fn parse_block(kind: BlockKind, inner: &str, tools: &[Value]) -> Option<Vec<ToolCall>> {
    match kind {
        BlockKind::Qwen => {
            let t = inner.trim();
            if t.starts_with("<function=") {
                parse_qwen_xml(t, tools)
            } else {
                parse_json_calls(t)
            }
        }
        BlockKind::Glm => parse_glm(inner, tools).map(|c| vec![c]),
        BlockKind::Gemma4 => parse_gemma4(inner).map(|c| vec![c]),
        BlockKind::Dsml => parse_dsml(inner),
        BlockKind::Lfm2 => parse_lfm2(inner),
        BlockKind::Json => parse_json_calls(inner.trim()),
    }
}

/// The JSON schema type(s) of parameter `param` of tool `name`, if the request declared it.
fn param_is_string(tools: &[Value], name: &str, param: &str) -> bool {
    let tool = tools.iter().find(|t| {
        t.pointer("/function/name").and_then(Value::as_str) == Some(name)
            || t.get("name").and_then(Value::as_str) == Some(name)
    });
    let Some(tool) = tool else { return false };
    let schema = tool
        .pointer("/function/parameters")
        .or_else(|| tool.get("input_schema"))
        .or_else(|| tool.get("parameters"));
    let ty = schema.and_then(|s| {
        s.pointer(&format!(
            "/properties/{}/type",
            param.replace('~', "~0").replace('/', "~1")
        ))
    });
    match ty {
        Some(Value::String(s)) => s == "string",
        Some(Value::Array(a)) => a
            .iter()
            .all(|t| t.as_str() == Some("string") || t.as_str() == Some("null")),
        _ => false,
    }
}

/// A value written as text: a string where the tool declares one, else JSON when it parses, else text.
fn typed_value(tools: &[Value], name: &str, param: &str, raw: &str) -> Value {
    if param_is_string(tools, name, param) {
        return Value::String(raw.to_string());
    }
    match serde_json::from_str::<Value>(raw.trim()) {
        Ok(v) => v,
        Err(_) => Value::String(raw.to_string()),
    }
}

/// `{"name": …, "arguments": {…}}` (arguments may also be `parameters`, or a JSON string), or a list.
fn parse_json_calls(text: &str) -> Option<Vec<ToolCall>> {
    let v: Value = serde_json::from_str(text).ok()?;
    let one = |v: &Value| -> Option<ToolCall> {
        let name = v.get("name")?.as_str()?.to_string();
        let args = v.get("arguments").or_else(|| v.get("parameters"));
        let arguments = match args {
            None => Value::Object(Map::new()),
            Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                .ok()
                .filter(Value::is_object)?,
            Some(o @ Value::Object(_)) => o.clone(),
            Some(_) => return None,
        };
        Some(ToolCall { name, arguments })
    };
    match &v {
        Value::Array(items) => items.iter().map(one).collect(),
        _ => one(&v).map(|c| vec![c]),
    }
}

/// Text between `open` and the next `close` in `s`: (inside, rest after close).
fn between<'a>(s: &'a str, open: &str, close: &str) -> Option<(&'a str, &'a str)> {
    let s = s.strip_prefix(open)?;
    let end = s.find(close)?;
    Some((&s[..end], &s[end + close.len()..]))
}

/// One newline at each end of a Qwen3-Coder parameter value is the format's, not the value's.
fn strip_one_newline(v: &str) -> &str {
    let v = v.strip_prefix('\n').unwrap_or(v);
    v.strip_suffix('\n').unwrap_or(v)
}

fn parse_qwen_xml(mut t: &str, tools: &[Value]) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    while !t.is_empty() {
        let (head, rest) = between(t, "<function=", ">")?;
        let name = head.trim().to_string();
        if name.is_empty() {
            return None;
        }
        let end = rest.find("</function>")?;
        let mut body = rest[..end].trim_start();
        t = rest[end + "</function>".len()..].trim_start();
        let mut args = Map::new();
        while !body.is_empty() {
            let (param, after) = between(body, "<parameter=", ">")?;
            let vend = after.find("</parameter>")?;
            let raw = strip_one_newline(&after[..vend]);
            let param = param.trim();
            args.insert(param.to_string(), typed_value(tools, &name, param, raw));
            body = after[vend + "</parameter>".len()..].trim_start();
        }
        calls.push(ToolCall {
            name,
            arguments: Value::Object(args),
        });
    }
    Some(calls)
}

fn parse_glm(inner: &str, tools: &[Value]) -> Option<ToolCall> {
    let t = inner.trim();
    let name_end = t.find("<arg_key>").unwrap_or(t.len());
    let name = t[..name_end].trim().to_string();
    if name.is_empty() || name.contains('<') || name.contains('{') {
        return None;
    }
    let mut body = t[name_end..].trim_start();
    let mut args = Map::new();
    while !body.is_empty() {
        let (key, rest) = between(body, "<arg_key>", "</arg_key>")?;
        let (val, rest) = between(rest.trim_start(), "<arg_value>", "</arg_value>")?;
        args.insert(
            key.trim().to_string(),
            typed_value(tools, &name, key.trim(), val),
        );
        body = rest.trim_start();
    }
    Some(ToolCall {
        name,
        arguments: Value::Object(args),
    })
}

fn parse_dsml(inner: &str) -> Option<Vec<ToolCall>> {
    const INVOKE: &str = "<｜DSML｜invoke name=\"";
    const INVOKE_END: &str = "</｜DSML｜invoke>";
    const PARAM: &str = "<｜DSML｜parameter name=\"";
    const PARAM_END: &str = "</｜DSML｜parameter>";
    let mut t = inner.trim();
    let mut calls = Vec::new();
    while !t.is_empty() {
        let (name, rest) = between(t, INVOKE, "\">")?;
        let end = rest.find(INVOKE_END)?;
        let mut body = rest[..end].trim();
        t = rest[end + INVOKE_END.len()..].trim_start();
        let mut args = Map::new();
        while !body.is_empty() {
            let (key, rest) = between(body, PARAM, "\"")?;
            let rest = rest.trim_start();
            let (is_string, rest) = if let Some(r) = rest.strip_prefix("string=\"true\">") {
                (true, r)
            } else {
                (false, rest.strip_prefix("string=\"false\">")?)
            };
            let vend = rest.find(PARAM_END)?;
            let raw = &rest[..vend];
            let value = if is_string {
                Value::String(raw.to_string())
            } else {
                serde_json::from_str(raw.trim()).ok()?
            };
            args.insert(key.to_string(), value);
            body = rest[vend + PARAM_END.len()..].trim_start();
        }
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: Value::Object(args),
        });
    }
    Some(calls)
}

/// Gemma 4's call syntax: `call:NAME{…}` with unquoted keys and `<|"|>`-delimited strings.
fn parse_gemma4(inner: &str) -> Option<ToolCall> {
    let t = inner.trim().strip_prefix("call:")?;
    let brace = t.find('{')?;
    let name = t[..brace].trim().to_string();
    if name.is_empty() {
        return None;
    }
    let mut cur = Cursor::new(&t[brace..]);
    let args = cur.gemma4_value()?;
    cur.skip_ws();
    if !cur.rest().is_empty() || !args.is_object() {
        return None;
    }
    Some(ToolCall {
        name,
        arguments: args,
    })
}

/// LFM2's `[name(k=v, …), …]` (Python call syntax, Python or JSON literals).
fn parse_lfm2(inner: &str) -> Option<Vec<ToolCall>> {
    let mut cur = Cursor::new(inner.trim());
    cur.expect("[")?;
    let mut calls = Vec::new();
    loop {
        cur.skip_ws();
        if cur.eat("]") {
            break;
        }
        if !calls.is_empty() {
            cur.expect(",")?;
            cur.skip_ws();
        }
        let name = cur.take_while(|c| c.is_alphanumeric() || c == '_' || c == '.' || c == '-');
        if name.is_empty() {
            return None;
        }
        cur.expect("(")?;
        let mut args = Map::new();
        loop {
            cur.skip_ws();
            if cur.eat(")") {
                break;
            }
            if !args.is_empty() {
                cur.expect(",")?;
                cur.skip_ws();
            }
            let key = cur.take_while(|c| c.is_alphanumeric() || c == '_');
            if key.is_empty() {
                return None;
            }
            cur.skip_ws();
            cur.expect("=")?;
            cur.skip_ws();
            let v = cur.python_value()?;
            args.insert(key.to_string(), v);
        }
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: Value::Object(args),
        });
    }
    cur.skip_ws();
    if !cur.rest().is_empty() {
        return None;
    }
    Some(calls)
}

/// A small reader over text for the non-JSON literal syntaxes.
struct Cursor<'a> {
    s: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(s: &'a str) -> Self {
        Cursor { s, pos: 0 }
    }

    fn rest(&self) -> &'a str {
        &self.s[self.pos..]
    }

    fn skip_ws(&mut self) {
        let r = self.rest();
        self.pos += r.len() - r.trim_start().len();
    }

    fn eat(&mut self, lit: &str) -> bool {
        if self.rest().starts_with(lit) {
            self.pos += lit.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, lit: &str) -> Option<()> {
        self.eat(lit).then_some(())
    }

    fn take_while(&mut self, f: impl Fn(char) -> bool) -> &'a str {
        let r = self.rest();
        let n = r.find(|c: char| !f(c)).unwrap_or(r.len());
        self.pos += n;
        &r[..n]
    }

    /// A JSON number, or a bare word (`true`, `None`, …) read by `word`.
    fn scalar(&mut self, word: impl Fn(&str) -> Option<Value>) -> Option<Value> {
        let tok = self.take_while(|c| c.is_alphanumeric() || matches!(c, '-' | '+' | '.' | '_'));
        if tok.is_empty() {
            return None;
        }
        if let Some(v) = word(tok) {
            return Some(v);
        }
        serde_json::from_str::<serde_json::Number>(tok)
            .ok()
            .map(Value::Number)
    }

    fn gemma4_value(&mut self) -> Option<Value> {
        const QUOTE: &str = "<|\"|>";
        self.skip_ws();
        if self.eat(QUOTE) {
            let r = self.rest();
            let end = r.find(QUOTE)?;
            self.pos += end + QUOTE.len();
            return Some(Value::String(r[..end].to_string()));
        }
        if self.eat("{") {
            let mut m = Map::new();
            loop {
                self.skip_ws();
                if self.eat("}") {
                    return Some(Value::Object(m));
                }
                if !m.is_empty() {
                    self.expect(",")?;
                    self.skip_ws();
                }
                let key = self.take_while(|c| c != ':' && c != '}');
                if key.is_empty() {
                    return None;
                }
                self.expect(":")?;
                let v = self.gemma4_value()?;
                m.insert(key.trim().to_string(), v);
            }
        }
        if self.eat("[") {
            let mut a = Vec::new();
            loop {
                self.skip_ws();
                if self.eat("]") {
                    return Some(Value::Array(a));
                }
                if !a.is_empty() {
                    self.expect(",")?;
                }
                a.push(self.gemma4_value()?);
            }
        }
        self.scalar(|w| match w {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            "null" => Some(Value::Null),
            _ => None,
        })
    }

    fn python_value(&mut self) -> Option<Value> {
        self.skip_ws();
        let r = self.rest();
        if let Some(q) = r.chars().next().filter(|&c| c == '\'' || c == '"') {
            self.pos += 1;
            let mut out = String::new();
            let mut chars = self.rest().char_indices();
            while let Some((i, c)) = chars.next() {
                if c == q {
                    self.pos += i + 1;
                    return Some(Value::String(out));
                }
                if c == '\\' {
                    let (_, e) = chars.next()?;
                    out.push(match e {
                        'n' => '\n',
                        't' => '\t',
                        'r' => '\r',
                        other => other,
                    });
                } else {
                    out.push(c);
                }
            }
            return None;
        }
        if self.eat("[") {
            let mut a = Vec::new();
            loop {
                self.skip_ws();
                if self.eat("]") {
                    return Some(Value::Array(a));
                }
                if !a.is_empty() {
                    self.expect(",")?;
                }
                a.push(self.python_value()?);
            }
        }
        if self.eat("{") {
            let mut m = Map::new();
            loop {
                self.skip_ws();
                if self.eat("}") {
                    return Some(Value::Object(m));
                }
                if !m.is_empty() {
                    self.expect(",")?;
                }
                let Value::String(k) = self.python_value()? else {
                    return None;
                };
                self.skip_ws();
                self.expect(":")?;
                let v = self.python_value()?;
                m.insert(k, v);
            }
        }
        self.scalar(|w| match w {
            "true" | "True" => Some(Value::Bool(true)),
            "false" | "False" => Some(Value::Bool(false)),
            "null" | "None" => Some(Value::Null),
            _ => None,
        })
    }
}
