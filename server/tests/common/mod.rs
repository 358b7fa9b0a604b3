//! Shared by the server's integration tests: an installation home over the CPU fixtures, a `polystrata
//! serve` child on a free port with real `poly-engine` children, and a small HTTP/1.1 client (std only) that
//! can read a stream piece by piece and drop a connection midway.
//! Environment: `POLY_ENGINE` names the engine binary (else the one beside `polystrata`).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("server/ has a parent")
        .to_path_buf()
}

pub fn fixture(name: &str) -> PathBuf {
    workspace_root().join("tests/fixtures/models").join(name)
}

pub fn polystrata_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_polystrata"))
}

/// Where the tests' `polystrata` processes remember their homes (`XDG_CONFIG_HOME`): one directory for
/// all of them (the file is replaced by a rename, never half written), so that `serve --home <temp>`
/// never changes the user's remembered home. Tests that read a remembered home give their own.
pub fn config_dir() -> PathBuf {
    std::env::temp_dir().join("polystrata-test-config")
}

/// `polystrata`, its remembered home kept in [`config_dir`].
pub fn polystrata() -> Command {
    let mut cmd = Command::new(polystrata_bin());
    cmd.env("XDG_CONFIG_HOME", config_dir());
    cmd
}

/// The engine binary: `POLY_ENGINE`, else `poly-engine` next to `polystrata` (the workspace build puts
/// both in the same target directory).
pub fn engine_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("POLY_ENGINE") {
        return PathBuf::from(p);
    }
    let bin = polystrata_bin()
        .parent()
        .expect("binary dir")
        .join("poly-engine");
    assert!(
        bin.is_file(),
        "{} is missing: build it with `cargo build --release -p poly-engine` (cargo test --workspace does) or set POLY_ENGINE",
        bin.display()
    );
    bin
}

/// A temporary installation home, removed on drop.
pub struct Home {
    pub dir: PathBuf,
}

impl Drop for Home {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Home {
    pub fn new(tag: &str) -> Home {
        let dir = std::env::temp_dir().join(format!(
            "polystrata-test-{tag}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        std::fs::create_dir_all(&dir).expect("temp home");
        Home { dir }
    }

    /// Writes `packs/<name>/tokenizer` from the GGUF with `polystrata tokenizer`.
    pub fn tokenizer_for(&self, name: &str, gguf: &Path) -> PathBuf {
        let out = self.dir.join("packs").join(name).join("tokenizer");
        let status = polystrata()
            .args(["tokenizer", "--gguf"])
            .arg(gguf)
            .arg("--out")
            .arg(&out)
            .status()
            .expect("run polystrata tokenizer");
        assert!(
            status.success(),
            "polystrata tokenizer failed for {}",
            gguf.display()
        );
        out
    }

    /// A run config for a fixture model served by the real engine.
    pub fn add_model(&self, name: &str, gguf_name: &str, extra: serde_json::Value) {
        let gguf = fixture(gguf_name);
        self.tokenizer_for(name, &gguf);
        let mut config = serde_json::json!({
            "exe": engine_bin(),
            "args": ["--model", gguf, "--max-context", "4096", "--threads", "1"],
            "cwd": ".",
            "tokenizer": format!("packs/{name}/tokenizer"),
            "model_name": name,
        });
        if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                c.insert(k.clone(), v.clone());
            }
        }
        self.write_config(name, &config);
    }

    /// The tiny vision projector `poly-engine synth` writes (`qwen3vl-mmproj`, F32), in the home.
    pub fn synth_projector(&self) -> PathBuf {
        self.synth_projector_of("qwen3vl-mmproj")
    }

    /// The tiny projector `poly-engine synth --arch arch` writes (F32, seed 1), in the home.
    pub fn synth_projector_of(&self, arch: &str) -> PathBuf {
        let out = self.dir.join(format!("{arch}-tiny.gguf"));
        let o = Command::new(engine_bin())
            .args(["synth", "--arch", arch, "--shape", "tiny"])
            .args(["--type", "F32", "--seed", "1", "--out"])
            .arg(&out)
            .output()
            .expect("synth");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        out
    }

    /// A model that reads pictures: the tiny qwen35moe fixture with [`Home::synth_projector`]'s projector
    /// named by its run config's `mmproj`, on the CPU (where pictures are read).
    pub fn add_vision_model(&self, name: &str) {
        self.add_vision_model_of(name, "qwen35moe-tiny-q4km.gguf", "qwen3vl-mmproj");
    }

    /// A Gemma 4 model that reads pictures: the tiny gemma4 fixture with the tiny `gemma4v` projector,
    /// on the CPU.
    pub fn add_gemma4_vision_model(&self, name: &str) {
        self.add_vision_model_of(name, "gemma4-tiny-q4km.gguf", "gemma4v-mmproj");
    }

    /// The fixture `gguf_name` with the tiny projector `synth --arch projector_arch` writes, on the CPU.
    fn add_vision_model_of(&self, name: &str, gguf_name: &str, projector_arch: &str) {
        let mmproj = self.synth_projector_of(projector_arch);
        let gguf = fixture(gguf_name);
        self.add_model(
            name,
            gguf_name,
            serde_json::json!({"mmproj": mmproj,
                   "args": ["--model", gguf, "--max-context", "4096", "--threads", "1", "--cpu"]}),
        );
    }

    pub fn write_config(&self, name: &str, config: &serde_json::Value) {
        std::fs::write(
            self.dir.join(format!("strata-{name}.json")),
            serde_json::to_string_pretty(config).expect("json"),
        )
        .expect("write run config");
    }

    /// A script standing in for an engine: it runs `body` (a shell snippet).
    pub fn script(&self, name: &str, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write script");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }
}

/// A running `polystrata serve`; killed (and its engine with it, by the server's shutdown) on drop.
pub struct Server {
    child: Child,
    pub addr: String,
    /// Kept open: a server writing to a closed stdout would fail.
    _stdout: BufReader<std::process::ChildStdout>,
}

impl Server {
    pub fn start(home: &Home, extra_args: &[&str]) -> Server {
        Server::start_with(home, extra_args, Stdio::inherit(), &[])
    }

    /// A server whose log (stderr) goes to `home/server.log`, with extra environment variables.
    pub fn start_logged(home: &Home, extra_args: &[&str], env: &[(&str, &str)]) -> Server {
        let log = std::fs::File::create(home.dir.join("server.log")).expect("server.log");
        Server::start_with(home, extra_args, Stdio::from(log), env)
    }

    fn start_with(home: &Home, extra_args: &[&str], stderr: Stdio, env: &[(&str, &str)]) -> Server {
        let mut child = polystrata()
            .arg("serve")
            .arg("--home")
            .arg(&home.dir)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(extra_args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("start polystrata serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        let mut stdout = BufReader::new(stdout);
        stdout
            .read_line(&mut line)
            .expect("read the listening line");
        let addr = line
            .trim()
            .rsplit("http://")
            .next()
            .expect("address")
            .to_string();
        assert!(addr.contains(':'), "unexpected first line: {line:?}");
        Server {
            child,
            addr,
            _stdout: stdout,
        }
    }

    /// The server process's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn get(&self, path: &str) -> Response {
        request(&self.addr, "GET", path, None, &[])
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> Response {
        request(
            &self.addr,
            "POST",
            path,
            Some(body.to_string().as_bytes()),
            &[],
        )
    }

    pub fn post_raw(&self, path: &str, body: &[u8], headers: &[(&str, &str)]) -> Response {
        request(&self.addr, "POST", path, Some(body), headers)
    }

    /// The pid of the engine in use (from `/api/models/current`).
    pub fn engine_pid(&self) -> Option<i32> {
        let r = self.get("/api/models/current");
        r.json()["pid"].as_i64().map(|p| p as i32)
    }

    /// Stops the server with SIGTERM and waits for it (its engine is stopped by its shutdown).
    pub fn stop(mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        self.child.wait().expect("wait server")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(self.child.id().to_string())
                .status();
            let _ = self.child.wait();
        }
    }
}

/// A whole HTTP response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "not JSON ({e}): status {} body {:?}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

fn write_request(
    stream: &mut TcpStream,
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
) {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).expect("write head");
    if let Some(b) = body {
        stream.write_all(b).expect("write body");
    }
}

/// Reads the status line and headers.
fn read_head(reader: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut status_line = String::new();
    reader.read_line(&mut status_line).expect("status line");
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("header line");
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    (status, headers)
}

/// Reads a chunked body until its end.
fn read_chunked(reader: &mut BufReader<TcpStream>) -> Vec<u8> {
    let mut body = Vec::new();
    while let Some(chunk) = read_chunk(reader) {
        body.extend_from_slice(&chunk);
    }
    body
}

/// One chunk of a chunked body; `None` at its end (or a closed connection).
fn read_chunk(reader: &mut BufReader<TcpStream>) -> Option<Vec<u8>> {
    let mut size_line = String::new();
    if reader.read_line(&mut size_line).ok()? == 0 {
        return None;
    }
    let size = usize::from_str_radix(size_line.trim(), 16).ok()?;
    if size == 0 {
        let mut end = String::new();
        let _ = reader.read_line(&mut end);
        return None;
    }
    let mut chunk = vec![0; size + 2];
    reader.read_exact(&mut chunk).ok()?;
    chunk.truncate(size);
    Some(chunk)
}

/// Sends `raw` (a whole request as written, any headers) and reads the answer (the connection is closed
/// by the request's `Connection: close` or by the server).
pub fn raw_request(addr: &str, raw: &[u8]) -> Response {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    stream.write_all(raw).expect("write request");
    read_response(BufReader::new(stream))
}

fn read_response(mut reader: BufReader<TcpStream>) -> Response {
    let (status, headers) = read_head(&mut reader);
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let length = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse::<usize>().ok());
    let body = if chunked {
        read_chunked(&mut reader)
    } else if let Some(n) = length {
        let mut b = vec![0; n];
        reader.read_exact(&mut b).expect("body");
        b
    } else {
        let mut b = Vec::new();
        let _ = reader.read_to_end(&mut b);
        b
    };
    Response {
        status,
        headers,
        body,
    }
}

pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
) -> Response {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(300)))
        .expect("timeout");
    write_request(&mut stream, addr, method, path, body, headers);
    read_response(BufReader::new(stream))
}

/// A streaming response read event by event.
pub struct Stream {
    reader: BufReader<TcpStream>,
    pub status: u16,
    pending: String,
}

impl Stream {
    pub fn open(addr: &str, path: &str, body: &serde_json::Value) -> Stream {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(300)))
            .expect("timeout");
        write_request(
            &mut stream,
            addr,
            "POST",
            path,
            Some(body.to_string().as_bytes()),
            &[],
        );
        let mut reader = BufReader::new(stream);
        let (status, _) = read_head(&mut reader);
        Stream {
            reader,
            status,
            pending: String::new(),
        }
    }

    /// The next SSE event's `data:` payload, or `None` when the stream ends.
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.pending.find("\n\n") {
                let event: String = self.pending.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect();
                if !data.is_empty() {
                    return Some(data.join("\n"));
                }
                continue;
            }
            let chunk = read_chunk(&mut self.reader)?;
            self.pending.push_str(&String::from_utf8_lossy(&chunk));
        }
    }

    /// Every remaining `data:` payload.
    pub fn rest(&mut self) -> Vec<String> {
        std::iter::from_fn(|| self.next_data()).collect()
    }
}

/// Whether process `pid` still exists (a zombie counts as gone: it holds no memory).
pub fn process_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // The state follows the parenthesised command name.
            let state = stat
                .rsplit(')')
                .next()
                .and_then(|s| s.split_whitespace().next());
            state != Some("Z")
        }
        Err(_) => false,
    }
}

/// The resident memory (`VmRSS`) of process `pid`, in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
