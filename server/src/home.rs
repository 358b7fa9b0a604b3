//! The installation home: where run configs (`strata-<name>.json`) and the optional `models.json` live.
//!
//! A run config says how to start one model's engine (`exe`, `args`, `cwd`) and where its tokenizer
//! directory is; `models.json` may add to or correct any entry's descriptive fields. This module only reads
//! and validates those files; what a model *is* (its GGUF facts, whether it can run) is the registry's.

use serde::Deserialize;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// The installation home: `--home DIR`, else `POLYSTRATA_HOME`, else the home the last `serve` used
/// (remembered in [`remembered_home_file`], when that directory still exists), else `~/.polystrata`.
pub fn resolve_home(flag: Option<&Path>) -> PathBuf {
    if let Some(dir) = explicit_home(flag) {
        return dir;
    }
    if let Some(dir) = remembered_home() {
        return dir;
    }
    default_home()
}

/// `--home DIR`, else `POLYSTRATA_HOME`: a home the user named for this command.
pub fn explicit_home(flag: Option<&Path>) -> Option<PathBuf> {
    if let Some(dir) = flag {
        return Some(dir.to_path_buf());
    }
    std::env::var_os("POLYSTRATA_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
}

/// `~/.polystrata`.
pub fn default_home() -> PathBuf {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".polystrata")
}

/// Where `serve` writes the home it serves, for the commands that follow (`benchmark`, `--model`,
/// `--list-models`) to read the same one: `$XDG_CONFIG_HOME/polystrata/home`, else
/// `~/.config/polystrata/home`. One line, the home's absolute path.
pub fn remembered_home_file() -> PathBuf {
    let config = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("."))
                .join(".config")
        });
    config.join("polystrata").join("home")
}

/// What a "model not found" adds so the user knows where it was looked for: the home read and how to
/// pick another.
pub fn home_read_note(home: &Path) -> String {
    format!(
        "home {} (--home DIR or POLYSTRATA_HOME picks another; else the last `serve`'s, remembered in {})",
        home.display(),
        remembered_home_file().display()
    )
}

/// The remembered home, if the file names a directory that still exists.
pub fn remembered_home() -> Option<PathBuf> {
    let text = std::fs::read_to_string(remembered_home_file()).ok()?;
    let dir = PathBuf::from(text.trim());
    (dir.is_absolute() && dir.is_dir()).then_some(dir)
}

/// Remembers `home` as the one later commands read (`serve` calls it with the home it serves, so the
/// home `setup` installed into and started the server on is the one `benchmark` then reads).
pub fn remember_home(home: &Path) -> Result<(), String> {
    let abs = std::fs::canonicalize(home).map_err(|e| format!("{}: {e}", home.display()))?;
    let file = remembered_home_file();
    if remembered_home().as_deref() == Some(abs.as_path()) {
        return Ok(());
    }
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let text = abs
        .to_str()
        .ok_or_else(|| format!("{} is not UTF-8", abs.display()))?;
    // Written beside and renamed, so a reader never sees half a path.
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, format!("{text}\n")).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &file).map_err(|e| format!("{}: {e}", file.display()))
}

/// One `strata-<name>.json`, with relative paths resolved against the home.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// The model's id: `model_name`, else the `<name>` of the file name.
    pub name: String,
    /// The config file itself.
    pub file: PathBuf,
    pub exe: PathBuf,
    pub args: Vec<String>,
    pub cwd: PathBuf,
    pub tokenizer: Option<PathBuf>,
    pub display_name: Option<String>,
    pub notes: Option<String>,
    /// The chat template or turn format to use when the GGUF has none (e.g. `"gemma3"`), as the text side
    /// understands it.
    pub chat_template: Option<String>,
    /// A draft (MTP) model the config names.
    pub draft: Option<String>,
    /// The vision projector (`mmproj` GGUF) the engine reads pictures with (`--mmproj`), relative to
    /// `cwd`. Only a run config names it: a request's names never become paths.
    pub mmproj: Option<PathBuf>,
    pub memory_debug: bool,
    /// Seconds this model's engine may owe an answer and send nothing before it is killed and replaced
    /// (0: never); else the server's `--stall-timeout`.
    pub stall_timeout_s: Option<u64>,
    /// Sampling defaults for this model (`temperature`, `top_p`, `top_k`, `min_p`, ...), applied where a
    /// request leaves a field out.
    pub sampling: Map<String, Value>,
    /// Other names requests may use for this model.
    pub aliases: Vec<String>,
    /// Every field of the file and of its `models.json` entry, for fields this server does not interpret.
    pub raw: Map<String, Value>,
}

#[derive(Deserialize)]
struct RunConfigFile {
    exe: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    tokenizer: Option<String>,
    #[serde(default)]
    display_name: Option<String>,
    #[serde(default)]
    notes: Option<String>,
    #[serde(default)]
    chat_template: Option<String>,
    #[serde(default)]
    draft: Option<String>,
    #[serde(default)]
    mmproj: Option<String>,
    #[serde(default)]
    memory_debug: bool,
    #[serde(default)]
    stall_timeout_s: Option<u64>,
    #[serde(default)]
    sampling: Map<String, Value>,
    #[serde(default)]
    aliases: Vec<String>,
}

/// A config file that could not be read: it still becomes a registry entry, unavailable with this reason.
#[derive(Clone, Debug)]
pub struct BrokenConfig {
    pub name: String,
    pub file: PathBuf,
    pub problem: String,
}

/// What the home holds: run configs sorted by name, the broken ones, and a `models.json` problem if any.
#[derive(Clone, Debug, Default)]
pub struct HomeContents {
    pub configs: Vec<RunConfig>,
    pub broken: Vec<BrokenConfig>,
    pub models_json_problem: Option<String>,
}

impl RunConfig {
    /// The path of the GGUF the engine is told to load: the value after `--model` in `args`.
    /// The vision projector the engine is given: the run config's `mmproj`, else a `--mmproj` in its
    /// args (relative to `cwd`, as the engine reads it).
    pub fn projector_path(&self) -> Option<PathBuf> {
        if let Some(m) = &self.mmproj {
            return Some(m.clone());
        }
        let at = self.args.iter().position(|a| a == "--mmproj")?;
        Some(resolve(&self.cwd, self.args.get(at + 1)?))
    }

    pub fn model_path(&self) -> Option<PathBuf> {
        let at = self.args.iter().position(|a| a == "--model")?;
        let value = self.args.get(at + 1)?;
        Some(resolve(&self.cwd, value))
    }

    /// Whether a `--max-context` over the training context is clamped to it (else the run config's
    /// `"clamp_context": false` keeps it: a test of long prompts on a small fixture, a model whose GGUF
    /// understates what it was trained for).
    pub fn clamps_context(&self) -> bool {
        self.raw
            .get("clamp_context")
            .and_then(Value::as_bool)
            .unwrap_or(true)
    }

    /// The `--max-context` the engine is given, if any.
    pub fn max_context(&self) -> Option<u32> {
        let at = self.args.iter().position(|a| a == "--max-context")?;
        self.args.get(at + 1)?.parse().ok()
    }
}

fn resolve(base: &Path, value: &str) -> PathBuf {
    let p = Path::new(value);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

/// Reads every `strata-*.json` of `home` and applies `models.json`. A missing home is an empty one.
pub fn read_home(home: &Path) -> HomeContents {
    let mut out = HomeContents::default();
    let Ok(dir) = std::fs::read_dir(home) else {
        return out;
    };
    let mut files: Vec<PathBuf> = dir
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("strata-") && n.ends_with(".json"))
        })
        .collect();
    files.sort();
    let overrides = match read_models_json(home) {
        Ok(o) => o,
        Err(problem) => {
            out.models_json_problem = Some(problem);
            Map::new()
        }
    };
    for file in files {
        let stem = file
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .trim_start_matches("strata-")
            .trim_end_matches(".json")
            .to_string();
        match parse_config(home, &file, &stem, &overrides) {
            Ok(config) => out.configs.push(config),
            Err(problem) => out.broken.push(BrokenConfig {
                name: stem,
                file,
                problem,
            }),
        }
    }
    out.configs.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Reads a file that must be a regular one: opening a FIFO (or a device) for reading blocks until a
/// writer comes, which froze every scan of the home.
pub fn read_regular(path: &Path) -> std::io::Result<String> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    std::fs::read_to_string(path)
}

fn read_models_json(home: &Path) -> Result<Map<String, Value>, String> {
    let path = home.join("models.json");
    let text = match read_regular(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Map::new()),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let value: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    // Either {"<name>": {...}} or {"models": {"<name>": {...}}}.
    let map = match value {
        Value::Object(mut m) => match m.remove("models") {
            Some(Value::Object(inner)) => inner,
            Some(other) => {
                m.insert("models".into(), other);
                m
            }
            None => m,
        },
        _ => return Err(format!("{}: not a JSON object", path.display())),
    };
    Ok(map)
}

fn parse_config(
    home: &Path,
    file: &Path,
    stem: &str,
    overrides: &Map<String, Value>,
) -> Result<RunConfig, String> {
    let text = read_regular(file).map_err(|e| format!("cannot read: {e}"))?;
    let mut raw: Map<String, Value> = match serde_json::from_str(&text) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return Err("not a JSON object".into()),
        Err(e) => return Err(format!("invalid JSON: {e}")),
    };
    let name = raw
        .get("model_name")
        .and_then(Value::as_str)
        .unwrap_or(stem)
        .to_string();
    if let Some(Value::Object(extra)) = overrides.get(&name).or_else(|| overrides.get(stem)) {
        for (k, v) in extra {
            raw.insert(k.clone(), v.clone());
        }
    }
    let parsed: RunConfigFile = serde_json::from_value(Value::Object(raw.clone()))
        .map_err(|e| format!("bad run config: {e}"))?;
    let cwd = resolve(home, parsed.cwd.as_deref().unwrap_or("."));
    let cwd_for_mmproj = cwd.clone();
    Ok(RunConfig {
        name,
        file: file.to_path_buf(),
        exe: resolve(&cwd, &parsed.exe),
        args: parsed.args,
        tokenizer: parsed.tokenizer.map(|t| resolve(home, &t)),
        cwd,
        display_name: parsed.display_name,
        notes: parsed.notes,
        chat_template: parsed.chat_template,
        draft: parsed.draft,
        mmproj: parsed.mmproj.map(|m| resolve(&cwd_for_mmproj, &m)),
        memory_debug: parsed.memory_debug,
        stall_timeout_s: parsed.stall_timeout_s,
        sampling: parsed.sampling,
        aliases: parsed.aliases,
        raw,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_home(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("polystrata-home-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn reads_configs_resolves_paths_and_applies_models_json() {
        let home = temp_home("read");
        std::fs::write(
            home.join("strata-tiny.json"),
            r#"{"exe":"bin/poly-engine","args":["--model","m/tiny.gguf","--max-context","512"],
                "cwd":".","tokenizer":"packs/tiny/tokenizer","display_name":"Tiny","port":8080}"#,
        )
        .expect("write");
        std::fs::write(home.join("strata-broken.json"), "{not json").expect("write");
        std::fs::write(home.join("other.json"), "{}").expect("write");
        std::fs::write(
            home.join("models.json"),
            r#"{"tiny":{"display_name":"Tiny corrected","notes":"from models.json"}}"#,
        )
        .expect("write");
        let contents = read_home(&home);
        assert_eq!(contents.configs.len(), 1);
        let c = &contents.configs[0];
        assert_eq!(c.name, "tiny");
        assert_eq!(c.display_name.as_deref(), Some("Tiny corrected"));
        assert_eq!(c.notes.as_deref(), Some("from models.json"));
        assert_eq!(c.exe, home.join("bin/poly-engine"));
        assert_eq!(c.model_path(), Some(home.join("m/tiny.gguf")));
        assert_eq!(c.max_context(), Some(512));
        assert_eq!(c.tokenizer, Some(home.join("packs/tiny/tokenizer")));
        assert_eq!(contents.broken.len(), 1);
        assert_eq!(contents.broken[0].name, "broken");
        assert!(contents.broken[0].problem.contains("invalid JSON"));
        let _ = std::fs::remove_dir_all(&home);
    }

    #[test]
    fn model_name_overrides_the_file_name() {
        let home = temp_home("name");
        std::fs::write(
            home.join("strata-a.json"),
            r#"{"exe":"/bin/true","model_name":"alpha"}"#,
        )
        .expect("write");
        let contents = read_home(&home);
        assert_eq!(contents.configs[0].name, "alpha");
        assert_eq!(contents.configs[0].model_path(), None);
        let _ = std::fs::remove_dir_all(&home);
    }

    #[test]
    fn missing_home_is_empty() {
        let contents = read_home(Path::new("/nonexistent/polystrata/home"));
        assert!(contents.configs.is_empty() && contents.broken.is_empty());
    }
}
