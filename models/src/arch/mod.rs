//! Model architectures: for each, the hyperparameters read from GGUF metadata and the table of tensors a
//! file of that architecture holds (llama.cpp's `load_arch_hparams` / `load_arch_tensors`).
//!
//! The tables are data: every row names a tensor by [`Role`] (which fixes its GGUF name pattern), says
//! which layers hold it ([`LayerSel`]), gives its shape symbolically ([`Dim`], `ne0` first as GGUF stores
//! it) and its [`TensorClass`] (what `synth` and quantizers pick types by). [`resolve_tensors`] turns a
//! table and a hyperparameter set into concrete names and shapes; the forward pass and `synth` both use it.
//!
//! - [`common`]: the hyperparameters every architecture shares, read and checked once ([`CommonHparams`],
//!   and [`ExpertHparams`] for routed experts); an architecture file reads only its own.
//! - [`graph`]: the forward-pass interface ([`Forward`], [`ModelGraph`], [`StateSpec`], tensor binding).
//! - [`uses`]: what a graph's forward pass asks of a backend ([`ModelGraph::uses`]), so a backend that
//!   lacks an operation refuses the model at load.
//! - [`qwen3moe`]: Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B).
//! - [`qwen35moe`]: Qwen3.5/3.6 MoE: gated delta-net and gated full attention layers 3:1, routed and
//!   shared experts, one MTP (next-token prediction) block.
//! - [`clover_moe`]: Clover MoE, the Qwen3.6 layout in another form (`ssm_a` holds `A_log`, no rope
//!   sections); it runs as `qwen35moe`.
//! - [`gemma3`]: Gemma 3 text models: sliding-window and global attention 5:1, post-norms, tied output.
//! - [`llama`]: dense Llama-family models (Llama 2/3, Mistral, SmolLM2): GQA, normal RoPE, SwiGLU.
//! - [`lfm2moe`]: LFM2 MoE (LFM2-8B-A1B, LFM2.5-24B-A2B): gated short-convolution blocks beside
//!   attention blocks, dense leading FFNs, then sigmoid-routed experts with a selection bias.
//! - [`gemma4`]: Gemma 4 (26B-A4B): sliding-window and global attention blocks of different head sizes,
//!   a dense GELU MLP beside routed experts (fused gate/up, per-expert scales) in every block.
//! - [`glm5_next`]: GLM5-Next (GLM 5.3 Flash): mHC residual streams, KDA blocks beside sparse MLA
//!   blocks whose cells a k-pool indexer selects, DeepSeek-style experts; run on the CPU only.
//! - [`deepseek4`]: DeepSeek V4 (V4 Flash): mHC residual streams, one shared-KV attention head per block
//!   over a sliding window plus compressed KV (CSA blocks with a lightning indexer, HCA blocks), grouped
//!   low-rank output, hash-routed then sqrt-softplus-routed experts; run on the CPU only.

pub mod clover_moe;
pub mod common;
pub mod deepseek4;
pub mod gemma3;
pub mod gemma4;
pub mod glm5_next;
pub mod graph;
pub mod lfm2moe;
pub mod llama;
pub mod qwen35moe;
pub mod qwen3moe;
pub mod uses;

use crate::gguf::{GgufError, Metadata, Value};
use poly_kernels::quant::GgmlType;

pub use common::{CommonHparams, ExpertHparams};
pub use deepseek4::Deepseek4Hparams;
pub use gemma3::Gemma3Hparams;
pub use gemma4::Gemma4Hparams;
pub use glm5_next::Glm5NextHparams;
pub use graph::{
    bind_tensors, routed_experts, Forward, ModelGraph, ModelInfo, RoutedExperts, StateSpec,
    TensorMap, ValueMap,
};
pub use lfm2moe::Lfm2MoeHparams;
pub use llama::LlamaHparams;
pub use qwen35moe::Qwen35MoeHparams;
pub use qwen3moe::Qwen3MoeHparams;
pub use uses::GraphUses;

/// An error in an architecture's metadata: a key missing or of the wrong type, or values that do not
/// describe a model llama.cpp would load.
#[derive(Debug, Clone, PartialEq)]
pub struct ArchError(pub String);

impl std::fmt::Display for ArchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ArchError {}

impl From<GgufError> for ArchError {
    fn from(e: GgufError) -> Self {
        ArchError(e.to_string())
    }
}

/// What a tensor is for, coarsely: the unit in which types are chosen (`synth --types CLASS=TYPE`) and in
/// which a quantizer or an offloading policy thinks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorClass {
    /// Token embedding table.
    Embedding,
    /// Output (LM head) matrix.
    Output,
    /// Full-attention projections (Q, K, V, output).
    Attention,
    /// Gated delta-net projections (QKV, Z gate, alpha, beta, output).
    DeltaNet,
    /// Small recurrent-block parameters (the delta-net's conv1d kernel, A, dt bias; the short
    /// convolution's kernel): always F32.
    DeltaNetParam,
    /// Short-convolution blocks' input and output projections (LFM2).
    ShortConv,
    /// Dense feed-forward network.
    Ffn,
    /// Routed experts.
    Expert,
    /// Shared expert.
    SharedExpert,
    /// Router (expert gate) and the shared expert's gate vector.
    Router,
    /// MTP (next-token prediction) block's own projections.
    NextN,
    /// Normalization weights: always F32.
    Norm,
    /// Small matrices llama.cpp's quantizer leaves in the converter's type for `glm5-next` (the mHC
    /// mixing weights, the sparse-attention indexer's projections, the KDA gates' low-rank factors, the
    /// MLA latent projections): always F32 here.
    Unquantized,
    /// Integer tables (deepseek4's hash routing, token → experts): always I32, never a weight of a product.
    Index,
}

/// (class, command-line name, what it covers)
const CLASS_TABLE: &[(TensorClass, &str, &str)] = &[
    (TensorClass::Embedding, "embd", "token embedding"),
    (TensorClass::Output, "output", "output (LM head)"),
    (
        TensorClass::Attention,
        "attn",
        "full-attention Q/K/V/output",
    ),
    (
        TensorClass::DeltaNet,
        "ssm",
        "delta-net projections (qkv, gate, alpha, beta, out)",
    ),
    (
        TensorClass::DeltaNetParam,
        "ssm_param",
        "delta-net conv1d, A, dt; short-conv kernel (F32)",
    ),
    (
        TensorClass::ShortConv,
        "conv",
        "short-convolution in/out projections",
    ),
    (TensorClass::Ffn, "ffn", "dense feed-forward"),
    (TensorClass::Expert, "expert", "routed experts"),
    (TensorClass::SharedExpert, "shexp", "shared expert"),
    (
        TensorClass::Router,
        "router",
        "expert router, its selection bias and the shared-expert gate",
    ),
    (TensorClass::NextN, "nextn", "MTP block projection"),
    (TensorClass::Norm, "norm", "normalization weights (F32)"),
    (
        TensorClass::Unquantized,
        "unquantized",
        "matrices llama.cpp never quantizes (glm5-next's mHC, indexer, KDA gates, MLA latent; F32)",
    ),
    (
        TensorClass::Index,
        "index",
        "integer tables (deepseek4's hash routing; I32)",
    ),
];

impl TensorClass {
    /// Every class.
    pub fn all() -> impl Iterator<Item = TensorClass> {
        CLASS_TABLE.iter().map(|r| r.0)
    }

    /// The name `--types` uses (`expert`, `attn`, …).
    pub fn name(self) -> &'static str {
        CLASS_TABLE
            .iter()
            .find(|r| r.0 == self)
            .map_or("?", |r| r.1)
    }

    /// What the class covers, for help text.
    pub fn description(self) -> &'static str {
        CLASS_TABLE
            .iter()
            .find(|r| r.0 == self)
            .map_or("?", |r| r.2)
    }

    /// The class named `name` (case-insensitive).
    pub fn from_name(name: &str) -> Option<TensorClass> {
        CLASS_TABLE
            .iter()
            .find(|r| r.1.eq_ignore_ascii_case(name))
            .map(|r| r.0)
    }

    /// Whether llama.cpp's loader or graph needs these tensors in F32 (norms are multiplied element-wise,
    /// the delta-net's conv kernel and A/dt feed F32-only ops), so no type may be chosen for them.
    pub fn f32_only(self) -> bool {
        matches!(
            self,
            TensorClass::Norm | TensorClass::DeltaNetParam | TensorClass::Unquantized
        )
    }

    /// The one type the class is stored in, where it has one (F32 for [`TensorClass::f32_only`], I32
    /// for [`TensorClass::Index`]).
    pub fn fixed_type(self) -> Option<GgmlType> {
        if self.f32_only() {
            Some(GgmlType::F32)
        } else if self == TensorClass::Index {
            Some(GgmlType::I32)
        } else {
            None
        }
    }
}

/// A tensor's meaning; fixes its GGUF name (`{}` is the block number).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    TokenEmbd,
    OutputNorm,
    /// The final norm under LFM2's name for it (`token_embd_norm.weight`, llama.cpp's
    /// `LLM_TENSOR_OUTPUT_NORM_LFM2`): applied after the last block, not to the embeddings.
    OutputNormLfm2,
    /// RoPE frequency factors (`rope_freqs.weight`, Llama 3.1+).
    RopeFreqs,
    Output,
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnOut,
    AttnQNorm,
    AttnKNorm,
    AttnPostNorm,
    FfnNorm,
    FfnPostNorm,
    FfnGate,
    FfnUp,
    FfnDown,
    FfnGateInp,
    FfnGateExps,
    FfnUpExps,
    FfnDownExps,
    /// Every expert's gate and up projections in one tensor (`ffn_gate_up_exps`: each expert's gate rows,
    /// then its up rows).
    FfnGateUpExps,
    /// Per-expert scale of the experts' outputs (`ffn_down_exps.scale`, Gemma 4's `per_expert_scale`).
    FfnDownExpsScale,
    /// Scale of the router's normed input (`ffn_gate_inp.scale`, Gemma 4).
    FfnGateInpScale,
    /// Gemma 4's norms around its two feed-forward branches: before the experts, after the dense MLP,
    /// after the experts.
    FfnPreNorm2,
    FfnPostNorm1,
    FfnPostNorm2,
    /// One scalar multiplying a block's output (`layer_output_scale`, Gemma 4).
    LayerOutScale,
    FfnGateInpShexp,
    FfnGateShexp,
    FfnUpShexp,
    FfnDownShexp,
    /// The experts' selection bias (`exp_probs_b`).
    FfnExpProbsB,
    /// Optional biases of the attention and FFN projections (llama.cpp's `wq_b` … `ffn_down_b`).
    AttnQBias,
    AttnKBias,
    AttnVBias,
    AttnOutBias,
    FfnGateBias,
    FfnUpBias,
    FfnDownBias,
    /// Delta-net fused Q/K/V input projection.
    AttnQkv,
    /// Delta-net output gate (Z) projection.
    AttnGate,
    SsmConv1d,
    SsmDt,
    SsmA,
    SsmBeta,
    SsmAlpha,
    SsmNorm,
    SsmOut,
    /// Short-convolution kernel (LFM2).
    ShortConvConv,
    /// Short-convolution input projection: the B gate, C gate and input, side by side.
    ShortConvInProj,
    /// Short-convolution output projection.
    ShortConvOutProj,
    /// GLM5-Next's mHC (manifold-constrained hyper-connections) around the mixer and the FFN: the mixing
    /// projection of the flattened streams, its bias and its three scales (pre, post, combination).
    HcAttnFn,
    HcAttnBase,
    HcAttnScale,
    HcFfnFn,
    HcFfnBase,
    HcFfnScale,
    /// KDA (Kimi delta attention) blocks: the causal convolutions of Q, K and V, the decay gate's and
    /// the output gate's low-rank factors.
    SsmConv1dQ,
    SsmConv1dK,
    SsmConv1dV,
    SsmFA,
    SsmFB,
    SsmGA,
    SsmGB,
    /// MLA (multi-head latent attention): Q through a low-rank latent, the KV latent (`kv_a_mqa`), and
    /// the per-head absorbed K and V expansions.
    AttnQA,
    AttnQB,
    AttnQANorm,
    AttnKvAMqa,
    AttnKvANorm,
    AttnKB,
    AttnVB,
    /// The sparse-attention indexer (GLM5-Next's k-pool form): its keys' layer norm, per-head weights,
    /// key and query projections, the pool gate and the pool position bias.
    IndexerKNorm,
    IndexerKNormBias,
    IndexerProj,
    IndexerAttnK,
    IndexerAttnQB,
    IndexerKpoolGate,
    IndexerKpoolApe,
    /// DeepSeek V4 attention: the one shared K/V projection (`attn_kv`; its norm is [`Role::AttnKvANorm`]),
    /// the per-head attention sinks, the grouped low-rank output (`attn_output_a` per group, then
    /// `attn_output_b`).
    AttnKv,
    AttnSinks,
    AttnOutA,
    AttnOutB,
    /// DeepSeek V4's mHC head: the streams' weights into the final norm (`output_hc_*`).
    HcHeadFn,
    HcHeadBase,
    HcHeadScale,
    /// DeepSeek V4's KV compressor (CSA and HCA blocks): its KV and gate projections, the gate's position
    /// bias within a compressed block, and the compressed entries' norm.
    AttnCompressorKv,
    AttnCompressorGate,
    AttnCompressorApe,
    AttnCompressorNorm,
    /// DeepSeek V4's lightning indexer keys' compressor (its gate and position bias are
    /// [`Role::IndexerKpoolGate`] and [`Role::IndexerKpoolApe`], the same names).
    IndexerCompressorKv,
    IndexerCompressorNorm,
    /// DeepSeek V4's hash routing: each token's experts (I32 `[n_expert_used, n_vocab]`).
    FfnGateTid2eid,
    NextnEhProj,
    NextnEnorm,
    NextnHnorm,
    NextnEmbedTokens,
    NextnSharedHeadHead,
    NextnSharedHeadNorm,
}

impl Role {
    /// One of the optional projection biases (`AttnQBias` … `FfnDownBias`).
    pub fn is_projection_bias(self) -> bool {
        matches!(
            self,
            Role::AttnQBias
                | Role::AttnKBias
                | Role::AttnVBias
                | Role::AttnOutBias
                | Role::FfnGateBias
                | Role::FfnUpBias
                | Role::FfnDownBias
        )
    }

    /// The GGUF name pattern (llama.cpp's `LLM_TENSOR_NAMES` plus suffix); `{}` is the block number.
    pub fn pattern(self) -> &'static str {
        match self {
            Role::TokenEmbd => "token_embd.weight",
            Role::OutputNorm => "output_norm.weight",
            Role::OutputNormLfm2 => "token_embd_norm.weight",
            Role::RopeFreqs => "rope_freqs.weight",
            Role::Output => "output.weight",
            Role::AttnNorm => "blk.{}.attn_norm.weight",
            Role::AttnQ => "blk.{}.attn_q.weight",
            Role::AttnK => "blk.{}.attn_k.weight",
            Role::AttnV => "blk.{}.attn_v.weight",
            Role::AttnOut => "blk.{}.attn_output.weight",
            Role::AttnQNorm => "blk.{}.attn_q_norm.weight",
            Role::AttnKNorm => "blk.{}.attn_k_norm.weight",
            Role::AttnPostNorm => "blk.{}.post_attention_norm.weight",
            Role::FfnNorm => "blk.{}.ffn_norm.weight",
            Role::FfnPostNorm => "blk.{}.post_ffw_norm.weight",
            Role::FfnGate => "blk.{}.ffn_gate.weight",
            Role::FfnUp => "blk.{}.ffn_up.weight",
            Role::FfnDown => "blk.{}.ffn_down.weight",
            Role::FfnGateInp => "blk.{}.ffn_gate_inp.weight",
            Role::FfnGateExps => "blk.{}.ffn_gate_exps.weight",
            Role::FfnUpExps => "blk.{}.ffn_up_exps.weight",
            Role::FfnDownExps => "blk.{}.ffn_down_exps.weight",
            Role::FfnGateUpExps => "blk.{}.ffn_gate_up_exps.weight",
            Role::FfnDownExpsScale => "blk.{}.ffn_down_exps.scale",
            Role::FfnGateInpScale => "blk.{}.ffn_gate_inp.scale",
            Role::FfnPreNorm2 => "blk.{}.pre_ffw_norm_2.weight",
            Role::FfnPostNorm1 => "blk.{}.post_ffw_norm_1.weight",
            Role::FfnPostNorm2 => "blk.{}.post_ffw_norm_2.weight",
            Role::LayerOutScale => "blk.{}.layer_output_scale.weight",
            Role::FfnGateInpShexp => "blk.{}.ffn_gate_inp_shexp.weight",
            Role::FfnGateShexp => "blk.{}.ffn_gate_shexp.weight",
            Role::FfnUpShexp => "blk.{}.ffn_up_shexp.weight",
            Role::FfnDownShexp => "blk.{}.ffn_down_shexp.weight",
            Role::FfnExpProbsB => "blk.{}.exp_probs_b.bias",
            Role::AttnQBias => "blk.{}.attn_q.bias",
            Role::AttnKBias => "blk.{}.attn_k.bias",
            Role::AttnVBias => "blk.{}.attn_v.bias",
            Role::AttnOutBias => "blk.{}.attn_output.bias",
            Role::FfnGateBias => "blk.{}.ffn_gate.bias",
            Role::FfnUpBias => "blk.{}.ffn_up.bias",
            Role::FfnDownBias => "blk.{}.ffn_down.bias",
            Role::AttnQkv => "blk.{}.attn_qkv.weight",
            Role::AttnGate => "blk.{}.attn_gate.weight",
            Role::SsmConv1d => "blk.{}.ssm_conv1d.weight",
            Role::SsmDt => "blk.{}.ssm_dt.bias",
            Role::SsmA => "blk.{}.ssm_a",
            Role::SsmBeta => "blk.{}.ssm_beta.weight",
            Role::SsmAlpha => "blk.{}.ssm_alpha.weight",
            Role::SsmNorm => "blk.{}.ssm_norm.weight",
            Role::SsmOut => "blk.{}.ssm_out.weight",
            Role::ShortConvConv => "blk.{}.shortconv.conv.weight",
            Role::ShortConvInProj => "blk.{}.shortconv.in_proj.weight",
            Role::ShortConvOutProj => "blk.{}.shortconv.out_proj.weight",
            Role::HcAttnFn => "blk.{}.hc_attn_fn.weight",
            Role::HcAttnBase => "blk.{}.hc_attn_base.weight",
            Role::HcAttnScale => "blk.{}.hc_attn_scale.weight",
            Role::HcFfnFn => "blk.{}.hc_ffn_fn.weight",
            Role::HcFfnBase => "blk.{}.hc_ffn_base.weight",
            Role::HcFfnScale => "blk.{}.hc_ffn_scale.weight",
            Role::SsmConv1dQ => "blk.{}.ssm_conv1d_q.weight",
            Role::SsmConv1dK => "blk.{}.ssm_conv1d_k.weight",
            Role::SsmConv1dV => "blk.{}.ssm_conv1d_v.weight",
            Role::SsmFA => "blk.{}.ssm_f_a.weight",
            Role::SsmFB => "blk.{}.ssm_f_b.weight",
            Role::SsmGA => "blk.{}.ssm_g_a.weight",
            Role::SsmGB => "blk.{}.ssm_g_b.weight",
            Role::AttnQA => "blk.{}.attn_q_a.weight",
            Role::AttnQB => "blk.{}.attn_q_b.weight",
            Role::AttnQANorm => "blk.{}.attn_q_a_norm.weight",
            Role::AttnKvAMqa => "blk.{}.attn_kv_a_mqa.weight",
            Role::AttnKvANorm => "blk.{}.attn_kv_a_norm.weight",
            Role::AttnKB => "blk.{}.attn_k_b.weight",
            Role::AttnVB => "blk.{}.attn_v_b.weight",
            Role::IndexerKNorm => "blk.{}.indexer.k_norm.weight",
            Role::IndexerKNormBias => "blk.{}.indexer.k_norm.bias",
            Role::IndexerProj => "blk.{}.indexer.proj.weight",
            Role::IndexerAttnK => "blk.{}.indexer.attn_k.weight",
            Role::IndexerAttnQB => "blk.{}.indexer.attn_q_b.weight",
            Role::IndexerKpoolGate => "blk.{}.indexer_compressor_gate.weight",
            Role::IndexerKpoolApe => "blk.{}.indexer_compressor_ape.weight",
            Role::AttnKv => "blk.{}.attn_kv.weight",
            Role::AttnSinks => "blk.{}.attn_sinks.weight",
            Role::AttnOutA => "blk.{}.attn_output_a.weight",
            Role::AttnOutB => "blk.{}.attn_output_b.weight",
            Role::HcHeadFn => "output_hc_fn.weight",
            Role::HcHeadBase => "output_hc_base.weight",
            Role::HcHeadScale => "output_hc_scale.weight",
            Role::AttnCompressorKv => "blk.{}.attn_compressor_kv.weight",
            Role::AttnCompressorGate => "blk.{}.attn_compressor_gate.weight",
            Role::AttnCompressorApe => "blk.{}.attn_compressor_ape.weight",
            Role::AttnCompressorNorm => "blk.{}.attn_compressor_norm.weight",
            Role::IndexerCompressorKv => "blk.{}.indexer_compressor_kv.weight",
            Role::IndexerCompressorNorm => "blk.{}.indexer_compressor_norm.weight",
            Role::FfnGateTid2eid => "blk.{}.ffn_gate_tid2eid.weight",
            Role::NextnEhProj => "blk.{}.nextn.eh_proj.weight",
            Role::NextnEnorm => "blk.{}.nextn.enorm.weight",
            Role::NextnHnorm => "blk.{}.nextn.hnorm.weight",
            Role::NextnEmbedTokens => "blk.{}.nextn.embed_tokens.weight",
            Role::NextnSharedHeadHead => "blk.{}.nextn.shared_head_head.weight",
            Role::NextnSharedHeadNorm => "blk.{}.nextn.shared_head_norm.weight",
        }
    }

    /// The tensor's name in block `layer` (ignored for tensors outside blocks).
    pub fn name(self, layer: u32) -> String {
        self.pattern().replace("{}", &layer.to_string())
    }
}

/// A symbolic dimension, resolved by an architecture's hyperparameters ([`ArchHparams::dim`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    /// `n_embd`.
    Embd,
    /// `2 * n_embd` (the MTP block's concatenated embedding and hidden state).
    Embd2,
    /// `3 * n_embd` (LFM2's short-convolution input projection: B, C and the input).
    Embd3,
    /// Vocabulary size.
    Vocab,
    /// Dense FFN width.
    Ff,
    /// Routed expert FFN width.
    FfExp,
    /// `2 * n_ff_exp`: an expert's gate and up projections in one tensor.
    FfExpGateUp,
    /// Shared expert FFN width.
    FfShexp,
    /// Number of routed experts.
    Expert,
    /// Key head dimension (Q/K norm length).
    HeadK,
    /// Half the rotated dimensions (`n_rot / 2`): one RoPE frequency factor per rotated pair.
    RopeHalf,
    /// `n_head * head_k`: the query projection (and attention output input).
    QProj,
    /// `2 * n_head * head_k`: query and output gate together (Qwen3.5 gated attention).
    QGateProj,
    /// `n_head_kv * head_k`.
    KProj,
    /// `n_head_kv * head_v`.
    VProj,
    /// Sliding-window blocks' head size where it differs from the global blocks' (Gemma 4).
    HeadKSwa,
    /// `n_head * head_k_swa`.
    QProjSwa,
    /// `n_head_kv_swa * head_k_swa` (keys and values alike).
    KProjSwa,
    /// 1: a scalar.
    One,
    /// Convolution kernel length (the delta-net's conv1d, LFM2's short convolution).
    SsmConvKernel,
    /// Delta-net conv channels: `2 * n_k_heads * head_k + n_v_heads * head_v`.
    SsmConvDim,
    /// Delta-net value width: `n_v_heads * head_v`.
    SsmValueDim,
    /// Delta-net value heads.
    SsmVHeads,
    /// Delta-net head dimension.
    SsmHeadDim,
    /// `n_head`: one value per attention (or KDA) head.
    Heads,
    /// Three (the mHC scales: pre, post, combination).
    Three,
    /// `hc · n_embd`: the hyper-connection streams flattened.
    HcFlat,
    /// `(2 + hc) · hc`: the mHC mixes (pre and post weights per stream, the stream-to-stream matrix).
    HcMix,
    /// Q's latent rank (`attention.q_lora_rank`).
    QLora,
    /// The KV latent's rank (`attention.kv_lora_rank`).
    KvLora,
    /// MLA key head size (`attention.key_length_mla`; no rotated part in GLM5-Next).
    HeadKMla,
    /// MLA value head size (`attention.value_length_mla`).
    HeadVMla,
    /// `n_head · key_length_mla`.
    QProjMla,
    /// `n_head · value_length_mla`.
    OProjMla,
    /// Indexer heads (`attention.indexer.head_count`).
    IndexerHeads,
    /// Indexer key size (`attention.indexer.key_length`).
    IndexerDim,
    /// `indexer heads · indexer key size`.
    IndexerQProj,
    /// Tokens pooled into one indexer key (`attention.indexer.kpool`).
    KPool,
    /// The hyper-connection streams (`hyper_connection.count`).
    Hc,
    /// `2 · head_k`: a CSA compressor's two overlapping halves (DeepSeek V4).
    HeadK2,
    /// `2 · indexer key size`: the indexer compressor's two halves.
    IndexerDim2,
    /// Tokens compressed into one entry in CSA blocks (4) and in HCA blocks (128).
    CsaRatio,
    HcaRatio,
    /// `n_head · head_k / o_groups`: one output group's input (DeepSeek V4's `attn_output_a` rows).
    OGroupIn,
    /// `o_groups · o_lora_rank`: every group's low-rank output side by side.
    OLora,
    /// Experts each token is routed to (the hash table's rows).
    ExpertUsed,
}

/// What kind of block a layer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Full (global) attention.
    Attention,
    /// Sliding-window attention.
    SlidingAttention,
    /// Recurrent block (a gated delta-net, or LFM2's short convolution).
    Recurrent,
    /// MTP (next-token prediction) block: full attention plus the `nextn.*` tensors; not run by the main
    /// forward pass.
    NextN,
}

impl LayerKind {
    /// Block `il` of a file whose `n_layer` trunk blocks are recurrent or attention (`recurrent`) and
    /// whose blocks after them are MTP blocks (qwen35moe, glm5-next).
    pub fn of_trunk_then_nextn(il: u32, n_layer: u32, recurrent: bool) -> LayerKind {
        match (il >= n_layer, recurrent) {
            (true, _) => LayerKind::NextN,
            (false, true) => LayerKind::Recurrent,
            (false, false) => LayerKind::Attention,
        }
    }
}

/// Which blocks hold a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerSel {
    /// Every block, MTP blocks included.
    All,
    /// Blocks with softmax attention (full, sliding, and MTP blocks).
    Attention,
    /// Recurrent blocks.
    Recurrent,
    /// MTP blocks.
    NextN,
    /// Blocks whose feed-forward network is dense ([`ArchHparams::dense_ffn`]: LFM2's leading blocks).
    DenseFfn,
    /// Blocks whose feed-forward network is a mixture of experts.
    MoeFfn,
    /// Sliding-window attention blocks.
    SlidingAttention,
    /// Full (global) attention blocks.
    FullAttention,
    /// The trunk's blocks: every block but the MTP blocks.
    Trunk,
    /// Attention blocks that compute their own sparse-attention selection
    /// ([`ArchHparams::indexer_full`]); the others reuse the previous one's.
    IndexerFull,
    /// Blocks whose KV is compressed by 4 with an indexer choosing entries (DeepSeek V4's CSA:
    /// [`ArchHparams::compress_ratio`] 4).
    Csa,
    /// Blocks whose KV is compressed by 128, all entries attended (DeepSeek V4's HCA: ratio 128).
    Hca,
    /// Blocks whose experts a token's id chooses ([`ArchHparams::hash_routed`]).
    HashRouted,
    /// MoE blocks routed by the router with a selection bias (not hash-routed).
    BiasRouted,
}

impl LayerSel {
    /// Whether block `il` of `hp`'s model holds tensors of this selection.
    pub fn selects(self, hp: &dyn ArchHparams, il: u32) -> bool {
        let kind = hp.layer_kind(il);
        match self {
            LayerSel::All => true,
            LayerSel::Attention => kind != LayerKind::Recurrent,
            LayerSel::Recurrent => kind == LayerKind::Recurrent,
            LayerSel::NextN => kind == LayerKind::NextN,
            LayerSel::DenseFfn => hp.dense_ffn(il),
            LayerSel::MoeFfn => !hp.dense_ffn(il),
            LayerSel::SlidingAttention => kind == LayerKind::SlidingAttention,
            LayerSel::FullAttention => kind == LayerKind::Attention,
            LayerSel::Trunk => kind != LayerKind::NextN,
            LayerSel::IndexerFull => kind != LayerKind::Recurrent && hp.indexer_full(il),
            LayerSel::Csa => hp.compress_ratio(il) == 4,
            LayerSel::Hca => hp.compress_ratio(il) == 128,
            LayerSel::HashRouted => hp.hash_routed(il),
            LayerSel::BiasRouted => !hp.hash_routed(il),
        }
    }
}

/// Whether a file must hold a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Presence {
    /// llama.cpp refuses the file without it.
    Required,
    /// llama.cpp accepts the file without it (it falls back to another tensor, e.g. a missing
    /// `output.weight` to the token embedding); [`ArchHparams::synth_writes`] says whether files of the
    /// real model have it.
    Optional,
}

/// One row of an architecture's tensor table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorDef {
    pub role: Role,
    /// `None` for tensors outside blocks.
    pub layers: Option<LayerSel>,
    /// Shape, `ne0` (the contiguous row length) first.
    pub dims: &'static [Dim],
    pub class: TensorClass,
    pub presence: Presence,
}

/// A required row of a tensor table (the architectures' tables are lists of these).
pub(crate) const fn def(
    role: Role,
    layers: Option<LayerSel>,
    dims: &'static [Dim],
    class: TensorClass,
) -> TensorDef {
    TensorDef {
        role,
        layers,
        dims,
        class,
        presence: Presence::Required,
    }
}

/// `d`, optional.
pub(crate) const fn opt(d: TensorDef) -> TensorDef {
    TensorDef {
        presence: Presence::Optional,
        ..d
    }
}

/// A tensor of a concrete model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    pub name: String,
    pub role: Role,
    /// The block, for tensors inside one.
    pub layer: Option<u32>,
    /// Shape, `ne0` first.
    pub dims: Vec<u64>,
    pub class: TensorClass,
    pub presence: Presence,
}

impl TensorDesc {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// What every architecture's hyperparameters provide to the tables and to `synth`.
pub trait ArchHparams {
    /// `general.architecture`.
    fn arch_name(&self) -> &'static str;
    /// The tensor table.
    fn tensor_defs(&self) -> &'static [TensorDef];
    /// Number of blocks in the file (`block_count`, MTP blocks included).
    fn n_layer_all(&self) -> u32;
    /// The kind of block `il`.
    fn layer_kind(&self, il: u32) -> LayerKind;
    /// The value of a symbolic dimension; `None` when the architecture has no such dimension.
    fn dim(&self, d: Dim) -> Option<u64>;
    /// Experts each token is routed to (0 without experts).
    fn n_expert_used(&self) -> u32 {
        0
    }
    /// Whether block `il`'s feed-forward network is dense in a model that also has MoE blocks (the
    /// tables' [`LayerSel::DenseFfn`] / [`LayerSel::MoeFfn`]); false where no table asks.
    fn dense_ffn(&self, _il: u32) -> bool {
        false
    }
    /// Whether attention block `il` computes its own sparse-attention selection (GLM5-Next's full
    /// indexer blocks, and its MTP block); false where no table asks.
    fn indexer_full(&self, _il: u32) -> bool {
        false
    }
    /// Tokens compressed into one KV entry in block `il` (DeepSeek V4: 0, 4 or 128); 0 where no table
    /// asks.
    fn compress_ratio(&self, _il: u32) -> u32 {
        0
    }
    /// Whether block `il`'s experts are chosen by the token's id (DeepSeek V4's first blocks); false
    /// where no table asks.
    fn hash_routed(&self, _il: u32) -> bool {
        false
    }
    /// Whether the optional tensor `role` belongs in this model's files, as in files converted from the
    /// real model (e.g. no `output.weight` when the output is tied to the embedding).
    fn synth_writes(&self, role: Role) -> bool;
    /// The metadata pairs describing these hyperparameters (`<arch>.*` keys), as llama.cpp reads them.
    fn to_metadata(&self) -> Vec<(String, Value)>;
    /// The hyperparameters every architecture shares ([`CommonHparams`]).
    fn common(&self) -> CommonHparams;
    /// Checks that the values describe a model llama.cpp would load ([`CommonHparams::validate`] and the
    /// architecture's own).
    fn validate(&self) -> Result<(), ArchError>;
}

/// The concrete tensors of a model: every table row for every block that holds it, in table order within
/// a block (globals first, then blocks in order, as converted files list them). Optional rows are listed
/// when [`ArchHparams::synth_writes`] says the model has them.
pub fn resolve_tensors(hp: &dyn ArchHparams) -> Result<Vec<TensorDesc>, ArchError> {
    let defs = hp.tensor_defs();
    let mut out = Vec::new();
    let wanted = |d: &TensorDef| d.presence == Presence::Required || hp.synth_writes(d.role);
    let resolve = |d: &TensorDef| -> Result<Vec<u64>, ArchError> {
        d.dims
            .iter()
            .map(|&x| {
                hp.dim(x).ok_or_else(|| {
                    ArchError(format!(
                        "{}: dimension {x:?} of {} is not defined",
                        hp.arch_name(),
                        d.role.pattern()
                    ))
                })
            })
            .collect()
    };
    for d in defs.iter().filter(|d| d.layers.is_none() && wanted(d)) {
        out.push(TensorDesc {
            name: d.role.name(0),
            role: d.role,
            layer: None,
            dims: resolve(d)?,
            class: d.class,
            presence: d.presence,
        });
    }
    for il in 0..hp.n_layer_all() {
        for d in defs.iter().filter(|d| wanted(d)) {
            let Some(sel) = d.layers else { continue };
            if !sel.selects(hp, il) {
                continue;
            }
            out.push(TensorDesc {
                name: d.role.name(il),
                role: d.role,
                layer: Some(il),
                dims: resolve(d)?,
                class: d.class,
                presence: d.presence,
            });
        }
    }
    Ok(out)
}

/// The hyperparameters of any supported architecture.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelHparams {
    Qwen3Moe(Qwen3MoeHparams),
    Qwen35Moe(Qwen35MoeHparams),
    Gemma3(Gemma3Hparams),
    Llama(LlamaHparams),
    Lfm2Moe(Lfm2MoeHparams),
    Gemma4(Gemma4Hparams),
    Glm5Next(Glm5NextHparams),
    Deepseek4(Deepseek4Hparams),
}

/// The architectures this crate knows and the engine runs, by `general.architecture`.
pub const ARCH_NAMES: &[&str] = &[
    qwen3moe::ARCH,
    qwen35moe::ARCH,
    clover_moe::ARCH,
    gemma3::ARCH,
    llama::ARCH,
    lfm2moe::ARCH,
    gemma4::ARCH,
    glm5_next::ARCH,
    deepseek4::ARCH,
];

/// The architectures this crate reads, binds and `synth` writes, but whose forward pass is not
/// implemented: [`graph::ModelGraph::from_file`] refuses their files with the reason (none now).
pub const NOT_RUN_ARCH_NAMES: &[&str] = &[];

impl ModelHparams {
    /// Reads the hyperparameters of the file's architecture from its metadata.
    pub fn from_metadata(md: &Metadata) -> Result<ModelHparams, ArchError> {
        let arch = md.architecture()?;
        match arch {
            qwen3moe::ARCH => Ok(ModelHparams::Qwen3Moe(Qwen3MoeHparams::from_metadata(md)?)),
            qwen35moe::ARCH => Ok(ModelHparams::Qwen35Moe(Qwen35MoeHparams::from_metadata(
                md,
            )?)),
            clover_moe::ARCH => Ok(ModelHparams::Qwen35Moe(clover_moe::from_metadata(md)?)),
            gemma3::ARCH => Ok(ModelHparams::Gemma3(Gemma3Hparams::from_metadata(md)?)),
            llama::ARCH => Ok(ModelHparams::Llama(LlamaHparams::from_metadata(md)?)),
            lfm2moe::ARCH => Ok(ModelHparams::Lfm2Moe(Lfm2MoeHparams::from_metadata(md)?)),
            gemma4::ARCH => Ok(ModelHparams::Gemma4(Gemma4Hparams::from_metadata(md)?)),
            glm5_next::ARCH => Ok(ModelHparams::Glm5Next(Glm5NextHparams::from_metadata(md)?)),
            deepseek4::ARCH => Ok(ModelHparams::Deepseek4(Deepseek4Hparams::from_metadata(
                md,
            )?)),
            other => Err(ArchError(format!(
                "architecture {other:?} is not supported (known: {})",
                ARCH_NAMES.join(", ")
            ))),
        }
    }

    /// The architecture's hyperparameters as the common interface.
    pub fn as_dyn(&self) -> &dyn ArchHparams {
        match self {
            ModelHparams::Qwen3Moe(h) => h,
            ModelHparams::Qwen35Moe(h) => h,
            ModelHparams::Gemma3(h) => h,
            ModelHparams::Llama(h) => h,
            ModelHparams::Lfm2Moe(h) => h,
            ModelHparams::Gemma4(h) => h,
            ModelHparams::Glm5Next(h) => h,
            ModelHparams::Deepseek4(h) => h,
        }
    }
}

/// The vocabulary size a file declares: the length of `tokenizer.ggml.tokens` (what llama.cpp uses), else
/// `<arch>.vocab_size`.
pub(crate) fn vocab_size(md: &Metadata) -> Result<u64, ArchError> {
    if let Some(tokens) = md.get_str_array("tokenizer.ggml.tokens")? {
        return Ok(tokens.len() as u64);
    }
    md.arch_u32_opt("vocab_size")?
        .map(u64::from)
        .ok_or_else(|| {
            ArchError(
                "no tokenizer.ggml.tokens and no vocab_size: the vocabulary size is unknown".into(),
            )
        })
}

/// Shorthand for a metadata pair under the architecture's prefix.
pub(crate) fn arch_kv(arch: &str, suffix: &str, v: impl Into<Value>) -> (String, Value) {
    (format!("{arch}.{suffix}"), v.into())
}

/// Checks `cond`, else an [`ArchError`] naming the architecture.
pub(crate) fn check(arch: &str, cond: bool, what: &str) -> Result<(), ArchError> {
    if cond {
        Ok(())
    } else {
        Err(ArchError(format!("{arch}: {what}")))
    }
}

/// `<arch>.<suffix>` given per layer (a scalar or an array of `n_layers`), which must be the same for every
/// layer (these architectures do not vary it); `None` when absent.
pub(crate) fn uniform_u32(
    md: &Metadata,
    suffix: &str,
    n_layers: u32,
) -> Result<Option<u32>, ArchError> {
    let Some(values) = md.arch_u32_per_layer_opt(suffix, n_layers as usize)? else {
        return Ok(None);
    };
    match values.first() {
        Some(&v) if values.iter().all(|&x| x == v) => Ok(Some(v)),
        Some(_) => Err(ArchError(format!(
            "{suffix} differs between layers ({values:?}); this architecture needs one value"
        ))),
        None => Ok(None),
    }
}

/// `<arch>.<suffix>`, required, the same for every layer.
pub(crate) fn uniform_u32_req(
    md: &Metadata,
    suffix: &str,
    n_layers: u32,
) -> Result<u32, ArchError> {
    uniform_u32(md, suffix, n_layers)?.ok_or_else(|| {
        ArchError(format!(
            "key {} is missing",
            md.arch_key(suffix).unwrap_or_default()
        ))
    })
}
