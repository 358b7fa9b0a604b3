//! The llama.cpp witness: references recorded by `tests/witness/make_references.py` (llama.cpp's greedy
//! tokens and top-5 probabilities, step by step), the acceptance rule that compares an engine's run with
//! one, and the table that reports it. The CPU harness (`tests/tests/witness_cpu.rs`) and later the GPU
//! check share this module; only the way they obtain "our" steps differs.
//!
//! The acceptance rule: our greedy tokens equal llama.cpp's up to the first step where llama.cpp's two
//! likeliest tokens are within [`Rule::near_tie`] (a near tie; from that step on a different token is no
//! fault), and at every compared step each of llama.cpp's five probabilities differs from ours for the same
//! token id by at most [`Rule::max_prob_diff`]. A step is compared while both runs have produced the same
//! tokens before it (the same context); after the first different token the contexts differ and the
//! comparison ends.

mod engine;
pub mod picture;
mod sha256;

pub use engine::{
    engine_binary, ensure_model, run_engine_cli, workspace_dir, EngineRun, ENGINE_TOP,
};
pub use sha256::{sha256_file, sha256_hex, Sha256};

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// One generation step: the chosen token and the likeliest tokens with their probabilities, likeliest
/// first.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub token: u32,
    pub top: Vec<(u32, f64)>,
}

impl Step {
    /// The probability this step lists for `id`, if `id` is among its likeliest.
    pub fn prob_of(&self, id: u32) -> Option<f64> {
        self.top.iter().find(|(t, _)| *t == id).map(|(_, p)| *p)
    }

    /// Likeliest minus second likeliest probability (the whole first probability if only one is listed).
    pub fn gap(&self) -> f64 {
        match self.top.as_slice() {
            [] => 0.0,
            [(_, p)] => *p,
            [(_, p1), (_, p2), ..] => p1 - p2,
        }
    }

    /// The smallest probability listed (an upper bound on every unlisted token's probability).
    fn smallest_listed(&self) -> f64 {
        self.top
            .iter()
            .map(|(_, p)| *p)
            .fold(f64::INFINITY, f64::min)
    }

    /// Parses `{"token": id, "top": [...]}`; `top` entries are `[id, prob]` pairs or objects with the id
    /// under `id` or `token` and the probability under `p`, `prob` or `probability`.
    pub fn from_json(v: &Value) -> Result<Step, String> {
        let token = as_u32(v.get("token")).ok_or("step without an integer \"token\"")?;
        let entries = v
            .get("top")
            .and_then(Value::as_array)
            .ok_or("step without a \"top\" array")?;
        let mut top = Vec::with_capacity(entries.len());
        for e in entries {
            let pair = match e {
                Value::Array(a) if a.len() == 2 => (as_u32(a.first()), a[1].as_f64()),
                Value::Object(o) => (
                    as_u32(o.get("id").or_else(|| o.get("token"))),
                    ["p", "prob", "probability"]
                        .iter()
                        .find_map(|k| o.get(*k))
                        .and_then(Value::as_f64),
                ),
                _ => (None, None),
            };
            match pair {
                (Some(id), Some(p)) if p.is_finite() => top.push((id, p)),
                _ => return Err(format!("bad \"top\" entry {e}")),
            }
        }
        Ok(Step { token, top })
    }
}

fn as_u32(v: Option<&Value>) -> Option<u32> {
    v.and_then(Value::as_u64)
        .and_then(|x| u32::try_from(x).ok())
}

/// One reference file: a model, a prompt and llama.cpp's 64 greedy steps.
#[derive(Clone, Debug)]
pub struct Reference {
    /// The JSON file it was read from.
    pub path: PathBuf,
    /// The model's file name (fixtures: in `tests/fixtures/models/`).
    pub model: String,
    pub model_sha256: String,
    pub model_bytes: u64,
    /// For a model that is not committed: the shell command (run in the workspace root) that fetches it.
    pub model_fetch: Option<String>,
    pub arch: String,
    /// llama.cpp's version, as the generator wrote it.
    pub llama_cpp: String,
    pub prompt_name: String,
    /// Every token id llama.cpp decoded before the first step (BOS included where it was added).
    pub prompt: Vec<u32>,
    pub n_ctx: u32,
    /// The end-of-generation token ids of the model's vocabulary.
    pub eog: Vec<u32>,
    pub steps: Vec<Step>,
}

impl Reference {
    /// Reads and checks one reference file.
    pub fn load(path: &Path) -> Result<Reference, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::from_json(&v, path).map_err(|e| format!("{}: {e}", path.display()))
    }

    fn from_json(v: &Value, path: &Path) -> Result<Reference, String> {
        let s = |k: &str| -> Result<String, String> {
            v.get(k)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or(format!("no string \"{k}\""))
        };
        let ids = |k: &str| -> Result<Vec<u32>, String> {
            v.get(k)
                .and_then(Value::as_array)
                .ok_or(format!("no array \"{k}\""))?
                .iter()
                .map(|x| as_u32(Some(x)).ok_or(format!("bad id in \"{k}\"")))
                .collect()
        };
        if v.get("format").and_then(Value::as_u64) != Some(1) {
            return Err("unknown \"format\" (expected 1)".into());
        }
        let steps = v
            .get("steps")
            .and_then(Value::as_array)
            .ok_or("no array \"steps\"")?
            .iter()
            .enumerate()
            .map(|(i, s)| Step::from_json(s).map_err(|e| format!("step {i}: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        let r = Reference {
            path: path.to_owned(),
            model: s("model")?,
            model_sha256: s("model_sha256")?,
            model_bytes: v
                .get("model_bytes")
                .and_then(Value::as_u64)
                .ok_or("no \"model_bytes\"")?,
            model_fetch: v
                .get("model_fetch")
                .and_then(Value::as_str)
                .map(str::to_owned),
            arch: s("arch")?,
            llama_cpp: s("llama_cpp")?,
            prompt_name: s("prompt_name")?,
            prompt: ids("prompt")?,
            n_ctx: v
                .get("n_ctx")
                .and_then(Value::as_u64)
                .and_then(|x| u32::try_from(x).ok())
                .ok_or("no \"n_ctx\"")?,
            eog: ids("eog")?,
            steps,
        };
        r.check()?;
        Ok(r)
    }

    /// What must hold in every reference the generator writes.
    fn check(&self) -> Result<(), String> {
        if self.prompt.is_empty() || self.steps.is_empty() {
            return Err("empty prompt or no steps".into());
        }
        if self.prompt.len() + self.steps.len() > self.n_ctx as usize {
            return Err("prompt and steps exceed n_ctx".into());
        }
        for (i, st) in self.steps.iter().enumerate() {
            if st.top.len() < 2 {
                return Err(format!("step {i}: fewer than two likeliest tokens"));
            }
            if st.top[0].0 != st.token {
                return Err(format!(
                    "step {i}: the chosen token is not the likeliest (greedy)"
                ));
            }
            let sorted = st.top.windows(2).all(|w| w[0].1 >= w[1].1);
            let in_range = st.top.iter().all(|(_, p)| (0.0..=1.0).contains(p));
            let sum: f64 = st.top.iter().map(|(_, p)| p).sum();
            if !sorted || !in_range || sum > 1.0 + 1e-5 {
                return Err(format!(
                    "step {i}: top probabilities not sorted, out of [0,1] or sum > 1"
                ));
            }
        }
        Ok(())
    }

    /// `model / prompt`, for messages.
    pub fn label(&self) -> String {
        format!("{} / {}", self.model, self.prompt_name)
    }
}

/// Every `*.json` reference directly in `dir`, sorted by model, then prompt length.
pub fn load_references(dir: &Path) -> Result<Vec<Reference>, String> {
    let mut refs = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.extension().is_some_and(|x| x == "json") {
            refs.push(Reference::load(&path)?);
        }
    }
    refs.sort_by(|a, b| (&a.model, a.prompt.len()).cmp(&(&b.model, b.prompt.len())));
    Ok(refs)
}

/// The committed references: `tests/fixtures/references/`.
pub fn references_dir() -> PathBuf {
    crate::fixtures_dir().join("references")
}

/// The thresholds of the acceptance rule.
#[derive(Clone, Copy, Debug)]
pub struct Rule {
    /// llama.cpp's two likeliest within this: a near tie, after which tokens may differ.
    pub near_tie: f64,
    /// The largest allowed |llama.cpp's probability − ours| for one of llama.cpp's five token ids.
    pub max_prob_diff: f64,
}

impl Default for Rule {
    fn default() -> Self {
        Rule {
            near_tie: 0.02,
            max_prob_diff: 0.02,
        }
    }
}

/// The first step where our token is not llama.cpp's, with both tokens' probabilities on both sides.
#[derive(Clone, Debug, PartialEq)]
pub struct Departure {
    pub step: usize,
    pub llama_token: u32,
    pub our_token: u32,
    /// llama.cpp's probability of its own token and of ours (None: ours not in its top five).
    pub llama_p: (f64, Option<f64>),
    /// Our probability of llama.cpp's token (None: not in our list) and of our own token.
    pub our_p: (Option<f64>, f64),
    /// Whether llama.cpp had seen a near tie at or before this step (then the departure is allowed).
    pub allowed: bool,
}

/// The outcome of comparing one run with one reference.
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    /// Steps in the reference.
    pub steps: usize,
    /// Steps our run produced.
    pub our_steps: usize,
    /// Leading steps where our token equals llama.cpp's.
    pub same_tokens: usize,
    /// llama.cpp's first near tie.
    pub first_near_tie: Option<usize>,
    /// Steps whose probabilities were compared (those with the same context in both runs).
    pub compared_steps: usize,
    /// Largest |llama.cpp − ours| over llama.cpp's five tokens of every compared step.
    pub max_prob_diff: f64,
    /// Where `max_prob_diff` was seen: (step, token id).
    pub max_diff_at: Option<(usize, u32)>,
    /// llama.cpp top-five ids missing from our list (their difference counts as at least
    /// llama.cpp's probability minus our smallest listed one).
    pub missing_ids: usize,
    pub departure: Option<Departure>,
    /// Our run ended early on an end-of-generation token.
    pub stopped_on_eog: bool,
    /// Every broken rule, in words; empty when the run is accepted.
    pub failures: Vec<String>,
}

impl Comparison {
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// Applies the acceptance rule to our steps `ours` against llama.cpp's `reference` steps. `eog` lists
/// the end-of-generation ids (a run may stop on one of them).
pub fn compare(reference: &[Step], ours: &[Step], eog: &[u32], rule: Rule) -> Comparison {
    let first_near_tie = reference.iter().position(|s| s.gap() < rule.near_tie);
    let mut c = Comparison {
        steps: reference.len(),
        our_steps: ours.len(),
        same_tokens: 0,
        first_near_tie,
        compared_steps: 0,
        max_prob_diff: 0.0,
        max_diff_at: None,
        missing_ids: 0,
        departure: None,
        stopped_on_eog: false,
        failures: Vec::new(),
    };
    for (i, lref) in reference.iter().enumerate() {
        let Some(our) = ours.get(i) else {
            let last_is_eog = i > 0 && eog.contains(&ours[i - 1].token);
            if last_is_eog {
                c.stopped_on_eog = true;
            } else {
                c.failures.push(format!(
                    "our run ended after {} of {} steps",
                    ours.len(),
                    c.steps
                ));
            }
            break;
        };
        c.compared_steps += 1;
        for &(id, p) in &lref.top {
            let diff = match our.prob_of(id) {
                Some(q) => (p - q).abs(),
                None => {
                    c.missing_ids += 1;
                    (p - our.smallest_listed()).max(0.0)
                }
            };
            if diff > c.max_prob_diff || c.max_diff_at.is_none() {
                c.max_prob_diff = diff;
                c.max_diff_at = Some((i, id));
            }
        }
        if our.token != lref.token {
            let allowed = first_near_tie.is_some_and(|t| t <= i);
            c.departure = Some(Departure {
                step: i,
                llama_token: lref.token,
                our_token: our.token,
                llama_p: (
                    lref.prob_of(lref.token).unwrap_or(0.0),
                    lref.prob_of(our.token),
                ),
                our_p: (
                    our.prob_of(lref.token),
                    our.prob_of(our.token).unwrap_or(0.0),
                ),
                allowed,
            });
            if !allowed {
                c.failures.push(format!(
                    "step {i}: our token {} differs from llama.cpp's {} before any near tie",
                    our.token, lref.token
                ));
            }
            break;
        }
        c.same_tokens += 1;
    }
    if c.max_prob_diff > rule.max_prob_diff {
        if let Some((step, id)) = c.max_diff_at {
            c.failures.push(format!(
                "step {step}: probability of token {id} differs by {:.4} (> {})",
                c.max_prob_diff, rule.max_prob_diff
            ));
        }
    }
    c
}

fn fmt_p(p: Option<f64>) -> String {
    p.map_or("(not listed)".into(), |p| format!("{p:.4}"))
}

/// The header of [`table_row`]'s table.
pub fn table_header() -> String {
    format!(
        "  {:<12} {:>8} {:>20} {:>10} {:>9} {:>30} {:>8}  {}",
        "prompt",
        "tokens",
        "same tokens (of 64)",
        "near tie",
        "compared",
        "largest prob. difference",
        "time",
        "result"
    )
}

/// One table row (plus lines for the departure, if any, and every failure) for one reference; `seconds`
/// is how long our run took, if known.
pub fn table_row(
    prompt_name: &str,
    prompt_len: usize,
    c: &Comparison,
    seconds: Option<f64>,
) -> String {
    let mut s = String::new();
    let at = c
        .max_diff_at
        .map_or(String::new(), |(st, id)| format!(" (step {st}, id {id})"));
    let _ = writeln!(
        s,
        "  {:<12} {:>8} {:>20} {:>10} {:>9} {:>30} {:>8}  {}",
        prompt_name,
        prompt_len,
        format!("{} of {}", c.same_tokens, c.steps),
        c.first_near_tie.map_or("-".into(), |t| format!("step {t}")),
        c.compared_steps,
        format!("{:.4}{at}", c.max_prob_diff),
        seconds.map_or("-".into(), |t| format!("{t:.1} s")),
        if c.passed() { "ok" } else { "FAIL" }
    );
    if let Some(d) = &c.departure {
        let _ = writeln!(
            s,
            "      departure at step {} ({}): llama.cpp {} p={:.4}, {} p={}  |  ours {} p={}, {} p={:.4}",
            d.step,
            if d.allowed { "after a near tie: allowed" } else { "before any near tie" },
            d.llama_token,
            d.llama_p.0,
            d.our_token,
            fmt_p(d.llama_p.1),
            d.llama_token,
            fmt_p(d.our_p.0),
            d.our_token,
            d.our_p.1
        );
    }
    if c.missing_ids > 0 {
        let _ = writeln!(
            s,
            "      {} of llama.cpp's top-5 ids were not in our list",
            c.missing_ids
        );
    }
    if c.stopped_on_eog {
        let _ = writeln!(s, "      our run stopped on an end-of-generation token");
    }
    for f in &c.failures {
        let _ = writeln!(s, "      FAIL: {f}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(token: u32, top: &[(u32, f64)]) -> Step {
        Step {
            token,
            top: top.to_vec(),
        }
    }

    /// A reference of `n` confident steps (token i, p 0.6; runner-up 1000+i, p 0.2).
    fn confident(n: usize) -> Vec<Step> {
        (0..n as u32)
            .map(|i| {
                step(
                    i,
                    &[
                        (i, 0.6),
                        (1000 + i, 0.2),
                        (2000, 0.05),
                        (2001, 0.04),
                        (2002, 0.03),
                    ],
                )
            })
            .collect()
    }

    #[test]
    fn identical_runs_pass_with_every_step_compared() {
        let r = confident(64);
        let c = compare(&r, &r, &[], Rule::default());
        assert!(c.passed(), "{:?}", c.failures);
        assert_eq!(
            (c.same_tokens, c.compared_steps, c.max_prob_diff),
            (64, 64, 0.0)
        );
        assert_eq!(c.first_near_tie, None);
    }

    #[test]
    fn small_probability_drift_passes_and_large_fails() {
        let r = confident(8);
        let mut ours = r.clone();
        ours[3].top[1].1 += 0.015;
        let c = compare(&r, &ours, &[], Rule::default());
        assert!(c.passed());
        assert!((c.max_prob_diff - 0.015).abs() < 1e-12);
        assert_eq!(c.max_diff_at, Some((3, 1003)));
        ours[5].top[0].1 -= 0.03;
        let c = compare(&r, &ours, &[], Rule::default());
        assert!(!c.passed());
        assert_eq!(c.max_diff_at, Some((5, 5)));
    }

    #[test]
    fn different_token_before_a_near_tie_fails() {
        let r = confident(10);
        let mut ours = r.clone();
        ours[4] = step(1004, &[(1004, 0.6), (4, 0.59)]);
        let c = compare(&r, &ours, &[], Rule::default());
        assert!(!c.passed());
        assert_eq!(c.same_tokens, 4);
        let d = c.departure.expect("departure");
        assert_eq!(
            (d.step, d.llama_token, d.our_token, d.allowed),
            (4, 4, 1004, false)
        );
        assert_eq!(d.llama_p, (0.6, Some(0.2)));
        assert_eq!(d.our_p, (Some(0.59), 0.6));
    }

    #[test]
    fn different_token_at_or_after_a_near_tie_is_allowed_and_ends_the_comparison() {
        let mut r = confident(10);
        r[2] = step(2, &[(2, 0.41), (1002, 0.40), (7, 0.1)]);
        let mut ours = r.clone();
        // The other side of the near tie: allowed, and the comparison stops there.
        ours[2] = step(1002, &[(1002, 0.405), (2, 0.404), (7, 0.1)]);
        // Far off after the departure: not compared.
        ours[8].top[0].1 = 0.0;
        let c = compare(&r, &ours, &[], Rule::default());
        assert!(c.passed(), "{:?}", c.failures);
        assert_eq!(c.first_near_tie, Some(2));
        assert_eq!((c.same_tokens, c.compared_steps), (2, 3));
        assert!(c
            .departure
            .as_ref()
            .is_some_and(|d| d.allowed && d.step == 2));

        // Same token at the tie, a different one later: the token is no fault, but the departure step is
        // still compared, and 0.59 against llama.cpp's 0.2 breaks the probability rule.
        let mut ours = r.clone();
        ours[6] = step(1006, &[(1006, 0.6), (6, 0.59)]);
        let c = compare(&r, &ours, &[], Rule::default());
        assert_eq!((c.same_tokens, c.compared_steps), (6, 7));
        assert!(c
            .departure
            .as_ref()
            .is_some_and(|d| d.allowed && d.step == 6));
        assert_eq!(c.failures.len(), 1, "{:?}", c.failures);
        assert!(c.failures[0].contains("probability"), "{:?}", c.failures);
    }

    #[test]
    fn missing_ids_count_at_least_their_excess_over_our_smallest() {
        let r = confident(1);
        let ours = vec![step(
            0,
            &[(0, 0.6), (1000, 0.2), (2000, 0.05), (2001, 0.04)],
        )];
        let c = compare(&r, &ours, &[], Rule::default());
        // 2002 (0.03) is missing; our smallest listed is 0.04, so it could be equal: no difference.
        assert_eq!(c.missing_ids, 1);
        assert!(c.passed());
        let ours = vec![step(0, &[(0, 0.6), (1000, 0.2)])];
        let c = compare(&r, &ours, &[], Rule::default());
        assert_eq!(c.missing_ids, 3);
        assert!(c.passed(), "0.05 is below our smallest listed 0.2");
        let ours = vec![step(0, &[(0, 0.9), (1000, 0.001)])];
        let c = compare(&r, &ours, &[], Rule::default());
        assert!(!c.passed());
    }

    #[test]
    fn a_short_run_fails_unless_it_stopped_on_end_of_generation() {
        let r = confident(10);
        let c = compare(&r, &r[..5], &[], Rule::default());
        assert!(!c.passed());
        let c = compare(&r, &r[..5], &[4], Rule::default());
        assert!(c.passed());
        assert!(c.stopped_on_eog);
        let c = compare(&r, &[], &[], Rule::default());
        assert!(!c.passed());
    }

    #[test]
    fn step_json_accepts_pairs_and_objects() {
        let a: Value = serde_json::from_str(r#"{"token":5,"top":[[5,0.5],[6,0.25]]}"#).unwrap();
        let b: Value = serde_json::from_str(
            r#"{"step":0,"token":5,"top":[{"id":5,"p":0.5},{"token":6,"prob":0.25}]}"#,
        )
        .unwrap();
        let want = step(5, &[(5, 0.5), (6, 0.25)]);
        assert_eq!(Step::from_json(&a).unwrap(), want);
        assert_eq!(Step::from_json(&b).unwrap(), want);
        assert!((want.gap() - 0.25).abs() < 1e-12);
        let bad: Value = serde_json::from_str(r#"{"token":5,"top":[[5]]}"#).unwrap();
        assert!(Step::from_json(&bad).is_err());
        let neg: Value = serde_json::from_str(r#"{"token":-1,"top":[]}"#).unwrap();
        assert!(Step::from_json(&neg).is_err());
    }

    #[test]
    fn table_row_shows_the_departure_probabilities() {
        let r = confident(3);
        let mut ours = r.clone();
        ours[1] = step(1001, &[(1001, 0.5), (1, 0.45)]);
        let row = table_row(
            "random0025",
            25,
            &compare(&r, &ours, &[], Rule::default()),
            Some(1.5),
        );
        assert!(row.contains("1 of 3"), "{row}");
        assert!(row.contains("departure at step 1"), "{row}");
        assert!(row.contains("llama.cpp 1 p=0.6000, 1001 p=0.2000"), "{row}");
        assert!(row.contains("ours 1 p=0.4500, 1001 p=0.5000"), "{row}");
        assert!(row.contains("FAIL"), "{row}");
        assert!(row.contains("1.5 s"), "{row}");
    }
}
