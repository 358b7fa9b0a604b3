//! The `deepseek4` forward pass on the CPU, end to end on synth's tiny shape (written into a temporary
//! directory): its blocks' caches and the compressors' states are laid out as the graph says, every state
//! carries across forward calls — a prompt read in one call, in several, token by token, or resumed
//! from a checkpoint gives the same (bit for bit in batch-invariant arithmetic), past the first HCA entry
//! (128 tokens) and past the point where the indexer chooses (more than 16 CSA entries) — and the card
//! refuses the model with the reason. (Its values against llama.cpp's are the witness:
//! `tests/tests/witness_cpu.rs` on `tests/fixtures/references/deepseek4-*`.)

use std::sync::OnceLock;

use poly_engine::generate::prefill;
use poly_engine::model::Arithmetic;
use poly_engine::Model;
use poly_kernels::quant::GgmlType;
use poly_models::arch::deepseek4::{CSA_RATIO, HCA_RATIO};
use poly_models::arch::{Forward, ModelHparams, StateSpec};
use poly_models::compute::Logits;
use poly_models::synth::shapes::find_shape;

mod common;
use common::{max_diff, random_tokens, softmax};

/// The tiny shape in Q8_0 in batch-invariant arithmetic, loaded once.
fn invariant() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        common::load_synth("deepseek4", "tiny", GgmlType::Q8_0, "deepseek4-bi")
            .with_arithmetic(Arithmetic::BatchInvariant)
    })
}

#[test]
fn block_caches_then_compressor_states_are_laid_out_by_ratio() {
    let ModelHparams::Deepseek4(h) = find_shape("deepseek4", "tiny").unwrap().hparams else {
        unreachable!("a deepseek4 shape")
    };
    let states = invariant().graph().layer_states();
    let d = h.head_dim as usize;
    let di = h.indexer_head_dim as usize;
    let kv = |k: usize, v: usize| StateSpec::Kv {
        n_head_kv: 1,
        head_dim_k: k,
        head_dim_v: v,
        window: None,
    };
    let mut want: Vec<StateSpec> = (0..h.n_layer).map(|_| kv(d, d)).collect();
    for il in 0..h.n_layer {
        match h.ratio(il) {
            // The token's KV and gate rows (two halves each), the entry in a block's last row; then the
            // indexer's own compressor.
            CSA_RATIO => want.extend([kv(2 * d + d, 2 * d), kv(2 * di + di, 2 * di)]),
            HCA_RATIO => want.push(kv(d + d, d)),
            _ => {}
        }
    }
    assert_eq!(states, want);
}

/// In batch-invariant arithmetic a conversation read in several calls is, bit for bit, the one read at
/// once: the window caches, the compressors' rows and entries and the indexer's entries carry exactly.
#[test]
fn a_conversation_read_in_several_calls_is_the_one_read_at_once_bit_for_bit() {
    let model = invariant();
    let n_vocab = model.info().n_vocab;
    // Past the first HCA entry (128 tokens) and past 16 CSA entries, where the indexer chooses.
    let tokens = random_tokens(150, n_vocab, 5);
    let mut whole = model.new_state(256);
    let want = model.eval(&mut whole, &tokens, Logits::All).unwrap();
    for calls in [&[1usize][..], &[13, 1, 30, 4, 42], &[127, 23]] {
        let mut state = model.new_state(256);
        let mut got = Vec::new();
        let (mut at, mut i) = (0, 0);
        while at < tokens.len() {
            let n = calls[i % calls.len()].min(tokens.len() - at);
            got.extend(
                model
                    .eval(&mut state, &tokens[at..at + n], Logits::All)
                    .unwrap(),
            );
            at += n;
            i += 1;
        }
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "calls of {calls:?} differ from one call"
        );
        assert_eq!(state, whole, "calls of {calls:?} leave another state");
    }
}

/// The compressed entries change what a token sees: the same last tokens after another long past give
/// other probabilities (the window alone, 16 tokens, would give the same).
#[test]
fn the_compressed_past_beyond_the_window_changes_the_answer() {
    let model = invariant();
    let n_vocab = model.info().n_vocab;
    let tail = random_tokens(20, n_vocab, 8);
    let last = |past_seed: u64| {
        let mut tokens = random_tokens(140, n_vocab, past_seed);
        tokens.extend_from_slice(&tail);
        let mut state = model.new_state(256);
        softmax(&model.eval(&mut state, &tokens, Logits::Last).unwrap())
    };
    assert!(max_diff(&last(1), &last(2)) > 1e-3);
}

/// A checkpoint taken mid-conversation cuts the caches and the compressors' states, so the continuation
/// read again gives what it gave the first time.
#[test]
fn a_checkpoint_brings_the_conversation_back() {
    let model = invariant();
    let n_vocab = model.info().n_vocab;
    let prompt = random_tokens(37, n_vocab, 6);
    let more = random_tokens(11, n_vocab, 7);
    let mut state = model.new_state(128);
    prefill(model, &mut state, &prompt, 16).unwrap();
    let cp = state.checkpoint();
    let first = model.eval(&mut state, &more, Logits::All).unwrap();
    assert!(state.restore(&cp));
    assert_eq!(state.n_past(), prompt.len());
    let again = model.eval(&mut state, &more, Logits::All).unwrap();
    assert_eq!(first, again);
    // Without the restore the same tokens read on top give something else.
    let on_top = model.eval(&mut state, &more, Logits::All).unwrap();
    let n = more.len() - 1;
    let last = |l: &[f32]| softmax(&l[n * n_vocab..]);
    assert!(max_diff(&last(&first), &last(&on_top)) > 1e-3);
}

/// The card lacks the operations the forward pass uses: asked for a GPU, the model is refused with the
/// reason before any device is opened (so on a machine without one too); Q8_0 caches are refused too.
#[test]
fn a_gpu_or_q8_0_caches_asked_for_refuse_the_model_with_the_reason() {
    let mut model = common::load_synth("deepseek4", "tiny", GgmlType::Q8_0, "deepseek4-gpu");
    let e = model
        .use_device(poly_engine::gpu::DeviceChoice::Gpu(0))
        .expect_err("refused");
    for what in ["deepseek4", "DeepSeek V4", "--cpu"] {
        assert!(e.0.contains(what), "{what}: {e}");
    }
    assert!(!model.on_gpu());
    let e = model
        .set_kv(poly_engine::state::KvPrecision::Q8_0)
        .expect_err("refused");
    assert!(e.0.contains("q8_0") && e.0.contains("DeepSeek V4"), "{e}");
}
