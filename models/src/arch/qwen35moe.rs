//! Qwen3.5 / Qwen3.6 MoE (`qwen35moe`: Qwen3.5-35B-A3B, Qwen3.6-35B-A3B, Qwen3.5-122B-A10B, …).
//!
//! Blocks are either gated delta-net (linear attention: a fused QKV projection through a short causal
//! conv1d and SiLU, L2-normed Q/K, the gated delta rule with decay `exp(A * softplus(alpha + dt))` and
//! write strength `sigmoid(beta)`, an RMS norm gated by `silu(Z)`, an output projection) or gated full
//! attention (Q and an output gate from one projection, RMS-normed Q/K, interleaved multi-section RoPE
//! over part of the head, `sigmoid(gate)` on the attention output). By default every
//! `full_attention_interval`-th block is full attention. Every block ends with routed experts (softmax
//! top-k, renormalized) plus a shared expert scaled by `sigmoid(w · x)`. Norms: pre-attention norm and a
//! post-attention norm that feeds the FFN. After the trunk come `nextn_predict_layers` MTP blocks (full
//! attention + MoE, fed by `eh_proj` of the normed embedding and hidden state), which the main pass skips.
//!
//! Follows llama.cpp's `src/models/qwen35moe.cpp`.

use super::{
    arch_kv, check, uniform_u32, uniform_u32_req, vocab_size, ArchError, ArchHparams, Dim,
    LayerKind, LayerSel, Presence, Role, TensorClass, TensorDef,
};
use crate::gguf::{Metadata, Value};

/// `general.architecture`.
pub const ARCH: &str = "qwen35moe";

/// Hyperparameters of a `qwen35moe` model.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen35MoeHparams {
    /// Vocabulary size (length of `tokenizer.ggml.tokens`).
    pub n_vocab: u64,
    /// `context_length`.
    pub n_ctx_train: u32,
    /// `embedding_length`.
    pub n_embd: u32,
    /// Trunk blocks: `block_count - nextn_predict_layers`.
    pub n_layer: u32,
    /// `nextn_predict_layers`: MTP blocks after the trunk.
    pub n_nextn: u32,
    /// `attention.head_count` (full-attention blocks).
    pub n_head: u32,
    /// `attention.head_count_kv`.
    pub n_head_kv: u32,
    /// `attention.key_length` (= `value_length`).
    pub head_dim: u32,
    /// `rope.dimension_count`: rotated dimensions of a head (a quarter of it in the real models).
    pub rope_dim: u32,
    /// `rope.dimension_sections`: multi-section RoPE pairs per section (sum = `rope_dim / 2`).
    pub rope_sections: [u32; 4],
    /// `rope.freq_base`.
    pub rope_freq_base: f32,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// `expert_count`.
    pub n_expert: u32,
    /// `expert_used_count`.
    pub n_expert_used: u32,
    /// `expert_feed_forward_length`.
    pub n_ff_exp: u32,
    /// `expert_shared_feed_forward_length`.
    pub n_ff_shexp: u32,
    /// `ssm.conv_kernel`.
    pub ssm_conv_kernel: u32,
    /// `ssm.state_size`: delta-net head dimension (keys and values).
    pub ssm_state_size: u32,
    /// `ssm.group_count`: delta-net key heads.
    pub ssm_group_count: u32,
    /// `ssm.time_step_rank`: delta-net value heads.
    pub ssm_time_step_rank: u32,
    /// `ssm.inner_size`: value heads × head dimension.
    pub ssm_inner_size: u32,
    /// `full_attention_interval`: block `i` of the trunk is full attention when `(i + 1) % interval == 0`.
    pub full_attention_interval: u32,
    /// `attention.recurrent_layers`, when the file lists the recurrent blocks explicitly (one flag per
    /// block, MTP blocks included); it then overrides the interval.
    pub recurrent_layers: Option<Vec<bool>>,
}

use Dim::*;
use TensorClass as C;

const fn def(
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

const fn opt(d: TensorDef) -> TensorDef {
    TensorDef {
        presence: Presence::Optional,
        ..d
    }
}

const ALL: Option<LayerSel> = Some(LayerSel::All);
const ATT: Option<LayerSel> = Some(LayerSel::Attention);
const REC: Option<LayerSel> = Some(LayerSel::Recurrent);
const MTP: Option<LayerSel> = Some(LayerSel::NextN);

/// The tensors of a `qwen35moe` file.
pub const TENSORS: &[TensorDef] = &[
    def(Role::TokenEmbd, None, &[Embd, Vocab], C::Embedding), // [n_embd, n_vocab]
    def(Role::OutputNorm, None, &[Embd], C::Norm),            // [n_embd]
    opt(def(Role::Output, None, &[Embd, Vocab], C::Output)),  // [n_embd, n_vocab]; tied when absent
    def(Role::AttnNorm, ALL, &[Embd], C::Norm),               // [n_embd]
    def(Role::AttnPostNorm, ALL, &[Embd], C::Norm),           // [n_embd]
    // full attention (trunk and MTP blocks)
    def(Role::AttnQ, ATT, &[Embd, QGateProj], C::Attention), // [n_embd, 2 * n_head * head_dim]: Q and gate
    def(Role::AttnK, ATT, &[Embd, KProj], C::Attention),     // [n_embd, n_head_kv * head_dim]
    def(Role::AttnV, ATT, &[Embd, VProj], C::Attention),     // [n_embd, n_head_kv * head_dim]
    def(Role::AttnOut, ATT, &[QProj, Embd], C::Attention),   // [n_head * head_dim, n_embd]
    def(Role::AttnQNorm, ATT, &[HeadK], C::Norm),            // [head_dim]
    def(Role::AttnKNorm, ATT, &[HeadK], C::Norm),            // [head_dim]
    // gated delta net (llama.cpp's loader marks attn_qkv/attn_gate optional, but its graph needs them)
    def(Role::AttnQkv, REC, &[Embd, SsmConvDim], C::DeltaNet), // [n_embd, 2 * key_dim + value_dim]
    def(Role::AttnGate, REC, &[Embd, SsmValueDim], C::DeltaNet), // [n_embd, value_dim]
    def(
        Role::SsmConv1d,
        REC,
        &[SsmConvKernel, SsmConvDim],
        C::DeltaNetParam,
    ), // [d_conv, conv_dim]
    def(Role::SsmDt, REC, &[SsmVHeads], C::DeltaNetParam),     // [n_v_heads]
    def(Role::SsmA, REC, &[SsmVHeads], C::DeltaNetParam),      // [n_v_heads]: -exp(A_log)
    def(Role::SsmBeta, REC, &[Embd, SsmVHeads], C::DeltaNet),  // [n_embd, n_v_heads]
    def(Role::SsmAlpha, REC, &[Embd, SsmVHeads], C::DeltaNet), // [n_embd, n_v_heads]
    def(Role::SsmNorm, REC, &[SsmHeadDim], C::Norm),           // [head_v_dim]
    def(Role::SsmOut, REC, &[SsmValueDim, Embd], C::DeltaNet), // [value_dim, n_embd]
    // routed and shared experts (every block)
    def(Role::FfnGateInp, ALL, &[Embd, Expert], C::Router), // [n_embd, n_expert]
    def(Role::FfnDownExps, ALL, &[FfExp, Embd, Expert], C::Expert), // [n_ff_exp, n_embd, n_expert]
    def(Role::FfnGateExps, ALL, &[Embd, FfExp, Expert], C::Expert), // [n_embd, n_ff_exp, n_expert]
    def(Role::FfnUpExps, ALL, &[Embd, FfExp, Expert], C::Expert), // [n_embd, n_ff_exp, n_expert]
    def(Role::FfnGateInpShexp, ALL, &[Embd], C::Router),    // [n_embd]
    def(Role::FfnGateShexp, ALL, &[Embd, FfShexp], C::SharedExpert), // [n_embd, n_ff_shexp]
    def(Role::FfnUpShexp, ALL, &[Embd, FfShexp], C::SharedExpert), // [n_embd, n_ff_shexp]
    def(Role::FfnDownShexp, ALL, &[FfShexp, Embd], C::SharedExpert), // [n_ff_shexp, n_embd]
    // MTP block
    def(Role::NextnEhProj, MTP, &[Embd2, Embd], C::NextN), // [2 * n_embd, n_embd]
    def(Role::NextnEnorm, MTP, &[Embd], C::Norm),          // [n_embd]
    def(Role::NextnHnorm, MTP, &[Embd], C::Norm),          // [n_embd]
    opt(def(
        Role::NextnEmbedTokens,
        MTP,
        &[Embd, Vocab],
        C::Embedding,
    )), // [n_embd, n_vocab]; else token_embd
    opt(def(
        Role::NextnSharedHeadHead,
        MTP,
        &[Embd, Vocab],
        C::Output,
    )), // [n_embd, n_vocab]; else output
    opt(def(Role::NextnSharedHeadNorm, MTP, &[Embd], C::Norm)), // [n_embd]; else output_norm
];

impl Qwen35MoeHparams {
    /// Whether trunk or MTP block `il` is a recurrent (delta-net) block.
    pub fn is_recurrent(&self, il: u32) -> bool {
        if let Some(r) = &self.recurrent_layers {
            return r.get(il as usize).copied().unwrap_or(false);
        }
        il < self.n_layer
            && self.full_attention_interval > 0
            && !(il + 1).is_multiple_of(self.full_attention_interval)
    }

    /// Reads the hyperparameters from a file's metadata (the keys llama.cpp's loader reads).
    pub fn from_metadata(md: &Metadata) -> Result<Self, ArchError> {
        let n_layer_all = md.arch_u32("block_count")?;
        let n_nextn = md.arch_u32_opt("nextn_predict_layers")?.unwrap_or(0);
        check(
            ARCH,
            n_nextn < n_layer_all,
            "nextn_predict_layers leaves no trunk blocks",
        )?;
        let n_embd = md.arch_u32("embedding_length")?;
        let n_head = uniform_u32_req(md, "attention.head_count", n_layer_all)?;
        check(ARCH, n_head > 0, "attention.head_count is 0")?;
        let n_head_kv = uniform_u32(md, "attention.head_count_kv", n_layer_all)?.unwrap_or(n_head);
        let head_dim = md
            .arch_u32_opt("attention.key_length")?
            .unwrap_or(n_embd / n_head);
        let head_v = md
            .arch_u32_opt("attention.value_length")?
            .unwrap_or(n_embd / n_head);
        check(
            ARCH,
            head_v == head_dim,
            "attention.value_length differs from key_length",
        )?;
        let n_expert_used = uniform_u32_req(md, "expert_used_count", n_layer_all)?;
        check(ARCH, n_expert_used > 0, "expert_used_count is 0")?;
        let n_ff = uniform_u32(md, "feed_forward_length", n_layer_all)?.unwrap_or(0);
        let n_ff_exp = match uniform_u32(md, "expert_feed_forward_length", n_layer_all)? {
            Some(v) if v > 0 => v,
            _ => n_ff / n_expert_used,
        };
        let n_ff_shexp = match md.arch_u32_opt("expert_shared_feed_forward_length")? {
            Some(v) if v > 0 => v,
            _ => n_ff,
        };
        let sections = md.arch_u32_array("rope.dimension_sections")?;
        check(
            ARCH,
            sections.len() == 4,
            "rope.dimension_sections must have 4 elements",
        )?;
        let recurrent_layers = md.arch_bool_array_opt("attention.recurrent_layers")?;
        if let Some(r) = &recurrent_layers {
            check(
                ARCH,
                r.len() == n_layer_all as usize,
                "attention.recurrent_layers has the wrong length",
            )?;
        }
        let hp = Qwen35MoeHparams {
            n_vocab: vocab_size(md)?,
            n_ctx_train: md.arch_u32("context_length")?,
            n_embd,
            n_layer: n_layer_all - n_nextn,
            n_nextn,
            n_head,
            n_head_kv,
            head_dim,
            rope_dim: md.arch_u32_opt("rope.dimension_count")?.unwrap_or(head_dim),
            rope_sections: [sections[0], sections[1], sections[2], sections[3]],
            rope_freq_base: md.arch_f32_opt("rope.freq_base")?.unwrap_or(10000.0),
            rms_eps: md.arch_f32("attention.layer_norm_rms_epsilon")?,
            n_expert: md.arch_u32("expert_count")?,
            n_expert_used,
            n_ff_exp,
            n_ff_shexp,
            ssm_conv_kernel: md.arch_u32("ssm.conv_kernel")?,
            ssm_state_size: md.arch_u32("ssm.state_size")?,
            ssm_group_count: md.arch_u32("ssm.group_count")?,
            ssm_time_step_rank: md.arch_u32("ssm.time_step_rank")?,
            ssm_inner_size: md.arch_u32("ssm.inner_size")?,
            full_attention_interval: md.arch_u32_opt("full_attention_interval")?.unwrap_or(4),
            recurrent_layers,
        };
        hp.validate()?;
        Ok(hp)
    }
}

impl ArchHparams for Qwen35MoeHparams {
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
        if il >= self.n_layer {
            LayerKind::NextN
        } else if self.is_recurrent(il) {
            LayerKind::Recurrent
        } else {
            LayerKind::Attention
        }
    }

    fn dim(&self, d: Dim) -> Option<u64> {
        let key_dim = (self.ssm_state_size * self.ssm_group_count) as u64;
        let value_dim = (self.ssm_state_size * self.ssm_time_step_rank) as u64;
        let v = match d {
            Embd => self.n_embd as u64,
            Embd2 => 2 * self.n_embd as u64,
            Vocab => self.n_vocab,
            FfExp => self.n_ff_exp as u64,
            FfShexp => self.n_ff_shexp as u64,
            Expert => self.n_expert as u64,
            HeadK => self.head_dim as u64,
            QProj => (self.n_head * self.head_dim) as u64,
            QGateProj => 2 * (self.n_head * self.head_dim) as u64,
            KProj | VProj => (self.n_head_kv * self.head_dim) as u64,
            SsmConvKernel => self.ssm_conv_kernel as u64,
            SsmConvDim => 2 * key_dim + value_dim,
            SsmValueDim => value_dim,
            SsmVHeads => self.ssm_time_step_rank as u64,
            SsmHeadDim => self.ssm_state_size as u64,
            Ff => return None,
        };
        Some(v)
    }

    fn n_expert_used(&self) -> u32 {
        self.n_expert_used
    }

    fn synth_writes(&self, role: Role) -> bool {
        // Converted Qwen3.5/3.6 files have an untied output and the MTP block's own final norm, but no MTP
        // embedding or LM head of its own.
        matches!(role, Role::Output | Role::NextnSharedHeadNorm)
    }

    fn to_metadata(&self) -> Vec<(String, Value)> {
        let mut kv = vec![
            arch_kv(ARCH, "block_count", self.n_layer + self.n_nextn),
            arch_kv(ARCH, "context_length", self.n_ctx_train),
            arch_kv(ARCH, "embedding_length", self.n_embd),
            arch_kv(ARCH, "attention.head_count", self.n_head),
            arch_kv(ARCH, "attention.head_count_kv", self.n_head_kv),
            arch_kv(ARCH, "attention.key_length", self.head_dim),
            arch_kv(ARCH, "attention.value_length", self.head_dim),
            arch_kv(ARCH, "rope.dimension_count", self.rope_dim),
            arch_kv(ARCH, "rope.freq_base", self.rope_freq_base),
            arch_kv(
                ARCH,
                "rope.dimension_sections",
                Value::i32_array(self.rope_sections.map(|s| s as i32)),
            ),
            arch_kv(ARCH, "attention.layer_norm_rms_epsilon", self.rms_eps),
            arch_kv(ARCH, "expert_count", self.n_expert),
            arch_kv(ARCH, "expert_used_count", self.n_expert_used),
            arch_kv(ARCH, "expert_feed_forward_length", self.n_ff_exp),
            arch_kv(ARCH, "expert_shared_feed_forward_length", self.n_ff_shexp),
            arch_kv(ARCH, "ssm.conv_kernel", self.ssm_conv_kernel),
            arch_kv(ARCH, "ssm.state_size", self.ssm_state_size),
            arch_kv(ARCH, "ssm.group_count", self.ssm_group_count),
            arch_kv(ARCH, "ssm.time_step_rank", self.ssm_time_step_rank),
            arch_kv(ARCH, "ssm.inner_size", self.ssm_inner_size),
            arch_kv(
                ARCH,
                "full_attention_interval",
                self.full_attention_interval,
            ),
        ];
        if let Some(r) = &self.recurrent_layers {
            kv.push(arch_kv(
                ARCH,
                "attention.recurrent_layers",
                Value::bool_array(r.iter().copied()),
            ));
        }
        if self.n_nextn > 0 {
            kv.push(arch_kv(ARCH, "nextn_predict_layers", self.n_nextn));
        }
        kv
    }

    fn validate(&self) -> Result<(), ArchError> {
        check(ARCH, self.n_layer > 0, "no trunk blocks")?;
        check(
            ARCH,
            self.n_embd > 0 && self.n_vocab > 0,
            "embedding_length or vocabulary is 0",
        )?;
        check(
            ARCH,
            self.n_head > 0 && self.n_head_kv > 0,
            "a head count is 0",
        )?;
        check(
            ARCH,
            self.n_head.is_multiple_of(self.n_head_kv),
            "head_count is not a multiple of head_count_kv",
        )?;
        check(
            ARCH,
            self.rope_dim <= self.head_dim && self.rope_dim.is_multiple_of(2),
            "rope.dimension_count must be even and at most key_length",
        )?;
        check(
            ARCH,
            self.rope_sections.iter().sum::<u32>() * 2 == self.rope_dim,
            "rope.dimension_sections must sum to rope.dimension_count / 2",
        )?;
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
        check(
            ARCH,
            self.n_ff_exp > 0 && self.n_ff_shexp > 0,
            "an expert FFN length is 0",
        )?;
        check(
            ARCH,
            self.ssm_conv_kernel > 0 && self.ssm_state_size > 0,
            "ssm.conv_kernel and ssm.state_size must be > 0",
        )?;
        check(
            ARCH,
            self.ssm_group_count > 0 && self.ssm_time_step_rank > 0,
            "ssm head counts must be > 0",
        )?;
        check(
            ARCH,
            self.ssm_time_step_rank.is_multiple_of(self.ssm_group_count),
            "ssm.time_step_rank (value heads) must be a multiple of ssm.group_count (key heads)",
        )?;
        check(
            ARCH,
            self.ssm_inner_size == self.ssm_state_size * self.ssm_time_step_rank,
            "ssm.inner_size must be ssm.state_size * ssm.time_step_rank",
        )?;
        check(
            ARCH,
            self.full_attention_interval > 0,
            "full_attention_interval is 0",
        )?;
        check(
            ARCH,
            self.n_nextn <= 1,
            "llama.cpp supports at most one MTP block",
        )?;
        for il in self.n_layer..self.n_layer_all() {
            check(
                ARCH,
                !self.is_recurrent(il),
                "an MTP block is marked recurrent",
            )?;
        }
        check(
            ARCH,
            self.rms_eps > 0.0,
            "layer_norm_rms_epsilon must be positive",
        )?;
        Ok(())
    }
}
