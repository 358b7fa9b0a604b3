//! DeepSeek V4 (`deepseek4`: DeepSeek V4 Flash): its hyperparameters and tensor table, as llama.cpp's
//! `src/models/deepseek4.cpp` of the pinned sdist loads them, and its forward pass ([`forward`],
//! [`Deepseek4Graph`]). Only the CPU runs it: the forward pass uses operations the card lacks
//! ([`crate::arch::GraphUses::cpu_only`]), so the GPU backend refuses it at load.
//!
//! The model, as llama.cpp's graph computes it:
//! - mHC residual streams as in `glm5-next` (`hyper_connection.count` streams, pre/post weights and the
//!   Sinkhorn-normalized stream mixing around the attention and around the FFN), and at the end an mHC
//!   head instead of the streams' mean: `output_hc_fn` on the RMS-normed flattened streams gives one
//!   weight per stream, `sigmoid(s·m + b) + eps`, whose weighted sum goes through the output norm.
//! - Attention, one head of K/V shared by all `n_head` query heads (`head_count_kv` 1), heads of
//!   `key_length` (= `value_length`) whose last `rope.dimension_count` values turn (NORM RoPE):
//!   Q through a normed latent (`attn_q_a`, `attn_q_a_norm`, `attn_q_b`), then each head RMS-normed
//!   without weight; the shared K = V from `attn_kv` and its norm. Scores scaled by `1/sqrt(key_length)`,
//!   a per-head sink logit (`attn_sinks`) in the softmax, the output's rotated part turned back (RoPE at
//!   the negative position), then `attn_output_a` per group of heads (`output_group_count` groups to
//!   `output_lora_rank` each) and `attn_output_b`.
//! - What a token attends to, by `attention.compress_ratios[il]`:
//!   - 0: the last `sliding_window` tokens (RoPE base `rope.freq_base`, no YaRN).
//!   - 128 (HCA): the window plus one compressed entry per 128 earlier tokens: per token a KV row
//!     (`attn_compressor_kv`) and a gate row (`attn_compressor_gate` plus `attn_compressor_ape`'s row of
//!     the token's place in its block); an entry is the per-channel softmax-over-gates weighted sum of
//!     its 128 tokens' KV rows, RMS-normed (`attn_compressor_norm`) and turned at the entry's position
//!     (RoPE base `attention.compress_rope_freq_base`, with YaRN when the file asks).
//!   - 4 (CSA): the same by 4 with overlapping halves (the compressor's rows are `2·key_length` wide: the
//!     previous block's first half and the current block's second half), and a lightning indexer (its own
//!     compressed keys `indexer_compressor_*`, queries `indexer.attn_q_b` of the Q latent, weights
//!     `indexer.proj`, scores `Σ_h relu(q_h·k)·w_h`) keeps the `indexer.top_k` best entries.
//! - FFN: routed experts with sqrt-softplus scores (`expert_gating_func` 4) and a selection bias, the
//!   chosen weights renormalized and scaled, beside `expert_shared_count` shared experts; the first
//!   `hash_layer_count` blocks choose a token's experts from a table by its id (`ffn_gate_tid2eid`,
//!   I32) and only weigh them with the router. SwiGLU limits (`swiglu_clamp_*`) on both.
//! - `nextn_predict_layers` MTP blocks after the trunk (converted files of the trunk have none).

pub mod forward;

pub use forward::Deepseek4Graph;

use super::common::{f32_per_layer, CommonHparams};
use super::{
    arch_kv, check, def, opt, ArchError, ArchHparams, Dim, LayerKind, LayerSel, Role, TensorClass,
    TensorDef,
};
use crate::gguf::{Metadata, Value};

/// `general.architecture`.
pub const ARCH: &str = "deepseek4";

/// llama.cpp's `expert_gating_func` number for sqrt-softplus, the only one it loads for `deepseek4`.
pub const GATING_SQRT_SOFTPLUS: u32 = 4;

/// Tokens per compressed entry of a CSA block (with the indexer) and of an HCA block.
pub const CSA_RATIO: u32 = 4;
pub const HCA_RATIO: u32 = 128;

/// YaRN RoPE scaling (`rope.scaling.*`), which llama.cpp applies to the compressed blocks only.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// `rope.scaling.factor`.
    pub factor: f32,
    /// `rope.scaling.original_context_length`.
    pub n_ctx_orig: u32,
    /// `rope.scaling.yarn_beta_fast` (llama.cpp's default 32).
    pub beta_fast: f32,
    /// `rope.scaling.yarn_beta_slow` (default 1).
    pub beta_slow: f32,
}

/// Hyperparameters of a `deepseek4` model (llama.cpp's `llama_model_deepseek4::load_arch_hparams`).
#[derive(Clone, Debug, PartialEq)]
pub struct Deepseek4Hparams {
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
    /// `attention.head_count`.
    pub n_head: u32,
    /// `attention.key_length` = `attention.value_length`: the head size, K and V alike.
    pub head_dim: u32,
    /// `rope.dimension_count`: the rotated values at the end of each head.
    pub n_rot: u32,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// `rope.freq_base`: the uncompressed blocks' RoPE base.
    pub rope_freq_base: f32,
    /// `attention.compress_rope_freq_base`: the compressed blocks' RoPE base.
    pub compress_rope_freq_base: f32,
    /// `rope.scaling.*` when `rope.scaling.type` is `yarn`.
    pub yarn: Option<Yarn>,
    /// `attention.sliding_window`.
    pub sliding_window: u32,
    /// `attention.q_lora_rank`.
    pub q_lora_rank: u32,
    /// `attention.output_group_count`.
    pub o_groups: u32,
    /// `attention.output_lora_rank`: each group's low-rank output width.
    pub o_lora_rank: u32,
    /// `attention.compress_ratios`, one per block (MTP blocks included): 0, 4 or 128.
    pub compress_ratios: Vec<u32>,
    /// `attention.indexer.head_count`.
    pub indexer_n_head: u32,
    /// `attention.indexer.key_length`.
    pub indexer_head_dim: u32,
    /// `attention.indexer.top_k`: compressed entries a CSA block keeps per token.
    pub indexer_top_k: u32,
    /// `hyper_connection.count` (llama.cpp runs only 4).
    pub hc_mult: u32,
    /// `hyper_connection.sinkhorn_iterations`.
    pub hc_sinkhorn_iters: u32,
    /// `hyper_connection.epsilon`.
    pub hc_eps: f32,
    /// `hash_layer_count`: the first blocks, whose experts the token's id chooses.
    pub n_hash_layers: u32,
    /// `expert_count`.
    pub n_expert: u32,
    /// `expert_used_count`.
    pub n_expert_used: u32,
    /// `expert_feed_forward_length`.
    pub n_ff_exp: u32,
    /// `expert_shared_count`: the shared experts are one FFN `n_ff_exp · count` wide.
    pub n_expert_shared: u32,
    /// `expert_weights_scale`.
    pub expert_weights_scale: f32,
    /// `expert_weights_norm`.
    pub expert_weights_norm: bool,
    /// `swiglu_clamp_exp` per block (0: no limit).
    pub swiglu_clamp_exp: Vec<f32>,
    /// `swiglu_clamp_shexp` per block (default the experts' limits).
    pub swiglu_clamp_shexp: Vec<f32>,
}

use Dim::*;
use TensorClass as C;

const ALL: Option<LayerSel> = Some(LayerSel::All);
const CSA: Option<LayerSel> = Some(LayerSel::Csa);
const HCA: Option<LayerSel> = Some(LayerSel::Hca);
const HASH: Option<LayerSel> = Some(LayerSel::HashRouted);
const BIAS: Option<LayerSel> = Some(LayerSel::BiasRouted);
const MTP: Option<LayerSel> = Some(LayerSel::NextN);

/// The tensors of a `deepseek4` file (llama.cpp's `load_arch_tensors`), in its order within a block.
/// The vision variant's optional `exp_probs_b_vl` is not listed (the text model never reads it).
pub const TENSORS: &[TensorDef] = &[
    def(Role::TokenEmbd, None, &[Embd, Vocab], C::Embedding), // [n_embd, n_vocab]
    def(Role::OutputNorm, None, &[Embd], C::Norm),            // [n_embd]
    def(Role::Output, None, &[Embd, Vocab], C::Output),       // [n_embd, n_vocab]
    // The mHC head: one weight per stream into the final norm.
    def(Role::HcHeadFn, None, &[HcFlat, Hc], C::Unquantized), // [hc·n_embd, hc]
    def(Role::HcHeadBase, None, &[Hc], C::Unquantized),       // [hc]
    def(Role::HcHeadScale, None, &[One], C::Unquantized),     // [1]
    // Attention (every block)
    def(Role::AttnNorm, ALL, &[Embd], C::Norm), // [n_embd]
    def(Role::AttnSinks, ALL, &[Heads], C::Norm), // [n_head]: a sink logit per head
    def(Role::AttnQA, ALL, &[Embd, QLora], C::Attention), // [n_embd, q_lora_rank]
    def(Role::AttnQANorm, ALL, &[QLora], C::Norm), // [q_lora_rank]
    def(Role::AttnQB, ALL, &[QLora, QProj], C::Attention), // [q_lora_rank, n_head·head]
    def(Role::AttnKv, ALL, &[Embd, HeadK], C::Attention), // [n_embd, head]: K = V, one head
    def(Role::AttnKvANorm, ALL, &[HeadK], C::Norm), // [head]
    def(Role::AttnOutA, ALL, &[OGroupIn, OLora], C::Attention), // [n_head·head/groups, groups·o_lora]
    def(Role::AttnOutB, ALL, &[OLora, Embd], C::Attention),     // [groups·o_lora, n_embd]
    // mHC around the attention and the FFN
    def(Role::HcAttnFn, ALL, &[HcFlat, HcMix], C::Unquantized), // [hc·n_embd, (2+hc)·hc]
    def(Role::HcAttnBase, ALL, &[HcMix], C::Unquantized),       // [(2+hc)·hc]
    def(Role::HcAttnScale, ALL, &[Three], C::Unquantized),      // [3]
    def(Role::HcFfnFn, ALL, &[HcFlat, HcMix], C::Unquantized),  // [hc·n_embd, (2+hc)·hc]
    def(Role::HcFfnBase, ALL, &[HcMix], C::Unquantized),        // [(2+hc)·hc]
    def(Role::HcFfnScale, ALL, &[Three], C::Unquantized),       // [3]
    // CSA blocks (ratio 4): the compressor's rows hold two overlapping halves
    def(Role::AttnCompressorKv, CSA, &[Embd, HeadK2], C::Attention), // [n_embd, 2·head]
    def(Role::AttnCompressorGate, CSA, &[Embd, HeadK2], C::Attention), // [n_embd, 2·head]
    def(
        Role::AttnCompressorApe,
        CSA,
        &[HeadK2, CsaRatio],
        C::Unquantized,
    ), // [2·head, 4]
    def(Role::AttnCompressorNorm, CSA, &[HeadK], C::Norm),           // [head]
    // ... and the lightning indexer
    def(
        Role::IndexerProj,
        CSA,
        &[Embd, IndexerHeads],
        C::Unquantized,
    ), // [n_embd, idx heads]
    def(
        Role::IndexerAttnQB,
        CSA,
        &[QLora, IndexerQProj],
        C::Attention,
    ), // [q_lora, heads·idx head]
    def(
        Role::IndexerCompressorKv,
        CSA,
        &[Embd, IndexerDim2],
        C::Attention,
    ), // [n_embd, 2·idx head]
    def(
        Role::IndexerKpoolGate,
        CSA,
        &[Embd, IndexerDim2],
        C::Attention,
    ), // [n_embd, 2·idx head]
    def(
        Role::IndexerKpoolApe,
        CSA,
        &[IndexerDim2, CsaRatio],
        C::Unquantized,
    ), // [2·idx head, 4]
    def(Role::IndexerCompressorNorm, CSA, &[IndexerDim], C::Norm), // [idx head]
    // HCA blocks (ratio 128)
    def(Role::AttnCompressorKv, HCA, &[Embd, HeadK], C::Attention), // [n_embd, head]
    def(Role::AttnCompressorGate, HCA, &[Embd, HeadK], C::Attention), // [n_embd, head]
    def(
        Role::AttnCompressorApe,
        HCA,
        &[HeadK, HcaRatio],
        C::Unquantized,
    ), // [head, 128]
    def(Role::AttnCompressorNorm, HCA, &[HeadK], C::Norm),          // [head]
    // FFN: router, hash table or selection bias, experts and shared experts
    def(Role::FfnGateInp, ALL, &[Embd, Expert], C::Router), // [n_embd, n_expert]
    def(Role::FfnGateTid2eid, HASH, &[ExpertUsed, Vocab], C::Index), // [n_used, n_vocab] I32
    def(Role::FfnExpProbsB, BIAS, &[Expert], C::Router),    // [n_expert]
    def(Role::FfnNorm, ALL, &[Embd], C::Norm),              // [n_embd]
    def(Role::FfnGateExps, ALL, &[Embd, FfExp, Expert], C::Expert), // [n_embd, n_ff_exp, n_expert]
    def(Role::FfnDownExps, ALL, &[FfExp, Embd, Expert], C::Expert), // [n_ff_exp, n_embd, n_expert]
    def(Role::FfnUpExps, ALL, &[Embd, FfExp, Expert], C::Expert), // [n_embd, n_ff_exp, n_expert]
    def(Role::FfnGateShexp, ALL, &[Embd, FfShexp], C::SharedExpert), // [n_embd, n_ff_shexp]
    def(Role::FfnDownShexp, ALL, &[FfShexp, Embd], C::SharedExpert), // [n_ff_shexp, n_embd]
    def(Role::FfnUpShexp, ALL, &[Embd, FfShexp], C::SharedExpert), // [n_embd, n_ff_shexp]
    // MTP blocks
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

/// `rope.scaling.*`: YaRN when the type says so, none when absent; other types are refused.
fn read_yarn(md: &Metadata) -> Result<Option<Yarn>, ArchError> {
    match md.arch_str_opt("rope.scaling.type")? {
        None | Some("none") => Ok(None),
        Some("yarn") => Ok(Some(Yarn {
            factor: md.arch_f32("rope.scaling.factor")?,
            n_ctx_orig: md.arch_u32("rope.scaling.original_context_length")?,
            beta_fast: md
                .arch_f32_opt("rope.scaling.yarn_beta_fast")?
                .unwrap_or(32.0),
            beta_slow: md
                .arch_f32_opt("rope.scaling.yarn_beta_slow")?
                .unwrap_or(1.0),
        })),
        Some(other) => Err(ArchError(format!(
            "{ARCH}: rope.scaling.type {other:?} is not supported (yarn is)"
        ))),
    }
}

impl Deepseek4Hparams {
    /// Reads the hyperparameters from a file's metadata (the keys llama.cpp's loader reads).
    pub fn from_metadata(md: &Metadata) -> Result<Self, ArchError> {
        let c = CommonHparams::read(md, ARCH)?;
        let n_layer_all = c.n_layer_all;
        let n_nextn = md.arch_u32_opt("nextn_predict_layers")?.unwrap_or(0);
        check(
            ARCH,
            n_nextn < n_layer_all,
            "nextn_predict_layers leaves no trunk blocks",
        )?;
        let n = n_layer_all as usize;
        let compress_ratios = md.arch_u32_array("attention.compress_ratios")?;
        check(
            ARCH,
            compress_ratios.len() >= n,
            "compress_ratios is shorter than block_count (llama.cpp refuses it)",
        )?;
        let gating = md.arch_u32("expert_gating_func")?;
        check(
            ARCH,
            gating == GATING_SQRT_SOFTPLUS,
            "expert_gating_func must be 4, sqrt-softplus (llama.cpp's loader expects it)",
        )?;
        let swiglu_clamp_exp = f32_per_layer(md, ARCH, "swiglu_clamp_exp", n)?
            .ok_or_else(|| ArchError(format!("{ARCH}: swiglu_clamp_exp is missing")))?;
        let swiglu_clamp_shexp = f32_per_layer(md, ARCH, "swiglu_clamp_shexp", n)?
            .unwrap_or_else(|| swiglu_clamp_exp.clone());
        let hp = Deepseek4Hparams {
            n_vocab: c.n_vocab,
            n_ctx_train: c.n_ctx_train,
            n_embd: c.n_embd,
            n_layer: n_layer_all - n_nextn,
            n_nextn,
            n_head: c.n_head,
            head_dim: c.head_dim(ARCH)?,
            n_rot: c.n_rot,
            rms_eps: c.rms_eps,
            rope_freq_base: c.rope_freq_base,
            compress_rope_freq_base: md.arch_f32("attention.compress_rope_freq_base")?,
            yarn: read_yarn(md)?,
            sliding_window: md.arch_u32("attention.sliding_window")?,
            q_lora_rank: md.arch_u32("attention.q_lora_rank")?,
            o_groups: md.arch_u32("attention.output_group_count")?,
            o_lora_rank: md.arch_u32("attention.output_lora_rank")?,
            compress_ratios: compress_ratios[..n].to_vec(),
            indexer_n_head: md.arch_u32("attention.indexer.head_count")?,
            indexer_head_dim: md.arch_u32("attention.indexer.key_length")?,
            indexer_top_k: md.arch_u32("attention.indexer.top_k")?,
            hc_mult: md.arch_u32("hyper_connection.count")?,
            hc_sinkhorn_iters: md.arch_u32("hyper_connection.sinkhorn_iterations")?,
            hc_eps: md.arch_f32("hyper_connection.epsilon")?,
            n_hash_layers: md.arch_u32("hash_layer_count")?,
            n_expert: md.arch_u32("expert_count")?,
            n_expert_used: super::uniform_u32_req(md, "expert_used_count", n_layer_all)?,
            n_ff_exp: super::uniform_u32_req(md, "expert_feed_forward_length", n_layer_all)?,
            n_expert_shared: md.arch_u32("expert_shared_count")?,
            expert_weights_scale: md.arch_f32("expert_weights_scale")?,
            expert_weights_norm: md
                .arch_bool_opt("expert_weights_norm")?
                .ok_or_else(|| ArchError(format!("{ARCH}: expert_weights_norm is missing")))?,
            swiglu_clamp_exp,
            swiglu_clamp_shexp,
        };
        check(
            ARCH,
            c.n_head_kv == 1,
            "attention.head_count_kv must be 1 (one K/V head shared by all query heads)",
        )?;
        hp.validate()?;
        Ok(hp)
    }

    /// Tokens per compressed entry in block `il`: 0 (window only), 4 (CSA) or 128 (HCA).
    pub fn ratio(&self, il: u32) -> u32 {
        self.compress_ratios.get(il as usize).copied().unwrap_or(0)
    }

    /// The head's values that do not turn (its first `head_dim − n_rot`).
    pub fn n_nope(&self) -> u32 {
        self.head_dim - self.n_rot
    }
}

impl ArchHparams for Deepseek4Hparams {
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
        // Every block is sliding-window attention (llama.cpp marks them all SWA); the compressed entries
        // beside the window are the block's own state.
        match il >= self.n_layer {
            true => LayerKind::NextN,
            false => LayerKind::SlidingAttention,
        }
    }

    fn compress_ratio(&self, il: u32) -> u32 {
        self.ratio(il)
    }

    fn hash_routed(&self, il: u32) -> bool {
        il < self.n_hash_layers
    }

    fn dim(&self, d: Dim) -> Option<u64> {
        let u = |x: u32| x as u64;
        let v = match d {
            Embd => u(self.n_embd),
            Embd2 => 2 * u(self.n_embd),
            Vocab => self.n_vocab,
            FfExp => u(self.n_ff_exp),
            FfShexp => u(self.n_ff_exp) * u(self.n_expert_shared),
            Expert => u(self.n_expert),
            ExpertUsed => u(self.n_expert_used),
            One => 1,
            Three => 3,
            Heads => u(self.n_head),
            HeadK => u(self.head_dim),
            HeadK2 => 2 * u(self.head_dim),
            QProj => u(self.n_head) * u(self.head_dim),
            QLora => u(self.q_lora_rank),
            OGroupIn => u(self.n_head) * u(self.head_dim) / u(self.o_groups.max(1)),
            OLora => u(self.o_groups) * u(self.o_lora_rank),
            Hc => u(self.hc_mult),
            HcFlat => u(self.hc_mult) * u(self.n_embd),
            HcMix => u(2 + self.hc_mult) * u(self.hc_mult),
            CsaRatio => u(CSA_RATIO),
            HcaRatio => u(HCA_RATIO),
            IndexerHeads => u(self.indexer_n_head),
            IndexerDim => u(self.indexer_head_dim),
            IndexerDim2 => 2 * u(self.indexer_head_dim),
            IndexerQProj => u(self.indexer_n_head) * u(self.indexer_head_dim),
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
        let n_all = self.n_layer_all();
        let mut kv = vec![
            arch_kv(ARCH, "context_length", self.n_ctx_train),
            arch_kv(ARCH, "embedding_length", self.n_embd),
            arch_kv(ARCH, "embedding_length_out", self.hc_mult * self.n_embd),
            arch_kv(ARCH, "block_count", n_all),
            arch_kv(ARCH, "attention.head_count", self.n_head),
            arch_kv(ARCH, "attention.head_count_kv", 1u32),
            arch_kv(ARCH, "attention.key_length", self.head_dim),
            arch_kv(ARCH, "attention.value_length", self.head_dim),
            arch_kv(ARCH, "attention.layer_norm_rms_epsilon", self.rms_eps),
            arch_kv(ARCH, "rope.freq_base", self.rope_freq_base),
            arch_kv(ARCH, "rope.dimension_count", self.n_rot),
        ];
        if let Some(y) = self.yarn {
            kv.extend([
                arch_kv(ARCH, "rope.scaling.type", "yarn"),
                arch_kv(ARCH, "rope.scaling.factor", y.factor),
                arch_kv(ARCH, "rope.scaling.original_context_length", y.n_ctx_orig),
                arch_kv(ARCH, "rope.scaling.yarn_beta_fast", y.beta_fast),
                arch_kv(ARCH, "rope.scaling.yarn_beta_slow", y.beta_slow),
            ]);
        }
        if self.n_nextn > 0 {
            kv.push(arch_kv(ARCH, "nextn_predict_layers", self.n_nextn));
        }
        kv.extend([
            arch_kv(ARCH, "attention.q_lora_rank", self.q_lora_rank),
            arch_kv(ARCH, "attention.sliding_window", self.sliding_window),
            arch_kv(ARCH, "expert_count", self.n_expert),
            arch_kv(ARCH, "expert_used_count", self.n_expert_used),
            arch_kv(ARCH, "expert_feed_forward_length", self.n_ff_exp),
            arch_kv(ARCH, "expert_shared_count", self.n_expert_shared),
            arch_kv(ARCH, "expert_weights_scale", self.expert_weights_scale),
            arch_kv(ARCH, "expert_weights_norm", self.expert_weights_norm),
            arch_kv(ARCH, "expert_gating_func", GATING_SQRT_SOFTPLUS),
            arch_kv(
                ARCH,
                "swiglu_clamp_exp",
                Value::f32_array(self.swiglu_clamp_exp.iter().copied()),
            ),
            arch_kv(
                ARCH,
                "swiglu_clamp_shexp",
                Value::f32_array(self.swiglu_clamp_shexp.iter().copied()),
            ),
            arch_kv(ARCH, "attention.indexer.head_count", self.indexer_n_head),
            arch_kv(ARCH, "attention.indexer.key_length", self.indexer_head_dim),
            arch_kv(ARCH, "attention.indexer.top_k", self.indexer_top_k),
            arch_kv(ARCH, "attention.output_group_count", self.o_groups),
            arch_kv(ARCH, "attention.output_lora_rank", self.o_lora_rank),
            arch_kv(
                ARCH,
                "attention.compress_ratios",
                Value::u32_array(self.compress_ratios.iter().copied()),
            ),
            arch_kv(
                ARCH,
                "attention.compress_rope_freq_base",
                self.compress_rope_freq_base,
            ),
            arch_kv(ARCH, "hyper_connection.count", self.hc_mult),
            arch_kv(
                ARCH,
                "hyper_connection.sinkhorn_iterations",
                self.hc_sinkhorn_iters,
            ),
            arch_kv(ARCH, "hyper_connection.epsilon", self.hc_eps),
            arch_kv(ARCH, "hash_layer_count", self.n_hash_layers),
        ]);
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
            head_k: self.head_dim,
            head_v: self.head_dim,
            n_rot: self.n_rot,
            rms_eps: self.rms_eps,
            rope_freq_base: self.rope_freq_base,
        }
    }

    fn validate(&self) -> Result<(), ArchError> {
        self.common().validate(ARCH)?;
        let n_all = self.n_layer_all() as usize;
        check(
            ARCH,
            self.compress_ratios.len() == n_all,
            "compress_ratios is not given for every block",
        )?;
        check(
            ARCH,
            self.compress_ratios
                .iter()
                .all(|&r| r == 0 || r == CSA_RATIO || r == HCA_RATIO),
            "compression ratios must be 0, 4 or 128 (the only ones llama.cpp loads)",
        )?;
        check(
            ARCH,
            self.hc_mult == 4,
            "hyper_connection.count must be 4 (llama.cpp asserts it)",
        )?;
        check(
            ARCH,
            self.n_rot > 0 && self.n_rot <= self.head_dim && self.n_rot.is_multiple_of(2),
            "rope.dimension_count must be even, above 0 and at most key_length",
        )?;
        check(
            ARCH,
            self.o_groups > 0 && self.n_head.is_multiple_of(self.o_groups) && self.o_lora_rank > 0,
            "output_group_count must divide head_count and output_lora_rank be above 0",
        )?;
        check(
            ARCH,
            self.q_lora_rank > 0 && self.sliding_window > 0,
            "q_lora_rank and sliding_window must be above 0",
        )?;
        check(
            ARCH,
            self.indexer_n_head > 0
                && self.indexer_head_dim >= self.n_rot
                && self.indexer_top_k > 0,
            "the indexer needs heads, a key of at least rope.dimension_count values and top_k above 0",
        )?;
        check(
            ARCH,
            self.n_hash_layers <= self.n_layer,
            "hash_layer_count exceeds the trunk (llama.cpp's MTP block cannot be hash-routed)",
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
    use crate::arch::common::test_metadata::{metadata_of as md_of, set_key};
    use crate::arch::{resolve_tensors, ModelHparams};
    use crate::synth::shapes::find_shape;

    fn shape(name: &str) -> Deepseek4Hparams {
        let Some(ModelHparams::Deepseek4(h)) = find_shape(ARCH, name).map(|s| s.hparams) else {
            panic!("no {name} deepseek4 shape");
        };
        h
    }

    type MetadataPairs = Vec<(String, Value)>;

    fn set(kv: &mut MetadataPairs, suffix: &str, v: Value) {
        set_key(kv, ARCH, suffix, v);
    }

    #[test]
    fn metadata_round_trips() {
        for name in ["tiny", "deepseek-v4-flash"] {
            let h = shape(name);
            assert_eq!(
                Deepseek4Hparams::from_metadata(&md_of(&h, |_| {})),
                Ok(h.clone()),
                "{name}"
            );
        }
        // Without swiglu_clamp_shexp the shared experts take the experts' limits.
        let h = shape("tiny");
        let md = md_of(&h, |kv| {
            kv.retain(|(k, _)| k != "deepseek4.swiglu_clamp_shexp")
        });
        let d = Deepseek4Hparams::from_metadata(&md).unwrap();
        assert_eq!(d.swiglu_clamp_shexp, d.swiglu_clamp_exp);
    }

    #[test]
    fn the_table_gives_each_block_its_compressor_indexer_and_routing() {
        let h = shape("tiny");
        let t = resolve_tensors(&h).unwrap();
        let dims = |name: String| t.iter().find(|d| d.name == name).map(|d| d.dims.clone());
        let (hd, idx) = (h.head_dim as u64, h.indexer_head_dim as u64);
        // The tiny shape has every kind of block: window only, CSA and HCA; hash-routed and biased.
        for r in [0, CSA_RATIO, HCA_RATIO] {
            assert!(h.compress_ratios.contains(&r), "no block of ratio {r}");
        }
        assert!(h.n_hash_layers > 0 && h.n_hash_layers < h.n_layer);
        for il in 0..h.n_layer {
            let kv = dims(format!("blk.{il}.attn_compressor_kv.weight"));
            let ape = dims(format!("blk.{il}.attn_compressor_ape.weight"));
            let indexer = dims(format!("blk.{il}.indexer_compressor_ape.weight"));
            match h.ratio(il) {
                0 => assert!(kv.is_none() && ape.is_none() && indexer.is_none()),
                CSA_RATIO => {
                    assert_eq!(kv, Some(vec![h.n_embd as u64, 2 * hd]));
                    assert_eq!(ape, Some(vec![2 * hd, 4]));
                    assert_eq!(indexer, Some(vec![2 * idx, 4]));
                }
                _ => {
                    assert_eq!(kv, Some(vec![h.n_embd as u64, hd]));
                    assert_eq!(ape, Some(vec![hd, 128]));
                    assert!(indexer.is_none());
                }
            }
            let hashed = il < h.n_hash_layers;
            assert_eq!(
                dims(format!("blk.{il}.ffn_gate_tid2eid.weight")),
                hashed.then(|| vec![h.n_expert_used as u64, h.n_vocab])
            );
            assert_eq!(
                dims(format!("blk.{il}.exp_probs_b.bias")).is_some(),
                !hashed
            );
            assert_eq!(
                dims(format!("blk.{il}.attn_output_a.weight")),
                Some(vec![
                    (h.n_head * h.head_dim / h.o_groups) as u64,
                    (h.o_groups * h.o_lora_rank) as u64
                ])
            );
        }
        assert_eq!(
            dims("output_hc_fn.weight".into()),
            Some(vec![4 * h.n_embd as u64, 4])
        );
        let tid = t.iter().find(|d| d.role == Role::FfnGateTid2eid).unwrap();
        assert_eq!(tid.class, TensorClass::Index);
    }

    #[test]
    fn refuses_what_llama_cpp_refuses_with_the_reason() {
        let h = shape("tiny");
        let err = |edit: &dyn Fn(&mut MetadataPairs)| {
            Deepseek4Hparams::from_metadata(&md_of(&h, edit))
                .unwrap_err()
                .0
        };
        assert!(err(&|kv| set(kv, "expert_gating_func", Value::U32(2))).contains("sqrt-softplus"));
        assert!(err(&|kv| set(kv, "hyper_connection.count", Value::U32(2))).contains("must be 4"));
        let mut ratios = h.compress_ratios.clone();
        ratios[0] = 8;
        assert!(err(&|kv| set(
            kv,
            "attention.compress_ratios",
            Value::u32_array(ratios.iter().copied())
        ))
        .contains("0, 4 or 128"));
        assert!(
            err(&|kv| set(kv, "attention.compress_ratios", Value::u32_array([0u32])))
                .contains("shorter")
        );
        assert!(err(&|kv| set(kv, "attention.head_count_kv", Value::U32(2))).contains("must be 1"));
        assert!(
            err(&|kv| set(kv, "rope.scaling.type", Value::String("linear".into())))
                .contains("not supported")
        );
    }
}
