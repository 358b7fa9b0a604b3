//! The server against what issue 17 found could take it down or drive it: other web pages (foreign
//! `Origin` and `Host`, non-JSON bodies), CORS for allowed origins, slow and idle connections, many
//! connections, the descriptor limit, and the smaller HTTP cases (HEAD, the bearer scheme's case, an empty
//! API key).
//!
//! Cost: no model is loaded except where a test says so; a few seconds of timeouts.

mod common;

use common::{raw_request, Home, Server};
use serde_json::json;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn home_with_model(tag: &str) -> Home {
    let home = Home::new(tag);
    home.add_model("qwen3", "qwen3moe-tiny-q4km.gguf", json!({}));
    home
}

/// A request with exactly these header lines (and `Connection: close`, `Content-Length` for a body).
fn raw(method: &str, path: &str, headers: &[&str], body: &str) -> Vec<u8> {
    let mut r = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    for h in headers {
        r.push_str(h);
        r.push_str("\r\n");
    }
    if !body.is_empty() || method == "POST" {
        r.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    r.push_str("\r\n");
    r.push_str(body);
    r.into_bytes()
}

/// `/api/models` lists the model `piped` (a FIFO) as unavailable because it is not a regular file.
fn assert_piped_unavailable(models: &serde_json::Value) {
    let piped = models["models"]
        .as_array()
        .expect("models")
        .iter()
        .find(|m| m["id"] == "piped")
        .cloned()
        .expect("piped listed");
    assert_eq!(piped["status"], "unavailable", "{piped}");
    assert!(
        piped["problem"]
            .as_str()
            .is_some_and(|p| p.contains("not a regular file")),
        "{piped}"
    );
}

fn current_model(server: &Server) -> serde_json::Value {
    server.get("/api/models/current").json()["model"].clone()
}

#[test]
fn other_web_pages_cannot_drive_the_server() {
    let home = home_with_model("origin");
    let server = Server::start(&home, &[]);
    let host = format!("Host: {}", server.addr);
    let load = r#"{"model":"qwen3"}"#;

    // The attack of the issue: a "simple" cross-origin POST (text/plain, no preflight).
    let r = raw_request(
        &server.addr,
        &raw(
            "POST",
            "/api/models/load",
            &[
                &host,
                "Origin: https://evil.example",
                "Content-Type: text/plain",
            ],
            load,
        ),
    );
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(r.text().contains("--cors-origin"), "{}", r.text());
    // Even with a JSON type (only possible after a preflight, which it would fail): still refused.
    for origin in ["https://evil.example", "null"] {
        let r = raw_request(
            &server.addr,
            &raw(
                "POST",
                "/v1/completions",
                &[
                    &host,
                    &format!("Origin: {origin}"),
                    "Content-Type: application/json",
                ],
                r#"{"prompt":"hi","max_tokens":1}"#,
            ),
        );
        assert_eq!(r.status, 403, "{origin}: {}", r.text());
        assert_eq!(r.json()["error"]["type"], "permission_error");
    }
    // No CORS header ever goes to a foreign origin, so its page cannot read answers.
    let r = raw_request(
        &server.addr,
        &raw(
            "GET",
            "/api/models",
            &[&host, "Origin: https://evil.example"],
            "",
        ),
    );
    assert!(r.header("access-control-allow-origin").is_none());
    // Its preflight fails.
    let r = raw_request(
        &server.addr,
        &raw(
            "OPTIONS",
            "/api/models/load",
            &[
                &host,
                "Origin: https://evil.example",
                "Access-Control-Request-Method: POST",
            ],
            "",
        ),
    );
    assert_eq!(r.status, 403);
    assert!(r.header("access-control-allow-origin").is_none());

    // Without an origin (curl, SDKs) a body must still be JSON.
    let r = raw_request(
        &server.addr,
        &raw(
            "POST",
            "/api/models/load",
            &[&host, "Content-Type: text/plain"],
            load,
        ),
    );
    assert_eq!(r.status, 415, "{}", r.text());
    let r = raw_request(
        &server.addr,
        &raw("POST", "/api/models/unload", &[&host], ""),
    );
    assert_eq!(r.status, 415, "{}", r.text());
    assert_eq!(current_model(&server), json!(null), "nothing was loaded");

    // DNS rebinding: a foreign name for 127.0.0.1 is refused, reads included.
    for bad in ["evil.example", "evil.example:80", "localhost:1"] {
        let r = raw_request(
            &server.addr,
            &raw("GET", "/api/models", &[&format!("Host: {bad}")], ""),
        );
        assert_eq!(r.status, 403, "{bad}: {}", r.text());
        assert!(!r.text().contains("qwen3moe-tiny"), "no paths leak");
    }
    let r = raw_request(&server.addr, &raw("GET", "/api/models", &[], ""));
    assert_eq!(r.status, 400, "HTTP/1.1 needs a Host");
    let port = server.addr.rsplit(':').next().expect("port");
    for good in ["localhost", "127.0.0.1", "[::1]"] {
        let r = raw_request(
            &server.addr,
            &raw("GET", "/health", &[&format!("Host: {good}:{port}")], ""),
        );
        assert_eq!(r.status, 200, "{good}");
    }

    // The server's own web page (same origin) works: it loads the model.
    let r = raw_request(
        &server.addr,
        &raw(
            "POST",
            "/api/models/load",
            &[
                &host,
                &format!("Origin: http://{}", server.addr),
                "Content-Type: application/json",
            ],
            load,
        ),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(current_model(&server), json!("qwen3"));
}

#[test]
fn allowed_origins_get_cors_and_allowed_hosts_are_served() {
    let home = Home::new("cors");
    let server = Server::start(
        &home,
        &[
            "--cors-origin",
            "http://app.example:3000",
            "--allowed-host",
            "box.lan",
        ],
    );
    let host = format!("Host: {}", server.addr);
    let origin = "Origin: http://app.example:3000";
    let r = raw_request(
        &server.addr,
        &raw(
            "OPTIONS",
            "/v1/chat/completions",
            &[
                &host,
                origin,
                "Access-Control-Request-Method: POST",
                "Access-Control-Request-Headers: authorization, content-type",
            ],
            "",
        ),
    );
    assert_eq!(r.status, 204, "{}", r.text());
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://app.example:3000")
    );
    assert!(r
        .header("access-control-allow-methods")
        .is_some_and(|m| m.contains("POST")));
    assert_eq!(
        r.header("access-control-allow-headers"),
        Some("authorization, content-type")
    );
    // The allowed origin's requests are served, answers carry the CORS header (errors too).
    let r = raw_request(
        &server.addr,
        &raw(
            "POST",
            "/api/models/load",
            &[&host, origin, "Content-Type: application/json"],
            r#"{"model":"none-such"}"#,
        ),
    );
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://app.example:3000")
    );
    assert_eq!(r.header("vary"), Some("Origin"));
    // OPTIONS without an origin says what the routes allow (it was 405).
    let r = raw_request(&server.addr, &raw("OPTIONS", "/health", &[&host], ""));
    assert_eq!(r.status, 204);
    assert!(r.header("allow").is_some_and(|a| a.contains("POST")));
    let port = server.addr.rsplit(':').next().expect("port");
    let r = raw_request(
        &server.addr,
        &raw("GET", "/health", &[&format!("Host: BOX.lan:{port}")], ""),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn head_bearer_case_and_an_empty_api_key() {
    let out = common::polystrata()
        .args(["serve", "--port", "0", "--api-key", ""])
        .output()
        .expect("run polystrata");
    assert_eq!(out.status.code(), Some(2), "an empty key is refused");
    assert!(String::from_utf8_lossy(&out.stderr).contains("must not be empty"));

    let home = Home::new("head");
    let server = Server::start(&home, &["--api-key", "sekrit"]);
    for auth in ["bearer sekrit", "BEARER sekrit", "Bearer  sekrit"] {
        let r = common::request(
            &server.addr,
            "GET",
            "/v1/models",
            None,
            &[("Authorization", auth)],
        );
        assert_eq!(r.status, 200, "{auth}");
    }
    let r = common::request(
        &server.addr,
        "GET",
        "/v1/models",
        None,
        &[("x-api-key", "")],
    );
    assert_eq!(r.status, 401);
    // HEAD answers as GET does, without a body (the API's routes and the web page).
    for path in ["/health", "/"] {
        let mut s = TcpStream::connect(&server.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(&raw("HEAD", path, &[&format!("Host: {}", server.addr)], ""))
            .expect("write");
        let mut answer = String::new();
        s.read_to_string(&mut answer).expect("read");
        assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer}");
        assert!(
            answer.ends_with("\r\n\r\n"),
            "no body after the head: {answer:?}"
        );
    }
}

#[test]
fn slow_and_idle_connections_are_closed_and_many_do_not_block_health() {
    let home = Home::new("idle");
    let server = Server::start(&home, &["--header-timeout", "1", "--body-timeout", "1"]);
    // 1,100 idle connections (nothing sent) leave /health answering within a second.
    let idle: Vec<TcpStream> = (0..1100)
        .map(|_| TcpStream::connect(&server.addr).expect("connect"))
        .collect();
    let t = Instant::now();
    let r = server.get("/health");
    assert_eq!(r.status, 200);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "/health took {:?} with 1,100 idle connections",
        t.elapsed()
    );
    // The idle ones are closed after the header timeout: a read sees the end.
    let mut first = &idle[0];
    first
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut buf = [0u8; 256];
    let t = Instant::now();
    let n = first.read(&mut buf).unwrap_or(0);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "an idle connection was held for {:?}",
        t.elapsed()
    );
    let _ = n; // hyper may answer 408 before closing, or close at once.
    drop(idle);

    // A body shorter than its Content-Length: 408 after the body timeout, not a wait forever.
    let mut s = TcpStream::connect(&server.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\"",
        server.addr
    );
    s.write_all(head.as_bytes()).expect("write");
    let t = Instant::now();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // And a body over --max-body-mib is refused with 413.
    let r = raw_request(
        &server.addr,
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            server.addr,
            (8 << 20) + 1
        )
        .as_bytes(),
    );
    assert_eq!(r.status, 413, "{}", r.text());
}

/// /proc/<pid>/stat's utime + stime, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let after = stat.rsplit(')').next().expect("fields");
    let f: Vec<&str> = after.split_whitespace().collect();
    f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime")
}

#[test]
fn at_the_descriptor_limit_accept_backs_off_and_serving_resumes() {
    let home = Home::new("fdlimit");
    let log = home.dir.join("server.log");
    // A server with 64 descriptors and a connection cap above them: accept runs out of descriptors.
    let mut child = std::process::Command::new("sh")
        .env("XDG_CONFIG_HOME", common::config_dir())
        .arg("-c")
        .arg(format!(
            "ulimit -n 64 && exec {} serve --home {} --port 0 --max-connections 1000 2>{}",
            common::polystrata_bin().display(),
            home.dir.display(),
            log.display()
        ))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start");
    let mut line = String::new();
    let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    std::io::BufRead::read_line(&mut out, &mut line).expect("listening line");
    let addr = line
        .trim()
        .rsplit("http://")
        .next()
        .expect("addr")
        .to_string();
    let pid = child.id();
    let conns: Vec<TcpStream> = (0..100)
        .filter_map(|_| TcpStream::connect(&addr).ok())
        .collect();
    let before = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(3));
    let used = cpu_ticks(pid) - before;
    let log_len = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
    drop(conns);
    // Once the connections close, the server serves again.
    let r = common::request(&addr, "GET", "/health", None, &[]);
    let _ = std::process::Command::new("kill")
        .arg(pid.to_string())
        .status();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        text.contains("accept failed"),
        "the limit was reached: {text}"
    );
    // 3 s at 100 ticks/s: a spinning loop would use ~300.
    assert!(used < 50, "the accept loop used {used} ticks in 3 s");
    assert!(log_len < 4096, "{log_len} bytes of log in 3 s: {text}");
    assert_eq!(r.status, 200);
}

#[test]
fn a_large_prompt_is_refused_by_its_context_without_stalling_the_server() {
    let home = Home::new("large");
    let gguf = common::fixture("qwen3moe-tiny-q4km.gguf");
    home.add_model(
        "wide",
        "qwen3moe-tiny-q4km.gguf",
        // Kept over the fixture's training context: the bounds are measured against a wide one.
        json!({"args": ["--model", gguf, "--max-context", "65536", "--threads", "1"],
               "clamp_context": false}),
    );
    let server = Server::start(&home, &["--load", "wide"]);
    // 7 MB of text cannot be 65,536 tokens of this vocabulary: refused before it is tokenized.
    let words: String = (0..2_000_000).map(|i| format!("w{} ", i % 997)).collect();
    let huge = &words[..7_000_000];
    let body = json!({"prompt": huge, "max_tokens": 1}).to_string();
    let addr = server.addr.clone();
    let senders: Vec<_> = (0..3)
        .map(|_| {
            let (addr, body) = (addr.clone(), body.clone());
            std::thread::spawn(move || {
                common::request(&addr, "POST", "/v1/completions", Some(body.as_bytes()), &[])
            })
        })
        .collect();
    // Meanwhile the server answers at once, and a small generation is not held up.
    let t = Instant::now();
    assert_eq!(server.get("/health").status, 200);
    let health = t.elapsed();
    let small = server.post(
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 2}),
    );
    assert_eq!(small.status, 200, "{}", small.text());
    assert!(health < Duration::from_secs(1), "/health took {health:?}");
    for s in senders {
        let r = s.join().expect("sender");
        assert_eq!(r.status, 400, "{}", r.text());
        let m = r.json()["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string();
        assert!(
            m.contains("bytes) is longer than the model's context of 65536 tokens"),
            "{m}"
        );
    }
    // 300 kB fits by bytes but not by tokens: counted piece by piece and refused once surely over.
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": &words[..300_000]}], "max_tokens": 1}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let m = r.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(
        m.contains("tokens) is longer than the model's context"),
        "{m}"
    );
    // Anthropic's count uses the same bound.
    let r = server.post(
        "/v1/messages/count_tokens",
        &json!({"messages": [{"role": "user", "content": huge}]}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    // A prompt that fits is served as before.
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": &words[..2000]}], "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn a_model_file_with_an_absurd_block_count_is_unavailable_with_the_reason() {
    let home = home_with_model("blocks");
    // The fixture with its block_count (a u32 after the key and its type) set to 2^32-1.
    let mut bytes = std::fs::read(common::fixture("qwen3moe-tiny-q4km.gguf")).expect("fixture");
    let key = b"qwen3moe.block_count";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("block_count key")
        + key.len()
        + 4;
    bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    let broken = home.dir.join("broken.gguf");
    std::fs::write(&broken, &bytes).expect("write");
    home.write_config(
        "broken",
        &json!({"exe": common::engine_bin(), "args": ["--model", broken, "--max-context", "512"],
                "tokenizer": "packs/qwen3/tokenizer"}),
    );
    let server = Server::start(&home, &[]);
    let models = server.get("/api/models").json();
    let entry = models["models"]
        .as_array()
        .expect("models")
        .iter()
        .find(|m| m["id"] == "broken")
        .cloned()
        .expect("broken listed");
    assert_eq!(entry["status"], "unavailable", "{entry}");
    assert!(
        entry["problem"]
            .as_str()
            .is_some_and(|p| p.contains("block_count")),
        "{entry}"
    );
    // The engine itself refuses it with an error, not an abort.
    let out = std::process::Command::new(common::engine_bin())
        .arg("--model")
        .arg(&broken)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run the engine");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.code().is_some(), "ended by a signal: {all}");
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("ERR "),
        "an ERR line: {all}"
    );
    assert!(all.contains("block_count"), "{all}");
}

#[test]
fn a_model_path_that_is_a_fifo_is_unavailable_and_freezes_nothing() {
    let home = home_with_model("fifo");
    let fifo = home.dir.join("model.gguf");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    home.write_config(
        "piped",
        &json!({"exe": common::engine_bin(), "args": ["--model", fifo],
                "tokenizer": "packs/qwen3/tokenizer"}),
    );
    let server = Server::start(&home, &[]);
    // Opening the FIFO for reading would block until a writer comes: the listing must not wait.
    let (tx, rx) = std::sync::mpsc::channel();
    let addr = server.addr.clone();
    std::thread::spawn(move || {
        let _ = tx.send(common::request(&addr, "GET", "/api/models", None, &[]));
    });
    let r = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("/api/models answered while a model path is a FIFO");
    assert_piped_unavailable(&r.json());
}

#[test]
fn a_run_config_or_models_json_that_is_a_fifo_freezes_no_request() {
    let home = home_with_model("fifo-config");
    for name in ["strata-piped.json", "models.json"] {
        let made = std::process::Command::new("mkfifo")
            .arg(home.dir.join(name))
            .status()
            .expect("mkfifo");
        assert!(made.success());
    }
    let server = Server::start(&home, &[]);
    // Every route that scans the home, and a generation, at once: none may wait on the FIFOs (opening
    // one for reading blocks until a writer comes), nor on each other.
    let (tx, rx) = std::sync::mpsc::channel();
    let requests: Vec<(&str, &str, Option<serde_json::Value>)> = vec![
        ("GET", "/api/models", None),
        ("GET", "/v1/models", None),
        ("GET", "/api/models/current", None),
        ("GET", "/health", None),
        (
            "POST",
            "/v1/completions",
            Some(json!({"model": "qwen3", "prompt": [1, 2, 3], "max_tokens": 2})),
        ),
    ];
    for (method, path, body) in requests {
        let (tx, addr) = (tx.clone(), server.addr.clone());
        std::thread::spawn(move || {
            let body = body.map(|b| b.to_string());
            let r = common::request(&addr, method, path, body.as_deref().map(str::as_bytes), &[]);
            let _ = tx.send((path, r));
        });
    }
    let started = Instant::now();
    for _ in 0..5 {
        let (path, r) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("every request answered while the home holds FIFOs");
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        if path == "/api/models" {
            assert_piped_unavailable(&r.json());
        }
    }
    eprintln!("five requests answered in {:?}", started.elapsed());
}

#[test]
fn a_body_with_both_content_length_and_chunked_is_read_as_chunked_and_nothing_is_smuggled() {
    // RFC 9112 §6.3: with both, Transfer-Encoding decides the body and the server closes the connection
    // after answering, so bytes after the chunked body are never read as a second request (the
    // request-smuggling case issue 17 named).
    let home = Home::new("cl-te");
    let server = Server::start(&home, &[]);
    let mut s = TcpStream::connect(&server.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let smuggled = format!("GET /health HTTP/1.1\r\nHost: {}\r\n\r\n", server.addr);
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n{smuggled}",
        server.addr
    );
    s.write_all(request.as_bytes()).expect("write");
    let mut answer = String::new();
    let clock = Instant::now();
    s.read_to_string(&mut answer)
        .expect("the server closes the connection");
    assert!(clock.elapsed() < Duration::from_secs(10));
    assert_eq!(
        answer.matches("HTTP/1.1 ").count(),
        1,
        "one answer, the bytes after the chunked body not served: {answer}"
    );
    assert!(
        !answer.contains("\"ok\""),
        "the smuggled /health was answered: {answer}"
    );
}
