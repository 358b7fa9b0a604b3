//! Driving the real `poly-engine` binary over pipes, for the `serve_*` tests: start it on a committed
//! fixture, write request lines, read protocol lines (with a time limit, so a hung engine fails the test
//! instead of hanging it), and compute reference generations with the library on a fresh state.

#![allow(dead_code)] // each test file uses its own part of this

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::Duration;

use poly_engine::generate::{generate, GenerateOptions, Step};
use poly_engine::sample::{Sampler, SamplerConfig};
use poly_engine::Model;
use poly_protocol::{Done, ErrorCode, ErrorReply, FromEngine, Gen, Ready, ToEngine, Tokens};

/// How long any one answer may take before the test fails.
pub const ANSWER_LIMIT: Duration = Duration::from_secs(120);

/// The committed tiny fixtures, one per architecture and quantization mix.
pub const FIXTURES: [&str; 6] = [
    "qwen3moe-tiny-q4km.gguf",
    "qwen3moe-tiny-q4k-q8.gguf",
    "qwen35moe-tiny-q4km.gguf",
    "qwen35moe-tiny-q4k-q8.gguf",
    "gemma3-tiny-q4km.gguf",
    "gemma3-tiny-q4k-q8.gguf",
];

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

/// The library's model of a fixture in the engine process's default arithmetic
/// ([`poly_engine::serve::DEFAULT_ARITHMETIC`]), to compare the engine's answers with bit for bit.
pub fn served_model(name: &str) -> Model {
    Model::load(fixture(name))
        .expect("fixture loads")
        .with_arithmetic(poly_engine::serve::DEFAULT_ARITHMETIC)
}

/// A running engine process.
pub struct Engine {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    pub ready: Option<Ready>,
}

impl Engine {
    /// Starts `poly-engine --model <fixture> <args>` and reads its READY line.
    pub fn start(fixture_name: &str, args: &[&str]) -> Engine {
        let mut e = Engine::spawn(&fixture(fixture_name), args);
        match e.next() {
            FromEngine::Ready(r) => e.ready = Some(r),
            other => panic!("expected READY, got {other:?}"),
        }
        e
    }

    /// Starts `poly-engine --model <model> <args>` on any file and reads its READY line.
    pub fn start_path(model: &std::path::Path, args: &[&str]) -> Engine {
        let mut e = Engine::spawn(model, args);
        match e.next() {
            FromEngine::Ready(r) => e.ready = Some(r),
            other => panic!("expected READY, got {other:?}"),
        }
        e
    }

    /// Starts the binary on `model` without waiting for anything.
    pub fn spawn(model: &std::path::Path, args: &[&str]) -> Engine {
        let mut child = Command::new(env!("CARGO_BIN_EXE_poly-engine"))
            .arg("--model")
            .arg(model)
            // As many threads as the library here: split-KV decode splits by the thread count, and the
            // tests compare the engine's numbers with the library's bit for bit.
            .args(["--threads", &rayon::current_num_threads().to_string()])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start poly-engine");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Engine {
            stdin: child.stdin.take(),
            child,
            lines: rx,
            ready: None,
        }
    }

    pub fn n_vocab(&self) -> u32 {
        self.ready.as_ref().map_or(0, |r| r.n_vocab)
    }

    /// Writes one line (a newline is added).
    pub fn send_line(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(line.as_bytes()).expect("write");
        stdin.write_all(b"\n").expect("write");
        stdin.flush().expect("flush");
    }

    /// Writes raw bytes.
    pub fn send_bytes(&mut self, bytes: &[u8]) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(bytes).expect("write");
        stdin.flush().expect("flush");
    }

    pub fn send(&mut self, msg: &ToEngine) {
        self.send_line(&msg.to_line());
    }

    /// The next raw line; `None` once stdout is closed.
    pub fn next_line(&mut self) -> Option<String> {
        match self.lines.recv_timeout(ANSWER_LIMIT) {
            Ok(l) => Some(l),
            Err(RecvTimeoutError::Disconnected) => None,
            Err(RecvTimeoutError::Timeout) => panic!("no answer within {ANSWER_LIMIT:?}"),
        }
    }

    /// The next message (every line must parse).
    /// `PROGRESS` lines of long reads are skipped ([`Engine::next_line`] sees them).
    pub fn next(&mut self) -> FromEngine {
        loop {
            let line = self.next_line().expect("the engine ended its output");
            match FromEngine::parse(&line) {
                Ok(FromEngine::Progress(_)) => continue,
                Ok(m) => return m,
                Err(e) => panic!("unparsable line {line:?}: {e}"),
            }
        }
    }

    /// The next message, which must be an ERR.
    pub fn next_err(&mut self) -> ErrorReply {
        match self.next() {
            FromEngine::Err(e) => e,
            other => panic!("expected ERR, got {other:?}"),
        }
    }

    /// Sends `gen` and collects its answer: the T lines and the DONE, or the ERR.
    pub fn gen(&mut self, gen: &Gen) -> Result<Answer, ErrorReply> {
        self.send(&ToEngine::Gen(gen.clone()));
        self.collect(&gen.id)
    }

    /// Reads until the DONE or ERR of request `id` (lines of other requests are not expected).
    pub fn collect(&mut self, id: &str) -> Result<Answer, ErrorReply> {
        let mut tokens = Vec::new();
        loop {
            match self.next() {
                FromEngine::Tokens(t) if t.id == id => tokens.push(t),
                FromEngine::Done(d) if d.id == id => return Ok(Answer { tokens, done: d }),
                FromEngine::Err(e) if e.id.as_deref() == Some(id) => return Err(e),
                other => panic!("unexpected line while waiting for {id}: {other:?}"),
            }
        }
    }

    /// Takes stdin, to write from another thread; give it back with [`Engine::put_stdin`].
    pub fn take_stdin(&mut self) -> ChildStdin {
        self.stdin.take().expect("stdin open")
    }

    pub fn put_stdin(&mut self, stdin: ChildStdin) {
        self.stdin = Some(stdin);
    }

    /// Closes stdin and waits for the exit, reading what is left of stdout.
    pub fn close(mut self) -> (ExitStatus, Vec<String>) {
        drop(self.stdin.take());
        let mut rest = Vec::new();
        while let Some(l) = self.next_line() {
            rest.push(l);
        }
        (self.wait(), rest)
    }

    /// Waits for the process to end (called once its stdout is closed, after which it exits at once).
    pub fn wait(&mut self) -> ExitStatus {
        self.child.wait().expect("wait")
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The answer to one GEN.
#[derive(Debug)]
pub struct Answer {
    pub tokens: Vec<Tokens>,
    pub done: Done,
}

impl Answer {
    pub fn ids(&self) -> Vec<u32> {
        self.tokens.iter().flat_map(|t| t.tokens.clone()).collect()
    }

    pub fn logprobs(&self) -> Vec<f32> {
        self.tokens
            .iter()
            .flat_map(|t| t.logprobs.clone())
            .collect()
    }
}

/// What a fresh state gives for a greedy GEN read whole with the library: each step's token, its
/// log-probability, and the two likeliest tokens.
pub fn reference(model: &Model, prompt: &[u32], max_tokens: usize) -> Vec<Step> {
    let mut state = model.new_state(0);
    let opts = GenerateOptions {
        max_tokens,
        stop_tokens: model.info().stop_tokens(),
        top_n: 2,
        ..GenerateOptions::default()
    };
    let mut sampler = Sampler::new(SamplerConfig::greedy());
    generate(model, &mut state, prompt, &opts, &mut sampler, |_| {})
        .expect("generate")
        .steps
}

/// Asserts that an answer follows the fresh read `fresh`: the same tokens with probabilities within
/// `tol`, except that where the fresh read's two likeliest tokens lie within `2·tol` of each other the
/// answer may take the other one (after which the two run apart). Returns the largest probability
/// difference seen before any such split.
pub fn assert_follows(answer: &Answer, fresh: &[Step], tol: f32, what: &str) -> f32 {
    let ids = answer.ids();
    let logprobs = answer.logprobs();
    let mut worst = 0f32;
    for (i, step) in fresh.iter().enumerate() {
        let Some(&token) = ids.get(i) else {
            panic!(
                "{what}: {} tokens, the fresh read has {}",
                ids.len(),
                fresh.len()
            )
        };
        if token != step.token {
            let margin = step.top[0].1.exp() - step.top[1].1.exp();
            assert!(
                step.top[1].0 == token && margin <= 2.0 * tol,
                "{what}: token {i} is {token}, the fresh read's {} (top two {:?})",
                step.token,
                step.top
            );
            return worst;
        }
        let d = (logprobs[i].exp() - step.logprob.exp()).abs();
        assert!(d <= tol, "{what}: token {i}: probabilities differ by {d}");
        worst = worst.max(d);
    }
    assert_eq!(ids.len(), fresh.len(), "{what}: tokens");
    worst
}

/// A small seeded generator (splitmix64), for prompts and random lines.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// `n` token ids in `1..n_vocab - 8` (clear of the special tokens the fixtures put at the end).
    pub fn tokens(&mut self, n: usize, n_vocab: u32) -> Vec<u32> {
        (0..n)
            .map(|_| 1 + self.below(u64::from(n_vocab) - 9) as u32)
            .collect()
    }
}

/// Expects an ERR of `code` for request `id`.
pub fn expect_err(e: &mut Engine, code: ErrorCode, id: Option<&str>, what: &str) -> ErrorReply {
    let err = e.next_err();
    assert_eq!(err.code, code, "{what}: {err:?}");
    assert_eq!(err.id.as_deref(), id, "{what}: {err:?}");
    assert!(!err.message.is_empty(), "{what}: a message");
    err
}

/// The library replaying what a conversation's requests should do, call for call: resume at the kept
/// prefix (KV caches cut, recurrent layers back at the nearest checkpoint), read the rest in the same
/// forward calls (split at the 512-token ubatch and, with recurrent layers, at checkpoints every `every`
/// tokens and at `checkpoint_at`), then decode greedily. Its log-probabilities must equal the engine's
/// bit for bit: keeping and restoring states loses nothing.
pub struct Mirror {
    pub state: poly_engine::state::SeqState,
    checkpoints: Vec<poly_engine::state::Checkpoint>,
    every: usize,
}

impl Mirror {
    pub fn new(model: &Model, n_ctx: usize, every: usize) -> Mirror {
        Mirror {
            state: model.new_state(n_ctx),
            checkpoints: Vec::new(),
            every,
        }
    }

    /// Runs one greedy request; returns the prompt tokens reused, the tokens and their log-probabilities.
    pub fn run(
        &mut self,
        model: &Model,
        prompt: &[u32],
        max_tokens: usize,
        checkpoint_at: Option<usize>,
    ) -> (usize, Vec<u32>, Vec<f32>) {
        use poly_engine::sample::TopLogprobs;
        use poly_models::compute::Logits;
        let s = &mut self.state;
        let recurrent = s.has_recurrent();
        let shared = s
            .tokens()
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1);
        if !recurrent {
            assert!(s.truncate(shared));
        } else if shared < s.n_past() {
            match self.checkpoints.iter().rev().find(|c| c.n_past() <= shared) {
                Some(cp) => assert!(s.restore(cp)),
                None => s.clear(),
            }
        }
        let resume = s.n_past();
        self.checkpoints.retain(|c| c.n_past() <= resume);
        let wants_checkpoint = |p: usize| {
            recurrent
                && ((self.every > 0 && p > 0 && p.is_multiple_of(self.every))
                    || checkpoint_at == Some(p))
        };
        let mut pos = resume;
        let mut logits = Vec::new();
        while pos < prompt.len() {
            if wants_checkpoint(pos) && !self.checkpoints.iter().any(|c| c.n_past() == pos) {
                keep_checkpoint(&mut self.checkpoints, s.checkpoint());
            }
            let mut next = (pos + 512).min(prompt.len());
            if recurrent {
                next = (pos + 1..next)
                    .find(|&p| wants_checkpoint(p))
                    .unwrap_or(next);
            }
            let want = if next == prompt.len() {
                Logits::Last
            } else {
                Logits::None
            };
            logits = model.eval(s, &prompt[pos..next], want).unwrap();
            pos = next;
        }
        if wants_checkpoint(pos) && !self.checkpoints.iter().any(|c| c.n_past() == pos) {
            keep_checkpoint(&mut self.checkpoints, s.checkpoint());
        }
        let stop = model.info().stop_tokens();
        let mut greedy = Sampler::new(SamplerConfig::greedy());
        let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
        while tokens.len() < max_tokens {
            let lp = TopLogprobs::new(&logits);
            let token = greedy.sample(&logits);
            tokens.push(token);
            logprobs.push(lp.of(token));
            if stop.contains(&token) || tokens.len() == max_tokens || s.room() == 0 {
                break;
            }
            logits = model.eval(s, &[token], Logits::Last).unwrap();
        }
        (resume, tokens, logprobs)
    }
}

/// Keeps `cp`, dropping the earliest beyond the engine's bound.
fn keep_checkpoint(
    kept: &mut Vec<poly_engine::state::Checkpoint>,
    cp: poly_engine::state::Checkpoint,
) {
    kept.push(cp);
    kept.sort_by_key(|c| c.n_past());
    if kept.len() > poly_engine::serve::store::MAX_CHECKPOINTS {
        kept.remove(0);
    }
}
