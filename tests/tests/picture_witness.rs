//! A prompt with a picture against llama.cpp with its mtmd: the committed logits
//! (`tests/fixtures/vision/picture-logits.json`, written by `tests/witness/picture_logits.cpp`) of the
//! text after the committed picture, on the tiny `qwen35moe` and the tiny `qwen3vl_merger` projector that
//! `synth` writes (F32, seed 1; their SHA-256 must be the reference's). Ours: the text before the picture,
//! the picture's rows through [`Model::eval_picture`] (mtmd's M-RoPE positions, the text after it from
//! the picture's span on), the text after it; every row of the text after the picture is compared.
//!
//! The picture's rows are given twice: the rows mtmd's encoder wrote (`qwen3vl-tiny-f32.rows.bin`), which
//! isolates the language model's side, and our encoder's, end to end. The measures: the largest logit
//! difference over the row's logit standard deviation, the largest next-token probability difference,
//! and the top token of every row (all must agree).
//!
//! Measured (2026-12-07, this machine): 4.6e-4 and 2.4e-4 with mtmd's rows, 7.0e-4 and 2.9e-4 with ours
//! (the encoder's own 3.7e-5 passed on). For scale: llama.cpp against itself with flash attention on
//! instead of off moves them by 5.1e-3 and 1.6e-3; reading the picture's rows at text positions (the
//! grid's row and column left out, the span kept) gives 7.7e-2 and 2.0e-2, and a span of its row count
//! instead of the grid's larger side fails the `n_past` check. The bounds (manifest): 2e-3 and 1e-3,
//! four times the measured differences, below llama.cpp's own flash spread, a 38th of the error of
//! text positions (the tiny model's RoPE base of 1e7 turns the row and column sections slowly).

use poly_engine::Model;
use poly_kernels::quant::GgmlType;
use poly_models::compute::Logits;
use poly_models::synth::mmproj::{find_projector_shape, write_qwen3vl_projector};
use poly_models::vision::{ImageRows, VisionEncoder};
use poly_models::GgufFile;
use poly_tests::fixtures_dir;
use poly_tests::witness::picture::{ids, logit_gap, read_f32, write_tiny_f32_model};
use poly_tests::witness::sha256_file;
use serde_json::Value;

#[test]
fn a_prompt_with_a_picture_gives_llama_cpp_mtmds_logits() {
    let dir_fx = fixtures_dir().join("vision");
    let m: Value = serde_json::from_slice(
        &std::fs::read(dir_fx.join("picture-logits.json")).expect("picture-logits.json"),
    )
    .expect("picture-logits.json parses");
    let dir = std::env::temp_dir().join(format!("poly-picture-witness-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");

    let lm_path = dir.join("qwen35moe-tiny-f32.gguf");
    write_tiny_f32_model("qwen35moe", &m, &lm_path);
    let mmproj_path = dir.join("mmproj-tiny-f32.gguf");
    let shape = find_projector_shape("tiny").expect("tiny");
    let seed = m["projector_seed"].as_u64().expect("seed");
    write_qwen3vl_projector(&shape, GgmlType::F32, seed, &mmproj_path).unwrap();
    assert_eq!(
        sha256_file(&mmproj_path).unwrap(),
        m["projector_sha256"].as_str().expect("sha"),
        "synth no longer writes the projector the reference was made from"
    );

    let model = Model::load(&lm_path).expect("the model loads");
    let n_vocab = model.info().n_vocab;
    let (before, after) = (ids(&m["before"]), ids(&m["after"]));
    let theirs = read_f32(&dir_fx.join(m["logits_file"].as_str().expect("logits file")));
    assert_eq!(theirs.len(), after.len() * n_vocab);

    let projector = GgufFile::open(&mmproj_path).unwrap();
    let picture = std::fs::read(dir_fx.join(m["picture"].as_str().expect("picture"))).unwrap();
    let ours_rows = VisionEncoder::load(&projector)
        .unwrap()
        .encode_picture(&picture)
        .unwrap();
    let mtmd_rows = ImageRows {
        values: read_f32(&dir_fx.join(m["rows_file"].as_str().expect("rows file"))),
        ..ours_rows.clone()
    };
    assert_eq!(mtmd_rows.values.len(), ours_rows.values.len());
    assert_eq!(
        ours_rows.n_rows() as u64,
        m["picture_rows"].as_u64().expect("rows")
    );

    for (name, rows, bounds) in [
        ("mtmd's rows", &mtmd_rows, &m["bounds_mtmd_rows"]),
        ("our rows", &ours_rows, &m["bounds_our_rows"]),
    ] {
        let mut state = model.new_state(128);
        model.eval(&mut state, &before, Logits::None).unwrap();
        // The picture's placeholders: any ids, the rows replace their embeddings.
        let placeholders = vec![0u32; rows.n_rows()];
        model
            .eval_picture(&mut state, &placeholders, (0, rows), Logits::None)
            .unwrap();
        // llama.cpp's n_past after the picture: its first position plus its span.
        assert_eq!(
            state.rope_position(state.n_past()) as u64,
            m["n_past_after"].as_u64().expect("n_past")
        );
        let ours = model.eval(&mut state, &after, Logits::All).unwrap();
        let gap = logit_gap(&ours, &theirs, n_vocab);
        let (rel, prob, top) = (gap.logit_over_sd, gap.probability, gap.top_tokens_differing);
        eprintln!(
            "{name}: max |Δlogit|/sd {rel:.3e}, max |Δp| {prob:.3e}, top tokens differing {top}/{}",
            after.len()
        );
        assert_eq!(top, 0, "{name}: a row's top token differs");
        let b_rel = bounds["logit_over_sd"].as_f64().expect("bound");
        let b_prob = bounds["probability"].as_f64().expect("bound");
        assert!(rel < b_rel, "{name}: {rel:.3e} ≥ {b_rel:.0e}");
        assert!(prob < b_prob, "{name}: {prob:.3e} ≥ {b_prob:.0e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
