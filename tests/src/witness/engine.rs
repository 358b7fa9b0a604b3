//! Getting "our" side of a witness comparison: where the model file is, fetching a model that is not
//! committed, and (for a check that runs a binary rather than the library) running `poly-engine run
//! --json` and reading its steps.
//!
//! The CLI contract: `poly-engine run --model FILE --prompt-tokens ID,ID,... --max-tokens N --top K --json
//! [EXTRA...]` decodes exactly the given ids (no BOS added), then writes N greedy tokens, printing one JSON
//! object per step on stdout, `{"token": ID, "top": [...]}` with the K likeliest tokens, likeliest first,
//! as `[ID, PROB]` pairs or objects `{"token"|"id": ID, "prob"|"p": PROB}`. Other stdout lines, and
//! JSON objects without a `token`, are ignored. The CPU witness passes `--ignore-eos --n-ctx N` as
//! extras (llama.cpp's references do not stop on end-of-generation tokens).
//! Environment: `POLY_ENGINE` names the engine binary and `POLY_WITNESS_MODELS` the real models' folder.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde_json::Value;

use super::{sha256_file, Reference, Step};

/// How many likeliest tokens the harness asks the engine for: more than llama.cpp's five, so that a
/// token llama.cpp ranks fifth is still listed by us when our ranking differs slightly.
pub const ENGINE_TOP: usize = 20;

/// The workspace root (the parent of the `tests` crate).
pub fn workspace_dir() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(Path::to_path_buf).unwrap_or(manifest)
}

/// The `poly-engine` binary: `$POLY_ENGINE`, else `target/release/poly-engine` (built by
/// `cargo build --release -p poly-engine`).
pub fn engine_binary() -> Result<PathBuf, String> {
    let path = match std::env::var_os("POLY_ENGINE") {
        Some(p) => PathBuf::from(p),
        None => workspace_dir()
            .join("target")
            .join("release")
            .join("poly-engine"),
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "poly-engine binary not found at {} (build it with `cargo build --release -p poly-engine` \
             or point POLY_ENGINE at it)",
            path.display()
        ))
    }
}

/// The model file of `reference`, verified against its SHA-256. Committed fixtures are in
/// `tests/fixtures/models/`; a model with a fetch command lives in the folder that command fills,
/// its first argument (`target/gemma3-270m`, `target/smollm2`), and is fetched there when missing (`$POLY_WITNESS_MODELS` names another folder
/// to take it from, with no fetching). `verified` caches the paths already hashed, since five
/// references share one model.
pub fn ensure_model(reference: &Reference, verified: &mut Vec<PathBuf>) -> Result<PathBuf, String> {
    let path = match &reference.model_fetch {
        None => crate::fixtures_dir().join("models").join(&reference.model),
        Some(fetch) => {
            // $POLY_WITNESS_MODELS names a folder that is used as it is; the default folder is the one
            // the fetch command fills, so only it is fetched into.
            let (dir, may_fetch) = match std::env::var_os("POLY_WITNESS_MODELS") {
                Some(d) => (PathBuf::from(d), false),
                // `bash tests/witness/fetch_X.sh OUT_DIR ...`: the models land in OUT_DIR.
                None => match fetch.split_whitespace().nth(2) {
                    Some(out) => (workspace_dir().join(out), true),
                    None => (workspace_dir().join("target").join("gemma3-270m"), true),
                },
            };
            let path = dir.join(&reference.model);
            if !path.is_file() && !may_fetch {
                return Err(format!(
                    "{} is missing (POLY_WITNESS_MODELS)",
                    path.display()
                ));
            }
            if !path.is_file() {
                eprintln!(
                    "witness: {} is missing; fetching it: {fetch}",
                    path.display()
                );
                let status = Command::new("bash")
                    .arg("-c")
                    .arg(fetch)
                    .current_dir(workspace_dir())
                    .status()
                    .map_err(|e| format!("could not run the fetch command `{fetch}`: {e}"))?;
                if !status.success() || !path.is_file() {
                    return Err(format!(
                        "could not fetch {} (`{fetch}` exited with {status})",
                        reference.model
                    ));
                }
            }
            path
        }
    };
    if verified.contains(&path) {
        return Ok(path);
    }
    let sha = sha256_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    if sha != reference.model_sha256 {
        return Err(format!(
            "{}: SHA-256 {sha} is not the {} the reference {} was made from (regenerate the references \
             with tests/witness/make_references.py)",
            path.display(),
            reference.model_sha256,
            reference.path.display()
        ));
    }
    verified.push(path.clone());
    Ok(path)
}

/// Our steps for one prompt, with how long the engine took and the tail of what it printed on stderr.
#[derive(Clone, Debug)]
pub struct EngineRun {
    pub steps: Vec<Step>,
    pub seconds: f64,
    pub stderr_tail: String,
}

/// Runs `binary run --model MODEL --prompt-tokens ... --max-tokens N --top ENGINE_TOP --json EXTRA...`
/// and parses its per-step JSON lines (module docs). `extra` lets a caller add options (a device).
pub fn run_engine_cli(
    binary: &Path,
    model: &Path,
    prompt: &[u32],
    max_tokens: usize,
    extra: &[&str],
) -> Result<EngineRun, String> {
    let ids = prompt
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let start = Instant::now();
    let out = Command::new(binary)
        .arg("run")
        .arg("--model")
        .arg(model)
        .arg("--prompt-tokens")
        .arg(&ids)
        .arg("--max-tokens")
        .arg(max_tokens.to_string())
        .arg("--top")
        .arg(ENGINE_TOP.to_string())
        .arg("--json")
        .args(extra)
        .output()
        .map_err(|e| format!("could not start {}: {e}", binary.display()))?;
    let seconds = start.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stderr_tail = tail(&stderr, 12);
    if !out.status.success() {
        // The first error line says why in one line (clap's and our CLI's "error: ..."); the tail follows.
        let why = stderr
            .lines()
            .find(|l| l.trim_start().to_ascii_lowercase().starts_with("error"))
            .or_else(|| stderr.lines().find(|l| !l.trim().is_empty()))
            .unwrap_or("(no stderr)")
            .trim();
        return Err(format!(
            "`poly-engine run` failed ({}): {why}\n{stderr_tail}",
            out.status
        ));
    }
    let steps = parse_steps(&String::from_utf8_lossy(&out.stdout))?;
    Ok(EngineRun {
        steps,
        seconds,
        stderr_tail,
    })
}

/// The steps in `stdout`: every line that is a JSON object with a `token` (module docs).
pub fn parse_steps(stdout: &str) -> Result<Vec<Step>, String> {
    let mut steps = Vec::new();
    for (n, line) in stdout.lines().enumerate() {
        let line = line.trim();
        if !line.starts_with('{') {
            continue;
        }
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if v.get("token").is_none() {
            continue;
        }
        steps.push(Step::from_json(&v).map_err(|e| format!("stdout line {}: {e}", n + 1))?);
    }
    Ok(steps)
}

fn tail(s: &str, lines: usize) -> String {
    let all: Vec<&str> = s.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_steps_keeps_step_lines_only() {
        let out =
            "loading model\n{\"event\":\"loaded\"}\n{\"token\":3,\"top\":[[3,0.7],[9,0.1]]}\n\
                   not json {\n{\"token\":9,\"top\":[{\"id\":9,\"p\":0.5}]}\n{\"done\":true}\n";
        let steps = parse_steps(out).unwrap();
        assert_eq!(steps.len(), 2);
        assert_eq!(
            steps[0],
            Step {
                token: 3,
                top: vec![(3, 0.7), (9, 0.1)]
            }
        );
        assert_eq!(steps[1].token, 9);
        assert!(parse_steps("{\"token\":1,\"top\":\"x\"}").is_err());
    }

    #[test]
    fn missing_binary_is_an_error_that_says_how_to_build_it() {
        let e = run_engine_cli(
            Path::new("/nonexistent/poly-engine"),
            Path::new("m"),
            &[1],
            1,
            &[],
        );
        assert!(e.is_err());
    }
}
