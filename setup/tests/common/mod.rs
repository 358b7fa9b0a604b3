//! What the setup tests share: a local HTTP/1.1 file server (std only) with Range support and scripted
//! failures (a connection cut after part of a body, an error status, a host that ignores Range), a request
//! log, temporary directories, a minimal zip (wheel) writer, and the paths of the binaries under test.

#![allow(dead_code)]

use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// A real file to serve: the tiny synthetic Gemma 3 GGUF of the test fixtures (2.5 MB).
pub fn fixture_gguf() -> PathBuf {
    workspace_root().join("tests/fixtures/models/gemma3-tiny-q4km.gguf")
}

pub fn setup_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_setup"))
}

/// The directory of `poly-engine` and `polystrata`: beside `setup` in the target directory (the workspace
/// build puts them there).
pub fn bin_dir() -> PathBuf {
    let dir = setup_bin().parent().expect("bin dir").to_path_buf();
    for exe in ["polystrata", "poly-engine"] {
        assert!(
            dir.join(exe).is_file(),
            "{} is missing: build it with `cargo build --release -p polystrata -p poly-engine` \
             (cargo test --workspace --release does)",
            dir.join(exe).display()
        );
    }
    dir
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A fresh temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("poly-setup-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What the server answers on a path.
#[derive(Clone)]
pub enum Route {
    /// A file's bytes, honouring `Range: bytes=N-`.
    File {
        bytes: Arc<Vec<u8>>,
        /// The next this many full or ranged answers send only `cut_after` bytes of their body, then
        /// close the connection (the headers promise the whole length).
        cuts_left: usize,
        cut_after: usize,
        /// Answer 200 with the whole file even when a Range was asked for.
        ignore_range: bool,
    },
    /// A JSON body.
    Json(String),
    /// An error status with a short body.
    Status(u16),
}

impl Route {
    pub fn file(bytes: Vec<u8>) -> Route {
        Route::File {
            bytes: Arc::new(bytes),
            cuts_left: 0,
            cut_after: 0,
            ignore_range: false,
        }
    }
}

/// One request the server saw.
#[derive(Clone, Debug)]
pub struct Seen {
    pub path: String,
    pub range: Option<String>,
}

#[derive(Default)]
struct State {
    routes: HashMap<String, Route>,
    seen: Vec<Seen>,
}

/// A local HTTP server on 127.0.0.1, one thread per connection.
pub struct FileServer {
    pub base: String,
    state: Arc<Mutex<State>>,
}

impl FileServer {
    pub fn start() -> FileServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let state = shared.clone();
                std::thread::spawn(move || serve_connection(stream, &state));
            }
        });
        FileServer { base, state }
    }

    /// Sets what `path` (with its query, if any) answers.
    pub fn route(&self, path: &str, route: Route) {
        self.state
            .lock()
            .expect("state")
            .routes
            .insert(path.to_string(), route);
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.lock().expect("state").seen.clone()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

fn serve_connection(stream: TcpStream, state: &Mutex<State>) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut stream = stream;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
            return;
        }
        let path = request_line
            .split_whitespace()
            .nth(1)
            .unwrap_or("/")
            .to_string();
        let mut range = None;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                if k.eq_ignore_ascii_case("range") {
                    range = Some(v.trim().to_string());
                }
            }
        }
        let route = {
            let mut st = state.lock().expect("state");
            st.seen.push(Seen {
                path: path.clone(),
                range: range.clone(),
            });
            let route = st.routes.get(&path).cloned();
            // A cut is used up when it is served.
            if let Some(Route::File { cuts_left, .. }) = st.routes.get_mut(&path) {
                *cuts_left = cuts_left.saturating_sub(1);
            }
            route
        };
        let keep_open = match route {
            None => respond(&mut stream, 404, "text/plain", b"not found", &[]),
            Some(Route::Status(code)) => respond(&mut stream, code, "text/plain", b"failure", &[]),
            Some(Route::Json(body)) => {
                respond(&mut stream, 200, "application/json", body.as_bytes(), &[])
            }
            Some(Route::File {
                bytes,
                cuts_left,
                cut_after,
                ignore_range,
            }) => serve_file(
                &mut stream,
                &bytes,
                range.as_deref(),
                cuts_left > 0,
                cut_after,
                ignore_range,
            ),
        };
        if !keep_open {
            return;
        }
    }
}

fn respond(
    stream: &mut TcpStream,
    code: u16,
    content_type: &str,
    body: &[u8],
    extra: &[(&str, String)],
) -> bool {
    let mut head = format!(
        "HTTP/1.1 {code} X\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).is_ok() && stream.write_all(body).is_ok()
}

fn serve_file(
    stream: &mut TcpStream,
    bytes: &[u8],
    range: Option<&str>,
    cut: bool,
    cut_after: usize,
    ignore_range: bool,
) -> bool {
    let start = match range.and_then(|r| r.strip_prefix("bytes=")) {
        Some(r) if !ignore_range => r
            .split('-')
            .next()
            .and_then(|s| s.parse::<usize>().ok())
            .unwrap_or(0),
        _ => 0,
    };
    if start >= bytes.len() && start > 0 {
        return respond(
            stream,
            416,
            "text/plain",
            b"",
            &[("Content-Range", format!("bytes */{}", bytes.len()))],
        );
    }
    let body = &bytes[start..];
    let (code, extra) = if range.is_some() && !ignore_range {
        (
            206,
            vec![(
                "Content-Range",
                format!("bytes {start}-{}/{}", bytes.len() - 1, bytes.len()),
            )],
        )
    } else {
        (200, Vec::new())
    };
    if cut {
        // Headers promise the whole body; part of it comes, then the connection closes.
        let mut head = format!(
            "HTTP/1.1 {code} X\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in &extra {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let _ = stream.write_all(head.as_bytes());
        let _ = stream.write_all(&body[..cut_after.min(body.len())]);
        let _ = stream.flush();
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return false;
    }
    respond(stream, code, "application/octet-stream", body, &extra)
}

/// A zip archive (a wheel) of `(name, bytes, deflated)` members, with CRC-32s and a central directory.
pub fn zip(members: &[(&str, &[u8], bool)]) -> Vec<u8> {
    use flate2::write::DeflateEncoder;
    let mut out = Vec::new();
    let mut central = Vec::new();
    for (name, data, deflate) in members {
        let mut crc = flate2::Crc::new();
        crc.update(data);
        let (method, stored): (u16, Vec<u8>) = if *deflate {
            let mut enc = DeflateEncoder::new(Vec::new(), flate2::Compression::default());
            enc.write_all(data).expect("deflate");
            (8, enc.finish().expect("deflate"))
        } else {
            (0, data.to_vec())
        };
        let offset = out.len() as u32;
        let header = |sig: u32, central: bool| {
            let mut h = Vec::new();
            h.extend_from_slice(&sig.to_le_bytes());
            if central {
                h.extend_from_slice(&20u16.to_le_bytes()); // version made by
            }
            h.extend_from_slice(&20u16.to_le_bytes()); // version needed
            h.extend_from_slice(&0u16.to_le_bytes()); // flags
            h.extend_from_slice(&method.to_le_bytes());
            h.extend_from_slice(&[0; 4]); // time, date
            h.extend_from_slice(&crc.sum().to_le_bytes());
            h.extend_from_slice(&(stored.len() as u32).to_le_bytes());
            h.extend_from_slice(&(data.len() as u32).to_le_bytes());
            h.extend_from_slice(&(name.len() as u16).to_le_bytes());
            h.extend_from_slice(&0u16.to_le_bytes()); // extra
            if central {
                h.extend_from_slice(&[0; 6]); // comment length, disk, internal attrs
                h.extend_from_slice(&[0; 4]); // external attrs
                h.extend_from_slice(&offset.to_le_bytes());
            }
            h.extend_from_slice(name.as_bytes());
            h
        };
        out.extend(header(0x0403_4b50, false));
        out.extend_from_slice(&stored);
        central.extend(header(0x0201_4b50, true));
    }
    let cd_offset = out.len() as u32;
    out.extend_from_slice(&central);
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    out.extend_from_slice(&[0; 4]); // disk numbers
    out.extend_from_slice(&(members.len() as u16).to_le_bytes());
    out.extend_from_slice(&(members.len() as u16).to_le_bytes());
    out.extend_from_slice(&(central.len() as u32).to_le_bytes());
    out.extend_from_slice(&cd_offset.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}
