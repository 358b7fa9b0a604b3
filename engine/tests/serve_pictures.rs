//! GENs with pictures through the engine process (`poly-engine --model FILE --mmproj FILE`): the tiny
//! qwen35moe fixture and the tiny projector `synth --arch qwen3vl-mmproj` writes (F32, seed 1). A GEN's
//! answer with a picture is `poly-engine run --image`'s for the same prompt and picture, token for token
//! and bit for bit (both batch-invariant); the kept conversation is reused past a picture only for the
//! same picture, up to the first picture that differs (with a fresh read's answer); two requests with
//! pictures running at once (`--parallel 2`) give their answers alone; bad pictures are one ERR each and
//! the engine answers the next request as before; an engine without a projector refuses pictures, and a
//! projector on a model that reads none is refused at start. The tiny gemma4 fixture with the tiny
//! projector `synth --arch gemma4v-mmproj` writes: the same answer as `run --image`, the picture told
//! apart from another of its size; each family's projector refused beside the other's model.

mod serve_support;

use std::path::{Path, PathBuf};
use std::process::Command;

use poly_protocol::{encode_base64, ErrorCode, FromEngine, Gen, Picture, ToEngine};
use serve_support::{Answer, Engine};

const ENGINE: &str = env!("CARGO_BIN_EXE_poly-engine");
const MODEL: &str = "qwen35moe-tiny-q4km.gguf";
/// The prompt of `run --image`, the picture before its token [`AT`], standing for token [`PLACEHOLDER`].
const PROMPT: [u32; 9] = [11, 22, 33, 44, 55, 66, 77, 88, 99];
const AT: usize = 5;
const PLACEHOLDER: u32 = 7;
const STEPS: usize = 6;

fn vision(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/vision")
        .join(name)
}

/// A temporary directory with the tiny Qwen3-VL projector in it (removed by the caller).
fn projector(tag: &str) -> (PathBuf, PathBuf) {
    projector_of(tag, "qwen3vl-mmproj")
}

/// A temporary directory with the tiny projector `synth --arch arch` writes in it (removed by the caller).
fn projector_of(tag: &str, arch: &str) -> (PathBuf, PathBuf) {
    let dir =
        std::env::temp_dir().join(format!("poly-serve-pictures-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mmproj = dir.join("mmproj.gguf");
    let o = Command::new(ENGINE)
        .args(["synth", "--arch", arch, "--shape", "tiny"])
        .args(["--type", "F32", "--seed", "1", "--out"])
        .arg(&mmproj)
        .output()
        .expect("synth");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (dir, mmproj)
}

/// `poly-engine run --image`'s greedy tokens and log-probabilities (batch-invariant, end tokens ignored)
/// on [`MODEL`].
fn run_image(mmproj: &Path, picture: &Path) -> (Vec<u32>, Vec<f32>) {
    run_image_on(MODEL, mmproj, picture)
}

/// [`run_image`] on the fixture `model`.
fn run_image_on(model: &str, mmproj: &Path, picture: &Path) -> (Vec<u32>, Vec<f32>) {
    let prompt: Vec<String> = PROMPT.iter().map(u32::to_string).collect();
    let o = Command::new(ENGINE)
        .args([
            "run",
            "--cpu",
            "--json",
            "--batch-invariant",
            "--ignore-eos",
        ])
        .args(["--max-tokens", &STEPS.to_string(), "--model"])
        .arg(serve_support::fixture(model))
        .args(["--prompt-tokens", &prompt.join(",")])
        .args(["--image-at", &AT.to_string()])
        .args(["--image-token", &PLACEHOLDER.to_string(), "--mmproj"])
        .arg(mmproj)
        .arg("--image")
        .arg(picture)
        .output()
        .expect("run");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| {
            let step: serde_json::Value = serde_json::from_str(l).expect("a JSON step");
            let token = step["token"].as_u64().expect("token") as u32;
            // Written from an f32, read back exactly.
            let logprob = step["logprob"].as_f64().expect("logprob") as f32;
            (token, logprob)
        })
        .unzip()
}

/// The GEN of [`PROMPT`] with `picture` on its placeholder, a checkpoint asked for after the picture.
fn gen(id: &str, picture: &Path) -> Gen {
    let mut tokens = PROMPT[..AT].to_vec();
    tokens.push(PLACEHOLDER);
    tokens.extend_from_slice(&PROMPT[AT..]);
    Gen {
        max_tokens: Some(STEPS as u32),
        stop_tokens: Some(Vec::new()),
        // The token after the picture's, in the request's own positions.
        checkpoint_at: Some(AT as u32 + 2),
        pictures: vec![Picture {
            at: AT as u32,
            data: encode_base64(&std::fs::read(picture).expect("picture")),
        }],
        ..Gen::new(id, tokens)
    }
}

fn answer(e: &mut Engine, g: &Gen) -> Answer {
    e.gen(g).unwrap_or_else(|err| panic!("{}: {err:?}", g.id))
}

#[test]
fn a_picture_in_a_gen_answers_as_run_image_and_keeps_pictures_apart() {
    let (dir, mmproj) = projector("answers");
    let (a, b) = (
        vision("picture-64x48.png"),
        vision("picture-64x48-gradient.png"),
    );
    let (want_a, want_a_lp) = run_image(&mmproj, &a);
    let (want_b, want_b_lp) = run_image(&mmproj, &b);
    assert_ne!(want_a_lp, want_b_lp, "two pictures, two answers");

    let mmproj_arg = mmproj.to_str().expect("a UTF-8 path");
    let mut e = Engine::start(MODEL, &["--cpu", "--mmproj", mmproj_arg]);
    let vision_echo = e.ready.as_ref().and_then(|r| r.vision.clone());
    assert_eq!(
        vision_echo.map(|v| (v.mmproj, v.projector)),
        Some((mmproj_arg.to_string(), "qwen3vl_merger".to_string()))
    );

    let first = answer(&mut e, &gen("a1", &a));
    assert_eq!(first.ids(), want_a);
    assert_eq!(first.logprobs(), want_a_lp, "bit for bit with run --image");
    // The placeholder widened to the picture's 4×3 rows.
    assert_eq!(first.done.prompt_tokens as usize, PROMPT.len() + 12);
    assert_eq!(first.done.cached_tokens, 0);

    // The same picture again: resumed from the checkpoint after it (request position 7, widened 18).
    let again = answer(&mut e, &gen("a2", &a));
    assert_eq!(again.done.cached_tokens, 7 + 11);
    assert_eq!(
        (again.ids(), again.logprobs()),
        (want_a.clone(), want_a_lp.clone())
    );

    // The picture was encoded once: the second request took its rows from the engine's cache.
    e.send(&ToEngine::Stats);
    match e.next() {
        FromEngine::Stats(s) => assert_eq!(
            (&s.extra["pictures_encoded"], &s.extra["pictures_reused"]),
            (&serde_json::json!(1), &serde_json::json!(1))
        ),
        other => panic!("expected STATS, got {other:?}"),
    }

    // Another picture of the same size: the same tokens, but nothing past the text before it is reused.
    let other = answer(&mut e, &gen("b1", &b));
    assert!(
        other.done.cached_tokens as usize <= AT,
        "{}",
        other.done.cached_tokens
    );
    assert_eq!((other.ids(), other.logprobs()), (want_b, want_b_lp));

    // Bad pictures: one ERR each, nothing else changes.
    let mut bad = gen("bad1", &a);
    bad.pictures[0].data = "not base64!".into();
    let err = e.gen(&bad).expect_err("bad base64");
    assert_eq!(err.code, ErrorCode::BadRequest);
    assert!(err.message.contains("base64"), "{}", err.message);
    bad.id = "bad2".into();
    bad.pictures[0].data = encode_base64(b"these bytes are no picture");
    let err = e.gen(&bad).expect_err("not a picture");
    assert_eq!(err.code, ErrorCode::BadRequest);
    assert!(err.message.contains("pictures[0]"), "{}", err.message);

    // And back to the first picture: the kept state (picture b's) is not taken for it.
    let back = answer(&mut e, &gen("a3", &a));
    assert!(back.done.cached_tokens as usize <= AT);
    assert_eq!((back.ids(), back.logprobs()), (want_a, want_a_lp));
    drop(e);

    // A server cannot know the rows: max_tokens beyond the room the widened prompt leaves is cut to it.
    let mut e = Engine::start(
        MODEL,
        &["--cpu", "--mmproj", mmproj_arg, "--max-context", "32"],
    );
    let long = Gen {
        max_tokens: Some(1000),
        ..gen("long", &a)
    };
    let done = answer(&mut e, &long).done;
    assert_eq!((done.prompt_tokens, done.generated), (21, 11));
    assert_eq!(done.reason, poly_protocol::StopReason::Length);
    // A prompt whose pictures leave no room is refused as too long.
    let mut e2 = Engine::start(
        MODEL,
        &["--cpu", "--mmproj", mmproj_arg, "--max-context", "21"],
    );
    let err = e2.gen(&gen("full", &a)).expect_err("no room");
    assert_eq!(err.code, ErrorCode::ContextOverflow);
    // One whose pictures outgrow the context is refused when the rows are read, before it waits.
    let mut e3 = Engine::start(
        MODEL,
        &["--cpu", "--mmproj", mmproj_arg, "--max-context", "20"],
    );
    let err = e3.gen(&gen("over", &a)).expect_err("over");
    assert_eq!(err.code, ErrorCode::ContextOverflow);
    assert!(err.message.contains("pictures[..=0]"), "{}", err.message);
    drop((e, e2, e3));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn pictures_need_a_projector_and_a_model_that_reads_them() {
    // No --mmproj: pictures are refused, text is answered.
    let mut e = Engine::start(MODEL, &["--cpu"]);
    assert!(e.ready.as_ref().is_some_and(|r| r.vision.is_none()));
    let g = Gen {
        pictures: vec![Picture {
            at: 1,
            data: "AAAA".into(),
        }],
        max_tokens: Some(1),
        ..Gen::new("p1", vec![1, 2, 3])
    };
    let err = e.gen(&g).expect_err("no projector");
    assert_eq!(err.code, ErrorCode::BadRequest);
    assert!(err.message.contains("--mmproj"), "{}", err.message);
    let text = Gen {
        max_tokens: Some(1),
        ..Gen::new("t1", vec![1, 2, 3])
    };
    assert_eq!(e.gen(&text).expect("text").done.generated, 1);
    drop(e);

    // A projector beside a model without multi-section RoPE: one ERR (id null) and no READY.
    let (dir, mmproj) = projector("refused");
    let mut e = Engine::spawn(
        &serve_support::fixture("qwen3moe-tiny-q4km.gguf"),
        &["--cpu", "--mmproj", mmproj.to_str().expect("a UTF-8 path")],
    );
    match e.next() {
        FromEngine::Err(err) => {
            assert!(err.id.is_none());
            assert!(err.message.contains("reads no pictures"), "{}", err.message);
        }
        other => panic!("expected ERR, got {other:?}"),
    }
    assert!(!e.wait().success());
    let _ = std::fs::remove_dir_all(dir);
}

/// A GEN of two pictures: `first` after token 2, `second` after token 6, with a checkpoint asked for
/// where the second picture's placeholder stands.
fn two_pictures(id: &str, first: &Path, second: &Path) -> Gen {
    let data = |p: &Path| encode_base64(&std::fs::read(p).expect("picture"));
    Gen {
        max_tokens: Some(STEPS as u32),
        stop_tokens: Some(Vec::new()),
        checkpoint_at: Some(6),
        pictures: vec![
            Picture {
                at: 2,
                data: data(first),
            },
            Picture {
                at: 6,
                data: data(second),
            },
        ],
        ..Gen::new(
            id,
            vec![11, 22, PLACEHOLDER, 33, 44, 55, PLACEHOLDER, 66, 77],
        )
    }
}

#[test]
fn a_prompt_resumes_up_to_the_first_picture_that_differs_with_a_fresh_reads_answer() {
    let (dir, mmproj) = projector("two");
    let (a, b) = (
        vision("picture-64x48.png"),
        vision("picture-64x48-gradient.png"),
    );
    let args = ["--cpu", "--mmproj", mmproj.to_str().expect("a UTF-8 path")];
    let mut e = Engine::start(MODEL, &args);
    let first = answer(&mut e, &two_pictures("ab", &a, &b));
    // Two pictures of 12 rows where two placeholders stood.
    assert_eq!(first.done.prompt_tokens, 9 + 2 * 11);
    // The same first picture, another second one: resumed at the checkpoint before the second (request
    // position 6, widened 17), nothing of the second picture taken.
    let second = answer(&mut e, &two_pictures("aa", &a, &a));
    assert_eq!(second.done.cached_tokens, 6 + 11);
    // And its answer is a fresh engine's for the same request, bit for bit.
    let mut fresh = Engine::start(MODEL, &args);
    let alone = answer(&mut fresh, &two_pictures("aa", &a, &a));
    assert_eq!(alone.done.cached_tokens, 0);
    assert_eq!(
        (second.ids(), second.logprobs()),
        (alone.ids(), alone.logprobs())
    );
    assert_ne!(
        first.logprobs(),
        second.logprobs(),
        "the second picture counts"
    );
    drop((e, fresh));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn pictures_of_requests_running_at_once_give_the_answers_they_give_alone() {
    let (dir, mmproj) = projector("parallel");
    let (a, b) = (
        vision("picture-64x48.png"),
        vision("picture-64x48-gradient.png"),
    );
    let want = [run_image(&mmproj, &a), run_image(&mmproj, &b)];
    let mmproj_arg = mmproj.to_str().expect("a UTF-8 path");
    let mut e = Engine::start(MODEL, &["--cpu", "--mmproj", mmproj_arg, "--parallel", "2"]);
    let gens = [
        Gen {
            conversation: Some("ca".into()),
            ..gen("pa", &a)
        },
        Gen {
            conversation: Some("cb".into()),
            ..gen("pb", &b)
        },
    ];
    for g in &gens {
        e.send(&ToEngine::Gen(g.clone()));
    }
    let mut got: [(Vec<u32>, Vec<f32>); 2] = Default::default();
    let mut done = 0;
    while done < 2 {
        match e.next() {
            FromEngine::Tokens(t) => {
                let i = usize::from(t.id == "pb");
                got[i].0.extend(&t.tokens);
                got[i].1.extend(&t.logprobs);
            }
            FromEngine::Done(_) => done += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, want);
    drop(e);
    let _ = std::fs::remove_dir_all(dir);
}

const GEMMA4: &str = "gemma4-tiny-q4km.gguf";

#[test]
fn a_gemma4_picture_in_a_gen_answers_as_run_image() {
    let (dir, mmproj) = projector_of("gemma4", "gemma4v-mmproj");
    let (a, b) = (
        vision("picture-64x48.png"),
        vision("picture-64x48-gradient.png"),
    );
    let (want_a, want_a_lp) = run_image_on(GEMMA4, &mmproj, &a);
    let (want_b, want_b_lp) = run_image_on(GEMMA4, &mmproj, &b);
    assert_ne!(want_a_lp, want_b_lp, "two pictures, two answers");

    let mmproj_arg = mmproj.to_str().expect("a UTF-8 path");
    let mut e = Engine::start(GEMMA4, &["--cpu", "--mmproj", mmproj_arg]);
    let vision_echo = e.ready.as_ref().and_then(|r| r.vision.clone());
    assert_eq!(
        vision_echo.map(|v| v.projector),
        Some("gemma4v".to_string())
    );
    let first = answer(&mut e, &gen("g1", &a));
    assert_eq!(first.ids(), want_a);
    assert_eq!(first.logprobs(), want_a_lp, "bit for bit with run --image");
    // The placeholder widened to the picture's 10×8 rows.
    assert_eq!(first.done.prompt_tokens as usize, PROMPT.len() + 80);
    // The same picture again: resumed past it, up to the prompt's last token (a model of KV caches
    // only is cut anywhere, so no checkpoint bounds it).
    let again = answer(&mut e, &gen("g2", &a));
    assert_eq!(again.done.cached_tokens, first.done.prompt_tokens - 1);
    assert_eq!(
        (again.ids(), again.logprobs()),
        (want_a.clone(), want_a_lp.clone())
    );
    // Another picture of the same size: nothing past the text before it is reused.
    let other = answer(&mut e, &gen("g3", &b));
    assert!(
        other.done.cached_tokens as usize <= AT,
        "{}",
        other.done.cached_tokens
    );
    assert_eq!((other.ids(), other.logprobs()), (want_b, want_b_lp));
    drop(e);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn each_familys_projector_is_refused_beside_the_others_model() {
    let (dir, qwen) = projector_of("cross-qwen", "qwen3vl-mmproj");
    let (dir_g, gemma) = projector_of("cross-gemma", "gemma4v-mmproj");
    for (model, mmproj, wanted) in [
        (GEMMA4, &qwen, "gemma4v"),
        (MODEL, &gemma, "qwen3vl_merger"),
    ] {
        let mut e = Engine::spawn(
            &serve_support::fixture(model),
            &["--cpu", "--mmproj", mmproj.to_str().expect("a UTF-8 path")],
        );
        match e.next() {
            FromEngine::Err(err) => {
                assert!(err.id.is_none());
                assert!(
                    err.message.contains(&format!("from a {wanted} projector")),
                    "{}",
                    err.message
                );
            }
            other => panic!("expected ERR, got {other:?}"),
        }
        assert!(!e.wait().success());
    }
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(dir_g);
}
