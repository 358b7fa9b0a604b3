//! LFM2 MoE (`lfm2moe`: LFM2-8B-A1B, LFM2.5-24B-A2B).
//!
//! A hybrid of two kinds of pre-norm blocks, which the file tells apart by `attention.head_count_kv`
//! (0 in a short-convolution block, as llama.cpp's converter writes it and its loader reads it):
//! - gated short convolution: one input projection gives three `n_embd`-wide parts B, C and x; `B ⊙ x`
//!   runs through a causal depthwise convolution of `shortconv.l_cache` taps over time (the state keeps the
//!   last `l_cache - 1` inputs), then `C ⊙ conv` goes through the output projection. No activation;
//! - grouped-query attention with per-head RMS-normed Q and K and NeoX RoPE (the Q and output projections
//!   are `n_embd` wide: `n_head · head_dim = n_embd`).
//!
//! Each block's mixer output is added to the residual stream, then the FFN of its normed sum: a dense
//! SwiGLU in the first `leading_dense_block_count` blocks, a mixture of experts after them, routed by
//! `expert_gating_func` (sigmoid in the released models) with a per-expert selection bias (`exp_probs_b`,
//! which chooses the experts but does not weigh them), the chosen weights renormalized (llama.cpp passes
//! `norm_w = true` for LFM2 whatever the file says; it reads no weight scale). No shared expert. The
//! final norm is `token_embd_norm.weight` (llama.cpp's `LLM_TENSOR_OUTPUT_NORM_LFM2`); the output
//! matrix is the token embedding when the file has no `output.weight`.
//!
//! Follows llama.cpp's `src/models/lfm2moe.cpp` (hyperparameters, tensors) and `src/models/lfm2.cpp` (the
//! graph, shared by both LFM2 architectures). What llama.cpp accepts there and this file does not compute
//! is refused with the reason: gating functions other than softmax and sigmoid, a non-causal file
//! (`attention.causal` false: LFM2's embedding models, whose convolution is centred), non-linear RoPE
//! scaling. A fused `attn_qkv` projection lacks `attn_q`, so such a file fails to bind; projection biases
//! and the ColBERT `dense_2` head are not read (no released `lfm2moe` file has them).

use super::common::{rope_freq_scale, CommonHparams, ExpertHparams};
use super::graph::{Forward, ModelInfo, StateSpec, TensorMap};
use super::{
    arch_kv, check, def, uniform_u32_req, ArchError, ArchHparams, Dim, LayerKind, LayerSel,
    Presence, Role, TensorClass, TensorDef,
};
use crate::compute::{Attention, Compute, Gating, Moe, Rope, RopeKind, Unary, WeightId};
use crate::gguf::{Metadata, Value};

/// `general.architecture`.
pub const ARCH: &str = "lfm2moe";

/// Hyperparameters of an `lfm2moe` model.
#[derive(Clone, Debug, PartialEq)]
pub struct Lfm2MoeHparams {
    /// Vocabulary size (length of `tokenizer.ggml.tokens`, else `vocab_size`).
    pub n_vocab: u64,
    /// `context_length`.
    pub n_ctx_train: u32,
    /// `embedding_length`.
    pub n_embd: u32,
    /// `block_count`.
    pub n_layer: u32,
    /// `feed_forward_length`: the dense leading blocks' FFN width (0 when the file has none).
    pub n_ff: u32,
    /// `attention.head_count`.
    pub n_head: u32,
    /// `attention.head_count_kv` of the attention blocks.
    pub n_head_kv: u32,
    /// Head size: `n_embd / n_head` unless `attention.key_length` says otherwise (it must still make
    /// `n_head · head_dim = n_embd`, the width of llama.cpp's Q and output projections).
    pub head_dim: u32,
    /// `rope.dimension_count`, default `head_dim`.
    pub rope_dim: u32,
    /// `rope.freq_base`.
    pub rope_freq_base: f32,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// `expert_count`.
    pub n_expert: u32,
    /// `expert_used_count`.
    pub n_expert_used: u32,
    /// `expert_feed_forward_length` (required, as llama.cpp's loader reads it for `lfm2moe`).
    pub n_ff_exp: u32,
    /// `leading_dense_block_count`, default 0: blocks `0..n` have a dense FFN, the rest experts.
    pub n_dense_lead: u32,
    /// `expert_gating_func` (1 softmax, 2 sigmoid; required).
    pub gating: Gating,
    /// `shortconv.l_cache`: the short convolution's taps (the state holds one fewer inputs).
    pub conv_l_cache: u32,
    /// Which blocks are attention (`attention.head_count_kv` above 0); the others convolve.
    pub attention_layers: Vec<bool>,
}

use Dim::*;
use TensorClass as C;

const ALL: Option<LayerSel> = Some(LayerSel::All);
const ATT: Option<LayerSel> = Some(LayerSel::Attention);
const CONV: Option<LayerSel> = Some(LayerSel::Recurrent);
const DENSE: Option<LayerSel> = Some(LayerSel::DenseFfn);
const MOE: Option<LayerSel> = Some(LayerSel::MoeFfn);

/// The tensors of an `lfm2moe` file (llama.cpp's `llama_model_lfm2moe::load_arch_tensors`), in the order
/// llama.cpp creates them within a block.
pub const TENSORS: &[TensorDef] = &[
    def(Role::TokenEmbd, None, &[Embd, Vocab], C::Embedding), // [n_embd, n_vocab]
    // The final norm, under LFM2's name (token_embd_norm), applied after the last block.
    def(Role::OutputNormLfm2, None, &[Embd], C::Norm), // [n_embd]
    // Absent: the output is the token embedding (TENSOR_DUPLICATED).
    TensorDef {
        presence: Presence::Optional,
        ..def(Role::Output, None, &[Embd, Vocab], C::Output) // [n_embd, n_vocab]
    },
    // The FFN's input norm, every block.
    def(Role::FfnNorm, ALL, &[Embd], C::Norm), // [n_embd]
    // Routed experts (blocks from leading_dense_block_count on).
    def(Role::FfnGateInp, MOE, &[Embd, Expert], C::Router), // [n_embd, n_expert]: router
    def(Role::FfnGateExps, MOE, &[Embd, FfExp, Expert], C::Expert), // [n_embd, n_ff_exp, n_expert]
    def(Role::FfnDownExps, MOE, &[FfExp, Embd, Expert], C::Expert), // [n_ff_exp, n_embd, n_expert]
    def(Role::FfnUpExps, MOE, &[Embd, FfExp, Expert], C::Expert), // [n_embd, n_ff_exp, n_expert]
    // Per-expert bias added to the router's probabilities to choose the experts (not to weigh them).
    def(Role::FfnExpProbsB, MOE, &[Expert], C::Router), // [n_expert], F32
    // Dense SwiGLU FFN (the leading blocks).
    def(Role::FfnGate, DENSE, &[Embd, Ff], C::Ffn), // [n_embd, n_ff]
    def(Role::FfnDown, DENSE, &[Ff, Embd], C::Ffn), // [n_ff, n_embd]
    def(Role::FfnUp, DENSE, &[Embd, Ff], C::Ffn),   // [n_embd, n_ff]
    // The mixer's input norm ("operator norm"), every block.
    def(Role::AttnNorm, ALL, &[Embd], C::Norm), // [n_embd]
    // Attention blocks: per-head Q/K norms, Q/K/V, output.
    def(Role::AttnQNorm, ATT, &[HeadK], C::Norm), // [head_dim]
    def(Role::AttnKNorm, ATT, &[HeadK], C::Norm), // [head_dim]
    def(Role::AttnQ, ATT, &[Embd, Embd], C::Attention), // [n_embd, n_embd] (= n_head · head_dim)
    def(Role::AttnK, ATT, &[Embd, KProj], C::Attention), // [n_embd, n_head_kv · head_dim]
    def(Role::AttnV, ATT, &[Embd, VProj], C::Attention), // [n_embd, n_head_kv · head_dim]
    def(Role::AttnOut, ATT, &[Embd, Embd], C::Attention), // [n_embd, n_embd]
    // Short-convolution blocks: the kernel (F32: ggml_ssm_conv's, and llama.cpp never quantizes it),
    // the input projection to B, C and x, the output projection.
    def(
        Role::ShortConvConv,
        CONV,
        &[SsmConvKernel, Embd],
        C::DeltaNetParam,
    ), // [l_cache, n_embd]
    def(Role::ShortConvInProj, CONV, &[Embd, Embd3], C::ShortConv), // [n_embd, 3 · n_embd]
    def(Role::ShortConvOutProj, CONV, &[Embd, Embd], C::ShortConv), // [n_embd, n_embd]
];

/// `expert_gating_func` as llama.cpp numbers it (`llama_expert_gating_func_type`).
fn gating_from_key(v: u32) -> Result<Gating, ArchError> {
    match v {
        1 => Ok(Gating::Softmax),
        2 => Ok(Gating::Sigmoid),
        3 => Err(ArchError(format!(
            "{ARCH}: expert_gating_func 3 (softmax over the chosen weights) is not supported yet"
        ))),
        4 => Err(ArchError(format!(
            "{ARCH}: expert_gating_func 4 (sqrt-softplus) is not supported yet"
        ))),
        other => Err(ArchError(format!(
            "{ARCH}: expert_gating_func {other} is not a gating function llama.cpp runs"
        ))),
    }
}

fn gating_key(g: Gating) -> u32 {
    match g {
        Gating::Softmax => 1,
        Gating::Sigmoid => 2,
    }
}

impl Lfm2MoeHparams {
    /// Reads the hyperparameters from a file's metadata (the keys llama.cpp's loader reads).
    pub fn from_metadata(md: &Metadata) -> Result<Self, ArchError> {
        let c = CommonHparams::read_hybrid(md, ARCH)?;
        let n_layer = c.n_layer_all;
        let kv = md
            .arch_u32_per_layer_opt("attention.head_count_kv", n_layer as usize)?
            .unwrap_or_else(|| vec![c.n_head_kv; n_layer as usize]);
        let n_ff = c.n_ff_opt(md)?;
        let e = ExpertHparams::read(md, ARCH, &c, n_ff)?;
        check(
            ARCH,
            md.arch_bool_opt("attention.causal")? != Some(false),
            "attention.causal is false (a centred convolution and bidirectional attention): not supported",
        )?;
        let hp = Lfm2MoeHparams {
            n_vocab: c.n_vocab,
            n_ctx_train: c.n_ctx_train,
            n_embd: c.n_embd,
            n_layer,
            n_ff,
            n_head: c.n_head,
            n_head_kv: c.n_head_kv,
            head_dim: c.head_dim(ARCH)?,
            rope_dim: c.n_rot,
            rope_freq_base: c.rope_freq_base,
            rms_eps: c.rms_eps,
            n_expert: e.n_expert,
            n_expert_used: e.n_expert_used,
            // llama.cpp reads it required for lfm2moe (no default from the FFN length).
            n_ff_exp: uniform_u32_req(md, "expert_feed_forward_length", n_layer)?,
            n_dense_lead: md.arch_u32_opt("leading_dense_block_count")?.unwrap_or(0),
            gating: gating_from_key(md.arch_u32("expert_gating_func")?)?,
            conv_l_cache: md.arch_u32("shortconv.l_cache")?,
            attention_layers: kv.iter().map(|&v| v > 0).collect(),
        };
        hp.validate()?;
        Ok(hp)
    }

    /// Whether block `il` is a short-convolution block.
    pub fn is_conv(&self, il: u32) -> bool {
        !self
            .attention_layers
            .get(il as usize)
            .copied()
            .unwrap_or(true)
    }

    fn has_moe_blocks(&self) -> bool {
        self.n_dense_lead < self.n_layer
    }
}

impl ArchHparams for Lfm2MoeHparams {
    fn arch_name(&self) -> &'static str {
        ARCH
    }

    fn tensor_defs(&self) -> &'static [TensorDef] {
        TENSORS
    }

    fn n_layer_all(&self) -> u32 {
        self.n_layer
    }

    fn layer_kind(&self, il: u32) -> LayerKind {
        if self.is_conv(il) {
            LayerKind::Recurrent
        } else {
            LayerKind::Attention
        }
    }

    fn dense_ffn(&self, il: u32) -> bool {
        il < self.n_dense_lead
    }

    fn dim(&self, d: Dim) -> Option<u64> {
        let v = match d {
            Embd => self.n_embd as u64,
            Embd3 => 3 * self.n_embd as u64,
            Vocab => self.n_vocab,
            Ff => self.n_ff as u64,
            FfExp => self.n_ff_exp as u64,
            Expert => self.n_expert as u64,
            HeadK => self.head_dim as u64,
            KProj | VProj => (self.n_head_kv * self.head_dim) as u64,
            SsmConvKernel => self.conv_l_cache as u64,
            _ => return None,
        };
        Some(v)
    }

    fn n_expert_used(&self) -> u32 {
        self.n_expert_used
    }

    fn synth_writes(&self, _role: Role) -> bool {
        // LFM2 files tie the output to the embedding (no output.weight).
        false
    }

    fn to_metadata(&self) -> Vec<(String, Value)> {
        let kv_heads = self
            .attention_layers
            .iter()
            .map(|&a| if a { self.n_head_kv } else { 0 });
        let mut kv = vec![
            arch_kv(ARCH, "context_length", self.n_ctx_train),
            arch_kv(ARCH, "embedding_length", self.n_embd),
        ];
        if self.n_ff > 0 {
            kv.push(arch_kv(ARCH, "feed_forward_length", self.n_ff));
        }
        kv.extend([
            arch_kv(ARCH, "block_count", self.n_layer),
            arch_kv(ARCH, "attention.head_count", self.n_head),
            arch_kv(ARCH, "attention.head_count_kv", Value::u32_array(kv_heads)),
            arch_kv(ARCH, "rope.dimension_count", self.rope_dim),
            arch_kv(ARCH, "rope.freq_base", self.rope_freq_base),
            arch_kv(ARCH, "attention.layer_norm_rms_epsilon", self.rms_eps),
            arch_kv(ARCH, "expert_count", self.n_expert),
            arch_kv(ARCH, "expert_used_count", self.n_expert_used),
            arch_kv(ARCH, "expert_feed_forward_length", self.n_ff_exp),
            arch_kv(ARCH, "leading_dense_block_count", self.n_dense_lead),
            arch_kv(ARCH, "expert_gating_func", gating_key(self.gating)),
            arch_kv(ARCH, "shortconv.l_cache", self.conv_l_cache),
        ]);
        kv
    }

    fn common(&self) -> CommonHparams {
        CommonHparams {
            n_vocab: self.n_vocab,
            n_ctx_train: self.n_ctx_train,
            n_embd: self.n_embd,
            n_layer_all: self.n_layer,
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_k: self.head_dim,
            head_v: self.head_dim,
            n_rot: self.rope_dim,
            rms_eps: self.rms_eps,
            rope_freq_base: self.rope_freq_base,
        }
    }

    fn validate(&self) -> Result<(), ArchError> {
        self.common().validate(ARCH)?;
        check(
            ARCH,
            self.attention_layers.len() == self.n_layer as usize,
            "the attention blocks are not given for every block",
        )?;
        check(
            ARCH,
            self.n_head * self.head_dim == self.n_embd,
            "head_count × key_length differs from embedding_length (llama.cpp's Q and output \
             projections are embedding_length wide)",
        )?;
        check(
            ARCH,
            self.head_dim.is_multiple_of(2)
                && self.rope_dim.is_multiple_of(2)
                && self.rope_dim <= self.head_dim,
            "rope.dimension_count must be even and at most the head size",
        )?;
        check(
            ARCH,
            self.conv_l_cache > 1,
            "shortconv.l_cache must be above 1 (llama.cpp asserts it)",
        )?;
        check(
            ARCH,
            self.n_dense_lead <= self.n_layer,
            "leading_dense_block_count exceeds block_count",
        )?;
        check(
            ARCH,
            self.n_dense_lead == 0 || self.n_ff > 0,
            "dense leading blocks need feed_forward_length",
        )?;
        if self.has_moe_blocks() {
            check(
                ARCH,
                self.n_expert > 0 && self.n_expert_used > 0,
                "expert_count and expert_used_count must be > 0",
            )?;
            check(
                ARCH,
                self.n_expert_used <= self.n_expert,
                "expert_used_count exceeds expert_count",
            )?;
            check(ARCH, self.n_ff_exp > 0, "expert_feed_forward_length is 0")?;
        }
        check(
            ARCH,
            self.rms_eps > 0.0,
            "layer_norm_rms_epsilon must be positive",
        )
    }
}

/// An attention block's mixer.
#[derive(Clone, Debug)]
struct AttentionMixer {
    wq: WeightId,
    wk: WeightId,
    wv: WeightId,
    wo: WeightId,
    q_norm: WeightId,
    k_norm: WeightId,
}

/// A short-convolution block's mixer.
#[derive(Clone, Debug)]
struct ConvMixer {
    in_proj: WeightId,
    kernel: WeightId,
    out_proj: WeightId,
}

#[derive(Clone, Debug)]
enum Mixer {
    Attention(AttentionMixer),
    ShortConv(ConvMixer),
}

#[derive(Clone, Debug)]
enum Ffn {
    Dense {
        gate: WeightId,
        up: WeightId,
        down: WeightId,
    },
    Moe(Moe),
}

/// The weights of one block.
#[derive(Clone, Debug)]
struct Block {
    attn_norm: WeightId,
    mixer: Mixer,
    ffn_norm: WeightId,
    ffn: Ffn,
}

/// The forward pass of an `lfm2moe` model (llama.cpp's `llama_model_lfm2::graph`, causal, no sliding
/// window).
#[derive(Clone, Debug)]
pub struct Lfm2MoeGraph {
    hp: Lfm2MoeHparams,
    info: ModelInfo,
    tok_embd: WeightId,
    output_norm: WeightId,
    /// `output.weight`, or the token embedding when the file ties them.
    output: WeightId,
    blocks: Vec<Block>,
    rope: Rope,
}

impl Lfm2MoeGraph {
    /// Builds the forward pass from bound tensors.
    pub fn new(
        hp: Lfm2MoeHparams,
        t: &TensorMap,
        md: &Metadata,
    ) -> Result<Lfm2MoeGraph, ArchError> {
        let block = |il: u32| -> Result<Block, ArchError> {
            let mixer = if hp.is_conv(il) {
                Mixer::ShortConv(ConvMixer {
                    in_proj: t.layer(Role::ShortConvInProj, il)?,
                    kernel: t.layer(Role::ShortConvConv, il)?,
                    out_proj: t.layer(Role::ShortConvOutProj, il)?,
                })
            } else {
                Mixer::Attention(AttentionMixer {
                    wq: t.layer(Role::AttnQ, il)?,
                    wk: t.layer(Role::AttnK, il)?,
                    wv: t.layer(Role::AttnV, il)?,
                    wo: t.layer(Role::AttnOut, il)?,
                    q_norm: t.layer(Role::AttnQNorm, il)?,
                    k_norm: t.layer(Role::AttnKNorm, il)?,
                })
            };
            let ffn = if hp.dense_ffn(il) {
                Ffn::Dense {
                    gate: t.layer(Role::FfnGate, il)?,
                    up: t.layer(Role::FfnUp, il)?,
                    down: t.layer(Role::FfnDown, il)?,
                }
            } else {
                Ffn::Moe(Moe {
                    router: t.layer(Role::FfnGateInp, il)?,
                    gate_exps: t.layer(Role::FfnGateExps, il)?,
                    up_exps: t.layer(Role::FfnUpExps, il)?,
                    down_exps: t.layer(Role::FfnDownExps, il)?,
                    n_expert: hp.n_expert as usize,
                    n_expert_used: hp.n_expert_used as usize,
                    gating: hp.gating,
                    selection_bias: Some(t.layer(Role::FfnExpProbsB, il)?),
                    // llama.cpp's graph passes norm_w = true; lfm2moe reads no weight scale (0: none).
                    norm_weights: true,
                    weights_scale: 1.0,
                    act: Unary::Silu,
                })
            };
            Ok(Block {
                attn_norm: t.layer(Role::AttnNorm, il)?,
                mixer,
                ffn_norm: t.layer(Role::FfnNorm, il)?,
                ffn,
            })
        };
        let blocks = (0..hp.n_layer).map(block).collect::<Result<Vec<_>, _>>()?;
        let head_dim = hp.head_dim as usize;
        let rope = Rope {
            // LLM_ARCH_LFM2MOE is LLAMA_ROPE_TYPE_NEOX.
            kind: RopeKind::Neox,
            head_dim,
            n_rot: hp.rope_dim as usize,
            freq_base: hp.rope_freq_base,
            freq_scale: rope_freq_scale(md, ARCH)?,
            freq_factors: None,
            sections: None,
        };
        let info = ModelInfo::new(
            ARCH,
            hp.n_vocab as usize,
            hp.n_embd as usize,
            hp.n_ctx_train,
            md,
        )?;
        let tok_embd = t.global_req(Role::TokenEmbd)?;
        Ok(Lfm2MoeGraph {
            tok_embd,
            output_norm: t.global_req(Role::OutputNormLfm2)?,
            output: t.global(Role::Output).unwrap_or(tok_embd),
            blocks,
            rope,
            info,
            hp,
        })
    }

    /// The hyperparameters.
    pub fn hparams(&self) -> &Lfm2MoeHparams {
        &self.hp
    }

    /// The gated short convolution (llama.cpp's `build_shortconv_block`) on the normed input `x`.
    fn short_conv<C: Compute>(&self, c: &mut C, il: usize, m: &ConvMixer, x: &C::Act) -> C::Act {
        let n_embd = self.hp.n_embd as usize;
        let bcx = c.matmul(m.in_proj, x);
        let b = c.cols(&bcx, 0, n_embd);
        let gate_c = c.cols(&bcx, n_embd, n_embd);
        let input = c.cols(&bcx, 2 * n_embd, n_embd);
        let bx = c.mul(&b, &input);
        // Causal over time: the state holds the previous l_cache - 1 rows of B ⊙ x.
        let conv = c.ssm_conv(il, &bx, m.kernel);
        let y = c.mul(&gate_c, &conv);
        c.matmul(m.out_proj, &y)
    }

    /// The attention mixer (llama.cpp's `build_attn_block`) on the normed input `x`.
    fn attention<C: Compute>(
        &self,
        c: &mut C,
        il: usize,
        m: &AttentionMixer,
        x: &C::Act,
    ) -> C::Act {
        let hp = &self.hp;
        let head_dim = hp.head_dim as usize;
        let attn = Attention {
            n_head: hp.n_head as usize,
            n_head_kv: hp.n_head_kv as usize,
            head_dim_k: head_dim,
            head_dim_v: head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
            softcap: None,
            picture_rows_see_each_other: false,
        };
        let [q, k, v] = c.matmul_many([m.wq, m.wk, m.wv], x);
        let norms = [Some(m.q_norm), Some(m.k_norm)];
        let [q, k] = c.rms_norm_rope_pair([&q, &k], norms, hp.rms_eps, &self.rope);
        let out = c.attention(il, &q, &k, &v, &attn);
        c.matmul(m.wo, &out)
    }
}

impl Forward for Lfm2MoeGraph {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// A KV cache for each attention block, the convolution's last `l_cache - 1` inputs for each
    /// short-convolution block (a recurrent state without delta-rule heads).
    fn layer_states(&self) -> Vec<StateSpec> {
        let hp = &self.hp;
        self.blocks
            .iter()
            .map(|b| match b.mixer {
                Mixer::ShortConv(_) => StateSpec::Recurrent {
                    conv_kernel: hp.conv_l_cache as usize,
                    conv_channels: hp.n_embd as usize,
                    n_v_heads: 0,
                    head_k: 0,
                    head_v: 0,
                },
                Mixer::Attention(_) => StateSpec::Kv {
                    n_head_kv: hp.n_head_kv as usize,
                    head_dim_k: hp.head_dim as usize,
                    head_dim_v: hp.head_dim as usize,
                    window: None,
                },
            })
            .collect()
    }

    fn forward<C: Compute>(&self, c: &mut C) -> C::Act {
        let (n_embd, eps) = (self.hp.n_embd as usize, self.hp.rms_eps);
        let (tokens, out_rows) = {
            let b = c.batch();
            (b.tokens.to_vec(), b.output_rows())
        };
        let last = self.blocks.len() - 1;

        let mut inp = c.embed(self.tok_embd, &tokens);
        // The normed input of the next block (or of the output): each block's closing residual add comes
        // with it (`add_rms_norm`), so only the first block's norm stands alone.
        let mut cur = c.rms_norm(&inp, Some(self.blocks[0].attn_norm), eps, n_embd);
        for (il, b) in self.blocks.iter().enumerate() {
            // Every row goes through the mixer (the convolution's state and the KV cache need them all).
            let mut mixed = match &b.mixer {
                Mixer::ShortConv(m) => self.short_conv(c, il, m, &cur),
                Mixer::Attention(m) => self.attention(c, il, m, &cur),
            };
            // After the last block's mixer only the rows whose logits are wanted go on.
            if il == last && out_rows.len() < tokens.len() {
                mixed = c.rows(&mixed, &out_rows);
                inp = c.rows(&inp, &out_rows);
            }
            let (ffn_inp, ffn_in) = c.add_rms_norm(&mixed, &inp, Some(b.ffn_norm), eps, n_embd);
            let ffn_out = match &b.ffn {
                Ffn::Dense { gate, up, down } => {
                    let [g, u] = c.matmul_many([*gate, *up], &ffn_in);
                    let h = c.glu(&g, &u, Unary::Silu);
                    c.matmul(*down, &h)
                }
                Ffn::Moe(m) => c.moe(il, &ffn_in, m),
            };
            let next_norm = match self.blocks.get(il + 1) {
                Some(next) => next.attn_norm,
                None => self.output_norm,
            };
            (inp, cur) = c.add_rms_norm(&ffn_out, &ffn_inp, Some(next_norm), eps, n_embd);
        }
        c.matmul(self.output, &cur)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{resolve_tensors, ModelHparams};
    use crate::synth::shapes::find_shape;

    fn tiny() -> Lfm2MoeHparams {
        match find_shape(ARCH, "tiny").expect("the tiny shape").hparams {
            ModelHparams::Lfm2Moe(h) => h,
            other => panic!("an lfm2moe shape holds {other:?}"),
        }
    }

    use crate::arch::common::test_metadata::{metadata_of as md_of, set_key};

    type MetadataPairs = Vec<(String, Value)>;

    fn set(kv: &mut MetadataPairs, suffix: &str, v: Value) {
        set_key(kv, ARCH, suffix, v);
    }

    #[test]
    fn metadata_round_trips_and_the_blocks_come_from_head_count_kv() {
        let h = tiny();
        assert_eq!(
            Lfm2MoeHparams::from_metadata(&md_of(&h, |_| {})),
            Ok(h.clone())
        );
        // Blocks whose head_count_kv is 0 convolve; the others attend.
        let read = Lfm2MoeHparams::from_metadata(&md_of(&h, |kv| {
            set(
                kv,
                "attention.head_count_kv",
                Value::u32_array([0, 2, 2, 0]),
            )
        }))
        .expect("reads");
        assert_eq!(read.attention_layers, vec![false, true, true, false]);
        assert_eq!(read.layer_kind(0), LayerKind::Recurrent);
        assert_eq!(read.layer_kind(1), LayerKind::Attention);
        // leading_dense_block_count defaults to 0 (every block MoE), as llama.cpp reads it.
        let read = Lfm2MoeHparams::from_metadata(&md_of(&h, |kv| {
            kv.retain(|(k, _)| !k.ends_with("leading_dense_block_count"))
        }))
        .expect("reads");
        assert_eq!(read.n_dense_lead, 0);
        assert!(!read.dense_ffn(0));
    }

    #[test]
    fn the_table_gives_each_block_its_mixer_and_ffn() {
        let h = tiny();
        assert!(h.n_dense_lead > 0 && h.has_moe_blocks());
        let names: Vec<String> = resolve_tensors(&h)
            .expect("resolves")
            .into_iter()
            .map(|t| t.name)
            .collect();
        let has = |n: &str| names.iter().any(|x| x == n);
        assert!(has("token_embd_norm.weight") && !has("output_norm.weight"));
        for il in 0..h.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}");
            assert_eq!(has(&n("shortconv.conv.weight")), h.is_conv(il), "{il}");
            assert_eq!(has(&n("attn_q.weight")), !h.is_conv(il), "{il}");
            let dense = il < h.n_dense_lead;
            assert_eq!(has(&n("ffn_up.weight")), dense, "{il}");
            assert_eq!(has(&n("ffn_up_exps.weight")), !dense, "{il}");
            assert_eq!(has(&n("exp_probs_b.bias")), !dense, "{il}");
        }
    }

    #[test]
    fn refuses_what_it_cannot_compute_with_the_reason() {
        let h = tiny();
        let err = |edit: &dyn Fn(&mut MetadataPairs)| {
            Lfm2MoeHparams::from_metadata(&md_of(&h, edit))
                .expect_err("refused")
                .0
        };
        let e = err(&|kv| set(kv, "expert_gating_func", Value::U32(4)));
        assert!(e.contains("sqrt-softplus"), "{e}");
        let e = err(&|kv| set(kv, "expert_gating_func", Value::U32(0)));
        assert!(e.contains("expert_gating_func 0"), "{e}");
        let e = err(&|kv| kv.retain(|(k, _)| !k.ends_with("expert_gating_func")));
        assert!(e.contains("expert_gating_func"), "{e}");
        let e = err(&|kv| kv.retain(|(k, _)| !k.ends_with("shortconv.l_cache")));
        assert!(e.contains("shortconv.l_cache"), "{e}");
        let e = err(&|kv| set(kv, "shortconv.l_cache", Value::U32(1)));
        assert!(e.contains("above 1"), "{e}");
        let e = err(&|kv| set(kv, "attention.causal", Value::Bool(false)));
        assert!(e.contains("causal"), "{e}");
        let e = err(&|kv| {
            set(
                kv,
                "attention.head_count_kv",
                Value::u32_array([0, 2, 1, 0]),
            )
        });
        assert!(e.contains("differs between attention blocks"), "{e}");
        let e = err(&|kv| set(kv, "attention.head_count_kv", Value::U32(0)));
        assert!(e.contains("without attention"), "{e}");
        let e = err(&|kv| {
            set(kv, "attention.key_length", Value::U32(32));
            set(kv, "attention.value_length", Value::U32(32));
            set(kv, "rope.dimension_count", Value::U32(32));
        });
        assert!(e.contains("embedding_length"), "{e}");
    }
}
