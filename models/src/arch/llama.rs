//! Dense Llama-family models (`llama`: Llama 2/3, Mistral, SmolLM2 and the many files that say `llama`).
//!
//! Blocks of a pre-norm grouped-query attention (RoPE in ggml's "normal" mode, adjacent pairs, over the
//! whole head; scores scaled by `1/sqrt(head_dim)`) and a SiLU-gated FFN, each added to the residual
//! stream; a final RMS norm and the output matrix, which is the token embedding when the file has no
//! `output.weight` (SmolLM2, Llama 3.2 1B/3B).
//!
//! Llama 3.1+ files carry RoPE frequency factors (`rope_freqs.weight`, one per rotated pair, which divide
//! each pair's angle); some files carry biases on the attention and FFN projections. Both are optional
//! tensors, applied where llama.cpp applies them: the factors in both rotations, each bias right after its
//! matrix.
//!
//! Follows llama.cpp's `src/models/llama.cpp` (`load_arch_hparams`, `load_arch_tensors`, the graph) and
//! the common hyperparameters of `src/llama-model.cpp`. What llama.cpp accepts there and this file does
//! not compute yet is refused with the reason rather than run differently: routed experts (Mixtral-style
//! `llama` files), a fused `attn_qkv` projection (its file lacks `attn_q`, so it fails to bind) and
//! non-linear RoPE scaling (YaRN, LongRoPE).

use super::common::{rope_freq_scale, whole_head_common, CommonHparams};
use super::graph::{Forward, ModelInfo, StateSpec, TensorMap};
use super::{
    arch_kv, check, def, opt, ArchError, ArchHparams, Dim, LayerKind, LayerSel, Role, TensorClass,
    TensorDef,
};
use crate::compute::{Attention, Compute, Rope, RopeKind, Unary, WeightId};
use crate::gguf::{Metadata, Value};

/// `general.architecture`.
pub const ARCH: &str = "llama";

/// Hyperparameters of a dense `llama` model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaHparams {
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
    /// `attention.key_length` (= `value_length` = `rope.dimension_count`: llama.cpp's graph asserts both).
    pub head_dim: u32,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// `rope.freq_base`.
    pub rope_freq_base: f32,
    /// Whether the output is the token embedding (no `output.weight`). Not metadata: the tensors say it,
    /// so `from_metadata` leaves it false and only `synth` reads it (whether to write `output.weight`).
    pub tied_output: bool,
    /// Whether the file has `rope_freqs.weight` (Llama 3.1+). Like `tied_output`, only `synth` reads it.
    pub rope_freqs: bool,
    /// Whether the file has the projections' bias tensors. Like `tied_output`, only `synth` reads it.
    pub biases: bool,
}

use Dim::*;
use TensorClass as C;

const L: Option<LayerSel> = Some(LayerSel::All);

/// The tensors of a dense `llama` file (llama.cpp's `load_arch_tensors` with `n_expert == 0`).
pub const TENSORS: &[TensorDef] = &[
    def(Role::TokenEmbd, None, &[Embd, Vocab], C::Embedding), // [n_embd, n_vocab]
    def(Role::OutputNorm, None, &[Embd], C::Norm),            // [n_embd]
    // Absent: the output is the token embedding (TENSOR_DUPLICATED).
    opt(def(Role::Output, None, &[Embd, Vocab], C::Output)), // [n_embd, n_vocab]
    // Llama 3.1+ frequency factors, F32 (llama.cpp reads them as blk.0's and shares them with every
    // block; the file holds one).
    opt(def(Role::RopeFreqs, None, &[RopeHalf], C::Norm)), // [n_rot / 2]
    def(Role::AttnNorm, L, &[Embd], C::Norm),              // [n_embd]
    def(Role::AttnQ, L, &[Embd, QProj], C::Attention),     // [n_embd, n_head * head_dim]
    def(Role::AttnK, L, &[Embd, KProj], C::Attention),     // [n_embd, n_head_kv * head_dim]
    def(Role::AttnV, L, &[Embd, VProj], C::Attention),     // [n_embd, n_head_kv * head_dim]
    def(Role::AttnOut, L, &[QProj, Embd], C::Attention),   // [n_head * head_dim, n_embd]
    def(Role::FfnNorm, L, &[Embd], C::Norm),               // [n_embd]
    def(Role::FfnGate, L, &[Embd, Ff], C::Ffn),            // [n_embd, n_ff]
    def(Role::FfnDown, L, &[Ff, Embd], C::Ffn),            // [n_ff, n_embd]
    def(Role::FfnUp, L, &[Embd, Ff], C::Ffn),              // [n_embd, n_ff]
    // Optional biases (llama.cpp's TENSOR_NOT_REQUIRED), each added right after its matrix; vectors, so F32
    // like the norms (the class only keeps them out of the matrices' type choices).
    opt(def(Role::AttnQBias, L, &[QProj], C::Norm)), // [n_head * head_dim]
    opt(def(Role::AttnKBias, L, &[KProj], C::Norm)), // [n_head_kv * head_dim]
    opt(def(Role::AttnVBias, L, &[VProj], C::Norm)), // [n_head_kv * head_dim]
    opt(def(Role::AttnOutBias, L, &[Embd], C::Norm)), // [n_embd]
    opt(def(Role::FfnGateBias, L, &[Ff], C::Norm)),  // [n_ff]
    opt(def(Role::FfnDownBias, L, &[Embd], C::Norm)), // [n_embd]
    opt(def(Role::FfnUpBias, L, &[Ff], C::Norm)),    // [n_ff]
];

impl LlamaHparams {
    /// Reads the hyperparameters from a file's metadata (the keys llama.cpp's loader reads for `llama`).
    pub fn from_metadata(md: &Metadata) -> Result<Self, ArchError> {
        let c = CommonHparams::read(md, ARCH)?;
        // llama.cpp's graph asserts n_embd_head_v == n_embd_head_k == n_rot: files that differ abort there.
        let head_dim = c.head_dim(ARCH)?;
        check(
            ARCH,
            c.n_rot == head_dim,
            "rope.dimension_count differs from the head size (llama.cpp asserts they are equal)",
        )?;
        let n_expert = md.arch_u32_opt("expert_count")?.unwrap_or(0);
        check(
            ARCH,
            n_expert == 0,
            "routed experts (expert_count > 0, Mixtral-style) are not supported yet",
        )?;
        let hp = LlamaHparams {
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
            tied_output: false,
            rope_freqs: false,
            biases: false,
        };
        hp.validate()?;
        Ok(hp)
    }
}

impl ArchHparams for LlamaHparams {
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
            Ff => self.n_ff as u64,
            HeadK => self.head_dim as u64,
            RopeHalf => (self.head_dim / 2) as u64,
            QProj => (self.n_head * self.head_dim) as u64,
            KProj | VProj => (self.n_head_kv * self.head_dim) as u64,
            _ => return None,
        };
        Some(v)
    }

    fn synth_writes(&self, role: Role) -> bool {
        match role {
            Role::Output => !self.tied_output,
            Role::RopeFreqs => self.rope_freqs,
            r if r.is_projection_bias() => self.biases,
            _ => false,
        }
    }

    fn to_metadata(&self) -> Vec<(String, Value)> {
        vec![
            arch_kv(ARCH, "context_length", self.n_ctx_train),
            arch_kv(ARCH, "embedding_length", self.n_embd),
            arch_kv(ARCH, "block_count", self.n_layer),
            arch_kv(ARCH, "feed_forward_length", self.n_ff),
            arch_kv(ARCH, "attention.head_count", self.n_head),
            arch_kv(ARCH, "attention.head_count_kv", self.n_head_kv),
            arch_kv(ARCH, "attention.layer_norm_rms_epsilon", self.rms_eps),
            arch_kv(ARCH, "attention.key_length", self.head_dim),
            arch_kv(ARCH, "attention.value_length", self.head_dim),
            arch_kv(ARCH, "rope.dimension_count", self.head_dim),
            arch_kv(ARCH, "rope.freq_base", self.rope_freq_base),
        ]
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

/// The weights of one block; the `_b` biases are optional.
#[derive(Clone, Debug)]
struct Block {
    attn_norm: WeightId,
    wq: WeightId,
    wk: WeightId,
    wv: WeightId,
    wo: WeightId,
    wq_b: Option<WeightId>,
    wk_b: Option<WeightId>,
    wv_b: Option<WeightId>,
    wo_b: Option<WeightId>,
    ffn_norm: WeightId,
    ffn_gate: WeightId,
    ffn_up: WeightId,
    ffn_down: WeightId,
    ffn_gate_b: Option<WeightId>,
    ffn_up_b: Option<WeightId>,
    ffn_down_b: Option<WeightId>,
}

/// `x + b` when the bias is present (llama.cpp's `build_lora_mm` then `ggml_add` of the bias).
fn bias<C: Compute>(c: &mut C, x: C::Act, b: Option<WeightId>) -> C::Act {
    match b {
        Some(b) => c.add_weight(&x, b),
        None => x,
    }
}

/// The forward pass of a dense `llama` model (llama.cpp's `llama_model_llama::graph`).
#[derive(Clone, Debug)]
pub struct LlamaGraph {
    hp: LlamaHparams,
    info: ModelInfo,
    tok_embd: WeightId,
    output_norm: WeightId,
    /// `output.weight`, or the token embedding when the file ties them.
    output: WeightId,
    blocks: Vec<Block>,
    rope: Rope,
}

impl LlamaGraph {
    /// Builds the forward pass from bound tensors.
    pub fn new(hp: LlamaHparams, t: &TensorMap, md: &Metadata) -> Result<LlamaGraph, ArchError> {
        let tok_embd = t.global_req(Role::TokenEmbd)?;
        let blocks = (0..hp.n_layer)
            .map(|il| {
                Ok(Block {
                    attn_norm: t.layer(Role::AttnNorm, il)?,
                    wq: t.layer(Role::AttnQ, il)?,
                    wk: t.layer(Role::AttnK, il)?,
                    wv: t.layer(Role::AttnV, il)?,
                    wo: t.layer(Role::AttnOut, il)?,
                    wq_b: t.layer_opt(Role::AttnQBias, il),
                    wk_b: t.layer_opt(Role::AttnKBias, il),
                    wv_b: t.layer_opt(Role::AttnVBias, il),
                    wo_b: t.layer_opt(Role::AttnOutBias, il),
                    ffn_norm: t.layer(Role::FfnNorm, il)?,
                    ffn_gate: t.layer(Role::FfnGate, il)?,
                    ffn_up: t.layer(Role::FfnUp, il)?,
                    ffn_down: t.layer(Role::FfnDown, il)?,
                    ffn_gate_b: t.layer_opt(Role::FfnGateBias, il),
                    ffn_up_b: t.layer_opt(Role::FfnUpBias, il),
                    ffn_down_b: t.layer_opt(Role::FfnDownBias, il),
                })
            })
            .collect::<Result<Vec<_>, ArchError>>()?;
        let head_dim = hp.head_dim as usize;
        let rope = Rope {
            // LLM_ARCH_LLAMA is LLAMA_ROPE_TYPE_NORM: adjacent pairs.
            kind: RopeKind::Normal,
            head_dim,
            n_rot: head_dim,
            freq_base: hp.rope_freq_base,
            freq_scale: rope_freq_scale(md, ARCH)?,
            // llama.cpp's get_rope_factors: blk.0's rope_freqs for every block (TENSOR_DUPLICATED).
            freq_factors: t.global(Role::RopeFreqs),
            sections: None,
        };
        let info = ModelInfo::new(
            ARCH,
            hp.n_vocab as usize,
            hp.n_embd as usize,
            hp.n_ctx_train,
            md,
        )?;
        Ok(LlamaGraph {
            tok_embd,
            output_norm: t.global_req(Role::OutputNorm)?,
            output: t.global(Role::Output).unwrap_or(tok_embd),
            blocks,
            rope,
            info,
            hp,
        })
    }

    /// The hyperparameters.
    pub fn hparams(&self) -> &LlamaHparams {
        &self.hp
    }
}

impl Forward for LlamaGraph {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_states(&self) -> Vec<StateSpec> {
        (0..self.hp.n_layer)
            .map(|_| StateSpec::Kv {
                n_head_kv: self.hp.n_head_kv as usize,
                head_dim_k: self.hp.head_dim as usize,
                head_dim_v: self.hp.head_dim as usize,
                window: None,
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
        let attn = Attention {
            n_head: hp.n_head as usize,
            n_head_kv: hp.n_head_kv as usize,
            head_dim_k: head_dim,
            head_dim_v: head_dim,
            // llama.cpp's kq_scale: f_attention_scale is 0 for llama, so 1/sqrt(head size).
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
            softcap: None,
            picture_rows_see_each_other: false,
        };

        let mut inp = c.embed(self.tok_embd, &tokens);
        // The normed input of the next block (or of the output): each block's closing residual add comes
        // with it (`add_rms_norm`), so only the first block's norm stands alone.
        let mut cur = c.rms_norm(&inp, Some(self.blocks[0].attn_norm), eps, n_embd);
        for (il, b) in self.blocks.iter().enumerate() {
            // Self-attention: RoPE on Q and K (no head norms), scores scaled in the attention.
            let [q, k, v] = c.matmul_many([b.wq, b.wk, b.wv], &cur);
            let (q, k, v) = (bias(c, q, b.wq_b), bias(c, k, b.wk_b), bias(c, v, b.wv_b));
            let q = c.rope(&q, &self.rope);
            let k = c.rope(&k, &self.rope);
            let att = c.attention(il, &q, &k, &v, &attn);
            let att_out = c.matmul(b.wo, &att);
            let mut att_out = bias(c, att_out, b.wo_b);

            // After the last block's attention only the rows whose logits are wanted go on.
            if il == last && out_rows.len() < tokens.len() {
                att_out = c.rows(&att_out, &out_rows);
                inp = c.rows(&inp, &out_rows);
            }
            let (ffn_inp, ffn_in) = c.add_rms_norm(&att_out, &inp, Some(b.ffn_norm), eps, n_embd);

            // Feed-forward: SiLU(gate)·up, then down.
            let [gate, up] = c.matmul_many([b.ffn_gate, b.ffn_up], &ffn_in);
            let (gate, up) = (bias(c, gate, b.ffn_gate_b), bias(c, up, b.ffn_up_b));
            let ffn_out = c.glu(&gate, &up, Unary::Silu);
            let ffn_out = c.matmul(b.ffn_down, &ffn_out);
            let ffn_out = bias(c, ffn_out, b.ffn_down_b);
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
    use crate::arch::ModelHparams;
    use crate::synth::shapes::find_shape;

    fn md(pairs: &[(&str, Value)]) -> Metadata {
        let mut m = Metadata::new("test");
        assert!(m.insert_new("general.architecture".into(), Value::String(ARCH.into())));
        for (k, v) in pairs {
            assert!(m.insert_new(format!("{ARCH}.{k}"), v.clone()));
        }
        m
    }

    /// The metadata of a shape, `edit`ed as `(key, value)` pairs before they become a `Metadata`.
    fn shape_md(shape: &str, edit: impl FnOnce(&mut Vec<(String, Value)>)) -> Metadata {
        let ModelHparams::Llama(h) = find_shape(ARCH, shape).expect("shape").hparams else {
            unreachable!("a llama shape")
        };
        let mut kv = h.to_metadata();
        kv.push((format!("{ARCH}.vocab_size"), Value::U32(h.n_vocab as u32)));
        edit(&mut kv);
        let mut m = md(&[]);
        for (k, v) in kv {
            assert!(m.insert_new(k, v));
        }
        m
    }

    #[test]
    fn metadata_round_trips_and_defaults_follow_llama_cpp() {
        let ModelHparams::Llama(h) = find_shape(ARCH, "smollm2-135m").expect("shape").hparams
        else {
            unreachable!("a llama shape")
        };
        let untied = LlamaHparams {
            tied_output: false,
            ..h
        };
        assert_eq!(
            LlamaHparams::from_metadata(&shape_md("smollm2-135m", |_| {})),
            Ok(untied)
        );
        // Without head_count_kv, key_length and rope.freq_base llama.cpp takes n_head, n_embd / n_head
        // and 10000.
        let minimal = md(&[
            ("block_count", Value::U32(2)),
            ("embedding_length", Value::U32(128)),
            ("feed_forward_length", Value::U32(256)),
            ("attention.head_count", Value::U32(4)),
            ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
            ("context_length", Value::U32(64)),
            ("vocab_size", Value::U32(100)),
        ]);
        let m = LlamaHparams::from_metadata(&minimal).expect("loads");
        assert_eq!(
            (m.n_head_kv, m.head_dim, m.rope_freq_base),
            (4, 32, 10000.0)
        );
    }

    #[test]
    fn refuses_what_it_cannot_compute_with_the_reason() {
        let err = |edit: fn(&mut Vec<(String, Value)>)| {
            LlamaHparams::from_metadata(&shape_md("tiny", edit))
                .expect_err("refused")
                .0
        };
        let e = err(|kv| kv.push(("llama.expert_count".into(), Value::U32(8))));
        assert!(e.contains("experts"), "{e}");
        let e = err(|kv| {
            kv.retain(|(k, _)| k != "llama.rope.dimension_count");
            kv.push(("llama.rope.dimension_count".into(), Value::U32(32)));
        });
        assert!(e.contains("rope.dimension_count"), "{e}");
    }
}
