//! A property test through the real binary: thousands of random lines (random bytes, known and unknown
//! verbs with broken or strange bodies, GENs with mutated fields, CANCELs and STATS) never stop the
//! engine or make it write anything but protocol lines, and afterwards a normal GEN still gives the
//! reference tokens (the library on a fresh state).
//! Cost: one engine process per fixture architecture, ~2,000 lines each, a few seconds.

mod serve_support;

use poly_protocol::{FromEngine, Gen, ToEngine};
use serve_support::{assert_follows, reference, served_model, Engine, Rng, FIXTURES};

/// Pieces random JSON bodies are made of.
const KEYS: [&str; 16] = [
    "id",
    "tokens",
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop_tokens",
    "top_logprobs",
    "conversation",
    "checkpoint_at",
    "penalty_last_n",
];

fn random_value(rng: &mut Rng, n_vocab: u32, depth: u32) -> String {
    match rng.below(if depth > 2 { 9 } else { 11 }) {
        0 => "null".into(),
        1 => ["true", "false"][rng.below(2) as usize].into(),
        2 => format!("{}", rng.below(8)),
        3 => format!("-{}", rng.below(1 << 40)),
        4 => format!("{}", rng.next_u64()),
        5 => format!("{}e{}", rng.below(100), rng.below(80) as i64 - 40),
        6 => format!("\"r{}\"", rng.below(6)),
        7 => format!(
            "\"{}\"",
            "\u{1F600}\\u0000\\n".repeat(rng.below(3) as usize)
        ),
        8 => {
            let n = rng.below(6);
            let ids: Vec<String> = (0..n)
                .map(|_| (rng.below(u64::from(n_vocab) + 4)).to_string())
                .collect();
            format!("[{}]", ids.join(","))
        }
        9 => {
            let n = rng.below(4);
            let items: Vec<String> = (0..n)
                .map(|_| random_value(rng, n_vocab, depth + 1))
                .collect();
            format!("[{}]", items.join(","))
        }
        _ => random_object(rng, n_vocab, depth + 1),
    }
}

fn random_object(rng: &mut Rng, n_vocab: u32, depth: u32) -> String {
    let n = rng.below(6);
    let fields: Vec<String> = (0..n)
        .map(|_| {
            let key = KEYS[rng.below(KEYS.len() as u64) as usize];
            format!("\"{key}\":{}", random_value(rng, n_vocab, depth))
        })
        .collect();
    format!("{{{}}}", fields.join(","))
}

/// A GEN that is mostly right, with one field changed to something random.
fn mutated_gen(rng: &mut Rng, n_vocab: u32) -> String {
    let n_prompt = 1 + rng.below(6) as usize;
    let mut gen = Gen {
        max_tokens: Some(rng.below(4) as u32),
        conversation: Some(format!("c{}", rng.below(3))),
        ..Gen::new(format!("g{}", rng.below(5)), rng.tokens(n_prompt, n_vocab))
    };
    if rng.below(2) == 0 {
        gen.temperature = Some(rng.below(3) as f32 * 0.5);
        gen.seed = Some(rng.next_u64());
    }
    let mut value: serde_json::Value =
        serde_json::from_str(&ToEngine::Gen(gen).to_line()[4..]).unwrap();
    let key = KEYS[rng.below(KEYS.len() as u64) as usize];
    let replacement = random_value(rng, n_vocab, 0);
    value[key] = serde_json::from_str(&replacement).unwrap_or(serde_json::Value::Null);
    format!("GEN {value}")
}

fn random_line(rng: &mut Rng, n_vocab: u32) -> String {
    match rng.below(8) {
        // Random printable bytes (no newline: one line each).
        0 => (0..rng.below(80))
            .map(|_| char::from(b' ' + rng.below(95) as u8))
            .collect(),
        1 => format!("GEN {}", random_object(rng, n_vocab, 0)),
        2 | 3 => mutated_gen(rng, n_vocab),
        4 => format!("CANCEL {}", random_object(rng, n_vocab, 0)),
        5 => format!("CANCEL {{\"id\":\"g{}\"}}", rng.below(5)),
        6 => [
            "STATS",
            "STATS {}",
            "STATS {\"x\":1}",
            "STATS [",
            "QUITS {}",
            "QUIT [1]",
        ][rng.below(6) as usize]
            .into(),
        // A broken body: a good line cut short.
        _ => {
            let line = mutated_gen(rng, n_vocab);
            let cut = rng.below(line.len() as u64) as usize;
            line.chars().take(cut).collect()
        }
    }
}

fn random_lines_leave_the_engine_serving(name: &str, seed: u64) {
    let model = served_model(name);
    let mut e = Engine::start(name, &["--max-context", "256", "--park-mib", "1"]);
    let n_vocab = e.n_vocab();
    let mut rng = Rng::new(seed);
    // The writer and the reader run together: the engine's answers must be drained while lines flow.
    let lines: Vec<String> = (0..2000).map(|_| random_line(&mut rng, n_vocab)).collect();
    for line in &lines {
        assert!(!line.contains('\n'));
    }
    let mut stdin_lines = lines.clone();
    stdin_lines.push(r#"STATS {"end":"marker"}"#.into());
    let text = stdin_lines.join("\n") + "\n";
    let writer = {
        let mut stdin = e.take_stdin();
        std::thread::spawn(move || {
            use std::io::Write;
            stdin.write_all(text.as_bytes()).unwrap();
            stdin
        })
    };
    // Every line the engine writes is a protocol line; count STATS answers until the last one.
    let stats_sent = stdin_lines
        .iter()
        .filter(|l| l.trim_end() == "STATS" || l.starts_with("STATS {") && l.ends_with('}'))
        .count();
    let mut stats_seen = 0;
    let mut errors = 0;
    let mut last_stats = None;
    while stats_seen < stats_sent {
        match e.next() {
            FromEngine::Stats(s) => {
                stats_seen += 1;
                last_stats = Some(s);
            }
            FromEngine::Err(_) => errors += 1,
            FromEngine::Ready(_) => panic!("a second READY"),
            _ => {}
        }
    }
    assert!(
        errors > lines.len() / 2,
        "{errors} errors for {} lines",
        lines.len()
    );
    let last = last_stats.as_ref().unwrap();
    eprintln!(
        "{name}: {errors} ERR for {} lines; {} requests ran, {} cancelled, {} kept conversations",
        lines.len(),
        last.extra["requests"],
        last.extra["cancelled"],
        last.conversations.len()
    );
    // Random GENs were accepted too: each either ran or was cancelled by a random CANCEL (which of the two
    // depends on timing: a loaded machine runs fewer before the CANCEL lines reach them).
    let accepted =
        last.extra["requests"].as_u64().unwrap() + last.extra["cancelled"].as_u64().unwrap();
    assert!(accepted > 10, "random GENs were accepted too ({accepted})");
    let stdin = writer.join().unwrap();
    e.put_stdin(stdin);
    // Every line is answered by now but GENs still running or queued: wait for their ends.
    let last_stats = last_stats.unwrap();
    let mut pending =
        last_stats.queued as usize + usize::from(!last_stats.extra["running"].is_null());
    while pending > 0 {
        match e.next() {
            FromEngine::Done(_) | FromEngine::Err(_) => pending -= 1,
            FromEngine::Tokens(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    // A fresh conversation gives the reference tokens.
    let prompt = rng.tokens(24, n_vocab);
    let check = Gen {
        max_tokens: Some(8),
        conversation: Some("fresh-after-fuzz".into()),
        ..Gen::new("check", prompt.clone())
    };
    let answer = e.gen(&check).unwrap();
    assert_eq!(answer.done.cached_tokens, 0);
    assert_follows(&answer, &reference(&model, &prompt, 8), 0.0, name);
    let (status, rest) = e.close();
    assert!(status.success() && rest.is_empty(), "{rest:?}");
}

#[test]
fn qwen3moe_survives_random_lines() {
    random_lines_leave_the_engine_serving(FIXTURES[0], 31);
}

#[test]
fn qwen35moe_survives_random_lines() {
    random_lines_leave_the_engine_serving(FIXTURES[2], 32);
}

#[test]
fn gemma3_survives_random_lines() {
    random_lines_leave_the_engine_serving(FIXTURES[4], 33);
}
