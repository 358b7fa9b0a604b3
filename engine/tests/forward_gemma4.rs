//! The `gemma4` forward pass on the CPU, end to end on a synthetic tiny model (written by `synth` into
//! a temporary directory): sliding-window and global blocks carry KV caches of their own head sizes and
//! KV heads (the global block's keys serving as values), a prompt split into calls gives what one call
//! gives (bit for bit in the batch-invariant orders: in llama.cpp's, whose sums follow the row count,
//! this model's routing amplifies the last bits' differences, up to 0.9 in probability over 530
//! tokens, against 0.1–0.3 for the other fixtures), and the card refuses the model with the reason. (Its values against llama.cpp's are the witness:
//! `tests/tests/witness_cpu.rs` on `tests/fixtures/references/gemma4-*`.)

use std::path::PathBuf;
use std::sync::OnceLock;

use poly_engine::cpu::Arithmetic;
use poly_engine::Model;
use poly_kernels::quant::GgmlType;
use poly_models::arch::{Forward, ModelHparams, StateSpec};
use poly_models::synth::shapes::find_shape;

mod common;
use common::write_synth;

/// The tiny `gemma4` shape in Q8_0 (two sliding-window blocks, then a global one without a V projection;
/// a dense MLP beside the experts in each) in the batch-invariant orders, loaded once; the file is removed
/// once mapped.
fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let dir: PathBuf =
            std::env::temp_dir().join(format!("poly-engine-gemma4-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gemma4-q8_0.gguf");
        let shape = find_shape("gemma4", "tiny").expect("a tiny shape");
        write_synth(shape, GgmlType::Q8_0, 3, &path);
        let model = Model::load(&path)
            .unwrap()
            .with_arithmetic(Arithmetic::BatchInvariant);
        std::fs::remove_file(&path).unwrap();
        model
    })
}

#[test]
fn sliding_and_global_blocks_carry_caches_of_their_own_shapes() {
    let ModelHparams::Gemma4(h) = find_shape("gemma4", "tiny").unwrap().hparams else {
        unreachable!("a gemma4 shape")
    };
    let states = model().graph().layer_states();
    assert_eq!(states.len(), h.n_layer as usize);
    for (il, s) in states.iter().enumerate() {
        let want = if h.swa_layers[il] {
            StateSpec::Kv {
                n_head_kv: h.n_head_kv_swa as usize,
                head_dim_k: h.head_dim_swa as usize,
                head_dim_v: h.head_dim_swa as usize,
                window: Some(h.sliding_window),
            }
        } else {
            StateSpec::Kv {
                n_head_kv: h.n_head_kv as usize,
                head_dim_k: h.head_dim as usize,
                head_dim_v: h.head_dim as usize,
                window: None,
            }
        };
        assert_eq!(*s, want, "block {il}");
    }
    assert_ne!(
        h.head_dim, h.head_dim_swa,
        "the shape tells the kinds apart"
    );
    assert!(h.swa_layers.contains(&true) && h.swa_layers.contains(&false));
}

/// Past the sliding window (64 positions) too: the sliding blocks forget what the global one still sees.
#[test]
fn prompt_in_one_call_several_calls_or_token_by_token_gives_the_same_next_token() {
    common::check_prompt_splits(model(), 90, &[32, 7, 1], 0.0);
}

#[test]
fn logits_of_every_row_match_reading_one_token_at_a_time() {
    common::check_rows_match_single_tokens(model(), 0.0);
}

/// The card lacks Gemma 4's MoE form: asked for a GPU, the model is refused with the reason before any
/// device is opened (so on a machine without one too), not run without it.
#[test]
fn a_gpu_asked_for_refuses_the_model_with_the_reason() {
    let mut model = common::load_synth("gemma4", "tiny", GgmlType::Q8_0, "gemma4-gpu");
    let e = model
        .use_device(poly_engine::gpu::DeviceChoice::Gpu(0))
        .expect_err("refused");
    assert!(
        e.0.contains("gemma4") && e.0.contains("Gemma 4's form") && e.0.contains("--cpu"),
        "{e}"
    );
    assert!(!model.on_gpu());
}
