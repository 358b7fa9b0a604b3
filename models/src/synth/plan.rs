//! What `synth` writes for each tensor: its type (the class's choice, then llama.cpp's quantizer fallback
//! when the type's block does not divide a row) and how its values are drawn (the scale that keeps
//! activations of order 1 and makes the model confident).
//!
//! Scaling, reasoned per block (every block is pre-normed, so its input has RMS ≈ 1):
//! - a projection of fan-in `n` with weights of RMS `1/sqrt(n)` keeps RMS ≈ 1 (random matrices preserve
//!   norms on average); so every matrix gets `gain / sqrt(fan_in)`, gains near 1;
//! - the residual stream therefore grows by O(1) per block and stays finite; the final RMS norm brings
//!   it back to RMS ≈ `|output_norm|`;
//! - logits are then ≈ N(0, σ²) with σ = `out_rms · |output_norm| · sqrt(n_embd)`. The mean top-1
//!   probability of a softmax over V Gaussians of spread σ is ≈ 0.5 at σ ≈ 1.3·sqrt(2 ln V) (measured
//!   by simulation: V = 2k → σ ≈ 5, V = 150k–260k → σ ≈ 6.5), so that σ is the target: the model is
//!   confident without being one-hot;
//! - Gemma ties the output to the embedding and scales embeddings by `sqrt(n_embd)`: if the embedding
//!   dominated the residual stream, the current token would win every prediction (its logit is
//!   `sqrt(n_embd)` times the others' spread). So the embedding is kept small against the blocks' output
//!   (each post-norm adds RMS ≈ 1), its self-logit about 0.5σ (more makes greedy decoding repeat the last token), and the output norm's weight carries
//!   the logit scale instead.

use std::sync::Arc;

use poly_kernels::quant::GgmlType;

use super::agree::AgreementPlan;

use crate::arch::{gemma4, ArchHparams, Dim, ModelHparams, Role, TensorClass, TensorDesc};

/// How a tensor's values are drawn.
#[derive(Clone, Debug, PartialEq)]
pub enum Init {
    /// Random valid blocks of the tensor's type, zero mean, this RMS.
    Random { rms: f32 },
    /// Norm weights: `mean` plus Gaussian noise of RMS `noise` (F32).
    Norm { mean: f32, noise: f32 },
    /// Gaussian values of this RMS written as F32 (small vectors and the conv kernel).
    Gaussian { rms: f32 },
    /// Uniform in `[lo, hi)` (F32): the delta-net's A (negative) and dt bias.
    Uniform { lo: f32, hi: f32 },
    /// The router of block `layer`, generated ahead (it is simulated before writing).
    Router { layer: u32 },
    /// `a` for the first `first` values, `b` after them (F32): Gemma 4's RoPE factors, 1 for the pairs
    /// that turn and 1e30 for those that do not.
    Steps { first: u64, a: f32, b: f32 },
    /// Rows of `per_row` distinct expert ids below `n_expert` (I32): DeepSeek V4's hash routing, one row
    /// per token.
    ExpertIds { n_expert: u32, per_row: u32 },
    /// The token embedding of a model whose draft block agrees with it at a chosen rate
    /// ([`super::agree`]): each row the output head's row of the token's next token, in its half.
    AgreeingEmbedding(Arc<AgreementPlan>),
    /// That model's draft-block `eh_proj`: the first half of the token's embedding passed through, the
    /// hidden row projected at random ([`super::agree`]).
    AgreeingEhProj(Arc<AgreementPlan>),
}

/// One tensor as it will be written.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedTensor {
    pub desc: TensorDesc,
    pub ty: GgmlType,
    /// The type asked for, when llama.cpp's fallback replaced it.
    pub fell_back_from: Option<GgmlType>,
    pub init: Init,
}

/// The type chosen for each class.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeChoice {
    /// Type of every quantizable class without an override.
    pub default: GgmlType,
    /// `--types CLASS=TYPE` overrides.
    pub overrides: Vec<(TensorClass, GgmlType)>,
}

/// Float types routers may be written in (llama.cpp never quantizes them, and the skew needs exact
/// values).
pub const ROUTER_TYPES: &[GgmlType] = &[GgmlType::F32, GgmlType::F16, GgmlType::BF16];

impl TypeChoice {
    /// The type asked for tensors of `class` (before any fallback).
    pub fn for_class(&self, class: TensorClass) -> GgmlType {
        if let Some(t) = class.fixed_type() {
            return t;
        }
        if let Some(&(_, t)) = self.overrides.iter().rev().find(|(c, _)| *c == class) {
            return t;
        }
        match class {
            TensorClass::Router => GgmlType::F32,
            _ => self.default,
        }
    }
}

/// llama.cpp's quantizer fallback (`tensor_type_fallback` in `src/llama-quant.cpp`): the type used when
/// `ty`'s block does not divide a row of `ne0` values.
pub fn fallback_type(ty: GgmlType, ne0: u64) -> GgmlType {
    if ne0.is_multiple_of(ty.block_elems() as u64) {
        return ty;
    }
    use GgmlType::*;
    let fb = match ty {
        IQ1_S | IQ1_M | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S | IQ4_XS => IQ4_NL,
        Q2_K | Q3_K | TQ1_0 | TQ2_0 => Q4_0,
        Q4_K => Q5_0,
        Q5_K => Q5_1,
        Q6_K => Q8_0,
        other => other,
    };
    if ne0.is_multiple_of(fb.block_elems() as u64) {
        fb
    } else {
        F16
    }
}

/// The logit spread σ at which the mean top-1 probability over `n_vocab` Gaussian logits is about 0.5.
pub fn target_logit_sigma(n_vocab: u64) -> f32 {
    1.3 * (2.0 * (n_vocab.max(2) as f32).ln()).sqrt()
}

/// How far above the other logits (in units of their spread σ) a tied-output model puts the current
/// token: at 1.5 greedy decoding of the synthetic Gemma repeated tokens ("two two two"), at 0.5 it does not.
const SELF_LOGIT_SIGMAS: f32 = 0.5;

/// Embedding RMS and output-norm weight of a tied-output (Gemma) model: the embedding's input scale
/// `A = rms · sqrt(n_embd)` is set so the current token's own logit is ≈ 0.5σ while the blocks' outputs
/// (RMS ≈ sqrt(2 · n_layer) after all post-norms) dominate the stream; the output norm scales the logits
/// to σ.
pub fn tied_embedding_scales(n_embd: u64, n_layer: u32, n_vocab: u64) -> (f32, f32) {
    let sigma = target_logit_sigma(n_vocab);
    let acc = (2.0 * n_layer as f32).sqrt();
    let a = SELF_LOGIT_SIGMAS * acc / (n_embd as f32).sqrt();
    let emb_rms = a / (n_embd as f32).sqrt();
    (emb_rms, sigma / a)
}

/// Gain of the token-mixing outputs of a model whose routers are calibrated on its forward pass
/// ([`super::Synthesis::with_mixing_gain`]): at 0.3 the sequence-common part of qwen3moe's router inputs
/// grows about linearly with depth and stays near 1% of the states' variance over 8 layers (at 1.0 it
/// compounds to a third by the 8th layer, at 0.5 it still compounds).
pub const CALIBRATED_MIXING_GAIN: f32 = 0.3;

/// Noise RMS of norm weights around their mean.
const NORM_NOISE: f32 = 0.02;

/// The values of every tensor of `hp`'s model: types and draws.
pub fn plan(hp: &ModelHparams, descs: Vec<TensorDesc>, types: &TypeChoice) -> Vec<PlannedTensor> {
    let h = hp.as_dyn();
    let n_embd = h.dim(Dim::Embd).unwrap_or(1);
    let n_vocab = h.dim(Dim::Vocab).unwrap_or(2);
    let sigma = target_logit_sigma(n_vocab);
    let (emb_rms, out_norm) = match hp {
        ModelHparams::Gemma3(g) => tied_embedding_scales(n_embd, g.n_layer, n_vocab),
        ModelHparams::Gemma4(g) => tied_embedding_scales(n_embd, g.n_layer, n_vocab),
        // Llama does not scale its embedding by sqrt(n_embd): divide that factor out of the rows' RMS.
        ModelHparams::Llama(l) if l.tied_output => {
            let (rms, norm) = tied_embedding_scales(n_embd, l.n_layer, n_vocab);
            (rms * (n_embd as f32).sqrt(), norm)
        }
        // LFM2 ties its output too and does not scale its embedding: the rows carry Gemma's input scale
        // (times sqrt(n_embd)), so the output norm's weight is divided by it to keep the logits' spread.
        ModelHparams::Lfm2Moe(l) => {
            let (rms, norm) = tied_embedding_scales(n_embd, l.n_layer, n_vocab);
            let s = (n_embd as f32).sqrt();
            (rms * s, norm / s)
        }
        _ => (1.0, 1.0),
    };
    descs
        .into_iter()
        .map(|desc| {
            let asked = if desc.dims.len() == 1 {
                // llama.cpp never quantizes vectors.
                GgmlType::F32
            } else {
                types.for_class(desc.class)
            };
            let ty = fallback_type(asked, desc.dims[0]);
            let fan_in = desc.dims[0] as f32;
            let init = match desc.role {
                Role::TokenEmbd | Role::NextnEmbedTokens => Init::Random { rms: emb_rms },
                Role::Output | Role::NextnSharedHeadHead => Init::Random {
                    rms: sigma / (n_embd as f32).sqrt(),
                },
                Role::OutputNorm | Role::OutputNormLfm2 | Role::NextnSharedHeadNorm => Init::Norm {
                    mean: out_norm,
                    noise: NORM_NOISE * out_norm,
                },
                Role::FfnGateInp => Init::Router {
                    layer: desc.layer.unwrap_or(0),
                },
                Role::FfnGateTid2eid => Init::ExpertIds {
                    n_expert: h.dim(Dim::Expert).unwrap_or(1) as u32,
                    per_row: desc.dims[0] as u32,
                },
                // Attention sinks: one logit per head beside the scores, of their order.
                Role::AttnSinks => Init::Gaussian { rms: 1.0 },
                Role::FfnGateInpShexp => Init::Gaussian {
                    rms: 1.0 / fan_in.sqrt(),
                },
                // Kernel of 4 taps of RMS 0.5 (LFM2's short one: 3 of 0.58): the conv keeps RMS ≈ 1.
                Role::SsmConv1d | Role::ShortConvConv => Init::Gaussian {
                    rms: 1.0 / fan_in.sqrt(),
                },
                // The experts' selection bias: against sigmoid probabilities spread about ±0.25 it
                // changes some choices, so a forward pass that ignores it is told apart.
                Role::FfnExpProbsB => Init::Gaussian { rms: 0.1 },
                // A = -exp(A_log): decay exp(A · softplus(alpha + dt)) ≈ 0.6–0.95 per token.
                Role::SsmA => Init::Uniform { lo: -2.0, hi: -0.5 },
                Role::SsmDt => Init::Uniform { lo: -2.0, hi: -1.0 },
                // Gemma 4's global blocks turn a quarter of each head ("proportional" RoPE with
                // partial_rotary_factor 0.25, as its converter writes the factors).
                Role::RopeFreqs if matches!(hp, ModelHparams::Gemma4(_)) => Init::Steps {
                    first: desc.dims[0] / 4,
                    a: 1.0,
                    b: gemma4::UNROTATED_FACTOR,
                },
                // Llama 3.1's factors run from 1 (short wavelengths) to 8 (long ones).
                Role::RopeFreqs => Init::Uniform { lo: 1.0, hi: 8.0 },
                // Gemma 4's router input is the normed state over sqrt(n_embd), times this scale: about
                // sqrt(n_embd) gives the router an input of RMS 1, as the other routers get.
                Role::FfnGateInpScale => Init::Norm {
                    mean: (n_embd as f32).sqrt(),
                    noise: NORM_NOISE * (n_embd as f32).sqrt(),
                },
                // Per-expert output scales and block output scales: spread, so that dropping one
                // shows.
                Role::FfnDownExpsScale => Init::Uniform { lo: 0.5, hi: 1.5 },
                Role::LayerOutScale => Init::Uniform { lo: 0.5, hi: 1.0 },
                // Biases of the order of the projections' outputs, so that dropping one shows.
                r if r.is_projection_bias() => Init::Gaussian { rms: 0.3 },
                // alpha feeds a softplus next to dt: keep it moderate.
                Role::SsmAlpha => Init::Random {
                    rms: 0.5 / fan_in.sqrt(),
                },
                _ if desc.class == TensorClass::Norm => Init::Norm {
                    mean: 1.0,
                    noise: NORM_NOISE,
                },
                _ => Init::Random {
                    rms: 1.0 / fan_in.sqrt(),
                },
            };
            PlannedTensor {
                fell_back_from: (ty != asked).then_some(asked),
                desc,
                ty,
                init,
            }
        })
        .collect()
}

/// Total and active parameters: active counts `n_expert_used` of the routed experts.
pub fn param_counts(hp: &dyn ArchHparams, tensors: &[PlannedTensor]) -> (u64, u64) {
    let n_expert = hp.dim(Dim::Expert).unwrap_or(0);
    let total: u64 = tensors.iter().map(|t| t.desc.n_elements()).sum();
    let experts: u64 = tensors
        .iter()
        .filter(|t| t.desc.class == TensorClass::Expert)
        .map(|t| t.desc.n_elements())
        .sum();
    let used = hp.n_expert_used() as u64;
    let active = match n_expert {
        0 => total,
        n => total - experts + experts / n * used,
    };
    (total, active)
}

/// A parameter count in the naming convention's style, truncated: `30B`, `268M`, `3B`.
pub fn count_label(n: u64) -> String {
    let (unit, suffix) = match n {
        n if n >= 1_000_000_000_000 => (1e12, "T"),
        n if n >= 1_000_000_000 => (1e9, "B"),
        n if n >= 1_000_000 => (1e6, "M"),
        _ => (1e3, "K"),
    };
    format!("{}{suffix}", (n as f64 / unit).floor() as u64)
}

/// `general.size_label`: `30B-A3B` for MoE models, `268M` otherwise.
pub fn size_label(total: u64, active: u64) -> String {
    if active < total {
        format!("{}-A{}", count_label(total), count_label(active))
    } else {
        count_label(total)
    }
}

/// llama.cpp's `general.file_type` (`llama_ftype`) for a file whose main weight type is `ty`.
pub fn file_type(ty: GgmlType) -> u32 {
    use GgmlType::*;
    match ty {
        F32 => 0,
        F16 => 1,
        Q4_0 => 2,
        Q4_1 => 3,
        Q8_0 => 7,
        Q5_0 => 8,
        Q5_1 => 9,
        Q2_K => 10,
        Q3_K => 12,
        Q4_K => 15,
        Q5_K => 17,
        Q6_K => 18,
        IQ2_XXS => 19,
        IQ2_XS => 20,
        IQ3_XXS => 23,
        IQ1_S => 24,
        IQ4_NL => 25,
        IQ3_S => 26,
        IQ2_S => 28,
        IQ4_XS => 30,
        IQ1_M => 31,
        BF16 => 32,
        TQ1_0 => 36,
        TQ2_0 => 37,
        MXFP4 => 38,
        _ => 1024,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_follows_llama_cpp() {
        assert_eq!(fallback_type(GgmlType::Q4_K, 2048), GgmlType::Q4_K);
        assert_eq!(fallback_type(GgmlType::Q4_K, 640), GgmlType::Q5_0);
        assert_eq!(fallback_type(GgmlType::Q6_K, 640), GgmlType::Q8_0);
        assert_eq!(fallback_type(GgmlType::IQ2_XS, 64), GgmlType::IQ4_NL);
        assert_eq!(fallback_type(GgmlType::Q8_0, 48), GgmlType::F16);
        assert_eq!(fallback_type(GgmlType::Q4_K, 4), GgmlType::F16);
    }

    #[test]
    fn labels() {
        assert_eq!(size_label(30_532_122_624, 3_348_000_000), "30B-A3B");
        assert_eq!(size_label(268_098_176, 268_098_176), "268M");
        assert_eq!(count_label(11_500), "11K");
    }

    #[test]
    fn logit_sigma_grows_with_vocab() {
        let a = target_logit_sigma(2048);
        let b = target_logit_sigma(248_320);
        assert!(
            (4.5..5.5).contains(&a) && (6.0..7.0).contains(&b),
            "{a} {b}"
        );
    }
}
