//! Guessed tokens from repeats (issue 18), through the real binary on the CPU: an answer written with
//! guesses is the answer written without them (`--no-draft`), token for token and log-probability for
//! log-probability, greedy and sampled, and DONE counts the guesses; a model with recurrent layers, whose
//! state cannot be cut back, guesses nothing.
//!
//! The prompts repeat a stretch of tokens, and the tiny random models' greedy answers fall into loops of
//! their own: both give the guesser matches. Cost: a dozen engine processes on tiny models, seconds.

mod serve_support;

use poly_protocol::{Done, FromEngine, Gen, ToEngine, Tokens};
use serve_support::{Engine, Rng, FIXTURES};

/// The answer's lines and its DONE.
fn answer(e: &mut Engine, gen: Gen) -> (Vec<Tokens>, Done) {
    e.send(&ToEngine::Gen(gen));
    let mut tokens = Vec::new();
    loop {
        match e.next() {
            FromEngine::Tokens(t) => tokens.push(t),
            FromEngine::Done(d) => return (tokens, d),
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// A prompt of `n` random tokens said three times.
fn repeated_prompt(seed: u64, n: usize, n_vocab: u32) -> Vec<u32> {
    let part = Rng::new(seed).tokens(n, n_vocab);
    [part.clone(), part.clone(), part].concat()
}

fn gens(prompt: &[u32]) -> [Gen; 2] {
    [
        Gen {
            max_tokens: Some(40),
            top_logprobs: Some(2),
            ..Gen::new("greedy", prompt.to_vec())
        },
        Gen {
            max_tokens: Some(40),
            temperature: Some(0.9),
            seed: Some(7),
            ..Gen::new("sampled", prompt.to_vec())
        },
    ]
}

#[test]
fn answers_with_guesses_are_the_answers_without() {
    assert!(guesses_change_nothing(&[]) > 0, "no guess was ever kept");
}

/// The same with Q8_0 attention caches (`--kv q8_0`): the rows a guess wrote are cut back as whole
/// blocks, and the state kept is the one an answer without guesses keeps.
#[test]
fn q8_0_caches_cut_back_as_f16_ones_do() {
    assert!(
        guesses_change_nothing(&["--kv", "q8_0"]) > 0,
        "no guess was ever kept"
    );
}

/// [`answers_with_guesses_are_the_answers_without`] with `flags` added to both engines; returns the
/// guesses kept.
fn guesses_change_nothing(flags: &[&str]) -> u32 {
    let mut accepted = 0;
    for name in [
        "qwen3moe-tiny-q4km.gguf",
        FIXTURES[4],
        "llama-tiny-q4km.gguf",
    ] {
        let args = |more: &[&'static str]| [&["--cpu"][..], more, flags].concat();
        let mut with = Engine::start(name, &args(&[]));
        let mut without = Engine::start(name, &args(&["--no-draft"]));
        for e in [&with, &without] {
            let knobs = &e.ready.as_ref().expect("READY").knobs;
            let kv = flags.windows(2).find(|w| w[0] == "--kv").map(|w| w[1]);
            assert_eq!(
                knobs.get("kv").map(String::as_str),
                kv,
                "{name}: READY's knobs"
            );
        }
        let guesses = |e: &Engine| e.ready.as_ref().and_then(|r| r.guesses.clone());
        assert_eq!(guesses(&with).as_deref(), Some("repeats"), "{name}");
        assert_eq!(guesses(&without).as_deref(), Some("off"), "{name}");
        let prompt = repeated_prompt(3, 12, with.n_vocab());
        for (a, b) in gens(&prompt).into_iter().zip(gens(&prompt)) {
            let what = format!("{name} {}", a.id);
            // A fresh conversation each: the kept state of the one before is not what is compared.
            let (a, b) = (
                Gen {
                    conversation: Some(format!("{}-w", a.id)),
                    ..a
                },
                Gen {
                    conversation: Some(format!("{}-o", b.id)),
                    ..b
                },
            );
            let (ta, da) = answer(&mut with, a);
            let (tb, db) = answer(&mut without, b);
            assert_eq!(ta, tb, "{what}: the answer's lines");
            assert_eq!(
                (da.reason, da.generated),
                (db.reason, db.generated),
                "{what}"
            );
            assert_eq!((db.draft_proposed, db.draft_accepted), (0, 0), "{what}");
            assert!(da.draft_accepted <= da.draft_proposed, "{what}: {da:?}");
            eprintln!(
                "{what}: {} tokens, {} guessed, {} kept",
                da.generated, da.draft_proposed, da.draft_accepted
            );
            accepted += da.draft_accepted;
        }
        // The state an answer with guesses keeps is the one without: the same continuation.
        let next = |e: &mut Engine, conv: &str| {
            let (t, _) = answer(
                e,
                Gen {
                    max_tokens: Some(8),
                    conversation: Some(conv.into()),
                    ..Gen::new("next", [prompt.clone(), vec![5, 6]].concat())
                },
            );
            t.iter()
                .flat_map(|t| t.tokens.clone())
                .collect::<Vec<u32>>()
        };
        assert_eq!(
            next(&mut with, "greedy-w"),
            next(&mut without, "greedy-o"),
            "{name}: the kept state"
        );
    }
    accepted
}

#[test]
fn a_recurrent_model_guesses_nothing() {
    let mut e = Engine::start(FIXTURES[2], &["--cpu"]);
    let prompt = repeated_prompt(5, 12, e.n_vocab());
    let [greedy, _] = gens(&prompt);
    let (t, d) = answer(&mut e, greedy);
    assert!(!t.is_empty());
    assert_eq!((d.draft_proposed, d.draft_accepted), (0, 0));
}
