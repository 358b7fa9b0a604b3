//! Gemma 3 text models (`gemma3`: Gemma-3-270M, 1B, 4B, 12B, 27B).
//!
//! Embeddings scaled by `sqrt(n_embd)`; blocks of grouped-query attention (RMS-normed Q/K, RoPE, Q scaled by
//! `1/sqrt(head_dim)`, sliding-window on five of every six blocks with their own RoPE base) and a GELU-gated
//! FFN, each with a pre-norm and a post-norm before the residual add. Output tied to the embedding unless
//! `output.weight` exists; optional final logit soft-capping. Norm weights are stored with Gemma's `+1`
//! already added (the converter does it), so they multiply as they are.
//!
//! Follows llama.cpp's `src/models/gemma3.cpp`.

use super::{
    arch_kv, check, uniform_u32, uniform_u32_req, vocab_size, ArchError, ArchHparams, Dim,
    LayerKind, LayerSel, Presence, Role, TensorClass, TensorDef,
};
use crate::gguf::{Metadata, Value};

/// `general.architecture`.
pub const ARCH: &str = "gemma3";

/// llama.cpp's default sliding-window pattern for Gemma 3: five sliding blocks, then one global.
pub const DEFAULT_SWA_PATTERN: u32 = 6;

/// llama.cpp's default RoPE base of sliding-window blocks.
pub const DEFAULT_ROPE_FREQ_BASE_SWA: f32 = 10000.0;

/// Hyperparameters of a `gemma3` model.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Hparams {
    /// Vocabulary size (length of `tokenizer.ggml.tokens`).
    pub n_vocab: u64,
    /// `context_length`.
    pub n_ctx_train: u32,
    /// `embedding_length`.
    pub n_embd: u32,
    /// `block_count`.
    pub n_layer: u32,
    /// `feed_forward_length`.
    pub n_ff: u32,
    /// `attention.head_count`.
    pub n_head: u32,
    /// `attention.head_count_kv`.
    pub n_head_kv: u32,
    /// `attention.key_length` (= `value_length`).
    pub head_dim: u32,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// `rope.freq_base` (global blocks).
    pub rope_freq_base: f32,
    /// `rope.freq_base_swa` (sliding-window blocks).
    pub rope_freq_base_swa: f32,
    /// `attention.sliding_window`; 0 = no sliding window (every block global).
    pub sliding_window: u32,
    /// `attention.sliding_window_pattern`: block `i` slides when `i % pattern < pattern - 1`.
    pub swa_pattern: u32,
    /// `final_logit_softcapping`, when set.
    pub final_logit_softcapping: Option<f32>,
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

const L: Option<LayerSel> = Some(LayerSel::All);

/// The tensors of a `gemma3` file.
pub const TENSORS: &[TensorDef] = &[
    def(Role::TokenEmbd, None, &[Embd, Vocab], C::Embedding), // [n_embd, n_vocab]
    def(Role::OutputNorm, None, &[Embd], C::Norm),            // [n_embd]
    TensorDef {
        presence: Presence::Optional, // converted Gemma 3 files tie the output to token_embd
        ..def(Role::Output, None, &[Embd, Vocab], C::Output)  // [n_embd, n_vocab]
    },
    def(Role::AttnNorm, L, &[Embd], C::Norm), // [n_embd]
    def(Role::AttnQ, L, &[Embd, QProj], C::Attention), // [n_embd, n_head * head_dim]
    def(Role::AttnK, L, &[Embd, KProj], C::Attention), // [n_embd, n_head_kv * head_dim]
    def(Role::AttnV, L, &[Embd, VProj], C::Attention), // [n_embd, n_head_kv * head_dim]
    def(Role::AttnOut, L, &[QProj, Embd], C::Attention), // [n_head * head_dim, n_embd]
    def(Role::AttnPostNorm, L, &[Embd], C::Norm), // [n_embd]
    def(Role::AttnKNorm, L, &[HeadK], C::Norm), // [head_dim]
    def(Role::AttnQNorm, L, &[HeadK], C::Norm), // [head_dim]
    def(Role::FfnNorm, L, &[Embd], C::Norm),  // [n_embd]
    def(Role::FfnGate, L, &[Embd, Ff], C::Ffn), // [n_embd, n_ff]
    def(Role::FfnUp, L, &[Embd, Ff], C::Ffn), // [n_embd, n_ff]
    def(Role::FfnDown, L, &[Ff, Embd], C::Ffn), // [n_ff, n_embd]
    def(Role::FfnPostNorm, L, &[Embd], C::Norm), // [n_embd]
];

impl Gemma3Hparams {
    /// Whether block `il` uses sliding-window attention.
    pub fn is_swa(&self, il: u32) -> bool {
        self.sliding_window > 0
            && (self.swa_pattern == 0 || il % self.swa_pattern < self.swa_pattern - 1)
    }

    /// Reads the hyperparameters from a file's metadata (the keys llama.cpp's loader reads).
    pub fn from_metadata(md: &Metadata) -> Result<Self, ArchError> {
        let n_layer = md.arch_u32("block_count")?;
        let n_embd = md.arch_u32("embedding_length")?;
        let n_head = uniform_u32_req(md, "attention.head_count", n_layer)?;
        check(ARCH, n_head > 0, "attention.head_count is 0")?;
        let n_head_kv = uniform_u32(md, "attention.head_count_kv", n_layer)?.unwrap_or(n_head);
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
        if md
            .arch_bool_array_opt("attention.sliding_window_pattern")
            .is_ok_and(|v| v.is_some())
        {
            return Err(ArchError(format!(
                "{ARCH}: a per-layer attention.sliding_window_pattern array is not supported"
            )));
        }
        let hp = Gemma3Hparams {
            n_vocab: vocab_size(md)?,
            n_ctx_train: md.arch_u32("context_length")?,
            n_embd,
            n_layer,
            n_ff: uniform_u32_req(md, "feed_forward_length", n_layer)?,
            n_head,
            n_head_kv,
            head_dim,
            rms_eps: md.arch_f32("attention.layer_norm_rms_epsilon")?,
            rope_freq_base: md.arch_f32_opt("rope.freq_base")?.unwrap_or(10000.0),
            rope_freq_base_swa: md
                .arch_f32_opt("rope.freq_base_swa")?
                .unwrap_or(DEFAULT_ROPE_FREQ_BASE_SWA),
            sliding_window: md.arch_u32_opt("attention.sliding_window")?.unwrap_or(0),
            swa_pattern: md
                .arch_u32_opt("attention.sliding_window_pattern")?
                .unwrap_or(DEFAULT_SWA_PATTERN),
            final_logit_softcapping: md
                .arch_f32_opt("final_logit_softcapping")?
                .filter(|&c| c != 0.0),
        };
        hp.validate()?;
        Ok(hp)
    }
}

impl ArchHparams for Gemma3Hparams {
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

    fn dim(&self, d: Dim) -> Option<u64> {
        let v = match d {
            Embd => self.n_embd as u64,
            Vocab => self.n_vocab,
            Ff => self.n_ff as u64,
            HeadK => self.head_dim as u64,
            QProj => (self.n_head * self.head_dim) as u64,
            KProj | VProj => (self.n_head_kv * self.head_dim) as u64,
            _ => return None,
        };
        Some(v)
    }

    fn synth_writes(&self, _role: Role) -> bool {
        false
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
        ];
        if self.sliding_window > 0 {
            kv.push(arch_kv(
                ARCH,
                "attention.sliding_window",
                self.sliding_window,
            ));
            if self.swa_pattern != DEFAULT_SWA_PATTERN {
                kv.push(arch_kv(
                    ARCH,
                    "attention.sliding_window_pattern",
                    self.swa_pattern,
                ));
            }
            if self.rope_freq_base_swa != DEFAULT_ROPE_FREQ_BASE_SWA {
                kv.push(arch_kv(ARCH, "rope.freq_base_swa", self.rope_freq_base_swa));
            }
        }
        kv.push(arch_kv(ARCH, "attention.head_count_kv", self.n_head_kv));
        if let Some(c) = self.final_logit_softcapping {
            kv.push(arch_kv(ARCH, "final_logit_softcapping", c));
        }
        kv
    }

    fn validate(&self) -> Result<(), ArchError> {
        check(ARCH, self.n_layer > 0, "block_count is 0")?;
        check(
            ARCH,
            self.n_embd > 0 && self.n_vocab > 0,
            "embedding_length or vocabulary is 0",
        )?;
        check(ARCH, self.n_ff > 0, "feed_forward_length is 0")?;
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
            self.head_dim > 0 && self.head_dim.is_multiple_of(2),
            "key_length must be even (RoPE)",
        )?;
        check(
            ARCH,
            self.rms_eps > 0.0,
            "layer_norm_rms_epsilon must be positive",
        )?;
        Ok(())
    }
}
