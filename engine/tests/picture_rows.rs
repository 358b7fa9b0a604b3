//! A picture's rows in a prompt call ([`Model::eval_picture`]) on the synthetic tiny `qwen35moe` (F32):
//! rows that are the token embeddings' own at the positions text would have give the text's logits bit
//! for bit; a picture's grid positions (time, row, column) change the logits from its second row on; the
//! text after a picture sits at the picture's first position plus its span, whether the prompt is read in
//! one call or in pieces, and when read beside a state without a picture (`eval_many`); calls whose
//! picture does not fit are refused.

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

/// The tiny `qwen35moe` in F32 in batch-invariant arithmetic, and its token embedding table.
fn model() -> &'static (Model, Vec<f32>) {
    static MODEL: OnceLock<(Model, Vec<f32>)> = OnceLock::new();
    MODEL.get_or_init(|| {
        let dir: PathBuf =
            std::env::temp_dir().join(format!("poly-engine-picture-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("qwen35moe-f32.gguf");
        let shape = find_shape("qwen35moe", "tiny").expect("a tiny shape");
        write_synth(shape, GgmlType::F32, 3, &path);
        let file = GgufFile::open(&path).unwrap();
        let table: Vec<f32> = file
            .tensor("token_embd.weight")
            .unwrap()
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let model = Model::load(&path)
            .unwrap()
            .with_arithmetic(Arithmetic::BatchInvariant);
        std::fs::remove_file(&path).unwrap();
        (model, table)
    })
}

/// A picture of `n_x × n_y` rows that are the embeddings of `tokens`.
fn picture_of(tokens: &[u32], n_x: usize, n_y: usize) -> ImageRows {
    let (m, table) = model();
    let width = m.info().n_embd;
    assert_eq!(tokens.len(), n_x * n_y);
    ImageRows {
        n_x,
        n_y,
        width,
        values: tokens
            .iter()
            .flat_map(|&t| table[t as usize * width..][..width].iter().copied())
            .collect(),
    }
}

#[test]
fn a_one_row_picture_of_a_tokens_embedding_reads_as_that_token() {
    let (m, _) = model();
    let prompt = random_tokens(12, m.info().n_vocab, 1);
    let mut text = m.new_state(64);
    let want = m.eval(&mut text, &prompt, Logits::All).unwrap();
    let mut pic = m.new_state(64);
    let got = m
        .eval_picture(
            &mut pic,
            &prompt,
            (5, &picture_of(&prompt[5..6], 1, 1)),
            Logits::All,
        )
        .unwrap();
    assert_eq!(got, want);
    // A 1×1 picture spans one position: the text after it goes on as after the token.
    let next = [prompt[0], prompt[3]];
    assert_eq!(
        m.eval(&mut pic, &next, Logits::All).unwrap(),
        m.eval(&mut text, &next, Logits::All).unwrap()
    );
    // Rows that are not the token's change what follows.
    let mut other = m.new_state(64);
    let got = m
        .eval_picture(
            &mut other,
            &prompt,
            (5, &picture_of(&prompt[6..7], 1, 1)),
            Logits::All,
        )
        .unwrap();
    let n_vocab = m.info().n_vocab;
    assert_eq!(got[..5 * n_vocab], want[..5 * n_vocab]);
    assert_ne!(got[5 * n_vocab..], want[5 * n_vocab..]);
}

#[test]
fn a_pictures_grid_positions_and_span_place_it_and_the_text_after_it() {
    let (m, _) = model();
    let n_vocab = m.info().n_vocab;
    let prompt = random_tokens(14, n_vocab, 2);
    // A 3×2 picture in rows 4..10: positions [4,4,4], [4,4,5], [4,4,6], [4,5,4], [4,5,5], [4,5,6], then
    // the text from 4 + 3 = 7 on.
    let picture = picture_of(&prompt[4..10], 3, 2);
    let mut one = m.new_state(64);
    let whole = m
        .eval_picture(&mut one, &prompt, (4, &picture), Logits::All)
        .unwrap();
    assert_eq!(one.rope_position(10), 7);
    assert_eq!(one.rope_position(13), 10);
    // Against plain text: the same up to the picture's first row (its positions are the text's), then
    // different (the grid positions).
    let mut text = m.new_state(64);
    let plain = m.eval(&mut text, &prompt, Logits::All).unwrap();
    assert_eq!(whole[..5 * n_vocab], plain[..5 * n_vocab]);
    for row in 5..14 {
        let r = row * n_vocab..(row + 1) * n_vocab;
        assert_ne!(whole[r.clone()], plain[r], "row {row}");
    }
    // Read in three calls (text, the picture alone, text), the state keeps the picture's span.
    let mut parts = m.new_state(64);
    let mut pieces = m.eval(&mut parts, &prompt[..4], Logits::All).unwrap();
    pieces.extend(
        m.eval_picture(&mut parts, &prompt[4..10], (0, &picture), Logits::All)
            .unwrap(),
    );
    pieces.extend(m.eval(&mut parts, &prompt[10..], Logits::All).unwrap());
    assert_eq!(pieces, whole);
    let next = [prompt[1]];
    assert_eq!(
        m.eval(&mut parts, &next, Logits::Last).unwrap(),
        m.eval(&mut one, &next, Logits::Last).unwrap()
    );
    // Going back before the picture forgets its span.
    let mut cut = m.new_state(64);
    let cp = cut.checkpoint();
    m.eval_picture(&mut cut, &prompt, (4, &picture), Logits::None)
        .unwrap();
    assert!(cut.restore(&cp));
    assert!(!cut.has_pictures());
    assert_eq!(cut.rope_position(10), 10);
}

#[test]
fn pictures_that_do_not_fit_the_call_are_refused() {
    let (m, _) = model();
    let prompt = random_tokens(6, m.info().n_vocab, 3);
    let picture = picture_of(&prompt[..4], 2, 2);
    let mut state = m.new_state(64);
    assert!(m
        .eval_picture(&mut state, &prompt, (3, &picture), Logits::Last)
        .is_err());
    let narrow = ImageRows {
        width: picture.width - 1,
        values: vec![0.0; 4 * (picture.width - 1)],
        ..picture.clone()
    };
    assert!(m
        .eval_picture(&mut state, &prompt, (0, &narrow), Logits::Last)
        .is_err());
    assert_eq!(state.n_past(), 0);
}

#[test]
fn states_with_and_without_a_picture_read_together_as_alone() {
    let (m, _) = model();
    let prompt = random_tokens(10, m.info().n_vocab, 4);
    let picture = picture_of(&prompt[2..8], 2, 3);
    let (mut a, mut b) = (m.new_state(64), m.new_state(64));
    m.eval_picture(&mut a, &prompt, (2, &picture), Logits::None)
        .unwrap();
    m.eval(&mut b, &prompt, Logits::None).unwrap();
    let (mut a_alone, mut b_alone) = (a.clone(), b.clone());
    let next = [prompt[0], prompt[5], prompt[9]];
    assert!(m.batches_states(&a));
    let together = m.eval_many(&mut [(&mut a, &next[..]), (&mut b, &next[..])]);
    let alone = [
        m.eval(&mut a_alone, &next, Logits::All).unwrap(),
        m.eval(&mut b_alone, &next, Logits::All).unwrap(),
    ];
    assert_eq!(together[0].as_ref().unwrap(), &alone[0]);
    assert_eq!(together[1].as_ref().unwrap(), &alone[1]);
    assert_ne!(alone[0], alone[1]);
}
