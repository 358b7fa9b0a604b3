//! The hyperparameters every architecture here shares, read and checked once, as llama.cpp's
//! `llama_model::load_hparams` (src/llama-model.cpp of the pinned sdist) reads them before handing over to
//! the architecture's own `load_arch_hparams`: the same keys, the same defaults (KV heads = heads, head
//! size = width / heads, rotated dimensions = head size, RoPE base 10,000), the same refusals. An
//! architecture file reads only what is its own and takes these from [`CommonHparams`] (and, with routed
//! experts, [`ExpertHparams`]).

use super::{check, uniform_u32, uniform_u32_req, vocab_size, ArchError};
use crate::compute::{Compute, Unary};
use crate::gguf::Metadata;

/// `<arch>.<suffix>` as one f32 per block (a scalar or an array of `n`), `None` when absent (glm5-next's
/// and deepseek4's SwiGLU limits).
pub(crate) fn f32_per_layer(
    md: &Metadata,
    arch: &str,
    suffix: &str,
    n: usize,
) -> Result<Option<Vec<f32>>, ArchError> {
    if let Some(v) = md.arch_f32_array_opt(suffix)? {
        check(
            arch,
            v.len() == n,
            &format!("{suffix} has {} values for {n} blocks", v.len()),
        )?;
        return Ok(Some(v));
    }
    Ok(md.arch_f32_opt(suffix)?.map(|x| vec![x; n]))
}

/// A block's input from hyper-connection `streams` and the weights that write its output back
/// (llama.cpp's `build_hc_pre`, the same in glm5-next and deepseek4): the flattened streams' RMS norm
/// (no weight) times the mixing matrix `hc_fn` gives the mixes [`Compute::hc_pre`] turns into both.
pub(crate) fn hc_block_input<C: Compute>(
    c: &mut C,
    streams: &C::Act,
    (hc_fn, hc): (crate::compute::WeightId, &crate::compute::HyperConnection),
    (n_embd, rms_eps): (usize, f32),
) -> (C::Act, C::Act) {
    let flat = c.rms_norm(streams, None, rms_eps, hc.hc * n_embd);
    let mix = c.matmul(hc_fn, &flat);
    c.hc_pre(streams, &mix, hc)
}

/// llama.cpp's default `rope.freq_base`.
pub const DEFAULT_ROPE_FREQ_BASE: f32 = 10000.0;

/// The common hyperparameters of a file.
#[derive(Clone, Debug, PartialEq)]
pub struct CommonHparams {
    /// Vocabulary size (length of `tokenizer.ggml.tokens`, else `vocab_size`).
    pub n_vocab: u64,
    /// `context_length`.
    pub n_ctx_train: u32,
    /// `embedding_length`.
    pub n_embd: u32,
    /// `block_count`: every block of the file (an MTP block included).
    pub n_layer_all: u32,
    /// `attention.head_count` (one value for every layer).
    pub n_head: u32,
    /// `attention.head_count_kv`, default `n_head`.
    pub n_head_kv: u32,
    /// `attention.key_length`, default `n_embd / n_head`.
    pub head_k: u32,
    /// `attention.value_length`, default `n_embd / n_head`.
    pub head_v: u32,
    /// `rope.dimension_count`, default `head_k`.
    pub n_rot: u32,
    /// `attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// `rope.freq_base`, default [`DEFAULT_ROPE_FREQ_BASE`].
    pub rope_freq_base: f32,
}

impl CommonHparams {
    /// Reads them from `md` for architecture `arch` (which names the refusals).
    pub fn read(md: &Metadata, arch: &str) -> Result<Self, ArchError> {
        Self::read_layers(md, arch, KvHeads::Uniform)
    }

    /// [`CommonHparams::read`] for a hybrid architecture whose `attention.head_count_kv` is 0 in the
    /// blocks without attention (LFM2's short convolutions, as llama.cpp's converter writes them):
    /// `n_head_kv` is then the value of the blocks with attention, which must agree.
    pub fn read_hybrid(md: &Metadata, arch: &str) -> Result<Self, ArchError> {
        Self::read_layers(md, arch, KvHeads::Hybrid)
    }

    /// [`CommonHparams::read`] for an architecture whose `attention.head_count_kv` may differ between
    /// blocks (Gemma 4's sliding and global blocks): `n_head_kv` is then block 0's, as llama.cpp's
    /// `hparams.n_head_kv()` is; the architecture reads the array itself.
    pub fn read_varying_kv(md: &Metadata, arch: &str) -> Result<Self, ArchError> {
        Self::read_layers(md, arch, KvHeads::FirstBlock)
    }

    fn read_layers(md: &Metadata, arch: &str, kv_heads: KvHeads) -> Result<Self, ArchError> {
        let n_layer_all = md.arch_u32("block_count")?;
        let n_embd = md.arch_u32("embedding_length")?;
        let n_head = uniform_u32_req(md, "attention.head_count", n_layer_all)?;
        check(arch, n_head > 0, "attention.head_count is 0")?;
        let n_head_kv = match kv_heads {
            KvHeads::Hybrid => attention_kv_heads(md, arch, n_layer_all)?.unwrap_or(n_head),
            KvHeads::Uniform => {
                uniform_u32(md, "attention.head_count_kv", n_layer_all)?.unwrap_or(n_head)
            }
            KvHeads::FirstBlock => md
                .arch_u32_per_layer_opt("attention.head_count_kv", n_layer_all as usize)?
                .and_then(|v| v.first().copied())
                .unwrap_or(n_head),
        };
        let head_k = md
            .arch_u32_opt("attention.key_length")?
            .unwrap_or(n_embd / n_head);
        let head_v = md
            .arch_u32_opt("attention.value_length")?
            .unwrap_or(n_embd / n_head);
        Ok(CommonHparams {
            n_vocab: vocab_size(md)?,
            n_ctx_train: md.arch_u32("context_length")?,
            n_embd,
            n_layer_all,
            n_head,
            n_head_kv,
            head_k,
            head_v,
            n_rot: md.arch_u32_opt("rope.dimension_count")?.unwrap_or(head_k),
            rms_eps: md.arch_f32("attention.layer_norm_rms_epsilon")?,
            rope_freq_base: md
                .arch_f32_opt("rope.freq_base")?
                .unwrap_or(DEFAULT_ROPE_FREQ_BASE),
        })
    }

    /// The checks every architecture makes of these (a shape written by hand, for `synth`, included):
    /// blocks, width, vocabulary and heads present, the heads grouped evenly over the KV heads.
    pub fn validate(&self, arch: &str) -> Result<(), ArchError> {
        check(arch, self.n_layer_all > 0, "block_count is 0")?;
        check(
            arch,
            self.n_embd > 0 && self.n_vocab > 0,
            "embedding_length or vocabulary is 0",
        )?;
        check(
            arch,
            self.n_head > 0 && self.n_head_kv > 0,
            "a head count is 0",
        )?;
        check(
            arch,
            self.n_head.is_multiple_of(self.n_head_kv),
            "head_count is not a multiple of head_count_kv",
        )
    }

    /// The head size of an architecture whose keys and values have one (every one here: their attention
    /// kernels take one size; llama.cpp's graphs for them assert it too).
    pub fn head_dim(&self, arch: &str) -> Result<u32, ArchError> {
        check(
            arch,
            self.head_v == self.head_k,
            "attention.value_length differs from key_length",
        )?;
        Ok(self.head_k)
    }

    /// `feed_forward_length` (one value for every layer), or 0 when the file has none (an MoE file may
    /// give only the experts' length).
    pub fn n_ff_opt(&self, md: &Metadata) -> Result<u32, ArchError> {
        Ok(uniform_u32(md, "feed_forward_length", self.n_layer_all)?.unwrap_or(0))
    }

    /// `feed_forward_length`, required (a dense FFN in every block).
    pub fn n_ff(&self, md: &Metadata) -> Result<u32, ArchError> {
        uniform_u32_req(md, "feed_forward_length", self.n_layer_all)
    }
}

/// How [`CommonHparams`] reads `attention.head_count_kv`.
#[derive(Clone, Copy)]
enum KvHeads {
    /// One value for every block.
    Uniform,
    /// One value for every block with attention (0 in the others).
    Hybrid,
    /// Any values; block 0's is `n_head_kv`.
    FirstBlock,
}

/// `attention.head_count_kv` of a hybrid model's blocks with attention (those whose value is above 0; a
/// scalar applies to every block); `None` when the file has no such key.
fn attention_kv_heads(md: &Metadata, arch: &str, n_layers: u32) -> Result<Option<u32>, ArchError> {
    let Some(values) = md.arch_u32_per_layer_opt("attention.head_count_kv", n_layers as usize)?
    else {
        return Ok(None);
    };
    let mut attn = values.iter().copied().filter(|&v| v > 0);
    let Some(first) = attn.next() else {
        return Err(ArchError(format!(
            "{arch}: attention.head_count_kv is 0 in every block: a model without attention is not supported"
        )));
    };
    check(
        arch,
        attn.all(|v| v == first),
        "attention.head_count_kv differs between attention blocks; this architecture needs one value",
    )?;
    Ok(Some(first))
}

/// `CommonHparams` of an architecture's hyperparameters `$hp` that hold the common fields under their
/// usual names, with one head size for keys and values over which RoPE turns whole, and every block a
/// trunk block (gemma3, llama, qwen3moe).
macro_rules! whole_head_common {
    ($hp:expr) => {
        CommonHparams {
            n_vocab: $hp.n_vocab,
            n_ctx_train: $hp.n_ctx_train,
            n_embd: $hp.n_embd,
            n_layer_all: $hp.n_layer,
            n_head: $hp.n_head,
            n_head_kv: $hp.n_head_kv,
            head_k: $hp.head_dim,
            head_v: $hp.head_dim,
            n_rot: $hp.head_dim,
            rms_eps: $hp.rms_eps,
            rope_freq_base: $hp.rope_freq_base,
        }
    };
}
pub(crate) use whole_head_common;

/// The routed experts' hyperparameters of an MoE file.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertHparams {
    /// `expert_count`.
    pub n_expert: u32,
    /// `expert_used_count` (one value for every layer, above 0).
    pub n_expert_used: u32,
    /// `expert_feed_forward_length`; absent or 0: `n_ff / n_expert_used`.
    pub n_ff_exp: u32,
}

impl ExpertHparams {
    /// Reads them from `md` (`n_ff`: the file's `feed_forward_length`, 0 when absent).
    pub fn read(
        md: &Metadata,
        arch: &str,
        common: &CommonHparams,
        n_ff: u32,
    ) -> Result<Self, ArchError> {
        let n_layer = common.n_layer_all;
        let n_expert_used = uniform_u32_req(md, "expert_used_count", n_layer)?;
        check(arch, n_expert_used > 0, "expert_used_count is 0")?;
        let n_ff_exp = match uniform_u32(md, "expert_feed_forward_length", n_layer)? {
            Some(v) if v > 0 => v,
            _ => n_ff / n_expert_used,
        };
        Ok(ExpertHparams {
            n_expert: md.arch_u32("expert_count")?,
            n_expert_used,
            n_ff_exp,
        })
    }
}

/// `cap · tanh(x / cap)` (Gemma's soft capping of the logits), or `x` without a cap.
pub fn soft_cap<C: Compute>(c: &mut C, x: C::Act, cap: Option<f32>) -> C::Act {
    match cap {
        Some(cap) => {
            let y = c.scale(&x, 1.0 / cap);
            let y = c.unary(&y, Unary::Tanh);
            c.scale(&y, cap)
        }
        None => x,
    }
}

/// The RoPE position scale as llama.cpp's common loader derives it for every architecture: `1 /
/// rope.scaling.factor` (or the old key `rope.scale_linear`), 1 when absent or 0, and 1 when
/// `rope.scaling.type` is `none`. YaRN and LongRoPE change the angles in ways the `Rope` op does not
/// express: refused with the reason rather than run unscaled.
pub fn rope_freq_scale(md: &Metadata, arch: &str) -> Result<f32, ArchError> {
    let kind = md.arch_str_opt("rope.scaling.type")?.unwrap_or("linear");
    let factor = match md.arch_f32_opt("rope.scaling.factor")? {
        Some(f) => f,
        None => md.arch_f32_opt("rope.scale_linear")?.unwrap_or(0.0),
    };
    check(
        arch,
        factor.is_finite() && factor >= 0.0,
        "rope.scaling.factor must be a non-negative number",
    )?;
    match kind {
        "none" => Ok(1.0),
        "linear" if factor == 0.0 => Ok(1.0),
        "linear" => Ok(1.0 / factor),
        other => Err(ArchError(format!(
            "{arch}: rope.scaling.type {other:?} is not supported yet (linear or none)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Value;

    /// Metadata of architecture `test` with these `test.*` keys (and a vocabulary size).
    fn md(pairs: &[(&str, Value)]) -> Metadata {
        let mut m = Metadata::new("test");
        assert!(m.insert_new("general.architecture".into(), Value::String("test".into())));
        assert!(m.insert_new("test.vocab_size".into(), Value::U32(1000)));
        for (k, v) in pairs {
            assert!(m.insert_new(format!("test.{k}"), v.clone()));
        }
        m
    }

    fn minimal() -> Vec<(&'static str, Value)> {
        vec![
            ("block_count", Value::U32(4)),
            ("embedding_length", Value::U32(512)),
            ("context_length", Value::U32(2048)),
            ("attention.head_count", Value::U32(8)),
            ("attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ]
    }

    #[test]
    fn absent_keys_take_llama_cpps_defaults() {
        let c = CommonHparams::read(&md(&minimal()), "test").expect("reads");
        assert_eq!(
            (c.n_vocab, c.n_ctx_train, c.n_embd, c.n_layer_all),
            (1000, 2048, 512, 4)
        );
        // KV heads = heads, head size = width / heads, rotated dimensions = head size, base 10,000.
        assert_eq!(
            (c.n_head, c.n_head_kv, c.head_k, c.head_v, c.n_rot),
            (8, 8, 64, 64, 64)
        );
        assert_eq!(c.rope_freq_base, DEFAULT_ROPE_FREQ_BASE);
        assert_eq!(c.head_dim("test"), Ok(64));
        assert_eq!(c.n_ff_opt(&md(&minimal())), Ok(0));
        assert!(c.n_ff(&md(&minimal())).is_err());
    }

    #[test]
    fn given_keys_are_read_and_per_layer_arrays_of_one_value_taken() {
        let mut kv = minimal();
        kv.extend([
            ("attention.head_count_kv", Value::u32_array([2, 2, 2, 2])),
            ("attention.key_length", Value::U32(128)),
            ("attention.value_length", Value::U32(128)),
            ("rope.dimension_count", Value::U32(64)),
            ("rope.freq_base", Value::F32(1e6)),
            ("feed_forward_length", Value::U32(1536)),
        ]);
        let m = md(&kv);
        let c = CommonHparams::read(&m, "test").expect("reads");
        assert_eq!(
            (c.n_head_kv, c.head_k, c.n_rot, c.rope_freq_base),
            (2, 128, 64, 1e6)
        );
        assert_eq!(c.n_ff(&m), Ok(1536));
    }

    #[test]
    fn what_cannot_run_is_refused_with_the_reason() {
        let with = |extra: Vec<(&'static str, Value)>| {
            let mut kv: Vec<_> = minimal()
                .into_iter()
                .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
                .collect();
            kv.extend(extra);
            md(&kv)
        };
        let e = CommonHparams::read(&with(vec![("attention.head_count", Value::U32(0))]), "test");
        assert_eq!(e, Err(ArchError("test: attention.head_count is 0".into())));
        let e = CommonHparams::read(
            &with(vec![(
                "attention.head_count_kv",
                Value::u32_array([2, 2, 4, 2]),
            )]),
            "test",
        )
        .expect_err("layers differ");
        assert!(e.0.contains("differs between layers"), "{e}");
        let c = CommonHparams::read(
            &with(vec![("attention.value_length", Value::U32(32))]),
            "test",
        )
        .expect("reads");
        assert_eq!(
            c.head_dim("test"),
            Err(ArchError(
                "test: attention.value_length differs from key_length".into()
            ))
        );
        let missing: Vec<_> = minimal()
            .into_iter()
            .filter(|(k, _)| *k != "context_length")
            .collect();
        let e = CommonHparams::read(&md(&missing), "test").expect_err("no context");
        assert!(e.0.contains("context_length"), "{e}");
    }

    #[test]
    fn one_rope_scaling_reader_for_every_architecture() {
        let scaled = |pairs: &[(&str, Value)]| rope_freq_scale(&md(pairs), "test");
        assert_eq!(scaled(&[]), Ok(1.0));
        let typed = |t: &str| {
            scaled(&[
                ("rope.scaling.type", Value::String(t.into())),
                ("rope.scaling.factor", Value::F32(4.0)),
            ])
        };
        assert_eq!(typed("linear"), Ok(0.25));
        assert_eq!(typed("none"), Ok(1.0));
        let e = typed("yarn").expect_err("refused");
        assert!(e.0.contains("\"yarn\" is not supported"), "{e}");
        // The old key, read only when the new one is absent.
        assert_eq!(scaled(&[("rope.scale_linear", Value::F32(2.0))]), Ok(0.5));
        let both = [
            ("rope.scaling.factor", Value::F32(8.0)),
            ("rope.scale_linear", Value::F32(4.0)),
        ];
        assert_eq!(scaled(&both), Ok(0.125));
        assert_eq!(scaled(&[("rope.scaling.factor", Value::F32(0.0))]), Ok(1.0));
        assert!(scaled(&[("rope.scaling.factor", Value::F32(-1.0))]).is_err());
        assert!(scaled(&[("rope.scaling.factor", Value::F32(f32::NAN))]).is_err());
    }

    #[test]
    fn experts_default_their_length_from_the_ffn() {
        let mut kv = minimal();
        kv.extend([
            ("expert_count", Value::U32(64)),
            ("expert_used_count", Value::U32(8)),
            ("feed_forward_length", Value::U32(6144)),
        ]);
        let m = md(&kv);
        let c = CommonHparams::read(&m, "test").expect("reads");
        let e = ExpertHparams::read(&m, "test", &c, c.n_ff_opt(&m).expect("ff")).expect("reads");
        assert_eq!((e.n_expert, e.n_expert_used, e.n_ff_exp), (64, 8, 768));
        kv.push(("expert_feed_forward_length", Value::U32(512)));
        let m = md(&kv);
        let e = ExpertHparams::read(&m, "test", &c, 6144).expect("reads");
        assert_eq!(e.n_ff_exp, 512);
        let mut kv = minimal();
        kv.extend([
            ("expert_count", Value::U32(64)),
            ("expert_used_count", Value::U32(0)),
        ]);
        let m = md(&kv);
        assert_eq!(
            ExpertHparams::read(&m, "test", &c, 0),
            Err(ArchError("test: expert_used_count is 0".into()))
        );
    }
}

/// Metadata for the architectures' tests.
#[cfg(test)]
pub(crate) mod test_metadata {
    use crate::arch::ArchHparams;
    use crate::gguf::{Metadata, Value};

    /// The metadata `hp` writes, as a file's (with its vocabulary size where it writes none), `edit`ed
    /// as `(key, value)` pairs first.
    pub(crate) fn metadata_of(
        hp: &dyn ArchHparams,
        edit: impl FnOnce(&mut Vec<(String, Value)>),
    ) -> Metadata {
        let arch = hp.arch_name();
        let mut kv = hp.to_metadata();
        let vocab = format!("{arch}.vocab_size");
        if !kv.iter().any(|(k, _)| *k == vocab) {
            kv.push((vocab, Value::U32(hp.common().n_vocab as u32)));
        }
        edit(&mut kv);
        let mut m = Metadata::new("test");
        assert!(m.insert_new("general.architecture".into(), Value::String(arch.into())));
        for (k, v) in kv {
            assert!(m.insert_new(k, v));
        }
        m
    }

    /// `kv` with `{arch}.{suffix}` set to `v` (replacing it).
    pub(crate) fn set_key(kv: &mut Vec<(String, Value)>, arch: &str, suffix: &str, v: Value) {
        let key = format!("{arch}.{suffix}");
        kv.retain(|(k, _)| *k != key);
        kv.push((key, v));
    }
}

#[cfg(test)]
mod shape_tests {
    use super::*;
    use crate::arch::ModelHparams;
    use crate::synth::shapes::all_shapes;

    /// Every architecture's `common()` is what [`CommonHparams::read`] reads back from the metadata it
    /// writes, for every shape `synth` knows (so the two never drift apart).
    #[test]
    fn every_shapes_common_hyperparameters_read_back_as_written() {
        let shapes = all_shapes();
        assert!(shapes.len() >= 8, "{} shapes", shapes.len());
        for shape in shapes {
            let hp = shape.hparams.as_dyn();
            let arch = hp.arch_name();
            let md = test_metadata::metadata_of(hp, |_| {});
            let c = hp.common();
            let read = match arch {
                crate::arch::lfm2moe::ARCH | crate::arch::glm5_next::ARCH => {
                    CommonHparams::read_hybrid(&md, arch)
                }
                crate::arch::gemma4::ARCH => CommonHparams::read_varying_kv(&md, arch),
                _ => CommonHparams::read(&md, arch),
            }
            .expect("reads");
            assert_eq!(read, c, "{arch} {}", shape.name);
            hp.validate().expect("valid");
            let back = ModelHparams::from_metadata(&md).expect("loads");
            assert_eq!(back.as_dyn().common(), c, "{arch} {}", shape.name);
        }
    }
}
