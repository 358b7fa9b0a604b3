//! Gemma 3 text models (`gemma3`: Gemma-3-270M, 1B, 4B, 12B, 27B).
//!
//! Embeddings scaled by `sqrt(n_embd)`; blocks of grouped-query attention (RMS-normed Q/K, RoPE, Q scaled by
//! `1/sqrt(head_dim)`, sliding-window on five of every six blocks with their own RoPE base) and a GELU-gated
//! FFN, each with a pre-norm and a post-norm before the residual add. Output tied to the embedding unless
//! `output.weight` exists; optional final logit soft-capping. Norm weights are stored with Gemma's `+1`
//! already added (the converter does it), so they multiply as they are.
//!
//! Follows llama.cpp's `src/models/gemma3.cpp` (hyperparameters, tensors, graph); [`Gemma3Graph`] is the
//! forward pass.

use super::common::{rope_freq_scale, soft_cap, whole_head_common, CommonHparams};
use super::graph::{Forward, ModelInfo, StateSpec, TensorMap};
use super::{
    arch_kv, check, def, ArchError, ArchHparams, Dim, LayerKind, LayerSel, Presence, Role,
    TensorClass, TensorDef,
};
use crate::compute::{Attention, Compute, Rope, RopeKind, Unary, WeightId};
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
        let c = CommonHparams::read(md, ARCH)?;
        let head_dim = c.head_dim(ARCH)?;
        if md
            .arch_bool_array_opt("attention.sliding_window_pattern")
            .is_ok_and(|v| v.is_some())
        {
            return Err(ArchError(format!(
                "{ARCH}: a per-layer attention.sliding_window_pattern array is not supported"
            )));
        }
        let hp = Gemma3Hparams {
            n_vocab: c.n_vocab,
            n_ctx_train: c.n_ctx_train,
            n_embd: c.n_embd,
            n_layer: c.n_layer_all,
            n_ff: c.n_ff(md)?,
            n_head: c.n_head,
            n_head_kv: c.n_head_kv,
            head_dim,
            rms_eps: c.rms_eps,
            rope_freq_base: c.rope_freq_base,
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

    fn common(&self) -> CommonHparams {
        whole_head_common!(self)
    }

    fn validate(&self) -> Result<(), ArchError> {
        self.common().validate(ARCH)?;
        check(ARCH, self.n_ff > 0, "feed_forward_length is 0")?;
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

/// The weights of one `gemma3` block.
#[derive(Clone, Debug)]
struct Block {
    attn_norm: WeightId,
    wq: WeightId,
    wk: WeightId,
    wv: WeightId,
    wo: WeightId,
    q_norm: WeightId,
    k_norm: WeightId,
    attn_post_norm: WeightId,
    ffn_norm: WeightId,
    ffn_gate: WeightId,
    ffn_up: WeightId,
    ffn_down: WeightId,
    ffn_post_norm: WeightId,
}

/// The forward pass of a `gemma3` model (llama.cpp's `llama_model_gemma3::graph`).
#[derive(Clone, Debug)]
pub struct Gemma3Graph {
    hp: Gemma3Hparams,
    info: ModelInfo,
    tok_embd: WeightId,
    output_norm: WeightId,
    /// `output.weight`, or the token embedding when the file ties them.
    output: WeightId,
    blocks: Vec<Block>,
    /// RoPE of global blocks: `rope.freq_base`, linear scaling from `rope.scaling.factor`.
    rope_global: Rope,
    /// RoPE of sliding-window blocks: `rope.freq_base_swa`, never scaled (llama.cpp reads no scaling for
    /// them: `rope_freq_scale_train_swa` stays 1).
    rope_swa: Rope,
    /// Multiplies Q before attention (llama.cpp's `f_attention_scale`); the scores are not scaled again.
    q_scale: f32,
}

impl Gemma3Graph {
    /// Builds the forward pass from bound tensors.
    pub fn new(hp: Gemma3Hparams, t: &TensorMap, md: &Metadata) -> Result<Gemma3Graph, ArchError> {
        let tok_embd = t.global_req(Role::TokenEmbd)?;
        let blocks = (0..hp.n_layer)
            .map(|il| {
                Ok(Block {
                    attn_norm: t.layer(Role::AttnNorm, il)?,
                    wq: t.layer(Role::AttnQ, il)?,
                    wk: t.layer(Role::AttnK, il)?,
                    wv: t.layer(Role::AttnV, il)?,
                    wo: t.layer(Role::AttnOut, il)?,
                    q_norm: t.layer(Role::AttnQNorm, il)?,
                    k_norm: t.layer(Role::AttnKNorm, il)?,
                    attn_post_norm: t.layer(Role::AttnPostNorm, il)?,
                    ffn_norm: t.layer(Role::FfnNorm, il)?,
                    ffn_gate: t.layer(Role::FfnGate, il)?,
                    ffn_up: t.layer(Role::FfnUp, il)?,
                    ffn_down: t.layer(Role::FfnDown, il)?,
                    ffn_post_norm: t.layer(Role::FfnPostNorm, il)?,
                })
            })
            .collect::<Result<Vec<_>, ArchError>>()?;
        let head_dim = hp.head_dim as usize;
        let rope_global = Rope {
            kind: RopeKind::Neox,
            head_dim,
            n_rot: head_dim,
            freq_base: hp.rope_freq_base,
            freq_scale: rope_freq_scale(md, ARCH)?,
            freq_factors: None,
            sections: None,
        };
        let rope_swa = Rope {
            freq_base: hp.rope_freq_base_swa,
            freq_scale: 1.0,
            ..rope_global
        };
        let info = ModelInfo::new(
            ARCH,
            hp.n_vocab as usize,
            hp.n_embd as usize,
            hp.n_ctx_train,
            md,
        )?;
        Ok(Gemma3Graph {
            tok_embd,
            output_norm: t.global_req(Role::OutputNorm)?,
            output: t.global(Role::Output).unwrap_or(tok_embd),
            blocks,
            rope_global,
            rope_swa,
            q_scale: query_scale(&hp),
            info,
            hp,
        })
    }

    /// The hyperparameters.
    pub fn hparams(&self) -> &Gemma3Hparams {
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

    /// The factor Q is multiplied by before attention.
    pub fn query_scale(&self) -> f32 {
        self.q_scale
    }
}

/// llama.cpp's `f_attention_scale` for Gemma 3: `1/sqrt(head_dim)`, except that the 27B model (the one of
/// 62 blocks, whose `query_pre_attn_scalar` is `n_embd / n_head`) uses `1/sqrt(n_embd / n_head)`.
fn query_scale(hp: &Gemma3Hparams) -> f32 {
    const N_LAYER_27B: u32 = 62;
    let d = if hp.n_layer == N_LAYER_27B {
        hp.n_embd / hp.n_head
    } else {
        hp.head_dim
    };
    1.0 / (d as f32).sqrt()
}

impl Forward for Gemma3Graph {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_states(&self) -> Vec<StateSpec> {
        (0..self.hp.n_layer)
            .map(|il| StateSpec::Kv {
                n_head_kv: self.hp.n_head_kv as usize,
                head_dim_k: self.hp.head_dim as usize,
                head_dim_v: self.hp.head_dim as usize,
                window: self.window(il),
            })
            .collect()
    }

    fn forward<C: Compute>(&self, c: &mut C) -> C::Act {
        let hp = &self.hp;
        let (n_embd, head_dim) = (hp.n_embd as usize, hp.head_dim as usize);
        let eps = hp.rms_eps;
        let (tokens, out_rows) = {
            let b = c.batch();
            (b.tokens.to_vec(), b.output_rows())
        };
        let last = self.blocks.len() - 1;

        let inp = c.embed(self.tok_embd, &tokens);
        let mut inp = c.scale(&inp, (n_embd as f32).sqrt());
        // The normed input of the next block (or of the output): each block's closing residual add comes
        // with it (`add_rms_norm`), so only the first block's norm stands alone.
        let mut cur = c.rms_norm(&inp, Some(self.blocks[0].attn_norm), eps, n_embd);
        for (il, b) in self.blocks.iter().enumerate() {
            let rope = self.rope(il as u32);
            let attn = Attention {
                n_head: hp.n_head as usize,
                n_head_kv: hp.n_head_kv as usize,
                head_dim_k: head_dim,
                head_dim_v: head_dim,
                // Q carries the scale (below), as in llama.cpp, whose kq_scale for Gemma 3 is 1.
                scale: 1.0,
                window: self.window(il as u32),
                softcap: None,
                picture_rows_see_each_other: false,
            };

            // Self-attention: per-head RMS-normed Q and K, NeoX RoPE over the whole head, Q scaled.
            let [q, k, v] = c.matmul_many([b.wq, b.wk, b.wv], &cur);
            let norms = [Some(b.q_norm), Some(b.k_norm)];
            let [q, k] = c.rms_norm_rope_pair([&q, &k], norms, eps, rope);
            let q = c.scale(&q, self.q_scale);
            let att = c.attention(il, &q, &k, &v, &attn);
            let mut att_out = c.matmul(b.wo, &att);

            // After the last block's attention only the rows whose logits are wanted go on.
            if il == last && out_rows.len() < tokens.len() {
                att_out = c.rows(&att_out, &out_rows);
                inp = c.rows(&inp, &out_rows);
            }
            let att_out = c.rms_norm(&att_out, Some(b.attn_post_norm), eps, n_embd);
            let (sa_out, ffn_in) = c.add_rms_norm(&att_out, &inp, Some(b.ffn_norm), eps, n_embd);

            // Feed-forward: GELU(gate)·up, down, then its post-norm.
            let [gate, up] = c.matmul_many([b.ffn_gate, b.ffn_up], &ffn_in);
            let ffn_out = c.glu(&gate, &up, Unary::Gelu);
            let ffn_out = c.matmul(b.ffn_down, &ffn_out);
            let ffn_out = c.rms_norm(&ffn_out, Some(b.ffn_post_norm), eps, n_embd);
            let next_norm = match self.blocks.get(il + 1) {
                Some(next) => next.attn_norm,
                None => self.output_norm,
            };
            (inp, cur) = c.add_rms_norm(&ffn_out, &sa_out, Some(next_norm), eps, n_embd);
        }
        let logits = c.matmul(self.output, &cur);
        soft_cap(c, logits, hp.final_logit_softcapping)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::ModelHparams;
    use crate::synth::shapes::find_shape;

    fn hparams(shape: &str) -> Gemma3Hparams {
        match find_shape(ARCH, shape).expect("shape").hparams {
            ModelHparams::Gemma3(h) => h,
            _ => unreachable!("a gemma3 shape"),
        }
    }

    #[test]
    fn query_scale_is_head_size_except_for_the_27b() {
        let h = hparams("gemma3-270m");
        assert_eq!(query_scale(&h), 1.0 / 16.0);
        // Gemma-3-27B: 62 blocks, 5376 wide, 32 heads of 128; query_pre_attn_scalar = 5376 / 32 = 168.
        let big = Gemma3Hparams {
            n_layer: 62,
            n_embd: 5376,
            n_head: 32,
            n_head_kv: 16,
            head_dim: 128,
            ..h
        };
        assert_eq!(query_scale(&big), 1.0 / 168f32.sqrt());
    }
}
