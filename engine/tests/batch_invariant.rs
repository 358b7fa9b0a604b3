//! [`Arithmetic::BatchInvariant`]: a prompt read in one forward call, in uneven calls, or token by token,
//! on any number of threads, leaves the same state and gives the same logits bit for bit, and greedy
//! decoding continues identically. Checked on every committed fixture (three architectures, two
//! quantizations each) and on the real Gemma 3 270M Q4_K_M where it is on disk
//! (`/work/models/gemma-3-270m-q4_k_m.gguf`, `$POLY_WITNESS_MODELS`, or `target/gemma3-270m/`, which
//! `tests/witness/fetch_gemma.sh` fills); without it that test says so and checks nothing.
//!
//! The largest next-token probability difference between reads is printed too (it is 0 when the logits
//! are equal); for contrast, the fixture tests print the same number for llama.cpp's orders
//! ([`Arithmetic::LlamaCpp`]), where it is not.
//!
//! Cost (release, 2 cores shared with other builds at load average 7–10): each fixture test about 25 s
//! (two models, half of it the llama.cpp-orders contrast), Gemma 3 270M about 110 s (skipped without it).

use std::path::PathBuf;

use poly_engine::model::Arithmetic;
use poly_engine::state::SeqState;
use poly_engine::Model;
use poly_models::compute::Logits;

/// Tokens of the fixtures' prompts: past 512, where llama.cpp's decode splits the KV cache by threads.
const FIXTURE_PROMPT: usize = 530;
/// Tokens of Gemma 3 270M's prompt.
const GEMMA_PROMPT: usize = 300;
/// Greedy tokens decoded after each read.
const DECODE: usize = 8;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

const FIXTURES: &[&str] = &[
    "qwen3moe-tiny-q4km.gguf",
    "qwen3moe-tiny-q4k-q8.gguf",
    "qwen35moe-tiny-q4km.gguf",
    "qwen35moe-tiny-q4k-q8.gguf",
    "gemma3-tiny-q4km.gguf",
    "gemma3-tiny-q4k-q8.gguf",
    "gemma4-tiny-q4km.gguf",
    "gemma4-tiny-q4k-q8.gguf",
    "glm5-next-tiny-f32.gguf",
    "glm5-next-tiny-q8_0.gguf",
];

/// A seeded prompt (splitmix64) of `n` tokens below `n_vocab`.
fn prompt(n: usize, n_vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % n_vocab as u64) as u32
        })
        .collect()
}

/// How a prompt of `n` tokens is cut into forward calls.
#[derive(Clone, Copy, Debug)]
enum Split {
    /// One call.
    Whole,
    /// Calls of 64, 7, 13, 1, 100, 3, 8, 70 tokens, over again (tiled and vector attention, 1-, 4- and
    /// 8-row products, every remainder).
    Uneven,
    /// One call per token.
    TokenByToken,
}

impl Split {
    fn calls(self, n: usize) -> Vec<usize> {
        let pattern: &[usize] = match self {
            Split::Whole => return vec![n],
            Split::Uneven => &[64, 7, 13, 1, 100, 3, 8, 70],
            Split::TokenByToken => &[1],
        };
        let (mut out, mut left) = (Vec::new(), n);
        for &c in pattern.iter().cycle() {
            if left == 0 {
                break;
            }
            out.push(c.min(left));
            left -= c.min(left);
        }
        out
    }
}

/// What a read and the greedy decode after it produced.
struct Run {
    /// Every prompt position's logits (`all`), or the last one's.
    prompt_logits: Vec<f32>,
    /// The state after the prompt.
    state: SeqState,
    /// The greedy tokens and, per step, the logits they were picked from.
    decoded: Vec<u32>,
    decode_logits: Vec<Vec<f32>>,
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Reads `tokens` split as `split` on `threads` threads, then decodes [`DECODE`] greedy tokens.
fn run(model: &Model, tokens: &[u32], split: Split, threads: usize, all: bool) -> Run {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        let n_vocab = model.info().n_vocab;
        let mut state = model.new_state(tokens.len() + DECODE + 8);
        let mut prompt_logits = Vec::new();
        let mut at = 0;
        for len in split.calls(tokens.len()) {
            let want = if all { Logits::All } else { Logits::Last };
            let out = model.eval(&mut state, &tokens[at..at + len], want).unwrap();
            if all {
                prompt_logits.extend_from_slice(&out);
            } else {
                prompt_logits = out;
            }
            at += len;
        }
        let read = state.clone();
        let mut last = prompt_logits[prompt_logits.len() - n_vocab..].to_vec();
        let (mut decoded, mut decode_logits) = (Vec::new(), Vec::new());
        for _ in 0..DECODE {
            let t = argmax(&last);
            decoded.push(t);
            last = model.eval(&mut state, &[t], Logits::Last).unwrap();
            decode_logits.push(last.clone());
        }
        Run {
            prompt_logits,
            state: read,
            decoded,
            decode_logits,
        }
    })
}

fn softmax(v: &[f32]) -> Vec<f64> {
    let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = v.iter().map(|&x| (x as f64 - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

/// The largest difference in next-token probability between two runs' logits (`n_vocab` per row).
fn max_prob_diff(a: &Run, b: &Run, n_vocab: usize) -> f64 {
    let rows_a = a
        .prompt_logits
        .chunks(n_vocab)
        .chain(a.decode_logits.iter().map(|v| &v[..]));
    let rows_b = b
        .prompt_logits
        .chunks(n_vocab)
        .chain(b.decode_logits.iter().map(|v| &v[..]));
    rows_a
        .zip(rows_b)
        .map(|(x, y)| {
            softmax(x)
                .iter()
                .zip(softmax(y))
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f64::max)
        })
        .fold(0.0, f64::max)
}

/// Asserts that `b` equals `a` bit for bit (logits, state, decoded tokens).
fn assert_same(a: &Run, b: &Run, what: &str) {
    assert_eq!(a.prompt_logits.len(), b.prompt_logits.len(), "{what}");
    let first_diff = a
        .prompt_logits
        .iter()
        .zip(&b.prompt_logits)
        .position(|(x, y)| x.to_bits() != y.to_bits());
    assert_eq!(first_diff, None, "{what}: prompt logits differ");
    assert!(a.state == b.state, "{what}: states after the prompt differ");
    assert_eq!(a.decoded, b.decoded, "{what}: greedy tokens differ");
    for (i, (x, y)) in a.decode_logits.iter().zip(&b.decode_logits).enumerate() {
        assert!(
            x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "{what}: decode step {i}'s logits differ"
        );
    }
}

/// Every split and thread count against one call on two threads.
fn check_model(model: &Model, tokens: &[u32], all: bool, name: &str) -> f64 {
    let n_vocab = model.info().n_vocab;
    let base = run(model, tokens, Split::Whole, 2, all);
    let mut worst = 0f64;
    for (split, threads) in [
        (Split::Uneven, 2),
        (Split::TokenByToken, 2),
        (Split::Whole, 1),
        (Split::Uneven, 3),
        (Split::TokenByToken, 1),
    ] {
        let other = run(model, tokens, split, threads, all);
        let d = max_prob_diff(&base, &other, n_vocab);
        eprintln!(
            "{name}: batch-invariant, whole/2 threads vs {split:?}/{threads} threads: max prob diff {d:e}"
        );
        assert_same(
            &base,
            &other,
            &format!("{name}: {split:?} on {threads} threads"),
        );
        worst = worst.max(d);
    }
    worst
}

fn check_fixture(name: &str) {
    let model = Model::load(fixture(name))
        .unwrap()
        .with_arithmetic(Arithmetic::BatchInvariant);
    let tokens = prompt(FIXTURE_PROMPT, model.info().n_vocab, 7);
    assert_eq!(check_model(&model, &tokens, true, name), 0.0);

    // For contrast: llama.cpp's orders differ between splits on these 4-bit models.
    let model = model.with_arithmetic(Arithmetic::LlamaCpp);
    let n_vocab = model.info().n_vocab;
    let whole = run(&model, &tokens, Split::Whole, 2, true);
    let steps = run(&model, &tokens, Split::TokenByToken, 2, true);
    eprintln!(
        "{name}: llama.cpp orders, whole vs token by token: max prob diff {:e}",
        max_prob_diff(&whole, &steps, n_vocab)
    );
}

#[test]
fn qwen3moe_fixtures_are_split_invariant() {
    check_fixture(FIXTURES[0]);
    check_fixture(FIXTURES[1]);
}

#[test]
fn qwen35moe_fixtures_are_split_invariant() {
    check_fixture(FIXTURES[2]);
    check_fixture(FIXTURES[3]);
}

#[test]
fn gemma3_fixtures_are_split_invariant() {
    check_fixture(FIXTURES[4]);
    check_fixture(FIXTURES[5]);
}

#[test]
fn gemma4_fixtures_are_split_invariant() {
    check_fixture(FIXTURES[6]);
    check_fixture(FIXTURES[7]);
}

/// glm5-next's fixtures: their KDA states, latent caches and indexer caches carry across calls exactly.
#[test]
fn glm5_next_fixtures_are_split_invariant() {
    check_fixture(FIXTURES[8]);
    check_fixture(FIXTURES[9]);
}

/// The real Gemma 3 270M Q4_K_M, where it is on disk.
fn gemma_270m() -> Option<PathBuf> {
    const FILE: &str = "gemma-3-270m-q4_k_m.gguf";
    let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut places = vec![PathBuf::from("/work/models").join(FILE)];
    if let Some(d) = std::env::var_os("POLY_WITNESS_MODELS") {
        places.push(PathBuf::from(d).join(FILE));
    }
    places.push(workspace.join("target/gemma3-270m").join(FILE));
    places.into_iter().find(|p| p.is_file())
}

#[test]
fn gemma3_270m_is_split_invariant() {
    let Some(path) = gemma_270m() else {
        eprintln!(
            "gemma-3-270m-q4_k_m.gguf is not on disk (tests/witness/fetch_gemma.sh): skipped"
        );
        return;
    };
    let model = Model::load(path)
        .unwrap()
        .with_arithmetic(Arithmetic::BatchInvariant);
    // Ordinary tokens: above the special and byte tokens at the start of the vocabulary.
    let tokens: Vec<u32> = prompt(GEMMA_PROMPT, 20_000, 11)
        .into_iter()
        .map(|t| t + 1_000)
        .collect();
    assert_eq!(check_model(&model, &tokens, false, "gemma-3-270m"), 0.0);
}

/// Q8_0 attention caches (`--kv q8_0`): every split and thread count gives the same bits (llama.cpp
/// reads a quantized cache on one path for every batch), the sliding-window layers of Gemma 3 included
/// (a prompt past its window of 64); the rows take 34 bytes for 32 values; and a state cut back to an
/// earlier position is the state read to that position, which goes on the same way.
#[test]
fn q8_0_caches_are_split_invariant_and_cut_back_to_a_fresh_read() {
    use poly_engine::state::{KvPrecision, LayerState};
    use poly_models::arch::{Forward, StateSpec};
    for name in [FIXTURES[4], FIXTURES[0], FIXTURES[2]] {
        let model = Model::load(fixture(name))
            .unwrap()
            .with_arithmetic(Arithmetic::BatchInvariant)
            .with_kv(KvPrecision::Q8_0)
            .unwrap();
        let tokens = prompt(150, model.info().n_vocab, 5);
        assert_eq!(check_model(&model, &tokens, true, name), 0.0, "{name}");
        let mut state = model.new_state(200);
        model.eval(&mut state, &tokens, Logits::Last).unwrap();
        // Memory: 34 bytes for 32 values of every KV row, recurrent states as they were.
        let (mut kv_values, mut recurrent) = (0, 0);
        for (il, spec) in model.graph().layer_states().iter().enumerate() {
            match (*spec, state.layer(il)) {
                (
                    StateSpec::Kv {
                        n_head_kv,
                        head_dim_k,
                        head_dim_v,
                        ..
                    },
                    LayerState::Kv(c),
                ) => {
                    assert_eq!(c.precision, KvPrecision::Q8_0);
                    kv_values += tokens.len() * n_head_kv * (head_dim_k + head_dim_v);
                }
                (_, LayerState::Recurrent(r)) => recurrent += (r.conv.len() + r.delta.len()) * 4,
                _ => panic!("{name}: layer {il}'s state is not of its spec"),
            }
        }
        assert!(kv_values > 0);
        assert_eq!(state.bytes(), kv_values * 34 / 32 + recurrent, "{name}");
        if state.has_recurrent() {
            continue;
        }
        // Cut back to 100 tokens: the state a read of those 100 leaves, and the same next logits.
        let mut fresh = model.new_state(200);
        model
            .eval(&mut fresh, &tokens[..100], Logits::Last)
            .unwrap();
        assert!(state.truncate(100));
        assert!(
            state == fresh,
            "{name}: the cut state is not a fresh read's"
        );
        let next = [tokens[7], tokens[3]];
        let a = model.eval(&mut state, &next, Logits::All).unwrap();
        let b = model.eval(&mut fresh, &next, Logits::All).unwrap();
        assert!(a == b, "{name}: logits after the cut");
    }
}
