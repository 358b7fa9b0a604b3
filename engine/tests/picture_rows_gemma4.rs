//! A picture's rows in a prompt call ([`Model::eval_picture`]) on the synthetic tiny `gemma4` (F32), which
//! reads pictures in line as llama.cpp's mtmd does: its rows at the next positions as text, not scaled by
//! `√n_embd` as token embeddings are (a one-row picture of a token's scaled embedding reads as that token,
//! bit for bit); in the sliding-window layers a picture's rows see its later rows (its first row's logits
//! follow its last row), the text before it does not, and the text after it reads as after plain
//! positions, whether the picture is read in the prompt's call or in a call of its own.

use std::path::PathBuf;
use std::sync::OnceLock;

use poly_engine::model::Arithmetic;
use poly_engine::Model;
use poly_kernels::quant::GgmlType;
use poly_models::compute::Logits;
use poly_models::gguf::GgufFile;
use poly_models::synth::shapes::find_shape;
use poly_models::vision::ImageRows;

mod common;
use common::{random_tokens, write_synth};

/// The tiny `gemma4` in F32 in batch-invariant arithmetic, and its token embedding table.
fn model() -> &'static (Model, Vec<f32>) {
    static MODEL: OnceLock<(Model, Vec<f32>)> = OnceLock::new();
    MODEL.get_or_init(|| {
        let dir: PathBuf =
            std::env::temp_dir().join(format!("poly-engine-picture-gemma4-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("gemma4-f32.gguf");
        let shape = find_shape("gemma4", "tiny").expect("a tiny shape");
        write_synth(shape, GgmlType::F32, 5, &path);
        let file = GgufFile::open(&path).expect("the synthetic file");
        let table: Vec<f32> = file
            .tensor("token_embd.weight")
            .expect("a token embedding")
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let model = Model::load(&path)
            .expect("the tiny gemma4 loads")
            .with_arithmetic(Arithmetic::BatchInvariant);
        let _ = std::fs::remove_dir_all(&dir);
        (model, table)
    })
}

/// A picture of `tokens.len()` rows (one line) that are the embeddings of `tokens` times `scale`.
fn picture_of(tokens: &[u32], scale: f32) -> ImageRows {
    let (m, table) = model();
    let width = m.info().n_embd;
    ImageRows {
        n_x: tokens.len(),
        n_y: 1,
        width,
        values: tokens
            .iter()
            .flat_map(|&t| {
                table[t as usize * width..][..width]
                    .iter()
                    .map(|&v| v * scale)
            })
            .collect(),
    }
}

#[test]
fn a_one_row_picture_of_a_tokens_scaled_embedding_reads_as_that_token() {
    let (m, _) = model();
    let sqrt_n_embd = (m.info().n_embd as f32).sqrt();
    let prompt = random_tokens(12, m.info().n_vocab, 1);
    let mut text = m.new_state(64);
    let want = m.eval(&mut text, &prompt, Logits::All).unwrap();
    let mut pic = m.new_state(64);
    let got = m
        .eval_picture(
            &mut pic,
            &prompt,
            (5, &picture_of(&prompt[5..6], sqrt_n_embd)),
            Logits::All,
        )
        .unwrap();
    assert_eq!(
        got, want,
        "the picture's row is taken as it is, at the text's position"
    );
    // Positions stay the cells: the text after it goes on as after the token.
    assert!(!pic.has_pictures());
    assert_eq!(pic.picture_marks().len(), 1);
    let next = [prompt[0], prompt[3]];
    assert_eq!(
        m.eval(&mut pic, &next, Logits::All).unwrap(),
        m.eval(&mut text, &next, Logits::All).unwrap()
    );
    // The unscaled embedding is another row: the picture's rows are not scaled by the model.
    let mut unscaled = m.new_state(64);
    let got = m
        .eval_picture(
            &mut unscaled,
            &prompt,
            (5, &picture_of(&prompt[5..6], 1.0)),
            Logits::All,
        )
        .unwrap();
    let n_vocab = m.info().n_vocab;
    assert_eq!(got[..5 * n_vocab], want[..5 * n_vocab]);
    assert_ne!(got[5 * n_vocab..], want[5 * n_vocab..]);
}

#[test]
fn a_pictures_rows_see_its_later_rows_and_the_text_around_it_stays_causal() {
    let (m, _) = model();
    let n_vocab = m.info().n_vocab;
    let sqrt_n_embd = (m.info().n_embd as f32).sqrt();
    let prompt = random_tokens(12, n_vocab, 2);
    // A picture of four rows in rows 3..7.
    let picture = picture_of(&prompt[3..7], sqrt_n_embd);
    let mut one = m.new_state(64);
    let whole = m
        .eval_picture(&mut one, &prompt, (3, &picture), Logits::All)
        .unwrap();
    // Its last row replaced: the text before the picture reads the same, the picture's first row does
    // not (it sees the last row in the sliding-window layers).
    let mut changed = picture.clone();
    let width = picture.width;
    changed.values[3 * width..].copy_from_slice(&picture_of(&prompt[0..1], sqrt_n_embd).values);
    let mut other = m.new_state(64);
    let moved = m
        .eval_picture(&mut other, &prompt, (3, &changed), Logits::All)
        .unwrap();
    let row = |v: &[f32], r: usize| v[r * n_vocab..(r + 1) * n_vocab].to_vec();
    for r in 0..3 {
        assert_eq!(row(&moved, r), row(&whole, r), "text row {r}");
    }
    for r in 3..12 {
        assert_ne!(row(&moved, r), row(&whole, r), "row {r}");
    }
    // Not as text: the same rows read causally (a token's row sees only what is before it) differ.
    let mut text = m.new_state(64);
    let plain = m.eval(&mut text, &prompt, Logits::All).unwrap();
    assert_eq!(whole[..3 * n_vocab], plain[..3 * n_vocab]);
    assert_ne!(row(&whole, 3), row(&plain, 3));
    // Read in three calls (text, the picture alone as mtmd reads it, text): the same logits.
    let mut parts = m.new_state(64);
    let mut pieces = m.eval(&mut parts, &prompt[..3], Logits::All).unwrap();
    pieces.extend(
        m.eval_picture(&mut parts, &prompt[3..7], (0, &picture), Logits::All)
            .unwrap(),
    );
    pieces.extend(m.eval(&mut parts, &prompt[7..], Logits::All).unwrap());
    assert_eq!(pieces, whole);
}

#[test]
fn gemma4_takes_only_a_gemma4_projector() {
    let (m, _) = model();
    assert!(m.check_projector("gemma4v").is_ok());
    let err = m.check_projector("qwen3vl_merger").unwrap_err();
    assert!(err.to_string().contains("gemma4v"), "{err}");
}
