//! `poly-engine kl`: how far a configuration's answer is from a reference's, step by step (issue 23).
//!
//! Both files are `poly-engine run --json --top N` outputs; the candidate was written with `--follow
//! REFERENCE`, so both give a distribution at every step of the same tokens. Per step, the KL divergence
//! of the candidate from the reference over the reference's top-N tokens and the rest of the vocabulary
//! as one bin: the candidate's probability of a token outside its own top-N is its remaining mass spread
//! evenly over the tokens outside that list (llama.cpp's `--kl-divergence` reads whole distributions; a
//! top-40 list holds nearly all of the mass of a confident step, and this estimate is within a few
//! percent of the whole sum there). Also the share of steps whose likeliest token is the same.

use std::collections::HashMap;
use std::path::PathBuf;

use clap::Args;
use poly_engine::EngineError;
use serde_json::Value;

use super::CliResult;

#[derive(Args)]
pub struct KlArgs {
    /// The reference run (`poly-engine run --json --top 40`).
    reference: PathBuf,
    /// The run to judge (`poly-engine run --json --top 40 --follow REFERENCE`, another configuration).
    candidate: PathBuf,
    /// Fail (exit 1) when the mean KL exceeds this.
    #[arg(long, value_name = "NATS")]
    max_mean_kl: Option<f64>,
    /// Fail (exit 1) when fewer steps than this share have the same likeliest token.
    #[arg(long, value_name = "SHARE")]
    min_same_top: Option<f64>,
}

/// One step: the token written and the top list with probabilities.
#[derive(Debug, PartialEq)]
struct StepDist {
    token: u32,
    top: Vec<(u32, f64)>,
    n_vocab: usize,
}

fn read_steps(path: &PathBuf) -> Result<Vec<StepDist>, EngineError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| EngineError(format!("{}: {e}", path.display())))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            let bad =
                |what: &str| EngineError(format!("{} line {}: {what}", path.display(), i + 1));
            let v: Value = serde_json::from_str(l).map_err(|e| bad(&e.to_string()))?;
            let token = v["token"].as_u64().ok_or_else(|| bad("no token"))? as u32;
            let n_vocab = v["n_vocab"].as_u64().ok_or_else(|| bad("no n_vocab"))? as usize;
            let top = v["top"]
                .as_array()
                .ok_or_else(|| bad("no top list"))?
                .iter()
                .map(|e| {
                    Some((
                        u32::try_from(e["token"].as_u64()?).ok()?,
                        e["logprob"].as_f64()?.exp(),
                    ))
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("a top entry without token and logprob"))?;
            if top.is_empty() {
                return Err(bad("an empty top list"));
            }
            Ok(StepDist {
                token,
                top,
                n_vocab,
            })
        })
        .collect()
}

/// The KL divergence of `q` from `p` (nats) over `p`'s listed tokens and one bin for the rest.
fn step_kl(p: &StepDist, q: &StepDist) -> f64 {
    const FLOOR: f64 = 1e-10;
    let q_listed: HashMap<u32, f64> = q.top.iter().copied().collect();
    let q_rest = (1.0 - q.top.iter().map(|e| e.1).sum::<f64>()).max(0.0);
    let q_outside = q_rest / (q.n_vocab.saturating_sub(q.top.len()).max(1)) as f64;
    let mut kl = 0.0;
    let (mut p_sum, mut q_sum) = (0.0, 0.0);
    for &(t, pt) in &p.top {
        let qt = q_listed.get(&t).copied().unwrap_or(q_outside).max(FLOOR);
        if pt > 0.0 {
            kl += pt * (pt / qt).ln();
        }
        p_sum += pt;
        q_sum += qt;
    }
    let (p_rest, q_rest) = ((1.0 - p_sum).max(0.0), (1.0 - q_sum).max(FLOOR));
    if p_rest > 0.0 {
        kl += p_rest * (p_rest / q_rest).ln();
    }
    kl.max(0.0)
}

/// Mean and largest KL, and the share of steps with the same likeliest token.
fn compare(reference: &[StepDist], candidate: &[StepDist]) -> Result<(f64, f64, f64), EngineError> {
    if reference.len() != candidate.len() || reference.is_empty() {
        return Err(EngineError(format!(
            "{} reference steps and {} candidate steps: write the candidate with --follow REFERENCE",
            reference.len(),
            candidate.len()
        )));
    }
    if let Some(i) = (0..reference.len()).find(|&i| reference[i].token != candidate[i].token) {
        return Err(EngineError(format!(
            "step {i}: the candidate wrote {} where the reference wrote {} (--follow REFERENCE)",
            candidate[i].token, reference[i].token
        )));
    }
    let kls: Vec<f64> = reference
        .iter()
        .zip(candidate)
        .map(|(p, q)| step_kl(p, q))
        .collect();
    let same = reference
        .iter()
        .zip(candidate)
        .filter(|(p, q)| p.top[0].0 == q.top[0].0)
        .count();
    let mean = kls.iter().sum::<f64>() / kls.len() as f64;
    let max = kls.iter().copied().fold(0.0, f64::max);
    Ok((mean, max, same as f64 / reference.len() as f64))
}

pub fn run(args: KlArgs) -> CliResult {
    let (mean, max, same) = compare(&read_steps(&args.reference)?, &read_steps(&args.candidate)?)?;
    println!(
        "{}",
        serde_json::json!({"mean_kl": mean, "max_kl": max, "same_top": same})
    );
    let too_far = args.max_mean_kl.is_some_and(|m| mean > m);
    let too_different = args.min_same_top.is_some_and(|m| same < m);
    if too_far || too_different {
        return Err(EngineError(format!(
            "out of bounds: mean KL {mean:.3e} (at most {:?}), same top {same:.3} (at least {:?})",
            args.max_mean_kl, args.min_same_top
        ))
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dist(token: u32, top: &[(u32, f64)]) -> StepDist {
        StepDist {
            token,
            top: top.to_vec(),
            n_vocab: 100,
        }
    }

    #[test]
    fn the_same_distribution_is_zero_and_a_shifted_one_is_not() {
        let p = dist(1, &[(1, 0.6), (2, 0.3), (3, 0.05)]);
        assert!(step_kl(&p, &p).abs() < 1e-12);
        let q = dist(1, &[(2, 0.6), (1, 0.3), (3, 0.05)]);
        // 0.6 ln 2 + 0.3 ln 0.5 over the listed tokens, the rest bins equal.
        let want = 0.6 * 2f64.ln() + 0.3 * 0.5f64.ln();
        assert!((step_kl(&p, &q) - want).abs() < 1e-9, "{}", step_kl(&p, &q));
        let (mean, max, same) =
            compare(&[p, dist(2, &[(2, 0.9)])], &[q, dist(2, &[(2, 0.9)])]).expect("comparable");
        assert!((mean - want / 2.0).abs() < 1e-9 && (max - want).abs() < 1e-9);
        assert_eq!(same, 0.5);
    }

    #[test]
    fn a_token_outside_the_candidates_list_takes_its_spread_rest() {
        let p = dist(1, &[(1, 0.5), (9, 0.5)]);
        let q = dist(1, &[(1, 0.9)]);
        // Token 9 gets 0.1 / 99 of the candidate's mass.
        let want = 0.5 * (0.5f64 / 0.9).ln() + 0.5 * (0.5f64 / (0.1 / 99.0)).ln();
        assert!((step_kl(&p, &q) - want).abs() < 1e-9);
    }

    #[test]
    fn runs_of_other_tokens_are_refused() {
        let a = [dist(1, &[(1, 1.0)])];
        let b = [dist(2, &[(2, 1.0)])];
        assert!(compare(&a, &b).is_err());
        assert!(compare(&a, &[]).is_err());
    }
}
