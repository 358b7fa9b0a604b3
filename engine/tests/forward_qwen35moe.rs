//! The `qwen35moe` forward pass on the CPU, end to end on a synthetic tiny model (written by `synth` into
//! a temporary directory): its layers carry the right state, and the recurrent state (conv window and
//! delta-rule matrices) carries across forward calls, so how a prompt is split into calls does not change
//! the result.

use std::path::PathBuf;
use std::sync::OnceLock;

use poly_engine::generate::prefill;
use poly_engine::Model;
use poly_kernels::quant::GgmlType;
use poly_models::arch::{Forward, ModelHparams, StateSpec};
use poly_models::compute::Logits;
use poly_models::synth::shapes::find_shape;

mod common;
use common::{max_diff, random_tokens, softmax, write_synth};

/// The tiny `qwen35moe` shape in Q8_0 (three delta-net blocks, one gated-attention block, an MTP block),
/// loaded once; the file is removed once mapped.
fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| tiny_model(None))
}

/// The tiny shape's model, with other `rope.dimension_sections` when given (same seed, same tensors).
fn tiny_model(sections: Option<[u32; 4]>) -> Model {
    {
        let tag = sections.map_or("default".to_string(), |s| {
            format!("{s:?}").replace(", ", "-")
        });
        let dir: PathBuf =
            std::env::temp_dir().join(format!("poly-engine-q35-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("qwen35moe-q8_0.gguf");
        let mut shape = find_shape("qwen35moe", "tiny").expect("a tiny shape");
        if let (Some(s), ModelHparams::Qwen35Moe(h)) = (sections, &mut shape.hparams) {
            h.rope_sections = s;
        }
        write_synth(shape, GgmlType::Q8_0, 3, &path);
        let model = Model::load(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        model
    }
}

/// llama.cpp runs a file whose `rope.dimension_sections` do not sum to `rope.dimension_count / 2`: ggml's
/// interleaved multi-section RoPE takes rotated pair i's sector as i mod the sections' sum. For the tiny
/// shape's 8 rotated pairs, [2, 2, 2, 0] (sum 6) puts every pair in a text section, as [3, 3, 2, 0] does,
/// so with text positions both are NeoX RoPE over the same pairs and the logits are the same.
#[test]
fn rope_sections_that_do_not_sum_to_the_rotated_pairs_run_as_in_llama_cpp() {
    let odd = tiny_model(Some([2, 2, 2, 0]));
    let base = model();
    let n_vocab = base.info().n_vocab;
    let prompt = random_tokens(20, n_vocab, 4);
    let logits = |m: &Model| {
        let mut state = m.new_state(64);
        prefill(m, &mut state, &prompt, 512).unwrap()
    };
    assert_eq!(logits(&odd), logits(base));
}

#[test]
fn trunk_layers_carry_recurrent_or_kv_state_by_kind() {
    let g = model().graph();
    let states = g.layer_states();
    // full_attention_interval 4: blocks 0-2 are delta-net, block 3 attention; the MTP block has none.
    assert_eq!(states.len(), 4);
    for (il, s) in states.iter().enumerate() {
        match (il, s) {
            (
                3,
                StateSpec::Kv {
                    n_head_kv: 2,
                    window: None,
                    ..
                },
            ) => {}
            (
                0..=2,
                &StateSpec::Recurrent {
                    conv_kernel: 4,
                    conv_channels,
                    n_v_heads: 4,
                    head_k,
                    head_v,
                },
            ) => {
                // Q and K over 2 key heads, V over 4 value heads.
                assert_eq!(conv_channels, 2 * 2 * head_k + 4 * head_v, "layer {il}");
            }
            _ => panic!("layer {il}: unexpected state {s:?}"),
        }
    }
}

#[test]
fn prompt_in_one_call_several_calls_or_token_by_token_gives_the_same_next_token() {
    let model = model();
    let n_vocab = model.info().n_vocab;
    let prompt = random_tokens(45, n_vocab, 1);
    let next = |ubatch: usize| {
        let mut state = model.new_state(256);
        let logits = prefill(model, &mut state, &prompt, ubatch).unwrap();
        assert_eq!(logits.len(), n_vocab);
        assert_eq!(state.n_past(), prompt.len());
        (softmax(&logits), state)
    };
    let (whole, whole_state) = next(512);
    // The distribution is not degenerate: the test compares something.
    let top = whole.iter().copied().fold(0.0, f64::max);
    assert!(top > 0.01 && top < 0.999, "top probability {top}");
    for ubatch in [16, 7, 3, 1] {
        let (p, state) = next(ubatch);
        let d = max_diff(&whole, &p);
        assert!(d <= 1e-3, "ubatch {ubatch}: probabilities differ by {d}");
        assert_eq!(state.tokens(), whole_state.tokens());
    }
    // The state matters: the same last token read without the prompt before it predicts otherwise.
    let mut fresh = model.new_state(256);
    let alone = softmax(&prefill(model, &mut fresh, &prompt[prompt.len() - 1..], 1).unwrap());
    assert!(
        max_diff(&whole, &alone) > 1e-2,
        "the prompt before the last token changed nothing"
    );
}

#[test]
fn logits_of_every_row_match_reading_one_token_at_a_time() {
    let model = model();
    let n_vocab = model.info().n_vocab;
    let prompt = random_tokens(12, n_vocab, 2);
    let mut state = model.new_state(64);
    let all = model.eval(&mut state, &prompt, Logits::All).unwrap();
    assert_eq!(all.len(), prompt.len() * n_vocab);
    let mut one = model.new_state(64);
    for (i, &t) in prompt.iter().enumerate() {
        let l = model.eval(&mut one, &[t], Logits::Last).unwrap();
        let d = max_diff(&softmax(&all[i * n_vocab..(i + 1) * n_vocab]), &softmax(&l));
        assert!(d <= 1e-3, "position {i}: probabilities differ by {d}");
    }
}

#[test]
fn a_forked_state_continues_like_the_original() {
    let model = model();
    let n_vocab = model.info().n_vocab;
    let prompt = random_tokens(20, n_vocab, 3);
    let more = random_tokens(5, n_vocab, 4);
    let mut state = model.new_state(64);
    prefill(model, &mut state, &prompt, 8).unwrap();
    let mut fork = state.clone();
    let a = model.eval(&mut state, &more, Logits::Last).unwrap();
    let b = model.eval(&mut fork, &more, Logits::Last).unwrap();
    assert_eq!(a, b);
    // Reading the continuation again from the advanced state gives something else: the recurrent
    // state moved on.
    let c = model.eval(&mut fork, &more, Logits::Last).unwrap();
    assert!(max_diff(&softmax(&a), &softmax(&c)) > 1e-3);
}
