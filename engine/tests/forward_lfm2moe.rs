//! The `lfm2moe` forward pass on the CPU, end to end on a synthetic tiny model (written by `synth` into
//! a temporary directory): its blocks carry the right state (a KV cache for attention, the convolution's
//! last inputs for a short convolution), and the convolution's state carries across forward calls, so how
//! a prompt is split into calls does not change the result. (Its values against llama.cpp's are the
//! witness: `tests/tests/witness_cpu.rs` on `tests/fixtures/references/lfm2moe-*`.)

use std::path::PathBuf;
use std::sync::OnceLock;

use poly_engine::Model;
use poly_kernels::quant::GgmlType;
use poly_models::arch::{Forward, ModelHparams, StateSpec};
use poly_models::synth::shapes::find_shape;

mod common;
use common::write_synth;

/// The tiny `lfm2moe` shape in Q8_0 (short conv, short conv, attention, short conv; a dense FFN in the
/// first block, experts after it), loaded once; the file is removed once mapped.
fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let dir: PathBuf =
            std::env::temp_dir().join(format!("poly-engine-lfm2moe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lfm2moe-q8_0.gguf");
        let shape = find_shape("lfm2moe", "tiny").expect("a tiny shape");
        write_synth(shape, GgmlType::Q8_0, 3, &path);
        let model = Model::load(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        model
    })
}

#[test]
fn blocks_carry_a_kv_cache_or_a_convolution_state_by_kind() {
    let ModelHparams::Lfm2Moe(h) = find_shape("lfm2moe", "tiny").unwrap().hparams else {
        unreachable!("an lfm2moe shape")
    };
    let states = model().graph().layer_states();
    assert_eq!(states.len(), h.n_layer as usize);
    for (il, s) in states.iter().enumerate() {
        match s {
            StateSpec::Kv {
                n_head_kv,
                head_dim_k: 64,
                head_dim_v: 64,
                window: None,
            } => {
                assert!(h.attention_layers[il], "block {il} attends");
                assert_eq!(*n_head_kv, h.n_head_kv as usize);
            }
            // The convolution's last l_cache - 1 = 2 rows of n_embd, no delta-rule heads.
            StateSpec::Recurrent {
                conv_kernel: 3,
                conv_channels: 256,
                n_v_heads: 0,
                head_k: 0,
                head_v: 0,
            } => assert!(!h.attention_layers[il], "block {il} convolves"),
            _ => panic!("block {il}: unexpected state {s:?}"),
        }
    }
    assert_eq!(
        states
            .iter()
            .filter(|s| matches!(s, StateSpec::Kv { .. }))
            .count(),
        1
    );
}

#[test]
fn prompt_in_one_call_several_calls_or_token_by_token_gives_the_same_next_token() {
    common::check_prompt_splits(model(), 45, &[16, 7, 3, 2, 1], 1e-3);
}

#[test]
fn logits_of_every_row_match_reading_one_token_at_a_time() {
    common::check_rows_match_single_tokens(model(), 1e-3);
}

#[test]
fn a_forked_state_continues_like_the_original() {
    common::check_forked_state_continues(model());
}

/// The card lacks the experts' selection bias: asked for a GPU, the model is refused with the reason
/// before any device is opened (so on a machine without one too), not run without it.
#[test]
fn a_gpu_asked_for_refuses_the_model_with_the_reason() {
    let mut model = common::load_synth("lfm2moe", "tiny", GgmlType::Q8_0, "lfm2moe-gpu");
    let e = model
        .use_device(poly_engine::gpu::DeviceChoice::Gpu(0))
        .expect_err("refused");
    assert!(
        e.0.contains("lfm2moe") && e.0.contains("selection bias") && e.0.contains("--cpu"),
        "{e}"
    );
    assert!(!model.on_gpu());
}
