//! `poly-engine --model FILE [its serving flags] --verify PROMPTS`: the configuration a model is served
//! with, judged against the CPU reference (issue 23's `polystrata verify`, which tokenizes the
//! repository's text and runs this).
//!
//! For every prompt (a line of token ids) the reference (this file on the CPU, batch-invariant orders,
//! the prompt read one token at a time) writes a greedy answer, and the candidate (the same flags as
//! serving: its device, expert placement, knobs, summation orders and prompt calls) writes the same
//! tokens again (`--follow`'s forced tokens), both reporting the 40 likeliest tokens at every step. The
//! figures are `poly-engine kl`'s: mean and largest KL of the candidate from the reference, and the share
//! of steps with the same likeliest token. On the CPU with the default orders the two must agree bit for
//! bit (batch invariance); with `--llama-orders` they differ by llama.cpp's own spread between a prompt
//! read in one call and token by token (measured: mean KL 0.02–0.03 on SmolLM2 and Gemma 3 270M); on a
//! card by the card's arithmetic. One JSON object on stdout; exit status 1 when out of bounds.

use std::path::{Path, PathBuf};

use poly_engine::generate::{generate, GenerateOptions, Step};
use poly_engine::gpu::{DeviceChoice, Placement};
use poly_engine::model::Arithmetic;
use poly_engine::sample::{Sampler, SamplerConfig};
use poly_engine::{EngineError, Model};
use serde_json::json;

use super::kl::{compare, StepDist};
use super::CliResult;

/// Likeliest tokens recorded per step (as `run --top 40`).
const TOP_N: usize = 40;

/// What `--verify` checks and against what bounds.
pub struct VerifyJob {
    pub model: PathBuf,
    pub prompts: PathBuf,
    /// Tokens written per prompt.
    pub tokens: usize,
    pub device: DeviceChoice,
    pub placement: Placement,
    pub arithmetic: Arithmetic,
    /// The attention caches' precision as served (`--kv`).
    pub kv: poly_engine::state::KvPrecision,
    pub threads: Option<usize>,
    pub ubatch: usize,
    pub max_mean_kl: f64,
    pub min_same_top: f64,
}

/// Prompts of `path`: one per non-empty line, token ids separated by commas or white space.
fn read_prompts(path: &Path, n_vocab: usize) -> Result<Vec<Vec<u32>>, EngineError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| EngineError(format!("--verify {}: {e}", path.display())))?;
    let prompts: Vec<Vec<u32>> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            l.split(|c: char| c == ',' || c.is_whitespace())
                .filter(|p| !p.is_empty())
                .map(|p| match p.parse::<u32>() {
                    Ok(t) if (t as usize) < n_vocab => Ok(t),
                    _ => Err(EngineError(format!(
                        "--verify {} line {}: {p:?} is not a token id of this model",
                        path.display(),
                        i + 1
                    ))),
                })
                .collect()
        })
        .collect::<Result<_, _>>()?;
    if prompts.is_empty() {
        return Err(EngineError(format!(
            "--verify {}: no prompts",
            path.display()
        )));
    }
    Ok(prompts)
}

/// `model`'s answer to `prompt` (greedy, end tokens ignored; `follow` forces the tokens), each step's
/// distribution as `kl` reads it.
fn answer(
    model: &Model,
    prompt: &[u32],
    (tokens, ubatch): (usize, usize),
    follow: Option<Vec<u32>>,
) -> Result<Vec<StepDist>, EngineError> {
    let n_vocab = model.info().n_vocab;
    let mut state = model.new_state(prompt.len() + tokens + 1);
    let opts = GenerateOptions {
        max_tokens: follow.as_ref().map_or(tokens, Vec::len),
        stop_tokens: Vec::new(),
        ubatch,
        top_n: TOP_N,
        follow,
    };
    let mut sampler = Sampler::new(SamplerConfig::greedy());
    let mut steps = Vec::new();
    generate(
        model,
        &mut state,
        prompt,
        &opts,
        &mut sampler,
        |s: &Step| steps.push(StepDist::from_step(s, n_vocab)),
    )?;
    Ok(steps)
}

pub fn run(job: VerifyJob) -> CliResult {
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(n) = job.threads {
        pool = pool.num_threads(n);
    }
    let pool = pool.build()?;
    let reference = Model::load(&job.model)?.with_arithmetic(Arithmetic::BatchInvariant);
    let mut candidate = Model::load(&job.model)?
        .with_arithmetic(job.arithmetic)
        .with_kv(job.kv)?;
    candidate.use_device_with(job.device, &job.placement)?;
    let described = format!(
        "{} ({:?} orders, {} attention caches, prompt calls of up to {} tokens)",
        candidate.device_name(),
        job.arithmetic,
        job.kv.name(),
        job.ubatch
    );
    eprintln!("verify: the CPU reference against {described}");
    let prompts = read_prompts(&job.prompts, reference.info().n_vocab)?;
    let (mut all_ref, mut all_cand) = (Vec::new(), Vec::new());
    let mut per_prompt = Vec::new();
    pool.install(|| -> Result<(), EngineError> {
        for p in &prompts {
            let r = answer(&reference, p, (job.tokens, 1), None)?;
            let follow: Vec<u32> = r.iter().map(|s| s.token).collect();
            let c = answer(&candidate, p, (job.tokens, job.ubatch), Some(follow))?;
            let (mean, max, same) = compare(&r, &c)?;
            per_prompt.push(json!({"prompt_tokens": p.len(), "steps": r.len(),
                                   "mean_kl": mean, "max_kl": max, "same_top": same}));
            all_ref.extend(r);
            all_cand.extend(c);
        }
        Ok(())
    })?;
    let (mean, max, same) = compare(&all_ref, &all_cand)?;
    let pass = mean <= job.max_mean_kl && same >= job.min_same_top;
    println!(
        "{}",
        json!({"model": job.model, "reference": "cpu (BatchInvariant orders, the prompt token by token)", "candidate": described,
               "prompts": per_prompt, "steps": all_ref.len(), "mean_kl": mean, "max_kl": max,
               "same_top": same, "max_mean_kl": job.max_mean_kl, "min_same_top": job.min_same_top,
               "pass": pass})
    );
    if !pass {
        return Err(EngineError(format!(
            "verify: {described} is out of bounds against the CPU reference: mean KL {mean:.3e} \
             (at most {:.1e}), same likeliest token in {:.1}% of {} steps (at least {:.1}%)",
            job.max_mean_kl,
            100.0 * same,
            all_ref.len(),
            100.0 * job.min_same_top
        ))
        .into());
    }
    Ok(())
}
