//! Chat templates: the model's Jinja template rendered with minijinja, the way llama.cpp renders it.
//!
//! - Sandboxed: no loader (no `include` / `import` of files), a fuel limit on instructions and the
//!   default recursion limit, so a template cannot read files or run away; memory is bounded too: the
//!   output at [`MAX_OUTPUT_BYTES`], and every string a template builds (operators, filters, captures:
//!   the vendored minijinja's `MAX_STRING_LEN`, vendor/README.md; Python string methods here), so a
//!   template that doubles a string fails with an error instead of aborting the server.
//! - Jinja as HF templates need it: `trim_blocks` / `lstrip_blocks` (as transformers and llama.cpp set
//!   them), loop controls, Python string and dict methods (minijinja-contrib's pycompat),
//!   `raise_exception`, `strftime_now`, and `tojson` as Python's `json.dumps` writes it (`", "` and
//!   `": "` separators, key order kept, non-ASCII kept), which is also llama.cpp's.
//! - The context llama.cpp gives (`common/chat.cpp`): `messages` in OpenAI form (null content as `""`,
//!   `developer` as `system`, tool-call arguments as objects when the template reads them as objects, a
//!   leading system message folded into the first user message when the template ignores system
//!   messages), `tools` only when there are some, `bos_token`, `eos_token`, `enable_thinking`,
//!   `add_generation_prompt` only when true, `datetime` and `date_string`; a leading BOS text is removed
//!   when the tokenizer adds BOS itself.
//!
//! Models without a template get one by family ([`family_template`]); Gemma 3's turn format is one.

use super::{Result, TextError};
use minijinja::value::{Kwargs, Value as JValue, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Instructions a template may run for one render (a long conversation with many tools needs a few
/// hundred thousand; a runaway loop is stopped).
const FUEL: u64 = 20_000_000;

/// What a template renders.
#[derive(Clone, Debug, Default)]
pub struct ChatInput {
    /// OpenAI chat messages (`role`, `content`, `tool_calls`, `tool_call_id`, `name`, `reasoning_content`).
    pub messages: Vec<Value>,
    /// OpenAI tools (`{"type": "function", "function": {…}}`); none renders no `tools` variable.
    pub tools: Vec<Value>,
    pub add_generation_prompt: bool,
    /// `enable_thinking` (llama.cpp's default is true).
    pub enable_thinking: Option<bool>,
    /// Extra variables (`chat_template_kwargs`).
    pub extra: Map<String, Value>,
    /// The time for `strftime_now` and `datetime`; now when `None`.
    pub now: Option<SystemTime>,
}

/// A compiled chat template with what llama.cpp probes of it.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Tool-call arguments are given as objects (the template reads their keys).
    object_arguments: bool,
    /// The template renders system messages (else they are folded into the next message).
    system_role: bool,
    /// Gemma 4: when the template leaves the prompt at a closed turn, llama.cpp opens the model's turn
    /// (`common/parsers/gemma4.cpp`).
    gemma4_open_turn: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("object_arguments", &self.object_arguments)
            .field("system_role", &self.system_role)
            .finish()
    }
}

const NAME: &str = "chat";

fn jinja_err(e: Error) -> TextError {
    let mut msg = format!("chat template: {e}");
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    TextError::new(msg)
}

impl ChatTemplate {
    /// Compiles `source` with the model's BOS / EOS texts.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(bounded_methods);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(jinja_err)?;
        let mut t = ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            object_arguments: false,
            system_role: true,
            gemma4_open_turn: source.contains("'<|tool_call>call:'"),
        };
        t.probe();
        Ok(t)
    }

    /// llama.cpp's capability probes (`common/jinja/caps.cpp`), by what the output shows.
    fn probe(&mut self) {
        let sys_marker = "SYSTEM_MARKER_8F3A";
        let sys = ChatInput {
            messages: vec![
                serde_json::json!({"role": "system", "content": sys_marker}),
                serde_json::json!({"role": "user", "content": "User message"}),
            ],
            ..Default::default()
        };
        if let Ok(out) = self.render_raw(&sys) {
            self.system_role = out.contains(sys_marker);
        }
        let arg_marker = "ARG_MARKER_51C7";
        let tools = ChatInput {
            messages: vec![
                serde_json::json!({"role": "user", "content": "User message"}),
                serde_json::json!({"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "tool1", "arguments": {"arg": arg_marker}}, "id": "call00001"}
                ]}),
                serde_json::json!({"role": "tool", "content": "Tool response", "tool_call_id": "call00001"}),
                serde_json::json!({"role": "assistant", "content": "The tool response was 'tool response'"}),
                serde_json::json!({"role": "user", "content": "User message"}),
            ],
            tools: vec![serde_json::json!({"type": "function", "function": {
                "name": "tool1", "description": "Tool description",
                "parameters": {"type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}}, "required": ["arg"]}
            }})],
            ..Default::default()
        };
        if let Ok(out) = self.render_raw(&tools) {
            self.object_arguments = out.contains(arg_marker);
        }
    }

    /// Renders the prompt of a conversation. `strip_bos`: the tokenizer adds BOS itself, so a BOS text the
    /// template writes first is removed (as llama.cpp does).
    pub fn render(&self, input: &ChatInput, strip_bos: bool) -> Result<String> {
        let mut messages = normalize_messages(&input.messages, self.object_arguments)?;
        if !self.system_role {
            fold_system_message(&mut messages);
        }
        let normalized = ChatInput {
            messages,
            ..input.clone()
        };
        let mut out = self.render_raw(&normalized).map_err(jinja_err)?;
        if self.gemma4_open_turn && input.add_generation_prompt && out.ends_with("<turn|>\n") {
            out.push_str("<|turn>model\n");
        }
        Ok(match out.strip_prefix(self.bos_token.as_str()) {
            Some(rest) if strip_bos && !self.bos_token.is_empty() => rest.to_string(),
            _ => out,
        })
    }

    fn render_raw(&self, input: &ChatInput) -> std::result::Result<String, Error> {
        let now = input.now.unwrap_or_else(SystemTime::now);
        let mut ctx = Map::new();
        ctx.insert("messages".into(), Value::Array(input.messages.clone()));
        ctx.insert("bos_token".into(), Value::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Value::String(self.eos_token.clone()));
        ctx.insert(
            "enable_thinking".into(),
            Value::Bool(input.enable_thinking.unwrap_or(true)),
        );
        if !input.tools.is_empty() {
            ctx.insert("tools".into(), Value::Array(input.tools.clone()));
        }
        ctx.insert("datetime".into(), Value::String(strftime(now, "%b %d %Y")));
        ctx.insert(
            "date_string".into(),
            Value::String(strftime(now, "%d %b %Y")),
        );
        for (k, v) in &input.extra {
            ctx.insert(k.clone(), v.clone());
        }
        if input.add_generation_prompt {
            ctx.insert("add_generation_prompt".into(), Value::Bool(true));
        }
        let mut env_ctx = JValue::from_serialize(&ctx);
        // strftime_now sees the render's clock.
        let clock = JValue::from_function(move |fmt: String| strftime(now, &fmt));
        env_ctx = minijinja::context! { strftime_now => clock, ..env_ctx };
        let tmpl = self.env.get_template(NAME)?;
        let mut out = BoundedOutput::default();
        match tmpl.render_captured_to(env_ctx, &mut out) {
            Ok(_) => String::from_utf8(out.bytes)
                .map_err(|_| Error::new(ErrorKind::InvalidOperation, "the output is not UTF-8")),
            Err(_) if out.over => Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("the template's output is over {MAX_OUTPUT_BYTES} bytes"),
            )),
            Err(e) => Err(e),
        }
    }
}

/// minijinja-contrib's Python string methods, with the ones that can build a long string (`join`,
/// `replace`, `format`) checked against minijinja's `MAX_STRING_LEN` first.
fn bounded_methods(
    state: &minijinja::State,
    value: &JValue,
    method: &str,
    args: &[JValue],
) -> std::result::Result<JValue, Error> {
    use std::fmt::Write;
    if let Some(s) = value.as_str() {
        let limit = minijinja::value::ops_max_string_len();
        let too_long = || {
            Error::new(
                ErrorKind::InvalidOperation,
                format!("the template built a string over {limit} bytes (str.{method})"),
            )
        };
        // The text of a value, or an error once it passes the limit (a lazily concatenated list may
        // print far longer than it takes in memory).
        let len_of = |v: &JValue| -> std::result::Result<usize, Error> {
            let mut w = CountTo { n: 0, limit };
            match v.as_str() {
                Some(t) => Ok(t.len()),
                None => write!(w, "{v}").map(|_| w.n).map_err(|_| too_long()),
            }
        };
        let total = match method {
            "replace" => match (args.first().and_then(JValue::as_str), args.get(1)) {
                (Some(from), Some(to)) => {
                    let hits = s.matches(from).count();
                    Some(s.len().saturating_add(hits.saturating_mul(len_of(to)?)))
                }
                _ => None,
            },
            "join" => match args.first() {
                Some(items) => {
                    let mut n = 0usize;
                    for (i, item) in items.try_iter()?.enumerate() {
                        n = n.saturating_add(len_of(&item)?).saturating_add(if i > 0 {
                            s.len()
                        } else {
                            0
                        });
                        if n > limit {
                            return Err(too_long());
                        }
                    }
                    Some(n)
                }
                None => None,
            },
            "format" => {
                let mut n = s.len();
                for a in args {
                    n = n.saturating_add(len_of(a)?);
                }
                Some(n)
            }
            _ => None,
        };
        if total.is_some_and(|n| n > limit) {
            return Err(too_long());
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Counts what is written, failing past `limit`.
struct CountTo {
    n: usize,
    limit: usize,
}

impl std::fmt::Write for CountTo {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.n = self.n.saturating_add(s.len());
        if self.n > self.limit {
            Err(std::fmt::Error)
        } else {
            Ok(())
        }
    }
}

/// The most a render may write: a template printing without end is stopped here instead of growing the
/// server's memory until it aborts (a prompt this long could not fit any context anyway).
const MAX_OUTPUT_BYTES: usize = 64 << 20;

/// The render's output, failing the write that would pass [`MAX_OUTPUT_BYTES`].
#[derive(Default)]
struct BoundedOutput {
    bytes: Vec<u8>,
    over: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > MAX_OUTPUT_BYTES {
            self.over = true;
            return Err(std::io::Error::other("the template's output limit"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Messages as llama.cpp hands them to templates.
fn normalize_messages(messages: &[Value], object_arguments: bool) -> Result<Vec<Value>> {
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        let obj = m
            .as_object()
            .ok_or_else(|| TextError::new("a message is not an object"))?;
        let role = obj
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| TextError::new("a message without a role"))?;
        let role = if role == "developer" { "system" } else { role };
        let mut n = Map::new();
        n.insert("role".into(), Value::String(role.to_string()));
        let content = match obj.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
            Some(_) => return Err(TextError::new("message content is neither text nor parts")),
        };
        n.insert("content".into(), Value::String(content));
        for key in ["reasoning_content", "name", "tool_call_id"] {
            if let Some(Value::String(s)) = obj.get(key) {
                if !s.is_empty() {
                    n.insert(key.into(), Value::String(s.clone()));
                }
            }
        }
        if let Some(Value::Array(calls)) = obj.get("tool_calls") {
            let mut list = Vec::with_capacity(calls.len());
            for c in calls {
                let f = c.get("function").unwrap_or(c);
                let name = f
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| TextError::new("a tool call without a name"))?;
                let args = match f.get("arguments") {
                    None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(Value::String(s)) if object_arguments => {
                        serde_json::from_str(s).map_err(|e| {
                            TextError::new(format!("tool call arguments are not JSON: {e}"))
                        })?
                    }
                    Some(Value::String(s)) => Value::String(s.clone()),
                    Some(v) if object_arguments => v.clone(),
                    Some(v) => Value::String(v.to_string()),
                };
                let mut call = Map::new();
                call.insert("type".into(), Value::String("function".into()));
                let mut func = Map::new();
                func.insert("name".into(), Value::String(name.to_string()));
                func.insert("arguments".into(), args);
                call.insert("function".into(), Value::Object(func));
                if let Some(Value::String(id)) = c.get("id") {
                    if !id.is_empty() {
                        call.insert("id".into(), Value::String(id.clone()));
                    }
                }
                list.push(Value::Object(call));
            }
            if !list.is_empty() {
                n.insert("tool_calls".into(), Value::Array(list));
            }
        }
        out.push(Value::Object(n));
    }
    order_tool_results(&mut out);
    Ok(out)
}

/// Tool results go to the model in the order of the calls they answer (a client may send them in the
/// order they finished); results that name no call of the preceding assistant message keep their place
/// after the others.
fn order_tool_results(messages: &mut [Value]) {
    let mut i = 0;
    while i < messages.len() {
        let ids: Vec<String> = match messages[i].get("tool_calls").and_then(Value::as_array) {
            Some(calls) => calls
                .iter()
                .map(|c| {
                    c.get("id")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string()
                })
                .collect(),
            None => {
                i += 1;
                continue;
            }
        };
        let start = i + 1;
        let mut end = start;
        while end < messages.len()
            && messages[end].get("role").and_then(Value::as_str) == Some("tool")
        {
            end += 1;
        }
        messages[start..end].sort_by_key(|m| {
            let id = m.get("tool_call_id").and_then(Value::as_str).unwrap_or("");
            ids.iter()
                .position(|c| !c.is_empty() && c == id)
                .unwrap_or(usize::MAX)
        });
        i = end.max(start);
    }
}

/// A template that ignores system messages gets the system text at the start of the next message.
fn fold_system_message(messages: &mut Vec<Value>) {
    if messages
        .first()
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        != Some("system")
    {
        return;
    }
    let first = messages.remove(0);
    if let Some(next) = messages.first_mut() {
        let sys = first.get("content").and_then(Value::as_str).unwrap_or("");
        let cur = next.get("content").and_then(Value::as_str).unwrap_or("");
        next["content"] = Value::String(format!("{sys}\n{cur}"));
    }
}

fn raise_exception(msg: String) -> std::result::Result<JValue, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `tojson` as Python's `json.dumps` (and llama.cpp) writes it: `indent`, `separators`, `ensure_ascii`.
fn tojson(
    value: &JValue,
    indent: Option<JValue>,
    kwargs: Kwargs,
) -> std::result::Result<JValue, Error> {
    let indent = match kwargs.get::<Option<JValue>>("indent")?.or(indent) {
        Some(v) if v.kind() == ValueKind::Number => Some(i64::try_from(v)? as usize),
        _ => None,
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    if kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson(sort_keys=true) is not supported",
        ));
    }
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match &separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        _ => (
            if indent.is_some() {
                ",".into()
            } else {
                ", ".into()
            },
            ": ".into(),
        ),
    };
    let mut out = String::new();
    let w = JsonWriter {
        indent,
        item_sep: &item_sep,
        key_sep: &key_sep,
        ensure_ascii,
    };
    w.write(&mut out, value, 0)?;
    Ok(JValue::from_safe_string(out))
}

struct JsonWriter<'a> {
    indent: Option<usize>,
    item_sep: &'a str,
    key_sep: &'a str,
    ensure_ascii: bool,
}

impl JsonWriter<'_> {
    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    }

    fn write(&self, out: &mut String, v: &JValue, depth: usize) -> std::result::Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if let Ok(i) = i64::try_from(v.clone()) {
                    out.push_str(&i.to_string());
                } else {
                    let f = f64::try_from(v.clone())?;
                    if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                        out.push_str(&format!("{f:.1}"));
                    } else {
                        out.push_str(&f.to_string());
                    }
                }
            }
            ValueKind::String => self.string(out, v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<JValue> = v.try_iter()?.collect();
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(out, depth + 1);
                    self.write(out, item, depth + 1)?;
                }
                if !items.is_empty() {
                    self.newline(out, depth);
                }
                out.push(']');
            }
            ValueKind::Map => {
                let keys: Vec<JValue> = v.try_iter()?.collect();
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(out, depth + 1);
                    self.string(out, &k.to_string());
                    out.push_str(self.key_sep);
                    self.write(out, &v.get_item(k)?, depth + 1)?;
                }
                if !keys.is_empty() {
                    self.newline(out, depth);
                }
                out.push('}');
            }
            _ => self.string(out, &v.to_string()),
        }
        Ok(())
    }

    fn string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// `strftime` for the formats templates use (UTC): `%Y %y %m %d %e %B %b %A %a %H %I %M %S %p %j %%`.
pub fn strftime(t: SystemTime, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let secs = t
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    let days = secs / 86_400;
    let (y, m, d) = civil_from_days(days as i64);
    let sod = secs % 86_400;
    let (hh, mm, ss) = (sod / 3600, sod % 3600 / 60, sod % 60);
    let yday = days as i64 - days_from_civil(y, 1, 1) + 1;
    let weekday = DAYS[(days % 7) as usize];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('B') => out.push_str(month),
            Some('b') | Some('h') => out.push_str(&month[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('I') => out.push_str(&format!("{:02}", if hh % 12 == 0 { 12 } else { hh % 12 })),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month, day) of a day count since 1970-01-01 (Howard Hinnant's civil calendar algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Gemma 3's turn format (`<start_of_turn>user … <end_of_turn>`), for Gemma 3 GGUFs without a template
/// (the 270M base model). Gemma 3 has no tool format of its own: tools are listed in the first user turn,
/// calls are written as JSON in `<tool_call>` tags (the `json` reply family) and results come back in a
/// user turn, in the order of the calls.
pub const GEMMA3_TEMPLATE: &str = include_str!("templates/gemma3.jinja");

/// The template a family or run config names, for models whose GGUF has none.
pub fn family_template(name: &str) -> Option<&'static str> {
    match name {
        "gemma3" | "gemma" => Some(GEMMA3_TEMPLATE),
        _ => None,
    }
}

/// The template to use: the run config's (a name from [`family_template`] or Jinja source) over the
/// GGUF's; `None` means chat requests must be refused (completions still work).
pub fn resolve_template(gguf: Option<&str>, configured: Option<&str>) -> Option<String> {
    match configured {
        Some(c) => Some(
            family_template(c)
                .map(str::to_string)
                .unwrap_or_else(|| c.to_string()),
        ),
        None => gguf.map(str::to_string),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_results_follow_the_order_of_their_calls() {
        let msgs = vec![
            serde_json::json!({"role": "user", "content": "q"}),
            serde_json::json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "a", "function": {"name": "f", "arguments": "{}"}},
                {"id": "b", "function": {"name": "g", "arguments": "{}"}}]}),
            serde_json::json!({"role": "tool", "tool_call_id": "b", "content": "B"}),
            serde_json::json!({"role": "tool", "tool_call_id": "a", "content": "A"}),
            serde_json::json!({"role": "user", "content": "next"}),
        ];
        let out = normalize_messages(&msgs, true).expect("normalizes");
        let contents: Vec<&str> = out
            .iter()
            .map(|m| m["content"].as_str().unwrap_or("?"))
            .collect();
        assert_eq!(contents, ["q", "", "A", "B", "next"]);
        assert!(out[1]["tool_calls"][0]["function"]["arguments"].is_object());
    }

    #[test]
    fn strftime_formats_a_known_instant() {
        // 2026-01-02 03:04:05 UTC, a Friday
        let t = UNIX_EPOCH + Duration::from_secs(1_767_323_045);
        assert_eq!(strftime(t, "%Y-%m-%d %H:%M:%S"), "2026-01-02 03:04:05");
        assert_eq!(
            strftime(t, "%d %b %Y, %A %B %j %%"),
            "02 Jan 2026, Friday January 002 %"
        );
    }
}
