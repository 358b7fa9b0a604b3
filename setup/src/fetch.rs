//! Downloads over HTTP(S): resumable (a `.part` file beside the final name, continued with `Range`),
//! progress on stderr, SHA-256 over every byte, and the final name only after the hash matched. A file that
//! fails its check is deleted; nothing half-downloaded ever carries the final name.

use crate::hash::{sha256_file, HashSource};
use crate::SetupError;
use std::fs::OpenOptions;
use std::io::{IsTerminal, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How often a dropped connection is resumed within one run before giving up.
const ATTEMPTS: usize = 4;

/// What a downloaded file must be.
#[derive(Clone, Debug)]
pub struct Expected {
    /// Lowercase hex SHA-256.
    pub sha256: String,
    /// Where the hash comes from (printed, so people know what was checked).
    pub source: HashSource,
    /// The size where known (a longer `.part` is restarted; a different final size is refused).
    pub bytes: Option<u64>,
}

/// An HTTP client for files and for the small JSON answers of package hosts.
pub struct Fetcher {
    files: ureq::Agent,
    api: ureq::Agent,
    /// Progress lines on stderr.
    pub progress: bool,
}

impl Default for Fetcher {
    fn default() -> Self {
        Fetcher::new()
    }
}

impl Fetcher {
    pub fn new() -> Fetcher {
        let user_agent = concat!("polystrata-setup/", env!("CARGO_PKG_VERSION"));
        let tls = ureq::tls::TlsConfig::builder()
            .root_certs(root_certs())
            .build();
        // Files are asked for without content encoding: a Range continues the bytes on disk, which a
        // transparently decompressed body would not.
        let files = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .tls_config(tls.clone())
            .accept_encoding("identity")
            .user_agent(user_agent)
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(60)))
            .timeout_per_read(Some(Duration::from_secs(120)))
            .build()
            .new_agent();
        let api = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .tls_config(tls)
            .user_agent(user_agent)
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .new_agent();
        Fetcher {
            files,
            api,
            progress: true,
        }
    }

    /// GETs `url` and parses its JSON body.
    pub fn get_json(&self, url: &str) -> Result<serde_json::Value, SetupError> {
        self.get_json_as(url, "application/json")
    }

    /// GETs `url` asking for `accept` (a JSON media type) and parses the body.
    pub fn get_json_as(&self, url: &str, accept: &str) -> Result<serde_json::Value, SetupError> {
        let mut response = self
            .api
            .get(url)
            .header("Accept", accept)
            .call()
            .map_err(|e| SetupError::Http(format!("{url}: {e}")))?;
        let status = response.status().as_u16();
        if status != 200 {
            return Err(SetupError::Http(format!("{url}: HTTP {status}")));
        }
        let text = response
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .map_err(|e| SetupError::Http(format!("{url}: {e}")))?;
        serde_json::from_str(&text).map_err(|e| SetupError::Http(format!("{url}: bad JSON: {e}")))
    }

    /// Downloads `url` to `dest`: resumes `dest.part` if present, checks the SHA-256, then renames. A file
    /// already at `dest` is not touched (the caller decides whether it is current).
    pub fn download(&self, url: &str, dest: &Path, expected: &Expected) -> Result<(), SetupError> {
        let part = part_path(dest);
        if let Some(dir) = dest.parent() {
            std::fs::create_dir_all(dir).map_err(|e| SetupError::io(dir, e))?;
        }
        let label = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut last_error = None;
        for attempt in 0..ATTEMPTS {
            match self.fetch_into_part(url, &part, expected.bytes, &label) {
                Ok(()) => {
                    last_error = None;
                    break;
                }
                Err(e @ SetupError::Interrupted(_)) => {
                    if attempt + 1 < ATTEMPTS {
                        eprintln!("setup: {e}; resuming");
                    }
                    last_error = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        if let Some(e) = last_error {
            return Err(e);
        }
        verify_and_rename(&part, dest, expected)
    }

    /// One request: continues `part` from its length (or starts it) until the body ends.
    fn fetch_into_part(
        &self,
        url: &str,
        part: &Path,
        total: Option<u64>,
        label: &str,
    ) -> Result<(), SetupError> {
        let mut have = std::fs::metadata(part).map(|m| m.len()).unwrap_or(0);
        if total.is_some_and(|t| have > t) {
            // Longer than the file can be: not a prefix of it.
            have = 0;
        }
        if total.is_some_and(|t| have == t) {
            return Ok(());
        }
        let mut request = self.files.get(url);
        if have > 0 {
            request = request.header("Range", &format!("bytes={have}-"));
        }
        let response = request
            .call()
            .map_err(|e| SetupError::Http(format!("{url}: {e}")))?;
        let status = response.status().as_u16();
        let start = match status {
            200 => 0,
            206 => {
                let range = response
                    .headers()
                    .get("content-range")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default();
                let from = parse_content_range_start(range);
                if from != Some(have) {
                    return Err(SetupError::Http(format!(
                        "{url}: asked for bytes from {have}, got Content-Range {range:?}"
                    )));
                }
                have
            }
            416 => {
                // The part is not shorter than the file: start again and let the hash decide.
                let _ = std::fs::remove_file(part);
                return Err(SetupError::Interrupted(format!(
                    "{url}: the server refused to continue {} at byte {have}",
                    part.display()
                )));
            }
            _ => {
                return Err(SetupError::Http(format!(
                    "{url}: HTTP {status} {}",
                    response.status().canonical_reason().unwrap_or("")
                )))
            }
        };
        let length = response
            .headers()
            .get("content-length")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let expected_total = total.or(length.map(|l| l + start));
        let mut file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .open(part)
            .map_err(|e| SetupError::io(part, e))?;
        file.set_len(start).map_err(|e| SetupError::io(part, e))?;
        file.seek(SeekFrom::Start(start))
            .map_err(|e| SetupError::io(part, e))?;
        let mut body = response.into_body().into_reader();
        let mut progress = Progress::new(label, start, expected_total, self.progress);
        let mut buf = vec![0u8; 1 << 20];
        let mut written = start;
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    progress.finish();
                    file.flush().map_err(|e| SetupError::io(part, e))?;
                    return Err(SetupError::Interrupted(format!(
                        "{url}: connection lost after {written} bytes ({e})"
                    )));
                }
            };
            file.write_all(&buf[..n])
                .map_err(|e| SetupError::io(part, e))?;
            written += n as u64;
            progress.update(written);
        }
        progress.finish();
        file.flush().map_err(|e| SetupError::io(part, e))?;
        if let Some(t) = expected_total {
            if written < t {
                return Err(SetupError::Interrupted(format!(
                    "{url}: the body ended after {written} of {t} bytes"
                )));
            }
        }
        Ok(())
    }
}

/// The certificates TLS trusts: the system's bundle as curl and pip read it (`SSL_CERT_FILE`, else
/// Debian's, Fedora's or Alpine's bundle), so that a machine whose administrator added a certificate
/// authority (a company proxy) works; Mozilla's roots built into the binary where there is none.
fn root_certs() -> ureq::tls::RootCerts {
    let candidates = std::env::var_os("SSL_CERT_FILE")
        .map(PathBuf::from)
        .into_iter()
        .chain(
            [
                "/etc/ssl/certs/ca-certificates.crt",
                "/etc/pki/tls/certs/ca-bundle.crt",
                "/etc/ssl/cert.pem",
            ]
            .map(PathBuf::from),
        );
    for path in candidates {
        let Ok(pem) = std::fs::read(&path) else {
            continue;
        };
        let certs: Vec<ureq::tls::Certificate<'static>> = ureq::tls::parse_pem(&pem)
            .filter_map(|item| match item {
                Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
                _ => None,
            })
            .collect();
        if !certs.is_empty() {
            return ureq::tls::RootCerts::new_with_certs(&certs);
        }
    }
    ureq::tls::RootCerts::WebPki
}

/// The file a download writes before its hash is checked: `NAME.part` beside `NAME`.
pub fn part_path(dest: &Path) -> PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(".part");
    dest.with_file_name(name)
}

/// Checks `part`'s size and SHA-256 against `expected`; renames it to `dest` when they match, deletes it
/// when they do not (its bytes are wrong, resuming cannot fix them).
pub fn verify_and_rename(part: &Path, dest: &Path, expected: &Expected) -> Result<(), SetupError> {
    let len = std::fs::metadata(part)
        .map_err(|e| SetupError::io(part, e))?
        .len();
    if let Some(bytes) = expected.bytes {
        if len != bytes {
            let _ = std::fs::remove_file(part);
            return Err(SetupError::Mismatch(format!(
                "{}: {len} bytes, expected {bytes}; deleted, nothing installed",
                dest.display()
            )));
        }
    }
    let got = sha256_file(part)?;
    if !got.eq_ignore_ascii_case(&expected.sha256) {
        let _ = std::fs::remove_file(part);
        return Err(SetupError::Mismatch(format!(
            "{}: SHA-256 {got} does not match {} ({}); deleted, nothing installed",
            dest.display(),
            expected.sha256,
            expected.source
        )));
    }
    eprintln!(
        "setup: {} SHA-256 ok ({})",
        dest.file_name().unwrap_or_default().to_string_lossy(),
        expected.source
    );
    std::fs::rename(part, dest).map_err(|e| SetupError::io(dest, e))
}

/// `bytes START-END/TOTAL` → START.
fn parse_content_range_start(value: &str) -> Option<u64> {
    let rest = value.trim().strip_prefix("bytes")?.trim_start();
    rest.split('-').next()?.trim().parse().ok()
}

/// Progress of one transfer on stderr: a rewritten line on a terminal, else a line every 10%.
pub struct Progress {
    label: String,
    total: Option<u64>,
    enabled: bool,
    terminal: bool,
    started: Instant,
    start_bytes: u64,
    last_print: Instant,
    last_tenth: u64,
    printed: bool,
}

impl Progress {
    pub fn new(label: &str, start_bytes: u64, total: Option<u64>, enabled: bool) -> Progress {
        let now = Instant::now();
        Progress {
            label: label.to_string(),
            total,
            enabled,
            terminal: std::io::stderr().is_terminal(),
            started: now,
            start_bytes,
            last_print: now,
            last_tenth: 0,
            printed: false,
        }
    }

    pub fn update(&mut self, done: u64) {
        if !self.enabled {
            return;
        }
        let due = if self.terminal {
            self.last_print.elapsed() >= Duration::from_millis(250)
        } else {
            let tenth = self.total.map(|t| done * 10 / t.max(1)).unwrap_or(0);
            let due = tenth > self.last_tenth;
            self.last_tenth = self.last_tenth.max(tenth);
            due
        };
        if !due {
            return;
        }
        self.last_print = Instant::now();
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let rate = (done - self.start_bytes) as f64 / secs / 1e6;
        let line = match self.total {
            Some(t) => format!(
                "{}: {:.1} / {:.1} MB ({:.0}%), {rate:.1} MB/s",
                self.label,
                done as f64 / 1e6,
                t as f64 / 1e6,
                done as f64 * 100.0 / t.max(1) as f64
            ),
            None => format!(
                "{}: {:.1} MB, {rate:.1} MB/s",
                self.label,
                done as f64 / 1e6
            ),
        };
        if self.terminal {
            eprint!("\r{line}\x1b[K");
        } else {
            eprintln!("{line}");
        }
        self.printed = true;
    }

    pub fn finish(&mut self) {
        if self.enabled && self.terminal && self.printed {
            eprintln!();
        }
        self.printed = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_range_start() {
        assert_eq!(parse_content_range_start("bytes 100-199/200"), Some(100));
        assert_eq!(parse_content_range_start("bytes 0-0/*"), Some(0));
        assert_eq!(parse_content_range_start("items 1-2/3"), None);
    }

    #[test]
    fn part_path_is_beside_the_file() {
        assert_eq!(
            part_path(Path::new("/h/models/a.gguf")),
            PathBuf::from("/h/models/a.gguf.part")
        );
    }
}
