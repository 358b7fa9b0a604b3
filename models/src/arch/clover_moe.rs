//! Clover MoE (`clover_moe`: Clover-35B-A3B-Preview): the Qwen3.6 layout ([`super::qwen35moe`]) in another
//! form, and it runs as `qwen35moe`. Its files differ in two ways:
//! - each delta-net block's `ssm_a` holds `A_log`, where a Qwen3.5/3.6 file holds `-exp(A_log)` (computed
//!   when it was converted): the forward pass reads `-exp(ssm_a)` ([`crate::arch::ValueMap::NegExp`]);
//! - it has no `rope.dimension_sections`: a text position rotates every rotated pair, which is NeoX RoPE
//!   over `rope.dimension_count` (what Qwen3.6's interleaved sections give text tokens).
//!
//! llama.cpp has no `clover_moe`, so its witness is the `qwen35moe` original: a file rewritten in Clover's
//! form gives that file's outputs (`engine/tests/clover.rs`). Keys are read under `clover_moe.` as
//! `qwen35moe` reads its own.

use super::qwen35moe::{Qwen35Form, Qwen35MoeHparams};
use super::ArchError;
use crate::gguf::Metadata;

/// `general.architecture`.
pub const ARCH: &str = "clover_moe";

/// Reads a Clover file's hyperparameters: `qwen35moe`'s, in Clover's form.
pub fn from_metadata(md: &Metadata) -> Result<Qwen35MoeHparams, ArchError> {
    Qwen35MoeHparams::read(md, Qwen35Form::Clover)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{ArchHparams, ModelHparams};
    use crate::gguf::Value;
    use crate::synth::shapes::find_shape;

    #[test]
    fn a_clover_file_reads_as_qwen35moe_without_rope_sections() {
        let qwen = match find_shape("qwen35moe", "tiny")
            .expect("the tiny shape")
            .hparams
        {
            ModelHparams::Qwen35Moe(h) => h,
            other => panic!("a qwen35moe shape holds {other:?}"),
        };
        let clover = Qwen35MoeHparams {
            form: Qwen35Form::Clover,
            ..qwen.clone()
        };
        // Written in Clover's form: its own prefix, no sections.
        let written = clover.to_metadata();
        assert!(written.iter().all(|(k, _)| k.starts_with("clover_moe.")));
        assert!(!written
            .iter()
            .any(|(k, _)| k.ends_with("rope.dimension_sections")));
        let mut md = Metadata::new("test");
        assert!(md.insert_new("general.architecture".into(), Value::from(ARCH)));
        assert!(md.insert_new(
            "clover_moe.vocab_size".into(),
            Value::U32(qwen.n_vocab as u32)
        ));
        for (k, v) in written {
            assert!(md.insert_new(k, v));
        }
        let hp = match ModelHparams::from_metadata(&md).expect("clover_moe reads") {
            ModelHparams::Qwen35Moe(h) => h,
            other => panic!("clover_moe read as {other:?}"),
        };
        assert_eq!(hp.arch_name(), ARCH);
        // No sections (NeoX RoPE over the rotated pairs); everything else as the original.
        assert_eq!(hp.rope_sections, [0; 4]);
        assert_eq!(
            hp,
            Qwen35MoeHparams {
                rope_sections: hp.rope_sections,
                ..clover.clone()
            }
        );
        // A qwen35moe file without sections is still refused: only Clover's form goes without.
        let mut md = Metadata::new("test");
        assert!(md.insert_new("general.architecture".into(), Value::from("qwen35moe")));
        assert!(md.insert_new(
            "qwen35moe.vocab_size".into(),
            Value::U32(qwen.n_vocab as u32)
        ));
        for (k, v) in clover.to_metadata() {
            assert!(md.insert_new(k.replacen("clover_moe.", "qwen35moe.", 1), v));
        }
        let err = ModelHparams::from_metadata(&md).expect_err("qwen35moe needs its sections");
        assert!(err.to_string().contains("rope.dimension_sections"), "{err}");
    }
}
