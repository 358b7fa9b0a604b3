//! Models whose draft block agrees with the main model at a chosen rate (`synth --draft-agreement F`,
//! issue 18's "Measure it honestly"): random weights make a draft block guess at chance, so no guess of
//! `--draft-block on` was ever kept on a synthetic model and its cost could not be weighed against a gain.
//!
//! The construction, for a qwen35moe file (its MTP block reads the trunk's embedding table and writes
//! through the trunk's output head, as converted Qwen3.5/3.6 files have it):
//! - **The trunk's next token is a function of the current one.** Token `t`'s embedding is the output
//!   head's row of `next(t)` (the head's own random draws, dequantized), restricted to one half of the
//!   stream's dimensions and brought to RMS 1: `next(t)`'s logit then stands about `sqrt(n_embd / 2)`
//!   spreads above the others' mean (11 on the tiny shape, 32 on the real widths, where the largest of
//!   the others stands about 4 and 5), and the heads' norms scale the logits so that its probability is
//!   about [`TOP_PROBABILITY`]. The blocks' outputs (attention, delta-net, routed and shared experts) are
//!   written at [`BLOCK_GAIN`] times their usual scale, so the residual stream stays mostly the
//!   embedding: the context moves every logit a little, the greedy token not. `next` runs once through every ordinary token (one cycle), so greedy
//!   answers neither repeat nor end within the vocabulary's length, and never write a control token
//!   (those lead into the cycle).
//! - **The draft block sees the token for a share `F` of the vocabulary.** A chosen `round(F · n_vocab)`
//!   tokens (the "known" ones) have their embedding in the first half of the dimensions, the others in the
//!   second. The draft block's `eh_proj` passes the first half of the token's (normed) embedding through
//!   unchanged and drops the second; its hidden-row half is random, at [`HIDDEN_SHARE`] of the
//!   embedding's size. Its own layer's outputs are at [`BLOCK_GAIN`] too, and its head is the trunk's. For a
//!   known token `t` just written it reads `t`'s embedding and guesses `next(t)`, which is the trunk's next
//!   greedy token; for the others it reads only a random projection of the trunk's hidden row, and its
//!   guess is a token unrelated to `t` (right about once in the vocabulary's size).
//!
//! So the guess after a known token is right and the others are not: over an answer (fresh tokens of the
//! cycle, each known with probability `F`) the share of guesses kept is about `F`, with the spread of a
//! coin tossed once a token. That is the design, not the measurement: `poly-engine synth` runs the written
//! file's trunk greedily and its draft block beside it on the CPU and prints the agreement it measured.
//!
//! The token embedding and `eh_proj` hold exact values, so they are written in a type that can hold them
//! (F32, F16, BF16 or Q8_0: the one asked when it is one of those, else Q8_0); every other tensor keeps
//! its type and its random draws (only the blocks' output scales and the heads' norms change). The file
//! stays a plain qwen35moe file with `nextn_predict_layers` 1, which llama.cpp's `draft-mtp` reads.

use std::ops::Range;
use std::sync::Arc;

use poly_kernels::quant::{self, ActType, GgmlType};
use poly_kernels::rng::Rng;
use rayon::prelude::*;

use super::fill::{self, stream_seed};
use super::plan::{self, Init, PlannedTensor};
use super::vocab::{token_type, Vocab};
use super::{main_type, SynthError, Synthesis};
use crate::arch::Role;

/// Scale of every block's output projections (attention, delta-net, routed and shared experts; trunk and
/// draft block) against their usual draws: the stream stays mostly the token's embedding (RMS 1), the
/// blocks adding about this RMS each, enough that the context moves the logits, far too little to move
/// the greedy token (it stands `sqrt(n_embd / 2)` spreads above the others' mean).
pub const BLOCK_GAIN: f32 = 0.1;

/// RMS of what `eh_proj`'s hidden-row half adds against the token's normed embedding (RMS 1): small
/// enough that a known token's guess stays right, large enough that an unknown token's guess is a real
/// guess from the hidden row (a zero input would make every such guess the same token).
pub const HIDDEN_SHARE: f32 = 0.5;

/// The greedy token's probability the heads' norms aim at: confident, as a trained model is on its
/// likeliest continuations, but not one (a sampled answer still strays from the cycle at times).
pub const TOP_PROBABILITY: f64 = 0.9;

/// The heads' norm weight that puts the next token's probability near [`TOP_PROBABILITY`]: the next
/// token's logit is `s · sqrt(n_embd / 2)` (the embedding is its head row in half the dimensions, at
/// RMS 1) where the others spread as `N(0, s²)`, `s` the norm weight times the head's spread σ
/// ([`plan::target_logit_sigma`]), and the others' log-sum-exp is about `ln n_vocab + s² / 2`: the
/// next token's log-odds are `ln(p / (1 − p))` where `s · sqrt(n_embd / 2) = ln n_vocab + s² / 2 +
/// ln(p / (1 − p))`, the smaller root. Where the stream is too narrow for that, the weight stays 1.
fn head_norm_mean(n_embd: usize, n_vocab: usize) -> f32 {
    let sigma = plan::target_logit_sigma(n_vocab as u64) as f64;
    let half = (n_embd as f64 / 2.0).sqrt();
    let odds = TOP_PROBABILITY / (1.0 - TOP_PROBABILITY);
    let disc = half * half - 2.0 * ((n_vocab as f64).ln() + odds.ln());
    if disc <= 0.0 {
        return 1.0;
    }
    ((half - disc.sqrt()) / sigma) as f32
}

/// Where the vocabulary's tokens lead and which of them the draft block sees, shared by the tensors
/// that carry it (the token embedding and `eh_proj`).
#[derive(Clone, PartialEq)]
pub struct AgreementPlan {
    /// The share asked, `0..=1`.
    pub rate: f32,
    pub n_embd: usize,
    /// The trunk's next greedy token after each token: one cycle through the ordinary tokens; the
    /// others lead into it.
    pub next: Vec<u32>,
    /// Whether the draft block reads each token's embedding (exactly `round(rate · n_vocab)` do).
    pub known: Vec<bool>,
    /// Tensors written in another type than asked, to hold exact values: (name, asked, written).
    pub retyped: Vec<(String, GgmlType, GgmlType)>,
    /// The output head as planned, and its index in the file (its draws are made again to build the
    /// embedding from them).
    output: PlannedTensor,
    output_index: usize,
}

impl std::fmt::Debug for AgreementPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The tables are a vocabulary long: their sizes say enough.
        f.debug_struct("AgreementPlan")
            .field("rate", &self.rate)
            .field("n_embd", &self.n_embd)
            .field("n_vocab", &self.next.len())
            .field("n_known", &self.n_known())
            .field("retyped", &self.retyped)
            .finish()
    }
}

impl AgreementPlan {
    /// Tokens whose embedding the draft block reads.
    pub fn n_known(&self) -> usize {
        self.known.iter().filter(|&&k| k).count()
    }

    /// The dimensions token `t`'s embedding lives in: the first half for a known token (the half
    /// `eh_proj` passes), the second for the others.
    fn half(&self, t: usize) -> Range<usize> {
        let h = self.n_embd / 2;
        if self.known[t] {
            0..h
        } else {
            h..self.n_embd
        }
    }
}

/// Whether [`encode`] writes exact values in `ty`.
fn holds_exact_values(ty: GgmlType, n: usize) -> bool {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => true,
        GgmlType::Q8_0 => n.is_multiple_of(32),
        _ => false,
    }
}

/// The type a tensor of exact values with rows of `n` is written in: `asked` if it can hold them, else
/// Q8_0 (rows of whole blocks), else F16.
fn exact_type(asked: GgmlType, n: usize) -> GgmlType {
    if holds_exact_values(asked, n) {
        asked
    } else if holds_exact_values(GgmlType::Q8_0, n) {
        GgmlType::Q8_0
    } else {
        GgmlType::F16
    }
}

/// `x` (one row) written into `out` in `ty` (F32, F16, BF16 or Q8_0).
fn encode(ty: GgmlType, x: &[f32], out: &mut [u8], name: &str) -> Result<(), SynthError> {
    match ty {
        // The weight's block is the activations' (f16 scale, 32 × i8).
        GgmlType::Q8_0 => {
            ActType::Q8_0.quantize(x, out);
            Ok(())
        }
        _ => fill::write_floats(ty, out, |i| x[i], name),
    }
}

impl Synthesis {
    /// The same model written so that its draft block guesses the trunk's next greedy token at about
    /// `rate` (`0..=1`; see the module's documentation): the token embedding and the draft block's
    /// `eh_proj` built for it, the blocks' outputs at [`BLOCK_GAIN`]. Refused for models without a draft
    /// block (an `eh_proj`), or without an output head of their own.
    pub fn with_draft_agreement(mut self, rate: f32) -> Result<Synthesis, SynthError> {
        if !(0.0..=1.0).contains(&rate) {
            return Err(SynthError(format!(
                "--draft-agreement must be a share from 0 to 1, not {rate}"
            )));
        }
        let find = |role: Role| self.tensors.iter().position(|t| t.desc.role == role);
        let arch = self.shape.hparams.as_dyn().arch_name();
        let (Some(embd), Some(output), Some(_)) = (
            find(Role::TokenEmbd),
            find(Role::Output),
            find(Role::NextnEhProj),
        ) else {
            return Err(SynthError(format!(
                "--draft-agreement needs a model with a draft block (a qwen35moe shape), and {arch} {} has none",
                self.shape.name
            )));
        };
        let n_embd = self.tensors[embd].desc.dims[0] as usize;
        if !n_embd.is_multiple_of(2) || n_embd < 2 {
            return Err(SynthError(format!(
                "--draft-agreement splits the stream in halves: {n_embd} is odd"
            )));
        }
        let n_vocab = self.vocab.len();
        let (next, known) = draw_tables(&self.vocab, rate, self.seed);
        let mut plan = AgreementPlan {
            rate,
            n_embd,
            next,
            known,
            retyped: Vec::new(),
            output: self.tensors[output].clone(),
            output_index: output,
        };
        debug_assert_eq!(plan.next.len(), n_vocab);
        for t in &mut self.tensors {
            match t.desc.role {
                Role::TokenEmbd | Role::NextnEhProj => {
                    let ty = exact_type(t.ty, t.desc.dims[0] as usize);
                    if ty != t.ty {
                        plan.retyped.push((t.desc.name.clone(), t.ty, ty));
                        t.ty = ty;
                        t.fell_back_from = None;
                    }
                }
                // The heads' norms carry the logits' scale: the next token's probability about
                // [`TOP_PROBABILITY`] instead of one (its margin over the others is large).
                Role::OutputNorm | Role::NextnSharedHeadNorm => {
                    if let Init::Norm { mean, noise } = &mut t.init {
                        let m = head_norm_mean(n_embd, n_vocab);
                        *noise *= m / *mean;
                        *mean = m;
                    }
                }
                Role::AttnOut
                | Role::SsmOut
                | Role::ShortConvOutProj
                | Role::FfnDownExps
                | Role::FfnDownShexp
                | Role::FfnDown => {
                    if let Init::Random { rms } = &mut t.init {
                        *rms *= BLOCK_GAIN;
                    }
                }
                _ => {}
            }
        }
        let plan = Arc::new(plan);
        for t in &mut self.tensors {
            match t.desc.role {
                Role::TokenEmbd => t.init = Init::AgreeingEmbedding(plan.clone()),
                Role::NextnEhProj => t.init = Init::AgreeingEhProj(plan.clone()),
                _ => {}
            }
        }
        self.agreement = Some(plan);
        // The token embedding may have changed type: the file's main type and its metadata follow.
        self.main_type = main_type(&self.tensors);
        self.metadata = self.build_metadata();
        Ok(self)
    }
}

/// The tables of `rate` for `vocab` under `seed`: `next` (one cycle through the ordinary tokens in a
/// random order, each control or user-defined token leading to a random ordinary one) and `known`
/// (`round(rate · n_vocab)` tokens, drawn at random).
fn draw_tables(vocab: &Vocab, rate: f32, seed: u64) -> (Vec<u32>, Vec<bool>) {
    let n = vocab.len();
    let mut rng = Rng::new(stream_seed(seed, u64::MAX - 5, 0));
    let mut order: Vec<u32> = (0..n as u32)
        .filter(|&t| vocab.token_types[t as usize] == token_type::NORMAL)
        .collect();
    shuffle(&mut order, &mut rng);
    let mut next = vec![0u32; n];
    for (i, &t) in order.iter().enumerate() {
        next[t as usize] = order[(i + 1) % order.len()];
    }
    for (t, ty) in vocab.token_types.iter().enumerate() {
        if *ty != token_type::NORMAL {
            next[t] = order[rng.below(order.len() as u32) as usize];
        }
    }
    let mut ranks: Vec<u32> = (0..n as u32).collect();
    shuffle(&mut ranks, &mut rng);
    let n_known = (rate as f64 * n as f64).round() as usize;
    let mut known = vec![false; n];
    for &t in &ranks[..n_known.min(n)] {
        known[t as usize] = true;
    }
    (next, known)
}

/// Fisher-Yates.
fn shuffle(v: &mut [u32], rng: &mut Rng) {
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u32 + 1) as usize;
        v.swap(i, j.min(i));
    }
}

/// The token embedding of `plan` (every row, in `ty`) into `out`: row `t` is the output head's row of
/// `next(t)` (drawn again from `seed` as the file's head is), zero outside `t`'s half, at RMS 1.
pub fn fill_embedding(
    plan: &AgreementPlan,
    seed: u64,
    ty: GgmlType,
    out: &mut [u8],
) -> Result<(), SynthError> {
    let head = &plan.output;
    let name = "token_embd.weight";
    let head_bytes = head.ty.bytes_for(head.desc.n_elements()).unwrap_or(0) as usize;
    let mut heads = vec![0u8; head_bytes];
    fill::fill_tensor(head, plan.output_index, seed, &[], &mut heads)?;
    let n = plan.n_embd;
    let head_row = head.ty.bytes_for(n as u64).unwrap_or(0) as usize;
    let row = ty.bytes_for(n as u64).unwrap_or(0) as usize;
    if row == 0 || out.len() != row * plan.next.len() || heads.len() != head_row * plan.next.len() {
        return Err(SynthError(format!(
            "{name}: {} bytes are not {} rows of {n} values",
            out.len(),
            plan.next.len()
        )));
    }
    out.par_chunks_mut(row).enumerate().try_for_each_init(
        || vec![0f32; n],
        |x, (t, dst)| {
            let v = plan.next[t] as usize;
            quant::dequantize(head.ty, &heads[v * head_row..(v + 1) * head_row], x)
                .map_err(|e| SynthError(format!("{name}: {e}")))?;
            let half = plan.half(t);
            let mut ss = 0f64;
            for (i, xi) in x.iter_mut().enumerate() {
                if half.contains(&i) {
                    ss += (*xi as f64) * (*xi as f64);
                } else {
                    *xi = 0.0;
                }
            }
            let scale = if ss > 0.0 {
                (n as f64 / ss).sqrt() as f32
            } else {
                0.0
            };
            x.iter_mut().for_each(|v| *v *= scale);
            encode(ty, x, dst, name)
        },
    )
}

/// The draft block's `eh_proj` of `plan` (`[2 · n_embd, n_embd]`, in `ty`) into `out`: output `j` reads
/// input `j` of the token's half (weight 1) for `j` in the first half of the dimensions, nothing of it
/// otherwise, and the hidden row through random weights of RMS `HIDDEN_SHARE / sqrt(n_embd)` (drawn from
/// `tensor_seed`).
pub fn fill_eh_proj(
    plan: &AgreementPlan,
    tensor_seed: u64,
    ty: GgmlType,
    out: &mut [u8],
) -> Result<(), SynthError> {
    let name = "eh_proj";
    let n = plan.n_embd;
    let row = ty.bytes_for(2 * n as u64).unwrap_or(0) as usize;
    if row == 0 || out.len() != row * n {
        return Err(SynthError(format!(
            "{name}: {} bytes are not {n} rows of {} values",
            out.len(),
            2 * n
        )));
    }
    let mut rng = Rng::new(tensor_seed);
    let rms = HIDDEN_SHARE / (n as f32).sqrt();
    let mut x = vec![0f32; 2 * n];
    for (j, dst) in out.chunks_exact_mut(row).enumerate() {
        x[..n].fill(0.0);
        if j < n / 2 {
            x[j] = 1.0;
        }
        x[n..].iter_mut().for_each(|v| *v = rms * rng.normal());
        encode(ty, &x, dst, name)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::plan::TypeChoice;
    use crate::synth::shapes::find_shape;
    use crate::synth::SynthOptions;

    fn tiny(rate: f32) -> Synthesis {
        let shape = find_shape("qwen35moe", "tiny").expect("tiny");
        Synthesis::prepare(&SynthOptions {
            types: TypeChoice {
                default: GgmlType::Q4_K,
                overrides: Vec::new(),
            },
            shape,
            seed: 4,
            route_skew: 0.0,
        })
        .expect("prepare")
        .with_draft_agreement(rate)
        .expect("a draft block")
    }

    #[test]
    fn the_next_tokens_make_one_cycle_through_the_ordinary_tokens() {
        let s = tiny(0.5);
        let plan = s.agreement.as_ref().expect("plan");
        let v = &s.vocab;
        let ordinary = |t: u32| v.token_types[t as usize] == token_type::NORMAL;
        let n_ordinary = (0..v.len() as u32).filter(|&t| ordinary(t)).count();
        let start = (0..v.len() as u32).find(|&t| ordinary(t)).expect("a token");
        let (mut t, mut steps) = (start, 0);
        loop {
            t = plan.next[t as usize];
            steps += 1;
            assert!(ordinary(t), "token {t} in the cycle");
            if t == start {
                break;
            }
        }
        assert_eq!(steps, n_ordinary, "one cycle through every ordinary token");
        assert!((0..v.len()).all(|t| ordinary(plan.next[t])));
        assert_eq!(plan.n_known(), (0.5 * v.len() as f64).round() as usize);
        // Q4_K cannot hold the exact values: the embedding and eh_proj are Q8_0, the rest as asked.
        let names: Vec<&str> = plan.retyped.iter().map(|r| r.0.as_str()).collect();
        assert_eq!(names, ["token_embd.weight", "blk.4.nextn.eh_proj.weight"]);
        assert!(plan.retyped.iter().all(|r| r.2 == GgmlType::Q8_0));
    }

    #[test]
    fn embeddings_are_the_heads_rows_of_the_next_token_in_their_half() {
        let s = tiny(0.5);
        let plan = s.agreement.as_ref().expect("plan");
        let idx = |role: Role| {
            s.tensors
                .iter()
                .position(|t| t.desc.role == role)
                .expect("tensor")
        };
        let bytes = |i: usize| {
            let t = &s.tensors[i];
            let mut b = vec![0u8; t.ty.bytes_for(t.desc.n_elements()).expect("bytes") as usize];
            fill::fill_tensor(t, i, s.seed, &[], &mut b).expect("fill");
            let mut f = vec![0f32; t.desc.n_elements() as usize];
            quant::dequantize(t.ty, &b, &mut f).expect("dequantize");
            f
        };
        let (embd, head) = (bytes(idx(Role::TokenEmbd)), bytes(idx(Role::Output)));
        let n = plan.n_embd;
        for t in [0usize, 7, 300, 1999] {
            let e = &embd[t * n..(t + 1) * n];
            let o = &head[plan.next[t] as usize * n..(plan.next[t] as usize + 1) * n];
            let half = plan.half(t);
            let rms = (e.iter().map(|v| v * v).sum::<f32>() / n as f32).sqrt();
            assert!((rms - 1.0).abs() < 0.01, "token {t}: RMS {rms}");
            let dot: f32 = half.clone().map(|i| e[i] * o[i]).sum();
            let no: f32 = half.clone().map(|i| o[i] * o[i]).sum::<f32>().sqrt();
            let cos = dot / (no * (n as f32).sqrt());
            // Q8_0 rounding: a few parts per thousand.
            assert!(cos > 0.995, "token {t}: cosine {cos} with the head's row");
            assert!((0..n).filter(|i| !half.contains(i)).all(|i| e[i] == 0.0));
        }
        // eh_proj passes the first half of the token's embedding, weight 1.
        let eh = bytes(idx(Role::NextnEhProj));
        assert!((eh[3 * 2 * n + 3] - 1.0).abs() < 1e-3);
        assert_eq!(eh[(n / 2 + 3) * 2 * n + n / 2 + 3], 0.0);
    }

    #[test]
    fn models_without_a_draft_block_and_shares_out_of_range_are_refused() {
        let shape = find_shape("qwen3moe", "tiny").expect("tiny");
        let s = Synthesis::prepare(&SynthOptions {
            types: TypeChoice {
                default: GgmlType::Q8_0,
                overrides: Vec::new(),
            },
            shape,
            seed: 4,
            route_skew: 0.0,
        })
        .expect("prepare");
        let e = s.with_draft_agreement(0.5).expect_err("no draft block");
        assert!(e.0.contains("draft block"), "{e}");
        let shape = find_shape("qwen35moe", "tiny").expect("tiny");
        let s = Synthesis::prepare(&SynthOptions {
            types: TypeChoice {
                default: GgmlType::Q8_0,
                overrides: Vec::new(),
            },
            shape,
            seed: 4,
            route_skew: 0.0,
        })
        .expect("prepare");
        assert!(s.with_draft_agreement(1.5).is_err());
    }
}
