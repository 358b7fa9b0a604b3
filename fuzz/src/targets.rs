//! The bodies of the protocol, HTTP and chat-template fuzz targets, shared by the libFuzzer targets
//! (`fuzz_targets/*.rs`, nightly) and the stable bounded runs CI makes (`tests/src/bin/fuzz_smoke.rs`
//! includes this file). Each takes arbitrary bytes; a panic (or a failed assertion) is the finding.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// A protocol line, both ways: parsing never panics, and whatever parses formats to a line that parses
/// again to the same message; the bounded line reader keeps its bound whatever the bytes.
pub fn protocol_line(data: &[u8]) {
    use poly_protocol::{read_line_bounded, FromEngine, LineRead, ToEngine};
    let text = String::from_utf8_lossy(data);
    if let Ok(m) = ToEngine::parse(&text) {
        let line = m.to_line();
        assert!(!line.contains('\n'), "one line: {line:?}");
        let again = ToEngine::parse(&line).unwrap_or_else(|e| panic!("{line:?}: {}", e.message));
        assert_eq!(again.to_line(), line, "a stable round trip");
    }
    if let Ok(m) = FromEngine::parse(&text) {
        let line = m.to_line();
        assert!(!line.contains('\n'), "one line: {line:?}");
        let again = FromEngine::parse(&line).unwrap_or_else(|e| panic!("{line:?}: {}", e.message));
        assert_eq!(again.to_line(), line, "a stable round trip");
    }
    let mut reader = std::io::BufReader::with_capacity(16, data);
    let mut buf = Vec::new();
    loop {
        match read_line_bounded(&mut reader, &mut buf, 64) {
            Ok(LineRead::Line) => assert!(buf.len() <= 64, "the bound holds"),
            Ok(LineRead::TooLong) => {}
            Ok(LineRead::Eof) | Err(_) => break,
        }
    }
}

/// A server of this process (no model installed) on a free port, started once.
fn http_server() -> &'static String {
    static ADDR: OnceLock<String> = OnceLock::new();
    ADDR.get_or_init(|| {
        let home = std::env::temp_dir().join(format!("poly-fuzz-http-{}", std::process::id()));
        std::fs::create_dir_all(&home).expect("temp home");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let registry = Arc::new(polystrata::registry::Registry::new(home));
        let supervisor = Arc::new(polystrata::engine::supervisor::Supervisor::new(
            registry,
            Default::default(),
        ));
        let state = Arc::new(polystrata::http::AppState {
            supervisor,
            access: polystrata::http::access::Access {
                port: addr.port(),
                allowed_hosts: Vec::new(),
                cors_origins: vec!["http://allowed.example".into()],
                api_key: None,
            },
            limits: polystrata::http::ConnLimits {
                max_connections: 64,
                header_timeout: Duration::from_secs(2),
                body_timeout: Duration::from_secs(2),
                max_body_bytes: 1 << 20,
            },
            text_work: polystrata::http::prepare::TextWork::new(1),
        });
        std::thread::spawn(move || {
            runtime.block_on(polystrata::http::serve(
                listener,
                state,
                std::future::pending::<()>(),
            ))
        });
        addr.to_string()
    })
}

/// Reads what the server answers to `raw`, written whole, then (`half_close`) the write side closed so
/// that an incomplete request ends at once instead of at the header timeout. The server, like hyper by
/// default, closes a connection whose client half-closes: an answer may then be cut or missing.
fn exchange(addr: &str, raw: &[u8], half_close: bool) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    // The server may answer and close before reading everything (a refused head): a failed write is
    // not a finding.
    let _ = stream.write_all(raw);
    if half_close {
        let _ = stream.shutdown(std::net::Shutdown::Write);
    }
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out);
    out
}

/// Arbitrary bytes as an HTTP/1.1 request stream to the server: what comes back is an HTTP/1.1
/// response (or nothing), no handler panics (the runner's panic hook sees the server's threads too), and
/// the server still answers `/health` after.
pub fn http_request(data: &[u8]) {
    let addr = http_server();
    let out = exchange(addr, data, true);
    assert!(
        out.is_empty() || out.starts_with(b"HTTP/1.1 ") || out.starts_with(b"HTTP/1.0 "),
        "not an HTTP response: {:?}",
        String::from_utf8_lossy(&out[..out.len().min(200)])
    );
    let health = exchange(
        addr,
        format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        false,
    );
    assert!(
        health.starts_with(b"HTTP/1.1 200"),
        "/health after the case: {:?}",
        String::from_utf8_lossy(&health[..health.len().min(200)])
    );
}

/// Arbitrary bytes as a chat template (up to the first NUL) and the messages it renders (after it, as
/// JSON; a default conversation when that is not a list): compiling, probing and rendering return,
/// with an output within the bound, whatever the template does.
pub fn chat_template(data: &[u8]) {
    use polystrata::text::template::{ChatInput, ChatTemplate};
    let (source, rest) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &[][..]),
    };
    let source = String::from_utf8_lossy(source);
    let messages = serde_json::from_slice::<serde_json::Value>(rest)
        .ok()
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_else(|| {
            vec![
                serde_json::json!({"role": "system", "content": "Be brief."}),
                serde_json::json!({"role": "user", "content": "hi"}),
                serde_json::json!({"role": "assistant", "content": "hello", "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]}),
                serde_json::json!({"role": "tool", "content": "1"}),
            ]
        });
    let Ok(template) = ChatTemplate::new(&source, "<s>", "</s>") else {
        return;
    };
    let input = ChatInput {
        messages,
        add_generation_prompt: true,
        ..Default::default()
    };
    if let Ok(out) = template.render(&input, true) {
        assert!(out.len() <= 64 << 20, "the output bound holds");
    }
}

/// Arbitrary bytes as a picture (`picture::decode`: JPEG by the crate's stb-exact decoder, PNG and WebP
/// by `image`): an error or a picture within the size bound whose buffer holds its pixels, never a
/// panic.
pub fn picture(data: &[u8]) {
    use poly_models::vision::picture::{decode, MAX_SIDE};
    if let Ok(p) = decode(data) {
        assert!(p.width > 0 && p.height > 0, "an empty picture decoded");
        assert!(
            p.width <= MAX_SIDE as usize && p.height <= MAX_SIDE as usize,
            "past the bound"
        );
        assert_eq!(
            p.pixels.len(),
            p.width * p.height * 3,
            "the buffer holds the pixels"
        );
    }
}
