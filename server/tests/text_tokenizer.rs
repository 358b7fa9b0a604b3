//! The tokenizer directory gives llama.cpp's ids.
//!
//! `tests/fixtures/text/tokenizer_ids.json` holds llama.cpp's ids (`llama_tokenize` with `add_special`
//! and `parse_special`, written by `tests/witness/make_tokenizer_ids.py`) for the texts of
//! `tokenizer_texts.json` (about 2,400 characters: spaces, digits, CJK, emoji, code, special tokens).
//! Each test writes the tokenizer directory of a GGUF with `tokenizer_command`, loads it and compares.
//! Cost: well under a second for the synthetic vocabulary; a few seconds for Gemma 3 (262,144 tokens).
//! Gemma 3 270M is read from `POLY_GEMMA_GGUF` or /work/models/gemma-3-270m-q4_k_m.gguf
//! (tests/witness/fetch_gemma.sh fetches it).

use polystrata::text::tokenizer_dir::{tokenizer_command, Detokenizer, TextTokenizer};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fixture(name: &str) -> Value {
    let p = root().join("tests/fixtures/text").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture")).expect("fixture JSON")
}

fn out_dir(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("polystrata-text-{tag}-{}", std::process::id()))
}

/// Writes and loads the tokenizer directory of `gguf`, then checks every text against llama.cpp's ids.
fn check_model(key: &str, gguf: &Path) -> TextTokenizer {
    let expected = fixture("tokenizer_ids.json");
    let texts = fixture("tokenizer_texts.json");
    let entry = &expected[key];
    let dir = out_dir(key);
    let cfg = tokenizer_command(gguf, &dir).expect("tokenizer directory");
    assert_eq!(
        cfg.add_bos,
        entry["add_bos"].as_bool().expect("add_bos"),
        "{key}: add_bos"
    );
    let tok = TextTokenizer::load(&dir).expect("load tokenizer directory");
    let mut mismatches = Vec::new();
    let texts = texts.as_array().expect("texts");
    let ids = entry["ids"].as_array().expect("ids");
    assert_eq!(texts.len(), ids.len(), "{key}: fixture out of date");
    for (text, want) in texts.iter().zip(ids) {
        let text = text.as_str().expect("text");
        let want: Vec<u32> = want
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        let got = tok.encode(text, true, true).expect("encode");
        if got != want {
            mismatches.push(format!(
                "{text:?}\n  llama.cpp {want:?}\n  ours      {got:?}"
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        mismatches.is_empty(),
        "{key}: {} of {} texts differ:\n{}",
        mismatches.len(),
        texts.len(),
        mismatches.join("\n")
    );
    tok
}

/// Decoding the ids of a text (BOS dropped) gives the text back, streamed token by token.
fn check_round_trip(tok: &TextTokenizer) {
    let texts = fixture("tokenizer_texts.json");
    for text in texts.as_array().expect("texts") {
        let text = text.as_str().expect("text");
        let ids = tok.encode(text, false, true).expect("encode");
        let mut d = Detokenizer::new();
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&d.push(tok, id, true));
        }
        out.push_str(&d.finish());
        assert_eq!(out, text, "round trip of {text:?}");
    }
}

#[test]
fn synthetic_tokenizer_matches_llama_cpp() {
    for (key, file) in [
        ("synthetic_qwen3moe", "qwen3moe-tiny-q4km.gguf"),
        ("synthetic_gemma3", "gemma3-tiny-q4km.gguf"),
    ] {
        let tok = check_model(key, &root().join("tests/fixtures/models").join(file));
        check_round_trip(&tok);
        // The synthetic vocabulary ends replies on <|im_end|> and <|endoftext|>.
        let im_end = tok.token_id("<|im_end|>").expect("<|im_end|>");
        assert!(tok.is_end_of_reply(im_end));
        assert!(!tok.is_end_of_reply(tok.token_id("<think>").expect("<think>")));
        // Without parse_special a special token's text is plain text.
        let literal = tok.encode("<|im_end|>", false, false).expect("encode");
        assert!(literal.len() > 1 && !literal.contains(&im_end));
    }
}

/// Gemma 4's vocabulary type (`tokenizer.ggml.model = gemma4`: BPE over raw UTF-8, spaces as `▁`,
/// newline runs whole, byte fallback, BOS added whatever the file says) on a small vocabulary written for
/// it (tests/witness/make_gemma4_vocab.py): llama.cpp's ids for every text, and the round trip, which
/// goes through byte tokens for every character the vocabulary lacks.
#[test]
fn gemma4_vocabulary_matches_llama_cpp() {
    let tok = check_model(
        "synthetic_gemma4_vocab",
        &root().join("tests/fixtures/text/gemma4-vocab.gguf"),
    );
    check_round_trip(&tok);
    let turn = tok.token_id("<end_of_turn>").expect("<end_of_turn>");
    let literal = tok.encode("<end_of_turn>", false, false).expect("encode");
    assert!(literal.len() > 1 && !literal.contains(&turn), "{literal:?}");
    // A run of newlines that is a token is one token, also without parsing specials.
    let three = tok.token_id("\n\n\n").expect("three newlines");
    assert_eq!(
        tok.encode("a\n\n\nb", false, false).expect("encode").len(),
        3
    );
    assert!(tok
        .encode("a\n\n\nb", false, false)
        .expect("encode")
        .contains(&three));
}

#[test]
fn gemma3_270m_tokenizer_matches_llama_cpp() {
    let path = std::env::var_os("POLY_GEMMA_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/work/models/gemma-3-270m-q4_k_m.gguf"));
    assert!(
        path.exists(),
        "{} is missing: run tests/witness/fetch_gemma.sh (or set POLY_GEMMA_GGUF)",
        path.display()
    );
    let tok = check_model("gemma3_270m", &path);
    check_round_trip(&tok);
    let eot = tok.token_id("<end_of_turn>").expect("<end_of_turn>");
    assert!(tok.is_end_of_reply(eot));
}

/// `polystrata tokenizer --gguf FILE --out DIR` writes the three files, and the config says what ends a
/// reply, the BOS rule and the family.
#[test]
fn tokenizer_subcommand_writes_the_directory() {
    let dir = out_dir("cli");
    let gguf = root().join("tests/fixtures/models/gemma3-tiny-q4km.gguf");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_polystrata"))
        .args(["tokenizer", "--gguf"])
        .arg(&gguf)
        .arg("--out")
        .arg(&dir)
        .status()
        .expect("run polystrata");
    assert!(status.success());
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("tokenizer_config.json")).expect("config"),
    )
    .expect("config JSON");
    assert_eq!(cfg["model"], "gpt2");
    assert_eq!(cfg["pre"], "qwen2");
    assert_eq!(cfg["add_bos"], true);
    assert_eq!(cfg["bos"]["text"], "<|endoftext|>");
    assert_eq!(cfg["family"], "qwen3");
    let ends: Vec<&str> = cfg["end_of_reply"]
        .as_array()
        .expect("end_of_reply")
        .iter()
        .filter_map(|t| t["text"].as_str())
        .collect();
    assert_eq!(ends, ["<|endoftext|>", "<|im_end|>"]);
    let template = std::fs::read_to_string(dir.join("chat_template.jinja")).expect("template");
    assert!(template.contains("<|im_start|>"));
    assert!(dir.join("tokenizer.json").exists());
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_polystrata"))
        .args(["tokenizer", "--gguf", "/nonexistent.gguf", "--out"])
        .arg(&dir)
        .output()
        .expect("run polystrata");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("nonexistent.gguf"));
    let _ = std::fs::remove_dir_all(&dir);
}
