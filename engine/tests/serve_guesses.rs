//! Guessed tokens from repeats (issue 18), through the real binary on the CPU: an answer written with
//! guesses is the answer written without them (`--no-draft`), token for token and log-probability for
//! log-probability, greedy and sampled, and DONE counts the guesses; models with recurrent layers
//! (qwen35moe, lfm2moe), whose state goes back to a window's start and reads the kept tokens again, too.
//!
//! The prompts repeat a stretch of tokens, and the tiny random models' greedy answers fall into loops of
//! their own: both give the guesser matches. Cost: a dozen engine processes on tiny models, seconds.

mod serve_support;

use poly_protocol::{Done, FromEngine, Gen, ToEngine, Tokens};
use serve_support::{fixture, Engine, Rng, FIXTURES};
use std::path::Path;

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

fn gens(prompt: &[u32], max_tokens: u32) -> [Gen; 2] {
    [
        Gen {
            max_tokens: Some(max_tokens),
            top_logprobs: Some(2),
            ..Gen::new("greedy", prompt.to_vec())
        },
        Gen {
            max_tokens: Some(max_tokens),
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

/// A recurrent model whose guesses are often right ([`write_quiet_qwen35moe`]): a state restored
/// wrongly after a wrong guess shows in the log-probabilities compared.
#[test]
fn a_recurrent_state_goes_back_after_a_wrong_guess() {
    let dir = std::env::temp_dir().join(format!("poly-guesses-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = write_quiet_qwen35moe(&dir);
    let (proposed, kept) = totals(&compare_answers(&path, &[], (&[], 160)));
    std::fs::remove_dir_all(&dir).ok();
    eprintln!("quiet qwen35moe: {proposed} guessed, {kept} kept");
    assert!(
        kept > 0 && proposed > kept,
        "{proposed} guessed, {kept} kept"
    );
}

/// Writes into `dir` the tiny qwen35moe shape with its token mixing at gain 0.01 (`synth --mixing-gain`):
/// a token's next token depends mostly on the token itself, so greedy answers repeat and guesses are
/// often right, while the recurrent state still moves every logit a little.
fn write_quiet_qwen35moe(dir: &Path) -> std::path::PathBuf {
    write_tiny_qwen35moe(
        &dir.join("qwen35moe-quiet.gguf"),
        &["--mixing-gain", "0.01"],
    )
}

/// Writes the tiny qwen35moe shape of seed 5 with synth's `flags` to `path`; returns synth's report.
fn synth_tiny_qwen35moe(path: &Path, flags: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_poly-engine"))
        .args([
            "synth",
            "--arch",
            "qwen35moe",
            "--shape",
            "tiny",
            "--seed",
            "5",
        ])
        .args(flags)
        .arg("--out")
        .arg(path)
        .output()
        .expect("synth runs");
    let report = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{report}");
    report
}

/// [`synth_tiny_qwen35moe`], returning the path.
fn write_tiny_qwen35moe(path: &Path, flags: &[&str]) -> std::path::PathBuf {
    synth_tiny_qwen35moe(path, flags);
    path.to_path_buf()
}

/// A draft block written to agree with the model at a chosen share (`synth --draft-agreement`): a
/// greedy answer keeps about that share of its guesses (a window's guess is right when the token it
/// starts from is one of the share whose embedding the draft block reads), as synth's own measurement
/// says, and the answers with guesses are the answers without, greedy and sampled.
#[test]
fn a_draft_block_written_to_agree_keeps_about_that_share() {
    let dir = std::env::temp_dir().join(format!("poly-agree-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for rate in [0.8, 0.5] {
        let path = dir.join(format!("qwen35moe-agree-{rate}.gguf"));
        let report = synth_tiny_qwen35moe(&path, &["--draft-agreement", &rate.to_string()]);
        let measured = report
            .lines()
            .find(|l| l.contains("draft agreement measured"))
            .unwrap_or_else(|| panic!("no measurement in synth's report:\n{report}"));
        let gens = compare_answers(&path, &["--draft-block", "on"], (&[], 320));
        let (_, proposed, kept) = gens
            .iter()
            .find(|g| g.0 == "greedy")
            .cloned()
            .expect("the greedy answer");
        let share = kept as f64 / proposed.max(1) as f64;
        eprintln!(
            "asked {rate}: {kept} of {proposed} greedy guesses kept ({share:.3}); synth:{measured}"
        );
        // Each window's guess is right as a coin of `rate` falls (whether the token it starts from is
        // known; which tokens start windows depends on earlier windows only, the back-off after a miss
        // and the pause when guessing measures slower): within three standard deviations.
        let sd = (rate * (1.0 - rate) / proposed.max(1) as f64).sqrt();
        assert!(
            proposed >= 30 && (share - rate).abs() <= 3.0 * sd + 0.02,
            "asked {rate}: {kept} of {proposed} greedy guesses kept"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// deepseek4's tiny shape with an MTP block after the trunk (`synth --shape tiny-mtp`), in `dir`.
fn write_deepseek4_with_mtp(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("deepseek4-tiny-mtp.gguf");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_poly-engine"))
        .args([
            "synth",
            "--arch",
            "deepseek4",
            "--shape",
            "tiny-mtp",
            "--seed",
            "3",
            "--out",
        ])
        .arg(&path)
        .output()
        .expect("synth runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    path
}

/// [`answers_with_guesses_are_the_answers_without`] with `flags` added to both engines; returns the
/// guesses kept.
fn guesses_change_nothing(flags: &[&str]) -> u64 {
    let mut accepted = 0;
    for name in [
        "qwen3moe-tiny-q4km.gguf",
        FIXTURES[4],
        "llama-tiny-q4km.gguf",
        // Recurrent layers: restored to a window's start after a wrong guess.
        FIXTURES[2],
        "lfm2moe-tiny-q4km.gguf",
        "glm5-next-tiny-f32.gguf",
    ] {
        // glm5-next's indexer and sparse attention read f16 or f32 caches only: --kv q8_0 is refused.
        if name.starts_with("glm5-next") && flags.contains(&"q8_0") {
            continue;
        }
        // Recurrent models' random answers rarely repeat: a long random prompt before the repeated
        // part gives their written tokens earlier occurrences to start (mostly wrong) windows from.
        let recurrent = ["qwen35moe", "lfm2moe", "glm5-next"]
            .iter()
            .any(|a| name.starts_with(a));
        let lead = if recurrent { 300 } else { 0 };
        let lead = Rng::new(11).tokens(lead, 2048);
        let (proposed, kept) = totals(&compare_answers(&fixture(name), flags, (&lead, 40)));
        // A recurrent state must have gone back to a window's start at least once (a guess was
        // wrong), or the test proved nothing about it.
        if recurrent {
            assert!(proposed > kept, "{name}: {proposed} guessed, {kept} kept");
        }
        accepted += kept;
    }
    accepted
}

/// A draft model (`--draft`) of the same vocabulary: the model as its own draft guesses nearly every
/// greedy token right (its rows are computed alike, one token a call); another model guesses some; a recurrent
/// main model takes them as it takes repeats; the answers are the answers without guesses either way.
#[test]
fn a_draft_model_guesses_and_changes_nothing() {
    for (main, draft) in [
        ("llama-tiny-q4km.gguf", "llama-tiny-q4km.gguf"),
        ("qwen3moe-tiny-q4km.gguf", "llama-tiny-q4k-q8.gguf"),
        (FIXTURES[2], "qwen3moe-tiny-q4k-q8.gguf"),
    ] {
        let draft_path = fixture(draft).to_string_lossy().to_string();
        let gens = compare_answers(&fixture(main), &["--draft", &draft_path], (&[], 40));
        let (proposed, kept) = totals(&gens);
        eprintln!("{main} drafted by {draft}: {proposed} guessed, {kept} kept");
        assert!(proposed > 0, "{main} drafted by {draft}: nothing guessed");
        if main == draft {
            let (id, p, k) = &gens[0];
            assert_eq!(id, "greedy");
            // Nearly all: the draft writes the raw likeliest token, the sampler may apply penalties.
            assert!(
                *p > 8 && *k * 10 >= *p * 9,
                "{main} as its own draft: {k} of {p} greedy guesses kept"
            );
        }
    }
}

/// The model's own draft block (`--draft-block on`: the MTP head of the qwen35moe fixtures, of the
/// quiet synthetic model and of a synthetic deepseek4 with one, which reads every mHC stream of the
/// trunk): its guesses are checked as the others are, a wrong one cuts its KV rows back (with the
/// recurrent state's restore, or deepseek4's compressor states cut with their caches), and the answers
/// are the answers without guesses, greedy and sampled, with the kept state the same.
#[test]
fn the_draft_block_guesses_and_changes_nothing() {
    let dir = std::env::temp_dir().join(format!("poly-draft-block-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let quiet = write_quiet_qwen35moe(&dir);
    let deepseek4 = write_deepseek4_with_mtp(&dir);
    let lead = Rng::new(11).tokens(100, 2048);
    for model in [fixture(FIXTURES[2]), fixture(FIXTURES[3]), quiet, deepseek4] {
        let gens = compare_answers(&model, &["--draft-block", "on"], (&lead, 40));
        let (proposed, kept) = totals(&gens);
        eprintln!(
            "{}: draft block: {proposed} guessed, {kept} kept",
            model.display()
        );
        assert!(proposed > 0, "{}: nothing guessed", model.display());
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Two answers taking turns (`--parallel 2`: their calls read both states at once, each keeping its own
/// hidden rows for its own draft block) with draft-block guesses are the answers without guesses.
#[test]
fn draft_block_guesses_in_answers_taking_turns_change_nothing() {
    let model = fixture(FIXTURES[2]);
    let run = |flags: &[&str]| {
        let args = [&["--cpu", "--parallel", "2"][..], flags].concat();
        let mut e = Engine::start_path(&model, &args);
        let prompt = repeated_prompt(9, 30, e.n_vocab());
        for g in gens(&prompt, 60) {
            e.send(&ToEngine::Gen(g));
        }
        let mut lines = Vec::new();
        let mut done = Vec::new();
        while done.len() < 2 {
            match e.next() {
                FromEngine::Tokens(t) => lines.push(t),
                FromEngine::Done(d) => done.push(d),
                other => panic!("unexpected {other:?}"),
            }
        }
        lines.sort_by(|a, b| a.id.cmp(&b.id));
        let proposed: u32 = done.iter().map(|d| d.draft_proposed).sum();
        (lines, proposed)
    };
    let (with, proposed) = run(&["--draft-block", "on"]);
    let (without, _) = run(&["--no-draft"]);
    assert!(proposed > 0, "nothing guessed");
    assert_eq!(with, without, "the answers' lines");
}

/// `--draft-block on` for a model without a draft block is refused at start with the reason.
#[test]
fn a_model_without_a_draft_block_is_refused_with_the_reason() {
    let mut e = Engine::spawn(&fixture(FIXTURES[0]), &["--cpu", "--draft-block", "on"]);
    match e.next() {
        FromEngine::Err(err) => assert!(err.message.contains("no draft block"), "{}", err.message),
        other => panic!("expected ERR, got {other:?}"),
    }
}

/// A draft model the engine cannot use is refused at start with the reason: one with recurrent layers.
#[test]
fn a_recurrent_draft_model_is_refused_with_the_reason() {
    let draft = fixture(FIXTURES[2]).to_string_lossy().to_string();
    let mut e = Engine::spawn(&fixture(FIXTURES[0]), &["--cpu", "--draft", &draft]);
    match e.next() {
        FromEngine::Err(err) => assert!(
            err.message.contains("draft model") && err.message.contains("recurrent"),
            "{}",
            err.message
        ),
        other => panic!("expected ERR, got {other:?}"),
    }
}

/// Guesses proposed and kept over `gens`.
fn totals(gens: &[(String, u64, u64)]) -> (u64, u64) {
    gens.iter().fold((0, 0), |(p, k), (_, a, b)| (p + a, k + b))
}

/// The answers (greedy and sampled) of an engine on `model` that guesses, against one that does not,
/// line for line, and the state each keeps; returns each answer's id, guesses proposed and kept. The prompt is
/// `lead` then a stretch said three times; the answers are at most `max_tokens` long.
fn compare_answers(
    model: &Path,
    flags: &[&str],
    (lead, max_tokens): (&[u32], u32),
) -> Vec<(String, u64, u64)> {
    let name = model
        .file_name()
        .map_or(String::new(), |n| n.to_string_lossy().to_string());
    // One matching token starts a window: the tiny random models' answers repeat single tokens often
    // and longer stretches rarely, so guesses are tried, kept and missed on every model.
    let args =
        |more: &[&'static str]| [&["--cpu", "--repeats-min-match", "1"][..], more, flags].concat();
    let mut with = Engine::start_path(model, &args(&[]));
    let mut without = Engine::start_path(model, &args(&["--no-draft"]));
    for e in [&with, &without] {
        let knobs = &e.ready.as_ref().expect("READY").knobs;
        assert_eq!(
            knobs.get("repeats-min-match").map(String::as_str),
            Some("1"),
            "{name}: READY's knobs"
        );
        let kv = flags.windows(2).find(|w| w[0] == "--kv").map(|w| w[1]);
        assert_eq!(
            knobs.get("kv").map(String::as_str),
            kv,
            "{name}: READY's knobs"
        );
    }
    let guesses = |e: &Engine| e.ready.as_ref().and_then(|r| r.guesses.clone());
    let source = if flags.contains(&"--draft") {
        "draft"
    } else if flags.contains(&"--draft-block") {
        "draft-block"
    } else {
        "repeats"
    };
    assert_eq!(guesses(&with).as_deref(), Some(source), "{name}");
    assert_eq!(guesses(&without).as_deref(), Some("off"), "{name}");
    let prompt = [lead.to_vec(), repeated_prompt(3, 12, with.n_vocab())].concat();
    let mut counts = Vec::new();
    let mut greedy = Vec::new();
    for (a, b) in gens(&prompt, max_tokens)
        .into_iter()
        .zip(gens(&prompt, max_tokens))
    {
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
        if what.ends_with("greedy") {
            greedy = ta.iter().flat_map(|t| t.tokens.clone()).collect();
        }
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
        let id = what.rsplit(' ').next().unwrap_or_default().to_string();
        counts.push((
            id,
            u64::from(da.draft_proposed),
            u64::from(da.draft_accepted),
        ));
    }
    // The state an answer with guesses keeps is the one without: the same continuation, from the
    // answer's end (the conversation goes on) and from the prompt's (it goes back).
    let next = |e: &mut Engine, conv: &str, prompt: Vec<u32>| {
        let (t, _) = answer(
            e,
            Gen {
                max_tokens: Some(8),
                conversation: Some(conv.into()),
                ..Gen::new("next", prompt)
            },
        );
        t.iter()
            .flat_map(|t| t.tokens.clone())
            .collect::<Vec<u32>>()
    };
    let on = [prompt.clone(), greedy, vec![5, 6]].concat();
    assert_eq!(
        next(&mut with, "greedy-w", on.clone()),
        next(&mut without, "greedy-o", on),
        "{name}: the kept state, gone on"
    );
    let back = [prompt.clone(), vec![5, 6]].concat();
    assert_eq!(
        next(&mut with, "greedy-w", back.clone()),
        next(&mut without, "greedy-o", back),
        "{name}: the kept state, gone back"
    );
    counts
}
