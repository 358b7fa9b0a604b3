//! [`Model::eval_many`]: one forward call over several sequence states (each its own rows, attention over
//! its own cache) gives every state the logits and the state that a call of its own gives, bit for bit,
//! in batch-invariant arithmetic: the KV fixtures (qwen3moe, gemma3 with its sliding window, llama) and
//! the recurrent ones (qwen35moe's delta-net, lfm2moe's short convolutions: each state's recurrence over
//! its own rows), at depths past 512 where one state's attention differs most from another's, with
//! calls of one row and of several (a written token and its guesses). llama.cpp's orders fall back to
//! one call per state, with the same results. Cost: a few seconds per fixture.

use std::path::PathBuf;

use poly_engine::model::Arithmetic;
use poly_engine::state::SeqState;
use poly_engine::Model;
use poly_models::compute::Logits;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

/// A state of `model` that has read `n` pseudo-random tokens (seeded by `seed`).
fn read(model: &Model, n: usize, seed: u64) -> SeqState {
    let n_vocab = model.info().n_vocab as u64;
    let mut x = seed;
    let tokens: Vec<u32> = (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % n_vocab) as u32
        })
        .collect();
    let mut state = model.new_state(2048);
    model
        .eval(&mut state, &tokens, Logits::None)
        .expect("read the prompt");
    state
}

/// Checks one call over states read to `depths` against each state's own call, for the calls' tokens.
fn check(model: &Model, depths: &[usize], calls: &[Vec<u32>], what: &str) {
    let mut together: Vec<SeqState> = depths
        .iter()
        .enumerate()
        .map(|(i, &d)| read(model, d, i as u64 + 1))
        .collect();
    let mut alone: Vec<SeqState> = together.clone();
    let results = {
        let mut args: Vec<(&mut SeqState, &[u32])> = together
            .iter_mut()
            .zip(calls)
            .map(|(s, c)| (s, c.as_slice()))
            .collect();
        model.eval_many(&mut args)
    };
    assert_eq!(results.len(), calls.len());
    for (i, ((state, result), call)) in alone.iter_mut().zip(results).zip(calls).enumerate() {
        let want = if call.len() == 1 {
            Logits::Last
        } else {
            Logits::All
        };
        let own = model.eval(state, call, want).expect("its own call");
        let got = result.expect("the call over all states");
        assert_eq!(got.len(), own.len(), "{what}: state {i}: rows");
        assert!(
            got.iter()
                .zip(&own)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: state {i}: logits differ from its own call's"
        );
        assert_eq!(together[i], *state, "{what}: state {i} after the call");
    }
}

#[test]
fn one_call_over_several_states_gives_each_its_own_call() {
    for name in [
        "qwen3moe-tiny-q4km.gguf",
        "gemma3-tiny-q4k-q8.gguf",
        "llama-tiny-q4km.gguf",
        "qwen35moe-tiny-q4km.gguf",
        "lfm2moe-tiny-q4km.gguf",
        "glm5-next-tiny-f32.gguf",
    ] {
        let model = Model::load(fixture(name))
            .expect("fixture loads")
            .with_arithmetic(Arithmetic::BatchInvariant);
        let probe = model.new_state(1);
        assert!(
            model.batches_states(&probe),
            "{name}: one call over several states"
        );
        // Depths on both sides of 512 and of the sliding window; one row each, then uneven rows.
        let depths = [5, 530, 37];
        check(&model, &depths, &[vec![7], vec![11], vec![13]], name);
        check(
            &model,
            &depths,
            &[vec![7, 8, 9], vec![11], vec![13, 14]],
            name,
        );
    }
}

#[test]
fn llama_orders_take_one_call_per_state() {
    let model = Model::load(fixture("qwen3moe-tiny-q4km.gguf"))
        .expect("fixture loads")
        .with_arithmetic(Arithmetic::LlamaCpp);
    check(&model, &[4, 9], &[vec![3, 4], vec![5]], "llama.cpp orders");
}
