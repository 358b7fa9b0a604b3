//! `polystrata verify MODEL`: a user checks their own machine. The model's configuration as it is served
//! (its run config: device, expert placement, knobs) against the CPU reference, on a few prompts of the
//! repository's text tokenized with the model's tokenizer. The engine does the work (`poly-engine --verify`,
//! which writes each answer greedily on the CPU and again, token for token, in the served configuration,
//! and compares every step's distribution). This prints the figures and the bounds, and exits non-zero
//! when the configuration is out of them.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;

use serde_json::Value;

use crate::bench::prompts::BENCH_TEXT;
use crate::engine::process::engine_env;
use crate::model_text::ModelText;
use crate::registry::Registry;

/// What to verify.
pub struct VerifyOptions {
    /// The model (a registry id, alias or unique part of an id).
    pub model: String,
    /// Prompts, each `prompt_tokens` long, from places spread over the text.
    pub prompts: usize,
    pub prompt_tokens: usize,
    /// Tokens written per prompt.
    pub answer_tokens: usize,
    /// One JSON object on stdout (the engine's) instead of the summary.
    pub json: bool,
}

/// Where successive prompts start in the text (tokens; a prime, as the benchmark's long prompts).
const PROMPT_STEP: usize = 997;

/// `n` windows of `len` tokens of `text`, spread over it (fewer when the text is short).
fn windows(text: &[u32], n: usize, len: usize) -> Vec<Vec<u32>> {
    if text.len() < len || len == 0 {
        return Vec::new();
    }
    let room = text.len() - len + 1;
    (0..n)
        .map(|i| (i * PROMPT_STEP) % room)
        .map(|at| text[at..at + len].to_vec())
        .collect()
}

/// The prompts file the engine reads: one prompt a line, token ids separated by commas.
fn prompts_file(prompts: &[Vec<u32>]) -> Result<PathBuf, String> {
    let path = std::env::temp_dir().join(format!("polystrata-verify-{}.txt", std::process::id()));
    let mut f = std::fs::File::create(&path)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    for p in prompts {
        let line: Vec<String> = p.iter().map(u32::to_string).collect();
        writeln!(f, "{}", line.join(","))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(path)
}

/// Runs the check; the exit status says whether the model's configuration is within bounds.
pub fn run(registry: Arc<Registry>, opts: VerifyOptions) -> ExitCode {
    match verify(&registry, &opts) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("polystrata verify: {e}");
            ExitCode::FAILURE
        }
    }
}

fn verify(registry: &Registry, opts: &VerifyOptions) -> Result<bool, String> {
    let entry = registry
        .find(&opts.model)
        .map_err(|e| format!("{e}; {}", crate::home::home_read_note(registry.home())))?;
    let config = entry
        .config
        .as_ref()
        .ok_or_else(|| format!("model {} has no run config", entry.id))?;
    let text = ModelText::load(&entry)?;
    let tokens = text
        .encode(BENCH_TEXT)
        .map_err(|e| format!("cannot tokenize the text: {e}"))?;
    let prompts = windows(&tokens, opts.prompts, opts.prompt_tokens);
    if prompts.is_empty() {
        return Err(format!(
            "the text gives {} tokens under this tokenizer, fewer than a prompt of {}",
            tokens.len(),
            opts.prompt_tokens
        ));
    }
    let file = prompts_file(&prompts)?;
    eprintln!(
        "polystrata verify: {} as served ({}) against the CPU reference: {} prompts of {} tokens, {} \
         answer tokens each",
        entry.id,
        config.exe.display(),
        prompts.len(),
        opts.prompt_tokens,
        opts.answer_tokens
    );
    let out = Command::new(&config.exe)
        .args(&config.args)
        .arg("--verify")
        .arg(&file)
        .args(["--verify-tokens", &opts.answer_tokens.to_string()])
        .current_dir(&config.cwd)
        // As the server starts an engine: only the allow-list of the environment.
        .env_clear()
        .envs(engine_env(std::env::vars_os()))
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output();
    let _ = std::fs::remove_file(&file);
    let out = out.map_err(|e| format!("cannot start {}: {e}", config.exe.display()))?;
    let report: Value = serde_json::from_slice(&out.stdout).map_err(|_| {
        format!(
            "the engine gave no figures (exit status {}; its log is above)",
            out.status
        )
    })?;
    if opts.json {
        println!("{report}");
    } else {
        print!("{}", summary(&entry.id, &report));
    }
    Ok(out.status.success() && report["pass"] == Value::Bool(true))
}

/// The report as lines a person reads.
fn summary(id: &str, r: &Value) -> String {
    let num = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let mut s = format!(
        "{id}: {} against {}\n",
        r["candidate"].as_str().unwrap_or("?"),
        r["reference"].as_str().unwrap_or("?")
    );
    for (i, p) in r["prompts"].as_array().into_iter().flatten().enumerate() {
        s += &format!(
            "  prompt {}: {} steps, mean KL {:.2e}, largest {:.2e}, same likeliest token {:.1}%\n",
            i + 1,
            p["steps"],
            num(p, "mean_kl"),
            num(p, "max_kl"),
            100.0 * num(p, "same_top")
        );
    }
    let pass = r["pass"] == Value::Bool(true);
    s += &format!(
        "{}: mean KL {:.2e} (at most {:.1e}), same likeliest token {:.1}% (at least {:.1}%) over {} steps\n",
        if pass { "PASS" } else { "FAIL" },
        num(r, "mean_kl"),
        num(r, "max_mean_kl"),
        100.0 * num(r, "same_top"),
        100.0 * num(r, "min_same_top"),
        r["steps"]
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_spread_windows_of_the_text() {
        let text: Vec<u32> = (0..5000).collect();
        let w = windows(&text, 3, 64);
        assert_eq!(w.len(), 3);
        assert!(w.iter().all(|p| p.len() == 64));
        assert_eq!(w[0][0], 0);
        assert_eq!(w[1][0], 997);
        assert!(windows(&text[..10], 3, 64).is_empty());
        // A short text wraps around instead of running past its end.
        let short: Vec<u32> = (0..100).collect();
        assert!(windows(&short, 4, 64).iter().all(|p| p.len() == 64));
    }
}
