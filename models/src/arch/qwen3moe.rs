//! Qwen3 MoE (`qwen3moe`: Qwen3-30B-A3B, Qwen3-235B-A22B): pre-norm blocks of grouped-query attention with
//! per-head RMS-normed Q and K (RoPE over the whole head), then a mixture of experts (softmax router, top-k,
//! weights renormalized, SwiGLU experts). No shared expert, untied output.
//!
//! Follows llama.cpp's `src/models/qwen3moe.cpp` (hyperparameters, tensors, graph); [`Qwen3MoeGraph`] is the
//! forward pass.

use super::common::{rope_freq_scale, whole_head_common, CommonHparams, ExpertHparams};
use super::graph::{Forward, ModelInfo, StateSpec, TensorMap};
use super::{
    arch_kv, check, def, ArchError, ArchHparams, Dim, LayerKind, LayerSel, Presence, Role,
    TensorClass, TensorDef,
};
use crate::compute::{Attention, Compute, Gating, Moe, NormAfter, Rope, RopeKind, Unary, WeightId};
use crate::gguf::{Metadata, Value};

/// `general.architecture`.
pub const ARCH: &str = "qwen3moe";

/// Hyperparameters of a `qwen3moe` model.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3MoeHparams {
    /// Vocabulary size (length of `tokenizer.ggml.tokens`).
    pub n_vocab: u64,
    /// `context_length`.
    pub n_ctx_train: u32,
    /// `embedding_length`.
    pub n_embd: u32,
    /// `block_count`.
    pub n_layer: u32,
    /// `feed_forward_length` (the dense width of the original config; unused by MoE blocks, 0 if absent).
    pub n_ff: u32,
    /// `attention.head_count`.
    pub n_head: u32,
    /// `attention.head_count_kv`.
    pub n_head_kv: u32,
    /// `attention.key_length` (= `value_length` = rotary dimension).
    pub head_dim: u32,
    /// `expert_count`.
    pub n_expert: u32,
    /// `expert_used_count`.
    pub n_expert_used: u32,
    /// `expert_feed_forward_length`.
    pub n_ff_exp: u32,
    /// `rope.freq_base`.
    pub rope_freq_base: f32,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
}

use Dim::*;
use TensorClass as C;

const L: Option<LayerSel> = Some(LayerSel::All);

/// The tensors of a `qwen3moe` file.
pub const TENSORS: &[TensorDef] = &[
    def(Role::TokenEmbd, None, &[Embd, Vocab], C::Embedding), // [n_embd, n_vocab]
    def(Role::OutputNorm, None, &[Embd], C::Norm),            // [n_embd]
    TensorDef {
        presence: Presence::Optional, // tied to token_embd when absent
        ..def(Role::Output, None, &[Embd, Vocab], C::Output)  // [n_embd, n_vocab]
    },
    def(Role::AttnNorm, L, &[Embd], C::Norm), // [n_embd]
    def(Role::AttnQ, L, &[Embd, QProj], C::Attention), // [n_embd, n_head * head_dim]
    def(Role::AttnK, L, &[Embd, KProj], C::Attention), // [n_embd, n_head_kv * head_dim]
    def(Role::AttnV, L, &[Embd, VProj], C::Attention), // [n_embd, n_head_kv * head_dim]
    def(Role::AttnOut, L, &[QProj, Embd], C::Attention), // [n_head * head_dim, n_embd]
    def(Role::AttnKNorm, L, &[HeadK], C::Norm), // [head_dim]
    def(Role::AttnQNorm, L, &[HeadK], C::Norm), // [head_dim]
    def(Role::FfnNorm, L, &[Embd], C::Norm),  // [n_embd]
    def(Role::FfnGateInp, L, &[Embd, Expert], C::Router), // [n_embd, n_expert]
    def(Role::FfnGateExps, L, &[Embd, FfExp, Expert], C::Expert), // [n_embd, n_ff_exp, n_expert]
    def(Role::FfnDownExps, L, &[FfExp, Embd, Expert], C::Expert), // [n_ff_exp, n_embd, n_expert]
    def(Role::FfnUpExps, L, &[Embd, FfExp, Expert], C::Expert), // [n_embd, n_ff_exp, n_expert]
];

impl Qwen3MoeHparams {
    /// Reads the hyperparameters from a file's metadata (the keys llama.cpp's loader reads).
    pub fn from_metadata(md: &Metadata) -> Result<Self, ArchError> {
        let c = CommonHparams::read(md, ARCH)?;
        let n_ff = c.n_ff_opt(md)?;
        let e = ExpertHparams::read(md, ARCH, &c, n_ff)?;
        let hp = Qwen3MoeHparams {
            n_vocab: c.n_vocab,
            n_ctx_train: c.n_ctx_train,
            n_embd: c.n_embd,
            n_layer: c.n_layer_all,
            n_ff,
            n_head: c.n_head,
            n_head_kv: c.n_head_kv,
            head_dim: c.head_dim(ARCH)?,
            n_expert: e.n_expert,
            n_expert_used: e.n_expert_used,
            n_ff_exp: e.n_ff_exp,
            rope_freq_base: c.rope_freq_base,
            rms_eps: c.rms_eps,
        };
        hp.validate()?;
        Ok(hp)
    }
}

impl ArchHparams for Qwen3MoeHparams {
    fn arch_name(&self) -> &'static str {
        ARCH
    }

    fn tensor_defs(&self) -> &'static [TensorDef] {
        TENSORS
    }

    fn n_layer_all(&self) -> u32 {
        self.n_layer
    }

    fn layer_kind(&self, _il: u32) -> LayerKind {
        LayerKind::Attention
    }

    fn dim(&self, d: Dim) -> Option<u64> {
        let v = match d {
            Embd => self.n_embd as u64,
            Vocab => self.n_vocab,
            FfExp => self.n_ff_exp as u64,
            Expert => self.n_expert as u64,
            HeadK => self.head_dim as u64,
            QProj => (self.n_head * self.head_dim) as u64,
            KProj | VProj => (self.n_head_kv * self.head_dim) as u64,
            _ => return None,
        };
        Some(v)
    }

    fn n_expert_used(&self) -> u32 {
        self.n_expert_used
    }

    fn synth_writes(&self, role: Role) -> bool {
        role == Role::Output
    }

    fn to_metadata(&self) -> Vec<(String, Value)> {
        let mut kv = vec![
            arch_kv(ARCH, "block_count", self.n_layer),
            arch_kv(ARCH, "context_length", self.n_ctx_train),
            arch_kv(ARCH, "embedding_length", self.n_embd),
        ];
        if self.n_ff > 0 {
            kv.push(arch_kv(ARCH, "feed_forward_length", self.n_ff));
        }
        kv.extend([
            arch_kv(ARCH, "attention.head_count", self.n_head),
            arch_kv(ARCH, "attention.head_count_kv", self.n_head_kv),
            arch_kv(ARCH, "rope.freq_base", self.rope_freq_base),
            arch_kv(ARCH, "attention.layer_norm_rms_epsilon", self.rms_eps),
            arch_kv(ARCH, "expert_used_count", self.n_expert_used),
            arch_kv(ARCH, "attention.key_length", self.head_dim),
            arch_kv(ARCH, "attention.value_length", self.head_dim),
            arch_kv(ARCH, "expert_count", self.n_expert),
            arch_kv(ARCH, "expert_feed_forward_length", self.n_ff_exp),
        ]);
        kv
    }

    fn common(&self) -> CommonHparams {
        whole_head_common!(self)
    }

    fn validate(&self) -> Result<(), ArchError> {
        self.common().validate(ARCH)?;
        check(
            ARCH,
            self.head_dim > 0 && self.head_dim.is_multiple_of(2),
            "key_length must be even (RoPE)",
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
        check(ARCH, self.n_ff_exp > 0, "expert_feed_forward_length is 0")?;
        check(
            ARCH,
            self.rms_eps > 0.0,
            "layer_norm_rms_epsilon must be positive",
        )?;
        Ok(())
    }
}

/// The weights of one `qwen3moe` block.
#[derive(Clone, Debug)]
struct Block {
    attn_norm: WeightId,
    wq: WeightId,
    wk: WeightId,
    wv: WeightId,
    wo: WeightId,
    q_norm: WeightId,
    k_norm: WeightId,
    ffn_norm: WeightId,
    moe: Moe,
}

/// The forward pass of a `qwen3moe` model (llama.cpp's `llama_model_qwen3moe::graph`).
#[derive(Clone, Debug)]
pub struct Qwen3MoeGraph {
    hp: Qwen3MoeHparams,
    info: ModelInfo,
    tok_embd: WeightId,
    output_norm: WeightId,
    /// `output.weight`, or the token embedding when the file ties them.
    output: WeightId,
    blocks: Vec<Block>,
    /// The RoPE position scale ([`rope_freq_scale`]).
    rope_freq_scale: f32,
}

impl Qwen3MoeGraph {
    /// Builds the forward pass from bound tensors.
    pub fn new(
        hp: Qwen3MoeHparams,
        t: &TensorMap,
        md: &Metadata,
    ) -> Result<Qwen3MoeGraph, ArchError> {
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
                    ffn_norm: t.layer(Role::FfnNorm, il)?,
                    moe: Moe {
                        router: t.layer(Role::FfnGateInp, il)?,
                        gate_exps: t.layer(Role::FfnGateExps, il)?,
                        up_exps: t.layer(Role::FfnUpExps, il)?,
                        down_exps: t.layer(Role::FfnDownExps, il)?,
                        n_expert: hp.n_expert as usize,
                        n_expert_used: hp.n_expert_used as usize,
                        gating: Gating::Softmax,
                        selection_bias: None,
                        // llama.cpp passes norm_w = true for qwen3moe whatever the file says.
                        norm_weights: true,
                        weights_scale: 1.0,
                        act: Unary::Silu,
                    },
                })
            })
            .collect::<Result<Vec<_>, ArchError>>()?;
        let info = ModelInfo::new(
            ARCH,
            hp.n_vocab as usize,
            hp.n_embd as usize,
            hp.n_ctx_train,
            md,
        )?;
        Ok(Qwen3MoeGraph {
            rope_freq_scale: rope_freq_scale(md, ARCH)?,
            tok_embd,
            output_norm: t.global_req(Role::OutputNorm)?,
            output: t.global(Role::Output).unwrap_or(tok_embd),
            blocks,
            info,
            hp,
        })
    }

    /// The hyperparameters.
    pub fn hparams(&self) -> &Qwen3MoeHparams {
        &self.hp
    }
}

impl Forward for Qwen3MoeGraph {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_states(&self) -> Vec<StateSpec> {
        let kv = StateSpec::Kv {
            n_head_kv: self.hp.n_head_kv as usize,
            head_dim_k: self.hp.head_dim as usize,
            head_dim_v: self.hp.head_dim as usize,
            window: None,
        };
        vec![kv; self.blocks.len()]
    }

    fn forward<C: Compute>(&self, c: &mut C) -> C::Act {
        let hp = &self.hp;
        let (n_embd, head_dim) = (hp.n_embd as usize, hp.head_dim as usize);
        let eps = hp.rms_eps;
        let rope = Rope {
            kind: RopeKind::Neox,
            head_dim,
            n_rot: head_dim,
            freq_base: hp.rope_freq_base,
            freq_scale: self.rope_freq_scale,
            freq_factors: None,
            sections: None,
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
            // Self-attention: per-head RMS-normed Q and K, NeoX RoPE over the whole head.
            let [q, k, v] = c.matmul_many([b.wq, b.wk, b.wv], &cur);
            let norms = [Some(b.q_norm), Some(b.k_norm)];
            let [q, k] = c.rms_norm_rope_pair([&q, &k], norms, eps, &rope);
            let att = c.attention(il, &q, &k, &v, &attn);
            let mut att_out = c.matmul(b.wo, &att);

            // After the last block's attention only the rows whose logits are wanted go on.
            if il == last && out_rows.len() < tokens.len() {
                att_out = c.rows(&att_out, &out_rows);
                inp = c.rows(&inp, &out_rows);
            }

            // Mixture of experts on the normed residual.
            let (ffn_inp, ffn_in) = c.add_rms_norm(&att_out, &inp, Some(b.ffn_norm), eps, n_embd);
            let next_norm = match self.blocks.get(il + 1) {
                Some(next) => next.attn_norm,
                None => self.output_norm,
            };
            let after = NormAfter {
                residual: &ffn_inp,
                weight: Some(next_norm),
                eps,
                group: n_embd,
            };
            (inp, cur) = c.moe_add_rms_norm(il, &ffn_in, (&b.moe, None), after);
        }
        c.matmul(self.output, &cur)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::bind_tensors;
    use crate::gguf::GgufFile;

    /// The tiny fixture's graph, built with its metadata plus `extra` (`qwen3moe.*` keys).
    fn graph_with(extra: &[(&str, Value)]) -> Result<Qwen3MoeGraph, ArchError> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/models/qwen3moe-tiny-q4km.gguf"
        );
        let file = GgufFile::open(path).expect("fixture");
        let mut md = file.metadata().clone();
        for (k, v) in extra {
            assert!(md.insert_new(format!("{ARCH}.{k}"), v.clone()));
        }
        let hp = Qwen3MoeHparams::from_metadata(&md)?;
        let tensors = bind_tensors(&hp, &file)?;
        Qwen3MoeGraph::new(hp, &tensors, &md)
    }

    /// llama.cpp scales every architecture's RoPE positions by the file's linear `rope.scaling.factor`;
    /// this file once ran them unscaled. A scaling the op cannot express is refused with the reason.
    #[test]
    fn rope_scaling_is_read_as_llama_cpp_reads_it() {
        assert_eq!(graph_with(&[]).expect("builds").rope_freq_scale, 1.0);
        let linear = graph_with(&[
            ("rope.scaling.type", Value::String("linear".into())),
            ("rope.scaling.factor", Value::F32(4.0)),
        ])
        .expect("builds");
        assert_eq!(linear.rope_freq_scale, 0.25);
        let yarn = graph_with(&[
            ("rope.scaling.type", Value::String("yarn".into())),
            ("rope.scaling.factor", Value::F32(4.0)),
        ]);
        let e = yarn.expect_err("refused");
        assert!(e.0.contains("qwen3moe") && e.0.contains("yarn"), "{e}");
    }
}
