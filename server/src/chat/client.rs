//! A small blocking HTTP/1.1 client over `std::net` for the terminal chat: JSON requests to the
//! management API and `text/event-stream` answers read event by event as they arrive.

use serde_json::Value;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// The server the chat talks to.
#[derive(Clone)]
pub struct Client {
    addr: SocketAddr,
}

/// A whole JSON reply.
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

impl Reply {
    /// The error message of a failed request in any of the server's error shapes.
    pub fn error_message(&self) -> String {
        let e = &self.body["error"];
        e["message"]
            .as_str()
            .or_else(|| e.as_str())
            .or_else(|| self.body["message"].as_str())
            .map(str::to_string)
            .unwrap_or_else(|| format!("HTTP {}: {}", self.status, self.body))
    }
}

impl Client {
    pub fn new(port: u16) -> Client {
        Client {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        }
    }

    /// Whether a polystrata server answers `GET /health` on the port.
    pub fn health(&self) -> bool {
        let Ok(stream) = TcpStream::connect_timeout(&self.addr, Duration::from_secs(2)) else {
            return false;
        };
        // A port held by something that never answers must not hang the chat.
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        match self.exchange(stream, "GET", "/health", None) {
            Ok(r) => r.status == 200 && r.body["status"] == "ok",
            Err(_) => false,
        }
    }

    pub fn get(&self, path: &str) -> Result<Reply, String> {
        self.exchange(self.connect()?, "GET", path, None)
    }

    pub fn post(&self, path: &str, body: &Value) -> Result<Reply, String> {
        self.exchange(self.connect()?, "POST", path, Some(body))
    }

    /// Posts `body` and returns the event stream, or the error the server answered with.
    pub fn stream(&self, path: &str, body: &Value) -> Result<EventStream, String> {
        let mut stream = self.connect()?;
        write_request(&mut stream, &self.addr, "POST", path, Some(body))?;
        let (status, body) = read_response(stream)?;
        if status != 200 {
            return Err(to_reply(status, body).error_message());
        }
        Ok(EventStream {
            lines: BufReader::new(body),
        })
    }

    fn connect(&self) -> Result<TcpStream, String> {
        TcpStream::connect_timeout(&self.addr, Duration::from_secs(5))
            .map_err(|e| format!("cannot reach the server at {}: {e}", self.addr))
    }

    fn exchange(
        &self,
        mut stream: TcpStream,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Reply, String> {
        write_request(&mut stream, &self.addr, method, path, body)?;
        let (status, body) = read_response(stream)?;
        Ok(to_reply(status, body))
    }
}

fn to_reply(status: u16, mut body: BodyReader) -> Reply {
    let mut bytes = Vec::new();
    let _ = body.read_to_end(&mut bytes);
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    Reply { status, body }
}

fn write_request(
    stream: &mut TcpStream,
    addr: &SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<(), String> {
    let payload = body.map(|b| b.to_string()).unwrap_or_default();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(key) = std::env::var("POLYSTRATA_API_KEY").ok().filter(|k| !k.is_empty()) {
        head.push_str(&format!("Authorization: Bearer {key}\r\n"));
    }
    if body.is_some() {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            payload.len()
        ));
    }
    head.push_str("\r\n");
    head.push_str(&payload);
    stream
        .write_all(head.as_bytes())
        .map_err(|e| format!("cannot send the request: {e}"))
}

/// Reads the status line and headers; the body follows through the returned reader.
fn read_response(stream: TcpStream) -> Result<(u16, BodyReader), String> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    let broken = |e: io::Error| format!("the server closed the connection: {e}");
    reader.read_line(&mut line).map_err(broken)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| format!("not an HTTP response: {:?}", line.trim_end()))?;
    let mut framing = Framing::UntilClose;
    loop {
        line.clear();
        reader.read_line(&mut line).map_err(broken)?;
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        let Some((name, value)) = header.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") && value.contains("chunked") {
            framing = Framing::Chunked { left: 0 };
        } else if name.eq_ignore_ascii_case("content-length") {
            if let Ok(n) = value.parse() {
                framing = Framing::Length(n);
            }
        }
    }
    Ok((
        status,
        BodyReader {
            inner: reader,
            framing,
        },
    ))
}

/// How the body's end is known.
enum Framing {
    Length(usize),
    /// Bytes left in the current chunk (0: a size line comes next).
    Chunked {
        left: usize,
    },
    UntilClose,
    Done,
}

/// A response body as a plain reader, whatever its framing.
pub struct BodyReader {
    inner: BufReader<TcpStream>,
    framing: Framing,
}

impl Read for BodyReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let BodyReader { inner, framing } = self;
        match framing {
            Framing::Done => Ok(0),
            Framing::UntilClose => inner.read(buf),
            Framing::Length(left) => {
                let want = buf.len().min(*left);
                if want == 0 {
                    return Ok(0);
                }
                let n = inner.read(&mut buf[..want])?;
                *left -= n;
                Ok(n)
            }
            Framing::Chunked { left } => {
                if *left == 0 {
                    let mut size_line = String::new();
                    inner.read_line(&mut size_line)?;
                    let size = size_line.trim().split(';').next().unwrap_or_default();
                    let size = usize::from_str_radix(size, 16).map_err(|_| {
                        io::Error::new(io::ErrorKind::InvalidData, "bad chunk size")
                    })?;
                    if size == 0 {
                        *framing = Framing::Done;
                        return Ok(0);
                    }
                    *left = size;
                }
                let want = buf.len().min(*left);
                let n = inner.read(&mut buf[..want])?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                *left -= n;
                if *left == 0 {
                    let mut crlf = [0u8; 2];
                    inner.read_exact(&mut crlf)?;
                }
                Ok(n)
            }
        }
    }
}

/// Server-sent events, one `data:` payload at a time.
pub struct EventStream {
    lines: BufReader<BodyReader>,
}

impl EventStream {
    /// The next event's data, `None` at `[DONE]` or the end of the stream.
    pub fn next_data(&mut self) -> Result<Option<String>, String> {
        let mut data: Vec<String> = Vec::new();
        let mut line = String::new();
        loop {
            line.clear();
            let n = self
                .lines
                .read_line(&mut line)
                .map_err(|e| format!("the answer stream broke: {e}"))?;
            let text = line.trim_end_matches(['\r', '\n']);
            if n == 0 || text.is_empty() {
                if !data.is_empty() {
                    let joined = data.join("\n");
                    return Ok((joined != "[DONE]").then_some(joined));
                }
                if n == 0 {
                    return Ok(None);
                }
                continue;
            }
            if let Some(d) = text.strip_prefix("data:") {
                data.push(d.strip_prefix(' ').unwrap_or(d).to_string());
            }
        }
    }
}
