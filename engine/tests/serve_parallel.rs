//! `poly-engine --parallel N` through the real binary: requests running at once take turns token by token
//! (each writes one token per round while others write), every answer is the one the request gives alone
//! (greedy, bit for bit with the library's fresh read), a CANCEL of one running request leaves the others'
//! answers intact, a queued one waits for a free slot, and with the default of one the answers come one
//! after the other as before.
//! Cost: a few engine processes on tiny models, a few seconds.

mod serve_support;

use std::collections::HashMap;

use poly_protocol::{FromEngine, Gen, StopReason, ToEngine, Tokens};
use serve_support::{assert_follows, reference, served_model, Answer, Engine, Rng, FIXTURES};

/// A greedy GEN of exactly `n` tokens (no stop token ends it early).
fn exactly(id: &str, tokens: Vec<u32>, n: u32) -> Gen {
    Gen {
        max_tokens: Some(n),
        stop_tokens: Some(vec![]),
        ..Gen::new(id, tokens)
    }
}

/// The lines of several requests read until each has its DONE: the ids of the T lines in the order
/// they came (DONE lines as `"<id> done"`), and each request's answer.
fn collect_all(e: &mut Engine, ids: &[&str]) -> (Vec<String>, HashMap<String, Answer>) {
    let mut order = Vec::new();
    let mut tokens: HashMap<String, Vec<Tokens>> = HashMap::new();
    let mut answers = HashMap::new();
    while answers.len() < ids.len() {
        match e.next() {
            FromEngine::Tokens(t) => {
                assert!(ids.contains(&t.id.as_str()), "T of {}", t.id);
                order.push(t.id.clone());
                tokens.entry(t.id.clone()).or_default().push(t);
            }
            FromEngine::Done(d) => {
                order.push(format!("{} done", d.id));
                let t = tokens.remove(&d.id).unwrap_or_default();
                answers.insert(d.id.clone(), Answer { tokens: t, done: d });
            }
            FromEngine::Progress(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    (order, answers)
}

/// Asserts the turns were fair: while a request has written its first token and not yet ended, no
/// other request writes two tokens in a row.
fn assert_round_robin(order: &[String]) {
    let mut writing: Vec<&str> = Vec::new();
    let mut last: Option<&str> = None;
    for line in order {
        if let Some(id) = line.strip_suffix(" done") {
            writing.retain(|w| *w != id);
            continue;
        }
        let id = line.as_str();
        if last == Some(id) {
            assert!(
                writing.iter().all(|w| *w == id),
                "{id} wrote twice in a row while {writing:?} were writing: {order:?}"
            );
        }
        if !writing.contains(&id) {
            writing.push(id);
        }
        last = Some(id);
    }
}

#[test]
fn answers_taken_in_turns_are_each_the_answer_alone() {
    // A KV model with guesses from repeats, a recurrent one, a sliding-window one.
    for name in [FIXTURES[0], FIXTURES[2], FIXTURES[4]] {
        let model = served_model(name);
        let mut e = Engine::start(name, &["--max-context", "2048", "--parallel", "2"]);
        assert_eq!(
            e.ready
                .as_ref()
                .and_then(|r| r.knobs.get("parallel").cloned()),
            Some("2".to_string()),
            "{name}: READY echoes --parallel"
        );
        let mut rng = Rng::new(41);
        let n_vocab = e.n_vocab();
        // Repeats in the prompts give the guesser something to do on the KV model.
        let base = rng.tokens(6, n_vocab);
        let prompts = [
            [&base[..], &base[..], &rng.tokens(5, n_vocab)].concat(),
            rng.tokens(9, n_vocab),
            rng.tokens(14, n_vocab),
        ];
        let lengths = [24, 8, 12];
        // Three at once with two slots: the third waits for the second's slot.
        for (i, p) in prompts.iter().enumerate() {
            e.send(&ToEngine::Gen(exactly(
                &format!("g{i}"),
                p.clone(),
                lengths[i],
            )));
        }
        let (order, answers) = collect_all(&mut e, &["g0", "g1", "g2"]);
        for (i, p) in prompts.iter().enumerate() {
            let answer = &answers[&format!("g{i}")];
            assert_eq!(answer.done.reason, StopReason::Length);
            assert_eq!(answer.done.generated, lengths[i]);
            let fresh = reference(&model, p, lengths[i] as usize);
            assert_follows(answer, &fresh, 0.0, &format!("{name}: g{i} in turns"));
        }
        // They did take turns: g1 ended while g0 was writing, and g2 started only after g1 ended.
        let at = |line: &str| order.iter().position(|l| l == line).expect(line);
        let first = |id: &str| order.iter().position(|l| l == id).expect(id);
        assert!(
            first("g1") < at("g0 done") && at("g1 done") < at("g0 done"),
            "{order:?}"
        );
        assert!(at("g1 done") < first("g2"), "{order:?}");
        assert_round_robin(&order);

        // The written tokens' forward calls were made over both states at once (the CPU,
        // batch-invariant; recurrent layers run each state's own rows), fewer than the rounds where two
        // wrote: a turn whose token was a kept guess makes no call.
        e.send(&ToEngine::Stats);
        let over_states = match e.next() {
            FromEngine::Stats(s) => s.extra["calls_over_states"].as_u64().unwrap_or(0),
            other => panic!("expected STATS, got {other:?}"),
        };
        assert!(over_states > 0, "{name}: no call over several states");

        // The same requests alone, one after the other, give the same answers.
        for (i, p) in prompts.iter().enumerate() {
            let alone = e
                .gen(&exactly(&format!("alone{i}"), p.clone(), lengths[i]))
                .unwrap();
            let together = &answers[&format!("g{i}")];
            assert_eq!(alone.ids(), together.ids(), "{name}: g{i}");
            assert_eq!(alone.logprobs(), together.logprobs(), "{name}: g{i}");
        }
    }
}

#[test]
fn cancelling_one_leaves_the_others_intact() {
    let name = FIXTURES[0];
    let model = served_model(name);
    let mut e = Engine::start(name, &["--max-context", "4096", "--parallel", "2"]);
    let mut rng = Rng::new(42);
    let n_vocab = e.n_vocab();
    let prompts = [
        rng.tokens(7, n_vocab),
        rng.tokens(8, n_vocab),
        rng.tokens(9, n_vocab),
    ];
    e.send(&ToEngine::Gen(exactly("long", prompts[0].clone(), 600)));
    e.send(&ToEngine::Gen(exactly("kept", prompts[1].clone(), 30)));
    e.send(&ToEngine::Gen(exactly("queued", prompts[2].clone(), 5)));
    // Both running have written; the third waits for a slot.
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut kept_tokens = Vec::new();
    while seen.len() < 2 {
        match e.next() {
            FromEngine::Tokens(t) => {
                if t.id == "kept" {
                    kept_tokens.push(t.clone());
                }
                *seen.entry(t.id).or_default() += 1;
            }
            other => panic!("expected T, got {other:?}"),
        }
    }
    e.send(&ToEngine::Stats);
    e.send_line(r#"CANCEL {"id":"queued"}"#);
    e.send_line(r#"CANCEL {"id":"long"}"#);
    let mut stats = None;
    let mut dones = Vec::new();
    while dones.len() < 3 {
        match e.next() {
            FromEngine::Tokens(t) if t.id == "kept" => kept_tokens.push(t),
            FromEngine::Tokens(t) => *seen.entry(t.id).or_default() += 1,
            FromEngine::Stats(s) => stats = Some(s),
            FromEngine::Done(d) => dones.push(d),
            other => panic!("unexpected {other:?}"),
        }
    }
    let stats = stats.expect("STATS");
    assert_eq!(stats.queued, 1);
    assert_eq!(stats.extra["active_requests"], 2);
    assert_eq!(stats.extra["parallel"], 2);
    let order: Vec<(&str, StopReason)> = dones.iter().map(|d| (d.id.as_str(), d.reason)).collect();
    assert_eq!(
        order,
        [
            ("queued", StopReason::Cancel),
            ("long", StopReason::Cancel),
            ("kept", StopReason::Length)
        ]
    );
    assert_eq!(dones[0].generated, 0, "the queued one never started");
    assert_eq!(dones[1].generated as usize, seen["long"]);
    assert!(dones[1].generated < 600);
    let kept = Answer {
        tokens: kept_tokens,
        done: dones[2].clone(),
    };
    assert_follows(
        &kept,
        &reference(&model, &prompts[1], 30),
        0.0,
        "beside a cancelled request",
    );
    // The slots are free again: a request after them runs as it would alone.
    let after = e.gen(&exactly("after", prompts[2].clone(), 5)).unwrap();
    assert_follows(
        &after,
        &reference(&model, &prompts[2], 5),
        0.0,
        "after a cancel",
    );
}

#[test]
fn one_slot_answers_one_request_after_the_other() {
    let name = FIXTURES[0];
    let mut e = Engine::start(name, &["--max-context", "1024"]);
    assert!(!e
        .ready
        .as_ref()
        .is_some_and(|r| r.knobs.contains_key("parallel")));
    let mut rng = Rng::new(43);
    let n_vocab = e.n_vocab();
    for id in ["a", "b", "c"] {
        e.send(&ToEngine::Gen(exactly(id, rng.tokens(5, n_vocab), 6)));
    }
    let (order, _) = collect_all(&mut e, &["a", "b", "c"]);
    let want: Vec<String> = ["a", "b", "c"]
        .iter()
        .flat_map(|id| std::iter::repeat_n(id.to_string(), 6).chain([format!("{id} done")]))
        .collect();
    assert_eq!(order, want);
}

#[test]
fn conversations_kept_by_requests_that_ran_at_once() {
    // Recurrent layers: each conversation's state is resumed from its own checkpoints.
    let name = FIXTURES[2];
    let model = served_model(name);
    let mut e = Engine::start(name, &["--max-context", "2048", "--parallel", "3"]);
    let mut rng = Rng::new(44);
    let n_vocab = e.n_vocab();
    let prompts = [rng.tokens(12, n_vocab), rng.tokens(10, n_vocab)];
    let named = |id: &str, conv: &str, p: &[u32]| Gen {
        conversation: Some(conv.into()),
        ..exactly(id, p.to_vec(), 6)
    };
    // Two conversations, and a second request of the first at the same time (it starts afresh).
    e.send(&ToEngine::Gen(named("x", "cx", &prompts[0])));
    e.send(&ToEngine::Gen(named("y", "cy", &prompts[1])));
    e.send(&ToEngine::Gen(named("x2", "cx", &prompts[0])));
    let (_, answers) = collect_all(&mut e, &["x", "y", "x2"]);
    for (id, p) in [("x", &prompts[0]), ("y", &prompts[1]), ("x2", &prompts[0])] {
        assert_follows(&answers[id], &reference(&model, p, 6), 0.0, id);
        assert_eq!(answers[id].done.cached_tokens, 0, "{id}");
    }
    // Each conversation continues from what its request kept.
    for (id, conv, p) in [("x", "cx", &prompts[0]), ("y", "cy", &prompts[1])] {
        let next = [&p[..], &answers[id].ids(), &[5, 6, 7]].concat();
        let more = e.gen(&named(&format!("{id}-more"), conv, &next)).unwrap();
        assert_eq!(
            more.done.cached_tokens as usize,
            p.len() + 6 - 1,
            "{id} continues its conversation"
        );
        assert_follows(&more, &reference(&model, &next, 6), 0.0, conv);
    }
}
