//! The model registry: every run config of the home as an entry with the facts people choose a model by
//! (names, architecture, quantization, sizes, context, memory needs) and whether it can run at all.
//!
//! A model the engine cannot run (a broken config, a missing engine, GGUF or tokenizer, an architecture the
//! engine does not know) is listed as `unavailable` with the reason, so that nobody finds out at a switch.

use crate::home::{read_home, HomeContents, RunConfig};
use poly_models::summary::ModelSummary;
use poly_models::GgufFile;
use serde::Serialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

/// Whether a model can run, and for the model in use whether its engine is up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Available,
    Unavailable,
    Loaded,
    Unloaded,
}

/// The memory a model needs on the GPU, in GB.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct VramGb {
    /// Dense weights plus 1 GB: the least with which the engine runs (experts streamed).
    pub least: f64,
    /// With every routed expert resident too.
    pub all: f64,
}

/// One model of the registry, as `/api/models` and `--list-models` show it.
#[derive(Clone, Debug, Serialize)]
pub struct ModelEntry {
    pub id: String,
    pub display_name: String,
    pub backend: Option<String>,
    pub path: Option<PathBuf>,
    pub quantization: Option<String>,
    pub params_total: Option<String>,
    pub params_active: Option<String>,
    pub context: Option<u32>,
    /// Why `context` is less than the run config asks: the asked `--max-context` is over the model's
    /// training context (the GGUF's `<arch>.context_length`), so the engine is started with the latter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_note: Option<String>,
    pub multimodal: bool,
    pub mtp: bool,
    pub vram_gb: Option<VramGb>,
    pub ram_gb: Option<f64>,
    pub status: Status,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub notes: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// The run config this entry comes from (absent for an entry that could not be parsed).
    #[serde(skip)]
    pub config: Option<RunConfig>,
}

impl ModelEntry {
    pub fn is_runnable(&self) -> bool {
        self.problem.is_none()
    }

    /// Whether `name` names this model: its id or one of its aliases. An alias ending in `*` takes every
    /// name it starts (`"claude-*"` lets agents that send their own model names reach this model).
    pub fn answers_to(&self, name: &str) -> bool {
        self.id == name
            || self.aliases.iter().any(|a| match a.strip_suffix('*') {
                Some(prefix) => name.starts_with(prefix),
                None => a == name,
            })
    }
}

/// Reads the home and describes every model; GGUF facts are cached per file (path, size, mtime).
pub struct Registry {
    home: PathBuf,
    cache: Mutex<HashMap<PathBuf, CachedSummary>>,
}

/// A file's facts (or why it cannot be read), valid while the file keeps its stamp.
type CachedSummary = (FileStamp, Result<ModelSummary, String>);

#[derive(Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    len: u64,
    modified: Option<SystemTime>,
}

const GB: f64 = 1e9;

impl Registry {
    pub fn new(home: PathBuf) -> Registry {
        Registry {
            home,
            cache: Mutex::new(HashMap::new()),
        }
    }

    pub fn home(&self) -> &Path {
        &self.home
    }

    /// Every model of the home, sorted by id; each `available` or `unavailable` (the caller marks the one
    /// in use `loaded` / `unloaded`).
    pub fn scan(&self) -> Vec<ModelEntry> {
        let HomeContents {
            configs,
            broken,
            models_json_problem,
        } = read_home(&self.home);
        let mut entries: Vec<ModelEntry> = configs.into_iter().map(|c| self.describe(c)).collect();
        for b in broken {
            entries.push(ModelEntry {
                id: b.name.clone(),
                display_name: b.name,
                backend: None,
                path: None,
                quantization: None,
                params_total: None,
                params_active: None,
                context: None,
                context_note: None,
                multimodal: false,
                mtp: false,
                vram_gb: None,
                ram_gb: None,
                status: Status::Unavailable,
                problem: Some(format!("{}: {}", b.file.display(), b.problem)),
                notes: None,
                aliases: Vec::new(),
                config: None,
            });
        }
        if let Some(p) = models_json_problem {
            eprintln!("polystrata: models.json ignored: {p}");
        }
        entries.sort_by(|a, b| a.id.cmp(&b.id));
        entries
    }

    /// Finds a model by id or alias, else by a part of its id when only one id has it.
    pub fn find(&self, name: &str) -> Result<ModelEntry, String> {
        let entries = self.scan();
        find_in(&entries, name).cloned()
    }

    fn summary(&self, path: &Path) -> Result<ModelSummary, String> {
        let meta =
            std::fs::metadata(path).map_err(|e| format!("model file {}: {e}", path.display()))?;
        // Opening a FIFO (or a device) blocks until someone writes to it: it froze every request.
        if !meta.is_file() {
            return Err(format!(
                "model file {} is not a regular file",
                path.display()
            ));
        }
        let stamp = FileStamp {
            len: meta.len(),
            modified: meta.modified().ok(),
        };
        {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((s, result)) = cache.get(path) {
                if *s == stamp {
                    return result.clone();
                }
            }
        }
        // Read without the cache's lock: a slow file (a network mount) delays only its own scan.
        let result = GgufFile::open(path)
            .map_err(|e| format!("model file {}: {e}", path.display()))
            .and_then(|f| {
                ModelSummary::of(&f).map_err(|e| format!("model file {}: {e}", path.display()))
            });
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(path.to_path_buf(), (stamp, result.clone()));
        result
    }

    fn describe(&self, config: RunConfig) -> ModelEntry {
        let path = config.model_path();
        let mut problems: Vec<String> = Vec::new();
        if !is_executable(&config.exe) {
            problems.push(format!(
                "engine {} not found or not executable",
                config.exe.display()
            ));
        }
        match &config.tokenizer {
            None => problems.push(
                "no tokenizer directory in the run config (`polystrata tokenizer --gguf FILE --out DIR` writes one)"
                    .into(),
            ),
            Some(dir) if !dir.join("tokenizer.json").is_file() => {
                problems.push(format!("tokenizer {} has no tokenizer.json", dir.display()))
            }
            Some(_) => {}
        }
        let summary = match &path {
            None => {
                problems.push("the run config's args name no --model file".into());
                None
            }
            Some(p) => match self.summary(p) {
                Ok(s) => Some(s),
                Err(e) => {
                    problems.push(e);
                    None
                }
            },
        };
        if let Some(s) = &summary {
            if !poly_models::SUPPORTED_ARCHITECTURES.contains(&s.architecture.as_str()) {
                problems.push(format!(
                    "architecture {:?} is not supported by the engine (known: {})",
                    s.architecture,
                    poly_models::SUPPORTED_ARCHITECTURES.join(", ")
                ));
            }
        }
        let file_name = path
            .as_ref()
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let quantization = quantization_from_name(file_name).or_else(|| {
            summary
                .as_ref()
                .and_then(|s| s.main_type)
                .map(|t| t.name().to_uppercase())
        });
        let (params_total, params_active) = summary
            .as_ref()
            .map(|s| params_of(s.size_label.as_deref(), s.n_elements))
            .unwrap_or((None, None));
        // Pictures are read only with the projector there (a configured one that is missing would stop
        // the engine at its start), whether the run config's `mmproj` or a `--mmproj` in its args names it.
        let projector = config.projector_path();
        if let Some(m) = projector.as_ref().filter(|m| !m.is_file()) {
            problems.push(format!("projector (mmproj) {} not found", m.display()));
        }
        let multimodal = projector.as_ref().is_some_and(|m| m.is_file());
        let trained = summary
            .as_ref()
            .and_then(|s| s.context_length)
            .filter(|&t| t > 0);
        let context = match (config.max_context(), trained) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let context_note = match (config.max_context(), trained) {
            (Some(asked), Some(trained)) if asked > trained && config.clamps_context() => {
                Some(context_clamped_note(asked, trained))
            }
            _ => None,
        };
        let display_name = config
            .display_name
            .clone()
            .or_else(|| summary.as_ref().and_then(|s| s.name.clone()))
            .unwrap_or_else(|| config.name.clone());
        ModelEntry {
            id: config.name.clone(),
            display_name,
            backend: summary.as_ref().map(|s| s.architecture.clone()),
            path,
            quantization,
            params_total,
            params_active,
            context,
            context_note,
            multimodal,
            mtp: summary.as_ref().is_some_and(|s| s.has_mtp) || config.draft.is_some(),
            vram_gb: summary.as_ref().map(|s| VramGb {
                least: round2(s.other_bytes as f64 / GB + 1.0),
                all: round2((s.other_bytes + s.expert_bytes) as f64 / GB + 1.0),
            }),
            ram_gb: summary.as_ref().map(|s| round2(s.file_bytes as f64 / GB)),
            status: if problems.is_empty() {
                Status::Available
            } else {
                Status::Unavailable
            },
            problem: (!problems.is_empty()).then(|| problems.join("; ")),
            notes: config.notes.clone(),
            aliases: config.aliases.clone(),
            config: Some(config),
        }
    }
}

/// Finds `name` among `entries`: an exact id or alias first, else the only id containing it.
/// How much of an unknown model name an error repeats.
const NAME_ECHO_BYTES: usize = 100;
/// How many installed ids an unknown-model error lists.
const IDS_LISTED: usize = 8;

/// The note of a context clamped to the training context (the log's line, `/props`, `/api/models`).
pub fn context_clamped_note(asked: u32, trained: u32) -> String {
    format!(
        "--max-context {asked} is over the model's training context; clamped to {trained} \
         (the GGUF's context_length)"
    )
}

pub fn find_in<'a>(entries: &'a [ModelEntry], name: &str) -> Result<&'a ModelEntry, String> {
    if let Some(e) = entries.iter().find(|e| e.answers_to(name)) {
        return Ok(e);
    }
    let lower = name.to_lowercase();
    let partial: Vec<&ModelEntry> = entries
        .iter()
        .filter(|e| !lower.is_empty() && e.id.to_lowercase().contains(&lower))
        .collect();
    match partial.as_slice() {
        [one] => Ok(one),
        // The name is the client's: echoed cut short, and the installed ids listed up to a few (the
        // whole list is GET /v1/models).
        [] => Err(format!(
            "model {:?} not found (installed: {})",
            crate::http::access::truncate(name, NAME_ECHO_BYTES),
            if entries.is_empty() {
                "none".to_string()
            } else if entries.len() > IDS_LISTED {
                format!(
                    "{}, and {} more; see GET /v1/models",
                    entries[..IDS_LISTED]
                        .iter()
                        .map(|e| e.id.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    entries.len() - IDS_LISTED
                )
            } else {
                entries
                    .iter()
                    .map(|e| e.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        )),
        many => Err(format!(
            "model {:?} is ambiguous: {}",
            crate::http::access::truncate(name, NAME_ECHO_BYTES),
            many.iter()
                .map(|e| e.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The quantization a file name carries, as people write it: `UD-Q3_K_M`, `Q4_K_M`, `IQ2_XXS`, `Q8_0`,
/// `BF16`, `MXFP4`... Tokens are separated by `-`, `.` or `_`-free boundaries of the stem.
pub fn quantization_from_name(file_name: &str) -> Option<String> {
    let stem = file_name
        .strip_suffix(".gguf")
        .unwrap_or(file_name)
        .to_ascii_uppercase();
    // Split-file suffixes (`-00001-of-00003`) are not part of the label.
    let parts: Vec<&str> = stem.split(['-', '.']).collect();
    for (i, part) in parts.iter().enumerate() {
        if is_quant_label(part) {
            let ud = i > 0 && parts[i - 1] == "UD";
            return Some(if ud {
                format!("UD-{part}")
            } else {
                part.to_string()
            });
        }
    }
    None
}

fn is_quant_label(s: &str) -> bool {
    if matches!(s, "F16" | "BF16" | "F32" | "MXFP4" | "FP8") {
        return true;
    }
    let rest = s
        .strip_prefix("IQ")
        .or_else(|| s.strip_prefix("TQ"))
        .or_else(|| s.strip_prefix('Q'));
    let Some(rest) = rest else { return false };
    let mut chars = rest.chars();
    if !chars.next().is_some_and(|c| c.is_ascii_digit()) {
        return false;
    }
    let tail: String = chars.collect();
    tail.is_empty()
        || (tail.starts_with('_')
            && tail[1..]
                .split('_')
                .all(|t| !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric())))
}

/// Total and active parameter counts from `general.size_label` (`35B-A3B`, `30B-A3B`, `270M`), else the
/// element count of the tensors (total only; active then equals total).
pub fn params_of(size_label: Option<&str>, n_elements: u64) -> (Option<String>, Option<String>) {
    if let Some(label) = size_label.map(str::trim).filter(|l| !l.is_empty()) {
        let mut parts = label.split('-');
        let total = parts.next().map(str::to_string);
        let active = parts
            .find_map(|p| p.strip_prefix('A').map(str::to_string))
            .or_else(|| total.clone());
        return (total, active);
    }
    if n_elements == 0 {
        return (None, None);
    }
    let n = n_elements as f64;
    let label = if n >= 1e9 {
        format!("{:.1}B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.0}M", n / 1e6)
    } else {
        format!("{:.0}K", n / 1e3)
    };
    (Some(label.clone()), Some(label))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multimodal_only_with_the_projector_file_there() {
        let home =
            std::env::temp_dir().join(format!("polystrata-registry-mmproj-{}", std::process::id()));
        std::fs::create_dir_all(&home).unwrap();
        let write = |name: &str, config: serde_json::Value| {
            std::fs::write(home.join(format!("strata-{name}.json")), config.to_string()).unwrap();
        };
        write(
            "by-field",
            serde_json::json!({"exe": "/bin/true", "args": ["--model", "m.gguf"], "mmproj": "field.gguf"}),
        );
        write(
            "by-arg",
            serde_json::json!({"exe": "/bin/true", "args": ["--model", "m.gguf", "--mmproj", "arg.gguf"]}),
        );
        write(
            "text",
            serde_json::json!({"exe": "/bin/true", "args": ["--model", "m.gguf"]}),
        );
        let scan = || {
            let entries = Registry::new(home.clone()).scan();
            let get = |id: &str| entries.iter().find(|e| e.id == id).cloned().expect(id);
            (get("by-field"), get("by-arg"), get("text"))
        };
        let (field, arg, text) = scan();
        assert!(!field.multimodal && !arg.multimodal && !text.multimodal);
        assert!(
            field
                .problem
                .as_deref()
                .unwrap_or("")
                .contains("field.gguf not found"),
            "{:?}",
            field.problem
        );
        assert!(
            arg.problem
                .as_deref()
                .unwrap_or("")
                .contains("arg.gguf not found"),
            "{:?}",
            arg.problem
        );
        std::fs::write(home.join("field.gguf"), b"GGUF").unwrap();
        std::fs::write(home.join("arg.gguf"), b"GGUF").unwrap();
        let (field, arg, text) = scan();
        assert!(field.multimodal && arg.multimodal && !text.multimodal);
        std::fs::remove_dir_all(&home).unwrap();
    }

    #[test]
    fn quantization_labels_from_file_names() {
        let cases = [
            ("Qwen3.6-35B-A3B-UD-Q3_K_M.gguf", Some("UD-Q3_K_M")),
            ("gemma-3-270m-q4_k_m.gguf", Some("Q4_K_M")),
            ("model-IQ2_XXS-00001-of-00003.gguf", Some("IQ2_XXS")),
            ("GLM-4.5-Air-Q8_0.gguf", Some("Q8_0")),
            ("m-BF16.gguf", Some("BF16")),
            ("qwen3moe-tiny-q4km.gguf", None),
            ("plain.gguf", None),
        ];
        for (name, want) in cases {
            assert_eq!(quantization_from_name(name).as_deref(), want, "{name}");
        }
    }

    #[test]
    fn params_from_size_labels() {
        assert_eq!(
            params_of(Some("35B-A3B"), 0),
            (Some("35B".into()), Some("3B".into()))
        );
        assert_eq!(
            params_of(Some("270M"), 0),
            (Some("270M".into()), Some("270M".into()))
        );
        assert_eq!(
            params_of(None, 2_500_000),
            (Some("2M".into()), Some("2M".into()))
        );
        assert_eq!(params_of(None, 0), (None, None));
    }

    fn entry(id: &str) -> ModelEntry {
        ModelEntry {
            id: id.into(),
            display_name: id.into(),
            backend: None,
            path: None,
            quantization: None,
            params_total: None,
            params_active: None,
            context: None,
            context_note: None,
            multimodal: false,
            mtp: false,
            vram_gb: None,
            ram_gb: None,
            status: Status::Available,
            problem: None,
            notes: None,
            aliases: vec![format!("{id}-alias")],
            config: None,
        }
    }

    #[test]
    fn find_by_id_alias_and_unique_part() {
        let entries = vec![entry("qwen3-tiny"), entry("qwen35-tiny"), entry("gemma")];
        assert_eq!(
            find_in(&entries, "gemma").map(|e| e.id.as_str()),
            Ok("gemma")
        );
        assert_eq!(find_in(&entries, "gem").map(|e| e.id.as_str()), Ok("gemma"));
        assert_eq!(
            find_in(&entries, "qwen3-tiny-alias").map(|e| e.id.as_str()),
            Ok("qwen3-tiny")
        );
        assert!(find_in(&entries, "qwen").unwrap_err().contains("ambiguous"));
        assert!(find_in(&entries, "llama")
            .unwrap_err()
            .contains("not found"));
    }

    #[test]
    fn an_unknown_name_is_echoed_short_and_few_ids_are_listed() {
        let entries: Vec<ModelEntry> = (0..20).map(|i| entry(&format!("model-{i:02}"))).collect();
        let long = "x".repeat(100_000);
        let e = find_in(&entries, &long).unwrap_err();
        assert!(e.len() < 400, "{} bytes", e.len());
        assert!(e.contains("and 12 more; see GET /v1/models"), "{e}");
        assert!(!e.contains("model-19"), "{e}");
    }
}
