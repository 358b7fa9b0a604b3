//! A GGUF served by its path (`polystrata serve --gguf FILE`, `polystrata --model ./file.gguf`): the file
//! is registered in the home without a hand-written run config. Its tokenizer directory is written once
//! into the home's cache (`cache/tokenizers/<id>`), and a run config `strata-<id>.json` naming the file,
//! that directory and the engine next to this binary is written beside the others, so the model is then
//! listed and served like any installed one (and found again by the next start, which reuses both).
//!
//! Environment: `POLY_ENGINE` names the engine binary (a location, README.md's table of environment variables).

use crate::home::read_home;
use crate::text::tokenizer_dir::tokenizer_command;
use serde_json::json;
use std::path::{Path, PathBuf};

/// The context a file served by path gets when its training context is larger: enough for chats,
/// small enough that the KV cache of a long-context model fits a desktop. A run config may say more.
pub const DEFAULT_CONTEXT: u32 = 8192;

/// Whether `name` (the terminal chat's `--model`) names a GGUF file rather than a registry model.
pub fn is_gguf_path(name: &str) -> bool {
    name.to_ascii_lowercase().ends_with(".gguf") && Path::new(name).is_file()
}

/// Whether `name` is written as a file's path (it ends in `.gguf`, or starts `/`, `./`, `../` or `~/`),
/// so that one naming no file is reported as such rather than looked up as a model name.
pub fn looks_like_path(name: &str) -> bool {
    name.to_ascii_lowercase().ends_with(".gguf")
        || ["/", "./", "../", "~/"].iter().any(|p| name.starts_with(p))
}

/// A model id from a file name: its stem, lowercase, with only `[a-z0-9._-]` kept (others become `-`).
pub fn id_from_file(path: &Path) -> String {
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("model")
        .to_ascii_lowercase();
    let id: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    let id = id.trim_matches(|c| c == '-' || c == '.').to_string();
    if id.is_empty() {
        "model".into()
    } else {
        id
    }
}

/// The engine binary: `POLY_ENGINE`, else `poly-engine` next to this binary.
fn engine_exe() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("POLY_ENGINE").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    let engine = exe
        .parent()
        .map(|d| d.join("poly-engine"))
        .ok_or("this binary has no directory")?;
    if engine.is_file() {
        Ok(engine)
    } else {
        Err(format!(
            "{} is missing: build it (cargo build --release -p poly-engine) or set POLY_ENGINE",
            engine.display()
        ))
    }
}

/// Registers `gguf` in `home` and returns its model id: an existing run config for the same file is
/// reused; else a new id (the file's stem, numbered when another model has it) gets a tokenizer
/// directory and a run config.
pub fn register(home: &Path, gguf: &Path) -> Result<String, String> {
    let path = std::fs::canonicalize(gguf).map_err(|e| format!("{}: {e}", gguf.display()))?;
    let meta = std::fs::metadata(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    let contents = read_home(home);
    if let Some(c) = contents
        .configs
        .iter()
        .find(|c| c.model_path().as_deref() == Some(path.as_path()))
    {
        // The cache may have been cleared since: its tokenizer directory is written again.
        let cached = home.join("cache").join("tokenizers");
        if let Some(dir) = c.tokenizer.as_ref().filter(|d| d.starts_with(&cached)) {
            if !dir.join("tokenizer_config.json").is_file() {
                tokenizer_command(&path, dir).map_err(|e| e.to_string())?;
                eprintln!(
                    "polystrata: wrote {}'s tokenizer directory again ({})",
                    c.name,
                    dir.display()
                );
            }
        }
        return Ok(c.name.clone());
    }
    let taken = |id: &str| {
        contents.configs.iter().any(|c| c.name == id)
            || contents.broken.iter().any(|b| b.name == id)
            || home.join(format!("strata-{id}.json")).exists()
    };
    let base = id_from_file(&path);
    let id = (1..)
        .map(|n| {
            if n == 1 {
                base.clone()
            } else {
                format!("{base}-{n}")
            }
        })
        .find(|id| !taken(id))
        .unwrap_or(base);
    let file =
        poly_models::GgufFile::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let trained = file
        .arch_u32_opt("context_length")
        .ok()
        .flatten()
        .filter(|&c| c > 0);
    drop(file);
    let context = trained.map_or(DEFAULT_CONTEXT, |c| c.min(DEFAULT_CONTEXT));
    let tokenizer = home.join("cache").join("tokenizers").join(&id);
    tokenizer_command(&path, &tokenizer).map_err(|e| e.to_string())?;
    let config = json!({
        "exe": engine_exe()?,
        "args": ["--model", path, "--max-context", context.to_string()],
        "cwd": ".",
        // Relative to the home, as run configs' paths are read (a relative --home stays right).
        "tokenizer": Path::new("cache").join("tokenizers").join(&id),
        "model_name": id,
        "notes": format!("registered by path ({}); edit this file to change it", path.display()),
    });
    std::fs::create_dir_all(home).map_err(|e| format!("{}: {e}", home.display()))?;
    let text = serde_json::to_string_pretty(&config).map_err(|e| e.to_string())?;
    let target = home.join(format!("strata-{id}.json"));
    std::fs::write(&target, text).map_err(|e| format!("{}: {e}", target.display()))?;
    eprintln!(
        "polystrata: registered {} as {id} (context {context}; {})",
        path.display(),
        target.display()
    );
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_from_file_names() {
        assert_eq!(
            id_from_file(Path::new("/m/SmolLM2-135M-Instruct.Q4_1.gguf")),
            "smollm2-135m-instruct.q4_1"
        );
        assert_eq!(id_from_file(Path::new("a b/c d.gguf")), "c-d");
        assert_eq!(id_from_file(Path::new("/m/..gguf")), "model");
        assert!(!is_gguf_path("qwen36"));
        assert!(
            looks_like_path("./missing.gguf")
                && looks_like_path("/m/x")
                && looks_like_path("a.GGUF")
        );
        assert!(!looks_like_path("qwen36") && !looks_like_path("gemma3:270m"));
    }
}
