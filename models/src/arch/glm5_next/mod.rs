//! GLM5-Next (`glm5-next`: GLM 5.3 Flash): its hyperparameters and tensor table (this file) and its
//! forward pass ([`forward`], [`Glm5NextGraph`]). Only the CPU runs it: the forward pass uses operations
//! the card lacks ([`crate::arch::GraphUses::cpu_only`]), so the GPU backend refuses it at load.
//!
//! The model, as llama.cpp's `src/models/glm5-next.cpp` of the pinned sdist computes it:
//! - mHC residual streams: the embedding is repeated into `hyper_connection.count` (4) streams. Around the
//!   mixer and around the FFN, the flattened streams are RMS-normed (no weight) and projected by
//!   `hc_*_fn` to `(2 + 4)·4` mixes `m`; with the scales `s` (`hc_*_scale`) and the bias `b`
//!   (`hc_*_base`): `pre = sigmoid(s0·m[0..4] + b[0..4]) + eps` weighs the streams into the block's input,
//!   `post = 2·sigmoid(s1·m[4..8] + b[4..8])` spreads the block's output back over them, and the 4×4
//!   matrix `comb[d][s]` from `s2·m[8..24] + b[8..24]` (for each source `s` a softmax over the
//!   destinations `d`, plus eps; each destination's sum over the sources normalized to 1; then
//!   `sinkhorn_iterations − 1` times the sums over destinations, then over sources; each sum plus eps)
//!   mixes the old streams: `stream'[d] = post[d]·out + Σ_s comb[d][s]·stream[s]`. After the last block
//!   the streams' mean goes through the output norm and the output matrix.
//! - Two kinds of mixer, told apart by `attention.head_count_kv` (0: KDA):
//!   - KDA (Kimi delta attention): Q, K and V projections each through their own causal convolution
//!     (`ssm.conv_kernel` taps, three conv states) and SiLU; Q and K L2-normed; a per-channel log-decay
//!     `A_h · softplus(f_b(f_a(x)) + dt_bias)` (or, with `kda.gate_lower_bound` = lb, `lb ·
//!     sigmoid(−A_h · (f_b(f_a(x)) + dt_bias))`), write strength `sigmoid(beta·x)`, the delta rule with a
//!     per-key-channel decay (ggml's `gated_delta_net` with a `[head_dim]` gate), then `rms_norm(o)·w ⊙
//!     sigmoid(g_b(g_a(x)))` and the output projection.
//!   - MLA without RoPE (`rope.dimension_count` 0): Q through a normed latent (`q_a`, `q_a_norm`, `q_b`),
//!     the cache holds the normed KV latent (`kv_a_mqa`, `kv_a_norm`; `kv_lora_rank` wide, one head shared
//!     by all), Q absorbed through each head's `k_b`, scores scaled by `1/sqrt(key_length_mla)`, the
//!     attended latent expanded through each head's `v_b`, then the output projection. Attention is
//!     sparse: a token attends only to the cells its indexer selects.
//!   - The k-pool DSA indexer (blocks with `attention.indexer.types` true; the others reuse the previous
//!     selection): per token a key `layer_norm(attn_k·x)` (weight and bias, `layer_norm_epsilon`) and pool
//!     gates `kpool_gate·x` are cached; every `kpool` consecutive tokens form a pool whose key is the
//!     per-channel softmax-over-members (gate + `ape`) weighted sum of its members' keys; a token scores
//!     each complete pool ending at or before it as `Σ_h relu(q_h·pool) · w_h / sqrt(heads·key_length)`
//!     (`q = attn_q_b · q_latent`, `w = proj·x`), keeps the `top_k / kpool` best pools and, with
//!     `kpool_select_tail`, the cells of its own incomplete pool; those cells (within causality) are all
//!     it attends to.
//! - FFN: a dense SwiGLU in the first `leading_dense_block_count` blocks, then DeepSeek-style experts:
//!   sigmoid router (`expert_gating_func`, default sigmoid) with a selection bias (`exp_probs_b`), the
//!   chosen weights renormalized (`expert_weights_norm`) and scaled (`expert_weights_scale`), plus
//!   `expert_shared_count` shared experts (no gate); `swiglu_clamp_*` limits when given.
//! - `nextn_predict_layers` MTP blocks after the trunk (MLA with a full indexer, MoE, `nextn.*`):
//!   llama.cpp loads them only for its MTP graph, which it does not implement yet; the trunk never
//!   reads them.

pub mod forward;

pub use forward::Glm5NextGraph;

use super::common::{f32_per_layer, CommonHparams};
use super::{
    arch_kv, check, def, opt, ArchError, ArchHparams, Dim, LayerKind, LayerSel, Role, TensorClass,
    TensorDef,
};
use crate::compute::Gating;
use crate::gguf::{Metadata, Value};

/// `general.architecture`.
pub const ARCH: &str = "glm5-next";

/// Hyperparameters of a `glm5-next` model (llama.cpp's `llama_model_glm5_next::load_arch_hparams`).
#[derive(Clone, Debug, PartialEq)]
pub struct Glm5NextHparams {
    /// Vocabulary size (length of `tokenizer.ggml.tokens`, else `vocab_size`).
    pub n_vocab: u64,
    /// `context_length`.
    pub n_ctx_train: u32,
    /// `embedding_length`.
    pub n_embd: u32,
    /// Trunk blocks: `block_count - nextn_predict_layers`.
    pub n_layer: u32,
    /// `nextn_predict_layers`: MTP blocks after the trunk.
    pub n_nextn: u32,
    /// `feed_forward_length`: the dense leading blocks' FFN width.
    pub n_ff: u32,
    /// `attention.head_count`: MLA heads, and KDA heads.
    pub n_head: u32,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// `attention.layer_norm_epsilon` (the indexer keys' layer norm); llama.cpp reads it optionally.
    pub norm_eps: Option<f32>,
    /// Which blocks are KDA (`attention.head_count_kv` 0), MTP blocks included.
    pub recurrent: Vec<bool>,
    /// `ssm.conv_kernel`: taps of the KDA convolutions.
    pub ssm_conv_kernel: u32,
    /// `kda.head_dim`.
    pub kda_head_dim: u32,
    /// `kda.gate_lower_bound`: the sigmoid form of the decay when given.
    pub kda_gate_lower_bound: Option<f32>,
    /// `attention.q_lora_rank`.
    pub q_lora_rank: u32,
    /// `attention.kv_lora_rank` (also `key_length` and `value_length`: what the cache holds).
    pub kv_lora_rank: u32,
    /// `attention.key_length_mla`: the per-head Q/K size (no rotated part).
    pub head_k_mla: u32,
    /// `attention.value_length_mla`.
    pub head_v_mla: u32,
    /// `attention.indexer.head_count`.
    pub indexer_n_head: u32,
    /// `attention.indexer.key_length`.
    pub indexer_head_dim: u32,
    /// `attention.indexer.top_k`: cells selected per token (pools of `kpool`).
    pub indexer_top_k: u32,
    /// `attention.indexer.kpool`.
    pub indexer_kpool: u32,
    /// `attention.indexer.kpool_select_tail` (default true): a token also sees its incomplete pool.
    pub indexer_select_tail: bool,
    /// `attention.indexer.types`, one per trunk block (default all true): the blocks computing their own
    /// selection.
    pub indexer_full: Vec<bool>,
    /// `hyper_connection.count` (llama.cpp runs only 4).
    pub hc_mult: u32,
    /// `hyper_connection.sinkhorn_iterations`.
    pub hc_sinkhorn_iters: u32,
    /// `hyper_connection.epsilon`.
    pub hc_eps: f32,
    /// `expert_count`.
    pub n_expert: u32,
    /// `expert_used_count`.
    pub n_expert_used: u32,
    /// `expert_feed_forward_length`.
    pub n_ff_exp: u32,
    /// `expert_shared_count`: the shared experts are one FFN `n_ff_exp · count` wide.
    pub n_expert_shared: u32,
    /// `leading_dense_block_count`.
    pub n_dense_lead: u32,
    /// `expert_weights_scale` (0 when absent: llama.cpp then does not scale).
    pub expert_weights_scale: f32,
    /// `expert_weights_norm` (default false).
    pub expert_weights_norm: bool,
    /// `expert_gating_func` (default sigmoid).
    pub gating: Gating,
    /// `swiglu_clamp_exp` per block (0: no limit).
    pub swiglu_clamp_exp: Vec<f32>,
    /// `swiglu_clamp_shexp` per block (default the experts' limits).
    pub swiglu_clamp_shexp: Vec<f32>,
}

use Dim::*;
use TensorClass as C;

const ALL: Option<LayerSel> = Some(LayerSel::All);
const TRUNK: Option<LayerSel> = Some(LayerSel::Trunk);
const ATT: Option<LayerSel> = Some(LayerSel::Attention);
const KDA: Option<LayerSel> = Some(LayerSel::Recurrent);
const IDX: Option<LayerSel> = Some(LayerSel::IndexerFull);
const DENSE: Option<LayerSel> = Some(LayerSel::DenseFfn);
const MOE: Option<LayerSel> = Some(LayerSel::MoeFfn);
const MTP: Option<LayerSel> = Some(LayerSel::NextN);

/// The tensors of a `glm5-next` file (llama.cpp's `load_arch_tensors`), in its order within a block. The
/// indexer tensors of blocks that reuse the previous selection are optional there and not listed.
pub const TENSORS: &[TensorDef] = &[
    def(Role::TokenEmbd, None, &[Embd, Vocab], C::Embedding), // [n_embd, n_vocab]
    def(Role::OutputNorm, None, &[Embd], C::Norm),            // [n_embd]
    def(Role::Output, None, &[Embd, Vocab], C::Output),       // [n_embd, n_vocab]
    def(Role::AttnNorm, ALL, &[Embd], C::Norm),               // [n_embd]
    def(Role::FfnNorm, ALL, &[Embd], C::Norm),                // [n_embd]
    // mHC (trunk blocks)
    def(Role::HcAttnFn, TRUNK, &[HcFlat, HcMix], C::Unquantized), // [hc·n_embd, (2+hc)·hc]
    def(Role::HcAttnBase, TRUNK, &[HcMix], C::Unquantized),       // [(2+hc)·hc]
    def(Role::HcAttnScale, TRUNK, &[Three], C::Unquantized),      // [3]
    def(Role::HcFfnFn, TRUNK, &[HcFlat, HcMix], C::Unquantized),  // [hc·n_embd, (2+hc)·hc]
    def(Role::HcFfnBase, TRUNK, &[HcMix], C::Unquantized),        // [(2+hc)·hc]
    def(Role::HcFfnScale, TRUNK, &[Three], C::Unquantized),       // [3]
    // KDA blocks (d_inner = n_head · kda_head_dim); the kernels may carry a trailing 1
    def(
        Role::SsmConv1dQ,
        KDA,
        &[SsmConvKernel, One, SsmValueDim],
        C::DeltaNetParam,
    ), // [d_conv, 1, d_inner]
    def(
        Role::SsmConv1dK,
        KDA,
        &[SsmConvKernel, One, SsmValueDim],
        C::DeltaNetParam,
    ), // [d_conv, 1, d_inner]
    def(
        Role::SsmConv1dV,
        KDA,
        &[SsmConvKernel, One, SsmValueDim],
        C::DeltaNetParam,
    ), // [d_conv, 1, d_inner]
    def(Role::AttnQ, KDA, &[Embd, SsmValueDim], C::DeltaNet), // [n_embd, d_inner]
    def(Role::AttnK, KDA, &[Embd, SsmValueDim], C::DeltaNet), // [n_embd, d_inner]
    def(Role::AttnV, KDA, &[Embd, SsmValueDim], C::DeltaNet), // [n_embd, d_inner]
    def(Role::SsmFA, KDA, &[Embd, SsmHeadDim], C::Unquantized), // [n_embd, head_dim]
    def(Role::SsmFB, KDA, &[SsmHeadDim, SsmValueDim], C::Unquantized), // [head_dim, d_inner]
    def(Role::SsmBeta, KDA, &[Embd, Heads], C::Unquantized),  // [n_embd, n_head]
    def(Role::SsmA, KDA, &[Heads], C::DeltaNetParam),         // [n_head]: -exp(A_log)
    def(Role::SsmDt, KDA, &[SsmValueDim], C::DeltaNetParam),  // [d_inner]
    def(Role::SsmGA, KDA, &[Embd, SsmHeadDim], C::Unquantized), // [n_embd, head_dim]
    def(Role::SsmGB, KDA, &[SsmHeadDim, SsmValueDim], C::Unquantized), // [head_dim, d_inner]
    def(Role::SsmNorm, KDA, &[SsmHeadDim], C::Norm),          // [head_dim]
    def(Role::AttnOut, KDA, &[SsmValueDim, Embd], C::DeltaNet), // [d_inner, n_embd]
    // MLA blocks (trunk and MTP)
    def(Role::AttnQANorm, ATT, &[QLora], C::Norm), // [q_lora_rank]
    def(Role::AttnKvANorm, ATT, &[KvLora], C::Norm), // [kv_lora_rank]
    def(Role::AttnQA, ATT, &[Embd, QLora], C::Attention), // [n_embd, q_lora_rank]
    def(Role::AttnQB, ATT, &[QLora, QProjMla], C::Attention), // [q_lora_rank, n_head·head_k_mla]
    def(Role::AttnKvAMqa, ATT, &[Embd, KvLora], C::Unquantized), // [n_embd, kv_lora_rank] (no rope part)
    def(
        Role::AttnKB,
        ATT,
        &[HeadKMla, KvLora, Heads],
        C::Unquantized,
    ), // [head_k_mla, kv_lora, n_head]
    def(
        Role::AttnVB,
        ATT,
        &[KvLora, HeadVMla, Heads],
        C::Unquantized,
    ), // [kv_lora, head_v_mla, n_head]
    def(Role::AttnOut, ATT, &[OProjMla, Embd], C::Attention),    // [n_head·head_v_mla, n_embd]
    // the indexer of blocks that compute their own selection (and of the MTP block)
    def(Role::IndexerKNorm, IDX, &[IndexerDim], C::Norm), // [key_length]
    def(Role::IndexerKNormBias, IDX, &[IndexerDim], C::Norm), // [key_length]
    def(
        Role::IndexerProj,
        IDX,
        &[Embd, IndexerHeads],
        C::Unquantized,
    ), // [n_embd, heads]
    def(Role::IndexerAttnK, IDX, &[Embd, IndexerDim], C::Unquantized), // [n_embd, key_length]
    def(
        Role::IndexerAttnQB,
        IDX,
        &[QLora, IndexerQProj],
        C::Unquantized,
    ), // [q_lora, heads·key_length]
    def(
        Role::IndexerKpoolGate,
        IDX,
        &[Embd, IndexerDim],
        C::Unquantized,
    ), // [n_embd, key_length]
    def(
        Role::IndexerKpoolApe,
        IDX,
        &[IndexerDim, KPool],
        C::Unquantized,
    ), // [key_length, kpool]
    // dense SwiGLU (leading blocks)
    def(Role::FfnGate, DENSE, &[Embd, Ff], C::Ffn), // [n_embd, n_ff]
    def(Role::FfnDown, DENSE, &[Ff, Embd], C::Ffn), // [n_ff, n_embd]
    def(Role::FfnUp, DENSE, &[Embd, Ff], C::Ffn),   // [n_embd, n_ff]
    // routed and shared experts
    def(Role::FfnGateInp, MOE, &[Embd, Expert], C::Router), // [n_embd, n_expert]
    def(Role::FfnExpProbsB, MOE, &[Expert], C::Router),     // [n_expert], F32
    def(Role::FfnGateExps, MOE, &[Embd, FfExp, Expert], C::Expert), // [n_embd, n_ff_exp, n_expert]
    def(Role::FfnDownExps, MOE, &[FfExp, Embd, Expert], C::Expert), // [n_ff_exp, n_embd, n_expert]
    def(Role::FfnUpExps, MOE, &[Embd, FfExp, Expert], C::Expert), // [n_embd, n_ff_exp, n_expert]
    def(Role::FfnGateShexp, MOE, &[Embd, FfShexp], C::SharedExpert), // [n_embd, n_ff_exp·n_shared]
    def(Role::FfnDownShexp, MOE, &[FfShexp, Embd], C::SharedExpert), // [n_ff_exp·n_shared, n_embd]
    def(Role::FfnUpShexp, MOE, &[Embd, FfShexp], C::SharedExpert), // [n_embd, n_ff_exp·n_shared]
    // MTP block
    def(Role::NextnEhProj, MTP, &[Embd2, Embd], C::NextN), // [2·n_embd, n_embd]
    def(Role::NextnEnorm, MTP, &[Embd], C::Norm),          // [n_embd]
    def(Role::NextnHnorm, MTP, &[Embd], C::Norm),          // [n_embd]
    opt(def(
        Role::NextnEmbedTokens,
        MTP,
        &[Embd, Vocab],
        C::Embedding,
    )), // [n_embd, n_vocab]
    opt(def(
        Role::NextnSharedHeadHead,
        MTP,
        &[Embd, Vocab],
        C::Output,
    )), // [n_embd, n_vocab]
    opt(def(Role::NextnSharedHeadNorm, MTP, &[Embd], C::Norm)), // [n_embd]
];

/// `expert_gating_func` as llama.cpp numbers it; 0 (none) is sigmoid for this architecture.
fn gating_from_key(v: Option<u32>) -> Result<Gating, ArchError> {
    match v {
        None | Some(0) | Some(2) => Ok(Gating::Sigmoid),
        Some(1) => Ok(Gating::Softmax),
        Some(other) => Err(ArchError(format!(
            "{ARCH}: expert_gating_func {other} is not supported (softmax 1 and sigmoid 2 are)"
        ))),
    }
}

fn gating_key(g: Gating) -> u32 {
    match g {
        Gating::Softmax => 1,
        Gating::Sigmoid => 2,
    }
}

impl Glm5NextHparams {
    /// Reads the hyperparameters from a file's metadata (the keys llama.cpp's loader reads).
    pub fn from_metadata(md: &Metadata) -> Result<Self, ArchError> {
        let c = CommonHparams::read_hybrid(md, ARCH)?;
        let n_layer_all = c.n_layer_all;
        let n_nextn = md.arch_u32_opt("nextn_predict_layers")?.unwrap_or(0);
        check(
            ARCH,
            n_nextn < n_layer_all,
            "nextn_predict_layers leaves no trunk blocks",
        )?;
        let n_layer = n_layer_all - n_nextn;
        let kv = md
            .arch_u32_per_layer_opt("attention.head_count_kv", n_layer_all as usize)?
            .unwrap_or_else(|| vec![c.n_head_kv; n_layer_all as usize]);
        check(
            ARCH,
            c.n_rot == 0,
            "rope.dimension_count must be 0 (llama.cpp runs only the MLA without RoPE)",
        )?;
        let n_expert_used = super::uniform_u32_req(md, "expert_used_count", n_layer_all)?;
        let indexer_full = match md.arch_bool_array_opt("attention.indexer.types")? {
            Some(v) => {
                check(
                    ARCH,
                    v.len() >= n_layer as usize,
                    "attention.indexer.types has fewer values than trunk blocks",
                )?;
                v[..n_layer as usize].to_vec()
            }
            None => vec![true; n_layer as usize],
        };
        let n = n_layer_all as usize;
        let swiglu_clamp_exp =
            f32_per_layer(md, ARCH, "swiglu_clamp_exp", n)?.unwrap_or(vec![0.0; n]);
        let swiglu_clamp_shexp = f32_per_layer(md, ARCH, "swiglu_clamp_shexp", n)?
            .unwrap_or_else(|| swiglu_clamp_exp.clone());
        let hp = Glm5NextHparams {
            n_vocab: c.n_vocab,
            n_ctx_train: c.n_ctx_train,
            n_embd: c.n_embd,
            n_layer,
            n_nextn,
            n_ff: c.n_ff_opt(md)?,
            n_head: c.n_head,
            rms_eps: c.rms_eps,
            norm_eps: md.arch_f32_opt("attention.layer_norm_epsilon")?,
            recurrent: kv.iter().map(|&v| v == 0).collect(),
            ssm_conv_kernel: md.arch_u32("ssm.conv_kernel")?,
            kda_head_dim: md.arch_u32("kda.head_dim")?,
            kda_gate_lower_bound: md.arch_f32_opt("kda.gate_lower_bound")?,
            q_lora_rank: md.arch_u32("attention.q_lora_rank")?,
            kv_lora_rank: md.arch_u32("attention.kv_lora_rank")?,
            head_k_mla: md.arch_u32("attention.key_length_mla")?,
            head_v_mla: md.arch_u32("attention.value_length_mla")?,
            indexer_n_head: md.arch_u32("attention.indexer.head_count")?,
            indexer_head_dim: md.arch_u32("attention.indexer.key_length")?,
            indexer_top_k: md.arch_u32("attention.indexer.top_k")?,
            indexer_kpool: md.arch_u32("attention.indexer.kpool")?,
            indexer_select_tail: md
                .arch_bool_opt("attention.indexer.kpool_select_tail")?
                .unwrap_or(true),
            indexer_full,
            hc_mult: md.arch_u32("hyper_connection.count")?,
            hc_sinkhorn_iters: md.arch_u32("hyper_connection.sinkhorn_iterations")?,
            hc_eps: md.arch_f32("hyper_connection.epsilon")?,
            n_expert: md.arch_u32("expert_count")?,
            n_expert_used,
            n_ff_exp: super::uniform_u32_req(md, "expert_feed_forward_length", n_layer_all)?,
            n_expert_shared: md.arch_u32("expert_shared_count")?,
            n_dense_lead: md.arch_u32_opt("leading_dense_block_count")?.unwrap_or(0),
            expert_weights_scale: md.arch_f32_opt("expert_weights_scale")?.unwrap_or(0.0),
            expert_weights_norm: md.arch_bool_opt("expert_weights_norm")?.unwrap_or(false),
            gating: gating_from_key(md.arch_u32_opt("expert_gating_func")?)?,
            swiglu_clamp_exp,
            swiglu_clamp_shexp,
        };
        hp.validate()?;
        Ok(hp)
    }

    /// Whether block `il` is a KDA block.
    pub fn is_recurrent(&self, il: u32) -> bool {
        self.recurrent.get(il as usize).copied().unwrap_or(false)
    }

    /// `kda.head_dim · n_head`: a KDA block's Q, K and V width.
    pub fn kda_inner(&self) -> u32 {
        self.kda_head_dim * self.n_head
    }
}

impl ArchHparams for Glm5NextHparams {
    fn arch_name(&self) -> &'static str {
        ARCH
    }

    fn tensor_defs(&self) -> &'static [TensorDef] {
        TENSORS
    }

    fn n_layer_all(&self) -> u32 {
        self.n_layer + self.n_nextn
    }

    fn layer_kind(&self, il: u32) -> LayerKind {
        LayerKind::of_trunk_then_nextn(il, self.n_layer, self.is_recurrent(il))
    }

    fn dense_ffn(&self, il: u32) -> bool {
        il < self.n_dense_lead
    }

    fn indexer_full(&self, il: u32) -> bool {
        il >= self.n_layer || self.indexer_full.get(il as usize).copied().unwrap_or(true)
    }

    fn dim(&self, d: Dim) -> Option<u64> {
        let u = |x: u32| x as u64;
        let v = match d {
            Embd => u(self.n_embd),
            Embd2 => 2 * u(self.n_embd),
            Vocab => self.n_vocab,
            Ff => u(self.n_ff),
            FfExp => u(self.n_ff_exp),
            FfShexp => u(self.n_ff_exp) * u(self.n_expert_shared),
            Expert => u(self.n_expert),
            One => 1,
            Three => 3,
            Heads => u(self.n_head),
            HcFlat => u(self.hc_mult) * u(self.n_embd),
            HcMix => u(2 + self.hc_mult) * u(self.hc_mult),
            SsmConvKernel => u(self.ssm_conv_kernel),
            SsmHeadDim => u(self.kda_head_dim),
            SsmValueDim => u(self.kda_inner()),
            QLora => u(self.q_lora_rank),
            KvLora => u(self.kv_lora_rank),
            HeadKMla => u(self.head_k_mla),
            HeadVMla => u(self.head_v_mla),
            QProjMla => u(self.n_head) * u(self.head_k_mla),
            OProjMla => u(self.n_head) * u(self.head_v_mla),
            IndexerHeads => u(self.indexer_n_head),
            IndexerDim => u(self.indexer_head_dim),
            IndexerQProj => u(self.indexer_n_head) * u(self.indexer_head_dim),
            KPool => u(self.indexer_kpool),
            _ => return None,
        };
        Some(v)
    }

    fn n_expert_used(&self) -> u32 {
        self.n_expert_used
    }

    fn synth_writes(&self, _role: Role) -> bool {
        // The MTP block's optional embedding and head: converted files use the model's own.
        false
    }

    fn to_metadata(&self) -> Vec<(String, Value)> {
        // The converter writes 1 KV head for MLA blocks (MTP blocks included), 0 for KDA blocks.
        let kv_heads = (0..self.n_layer_all()).map(|il| u32::from(!self.is_recurrent(il)));
        let mut kv = vec![
            arch_kv(ARCH, "context_length", self.n_ctx_train),
            arch_kv(ARCH, "embedding_length", self.n_embd),
            arch_kv(ARCH, "feed_forward_length", self.n_ff),
            arch_kv(ARCH, "block_count", self.n_layer_all()),
            arch_kv(ARCH, "attention.head_count", self.n_head),
            arch_kv(ARCH, "attention.head_count_kv", Value::u32_array(kv_heads)),
            arch_kv(ARCH, "attention.layer_norm_rms_epsilon", self.rms_eps),
        ];
        if let Some(e) = self.norm_eps {
            kv.push(arch_kv(ARCH, "attention.layer_norm_epsilon", e));
        }
        if self.n_nextn > 0 {
            kv.push(arch_kv(ARCH, "nextn_predict_layers", self.n_nextn));
        }
        kv.extend([
            arch_kv(ARCH, "ssm.conv_kernel", self.ssm_conv_kernel),
            arch_kv(ARCH, "kda.head_dim", self.kda_head_dim),
        ]);
        if let Some(lb) = self.kda_gate_lower_bound {
            kv.push(arch_kv(ARCH, "kda.gate_lower_bound", lb));
        }
        kv.extend([
            arch_kv(ARCH, "attention.q_lora_rank", self.q_lora_rank),
            arch_kv(ARCH, "attention.kv_lora_rank", self.kv_lora_rank),
            arch_kv(ARCH, "rope.dimension_count", 0u32),
            arch_kv(ARCH, "attention.key_length", self.kv_lora_rank),
            arch_kv(ARCH, "attention.value_length", self.kv_lora_rank),
            arch_kv(ARCH, "attention.key_length_mla", self.head_k_mla),
            arch_kv(ARCH, "attention.value_length_mla", self.head_v_mla),
            arch_kv(ARCH, "attention.indexer.head_count", self.indexer_n_head),
            arch_kv(ARCH, "attention.indexer.key_length", self.indexer_head_dim),
            arch_kv(ARCH, "attention.indexer.top_k", self.indexer_top_k),
            arch_kv(ARCH, "attention.indexer.kpool", self.indexer_kpool),
            arch_kv(
                ARCH,
                "attention.indexer.kpool_select_tail",
                self.indexer_select_tail,
            ),
            arch_kv(
                ARCH,
                "attention.indexer.types",
                Value::bool_array(self.indexer_full.iter().copied()),
            ),
            arch_kv(ARCH, "hyper_connection.count", self.hc_mult),
            arch_kv(
                ARCH,
                "hyper_connection.sinkhorn_iterations",
                self.hc_sinkhorn_iters,
            ),
            arch_kv(ARCH, "hyper_connection.epsilon", self.hc_eps),
            arch_kv(ARCH, "expert_count", self.n_expert),
            arch_kv(ARCH, "expert_used_count", self.n_expert_used),
            arch_kv(ARCH, "expert_feed_forward_length", self.n_ff_exp),
            arch_kv(ARCH, "expert_shared_count", self.n_expert_shared),
            arch_kv(ARCH, "leading_dense_block_count", self.n_dense_lead),
            arch_kv(ARCH, "expert_weights_scale", self.expert_weights_scale),
            arch_kv(ARCH, "expert_weights_norm", self.expert_weights_norm),
            arch_kv(ARCH, "expert_gating_func", gating_key(self.gating)),
        ]);
        if self.swiglu_clamp_exp.iter().any(|&x| x != 0.0) {
            kv.push(arch_kv(
                ARCH,
                "swiglu_clamp_exp",
                Value::f32_array(self.swiglu_clamp_exp.iter().copied()),
            ));
        }
        if self.swiglu_clamp_shexp != self.swiglu_clamp_exp {
            kv.push(arch_kv(
                ARCH,
                "swiglu_clamp_shexp",
                Value::f32_array(self.swiglu_clamp_shexp.iter().copied()),
            ));
        }
        kv
    }

    fn common(&self) -> CommonHparams {
        CommonHparams {
            n_vocab: self.n_vocab,
            n_ctx_train: self.n_ctx_train,
            n_embd: self.n_embd,
            n_layer_all: self.n_layer_all(),
            n_head: self.n_head,
            n_head_kv: 1,
            head_k: self.kv_lora_rank,
            head_v: self.kv_lora_rank,
            n_rot: 0,
            rms_eps: self.rms_eps,
            rope_freq_base: super::common::DEFAULT_ROPE_FREQ_BASE,
        }
    }

    fn validate(&self) -> Result<(), ArchError> {
        self.common().validate(ARCH)?;
        let n_all = self.n_layer_all() as usize;
        check(
            ARCH,
            self.recurrent.len() == n_all,
            "the KDA blocks are not given for every block",
        )?;
        check(
            ARCH,
            self.recurrent[self.n_layer as usize..].iter().all(|&r| !r),
            "an MTP block is a KDA block (MTP blocks are MLA blocks)",
        )?;
        check(
            ARCH,
            self.indexer_full.len() == self.n_layer as usize,
            "attention.indexer.types is not given for every trunk block",
        )?;
        let first_attention = (0..self.n_layer).find(|&il| !self.is_recurrent(il));
        check(
            ARCH,
            first_attention.is_none_or(|il| self.indexer_full[il as usize]),
            "the first MLA block reuses an indexer selection no block computed (llama.cpp asserts \
             that a shared-indexer block follows a full one)",
        )?;
        check(
            ARCH,
            self.hc_mult == 4,
            "hyper_connection.count must be 4 (llama.cpp asserts it)",
        )?;
        check(
            ARCH,
            self.indexer_kpool > 1 && self.indexer_top_k.is_multiple_of(self.indexer_kpool),
            "attention.indexer.kpool must be above 1 and divide indexer.top_k (llama.cpp asserts it)",
        )?;
        check(
            ARCH,
            self.indexer_n_head > 0 && self.indexer_head_dim > 0,
            "the indexer has no heads",
        )?;
        check(
            ARCH,
            self.ssm_conv_kernel > 1 && self.kda_head_dim > 0,
            "ssm.conv_kernel must be above 1 and kda.head_dim above 0",
        )?;
        check(
            ARCH,
            self.q_lora_rank > 0
                && self.kv_lora_rank > 0
                && self.head_k_mla > 0
                && self.head_v_mla > 0,
            "an MLA size is 0",
        )?;
        check(
            ARCH,
            self.n_dense_lead <= self.n_layer,
            "leading_dense_block_count exceeds the trunk",
        )?;
        check(
            ARCH,
            self.n_dense_lead == 0 || self.n_ff > 0,
            "dense leading blocks need feed_forward_length",
        )?;
        check(
            ARCH,
            self.n_expert > 0
                && self.n_expert_used > 0
                && self.n_expert_used <= self.n_expert
                && self.n_ff_exp > 0
                && self.n_expert_shared > 0,
            "the experts (count, used, width, shared count) must be above 0, used at most count",
        )?;
        check(
            ARCH,
            self.swiglu_clamp_exp.len() == n_all && self.swiglu_clamp_shexp.len() == n_all,
            "the SwiGLU limits are not given for every block",
        )?;
        check(
            ARCH,
            self.rms_eps > 0.0 && self.hc_eps > 0.0,
            "layer_norm_rms_epsilon and hyper_connection.epsilon must be positive",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{resolve_tensors, ModelHparams, Presence};
    use crate::synth::shapes::find_shape;

    fn tiny() -> Glm5NextHparams {
        let Some(ModelHparams::Glm5Next(h)) = find_shape(ARCH, "tiny").map(|s| s.hparams) else {
            panic!("no tiny glm5-next shape");
        };
        h
    }

    use crate::arch::common::test_metadata::{metadata_of as md_of, set_key};

    type MetadataPairs = Vec<(String, Value)>;

    fn set(kv: &mut MetadataPairs, suffix: &str, v: Value) {
        set_key(kv, ARCH, suffix, v);
    }

    #[test]
    fn metadata_round_trips_with_llama_cpps_defaults() {
        let h = tiny();
        assert_eq!(
            Glm5NextHparams::from_metadata(&md_of(&h, |_| {})),
            Ok(h.clone())
        );
        // Absent optional keys take llama.cpp's defaults: sigmoid gating, no scale, no norm, the tail
        // selected, every block a full indexer, no SwiGLU limits.
        let md = md_of(&h, |kv| {
            for k in [
                "expert_gating_func",
                "expert_weights_scale",
                "expert_weights_norm",
                "attention.indexer.kpool_select_tail",
                "attention.indexer.types",
                "leading_dense_block_count",
            ] {
                let key = format!("{ARCH}.{k}");
                kv.retain(|(x, _)| *x != key);
            }
        });
        let d = Glm5NextHparams::from_metadata(&md).unwrap();
        assert_eq!(d.gating, Gating::Sigmoid);
        assert_eq!(d.expert_weights_scale, 0.0);
        assert!(!d.expert_weights_norm && d.indexer_select_tail);
        assert!(d.indexer_full.iter().all(|&f| f));
        assert_eq!(d.n_dense_lead, 0);
        assert!(d.swiglu_clamp_exp.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn the_table_gives_each_block_its_mixer_indexer_and_ffn() {
        let h = tiny();
        let t = resolve_tensors(&h).unwrap();
        let has = |name: &str| t.iter().any(|d| d.name == name);
        for il in 0..h.n_layer {
            assert!(has(&format!("blk.{il}.hc_attn_fn.weight")));
            assert_eq!(has(&format!("blk.{il}.ssm_f_a.weight")), h.is_recurrent(il));
            assert_eq!(
                has(&format!("blk.{il}.attn_k_b.weight")),
                !h.is_recurrent(il)
            );
            assert_eq!(
                has(&format!("blk.{il}.indexer.proj.weight")),
                !h.is_recurrent(il) && h.indexer_full[il as usize]
            );
            assert_eq!(has(&format!("blk.{il}.ffn_up.weight")), il < h.n_dense_lead);
            assert_eq!(
                has(&format!("blk.{il}.ffn_up_shexp.weight")),
                il >= h.n_dense_lead
            );
        }
        // KDA and MLA blocks both have attn_output, of their own widths.
        let out = |il: u32| {
            t.iter()
                .find(|d| d.name == format!("blk.{il}.attn_output.weight"))
                .map(|d| d.dims.clone())
        };
        let kda = (0..h.n_layer).find(|&il| h.is_recurrent(il)).unwrap();
        let mla = (0..h.n_layer).find(|&il| !h.is_recurrent(il)).unwrap();
        assert_eq!(out(kda), Some(vec![h.kda_inner() as u64, h.n_embd as u64]));
        assert_eq!(
            out(mla),
            Some(vec![(h.n_head * h.head_v_mla) as u64, h.n_embd as u64])
        );
        assert!(t.iter().all(|d| d.presence == Presence::Required));
        // The MTP block: no mHC tensors in it, a full indexer and the nextn projections.
        assert_eq!(h.n_nextn, 1);
        let il = h.n_layer;
        let has = |name: String| t.iter().any(|d| d.name == name);
        assert!(!has(format!("blk.{il}.hc_attn_fn.weight")));
        assert!(has(format!("blk.{il}.indexer.proj.weight")));
        assert!(has(format!("blk.{il}.nextn.eh_proj.weight")));
        assert!(has(format!("blk.{il}.attn_kv_a_mqa.weight")));
    }

    #[test]
    fn refuses_what_llama_cpp_refuses_with_the_reason() {
        let h = tiny();
        let err = |edit: &dyn Fn(&mut MetadataPairs)| {
            Glm5NextHparams::from_metadata(&md_of(&h, edit))
                .unwrap_err()
                .0
        };
        assert!(err(&|kv| set(kv, "hyper_connection.count", Value::U32(2))).contains("must be 4"));
        assert!(err(&|kv| set(kv, "attention.indexer.kpool", Value::U32(3))).contains("kpool"));
        assert!(err(&|kv| set(kv, "rope.dimension_count", Value::U32(16))).contains("RoPE"));
        assert!(err(&|kv| set(kv, "expert_gating_func", Value::U32(4))).contains("gating"));
        let first_mla = (0..h.n_layer).find(|&il| !h.is_recurrent(il)).unwrap();
        let mut types = h.indexer_full.clone();
        types[first_mla as usize] = false;
        assert!(err(&|kv| set(
            kv,
            "attention.indexer.types",
            Value::bool_array(types.iter().copied())
        ))
        .contains("shared-indexer"));
    }
}
