//! Gemma 4 (`gemma4`: Gemma-4-26B-A4B; the dense 31B reads the same way).
//!
//! Embeddings scaled by `sqrt(n_embd)`. Every block: grouped-query attention with per-head RMS-normed Q
//! and K (weights) and V (no weight), NeoX RoPE, no score scaling (`f_attention_scale` 1: the norms carry
//! it), its output RMS-normed before the residual add. Sliding-window blocks (the file's per-block
//! `attention.sliding_window_pattern`) and global blocks differ in head size (`key_length_swa` /
//! `key_length`), KV heads (`attention.head_count_kv` per block), RoPE base (`rope.freq_base_swa` /
//! `rope.freq_base`) and rotated dimensions; global blocks turn only part of each head through
//! `rope_freqs.weight` (factors of 1e30 stop the rest: "proportional" RoPE), and may have no V projection,
//! the keys' projection then serving as values (before the K norm).
//!
//! The feed-forward part of a MoE block has two branches on the attention block's output: a dense GELU
//! MLP (`ffn_norm`, then `post_ffw_norm_1`) and routed experts (`pre_ffw_norm_2`, then `post_ffw_norm_2`),
//! added, then `post_ffw_norm` and the residual add. The router reads its own input: the RMS-normed block
//! input scaled by `1/sqrt(n_embd)` and `ffn_gate_inp.scale`; softmax over all experts, top-k, weights
//! renormalized; GELU experts whose gate and up projections are one tensor (`ffn_gate_up_exps`), each
//! expert's output times its `ffn_down_exps.scale`. A block without a router has only the MLP. The block's
//! output is multiplied by `layer_output_scale` when the file has it. Output tied to the embedding unless
//! `output.weight` exists; final logits soft-capped (30 unless the file says otherwise).
//!
//! Follows llama.cpp's `src/models/gemma4.cpp` (hyperparameters, tensors, graph); [`Gemma4Graph`] is the
//! forward pass. What llama.cpp accepts and this file does not compute is refused with the reason: the
//! per-layer embeddings of Gemma 4 E2B/E4B (`embedding_length_per_layer_input` above 0), blocks that
//! reuse earlier blocks' KV caches (`attention.shared_kv_layers`), a fused `attn_qkv` (the file fails to
//! bind: no `attn_q`), separate `ffn_gate_exps`/`ffn_up_exps` (llama.cpp's converter writes Gemma 4's
//! experts fused), sliding-window blocks without a V projection (HF's Gemma 4 drops V on global blocks
//! only), non-linear RoPE scaling.

use super::common::{rope_freq_scale, soft_cap, CommonHparams, ExpertHparams};
use super::graph::{Forward, ModelInfo, StateSpec, TensorMap};
use super::{
    arch_kv, check, def, opt, ArchError, ArchHparams, Dim, LayerKind, LayerSel, Role, TensorClass,
    TensorDef,
};
use crate::compute::{Attention, Compute, FusedMoe, Gating, Rope, RopeKind, Unary, WeightId};
use crate::gguf::{GgufFile, Metadata, Value};

/// `general.architecture`.
pub const ARCH: &str = "gemma4";

/// The embedding widths of Gemma 4 E2B and E4B, whose pictures mtmd reads causally.
const E_MODEL_WIDTHS: [u32; 2] = [1536, 2560];

/// llama.cpp's default RoPE base of sliding-window blocks.
pub const DEFAULT_ROPE_FREQ_BASE_SWA: f32 = 10000.0;

/// llama.cpp's `f_final_logit_softcapping` when the file does not set it.
pub const DEFAULT_FINAL_LOGIT_SOFTCAPPING: f32 = 30.0;

/// The RoPE frequency factor that stops a pair from turning (Gemma 4's converter writes it for the
/// unrotated part of global heads).
pub const UNROTATED_FACTOR: f32 = 1e30;

/// Hyperparameters of a `gemma4` model.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma4Hparams {
    /// Vocabulary size (length of `tokenizer.ggml.tokens`).
    pub n_vocab: u64,
    /// `context_length`.
    pub n_ctx_train: u32,
    /// `embedding_length`.
    pub n_embd: u32,
    /// `block_count`.
    pub n_layer: u32,
    /// `feed_forward_length`: the dense MLP's width (one value for every block).
    pub n_ff: u32,
    /// `attention.head_count`.
    pub n_head: u32,
    /// `attention.head_count_kv` of the sliding-window blocks.
    pub n_head_kv_swa: u32,
    /// `attention.head_count_kv` of the global blocks.
    pub n_head_kv: u32,
    /// `attention.key_length` (= `value_length`): the global blocks' head size.
    pub head_dim: u32,
    /// `attention.key_length_swa` (= `value_length_swa`): the sliding-window blocks' head size.
    pub head_dim_swa: u32,
    /// `rope.dimension_count`: the global blocks' rotated dimensions (the whole head; `rope_freqs`
    /// stops part of it).
    pub n_rot: u32,
    /// `rope.dimension_count_swa`, default `n_rot`.
    pub n_rot_swa: u32,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// `rope.freq_base` (global blocks).
    pub rope_freq_base: f32,
    /// `rope.freq_base_swa` (sliding-window blocks).
    pub rope_freq_base_swa: f32,
    /// `attention.sliding_window`.
    pub sliding_window: u32,
    /// `attention.sliding_window_pattern`: which blocks slide.
    pub swa_layers: Vec<bool>,
    /// `expert_count`; 0 for a dense model.
    pub n_expert: u32,
    /// `expert_used_count` (0 for a dense model).
    pub n_expert_used: u32,
    /// `expert_feed_forward_length` (0 for a dense model).
    pub n_ff_exp: u32,
    /// `final_logit_softcapping` ([`DEFAULT_FINAL_LOGIT_SOFTCAPPING`] when absent; `None` when 0).
    pub final_logit_softcapping: Option<f32>,
}

use Dim::*;
use TensorClass as C;

const ALL: Option<LayerSel> = Some(LayerSel::All);
const SWA: Option<LayerSel> = Some(LayerSel::SlidingAttention);
const FULL: Option<LayerSel> = Some(LayerSel::FullAttention);
const MOE: Option<LayerSel> = Some(LayerSel::MoeFfn);

/// The tensors of a `gemma4` file (llama.cpp's `llama_model_gemma4::load_arch_tensors`), in the order
/// llama.cpp creates them within a block. Sliding-window and global blocks have rows of their own where
/// their shapes differ.
pub const TENSORS: &[TensorDef] = &[
    // Absent: the output is the token embedding (TENSOR_DUPLICATED), as converted files have it.
    opt(def(Role::Output, None, &[Embd, Vocab], C::Output)), // [n_embd, n_vocab]
    def(Role::TokenEmbd, None, &[Embd, Vocab], C::Embedding), // [n_embd, n_vocab]
    def(Role::OutputNorm, None, &[Embd], C::Norm),           // [n_embd]
    // The global blocks' RoPE factors (1, or 1e30 for the pairs that do not turn); llama.cpp requires it
    // when there is a global block (checked by the graph).
    opt(def(Role::RopeFreqs, None, &[RopeHalf], C::Norm)), // [n_rot / 2], F32
    def(Role::AttnNorm, ALL, &[Embd], C::Norm),            // [n_embd]
    def(Role::AttnQ, SWA, &[Embd, QProjSwa], C::Attention), // [n_embd, n_head · head_swa]
    def(Role::AttnQ, FULL, &[Embd, QProj], C::Attention),  // [n_embd, n_head · head]
    def(Role::AttnK, SWA, &[Embd, KProjSwa], C::Attention), // [n_embd, n_head_kv_swa · head_swa]
    def(Role::AttnK, FULL, &[Embd, KProj], C::Attention),  // [n_embd, n_head_kv · head]
    def(Role::AttnV, SWA, &[Embd, KProjSwa], C::Attention), // [n_embd, n_head_kv_swa · head_swa]
    // Absent in the 26B's global blocks: V is the K projection.
    opt(def(Role::AttnV, FULL, &[Embd, VProj], C::Attention)), // [n_embd, n_head_kv · head]
    def(Role::AttnOut, SWA, &[QProjSwa, Embd], C::Attention),  // [n_head · head_swa, n_embd]
    def(Role::AttnOut, FULL, &[QProj, Embd], C::Attention),    // [n_head · head, n_embd]
    def(Role::AttnQNorm, SWA, &[HeadKSwa], C::Norm),           // [head_swa]
    def(Role::AttnQNorm, FULL, &[HeadK], C::Norm),             // [head]
    def(Role::AttnKNorm, SWA, &[HeadKSwa], C::Norm),           // [head_swa]
    def(Role::AttnKNorm, FULL, &[HeadK], C::Norm),             // [head]
    def(Role::AttnPostNorm, ALL, &[Embd], C::Norm),            // [n_embd]
    opt(def(Role::LayerOutScale, ALL, &[One], C::Norm)),       // [1], F32
    // The dense GELU MLP (the "shared expert" of a MoE block).
    def(Role::FfnNorm, ALL, &[Embd], C::Norm), // [n_embd]
    def(Role::FfnGate, ALL, &[Embd, Ff], C::Ffn), // [n_embd, n_ff]
    def(Role::FfnUp, ALL, &[Embd, Ff], C::Ffn), // [n_embd, n_ff]
    def(Role::FfnDown, ALL, &[Ff, Embd], C::Ffn), // [n_ff, n_embd]
    def(Role::FfnPostNorm, ALL, &[Embd], C::Norm), // [n_embd]
    // Routed experts.
    def(Role::FfnGateInp, MOE, &[Embd, Expert], C::Router), // [n_embd, n_expert]
    def(Role::FfnGateInpScale, MOE, &[Embd], C::Router),    // [n_embd], F32
    def(Role::FfnPreNorm2, MOE, &[Embd], C::Norm),          // [n_embd]
    def(Role::FfnPostNorm1, MOE, &[Embd], C::Norm),         // [n_embd]
    def(Role::FfnPostNorm2, MOE, &[Embd], C::Norm),         // [n_embd]
    def(
        Role::FfnGateUpExps,
        MOE,
        &[Embd, FfExpGateUp, Expert],
        C::Expert,
    ), // [n_embd, 2 · n_ff_exp, n_expert]
    def(Role::FfnDownExps, MOE, &[FfExp, Embd, Expert], C::Expert), // [n_ff_exp, n_embd, n_expert]
    opt(def(Role::FfnDownExpsScale, MOE, &[Expert], C::Router)), // [n_expert], F32
];

impl Gemma4Hparams {
    /// Reads the hyperparameters from a file's metadata (the keys llama.cpp's loader reads).
    pub fn from_metadata(md: &Metadata) -> Result<Self, ArchError> {
        let c = CommonHparams::read_varying_kv(md, ARCH)?;
        let n = c.n_layer_all;
        let swa_layers = md
            .arch_bool_array_opt("attention.sliding_window_pattern")?
            .ok_or_else(|| {
                ArchError(format!(
                    "{ARCH}: attention.sliding_window_pattern (one flag per block) is missing"
                ))
            })?;
        check(
            ARCH,
            swa_layers.len() == n as usize,
            "attention.sliding_window_pattern does not give every block",
        )?;
        let kv = md
            .arch_u32_per_layer_opt("attention.head_count_kv", n as usize)?
            .unwrap_or_else(|| vec![c.n_head; n as usize]);
        let kv_of = |swa: bool| -> Result<u32, ArchError> {
            let mut it = kv
                .iter()
                .zip(&swa_layers)
                .filter(|(_, &s)| s == swa)
                .map(|(&v, _)| v);
            let first = it.next().unwrap_or(c.n_head_kv);
            check(
                ARCH,
                it.all(|v| v == first),
                "attention.head_count_kv differs between blocks of one kind",
            )?;
            Ok(first)
        };
        let per_layer = md
            .arch_u32("embedding_length_per_layer_input")
            .map_err(|e| ArchError(format!("{ARCH}: {e}")))?;
        check(
            ARCH,
            per_layer == 0,
            "per-layer embeddings (embedding_length_per_layer_input above 0: Gemma 4 E2B/E4B) are \
             not supported yet",
        )?;
        check(
            ARCH,
            md.arch_u32_opt("attention.shared_kv_layers")?.unwrap_or(0) == 0,
            "blocks that reuse earlier blocks' KV caches (attention.shared_kv_layers) are not \
             supported yet",
        )?;
        let head_dim_swa = md.arch_u32("attention.key_length_swa")?;
        check(
            ARCH,
            md.arch_u32("attention.value_length_swa")? == head_dim_swa,
            "attention.value_length_swa differs from key_length_swa",
        )?;
        let n_ff = c.n_ff(md)?;
        let n_expert = md.arch_u32_opt("expert_count")?.unwrap_or(0);
        let (n_expert_used, n_ff_exp) = if n_expert > 0 {
            let e = ExpertHparams::read(md, ARCH, &c, n_ff)?;
            (e.n_expert_used, e.n_ff_exp)
        } else {
            (0, 0)
        };
        let hp = Gemma4Hparams {
            n_vocab: c.n_vocab,
            n_ctx_train: c.n_ctx_train,
            n_embd: c.n_embd,
            n_layer: n,
            n_ff,
            n_head: c.n_head,
            n_head_kv_swa: kv_of(true)?,
            n_head_kv: kv_of(false)?,
            head_dim: c.head_dim(ARCH)?,
            head_dim_swa,
            n_rot: c.n_rot,
            n_rot_swa: md
                .arch_u32_opt("rope.dimension_count_swa")?
                .unwrap_or(c.n_rot),
            rms_eps: c.rms_eps,
            rope_freq_base: c.rope_freq_base,
            rope_freq_base_swa: md
                .arch_f32_opt("rope.freq_base_swa")?
                .unwrap_or(DEFAULT_ROPE_FREQ_BASE_SWA),
            sliding_window: md.arch_u32("attention.sliding_window")?,
            swa_layers,
            n_expert,
            n_expert_used,
            n_ff_exp,
            final_logit_softcapping: Some(
                md.arch_f32_opt("final_logit_softcapping")?
                    .unwrap_or(DEFAULT_FINAL_LOGIT_SOFTCAPPING),
            )
            .filter(|&c| c != 0.0),
        };
        hp.validate()?;
        Ok(hp)
    }

    /// Whether block `il` uses sliding-window attention.
    pub fn is_swa(&self, il: u32) -> bool {
        self.swa_layers.get(il as usize).copied().unwrap_or(false)
    }

    /// Block `il`'s (head size, KV heads).
    pub fn head(&self, il: u32) -> (u32, u32) {
        if self.is_swa(il) {
            (self.head_dim_swa, self.n_head_kv_swa)
        } else {
            (self.head_dim, self.n_head_kv)
        }
    }

    /// The KV heads of every block, as `attention.head_count_kv` lists them.
    fn kv_heads(&self) -> Vec<u32> {
        (0..self.n_layer).map(|il| self.head(il).1).collect()
    }
}

impl ArchHparams for Gemma4Hparams {
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
        if self.is_swa(il) {
            LayerKind::SlidingAttention
        } else {
            LayerKind::Attention
        }
    }

    fn dense_ffn(&self, _il: u32) -> bool {
        self.n_expert == 0
    }

    fn dim(&self, d: Dim) -> Option<u64> {
        let v = match d {
            Embd => self.n_embd as u64,
            Vocab => self.n_vocab,
            Ff => self.n_ff as u64,
            FfExp => self.n_ff_exp as u64,
            FfExpGateUp => 2 * self.n_ff_exp as u64,
            Expert => self.n_expert as u64,
            HeadK => self.head_dim as u64,
            HeadKSwa => self.head_dim_swa as u64,
            RopeHalf => (self.n_rot / 2) as u64,
            QProj => (self.n_head * self.head_dim) as u64,
            QProjSwa => (self.n_head * self.head_dim_swa) as u64,
            KProj | VProj => (self.n_head_kv * self.head_dim) as u64,
            KProjSwa => (self.n_head_kv_swa * self.head_dim_swa) as u64,
            One => 1,
            _ => return None,
        };
        Some(v)
    }

    fn n_expert_used(&self) -> u32 {
        self.n_expert_used
    }

    fn synth_writes(&self, role: Role) -> bool {
        // As converted Gemma 4 26B-A4B files: tied output and no V in the global blocks; the RoPE
        // factors, block scales and per-expert scales present.
        matches!(
            role,
            Role::RopeFreqs | Role::LayerOutScale | Role::FfnDownExpsScale
        )
    }

    fn to_metadata(&self) -> Vec<(String, Value)> {
        let mut kv = vec![
            arch_kv(ARCH, "context_length", self.n_ctx_train),
            arch_kv(ARCH, "embedding_length", self.n_embd),
            arch_kv(ARCH, "block_count", self.n_layer),
            arch_kv(ARCH, "feed_forward_length", self.n_ff),
            arch_kv(ARCH, "attention.head_count", self.n_head),
            arch_kv(ARCH, "attention.layer_norm_rms_epsilon", self.rms_eps),
            arch_kv(ARCH, "attention.key_length", self.head_dim),
            arch_kv(ARCH, "attention.value_length", self.head_dim),
            arch_kv(ARCH, "rope.freq_base", self.rope_freq_base),
            arch_kv(ARCH, "attention.sliding_window", self.sliding_window),
            arch_kv(
                ARCH,
                "attention.head_count_kv",
                Value::u32_array(self.kv_heads()),
            ),
        ];
        if let Some(c) = self.final_logit_softcapping {
            kv.push(arch_kv(ARCH, "final_logit_softcapping", c));
        }
        kv.extend([
            arch_kv(ARCH, "attention.shared_kv_layers", 0u32),
            arch_kv(ARCH, "embedding_length_per_layer_input", 0u32),
            arch_kv(
                ARCH,
                "attention.sliding_window_pattern",
                Value::bool_array(self.swa_layers.iter().copied()),
            ),
            arch_kv(ARCH, "attention.key_length_swa", self.head_dim_swa),
            arch_kv(ARCH, "attention.value_length_swa", self.head_dim_swa),
            arch_kv(ARCH, "rope.dimension_count", self.n_rot),
            arch_kv(ARCH, "rope.dimension_count_swa", self.n_rot_swa),
            arch_kv(ARCH, "rope.freq_base_swa", self.rope_freq_base_swa),
        ]);
        if self.n_expert > 0 {
            kv.extend([
                arch_kv(ARCH, "expert_count", self.n_expert),
                arch_kv(ARCH, "expert_used_count", self.n_expert_used),
                arch_kv(ARCH, "expert_feed_forward_length", self.n_ff_exp),
            ]);
        }
        kv
    }

    fn common(&self) -> CommonHparams {
        CommonHparams {
            n_vocab: self.n_vocab,
            n_ctx_train: self.n_ctx_train,
            n_embd: self.n_embd,
            n_layer_all: self.n_layer,
            n_head: self.n_head,
            n_head_kv: self.head(0).1,
            head_k: self.head_dim,
            head_v: self.head_dim,
            n_rot: self.n_rot,
            rms_eps: self.rms_eps,
            rope_freq_base: self.rope_freq_base,
        }
    }

    fn validate(&self) -> Result<(), ArchError> {
        self.common().validate(ARCH)?;
        check(
            ARCH,
            self.swa_layers.len() == self.n_layer as usize,
            "the sliding-window blocks are not given for every block",
        )?;
        for kv in [self.n_head_kv, self.n_head_kv_swa] {
            check(
                ARCH,
                kv > 0 && self.n_head.is_multiple_of(kv),
                "head_count is not a multiple of a block kind's head_count_kv",
            )?;
        }
        check(
            ARCH,
            self.n_rot.is_multiple_of(2)
                && self.n_rot > 0
                && self.n_rot <= self.head_dim
                && self.n_rot_swa.is_multiple_of(2)
                && self.n_rot_swa > 0
                && self.n_rot_swa <= self.head_dim_swa,
            "rope.dimension_count(_swa) must be even, above 0 and at most the head size",
        )?;
        check(ARCH, self.n_ff > 0, "feed_forward_length is 0")?;
        check(
            ARCH,
            self.sliding_window > 0 || self.swa_layers.iter().all(|&s| !s),
            "attention.sliding_window is 0 but some blocks slide",
        )?;
        if self.n_expert > 0 {
            check(
                ARCH,
                self.n_expert_used > 0 && self.n_expert_used <= self.n_expert,
                "expert_used_count must be between 1 and expert_count",
            )?;
            check(ARCH, self.n_ff_exp > 0, "expert_feed_forward_length is 0")?;
        }
        check(
            ARCH,
            self.rms_eps > 0.0,
            "layer_norm_rms_epsilon must be positive",
        )?;
        Ok(())
    }
}

/// The routed experts of one `gemma4` block.
#[derive(Clone, Debug)]
struct Experts {
    pre_norm: WeightId,
    post_norm_mlp: WeightId,
    post_norm: WeightId,
    router_scale: WeightId,
    moe: FusedMoe,
}

/// The weights of one `gemma4` block.
#[derive(Clone, Debug)]
struct Block {
    attn_norm: WeightId,
    wq: WeightId,
    wk: WeightId,
    /// `None`: the K projection serves as V.
    wv: Option<WeightId>,
    wo: WeightId,
    q_norm: WeightId,
    k_norm: WeightId,
    attn_post_norm: WeightId,
    ffn_norm: WeightId,
    ffn_gate: WeightId,
    ffn_up: WeightId,
    ffn_down: WeightId,
    ffn_post_norm: WeightId,
    experts: Option<Experts>,
    /// `layer_output_scale`'s value.
    out_scale: Option<f32>,
}

/// The forward pass of a `gemma4` model (llama.cpp's `llama_model_gemma4::graph`).
#[derive(Clone, Debug)]
pub struct Gemma4Graph {
    hp: Gemma4Hparams,
    info: ModelInfo,
    tok_embd: WeightId,
    output_norm: WeightId,
    /// `output.weight`, or the token embedding when the file ties them.
    output: WeightId,
    blocks: Vec<Block>,
    /// RoPE of global blocks: `rope.freq_base`, linear scaling from `rope.scaling.factor`, the factors of
    /// `rope_freqs.weight`.
    rope_global: Rope,
    /// RoPE of sliding-window blocks: `rope.freq_base_swa`, never scaled (llama.cpp's
    /// `rope_freq_scale_train_swa` stays 1), no factors.
    rope_swa: Rope,
}

/// The value of a one-element F32 tensor of `file` (`layer_output_scale`).
fn scalar(file: &GgufFile, id: WeightId) -> Result<f32, ArchError> {
    let info = &file.tensor_infos()[id.0 as usize];
    let bytes = file
        .part_bytes(info.part)
        .and_then(|p| p.get(info.offset as usize..(info.offset + info.n_bytes) as usize))
        .ok_or_else(|| ArchError(format!("{ARCH}: tensor {} is not in its file", info.name)))?;
    match (info.ty, bytes) {
        (poly_kernels::GgmlType::F32, [a, b, c, d]) => Ok(f32::from_le_bytes([*a, *b, *c, *d])),
        _ => Err(ArchError(format!(
            "{ARCH}: tensor {} must be one F32 value (it is {} of {} bytes)",
            info.name,
            info.ty,
            bytes.len()
        ))),
    }
}

impl Gemma4Graph {
    /// Builds the forward pass from bound tensors (`file` gives the block scales' values).
    pub fn new(
        hp: Gemma4Hparams,
        t: &TensorMap,
        md: &Metadata,
        file: &GgufFile,
    ) -> Result<Gemma4Graph, ArchError> {
        let tok_embd = t.global_req(Role::TokenEmbd)?;
        let blocks = (0..hp.n_layer)
            .map(|il| {
                let experts = match t.layer_opt(Role::FfnGateInp, il) {
                    None => None,
                    Some(router) => Some(Experts {
                        pre_norm: t.layer(Role::FfnPreNorm2, il)?,
                        post_norm_mlp: t.layer(Role::FfnPostNorm1, il)?,
                        post_norm: t.layer(Role::FfnPostNorm2, il)?,
                        router_scale: t.layer(Role::FfnGateInpScale, il)?,
                        moe: FusedMoe {
                            router,
                            gate_up_exps: t.layer(Role::FfnGateUpExps, il)?,
                            down_exps: t.layer(Role::FfnDownExps, il)?,
                            down_scale: t.layer_opt(Role::FfnDownExpsScale, il),
                            n_expert: hp.n_expert as usize,
                            n_expert_used: hp.n_expert_used as usize,
                            gating: Gating::Softmax,
                            norm_weights: true,
                            weights_scale: 1.0,
                            act: Unary::Gelu,
                        },
                    }),
                };
                Ok(Block {
                    attn_norm: t.layer(Role::AttnNorm, il)?,
                    wq: t.layer(Role::AttnQ, il)?,
                    wk: t.layer(Role::AttnK, il)?,
                    wv: t.layer_opt(Role::AttnV, il),
                    wo: t.layer(Role::AttnOut, il)?,
                    q_norm: t.layer(Role::AttnQNorm, il)?,
                    k_norm: t.layer(Role::AttnKNorm, il)?,
                    attn_post_norm: t.layer(Role::AttnPostNorm, il)?,
                    ffn_norm: t.layer(Role::FfnNorm, il)?,
                    ffn_gate: t.layer(Role::FfnGate, il)?,
                    ffn_up: t.layer(Role::FfnUp, il)?,
                    ffn_down: t.layer(Role::FfnDown, il)?,
                    ffn_post_norm: t.layer(Role::FfnPostNorm, il)?,
                    experts,
                    out_scale: t
                        .layer_opt(Role::LayerOutScale, il)
                        .map(|id| scalar(file, id))
                        .transpose()?,
                })
            })
            .collect::<Result<Vec<_>, ArchError>>()?;
        check(
            ARCH,
            hp.n_expert == 0 || blocks.iter().all(|b| b.experts.is_some()),
            "a block of an MoE model has no router (ffn_gate_inp)",
        )?;
        let freq_factors = t.global(Role::RopeFreqs);
        check(
            ARCH,
            freq_factors.is_some() || (0..hp.n_layer).all(|il| hp.is_swa(il)),
            "rope_freqs.weight is missing (llama.cpp requires it for the global blocks)",
        )?;
        let rope_global = Rope {
            kind: RopeKind::Neox,
            head_dim: hp.head_dim as usize,
            n_rot: hp.n_rot as usize,
            freq_base: hp.rope_freq_base,
            freq_scale: rope_freq_scale(md, ARCH)?,
            freq_factors,
            sections: None,
        };
        let rope_swa = Rope {
            kind: RopeKind::Neox,
            head_dim: hp.head_dim_swa as usize,
            n_rot: hp.n_rot_swa as usize,
            freq_base: hp.rope_freq_base_swa,
            freq_scale: 1.0,
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
        Ok(Gemma4Graph {
            tok_embd,
            output_norm: t.global_req(Role::OutputNorm)?,
            output: t.global(Role::Output).unwrap_or(tok_embd),
            blocks,
            rope_global,
            rope_swa,
            info,
            hp,
        })
    }

    /// The hyperparameters.
    pub fn hparams(&self) -> &Gemma4Hparams {
        &self.hp
    }

    /// The RoPE block `il` uses.
    pub fn rope(&self, il: u32) -> &Rope {
        if self.hp.is_swa(il) {
            &self.rope_swa
        } else {
            &self.rope_global
        }
    }

    /// The sliding window block `il` attends over (`None` for a global block).
    pub fn window(&self, il: u32) -> Option<u32> {
        self.hp.is_swa(il).then_some(self.hp.sliding_window)
    }

    /// Whether a picture's rows see each other in block `il`: llama.cpp's mtmd reads a Gemma 4 picture
    /// with causal attention off (`mtmd_decode_use_non_causal`), which makes only the sliding-window
    /// blocks bidirectional (`LLAMA_NON_CAUSAL_TYPE_SWA_ONLY`), except for E2B and E4B (embeddings 1536
    /// and 2560 wide), which mtmd keeps causal.
    pub fn picture_rows_see_each_other(&self, il: u32) -> bool {
        self.hp.is_swa(il) && !E_MODEL_WIDTHS.contains(&self.hp.n_embd)
    }
}

impl Forward for Gemma4Graph {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn reads_pictures_in_line(&self) -> bool {
        true
    }

    fn layer_states(&self) -> Vec<StateSpec> {
        (0..self.hp.n_layer)
            .map(|il| {
                let (head_dim, n_head_kv) = self.hp.head(il);
                StateSpec::Kv {
                    n_head_kv: n_head_kv as usize,
                    head_dim_k: head_dim as usize,
                    head_dim_v: head_dim as usize,
                    window: self.window(il),
                }
            })
            .collect()
    }

    fn forward<C: Compute>(&self, c: &mut C) -> C::Act {
        let hp = &self.hp;
        let n_embd = hp.n_embd as usize;
        let eps = hp.rms_eps;
        let (tokens, out_rows) = {
            let b = c.batch();
            (b.tokens.to_vec(), b.output_rows())
        };

        let inp = c.embed(self.tok_embd, &tokens);
        let mut inp = c.scale_token_rows(&inp, (n_embd as f32).sqrt());
        for (il, b) in self.blocks.iter().enumerate() {
            let rope = self.rope(il as u32);
            let (head_dim, n_head_kv) = hp.head(il as u32);
            let head_dim = head_dim as usize;
            let attn = Attention {
                n_head: hp.n_head as usize,
                n_head_kv: n_head_kv as usize,
                head_dim_k: head_dim,
                head_dim_v: head_dim,
                // The Q and K norms carry the scale (llama.cpp's f_attention_scale is 1 for Gemma 4).
                scale: 1.0,
                window: self.window(il as u32),
                softcap: None,
                picture_rows_see_each_other: self.picture_rows_see_each_other(il as u32),
            };

            // Self-attention: per-head RMS-normed Q and K with RoPE, per-head RMS-normed V (no weight);
            // without a V projection V is the K projection, before the K norm.
            let cur = c.rms_norm(&inp, Some(b.attn_norm), eps, n_embd);
            let [q, k] = c.matmul_many([b.wq, b.wk], &cur);
            let v = match b.wv {
                Some(wv) => {
                    let v = c.matmul(wv, &cur);
                    c.rms_norm(&v, None, eps, head_dim)
                }
                None => c.rms_norm(&k, None, eps, head_dim),
            };
            let norms = [Some(b.q_norm), Some(b.k_norm)];
            let [q, k] = c.rms_norm_rope_pair([&q, &k], norms, eps, rope);
            let att = c.attention(il, &q, &k, &v, &attn);
            let att_out = c.matmul(b.wo, &att);
            // llama.cpp keeps every row through the last block (embeddings_nextn_masked is off) and
            // drops the others after the output norm; so does this graph, so the last block's products
            // take the orders of the whole batch, as llama.cpp's.
            let att_out = c.rms_norm(&att_out, Some(b.attn_post_norm), eps, n_embd);
            let (attn_res, mlp_in) = c.add_rms_norm(&att_out, &inp, Some(b.ffn_norm), eps, n_embd);

            // The dense GELU MLP.
            let [gate, up] = c.matmul_many([b.ffn_gate, b.ffn_up], &mlp_in);
            let mlp = c.glu(&gate, &up, Unary::Gelu);
            let mlp = c.matmul(b.ffn_down, &mlp);
            let ffn_out = match &b.experts {
                None => mlp,
                Some(e) => {
                    let mlp = c.rms_norm(&mlp, Some(e.post_norm_mlp), eps, n_embd);
                    // The experts on their own norm of the block's input; the router on the plain
                    // norm scaled by 1/sqrt(n_embd) and its own scale.
                    let moe_in = c.rms_norm(&attn_res, Some(e.pre_norm), eps, n_embd);
                    let router_in = c.rms_norm(&attn_res, None, eps, n_embd);
                    let router_in = c.scale(&router_in, 1.0 / (n_embd as f32).sqrt());
                    let router_in = c.mul_weight(&router_in, e.router_scale);
                    let moe = c.fused_moe(il, &moe_in, &router_in, &e.moe);
                    let moe = c.rms_norm(&moe, Some(e.post_norm), eps, n_embd);
                    c.add(&mlp, &moe)
                }
            };
            let ffn_out = c.rms_norm(&ffn_out, Some(b.ffn_post_norm), eps, n_embd);
            let out = c.add(&ffn_out, &attn_res);
            inp = match b.out_scale {
                Some(s) => c.scale(&out, s),
                None => out,
            };
        }
        let cur = c.rms_norm(&inp, Some(self.output_norm), eps, n_embd);
        let cur = if out_rows.len() < tokens.len() {
            c.rows(&cur, &out_rows)
        } else {
            cur
        };
        let logits = c.matmul(self.output, &cur);
        soft_cap(c, logits, hp.final_logit_softcapping)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{resolve_tensors, ModelHparams};
    use crate::synth::plan::{param_counts, plan, TypeChoice};
    use crate::synth::shapes::find_shape;
    use poly_kernels::GgmlType;

    fn hparams(shape: &str) -> Gemma4Hparams {
        match find_shape(ARCH, shape).expect("shape").hparams {
            ModelHparams::Gemma4(h) => h,
            _ => unreachable!("a gemma4 shape"),
        }
    }

    /// The metadata `hp` writes, with a vocabulary size, as a file's.
    fn metadata(hp: &Gemma4Hparams) -> Metadata {
        crate::arch::common::test_metadata::metadata_of(hp, |_| {})
    }

    /// `hp`'s metadata with `key` (under `gemma4.`) set to `v`, or removed when `None`.
    fn with(hp: &Gemma4Hparams, key: &str, v: Option<Value>) -> Result<Gemma4Hparams, ArchError> {
        let mut md = Metadata::new("test");
        let src = metadata(hp);
        let full = format!("{ARCH}.{key}");
        for (k, val) in src.entries() {
            if *k != full {
                assert!(md.insert_new(k.clone(), val.clone()));
            }
        }
        if let Some(v) = v {
            assert!(md.insert_new(full, v));
        }
        Gemma4Hparams::from_metadata(&md)
    }

    #[test]
    fn every_shape_reads_back_as_written() {
        for shape in ["tiny", "gemma-4-26b-a4b"] {
            let h = hparams(shape);
            assert_eq!(
                Gemma4Hparams::from_metadata(&metadata(&h)),
                Ok(h),
                "{shape}"
            );
        }
    }

    #[test]
    fn the_26b_shape_has_the_real_models_blocks_and_parameters() {
        let h = hparams("26b-a4b");
        let global: Vec<u32> = (0..h.n_layer).filter(|&il| !h.is_swa(il)).collect();
        assert_eq!(global, [5, 11, 17, 23, 29]);
        let descs = resolve_tensors(&h).expect("resolves");
        // No V projection in the global blocks; one in every sliding block.
        let v: Vec<u32> = descs
            .iter()
            .filter(|d| d.role == Role::AttnV)
            .filter_map(|d| d.layer)
            .collect();
        assert_eq!(v.len(), 25);
        assert!(global.iter().all(|il| !v.contains(il)));
        let q5 = descs
            .iter()
            .find(|d| d.name == "blk.5.attn_q.weight")
            .expect("q");
        assert_eq!(q5.dims, [2816, 16 * 512]);
        let q0 = descs
            .iter()
            .find(|d| d.name == "blk.0.attn_k.weight")
            .expect("k");
        assert_eq!(q0.dims, [2816, 8 * 256]);
        // Google's 25.2B total, 3.8B active.
        let types = TypeChoice {
            default: GgmlType::Q4_K,
            overrides: Vec::new(),
        };
        let planned = plan(&ModelHparams::Gemma4(h.clone()), descs, &types);
        let (total, active) = param_counts(&h, &planned);
        assert!(
            (25.0e9..25.5e9).contains(&(total as f64)),
            "{total} parameters"
        );
        assert!((3.7e9..4.0e9).contains(&(active as f64)), "{active} active");
    }

    #[test]
    fn defaults_are_llama_cpps() {
        let h = hparams("tiny");
        // No final_logit_softcapping: llama.cpp's default of 30; 0 switches it off.
        let read = with(&h, "final_logit_softcapping", None).expect("reads");
        assert_eq!(read.final_logit_softcapping, Some(30.0));
        let read = with(&h, "final_logit_softcapping", Some(Value::F32(0.0))).expect("reads");
        assert_eq!(read.final_logit_softcapping, None);
        let read = with(&h, "rope.freq_base_swa", None).expect("reads");
        assert_eq!(read.rope_freq_base_swa, DEFAULT_ROPE_FREQ_BASE_SWA);
    }

    #[test]
    fn what_is_not_computed_is_refused_with_the_reason() {
        let h = hparams("tiny");
        let e = with(
            &h,
            "embedding_length_per_layer_input",
            Some(Value::U32(256)),
        )
        .expect_err("refused");
        assert!(e.0.contains("per-layer embeddings"), "{e}");
        let e = with(&h, "attention.shared_kv_layers", Some(Value::U32(1))).expect_err("refused");
        assert!(e.0.contains("shared_kv_layers"), "{e}");
        let e = with(&h, "attention.sliding_window_pattern", None).expect_err("refused");
        assert!(e.0.contains("sliding_window_pattern"), "{e}");
        let e = with(
            &h,
            "attention.sliding_window_pattern",
            Some(Value::bool_array([true, false])),
        )
        .expect_err("refused");
        assert!(e.0.contains("every block"), "{e}");
        let e = with(
            &h,
            "attention.head_count_kv",
            Some(Value::u32_array([1, 2, 1])),
        )
        .expect_err("refused");
        assert!(e.0.contains("differs between blocks of one kind"), "{e}");
    }
}
