//! Cancellation and the request queue through the real binary: CANCEL stops a running GEN between tokens
//! (its DONE counts exactly the tokens sent) or between the forward calls of its prompt read, and leaves
//! the kept state as it was; queued GENs run in order, a queued one can be cancelled before it starts,
//! beyond the queue's depth a GEN is answered `busy`, and STATS answers while a GEN runs.
//! Cost: three engine processes on tiny models, a second or two.

mod serve_support;

use poly_engine::serve::QUEUE_DEPTH;
use poly_engine::Model;
use poly_protocol::{ErrorCode, FromEngine, Gen, StopReason, ToEngine};
use serve_support::{assert_follows, fixture, reference, Engine, Rng, FIXTURES};

/// A GEN that would run for thousands of tokens unless stopped.
fn endless(id: &str, tokens: Vec<u32>) -> Gen {
    Gen {
        max_tokens: Some(3000),
        stop_tokens: Some(vec![]),
        ..Gen::new(id, tokens)
    }
}

fn short(id: &str, tokens: Vec<u32>) -> Gen {
    Gen {
        max_tokens: Some(3),
        ..Gen::new(id, tokens)
    }
}

#[test]
fn cancel_stops_between_tokens_and_keeps_what_was_kept() {
    // qwen35moe: recurrent layers, whose state a cancelled request must put back from its checkpoint.
    let name = FIXTURES[2];
    let model = Model::load(fixture(name)).unwrap();
    let mut e = Engine::start(name, &["--max-context", "4096"]);
    let mut rng = Rng::new(21);
    let prompt = rng.tokens(30, e.n_vocab());
    let first = e.gen(&short("first", prompt.clone())).unwrap();
    let kept = prompt.len() + first.ids().len() - 1;

    // Continue the conversation, then cancel after a few tokens.
    let longer = [&prompt[..], &first.ids(), &[11, 12, 13]].concat();
    e.send(&ToEngine::Gen(endless("long", longer.clone())));
    let mut sent = 0;
    while sent < 5 {
        match e.next() {
            FromEngine::Tokens(t) => sent += t.tokens.len(),
            other => panic!("expected T, got {other:?}"),
        }
    }
    e.send_line(r#"CANCEL {"id":"long"}"#);
    let answer = e.collect("long").unwrap();
    let done = answer.done;
    assert_eq!(done.reason, StopReason::Cancel);
    assert_eq!(done.generated as usize, sent + answer.tokens.len());
    assert!(done.generated < 3000);
    assert_eq!(done.cached_tokens as usize, kept);

    // The cancelled request kept nothing: the state is the first request's, so this continues from it.
    let other = [&prompt[..], &first.ids(), &[21, 22]].concat();
    let after = e.gen(&short("after", other.clone())).unwrap();
    assert_eq!(after.done.cached_tokens as usize, kept);
    assert_follows(&after, &reference(&model, &other, 3), 0.1, "after a cancel");
    // Cancelling what has ended is cancelling an unknown id.
    e.send_line(r#"CANCEL {"id":"long"}"#);
    let err = e.next_err();
    assert_eq!(
        (err.code, err.id.as_deref()),
        (ErrorCode::BadRequest, Some("long"))
    );
}

#[test]
fn requests_queue_in_order_and_beyond_the_queue_are_busy() {
    let name = FIXTURES[0];
    let model = Model::load(fixture(name)).unwrap();
    let mut e = Engine::start(name, &["--max-context", "4096"]);
    let mut rng = Rng::new(22);
    let n_vocab = e.n_vocab();
    e.send(&ToEngine::Gen(endless("run", rng.tokens(8, n_vocab))));
    assert!(matches!(e.next(), FromEngine::Tokens(t) if t.id == "run"));
    // While it runs: fill the queue, one more, a duplicate id, then STATS.
    let prompts: Vec<Vec<u32>> = (0..QUEUE_DEPTH).map(|_| rng.tokens(6, n_vocab)).collect();
    for (i, p) in prompts.iter().enumerate() {
        e.send(&ToEngine::Gen(short(&format!("q{i}"), p.clone())));
    }
    e.send(&ToEngine::Gen(short("extra", vec![1, 2])));
    e.send(&ToEngine::Gen(short("q0", vec![1, 2])));
    e.send(&ToEngine::Gen(short("run", vec![1, 2])));
    e.send(&ToEngine::Stats);
    e.send_line(r#"CANCEL {"id":"q1"}"#);
    e.send_line(r#"CANCEL {"id":"run"}"#);

    let mut run_tokens = 1;
    let mut errors = Vec::new();
    let mut stats = None;
    let mut dones = Vec::new();
    let mut answers: Vec<Vec<u32>> = vec![Vec::new(); QUEUE_DEPTH];
    while dones.len() < QUEUE_DEPTH + 1 {
        match e.next() {
            FromEngine::Tokens(t) if t.id == "run" => run_tokens += t.tokens.len(),
            FromEngine::Tokens(t) => {
                let i: usize = t.id[1..].parse().unwrap();
                answers[i].extend(&t.tokens);
            }
            FromEngine::Err(err) => errors.push((err.id.unwrap_or_default(), err.code)),
            FromEngine::Stats(s) => stats = Some(s),
            FromEngine::Done(d) => dones.push(d),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(
        errors,
        [
            ("extra".to_string(), ErrorCode::Busy),
            ("q0".to_string(), ErrorCode::BadRequest),
            ("run".to_string(), ErrorCode::BadRequest),
        ]
    );
    let stats = stats.expect("STATS while a request runs");
    assert_eq!(stats.queued as usize, QUEUE_DEPTH);
    assert_eq!(stats.extra["running"], "run");
    // The conversation it works on, out of the store while it runs, as it was when it began.
    assert_eq!(stats.extra["running_conversation"]["tokens"], 0);
    assert!(stats.conversations.is_empty());
    // q1 is answered at once, before anything ran; then run's cancel; then the rest in order.
    let order: Vec<(&str, StopReason)> = dones.iter().map(|d| (d.id.as_str(), d.reason)).collect();
    let mut want = vec![("q1", StopReason::Cancel), ("run", StopReason::Cancel)];
    let rest: Vec<String> = (0..QUEUE_DEPTH)
        .filter(|&i| i != 1)
        .map(|i| format!("q{i}"))
        .collect();
    want.extend(rest.iter().map(|id| (id.as_str(), StopReason::Length)));
    assert_eq!(order, want);
    assert_eq!((dones[0].generated, dones[0].prompt_tokens), (0, 6));
    assert_eq!(dones[1].generated as usize, run_tokens);
    for (i, p) in prompts.iter().enumerate().filter(|&(i, _)| i != 1) {
        let fresh = reference(&model, p, 3);
        let want: Vec<u32> = fresh.iter().map(|s| s.token).collect();
        assert_eq!(answers[i], want, "q{i}");
    }
    assert!(answers[1].is_empty());
}

#[test]
fn cancel_stops_a_prompt_read_between_forward_calls() {
    let name = FIXTURES[0];
    let mut e = Engine::start(name, &["--max-context", "8192"]);
    let mut rng = Rng::new(23);
    let n_vocab = e.n_vocab();
    let prompt = rng.tokens(10, n_vocab);
    let before = e.gen(&short("before", prompt.clone())).unwrap();
    let kept = prompt.len() + before.ids().len() - 1;
    // 1,600 more tokens: four forward calls of up to 512, each long enough for the CANCEL to arrive.
    let tail = rng.tokens(1600, n_vocab);
    let long = [&prompt[..], &before.ids(), &tail].concat();
    e.send(&ToEngine::Gen(endless("long", long.clone())));
    e.send_line(r#"CANCEL {"id":"long"}"#);
    let answer = e.collect("long").unwrap();
    assert_eq!(answer.done.reason, StopReason::Cancel);
    assert_eq!(answer.done.generated, 0, "cancelled before the first token");
    assert!(answer.tokens.is_empty());
    assert_eq!(answer.done.cached_tokens as usize, kept);
    // What the cancelled read had read is not kept: the state is still the first request's.
    let next = [&prompt[..], &before.ids(), &tail[..600]].concat();
    let after = e.gen(&short("after", next)).unwrap();
    assert_eq!(after.done.cached_tokens as usize, kept);
}
