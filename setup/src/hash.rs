//! SHA-256 of files and where an expected hash comes from (printed next to every check, so a person can
//! tell a hash pinned in the table from one the host published).

use crate::SetupError;
use sha2::{Digest, Sha256};
use std::fmt;
use std::io::Read;
use std::path::Path;

/// Where an expected SHA-256 comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HashSource {
    /// Pinned in the family table.
    Pinned,
    /// Published by Hugging Face for this commit (`lfs.sha256` / `lfs.oid` of the file).
    HuggingFace { repo: String, commit: String },
    /// PyPI's digest of a wheel.
    Pypi { package: String, version: String },
    /// A stamp `setup` wrote when it installed the file.
    Stamp,
}

impl fmt::Display for HashSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HashSource::Pinned => write!(f, "hash pinned in the family table"),
            HashSource::HuggingFace { repo, commit } => {
                write!(f, "hash published by Hugging Face for {repo} at {commit}")
            }
            HashSource::Pypi { package, version } => {
                write!(f, "hash published by PyPI for {package} {version}")
            }
            HashSource::Stamp => write!(f, "hash recorded when setup installed it"),
        }
    }
}

/// Lowercase hex SHA-256 of a file's bytes.
pub fn sha256_file(path: &Path) -> Result<String, SetupError> {
    let mut file = std::fs::File::open(path).map_err(|e| SetupError::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| SetupError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Lowercase hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_abc() {
        // FIPS 180-2's example.
        let mut h = Sha256::new();
        h.update(b"abc");
        assert_eq!(
            hex(&h.finalize()),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
