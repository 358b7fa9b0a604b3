//! `poly-engine --model FILE [its serving flags] --verify PROMPTS`: the configuration a model is served
//! with, judged against the CPU reference (issue 23's `polystrata verify`, which tokenizes the
//! repository's text and runs this).
//!
//! For every prompt (a line of token ids) the reference (this file on the CPU, batch-invariant orders,
//! the prompt read one token at a time) writes a greedy answer, and the candidate (the same flags as
//! serving: its device, expert placement, knobs, summation orders, attention caches and prompt calls)
//! writes the same tokens again (`--follow`'s forced tokens). Each step's KL divergence of the candidate
//! from the reference is taken over the whole vocabulary (not `poly-engine kl`'s estimate from top-40
//! lists, which overstates small divergences 3–4×), with the share of steps whose likeliest token is the
//! same. On the CPU with the default orders the two agree bit for bit (batch invariance); other
//! configurations differ by their arithmetic (figures at the bounds, `cli/mod.rs`). One JSON object on
//! stdout; exit status 1 when out of bounds.

use std::path::{Path, PathBuf};

use poly_engine::generate::{generate, GenerateOptions, Step};
use poly_engine::gpu::{DeviceChoice, Placement};
use poly_engine::model::Arithmetic;
use poly_engine::sample::{Sampler, SamplerConfig};
use poly_engine::{EngineError, Model};
use serde_json::json;

use super::CliResult;

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

/// One step of an answer: the token written and the whole distribution it was written from.
struct FullStep {
    token: u32,
    probs: Vec<f32>,
}

/// `model`'s answer to `prompt` (greedy, end tokens ignored; `follow` forces the tokens), with every
/// step's whole distribution.
fn answer(
    model: &Model,
    prompt: &[u32],
    (tokens, ubatch): (usize, usize),
    follow: Option<Vec<u32>>,
) -> Result<Vec<FullStep>, EngineError> {
    let n_vocab = model.info().n_vocab;
    let mut state = model.new_state(prompt.len() + tokens + 1);
    let opts = GenerateOptions {
        max_tokens: follow.as_ref().map_or(tokens, Vec::len),
        stop_tokens: Vec::new(),
        ubatch,
        top_n: n_vocab,
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
        |s: &Step| {
            let mut probs = vec![0f32; n_vocab];
            for &(t, lp) in &s.top {
                if let Some(p) = probs.get_mut(t as usize) {
                    *p = lp.exp();
                }
            }
            steps.push(FullStep {
                token: s.token,
                probs,
            })
        },
    )?;
    Ok(steps)
}

/// The KL divergence of `q` from `p` over the whole vocabulary (nats), and whether their likeliest
/// tokens are the same.
fn step_kl(p: &[f32], q: &[f32]) -> (f64, bool) {
    const FLOOR: f64 = 1e-30;
    let kl: f64 = p
        .iter()
        .zip(q)
        .filter(|(&pi, _)| pi > 0.0)
        .map(|(&pi, &qi)| {
            let (pi, qi) = (pi as f64, (qi as f64).max(FLOOR));
            pi * (pi / qi).ln()
        })
        .sum();
    let top = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
            .map(|(i, _)| i)
    };
    (kl.max(0.0), top(p) == top(q))
}

/// Mean and largest KL, and the share of steps with the same likeliest token.
fn figures(kls: &[(f64, bool)]) -> (f64, f64, f64) {
    let n = kls.len().max(1) as f64;
    let mean = kls.iter().map(|k| k.0).sum::<f64>() / n;
    let max = kls.iter().map(|k| k.0).fold(0.0, f64::max);
    let same = kls.iter().filter(|k| k.1).count() as f64 / n;
    (mean, max, same)
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
    let mut all = Vec::new();
    let mut per_prompt = Vec::new();
    pool.install(|| -> Result<(), EngineError> {
        for p in &prompts {
            let r = answer(&reference, p, (job.tokens, 1), None)?;
            let follow: Vec<u32> = r.iter().map(|s| s.token).collect();
            let c = answer(&candidate, p, (job.tokens, job.ubatch), Some(follow))?;
            if c.len() != r.len() || c.iter().zip(&r).any(|(a, b)| a.token != b.token) {
                return Err(EngineError(
                    "verify: the candidate did not write the reference's tokens".into(),
                ));
            }
            let kls: Vec<(f64, bool)> = r
                .iter()
                .zip(&c)
                .map(|(a, b)| step_kl(&a.probs, &b.probs))
                .collect();
            let (mean, max, same) = figures(&kls);
            per_prompt.push(json!({"prompt_tokens": p.len(), "steps": r.len(),
                                   "mean_kl": mean, "max_kl": max, "same_top": same}));
            all.extend(kls);
        }
        Ok(())
    })?;
    let (mean, max, same) = figures(&all);
    let pass = mean <= job.max_mean_kl && same >= job.min_same_top;
    println!(
        "{}",
        json!({"model": job.model, "reference": "cpu (BatchInvariant orders, the prompt token by token)", "candidate": described,
               "prompts": per_prompt, "steps": all.len(), "mean_kl": mean, "max_kl": max,
               "same_top": same, "max_mean_kl": job.max_mean_kl, "min_same_top": job.min_same_top,
               "pass": pass})
    );
    if !pass {
        return Err(EngineError(format!(
            "verify: {described} is out of bounds against the CPU reference: mean KL {mean:.3e} \
             (at most {:.1e}), same likeliest token in {:.1}% of {} steps (at least {:.1}%)",
            job.max_mean_kl,
            100.0 * same,
            all.len(),
            100.0 * job.min_same_top
        ))
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_divergence_is_taken_over_the_whole_vocabulary() {
        let p = [0.6f32, 0.3, 0.1, 0.0];
        assert_eq!(step_kl(&p, &p), (0.0, true));
        let q = [0.3f32, 0.6, 0.05, 0.05];
        let want = 0.6 * 2f64.ln() + 0.3 * 0.5f64.ln() + 0.1 * 2f64.ln();
        let (kl, same) = step_kl(&p, &q);
        assert!((kl - want).abs() < 1e-6, "{kl} against {want}");
        assert!(!same);
        // A token the candidate gives no mass costs a large but finite amount.
        let (kl, _) = step_kl(&p, &[0.6, 0.4, 0.0, 0.0]);
        assert!(kl.is_finite() && kl > 5.0, "{kl}");
        let (mean, max, same) = figures(&[(0.1, true), (0.3, false)]);
        assert!((mean - 0.2).abs() < 1e-12 && max == 0.3 && same == 0.5);
    }
}
