//! Issue §3 through the real binary: every bad line or request gets a clear ERR (with the request id when
//! it could be read), and the engine keeps serving with its kept state intact; a model that cannot be
//! loaded is one ERR with a null id and a failure exit; QUIT and the end of stdin end it with success.
//! Cost: a few engine processes on a tiny model and one 64 MiB line through a pipe, a few seconds.

mod serve_support;

use poly_protocol::{ErrorCode, FromEngine, Gen, ToEngine, MAX_LINE_BYTES};
use serve_support::{
    assert_follows, expect_err, fixture, reference, served_model, Engine, Rng, FIXTURES,
};

const MODEL: &str = FIXTURES[0];

/// Each bad line, and the error it must get: (line, code, id).
fn bad_lines(n_vocab: u32) -> Vec<(String, ErrorCode, Option<&'static str>)> {
    use ErrorCode::{BadRequest, ContextOverflow};
    let gen = |body: &str| format!("GEN {{\"id\":\"x\",{body}}}");
    vec![
        // Malformed lines.
        ("GEN".into(), BadRequest, None),
        ("GEN{\"id\":\"x\",\"tokens\":[1]}".into(), BadRequest, None),
        ("   ".into(), BadRequest, None),
        ("".into(), BadRequest, None),
        // An unknown verb.
        ("HELLO {}".into(), BadRequest, None),
        ("gen {\"id\":\"x\",\"tokens\":[1]}".into(), BadRequest, None),
        // Invalid JSON, or JSON that is not an object.
        (
            "GEN {\"id\":\"x\",\"tokens\":[1,2}".into(),
            BadRequest,
            None,
        ),
        ("GEN [1,2,3]".into(), BadRequest, None),
        ("CANCEL {\"id\":".into(), BadRequest, None),
        // A missing or unusable id.
        ("GEN {\"tokens\":[1,2]}".into(), BadRequest, None),
        ("GEN {\"id\":7,\"tokens\":[1,2]}".into(), BadRequest, None),
        (
            "GEN {\"id\":\"\",\"tokens\":[1,2]}".into(),
            BadRequest,
            None,
        ),
        ("CANCEL {}".into(), BadRequest, None),
        // Tokens outside the vocabulary, or not token ids at all.
        (
            gen(&format!("\"tokens\":[1,{n_vocab}]")),
            BadRequest,
            Some("x"),
        ),
        (gen("\"tokens\":[1,-2]"), BadRequest, Some("x")),
        (gen("\"tokens\":[1,99999999999]"), BadRequest, Some("x")),
        (gen("\"tokens\":\"hello\""), BadRequest, Some("x")),
        (
            gen(&format!("\"tokens\":[1],\"stop_tokens\":[{n_vocab}]")),
            BadRequest,
            Some("x"),
        ),
        // An empty prompt.
        (gen("\"tokens\":[]"), BadRequest, Some("x")),
        // A prompt plus max_tokens beyond the context (--max-context 64).
        (
            gen("\"tokens\":[1,2,3],\"max_tokens\":62"),
            ContextOverflow,
            Some("x"),
        ),
        (
            gen(&format!("\"tokens\":[{}]", vec!["5"; 65].join(","))),
            ContextOverflow,
            Some("x"),
        ),
        // Negative or absurd sampling values.
        (
            gen("\"tokens\":[1],\"temperature\":-1"),
            BadRequest,
            Some("x"),
        ),
        (
            gen("\"tokens\":[1],\"temperature\":1e30"),
            BadRequest,
            Some("x"),
        ),
        (gen("\"tokens\":[1],\"top_p\":1.5"), BadRequest, Some("x")),
        (gen("\"tokens\":[1],\"min_p\":-0.1"), BadRequest, Some("x")),
        (gen("\"tokens\":[1],\"top_k\":-3"), BadRequest, Some("x")),
        (
            gen("\"tokens\":[1],\"repeat_penalty\":0"),
            BadRequest,
            Some("x"),
        ),
        (
            gen("\"tokens\":[1],\"frequency_penalty\":1000"),
            BadRequest,
            Some("x"),
        ),
        (
            gen("\"tokens\":[1],\"top_logprobs\":100000"),
            BadRequest,
            Some("x"),
        ),
        (
            gen("\"tokens\":[1],\"max_tokens\":-1"),
            BadRequest,
            Some("x"),
        ),
        (
            gen("\"tokens\":[1],\"seed\":\"lucky\""),
            BadRequest,
            Some("x"),
        ),
        (
            gen("\"tokens\":[1],\"max_tokens\":4,\"checkpoint_at\":9"),
            BadRequest,
            Some("x"),
        ),
        // CANCEL of an unknown id.
        (
            "CANCEL {\"id\":\"nobody\"}".into(),
            BadRequest,
            Some("nobody"),
        ),
    ]
}

#[test]
fn every_bad_line_gets_an_err_and_the_kept_state_survives() {
    let model = served_model(MODEL);
    let mut e = Engine::start(MODEL, &["--max-context", "64"]);
    let n_vocab = e.n_vocab();
    let mut rng = Rng::new(11);
    let prompt = rng.tokens(20, n_vocab);
    let first = e.gen(&Gen::new("keep", prompt.clone())).unwrap_err();
    // The default of 256 tokens does not fit in 64: the error says so and names the request.
    assert_eq!(
        (first.code, first.id.as_deref()),
        (ErrorCode::ContextOverflow, Some("keep"))
    );
    let keep = Gen {
        max_tokens: Some(6),
        ..Gen::new("keep", prompt.clone())
    };
    let kept = e.gen(&keep).unwrap();
    assert_follows(&kept, &reference(&model, &prompt, 6), 0.0, "first");

    for (line, code, id) in bad_lines(n_vocab) {
        e.send_line(&line);
        expect_err(&mut e, code, id, &line);
    }
    // Not UTF-8.
    e.send_bytes(b"GEN {\"id\":\"\xff\xfe\",\"tokens\":[1]}\n");
    expect_err(&mut e, ErrorCode::BadRequest, None, "not UTF-8");
    // A line longer than 64 MiB is skipped without being kept, then the next line is read.
    let mut long = vec![b'x'; MAX_LINE_BYTES + 1];
    long.push(b'\n');
    e.send_bytes(&long);
    drop(long);
    expect_err(&mut e, ErrorCode::BadRequest, None, "a line over 64 MiB");
    e.send(&ToEngine::Stats);
    let FromEngine::Stats(stats) = e.next() else {
        panic!("expected STATS")
    };
    assert!(
        stats.rss_bytes < MAX_LINE_BYTES as u64,
        "the long line was not kept: RSS {}",
        stats.rss_bytes
    );

    // The kept state is intact: a continuation reads only what is new, and gives the fresh tokens.
    let more = [&prompt[..], &kept.ids(), &[7, 8, 9]].concat();
    let next = e
        .gen(&Gen {
            max_tokens: Some(6),
            ..Gen::new("next", more.clone())
        })
        .unwrap();
    assert_eq!(
        next.done.cached_tokens as usize,
        prompt.len() + kept.ids().len() - 1
    );
    assert_follows(&next, &reference(&model, &more, 6), 0.1, "after the errors");
    let (status, rest) = e.close();
    assert!(status.success() && rest.is_empty(), "{rest:?}");
}

#[test]
fn a_model_that_cannot_load_is_one_err_and_a_failure_exit() {
    let dir = std::env::temp_dir().join(format!("poly-serve-robust-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let junk = dir.join("junk.gguf");
    std::fs::write(&junk, b"GGUF but not really a model file").unwrap();
    // A truncated real model: the header reads, the tensors do not fit.
    let real = std::fs::read(fixture(MODEL)).unwrap();
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, &real[..real.len() / 2]).unwrap();
    for path in [junk.clone(), cut.clone(), dir.join("missing.gguf")] {
        let mut e = Engine::spawn(&path, &[]);
        // The ERR is read while stdin is still open: a pipe closed with nothing sent says the server is
        // gone, and an engine still loading may then exit without a word (the test below).
        let first = e.next_line();
        let (status, rest) = e.close();
        let lines: Vec<String> = first.into_iter().chain(rest).collect();
        assert!(!status.success(), "{path:?}");
        assert_eq!(lines.len(), 1, "{path:?}: {lines:?}");
        match FromEngine::parse(&lines[0]).unwrap() {
            FromEngine::Err(err) => {
                assert_eq!((err.id, err.code), (None, ErrorCode::Internal), "{path:?}");
                assert!(err.message.contains("cannot load"), "{}", err.message);
            }
            other => panic!("{path:?}: expected ERR, got {other:?}"),
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A server gone while the model loads (its end of stdin closed, nothing sent) ends the engine at once,
/// not when the load is done: here a model path that is a FIFO nobody writes, whose opening never ends,
/// so without the watch the engine would wait forever.
#[test]
fn an_engine_whose_server_is_gone_while_it_loads_exits_at_once() {
    let dir = std::env::temp_dir().join(format!("poly-serve-orphan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("never-written.gguf");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("run mkfifo");
    assert!(made.success(), "mkfifo {fifo:?}");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_poly-engine"))
        .arg("--model")
        .arg(&fifo)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start poly-engine");
    drop(child.stdin.take());
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let status = child.wait();
        let _ = tx.send(());
        (child, status)
    });
    let ended = rx.recv_timeout(std::time::Duration::from_secs(60)).is_ok();
    if !ended {
        // Free the engine (and the waiter) by opening the FIFO for writing, then fail.
        let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
    }
    let (mut child, status) = waiter.join().expect("the waiter");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        ended,
        "the engine still loading 60 s after its stdin closed"
    );
    let status = status.expect("wait");
    assert_eq!(status.code(), Some(3), "the orphaned load's exit status");
    let mut log = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut log)
        .unwrap();
    assert!(log.contains("closed the protocol pipe"), "{log}");
}

#[test]
fn quit_and_end_of_input_exit_with_success() {
    let mut e = Engine::start(MODEL, &[]);
    e.send_line("QUIT {}");
    let (status, rest) = e.close();
    assert!(status.success() && rest.is_empty(), "{rest:?}");
    // Bare QUIT, with a request still queued behind a running one: both are answered with a cancel.
    let mut e = Engine::start(MODEL, &["--max-context", "4096"]);
    let long = Gen {
        max_tokens: Some(4000),
        stop_tokens: Some(vec![]),
        ..Gen::new("long", vec![1, 2, 3])
    };
    e.send(&ToEngine::Gen(long));
    e.send(&ToEngine::Gen(Gen::new("waits", vec![1, 2, 3])));
    assert!(matches!(e.next(), FromEngine::Tokens(t) if t.id == "long"));
    e.send_line("QUIT");
    let (status, rest) = e.close();
    assert!(status.success());
    let dones: Vec<(String, bool)> = rest
        .iter()
        .filter_map(|l| match FromEngine::parse(l).unwrap() {
            FromEngine::Done(d) => Some((d.id, d.reason == poly_protocol::StopReason::Cancel)),
            _ => None,
        })
        .collect();
    assert_eq!(
        dones,
        [("long".to_string(), true), ("waits".to_string(), true)]
    );
    // End of input alone.
    let e = Engine::start(MODEL, &[]);
    let (status, rest) = e.close();
    assert!(status.success() && rest.is_empty(), "{rest:?}");
}

/// A prompt read in several forward calls says how far it got after each but the last (`PROGRESS`), so
/// that the server can tell a long read from a stopped engine; then its answer comes as usual.
#[test]
fn a_long_read_sends_progress_between_its_forward_calls() {
    let mut e = Engine::start(MODEL, &["--ubatch", "8"]);
    let n_vocab = e.n_vocab();
    let prompt = Rng::new(17).tokens(30, n_vocab);
    e.send(&ToEngine::Gen(Gen {
        max_tokens: Some(2),
        ..Gen::new("long", prompt)
    }));
    let mut progress = Vec::new();
    loop {
        let line = e.next_line().expect("an answer");
        match FromEngine::parse(&line).unwrap() {
            FromEngine::Progress(p) => {
                assert_eq!((p.id.as_str(), p.prompt_tokens), ("long", 30), "{line}");
                progress.push(p.prompt_read);
            }
            FromEngine::Tokens(t) => assert_eq!(t.id, "long"),
            FromEngine::Done(d) => {
                assert_eq!(d.generated, 2);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(
        progress,
        vec![8, 16, 24],
        "one line after each call but the last"
    );
}

/// READY counts the routed experts of every MoE block its architecture's tensor table binds: the tiny
/// qwen3moe fixture's 16 experts in each of its blocks, a dense model none.
#[test]
fn ready_counts_the_experts_of_every_moe_block() {
    let file = poly_models::GgufFile::open(fixture(MODEL)).expect("fixture");
    let md = file.metadata();
    let per_block = md.arch_u32("expert_count").expect("experts") as u64;
    let blocks = md.arch_u32("block_count").expect("blocks") as u64;
    let e = Engine::start(MODEL, &[]);
    assert_eq!(
        e.ready.as_ref().expect("ready").experts_total,
        per_block * blocks
    );
    e.close();
    let e = Engine::start("gemma3-tiny-q4km.gguf", &[]);
    assert_eq!(e.ready.as_ref().expect("ready").experts_total, 0);
    e.close();
}
