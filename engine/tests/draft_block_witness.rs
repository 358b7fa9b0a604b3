//! The draft block (qwen35moe's and deepseek4's MTP heads) against llama.cpp's own MTP graph: for the
//! references' prompts,
//! each row's draft probabilities (the token after the next, guessed from the token at the row and the
//! trunk's hidden row before it) are llama.cpp's within the CPU witness rule (`poly_tests::witness::Rule`:
//! the same likeliest token unless llama.cpp's two likeliest are within 0.02; each of llama.cpp's five
//! likeliest within 0.02 in probability). The references are written by `tests/witness/mtp_logits.cpp`
//! (the pinned llama.cpp's `LLM_GRAPH_TYPE_DECODER_MTP`, fed as common/speculative.cpp's `draft-mtp`
//! feeds it), one thread, f16 caches.
//!
//! Both sides run their own trunk: the comparison covers the hidden rows the trunk keeps for the block
//! (qwen35moe's post-norm row, deepseek4's last mHC streams; the position before) as well as the block.
//! A reference whose model is no committed fixture names the `poly-engine synth` arguments that write
//! it (`"synth"`, seeded: the same file each time), and the model is written to a temporary folder.

use std::path::PathBuf;

use poly_engine::Model;
use poly_models::compute::Logits;

const NEAR_TIE: f64 = 0.02;
const MAX_PROB_DIFF: f64 = 0.02;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Softmax probabilities of one row of logits.
fn probs(logits: &[f32]) -> Vec<f64> {
    let mx = logits.iter().copied().fold(f32::MIN, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - mx).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

/// Our draft logits for every row of `tokens` (one call of the trunk, the block read in two calls, as
/// the engine reads it in pieces), `n_vocab` per row.
fn draft_rows(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let n_embd = model.draft_block_hidden_width();
    let mut state = model.new_state(512);
    state.keep_hidden(true);
    model.eval(&mut state, tokens, Logits::Last).expect("trunk");
    let mut hidden = vec![0.0; n_embd];
    for k in 1..tokens.len() {
        hidden.extend_from_slice(state.hidden_row(k - 1).expect("kept hidden row"));
    }
    let mut block = model.new_draft_block_state(512).expect("a draft block");
    let split = tokens.len() / 2;
    let mut out = model
        .eval_draft_block(
            &mut block,
            (&tokens[..split], &hidden[..split * n_embd]),
            Logits::All,
        )
        .expect("draft block, first part");
    out.extend(
        model
            .eval_draft_block(
                &mut block,
                (&tokens[split..], &hidden[split * n_embd..]),
                Logits::All,
            )
            .expect("draft block, second part"),
    );
    out
}

#[test]
fn draft_block_probabilities_are_llama_cpps() {
    let dir = workspace().join("tests/fixtures/references/mtp");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("references")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no reference in {}", dir.display());
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read reference");
        let r: serde_json::Value = serde_json::from_str(&text).expect("reference JSON");
        let name = PathBuf::from(r["model"].as_str().expect("model"));
        let name = name.file_name().expect("model file name");
        let model = match r["synth"].as_array() {
            Some(args) => synth(args, name),
            None => {
                Model::load(workspace().join("tests/fixtures/models").join(name)).expect("load")
            }
        };
        let tokens: Vec<u32> = r["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("token") as u32)
            .collect();
        let n_vocab = model.info().n_vocab;
        let ours = draft_rows(&model, &tokens);
        let rows = r["rows"].as_array().expect("rows");
        assert_eq!(rows.len(), tokens.len());
        let mut worst = 0.0f64;
        for (i, (row, logits)) in rows.iter().zip(ours.chunks(n_vocab)).enumerate() {
            let p = probs(logits);
            let top: Vec<(usize, f64)> = row
                .as_array()
                .expect("row")
                .iter()
                .map(|e| {
                    (
                        e[0].as_u64().expect("id") as usize,
                        e[1].as_f64().expect("p"),
                    )
                })
                .collect();
            if std::env::var_os("DRAFT_WITNESS_VERBOSE").is_some() {
                let d: Vec<String> = top
                    .iter()
                    .map(|&(id, lp)| format!("{id}:{lp:.4}/{:.4}", p[id]))
                    .collect();
                eprintln!("{name:?} row {i}: {}", d.join(" "));
                continue;
            }
            for &(id, lp) in &top {
                worst = worst.max((lp - p[id]).abs());
                assert!(
                    (lp - p[id]).abs() <= MAX_PROB_DIFF,
                    "{name:?} row {i}: token {id}: llama.cpp {lp:.4}, ours {:.4}",
                    p[id]
                );
            }
            let ours_best = (0..n_vocab)
                .max_by(|&a, &b| p[a].total_cmp(&p[b]).then(b.cmp(&a)))
                .expect("a vocabulary");
            let near_tie = top[0].1 - top[1].1 < NEAR_TIE;
            assert!(
                ours_best == top[0].0 || near_tie,
                "{name:?} row {i}: our likeliest {ours_best}, llama.cpp's {}",
                top[0].0
            );
        }
        eprintln!(
            "{name:?}: {} rows, largest probability difference {worst:.5}",
            rows.len()
        );
    }
}

/// The model `poly-engine synth` writes with `args` (then `--out`), loaded from a temporary file of
/// `name` that is removed once mapped.
fn synth(args: &[serde_json::Value], name: &std::ffi::OsStr) -> Model {
    let dir = std::env::temp_dir().join(format!("poly-draft-witness-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    let args: Vec<&str> = args
        .iter()
        .map(|a| a.as_str().expect("a synth argument"))
        .collect();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_poly-engine"))
        .arg("synth")
        .args(&args)
        .arg("--out")
        .arg(&path)
        .output()
        .expect("synth runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let model = Model::load(&path).expect("load");
    std::fs::remove_dir_all(&dir).ok();
    model
}
