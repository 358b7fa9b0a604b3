//! A small blocking client of this server's HTTP API, for the terminal chat (`polystrata --model NAME`)
//! and scripts: health, the model list, load / unload, and a streamed chat whose deltas (content,
//! reasoning, tool calls) arrive through a callback as they come.
//!
//! std only (one request per connection, `Connection: close`), so it runs before any runtime exists and
//! needs no HTTP stack of its own beyond reading chunked bodies.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What a streamed chat delivers, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum ChatDelta {
    Content(String),
    Reasoning(String),
    /// A whole tool call: name and JSON arguments.
    ToolCall {
        name: String,
        arguments: String,
    },
    /// The end: the finish reason and the usage object.
    Finished {
        reason: String,
        usage: Value,
    },
}

/// A client of one server.
#[derive(Clone, Debug)]
pub struct Client {
    addr: String,
    api_key: Option<String>,
    timeout: Duration,
    /// The connection of the chat being streamed, so that another thread (the terminal chat's Ctrl-C)
    /// can stop it by shutting the socket (the server cancels a request whose client went away).
    streaming: Arc<Mutex<Option<TcpStream>>>,
}

/// An error: the server cannot be reached, or it answered with an error (`status`, its message).
#[derive(Clone, Debug, PartialEq)]
pub enum ClientError {
    Unreachable(String),
    Api { status: u16, message: String },
    Protocol(String),
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientError::Unreachable(m) => write!(f, "server unreachable: {m}"),
            ClientError::Api { status, message } => write!(f, "{status}: {message}"),
            ClientError::Protocol(m) => write!(f, "unexpected answer: {m}"),
        }
    }
}

impl std::error::Error for ClientError {}

type Result<T> = std::result::Result<T, ClientError>;

/// The message of an error body in any of the server's shapes.
fn error_message(body: &Value) -> Option<String> {
    body.get("error")
        .and_then(|e| e.get("message").or(Some(e)))
        .and_then(|m| m.as_str().map(str::to_string))
}

impl Client {
    /// A client of the server at `addr` (`host:port`).
    pub fn new(addr: impl Into<String>, api_key: Option<String>) -> Client {
        Client {
            addr: addr.into(),
            api_key,
            timeout: Duration::from_secs(600),
            streaming: Arc::default(),
        }
    }

    /// Stops the chat being streamed, if any: its connection is shut, so `chat_stream` returns an
    /// error and the server cancels the generation. Returns whether one was streaming.
    /// `before_shut` runs first when one was, so that what it marks is seen by the chat as soon as the
    /// stream's read fails.
    pub fn stop_stream(&self, before_shut: impl FnOnce()) -> bool {
        let taken = self
            .streaming
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match taken {
            Some(stream) => {
                before_shut();
                let _ = stream.shutdown(std::net::Shutdown::Both);
                true
            }
            None => false,
        }
    }

    fn set_streaming(&self, stream: Option<TcpStream>) {
        *self.streaming.lock().unwrap_or_else(|p| p.into_inner()) = stream;
    }

    /// Whether a polystrata server answers at the address (what the terminal chat checks before
    /// starting its own).
    pub fn is_running(&self) -> bool {
        self.health()
            .is_ok_and(|h| h.get("status").and_then(Value::as_str) == Some("ok"))
    }

    pub fn health(&self) -> Result<Value> {
        self.call("GET", "/health", None)
    }

    /// `GET /api/models`: `{"models": [...], "current": id|null}`.
    pub fn models(&self) -> Result<Value> {
        self.call("GET", "/api/models", None)
    }

    pub fn current(&self) -> Result<Value> {
        self.call("GET", "/api/models/current", None)
    }

    /// Switches the server to `model` (the one switch path); the error says which model is loaded.
    pub fn load(&self, model: &str) -> Result<Value> {
        self.call("POST", "/api/models/load", Some(&json!({"model": model})))
    }

    pub fn unload(&self) -> Result<Value> {
        self.call("POST", "/api/models/unload", Some(&json!({})))
    }

    /// Streams a chat completion of `body` (an OpenAI chat request; `stream` is set here), calling
    /// `on_delta` for each piece as it arrives.
    pub fn chat_stream(&self, mut body: Value, mut on_delta: impl FnMut(ChatDelta)) -> Result<()> {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let (status, mut reader) = self.send("POST", "/v1/chat/completions", Some(&body))?;
        self.set_streaming(reader.inner.get_ref().try_clone().ok());
        // Cleared however the stream ends, so a later Ctrl-C does not shut a finished connection.
        let result = self.read_chat_stream(status, &mut reader, &mut on_delta);
        self.set_streaming(None);
        result
    }

    fn read_chat_stream(
        &self,
        status: u16,
        reader: &mut Reader,
        on_delta: &mut impl FnMut(ChatDelta),
    ) -> Result<()> {
        if status != 200 {
            let bytes = read_body(reader)?;
            return Err(api_error(status, &bytes));
        }
        let mut pending = String::new();
        let mut reason = String::new();
        loop {
            let Some(chunk) = read_chunk(reader)? else {
                return Err(ClientError::Protocol(
                    "the stream ended without [DONE]".into(),
                ));
            };
            pending.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = pending.find("\n\n") {
                let event: String = pending.drain(..end + 2).collect();
                for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                    if data == "[DONE]" {
                        return Ok(());
                    }
                    let v: Value = serde_json::from_str(data)
                        .map_err(|e| ClientError::Protocol(format!("{e}: {data}")))?;
                    if let Some(message) = error_message(&v) {
                        return Err(ClientError::Api {
                            status: 500,
                            message,
                        });
                    }
                    if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
                        on_delta(ChatDelta::Finished {
                            reason: reason.clone(),
                            usage: usage.clone(),
                        });
                    }
                    let Some(choice) = v["choices"].get(0) else {
                        continue;
                    };
                    if let Some(r) = choice["finish_reason"].as_str() {
                        reason = r.to_string();
                    }
                    let delta = &choice["delta"];
                    if let Some(t) = delta["reasoning_content"]
                        .as_str()
                        .filter(|t| !t.is_empty())
                    {
                        on_delta(ChatDelta::Reasoning(t.to_string()));
                    }
                    if let Some(t) = delta["content"].as_str().filter(|t| !t.is_empty()) {
                        on_delta(ChatDelta::Content(t.to_string()));
                    }
                    for call in delta["tool_calls"].as_array().into_iter().flatten() {
                        on_delta(ChatDelta::ToolCall {
                            name: call["function"]["name"]
                                .as_str()
                                .unwrap_or_default()
                                .to_string(),
                            arguments: call["function"]["arguments"]
                                .as_str()
                                .unwrap_or_default()
                                .to_string(),
                        });
                    }
                }
            }
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value> {
        let (status, mut reader) = self.send(method, path, body)?;
        let bytes = read_body(&mut reader)?;
        if !(200..300).contains(&status) {
            return Err(api_error(status, &bytes));
        }
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Protocol(e.to_string()))
    }

    fn send(&self, method: &str, path: &str, body: Option<&Value>) -> Result<(u16, Reader)> {
        let unreachable =
            |e: std::io::Error| ClientError::Unreachable(format!("{}: {e}", self.addr));
        let mut stream = TcpStream::connect(&self.addr).map_err(unreachable)?;
        stream
            .set_read_timeout(Some(self.timeout))
            .map_err(unreachable)?;
        let body = body.map(|b| b.to_string());
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n",
            self.addr
        );
        if let Some(key) = &self.api_key {
            head.push_str(&format!("Authorization: Bearer {key}\r\n"));
        }
        if let Some(b) = &body {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            ));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).map_err(unreachable)?;
        if let Some(b) = &body {
            stream.write_all(b.as_bytes()).map_err(unreachable)?;
        }
        let mut reader = BufReader::new(stream);
        let mut status_line = String::new();
        reader.read_line(&mut status_line).map_err(unreachable)?;
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| ClientError::Protocol(format!("status line {status_line:?}")))?;
        let mut chunked = false;
        let mut length = None;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).map_err(unreachable)?;
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
                if k == "transfer-encoding" && v.contains("chunked") {
                    chunked = true;
                }
                if k == "content-length" {
                    length = v.parse::<usize>().ok();
                }
            }
        }
        Ok((
            status,
            Reader {
                inner: reader,
                chunked,
                length,
            },
        ))
    }
}

/// A response body being read.
struct Reader {
    inner: BufReader<TcpStream>,
    chunked: bool,
    length: Option<usize>,
}

fn api_error(status: u16, bytes: &[u8]) -> ClientError {
    let message = serde_json::from_slice::<Value>(bytes)
        .ok()
        .and_then(|v| error_message(&v))
        .unwrap_or_else(|| String::from_utf8_lossy(bytes).into_owned());
    ClientError::Api { status, message }
}

fn io(e: std::io::Error) -> ClientError {
    ClientError::Protocol(e.to_string())
}

fn read_body(reader: &mut Reader) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    if reader.chunked {
        while let Some(chunk) = read_chunk(reader)? {
            body.extend_from_slice(&chunk);
        }
    } else if let Some(n) = reader.length {
        body.resize(n, 0);
        reader.inner.read_exact(&mut body).map_err(io)?;
    } else {
        reader.inner.read_to_end(&mut body).map_err(io)?;
    }
    Ok(body)
}

/// The next piece of the body: a chunk of a chunked body (`None` at its end), or whatever arrives of a
/// plain one.
fn read_chunk(reader: &mut Reader) -> Result<Option<Vec<u8>>> {
    if !reader.chunked {
        let mut buf = vec![0; 8192];
        let n = reader.inner.read(&mut buf).map_err(io)?;
        buf.truncate(n);
        return Ok((n > 0).then_some(buf));
    }
    let mut size_line = String::new();
    if reader.inner.read_line(&mut size_line).map_err(io)? == 0 {
        return Ok(None);
    }
    let size = usize::from_str_radix(size_line.trim(), 16)
        .map_err(|_| ClientError::Protocol(format!("chunk size {size_line:?}")))?;
    if size == 0 {
        let mut end = String::new();
        let _ = reader.inner.read_line(&mut end);
        return Ok(None);
    }
    let mut chunk = vec![0; size + 2];
    reader.inner.read_exact(&mut chunk).map_err(io)?;
    chunk.truncate(size);
    Ok(Some(chunk))
}
