//! Every fuzz target of `fuzz/` for a bounded time, on the stable toolchain, as CI runs them
//! (`tests/run.sh`): `cargo run --release -p poly-tests --bin fuzz_smoke -- [--seconds N] [TARGET...]`.
//!
//! The libFuzzer targets (`fuzz/`, nightly, coverage-guided) are for long runs; this runner calls the
//! same bodies (`fuzz/src/lib.rs`, `fuzz/src/targets.rs`) on mutations of a small seed corpus, from a
//! fixed seed: no coverage feedback, so it finds shallow faults only, but it runs on every change. A
//! panic in a target is a finding: the input is written to `target/fuzz-smoke/` and the run fails.
//! It prints the cases run per target.

#[path = "../../../fuzz/src/lib.rs"]
#[allow(dead_code)]
mod gguf_checks;
#[path = "../../../fuzz/src/targets.rs"]
mod targets;

use poly_models::gguf::{parse_gguf_bytes, GgufFile, GgufWriter, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Panics seen by the hook, in every thread.
static PANICS: AtomicU64 = AtomicU64::new(0);

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One mutation of `input`: bit flips, byte changes, insertions of random bytes or of a dictionary
/// word, deletions, duplications, or a splice with another corpus entry.
fn mutate(rng: &mut Rng, input: &[u8], corpus: &[Vec<u8>], dict: &[&[u8]]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let len = out.len();
        match rng.below(8) {
            0 if len > 0 => {
                let i = rng.below(len);
                out[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                out[i] = [0u8, 0xff, 0x7f, 0x80, b'"', b'{', b'\n', b'%'][rng.below(8)];
            }
            2 => {
                let at = rng.below(len + 1);
                let n = 1 + rng.below(8);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                out.splice(at..at, bytes);
            }
            3 if !dict.is_empty() => {
                let at = rng.below(len + 1);
                let word = dict[rng.below(dict.len())];
                out.splice(at..at, word.iter().copied());
            }
            4 if len > 0 => {
                let a = rng.below(len);
                let b = (a + 1 + rng.below(16)).min(len);
                out.drain(a..b);
            }
            5 if len > 0 => {
                let a = rng.below(len);
                let b = (a + 1 + rng.below(64)).min(len);
                let piece = out[a..b].to_vec();
                let at = rng.below(out.len() + 1);
                out.splice(at..at, piece);
            }
            6 if !corpus.is_empty() => {
                let other = &corpus[rng.below(corpus.len())];
                let cut = rng.below(len + 1);
                let from = rng.below(other.len() + 1);
                out.truncate(cut);
                out.extend_from_slice(&other[from..]);
            }
            _ if len > 0 => {
                // An integer field set to an edge value (lengths, counts).
                let i = rng.below(len);
                let edge = [0u32, 1, u32::MAX, 1 << 31, 0xffff][rng.below(5)].to_le_bytes();
                let end = (i + 4).min(len);
                out[i..end].copy_from_slice(&edge[..end - i]);
            }
            _ => {}
        }
    }
    out.truncate(1 << 20);
    out
}

fn gguf_seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    for (n_tensors, version) in [(0usize, 3u32), (2, 3), (1, 2)] {
        let mut w = GgufWriter::new();
        w.set_version(version).expect("version");
        w.add_kv("general.architecture", "qwen3moe");
        w.add_kv("qwen3moe.block_count", 2u32);
        w.add_kv("qwen3moe.context_length", 64u32);
        w.add_kv("qwen3moe.rope.freq_base", 1e6f32);
        w.add_kv(
            "qwen3moe.attention.head_count_kv",
            Value::from(vec![2i32, 4]),
        );
        w.add_kv("tokenizer.ggml.model", "gpt2");
        w.add_kv(
            "tokenizer.ggml.tokens",
            Value::string_array(["a", "b", "ab"]),
        );
        w.add_kv("tokenizer.ggml.token_type", Value::i32_array([1, 1, 3]));
        for i in 0..n_tensors {
            w.add_tensor(
                format!("blk.{i}.attn_norm.weight"),
                poly_kernels::quant::GgmlType::F32,
                &[4],
            )
            .expect("tensor");
        }
        let bytes = w
            .to_bytes(|i, _, out| {
                for (j, b) in out.iter_mut().enumerate() {
                    *b = (i * 31 + j) as u8;
                }
                Ok(())
            })
            .expect("seed");
        seeds.push(bytes);
    }
    seeds
}

fn gguf_parse(data: &[u8]) {
    if let Ok(h) = parse_gguf_bytes(data, "fuzz") {
        gguf_checks::check_parsed(data, &h);
        gguf_checks::exercise_accessors(&h.metadata);
    }
}

fn gguf_open(data: &[u8]) {
    let path = std::env::temp_dir().join(format!("poly-fuzz-smoke-{}.gguf", std::process::id()));
    std::fs::write(&path, data).expect("write");
    if let Ok(f) = GgufFile::open(&path) {
        for t in f.tensors() {
            assert_eq!(t.data.len() as u64, t.info.n_bytes);
        }
        assert_eq!(f.tensors().count(), f.n_tensors());
        gguf_checks::exercise_accessors(f.metadata());
    }
}

fn protocol_seeds() -> Vec<Vec<u8>> {
    [
        r#"GEN {"id":"r1","tokens":[1,2,3],"max_tokens":2,"temperature":0.5,"top_k":4,"top_p":0.9,"min_p":0.1,"repeat_penalty":1.1,"seed":7,"stop_tokens":[9],"top_logprobs":2,"conversation":"c1","checkpoint_at":1}"#,
        r#"CANCEL {"id":"r1"}"#,
        "STATS",
        "QUIT {}",
        r#"READY {"protocol":1,"model":"m","arch":"qwen3moe","n_vocab":2048,"n_ctx":4096,"bos":null,"eos":[0],"device":"cpu","experts_total":0,"experts_vram":0}"#,
        r#"T {"id":"r1","tokens":[9707],"logprobs":[-0.31],"top":[[[9707,-0.31],[13048,-1.9]]]}"#,
        r#"DONE {"id":"r1","reason":"length","prompt_tokens":3,"cached_tokens":0,"generated":2,"prefill_ms":4.1,"decode_ms":9.8,"experts_vram_share":null,"draft_proposed":0,"draft_accepted":0}"#,
        r#"ERR {"id":null,"code":"busy","message":"x"}"#,
        r#"PROGRESS {"id":"r1","prompt_read":512,"prompt_tokens":3000}"#,
        r#"STATS {"rss_bytes":1,"vram_bytes":null,"conversations":[{"id":"c1","tokens":3,"active":true,"bytes":9,"checkpoints":0}],"parked_bytes":0,"park_limit_bytes":0,"queued":0}"#,
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

fn http_seeds() -> Vec<Vec<u8>> {
    let body = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;
    [
        "GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n".to_string(),
        "HEAD /api/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n".to_string(),
        format!("POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()),
        format!("POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n", body.len()),
        "OPTIONS /api/models/load HTTP/1.1\r\nHost: localhost\r\nOrigin: http://allowed.example\r\nAccess-Control-Request-Method: POST\r\n\r\n".to_string(),
        "POST /api/models/load HTTP/1.1\r\nHost: localhost\r\nOrigin: https://evil.example\r\nContent-Type: text/plain\r\nContent-Length: 17\r\n\r\n{\"model\":\"qwen\"}".to_string(),
        "POST /v1/messages/count_tokens HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}".to_string(),
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

fn template_seeds() -> Vec<Vec<u8>> {
    let dir = poly_tests::fixtures_dir().join("text/templates");
    let mut seeds: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .map(|d| {
            let mut paths: Vec<PathBuf> = d.filter_map(|e| e.ok().map(|e| e.path())).collect();
            paths.sort();
            paths.iter().filter_map(|p| std::fs::read(p).ok()).collect()
        })
        .unwrap_or_default();
    seeds.push(
        b"{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"
            .to_vec(),
    );
    seeds.push(
        b"{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\0[{\"role\":\"user\",\"content\":\"hi\"}]"
            .to_vec(),
    );
    seeds
}

fn picture_seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    for dir in ["vision/jpeg", "vision"] {
        let Ok(d) = std::fs::read_dir(poly_tests::fixtures_dir().join(dir)) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = d.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for p in paths {
            let small = std::fs::metadata(&p)
                .map(|m| m.len() < 8192)
                .unwrap_or(false);
            if small && matches!(p.extension().and_then(|e| e.to_str()), Some("jpg" | "png")) {
                seeds.extend(std::fs::read(&p).ok());
            }
        }
    }
    seeds
}

struct Target {
    name: &'static str,
    run: fn(&[u8]),
    seeds: fn() -> Vec<Vec<u8>>,
    dict: &'static [&'static [u8]],
}

const TARGETS: &[Target] = &[
    Target {
        name: "gguf_parse",
        run: gguf_parse,
        seeds: gguf_seeds,
        dict: &[b"GGUF", b"general.architecture", b"block_count"],
    },
    Target {
        name: "gguf_open",
        run: gguf_open,
        seeds: gguf_seeds,
        dict: &[b"GGUF", b"general.alignment"],
    },
    Target {
        name: "protocol_line",
        run: targets::protocol_line,
        seeds: protocol_seeds,
        dict: &[
            b"\"id\":",
            b"null",
            b"1e309",
            b"-0",
            b"\"\\u0000\"",
            b"[]",
            b"{}",
            b"\n",
        ],
    },
    Target {
        name: "http_request",
        run: targets::http_request,
        seeds: http_seeds,
        dict: &[
            b"\r\n",
            b"Content-Length: 5\r\n",
            b"Transfer-Encoding: chunked\r\n",
            b"Host: localhost\r\n",
            b"Origin: null\r\n",
            b"Authorization: Bearer x\r\n",
            b"Expect: 100-continue\r\n",
            b" HTTP/1.0",
            b"/v1/completions",
            b"/api/models/load",
        ],
    },
    Target {
        name: "picture",
        run: targets::picture,
        seeds: picture_seeds,
        dict: &[
            b"\xff\xd8",
            b"\xff\xd9",
            b"\xff\xda\x00\x0c\x03\x01\x00\x02\x11\x03\x11\x00\x3f\x00",
            b"\xff\xc2",
            b"\xff\xc4",
            b"\xff\xdd\x00\x04\x00\x01",
            b"\xff\xd0",
            b"\xff\x00",
            b"\x22",
            b"\x11",
        ],
    },
    Target {
        name: "chat_template",
        run: targets::chat_template,
        seeds: template_seeds,
        dict: &[
            b"{{ ",
            b" }}",
            b"{% for i in range(9) %}",
            b"{% endfor %}",
            b"{% set x = ",
            b" ~ ",
            b" + ",
            b"|join",
            b"|tojson",
            b".replace('a','bb')",
            b"{% macro m() %}{{ caller() }}{% endmacro %}",
            b"{% call m() %}x{% endcall %}",
            b"messages",
        ],
    },
];

fn main() {
    let mut seconds = 20u64;
    let mut only: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--seconds" => {
                seconds = args
                    .next()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or_else(|| panic!("--seconds needs a number"))
            }
            name => only.push(name.to_string()),
        }
    }
    // Panics are findings, in any thread (the HTTP target's server runs its own): the hook counts
    // them, and each case compares the count before and after.
    std::panic::set_hook(Box::new(|info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        if PANICS.load(Ordering::SeqCst) <= 3 {
            eprintln!("fuzz_smoke: panic: {info}");
        }
    }));
    let out_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/fuzz-smoke");
    let mut failed = false;
    for target in TARGETS {
        if !only.is_empty() && !only.iter().any(|o| o == target.name) {
            continue;
        }
        let corpus = (target.seeds)();
        let mut rng = Rng(0x5EED ^ target.name.len() as u64);
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let (mut cases, mut crashes) = (0u64, 0u64);
        // The seeds themselves first, then mutations until the deadline.
        let mut inputs = corpus.clone().into_iter();
        while Instant::now() < deadline {
            let input = inputs.next().unwrap_or_else(|| {
                let base = &corpus[rng.below(corpus.len())];
                mutate(&mut rng, base, &corpus, target.dict)
            });
            cases += 1;
            let run = target.run;
            let before = PANICS.load(Ordering::SeqCst);
            let caught = std::panic::catch_unwind(|| run(&input)).is_err();
            if caught || PANICS.load(Ordering::SeqCst) != before {
                crashes += 1;
                let _ = std::fs::create_dir_all(&out_dir);
                let file = out_dir.join(format!("crash-{}-{cases}", target.name));
                let _ = std::fs::write(&file, &input);
                eprintln!(
                    "fuzz_smoke: {}: a panic; input in {}",
                    target.name,
                    file.display()
                );
                if crashes >= 5 {
                    break;
                }
            }
        }
        println!(
            "fuzz_smoke: {}: {cases} cases in {seconds} s, {crashes} crashes",
            target.name
        );
        failed |= crashes > 0;
    }
    if failed {
        std::process::exit(1);
    }
}
