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
//! Follows llama.cpp's `src/models/qwen35moe.cpp` (hyperparameters, tensors, graph) and
//! `src/models/delta-net-base.cpp` (the delta rule); [`Qwen35MoeGraph`] is the forward pass.

use super::common::{rope_freq_scale, CommonHparams, ExpertHparams};
use super::graph::{Forward, ModelInfo, StateSpec, TensorMap, ValueMap};
use super::{
    arch_kv, check, def, opt, ArchError, ArchHparams, Dim, LayerKind, LayerSel, Role, TensorClass,
    TensorDef,
};
use crate::compute::{
    Attention, Compute, DeltaNet, DeltaNetInputs, Gating, Moe, NormAfter, Rope, RopeKind,
    SharedExpert, Unary, WeightId,
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
    /// `rope.dimension_sections`: multi-section RoPE pairs per section (normally summing to `rope_dim / 2`;
    /// ggml takes each rotated pair's section modulo their sum, so other sums run too). All 0 in Clover's
    /// form, which has none: NeoX RoPE over the rotated pairs, what the sections give text positions.
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
    /// The file's form: Qwen3.5/3.6's own, or Clover's ([`super::clover_moe`]).
    pub form: Qwen35Form,
}

/// The forms a file of this layout comes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Qwen35Form {
    /// `qwen35moe`: `ssm_a` holds `-exp(A_log)`, `rope.dimension_sections` given.
    Qwen35,
    /// `clover_moe`: `ssm_a` holds `A_log` (the value is `-exp` of it), no rope sections (every rotated
    /// pair is a text pair: NeoX RoPE over `rope.dimension_count`).
    Clover,
}

impl Qwen35Form {
    /// `general.architecture` of the form.
    pub fn arch(self) -> &'static str {
        match self {
            Qwen35Form::Qwen35 => ARCH,
            Qwen35Form::Clover => super::clover_moe::ARCH,
        }
    }
}

use Dim::*;
use TensorClass as C;

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
        Self::read(md, Qwen35Form::Qwen35)
    }

    /// Reads the hyperparameters of a file of `form` (its keys under its own `general.architecture`).
    pub(super) fn read(md: &Metadata, form: Qwen35Form) -> Result<Self, ArchError> {
        let arch = form.arch();
        let c = CommonHparams::read(md, arch)?;
        let n_layer_all = c.n_layer_all;
        let n_nextn = md.arch_u32_opt("nextn_predict_layers")?.unwrap_or(0);
        check(
            arch,
            n_nextn < n_layer_all,
            "nextn_predict_layers leaves no trunk blocks",
        )?;
        let head_dim = c.head_dim(arch)?;
        let n_ff = c.n_ff_opt(md)?;
        let e = ExpertHparams::read(md, arch, &c, n_ff)?;
        let n_ff_shexp = match md.arch_u32_opt("expert_shared_feed_forward_length")? {
            Some(v) if v > 0 => v,
            _ => n_ff,
        };
        let sections = match form {
            Qwen35Form::Qwen35 => md.arch_u32_array("rope.dimension_sections")?,
            // None: plain NeoX RoPE over the rotated pairs.
            Qwen35Form::Clover => vec![0; 4],
        };
        check(
            arch,
            sections.len() == 4,
            "rope.dimension_sections must have 4 elements",
        )?;
        let recurrent_layers = md.arch_bool_array_opt("attention.recurrent_layers")?;
        if let Some(r) = &recurrent_layers {
            check(
                arch,
                r.len() == n_layer_all as usize,
                "attention.recurrent_layers has the wrong length",
            )?;
        }
        let hp = Qwen35MoeHparams {
            n_vocab: c.n_vocab,
            n_ctx_train: c.n_ctx_train,
            n_embd: c.n_embd,
            n_layer: n_layer_all - n_nextn,
            n_nextn,
            n_head: c.n_head,
            n_head_kv: c.n_head_kv,
            head_dim,
            rope_dim: c.n_rot,
            rope_sections: [sections[0], sections[1], sections[2], sections[3]],
            rope_freq_base: c.rope_freq_base,
            rms_eps: c.rms_eps,
            n_expert: e.n_expert,
            n_expert_used: e.n_expert_used,
            n_ff_exp: e.n_ff_exp,
            n_ff_shexp,
            ssm_conv_kernel: md.arch_u32("ssm.conv_kernel")?,
            ssm_state_size: md.arch_u32("ssm.state_size")?,
            ssm_group_count: md.arch_u32("ssm.group_count")?,
            ssm_time_step_rank: md.arch_u32("ssm.time_step_rank")?,
            ssm_inner_size: md.arch_u32("ssm.inner_size")?,
            full_attention_interval: md.arch_u32_opt("full_attention_interval")?.unwrap_or(4),
            recurrent_layers,
            form,
        };
        hp.validate()?;
        Ok(hp)
    }
}

impl ArchHparams for Qwen35MoeHparams {
    fn arch_name(&self) -> &'static str {
        self.form.arch()
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
            _ => return None,
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
        let arch = self.form.arch();
        let mut kv = vec![
            arch_kv(arch, "block_count", self.n_layer + self.n_nextn),
            arch_kv(arch, "context_length", self.n_ctx_train),
            arch_kv(arch, "embedding_length", self.n_embd),
            arch_kv(arch, "attention.head_count", self.n_head),
            arch_kv(arch, "attention.head_count_kv", self.n_head_kv),
            arch_kv(arch, "attention.key_length", self.head_dim),
            arch_kv(arch, "attention.value_length", self.head_dim),
            arch_kv(arch, "rope.dimension_count", self.rope_dim),
            arch_kv(arch, "rope.freq_base", self.rope_freq_base),
        ];
        if self.form == Qwen35Form::Qwen35 {
            kv.push(arch_kv(
                arch,
                "rope.dimension_sections",
                Value::i32_array(self.rope_sections.map(|s| s as i32)),
            ));
        }
        kv.extend([
            arch_kv(arch, "attention.layer_norm_rms_epsilon", self.rms_eps),
            arch_kv(arch, "expert_count", self.n_expert),
            arch_kv(arch, "expert_used_count", self.n_expert_used),
            arch_kv(arch, "expert_feed_forward_length", self.n_ff_exp),
            arch_kv(arch, "expert_shared_feed_forward_length", self.n_ff_shexp),
            arch_kv(arch, "ssm.conv_kernel", self.ssm_conv_kernel),
            arch_kv(arch, "ssm.state_size", self.ssm_state_size),
            arch_kv(arch, "ssm.group_count", self.ssm_group_count),
            arch_kv(arch, "ssm.time_step_rank", self.ssm_time_step_rank),
            arch_kv(arch, "ssm.inner_size", self.ssm_inner_size),
            arch_kv(
                arch,
                "full_attention_interval",
                self.full_attention_interval,
            ),
        ]);
        if let Some(r) = &self.recurrent_layers {
            kv.push(arch_kv(
                arch,
                "attention.recurrent_layers",
                Value::bool_array(r.iter().copied()),
            ));
        }
        if self.n_nextn > 0 {
            kv.push(arch_kv(arch, "nextn_predict_layers", self.n_nextn));
        }
        kv
    }

    fn common(&self) -> CommonHparams {
        CommonHparams {
            n_vocab: self.n_vocab,
            n_ctx_train: self.n_ctx_train,
            n_embd: self.n_embd,
            n_layer_all: self.n_layer + self.n_nextn,
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
        let arch = self.form.arch();
        check(arch, self.n_layer > 0, "no trunk blocks")?;
        self.common().validate(arch)?;
        check(
            arch,
            self.rope_dim <= self.head_dim && self.rope_dim.is_multiple_of(2),
            "rope.dimension_count must be even and at most key_length",
        )?;
        // llama.cpp does not ask the sections to sum to rope.dimension_count / 2: ggml's multi-section RoPE
        // takes pair i's sector as i mod their sum. It only asserts the sum is at most the head size
        // (GGML_ASSERT(sect_dims <= ne0) in ggml_mrope_cache_init), and a sum of 0 would divide by zero.
        let sect_dims: u32 = self.rope_sections.iter().sum();
        check(
            arch,
            self.form == Qwen35Form::Clover || (sect_dims > 0 && sect_dims <= self.head_dim),
            "rope.dimension_sections must sum to more than 0 and at most key_length (ggml asserts it)",
        )?;
        check(
            arch,
            self.n_expert > 0 && self.n_expert_used > 0,
            "expert_count and expert_used_count must be > 0",
        )?;
        check(
            arch,
            self.n_expert_used <= self.n_expert,
            "expert_used_count exceeds expert_count",
        )?;
        check(
            arch,
            self.n_ff_exp > 0 && self.n_ff_shexp > 0,
            "an expert FFN length is 0",
        )?;
        check(
            arch,
            self.ssm_conv_kernel > 0 && self.ssm_state_size > 0,
            "ssm.conv_kernel and ssm.state_size must be > 0",
        )?;
        check(
            arch,
            self.ssm_group_count > 0 && self.ssm_time_step_rank > 0,
            "ssm head counts must be > 0",
        )?;
        check(
            arch,
            self.ssm_time_step_rank.is_multiple_of(self.ssm_group_count),
            "ssm.time_step_rank (value heads) must be a multiple of ssm.group_count (key heads)",
        )?;
        check(
            arch,
            self.ssm_inner_size == self.ssm_state_size * self.ssm_time_step_rank,
            "ssm.inner_size must be ssm.state_size * ssm.time_step_rank",
        )?;
        check(
            arch,
            self.full_attention_interval > 0,
            "full_attention_interval is 0",
        )?;
        check(
            arch,
            self.n_nextn <= 1,
            "llama.cpp supports at most one MTP block",
        )?;
        for il in self.n_layer..self.n_layer_all() {
            check(
                arch,
                !self.is_recurrent(il),
                "an MTP block is marked recurrent",
            )?;
        }
        check(
            arch,
            self.rms_eps > 0.0,
            "layer_norm_rms_epsilon must be positive",
        )?;
        Ok(())
    }
}

/// Whether interleaved multi-section RoPE (ggml's `GGML_ROPE_TYPE_IMROPE`, which llama.cpp uses for
/// `qwen35moe`) rotates every one of the `n_pairs` rotated pairs by the token's position when
/// the positions are text positions. llama.cpp gives a text token the position `p` in the first three
/// sections and 0 in the fourth; pair `i` (sector `i mod Σ sections`) reads section `i mod 3` while the
/// sector is below three times that section's size, and the fourth otherwise — and a pair at position 0
/// is not rotated. When every pair reads one of the first three, the rotation is plain NeoX RoPE over
/// the rotated dimensions (same angles, same pairing).
fn imrope_text_is_neox(sections: [u32; 4], n_pairs: u32) -> bool {
    let sect_dims: u32 = sections.iter().sum();
    if sect_dims == 0 {
        return false;
    }
    (0..n_pairs)
        .map(|i| i % sect_dims)
        .all(|sector| match sector % 3 {
            0 => sector < 3 * sections[0],
            1 => sector < 3 * sections[1],
            _ => sector < 3 * sections[2],
        })
}

/// The token mixer of a gated delta-net block.
#[derive(Clone, Debug)]
struct DeltaNetMixer {
    /// `attn_qkv`: the fused Q, K, V projection (before the convolution).
    qkv: WeightId,
    /// `attn_gate`: Z, the output gate.
    z: WeightId,
    conv1d: WeightId,
    /// `ssm_dt.bias`, added to alpha before the softplus.
    dt_bias: WeightId,
    /// `ssm_a`: `-exp(A_log)` (Clover's files hold `A_log`: [`Qwen35MoeGraph::value_maps`]).
    a: WeightId,
    beta: WeightId,
    alpha: WeightId,
    norm: WeightId,
    out: WeightId,
}

/// The token mixer of a gated full-attention block.
#[derive(Clone, Debug)]
struct AttentionMixer {
    /// Q and the output gate, interleaved per head: `[n_embd, 2 · n_head · head_dim]`.
    wq_gate: WeightId,
    wk: WeightId,
    wv: WeightId,
    wo: WeightId,
    q_norm: WeightId,
    k_norm: WeightId,
}

#[derive(Clone, Debug)]
enum Mixer {
    DeltaNet(DeltaNetMixer),
    Attention(AttentionMixer),
}

/// The shared expert: a SwiGLU FFN scaled by `sigmoid(gate_inp · x)`.
#[derive(Clone, Debug)]
struct SharedExpertTensors {
    /// `ffn_gate_inp_shexp`: `[n_embd]`, one logit per token.
    gate_inp: WeightId,
    gate: WeightId,
    up: WeightId,
    down: WeightId,
}

/// One block: pre-norm, token mixer, post-attention norm (the FFN's input norm), routed and shared
/// experts.
#[derive(Clone, Debug)]
struct Block {
    attn_norm: WeightId,
    post_attn_norm: WeightId,
    mixer: Mixer,
    moe: Moe,
    shexp: SharedExpertTensors,
}

/// The MTP (next-token prediction) block's own tensors: the draft block
/// ([`Forward::forward_draft_block`]), which the main forward pass does not run.
#[derive(Clone, Debug)]
struct NextnBlock {
    /// A full-attention block like the trunk's.
    block: Block,
    eh_proj: WeightId,
    enorm: WeightId,
    hnorm: WeightId,
    /// Its own token embedding, when the file has one (else `token_embd`).
    embed_tokens: Option<WeightId>,
    /// Its own LM head, when the file has one (else `output`).
    head: Option<WeightId>,
    /// Its own final norm, when the file has one (else `output_norm`).
    head_norm: Option<WeightId>,
}

/// The forward pass of a `qwen35moe` model (llama.cpp's `llama_model_qwen35moe::graph`).
#[derive(Clone, Debug)]
pub struct Qwen35MoeGraph {
    hp: Qwen35MoeHparams,
    info: ModelInfo,
    tok_embd: WeightId,
    output_norm: WeightId,
    /// `output.weight`, or the token embedding when the file ties them.
    output: WeightId,
    blocks: Vec<Block>,
    nextn: Vec<NextnBlock>,
    /// The RoPE position scale ([`rope_freq_scale`]).
    rope_freq_scale: f32,
    /// `rope.dimension_sections`, for rows given four positions (a picture's); `None` for Clover's files,
    /// whose sections this forward pass does not read.
    rope_sections: Option<[u32; 4]>,
}

impl Qwen35MoeGraph {
    /// Builds the forward pass from bound tensors; an error for RoPE sections this forward pass does not
    /// compute (ones that leave text positions' pairs unrotated, which no released model has).
    pub fn new(
        hp: Qwen35MoeHparams,
        t: &TensorMap,
        md: &Metadata,
    ) -> Result<Qwen35MoeGraph, ArchError> {
        check(
            hp.form.arch(),
            hp.form == Qwen35Form::Clover || imrope_text_is_neox(hp.rope_sections, hp.rope_dim / 2),
            "rope.dimension_sections leave rotated pairs at position 0, which is not implemented",
        )?;
        let attention = |il: u32| -> Result<AttentionMixer, ArchError> {
            Ok(AttentionMixer {
                wq_gate: t.layer(Role::AttnQ, il)?,
                wk: t.layer(Role::AttnK, il)?,
                wv: t.layer(Role::AttnV, il)?,
                wo: t.layer(Role::AttnOut, il)?,
                q_norm: t.layer(Role::AttnQNorm, il)?,
                k_norm: t.layer(Role::AttnKNorm, il)?,
            })
        };
        let block = |il: u32| -> Result<Block, ArchError> {
            let mixer = if hp.is_recurrent(il) {
                Mixer::DeltaNet(DeltaNetMixer {
                    qkv: t.layer(Role::AttnQkv, il)?,
                    z: t.layer(Role::AttnGate, il)?,
                    conv1d: t.layer(Role::SsmConv1d, il)?,
                    dt_bias: t.layer(Role::SsmDt, il)?,
                    a: t.layer(Role::SsmA, il)?,
                    beta: t.layer(Role::SsmBeta, il)?,
                    alpha: t.layer(Role::SsmAlpha, il)?,
                    norm: t.layer(Role::SsmNorm, il)?,
                    out: t.layer(Role::SsmOut, il)?,
                })
            } else {
                Mixer::Attention(attention(il)?)
            };
            Ok(Block {
                attn_norm: t.layer(Role::AttnNorm, il)?,
                post_attn_norm: t.layer(Role::AttnPostNorm, il)?,
                mixer,
                moe: Moe {
                    router: t.layer(Role::FfnGateInp, il)?,
                    gate_exps: t.layer(Role::FfnGateExps, il)?,
                    up_exps: t.layer(Role::FfnUpExps, il)?,
                    down_exps: t.layer(Role::FfnDownExps, il)?,
                    n_expert: hp.n_expert as usize,
                    n_expert_used: hp.n_expert_used as usize,
                    gating: Gating::Softmax,
                    selection_bias: None,
                    // llama.cpp passes norm_w = true for qwen35moe whatever the file says, and reads no
                    // expert weight scale for it (0: none).
                    norm_weights: true,
                    weights_scale: 1.0,
                    act: Unary::Silu,
                },
                shexp: SharedExpertTensors {
                    gate_inp: t.layer(Role::FfnGateInpShexp, il)?,
                    gate: t.layer(Role::FfnGateShexp, il)?,
                    up: t.layer(Role::FfnUpShexp, il)?,
                    down: t.layer(Role::FfnDownShexp, il)?,
                },
            })
        };
        let blocks = (0..hp.n_layer).map(block).collect::<Result<Vec<_>, _>>()?;
        let nextn = (hp.n_layer..hp.n_layer_all())
            .map(|il| {
                Ok(NextnBlock {
                    block: block(il)?,
                    eh_proj: t.layer(Role::NextnEhProj, il)?,
                    enorm: t.layer(Role::NextnEnorm, il)?,
                    hnorm: t.layer(Role::NextnHnorm, il)?,
                    embed_tokens: t.layer_opt(Role::NextnEmbedTokens, il),
                    head: t.layer_opt(Role::NextnSharedHeadHead, il),
                    head_norm: t.layer_opt(Role::NextnSharedHeadNorm, il),
                })
            })
            .collect::<Result<Vec<_>, ArchError>>()?;
        let info = ModelInfo::new(
            hp.form.arch(),
            hp.n_vocab as usize,
            hp.n_embd as usize,
            hp.n_ctx_train,
            md,
        )?;
        let tok_embd = t.global_req(Role::TokenEmbd)?;
        Ok(Qwen35MoeGraph {
            rope_freq_scale: rope_freq_scale(md, ARCH)?,
            rope_sections: (hp.form != Qwen35Form::Clover).then_some(hp.rope_sections),
            tok_embd,
            output_norm: t.global_req(Role::OutputNorm)?,
            output: t.global(Role::Output).unwrap_or(tok_embd),
            blocks,
            nextn,
            info,
            hp,
        })
    }

    /// The hyperparameters.
    pub fn hparams(&self) -> &Qwen35MoeHparams {
        &self.hp
    }

    /// [`super::ModelGraph::value_maps`]: Clover's `ssm_a` of every delta-net block holds `A_log`.
    pub fn value_maps(&self) -> Vec<(WeightId, ValueMap)> {
        if self.hp.form != Qwen35Form::Clover {
            return Vec::new();
        }
        self.blocks
            .iter()
            .filter_map(|b| match &b.mixer {
                Mixer::DeltaNet(m) => Some((m.a, ValueMap::NegExp)),
                Mixer::Attention(_) => None,
            })
            .collect()
    }

    /// Delta-net sizes: `(n_k_heads, n_v_heads, head_dim)` (keys and values share the head size).
    fn delta_dims(&self) -> (usize, usize, usize) {
        let hp = &self.hp;
        (
            hp.ssm_group_count as usize,
            hp.ssm_time_step_rank as usize,
            hp.ssm_state_size as usize,
        )
    }

    /// The gated delta-net mixer (llama.cpp's `build_layer_attn_linear`) on the normed input `x`.
    fn delta_net<C: Compute>(&self, c: &mut C, il: usize, m: &DeltaNetMixer, x: &C::Act) -> C::Act {
        let eps = self.hp.rms_eps;
        let (n_k, n_v, head) = self.delta_dims();
        let (key_dim, value_dim) = (n_k * head, n_v * head);

        let [qkv, z, beta, alpha] = c.matmul_many([m.qkv, m.z, m.beta, m.alpha], x);
        // beta = sigmoid(beta); gate = softplus(alpha + dt_bias) · A: the log of the per-head state decay.
        let (beta, gate) = c.delta_gates(&beta, &alpha, m.dt_bias, m.a);

        // Causal conv1d over time (the state holds the previous kernel - 1 inputs), then SiLU.
        let conv = c.ssm_conv_silu(il, &qkv, m.conv1d);
        // q and k L2-normed as llama.cpp's `build_gdn_l2_norm`: rms_norm with eps/n, times 1/√n, i.e.
        // x / √(‖x‖² + eps).
        let l2 = (eps / head as f32, 1.0 / (head as f32).sqrt());
        let q = c.cols_rms_norm_scale(&conv, (0, key_dim), l2.0, head, l2.1);
        let k = c.cols_rms_norm_scale(&conv, (key_dim, key_dim), l2.0, head, l2.1);
        let v = c.cols(&conv, 2 * key_dim, value_dim);
        let net = DeltaNet {
            n_v_heads: n_v,
            head_k: head,
            head_v: head,
        };
        let inputs = DeltaNetInputs {
            q: &q,
            k: &k,
            v: &v,
            gate: &gate,
            beta: &beta,
        };
        // Value head h reads key head h mod n_k (ggml_repeat's tiling; the fused op indexes the same).
        let out = c.gated_delta_net_grouped(il, inputs, &net, n_k);

        // Gated RMS norm per value head: norm(out) ⊙ silu(z).
        let out = c.rms_norm_gated(&out, Some(m.norm), eps, head, &z);
        c.matmul(m.out, &out)
    }

    /// The gated full-attention mixer (llama.cpp's `build_layer_attn`) on the normed input `x`.
    fn attention<C: Compute>(
        &self,
        c: &mut C,
        il: usize,
        m: &AttentionMixer,
        x: &C::Act,
    ) -> C::Act {
        let hp = &self.hp;
        let (head_dim, eps) = (hp.head_dim as usize, hp.rms_eps);
        // Text positions: multi-section RoPE is NeoX over the rotated dimensions (checked at load); rows
        // with four positions (a picture's) turn by the sections.
        let rope = Rope {
            kind: RopeKind::Neox,
            head_dim,
            n_rot: hp.rope_dim as usize,
            freq_base: hp.rope_freq_base,
            freq_scale: self.rope_freq_scale,
            freq_factors: None,
            sections: self.rope_sections,
        };
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
        let [q_gate, k, v] = c.matmul_many([m.wq_gate, m.wk, m.wv], x);
        let q = c.head_part(&q_gate, head_dim, 2, 0);
        let gate = c.head_part(&q_gate, head_dim, 2, 1);
        let [q, k] = c.rms_norm_rope_pair([&q, &k], [Some(m.q_norm), Some(m.k_norm)], eps, &rope);
        let out = c.attention(il, &q, &k, &v, &attn);
        let gate = c.unary(&gate, Unary::Sigmoid);
        let out = c.mul(&out, &gate);
        c.matmul(m.wo, &out)
    }

    /// Routed experts plus the gated shared expert (llama.cpp's `build_layer_ffn`) on the normed `x`, then
    /// the residual add and the next norm (`after`): `(sum, normed)`.
    fn ffn_add_rms_norm<C: Compute>(
        &self,
        c: &mut C,
        (il, b): (usize, &Block),
        x: &C::Act,
        after: NormAfter<'_, C::Act>,
    ) -> (C::Act, C::Act) {
        let s = &b.shexp;
        let shared = SharedExpert {
            gate: s.gate,
            up: s.up,
            down: s.down,
            gate_inp: Some(s.gate_inp),
            act: Unary::Silu,
        };
        c.moe_add_rms_norm(il, x, (&b.moe, Some(&shared)), after)
    }
}

impl Forward for Qwen35MoeGraph {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// One state per trunk block (the MTP block is not run, so it has none).
    fn layer_states(&self) -> Vec<StateSpec> {
        let hp = &self.hp;
        let (n_k, n_v, head) = self.delta_dims();
        self.blocks
            .iter()
            .map(|b| match b.mixer {
                Mixer::DeltaNet(_) => StateSpec::Recurrent {
                    conv_kernel: hp.ssm_conv_kernel as usize,
                    conv_channels: 2 * n_k * head + n_v * head,
                    n_v_heads: n_v,
                    head_k: head,
                    head_v: head,
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

    /// The first MTP block, when it is a full-attention block (llama.cpp runs only one, and only so).
    fn draft_block_state(&self) -> Option<StateSpec> {
        let nb = self.nextn.first()?;
        matches!(nb.block.mixer, Mixer::Attention(_)).then_some(StateSpec::Kv {
            n_head_kv: self.hp.n_head_kv as usize,
            head_dim_k: self.hp.head_dim as usize,
            head_dim_v: self.hp.head_dim as usize,
            window: None,
        })
    }

    /// llama.cpp's `graph_mtp`: the token (its embedding from the block's own table, else the model's)
    /// and the trunk's post-norm hidden row of the position before, each RMS-normed (`enorm`, `hnorm`),
    /// concatenated in that order and projected by `eh_proj`; then a gated full-attention block with its
    /// own KV cache at the token's position and the routed plus shared experts; then the block's final
    /// norm (else `output_norm`) and its head (else `output`).
    fn forward_draft_block<C: Compute>(&self, c: &mut C, hidden: &[f32]) -> C::Act {
        let (n_embd, eps) = (self.hp.n_embd as usize, self.hp.rms_eps);
        let nb = &self.nextn[0];
        let Mixer::Attention(m) = &nb.block.mixer else {
            unreachable!("draft_block_state refuses a recurrent MTP block")
        };
        let (tokens, out_rows) = {
            let b = c.batch();
            (b.tokens.to_vec(), b.output_rows())
        };
        let e = c.embed(nb.embed_tokens.unwrap_or(self.tok_embd), &tokens);
        let e = c.rms_norm(&e, Some(nb.enorm), eps, n_embd);
        let h = c.input(hidden, n_embd);
        let h = c.rms_norm(&h, Some(nb.hnorm), eps, n_embd);
        let eh = c.concat_cols(&e, &h);
        let inp = c.matmul(nb.eh_proj, &eh);
        let cur = c.rms_norm(&inp, Some(nb.block.attn_norm), eps, n_embd);
        // Layer 0: the draft block's state has this one layer.
        let mixed = self.attention(c, 0, m, &cur);
        let (ffn_residual, ffn_in) =
            c.add_rms_norm(&mixed, &inp, Some(nb.block.post_attn_norm), eps, n_embd);
        // The MoE's layer is the file's block number (what route counts and expert caches key on).
        let after = NormAfter {
            residual: &ffn_residual,
            weight: Some(nb.head_norm.unwrap_or(self.output_norm)),
            eps,
            group: n_embd,
        };
        let block = (self.blocks.len(), &nb.block);
        let (_, mut cur) = self.ffn_add_rms_norm(c, block, &ffn_in, after);
        if out_rows.len() < tokens.len() {
            cur = c.rows(&cur, &out_rows);
        }
        c.matmul(nb.head.unwrap_or(self.output), &cur)
    }

    fn multi_section_rope(&self) -> Option<[u32; 4]> {
        self.rope_sections
    }

    fn forward<C: Compute>(&self, c: &mut C) -> C::Act {
        let (n_embd, eps) = (self.hp.n_embd as usize, self.hp.rms_eps);
        let (tokens, out_rows) = {
            let b = c.batch();
            (b.tokens.to_vec(), b.output_rows())
        };

        let mut inp = c.embed(self.tok_embd, &tokens);
        // The normed input of the next block (or of the output): each block's closing residual add comes
        // with it (`add_rms_norm`), so only the first block's norm stands alone.
        let mut cur = c.rms_norm(&inp, Some(self.blocks[0].attn_norm), eps, n_embd);
        for (il, b) in self.blocks.iter().enumerate() {
            let mixed = match &b.mixer {
                Mixer::DeltaNet(m) => self.delta_net(c, il, m, &cur),
                Mixer::Attention(m) => self.attention(c, il, m, &cur),
            };
            // Every row goes through the last block too: llama.cpp keeps them all (its MTP head reads the
            // final hidden states; `embeddings_nextn_masked` is off) and picks the wanted rows only after
            // the output norm, and a batch of one row would sum some products in other orders.
            // The post-attention norm is the FFN's input norm.
            let (ffn_residual, ffn_in) =
                c.add_rms_norm(&mixed, &inp, Some(b.post_attn_norm), eps, n_embd);
            let next_norm = match self.blocks.get(il + 1) {
                Some(next) => next.attn_norm,
                None => self.output_norm,
            };
            let after = NormAfter {
                residual: &ffn_residual,
                weight: Some(next_norm),
                eps,
                group: n_embd,
            };
            (inp, cur) = self.ffn_add_rms_norm(c, (il, b), &ffn_in, after);
        }
        // The post-norm hidden rows feed both the LM head and the draft block's next call (llama.cpp's
        // `h_nextn`, taken before the rows are picked).
        c.keep_hidden(&cur);
        if out_rows.len() < tokens.len() {
            cur = c.rows(&cur, &out_rows);
        }
        c.matmul(self.output, &cur)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imrope_sections_of_released_models_rotate_every_text_pair() {
        // Qwen3.5/3.6 (64 rotated dims) and the tiny fixtures (16).
        assert!(imrope_text_is_neox([11, 11, 10, 0], 32));
        assert!(imrope_text_is_neox([3, 3, 2, 0], 8));
        // Sector 7 of [4, 2, 2, 0] is 7 mod 3 = 1 but not below 3·2: it reads the fourth section.
        assert!(!imrope_text_is_neox([4, 2, 2, 0], 8));
        // A fourth section of its own always reads position 0.
        assert!(!imrope_text_is_neox([2, 2, 2, 2], 8));
        // Sections that do not sum to the pairs: pair i reads sector i mod 6, and sectors 0..6 of
        // [2, 2, 2, 0] are all text sections, so every pair of 8 is rotated (pairs 6, 7 as sectors 0, 1).
        assert!(imrope_text_is_neox([2, 2, 2, 0], 8));
        // [1, 1, 1, 0]: pairs take i mod 3, so the sectors stay 0..2, each below 3 times its section.
        assert!(imrope_text_is_neox([1, 1, 1, 0], 8));
        assert!(!imrope_text_is_neox([0, 0, 0, 0], 8));
    }

    /// The tiny shape's metadata with other `rope.dimension_sections`.
    fn tiny_with_sections(sections: [i32; 4]) -> Metadata {
        let crate::arch::ModelHparams::Qwen35Moe(h) =
            crate::synth::shapes::find_shape(ARCH, "tiny")
                .expect("tiny")
                .hparams
        else {
            unreachable!("a qwen35moe shape")
        };
        let mut m = Metadata::new("test");
        assert!(m.insert_new("general.architecture".into(), Value::String(ARCH.into())));
        for (k, v) in h.to_metadata() {
            let v = if k.ends_with("rope.dimension_sections") {
                Value::i32_array(sections)
            } else {
                v
            };
            assert!(m.insert_new(k, v));
        }
        assert!(m.insert_new(format!("{ARCH}.vocab_size"), Value::U32(h.n_vocab as u32)));
        m
    }

    #[test]
    fn sections_that_do_not_sum_to_the_rotated_pairs_load_as_in_llama_cpp() {
        // The tiny shape rotates 16 dimensions (8 pairs); [2, 2, 2, 0] sums to 6, which llama.cpp runs
        // (pair i in section i mod 6) and which used to be refused ("must sum to ...").
        let hp = Qwen35MoeHparams::from_metadata(&tiny_with_sections([2, 2, 2, 0])).expect("loads");
        assert_eq!(hp.rope_sections, [2, 2, 2, 0]);
        assert!(imrope_text_is_neox(hp.rope_sections, hp.rope_dim / 2));
        // What ggml cannot run is still refused with the reason: a sum of 0 (a division by zero) and a
        // sum above the head size (its GGML_ASSERT).
        for bad in [[0, 0, 0, 0], [40, 40, 0, 0]] {
            let e = Qwen35MoeHparams::from_metadata(&tiny_with_sections(bad)).expect_err("refused");
            assert!(e.0.contains("at most key_length"), "{e}");
        }
    }
}
