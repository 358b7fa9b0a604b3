//! Choosing the next token from logits, with llama.cpp's samplers and their order (`common/sampling.cpp`:
//! penalties → top-k → top-p → min-p → temperature → draw), and the log-probabilities reported with it.
//!
//! Semantics follow `src/llama-sampler.cpp`:
//! - penalties, over the last `penalty_last_n` accepted tokens: a token seen `c` times has its logit
//!   divided by `repeat_penalty` (multiplied when the logit is ≤ 0), then lowered by
//!   `c·frequency_penalty + presence_penalty`;
//! - top-k keeps the `k` likeliest; top-p the likeliest whose probabilities first reach `p` (at least
//!   `min_keep`); min-p those whose probability is at least `p` times the likeliest's;
//! - temperature ≤ 0 keeps only the likeliest (greedy); otherwise logits are divided by it;
//! - the draw picks from the softmax of what is left with a seeded generator.
//!
//! Reported log-probabilities ([`TopLogprobs`]) are the log-softmax of the raw logits, before any of this.

use std::collections::{HashMap, VecDeque};

use poly_kernels::rng::Rng;

/// What the sampler does.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// ≤ 0: always the likeliest token (greedy).
    pub temperature: f32,
    /// 0: off.
    pub top_k: usize,
    /// 1: off.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    /// Fewest tokens top-p and min-p keep.
    pub min_keep: usize,
    /// 1: off.
    pub repeat_penalty: f32,
    /// 0: off.
    pub frequency_penalty: f32,
    /// 0: off.
    pub presence_penalty: f32,
    /// How many of the last accepted tokens the penalties look at (0: penalties off).
    pub penalty_last_n: usize,
    pub seed: u64,
}

impl SamplerConfig {
    /// Always the likeliest token.
    pub fn greedy() -> SamplerConfig {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..SamplerConfig::default()
        }
    }
}

impl Default for SamplerConfig {
    /// llama.cpp's defaults (`common_params_sampling`).
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            min_keep: 0,
            repeat_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
        }
    }
}

/// A token and its logit or probability.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Candidate {
    id: u32,
    logit: f32,
}

/// A sampler with its state: the generator and the recent tokens the penalties count.
#[derive(Clone, Debug)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    recent: VecDeque<u32>,
    counts: HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        Sampler {
            rng: Rng::new(cfg.seed),
            cfg,
            recent: VecDeque::new(),
            counts: HashMap::new(),
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Records a token of the sequence (prompt or generated) for the penalties.
    pub fn accept(&mut self, token: u32) {
        let n = self.cfg.penalty_last_n;
        if n == 0 {
            return;
        }
        if self.recent.len() >= n {
            if let Some(old) = self.recent.pop_front() {
                if let Some(c) = self.counts.get_mut(&old) {
                    *c -= 1;
                    if *c == 0 {
                        self.counts.remove(&old);
                    }
                }
            }
        }
        self.recent.push_back(token);
        *self.counts.entry(token).or_insert(0) += 1;
    }

    fn penalties_on(&self) -> bool {
        let c = &self.cfg;
        c.penalty_last_n > 0
            && (c.repeat_penalty != 1.0 || c.frequency_penalty != 0.0 || c.presence_penalty != 0.0)
    }

    /// Chooses the next token from `logits` (one per vocabulary entry; `-∞` excludes a token).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 && !self.penalties_on() {
            // Greedy: the first of the largest, without a candidate list.
            let max = max_logit(logits);
            return logits.iter().position(|&v| v == max).unwrap_or(0) as u32;
        }
        let mut cands: Vec<Candidate> = logits
            .iter()
            .enumerate()
            .map(|(id, &logit)| Candidate {
                id: id as u32,
                logit,
            })
            .collect();
        if self.penalties_on() {
            self.apply_penalties(&mut cands);
        }
        let c = self.cfg.clone();
        if c.temperature <= 0.0 {
            return argmax(&cands);
        }
        if c.top_k > 0 && c.top_k < cands.len() {
            // The k likeliest first, then only they are sorted (the order is total: the same k).
            cands.select_nth_unstable_by(c.top_k - 1, desc);
            cands.truncate(c.top_k);
        }
        sort_desc(&mut cands);
        if c.top_p < 1.0 {
            let probs = probabilities(&cands);
            let mut cum = 0f32;
            let mut keep = cands.len();
            for (i, p) in probs.iter().enumerate() {
                cum += p;
                if cum >= c.top_p && i + 1 >= c.min_keep {
                    keep = i + 1;
                    break;
                }
            }
            cands.truncate(keep);
        }
        if c.min_p > 0.0 && !cands.is_empty() {
            let min_logit = cands[0].logit + c.min_p.ln();
            let keep = cands
                .iter()
                .enumerate()
                .skip(1)
                .find(|&(i, x)| x.logit < min_logit && i >= c.min_keep)
                .map_or(cands.len(), |(i, _)| i);
            cands.truncate(keep);
        }
        for x in cands.iter_mut() {
            x.logit /= c.temperature;
        }
        self.draw(&cands)
    }

    fn apply_penalties(&self, cands: &mut [Candidate]) {
        let c = &self.cfg;
        for (&id, &count) in &self.counts {
            let Some(x) = cands.get_mut(id as usize) else {
                continue;
            };
            if x.logit <= 0.0 {
                x.logit *= c.repeat_penalty;
            } else {
                x.logit /= c.repeat_penalty;
            }
            x.logit -= count as f32 * c.frequency_penalty + c.presence_penalty;
        }
    }

    /// Draws from the softmax of `cands` (sorted or not).
    fn draw(&mut self, cands: &[Candidate]) -> u32 {
        let Some(first) = cands.first() else {
            return 0;
        };
        let max = cands
            .iter()
            .map(|x| x.logit)
            .fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f64> = cands.iter().map(|x| (x.logit - max).exp() as f64).collect();
        let total: f64 = weights.iter().sum();
        let u = (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        let target = total * u;
        let mut run = 0f64;
        for (x, w) in cands.iter().zip(&weights) {
            run += w;
            if run >= target && *w > 0.0 {
                return x.id;
            }
        }
        cands
            .iter()
            .rev()
            .find(|x| x.logit > f32::NEG_INFINITY)
            .unwrap_or(first)
            .id
    }
}

/// The likeliest candidate; the lowest id among equals.
fn argmax(cands: &[Candidate]) -> u32 {
    let mut best: Option<Candidate> = None;
    for &x in cands {
        if best.is_none_or(|b| x.logit > b.logit) {
            best = Some(x);
        }
    }
    best.map_or(0, |b| b.id)
}

/// Sorts by logit, largest first (ids ascending among equals).
fn sort_desc(cands: &mut [Candidate]) {
    cands.sort_by(desc);
}

/// Larger logit first, then the lower id.
fn desc(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// Softmax of the candidates' logits.
fn probabilities(cands: &[Candidate]) -> Vec<f32> {
    let max = cands
        .iter()
        .map(|x| x.logit)
        .fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = cands.iter().map(|x| (x.logit - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.into_iter().map(|v| v / sum).collect()
}

/// The log-probabilities of one step: the log-softmax of the raw logits, each `logit - log Σ exp`.
/// Only the normalizer is computed up front (one pass over the vocabulary); a token's log-probability
/// and the top `n` are read from the logits when asked.
#[derive(Clone, Debug)]
pub struct TopLogprobs<'a> {
    logits: &'a [f32],
    /// `log Σ exp(logit)` (−∞ when every logit is).
    log_z: f64,
}

impl<'a> TopLogprobs<'a> {
    pub fn new(logits: &'a [f32]) -> TopLogprobs<'a> {
        TopLogprobs {
            logits,
            log_z: log_sum_exp(logits),
        }
    }

    /// The log-probability of `token`.
    pub fn of(&self, token: u32) -> f32 {
        self.logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&v| self.logprob(v))
    }

    fn logprob(&self, logit: f32) -> f32 {
        if self.log_z == f64::NEG_INFINITY {
            return logit;
        }
        (logit as f64 - self.log_z) as f32
    }

    /// The `n` likeliest tokens and their log-probabilities, likeliest first.
    pub fn top(&self, n: usize) -> Vec<(u32, f32)> {
        if n == 0 {
            return Vec::new();
        }
        poly_kernels::ops::topk::top_k(self.logits, n)
            .into_iter()
            .map(|i| (i as u32, self.logprob(self.logits[i])))
            .collect()
    }
}

/// Lanes of the vocabulary passes below: independent accumulators the compiler keeps in vector registers.
const LANES: usize = 16;

/// The largest of `x` (NaN ignored; −∞ for none), in `LANES` independent lanes.
pub fn max_logit(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    rest.iter()
        .chain(acc.iter())
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// `log Σ exp(x)`: the max, then one pass of exponentials (`exp_le0`, to about 2e-7 relative) summed
/// in f32 lanes per block and f64 across blocks.
pub fn log_sum_exp(x: &[f32]) -> f64 {
    let max = max_logit(x);
    if max == f32::NEG_INFINITY || max.is_nan() {
        return f64::NEG_INFINITY;
    }
    let mut total = 0f64;
    for block in x.chunks(4096) {
        let mut acc = [0f32; LANES];
        let chunks = block.chunks_exact(LANES);
        let rest = chunks.remainder();
        for c in chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += exp_le0(v - max);
            }
        }
        let tail: f32 = rest.iter().map(|&v| exp_le0(v - max)).sum();
        total += acc.iter().map(|&a| a as f64).sum::<f64>() + tail as f64;
    }
    max as f64 + total.ln()
}

/// `exp(x)` for `x ≤ 0` (a NaN gives 0; below −80, where it is under 2e-35, 0 too): `2^n · p(r)` with
/// `x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`, `p` the degree-6 Taylor polynomial (relative error about 2e-7).
/// Branch-free so that a loop of it is vectorized.
#[inline(always)]
fn exp_le0(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5·2^23: adding it rounds to an integer, whose value sits in the low mantissa bits.
    const SHIFTER: f32 = 12_582_912.0;
    let live = x >= -80.0;
    let x = if live { x } else { -80.0 };
    let t = x * LOG2E + SHIFTER;
    let n = t - SHIFTER;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // n in [-116, 0]: 2^n is an exponent shift of p (in [0.7, 1.42]), a normal number.
    let shift = (t.to_bits() as i32).wrapping_sub(SHIFTER.to_bits() as i32);
    let e = f32::from_bits((p.to_bits() as i32).wrapping_add(shift << 23) as u32);
    if live {
        e
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32) -> SamplerConfig {
        SamplerConfig {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..SamplerConfig::default()
        }
    }

    /// How often each token is drawn in `n` tries.
    fn histogram(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<usize> {
        let mut h = vec![0; logits.len()];
        for _ in 0..n {
            h[s.sample(logits) as usize] += 1;
        }
        h
    }

    #[test]
    fn greedy_takes_the_largest_logit() {
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
        assert_eq!(s.sample(&[5.0, 5.0, 1.0]), 0);
    }

    #[test]
    fn draws_follow_the_softmax_and_the_seed() {
        let logits = [0.0f32, 1.0, 2.0, f32::NEG_INFINITY];
        let mut s = Sampler::new(cfg(1.0));
        let n = 40_000;
        let h = histogram(&mut s, &logits, n);
        let z: f64 = (0..3).map(|i| (i as f64).exp()).sum();
        for (i, &count) in h.iter().enumerate().take(3) {
            let p = (i as f64).exp() / z;
            let f = count as f64 / n as f64;
            assert!((f - p).abs() < 0.01, "token {i}: {f} vs {p}");
        }
        assert_eq!(h[3], 0);
        // Same seed, same draws; temperature sharpens.
        let a: Vec<u32> = (0..50)
            .map(|_| Sampler::new(cfg(1.0)).sample(&logits))
            .collect();
        let mut s1 = Sampler::new(cfg(1.0));
        let mut s2 = Sampler::new(cfg(1.0));
        let b: Vec<u32> = (0..50).map(|_| s1.sample(&logits)).collect();
        let c: Vec<u32> = (0..50).map(|_| s2.sample(&logits)).collect();
        assert_eq!(b, c);
        assert!(a.iter().all(|&t| t == a[0]));
        let cold = histogram(&mut Sampler::new(cfg(0.25)), &logits, 10_000);
        assert!(cold[2] > 9_000, "{cold:?}");
    }

    #[test]
    fn top_k_top_p_and_min_p_cut_the_tail() {
        // Probabilities ≈ 0.64, 0.24, 0.09, 0.03.
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let run = |c: SamplerConfig| {
            let h = histogram(&mut Sampler::new(c), &logits, 4000);
            h.iter().map(|&x| x > 0).collect::<Vec<_>>()
        };
        let top_k = SamplerConfig {
            top_k: 2,
            ..cfg(1.0)
        };
        assert_eq!(run(top_k), [true, true, false, false]);
        let top_p = SamplerConfig {
            top_p: 0.85,
            ..cfg(1.0)
        };
        assert_eq!(run(top_p), [true, true, false, false]);
        let top_p_low = SamplerConfig {
            top_p: 0.5,
            ..cfg(1.0)
        };
        assert_eq!(run(top_p_low), [true, false, false, false]);
        let top_p_keep = SamplerConfig {
            top_p: 0.5,
            min_keep: 3,
            ..cfg(1.0)
        };
        assert_eq!(run(top_p_keep), [true, true, true, false]);
        // p(token 2)/p(token 0) = e^-2 ≈ 0.135.
        let min_p = SamplerConfig {
            min_p: 0.1,
            ..cfg(1.0)
        };
        assert_eq!(run(min_p), [true, true, true, false]);
        let min_p_high = SamplerConfig {
            min_p: 0.2,
            ..cfg(1.0)
        };
        assert_eq!(run(min_p_high), [true, true, false, false]);
    }

    #[test]
    fn penalties_follow_llama_cpp() {
        let c = SamplerConfig {
            repeat_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            penalty_last_n: 3,
            ..SamplerConfig::greedy()
        };
        let mut s = Sampler::new(c);
        for t in [0, 0, 1] {
            s.accept(t);
        }
        let mut cands: Vec<Candidate> = [4.0f32, -1.0, 3.0]
            .iter()
            .enumerate()
            .map(|(i, &l)| Candidate {
                id: i as u32,
                logit: l,
            })
            .collect();
        s.apply_penalties(&mut cands);
        // Token 0: seen twice, 4/2 - 2·0.5 - 0.25; token 1: once, -1·2 - 0.5 - 0.25; token 2 untouched.
        assert_eq!(cands[0].logit, 4.0 / 2.0 - 1.0 - 0.25);
        assert_eq!(cands[1].logit, -2.0 - 0.5 - 0.25);
        assert_eq!(cands[2].logit, 3.0);
        assert_eq!(s.sample(&[4.0, -1.0, 3.0]), 2);
        // The window holds 3 tokens: after three more, token 0 is forgotten.
        for t in [2, 2, 2] {
            s.accept(t);
        }
        assert_eq!(s.sample(&[4.0, -1.0, 3.0]), 0);
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax() {
        let lp = TopLogprobs::new(&[1.0, 3.0, 2.0]);
        let z = (1f64.exp() + 3f64.exp() + 2f64.exp()).ln();
        let top = lp.top(2);
        assert_eq!((top[0].0, top[1].0), (1, 2));
        assert!((top[0].1 as f64 - (3.0 - z)).abs() < 1e-6);
        assert!((lp.of(0) as f64 - (1.0 - z)).abs() < 1e-6);
        assert_eq!(lp.of(7), f32::NEG_INFINITY);
    }

    /// `log Σ exp` by f64 exponentials, the reference.
    fn log_sum_exp_f64(x: &[f32]) -> f64 {
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        max + x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln()
    }

    /// A vocabulary of logits like a model's: normals times `scale`, a few large ones.
    fn vocab_logits(n: usize, scale: f32, seed: u64) -> Vec<f32> {
        let mut rng = poly_kernels::rng::Rng::new(seed);
        (0..n)
            .map(|i| {
                let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                let w = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                let z = (-2.0 * (u + 1e-7).ln()).sqrt() * (std::f32::consts::TAU * w).cos();
                z * scale + if i % 9973 == 0 { 12.0 } else { 0.0 }
            })
            .collect()
    }

    #[test]
    fn the_fast_exponential_is_close_to_exp() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -(i as f32) * 80.0 / 200_000.0;
            let want = (x as f64).exp();
            let got = exp_le0(x) as f64;
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert_eq!(exp_le0(-100.0), 0.0);
        assert_eq!(exp_le0(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_le0(f32::NAN), 0.0);
        assert_eq!(exp_le0(0.0), 1.0);
    }

    #[test]
    fn log_sum_exp_matches_f64_over_a_vocabulary() {
        for (n, scale, seed) in [
            (151_936, 3.0, 1),
            (262_144, 8.0, 2),
            (1, 1.0, 3),
            (17, 30.0, 4),
        ] {
            let x = vocab_logits(n, scale, seed);
            let (got, want) = (log_sum_exp(&x), log_sum_exp_f64(&x));
            assert!((got - want).abs() < 2e-6, "n {n}: {got} vs {want}");
            let lp = TopLogprobs::new(&x);
            let t = (n / 2) as u32;
            assert!((lp.of(t) as f64 - (x[t as usize] as f64 - want)).abs() < 4e-6);
        }
        let mut x = vec![f32::NEG_INFINITY; 40];
        assert_eq!(log_sum_exp(&x), f64::NEG_INFINITY);
        x[33] = 2.0;
        assert!((log_sum_exp(&x) - 2.0).abs() < 1e-12);
        assert_eq!(TopLogprobs::new(&x).of(33), 0.0);
    }

    #[test]
    fn greedy_without_a_candidate_list_takes_the_first_largest() {
        let mut x = vocab_logits(151_936, 3.0, 5);
        x[70_001] = 40.0;
        x[90_000] = 40.0;
        x[3] = f32::NAN;
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.sample(&x), 70_001);
        let cands: Vec<Candidate> = x
            .iter()
            .enumerate()
            .map(|(id, &logit)| Candidate {
                id: id as u32,
                logit,
            })
            .collect();
        assert_eq!(argmax(&cands), 70_001);
        assert_eq!(s.sample(&[f32::NEG_INFINITY; 3]), 0);
    }

    /// The per-token host work of a greedy answer with logprobs over a 151,936-token vocabulary, the old
    /// way (a full f64 log-softmax into a new vector, a candidate list) and now. A measurement, not a
    /// check: `cargo test --release -p poly-engine --lib sample -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn per_token_host_work() {
        use poly_kernels::ops::softmax::log_softmax;
        let x = vocab_logits(151_936, 3.0, 6);
        let reps = 200;
        let t = std::time::Instant::now();
        let mut sink = 0f32;
        for _ in 0..reps {
            let mut lp = vec![0f32; x.len()];
            log_softmax(&x, &mut lp);
            let cands: Vec<Candidate> = x
                .iter()
                .enumerate()
                .map(|(id, &logit)| Candidate {
                    id: id as u32,
                    logit,
                })
                .collect();
            let tok = argmax(&cands);
            sink += lp[tok as usize];
        }
        let old = t.elapsed().as_secs_f64() / reps as f64 * 1e6;
        let t = std::time::Instant::now();
        let mut s = Sampler::new(SamplerConfig::greedy());
        for _ in 0..reps {
            let lp = TopLogprobs::new(&x);
            let tok = s.sample(&x);
            sink -= lp.of(tok);
        }
        let new = t.elapsed().as_secs_f64() / reps as f64 * 1e6;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            sink += max_logit(&x) * 1e-30;
        }
        eprintln!(
            "max {:.0} us",
            t.elapsed().as_secs_f64() / reps as f64 * 1e6
        );
        let t = std::time::Instant::now();
        for _ in 0..reps {
            sink += log_sum_exp(&x) as f32 * 1e-30;
        }
        eprintln!(
            "lse {:.0} us",
            t.elapsed().as_secs_f64() / reps as f64 * 1e6
        );
        eprintln!("per token: old {old:.0} us, new {new:.0} us (difference of the sums {sink:e})");
        assert!(sink.abs() < 1e-3 * reps as f32);
    }
}
