//! The witness runner the CPU and GPU witness tests share: every committed llama.cpp reference
//! (tests/fixtures/references/*.json) run through our engine and judged by `poly_tests::witness`'s rule.
//! Environment: `POLY_ENGINE` names the engine binary (locations only: README.md's table).

#![allow(dead_code)] // each test file uses its part

use std::collections::BTreeMap;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::Instant;

use poly_engine::generate::{generate, GenerateOptions, DEFAULT_UBATCH};
use poly_engine::gpu::DeviceChoice;
use poly_engine::sample::{Sampler, SamplerConfig};
use poly_engine::Model;
use poly_tests::witness::{
    compare, ensure_model, load_references, run_engine_cli, table_header, table_row, Reference,
    Rule, Step, ENGINE_TOP,
};

pub fn selected(r: &Reference, only: &[String]) -> bool {
    only.is_empty()
        || only
            .iter()
            .any(|o| r.model.contains(o.as_str()) || r.prompt_name.contains(o.as_str()))
}

/// Pure argmax: no temperature, truncation or penalties (llama.cpp's reference is the argmax of its
/// logits).
fn greedy() -> SamplerConfig {
    SamplerConfig {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        ..SamplerConfig::greedy()
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "(no message)".into())
}

/// Where our steps come from.
pub enum Engine {
    /// The poly-engine library in this process, on `device`.
    Library,
    /// `poly-engine run --json` (the binary chooses its device).
    Cli(PathBuf),
}

/// One model on our side: loaded once for its references (library) or a file path (CLI).
enum Loaded {
    Library(Box<Model>),
    Cli(PathBuf, PathBuf),
}

impl Engine {
    /// From `$POLY_ENGINE` (the binary) or the library.
    pub fn from_env() -> Engine {
        match std::env::var_os("POLY_ENGINE") {
            Some(bin) => Engine::Cli(PathBuf::from(bin)),
            None => Engine::Library,
        }
    }

    fn load(&self, path: &Path, device: DeviceChoice) -> Result<Loaded, String> {
        match self {
            Engine::Cli(bin) => Ok(Loaded::Cli(bin.clone(), path.to_owned())),
            Engine::Library => catch_unwind(|| {
                let mut model = Model::load(path)?;
                model.use_device(device)?;
                Ok::<_, poly_engine::EngineError>(model)
            })
            .map_err(|p| {
                format!(
                    "poly-engine panicked loading the model: {}",
                    panic_message(p)
                )
            })?
            .map(|m| Loaded::Library(Box::new(m)))
            .map_err(|e| format!("poly-engine cannot load the model: {e}")),
        }
    }
}

impl Loaded {
    /// Our steps for `r`'s prompt, and the seconds they took.
    fn run(&self, r: &Reference) -> Result<(Vec<Step>, f64), String> {
        let start = Instant::now();
        let steps = match self {
            Loaded::Cli(bin, model) => {
                let extra = ["--ignore-eos", "--n-ctx", &r.n_ctx.to_string()].map(String::from);
                let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
                run_engine_cli(bin, model, &r.prompt, r.steps.len(), &extra)?.steps
            }
            Loaded::Library(model) => {
                let opts = GenerateOptions {
                    max_tokens: r.steps.len(),
                    // llama.cpp's reference does not stop on end-of-generation tokens either.
                    stop_tokens: Vec::new(),
                    ubatch: DEFAULT_UBATCH,
                    top_n: ENGINE_TOP,
                    follow: None,
                };
                let run = catch_unwind(AssertUnwindSafe(|| {
                    let mut state = model.new_state(r.n_ctx as usize);
                    let mut sampler = Sampler::new(greedy());
                    generate(model, &mut state, &r.prompt, &opts, &mut sampler, |_| {})
                }))
                .map_err(|p| format!("poly-engine panicked: {}", panic_message(p)))?
                .map_err(|e| format!("poly-engine failed: {e}"))?;
                run.steps
                    .iter()
                    .map(|s| Step {
                        token: s.token,
                        top: s
                            .top
                            .iter()
                            .map(|&(t, lp)| (t, f64::from(lp).exp()))
                            .collect(),
                    })
                    .collect()
            }
        };
        Ok((steps, start.elapsed().as_secs_f64()))
    }
}

/// What one witness run found.
pub struct WitnessRun {
    pub passed: usize,
    /// One line per failed reference; empty when every reference was accepted.
    pub failures: Vec<String>,
    /// Models not committed and not fetchable here (the real Gemma without network).
    pub skipped: Vec<String>,
}

/// Our own CPU engine as the reference (the GPU's second check): models loaded once each.
pub struct CpuReference {
    models: std::sync::Mutex<BTreeMap<PathBuf, std::sync::Arc<Loaded>>>,
}

impl CpuReference {
    pub fn new() -> CpuReference {
        CpuReference {
            models: std::sync::Mutex::new(BTreeMap::new()),
        }
    }

    fn get(&self, path: &Path) -> Result<std::sync::Arc<Loaded>, String> {
        let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = models.get(path) {
            return Ok(m.clone());
        }
        let m = std::sync::Arc::new(Engine::Library.load(path, DeviceChoice::Cpu)?);
        models.insert(path.to_owned(), m.clone());
        Ok(m)
    }
}

/// Runs every reference of `refs_dir` (narrowed by `WITNESS_ONLY`) through `engine` on `device` and applies
/// `rule` against llama.cpp's steps, or, with `against_cpu`, against our own CPU engine's steps on the same
/// prompt. Prints one table per model to stderr, headed by `name`.
pub fn run_witness(
    name: &str,
    engine: &Engine,
    device: DeviceChoice,
    rule: Rule,
    against_cpu: Option<&CpuReference>,
    refs_dir: &Path,
) -> WitnessRun {
    let refs = load_references(refs_dir).expect("references load");
    assert!(!refs.is_empty(), "no references in {}", refs_dir.display());
    let only: Vec<String> = std::env::var("WITNESS_ONLY")
        .map(|s| {
            s.split(',')
                .filter(|x| !x.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();

    let mut by_model: BTreeMap<String, Vec<&Reference>> = BTreeMap::new();
    for r in refs.iter().filter(|r| selected(r, &only)) {
        by_model.entry(r.model.clone()).or_default().push(r);
    }

    let mut verified = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut skipped: Vec<String> = Vec::new();
    let mut passed = 0usize;
    let mut report = String::new();

    for (model, group) in &by_model {
        let first = group[0];
        report += &format!(
            "\n{model} ({}; reference: {})\n",
            first.arch, first.llama_cpp
        );
        let path = match ensure_model(first, &mut verified) {
            Ok(p) => p,
            Err(e) if first.model_fetch.is_some() => {
                let msg = format!(
                    "\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n\
                     !!! SKIPPED {} witness references of {model}: the model is not committed and\n\
                     !!! could not be fetched: {e}\n\
                     !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!",
                    group.len()
                );
                let _ = writeln!(std::io::stderr(), "{msg}");
                report += &format!("  SKIPPED: {e}\n");
                skipped.push(model.clone());
                continue;
            }
            Err(e) => {
                report += &format!("  FAIL: {e}\n");
                failures.push(format!("{model}: {e}"));
                continue;
            }
        };
        let loaded = match engine.load(&path, device) {
            Ok(l) => l,
            Err(e) => {
                report += &format!("  FAIL ({} references): {e}\n", group.len());
                failures.extend(group.iter().map(|r| format!("{}: {e}", r.label())));
                continue;
            }
        };
        report += &table_header();
        report.push('\n');
        for r in group {
            // Our steps, and the steps they are judged against: llama.cpp's, or our CPU engine's.
            let runs = loaded.run(r).and_then(|(steps, seconds)| {
                let reference = match against_cpu {
                    Some(cpu) => cpu.get(&path)?.run(r)?.0,
                    None => r.steps.clone(),
                };
                Ok((steps, seconds, reference))
            });
            match runs {
                Ok((steps, seconds, reference)) => {
                    let c = compare(&reference, &steps, &r.eog, rule);
                    report += &table_row(&r.prompt_name, r.prompt.len(), &c, Some(seconds));
                    if c.passed() {
                        passed += 1;
                    } else {
                        failures.push(format!("{}: {}", r.label(), c.failures.join("; ")));
                    }
                }
                Err(e) => {
                    let first_line = e.lines().next().unwrap_or("").to_owned();
                    report += &format!(
                        "  {:<12} FAIL: our engine could not run it: {e}\n",
                        r.prompt_name
                    );
                    failures.push(format!("{}: {first_line}", r.label()));
                }
            }
        }
    }

    let total = by_model.values().map(Vec::len).sum::<usize>();
    report += &format!(
        "\n{name}: {passed} of {total} references accepted, {} failed, {} models skipped ({})\n",
        failures.len(),
        skipped.len(),
        skipped.join(", ")
    );
    // Written to the stderr handle, not through eprintln!, which the test harness captures: the table is
    // wanted in every run, passing or not.
    let _ = std::io::stderr().write_all(report.as_bytes());
    WitnessRun {
        passed,
        failures,
        skipped,
    }
}
