//! Guessed tokens from the model's own draft block (issue 18's first source, `--draft-block on`): the
//! MTP head a Qwen3.5/3.6 or DeepSeek V4 file carries after its trunk reads the token just written with
//! the trunk's hidden row of the position before it (`n_embd` wide, or every mHC stream of it:
//! [`Model::draft_block_hidden_width`]) and guesses the token after (llama.cpp's `draft-mtp`, one token
//! per window as its single-head form drafts). The main model checks the guess as it checks guesses from
//! repeats ([`super::repeats`]: the same windows, the same rule for keeping a guess, so the answer is
//! the one written without guesses, bit for bit).
//!
//! The draft block keeps a KV cache of its own, one row per position `q` of the conversation, read from
//! the token at `q` and the trunk's hidden row of `q − 1` (zeros for position 0, as llama.cpp pairs the
//! first token). The trunk's forward calls keep their hidden rows in the conversation's state
//! ([`SeqState::keep_hidden`]) until the draft block has read them. Before each window the draft block's
//! state is brought to the conversation's kept tokens: rows of tokens the conversation no longer holds
//! (a wrong guess, a conversation taken back) are cut, and the rows it lacks are read in one call whose
//! last row gives the guess.

use poly_models::compute::Logits;

use super::store::common_prefix;
use crate::model::{EngineError, Model};
use crate::state::SeqState;

/// The draft block's `block` state brought to `main`'s kept tokens and `token` (written at position
/// `main.n_past()`, not yet read by the trunk), then its guess of the token after `token`. The trunk's
/// hidden rows the draft block no longer needs leave `main`.
pub fn guesses(
    model: &Model,
    block: &mut SeqState,
    main: &mut SeqState,
    token: u32,
) -> Result<Vec<u32>, EngineError> {
    let logits = draft_logits(model, block, main, token)?;
    Ok(vec![super::draft::greedy(&logits)])
}

/// Trunk hidden rows kept before an answer that is not guessing brings the draft block up to them (one
/// call of that many rows, instead of a conversation's worth of hidden rows held).
pub const CATCH_UP_ROWS: usize = 256;

/// The draft block's `block` state brought to `main`'s kept tokens: the rows it lacks read in one call
/// (as llama.cpp's draft-mtp reads each of the target's batches), no logits. The prompt's reads call it
/// after each forward call, so the hidden rows kept stay one call's worth.
pub fn catch_up(
    model: &Model,
    block: &mut SeqState,
    main: &mut SeqState,
) -> Result<(), EngineError> {
    let n = main.n_past();
    let same = cut_to_kept(block, main.tokens(), n)?;
    if same < n {
        let tokens = main.tokens()[same..].to_vec();
        let hidden = hidden_rows(model, main, same..n);
        model.eval_draft_block(block, (&tokens, &hidden), Logits::None)?;
        // The row of n − 1 pairs with the next token.
        main.forget_hidden_before(n - 1);
    }
    Ok(())
}

/// Cuts `block` to its rows of tokens the conversation (`kept`) still holds, at most `max` of them: a row
/// depends only on the tokens up to its own. Returns how many stay.
fn cut_to_kept(block: &mut SeqState, kept: &[u32], max: usize) -> Result<usize, EngineError> {
    let same = common_prefix(block.tokens(), kept).min(max);
    if !block.truncate(same) {
        return Err(EngineError(
            "the draft block's state cannot be cut back".into(),
        ));
    }
    Ok(same)
}

/// The hidden rows the draft block reads with the tokens of positions `rows`: the trunk's of the
/// position before each. A row no longer kept (position 0's, a parked conversation's) reads zeros, as
/// llama.cpp pairs the first token: the guesses are worse, the answer the same.
fn hidden_rows(model: &Model, main: &SeqState, rows: std::ops::Range<usize>) -> Vec<f32> {
    let width = model.draft_block_hidden_width();
    let mut hidden = Vec::with_capacity(rows.len() * width);
    for q in rows {
        match q.checked_sub(1).and_then(|r| main.hidden_row(r)) {
            Some(h) => hidden.extend_from_slice(h),
            None => hidden.resize(hidden.len() + width, 0.0),
        }
    }
    hidden
}

/// [`guesses`]'s draft logits (`n_vocab`) of the token after `token`.
fn draft_logits(
    model: &Model,
    block: &mut SeqState,
    main: &mut SeqState,
    token: u32,
) -> Result<Vec<f32>, EngineError> {
    let kept = main.tokens();
    let p = kept.len();
    let same = cut_to_kept(block, kept, p)?;
    let tokens: Vec<u32> = kept[same..].iter().copied().chain([token]).collect();
    let hidden = hidden_rows(model, main, same..p + 1);
    let logits = model.eval_draft_block(block, (&tokens, &hidden), Logits::Last)?;
    // The next window reads from position p + 1, with the hidden row of p; the row of p − 1 stays for a
    // recurrent state restored to this window's start, which reads the token at p again.
    main.forget_hidden_before(p.saturating_sub(1));
    Ok(logits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Arithmetic;

    /// Windows as an answer makes them on a recurrent model (a checkpoint before the checking call; a
    /// wrong guess restores it and reads the token again), every other guess right: before each window
    /// the draft block's logits are, bit for bit, those of a draft block read fresh over the kept tokens
    /// with the hidden rows of one trunk call over them (batch-invariant arithmetic: rows do not depend
    /// on the call's split). So no row of a cut guess, and no hidden row of one, stays behind.
    #[test]
    fn the_draft_block_after_kept_and_cut_guesses_is_a_fresh_one() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/models/qwen35moe-tiny-q4km.gguf");
        let model = Model::load(path).expect("fixture");
        after_kept_and_cut_guesses(model);
    }

    /// The same for deepseek4's draft block (a window-only block reading every mHC stream of the
    /// trunk's last block), on the synthetic `tiny-mtp` shape written to a temporary folder.
    #[test]
    fn deepseek4s_draft_block_after_kept_and_cut_guesses_is_a_fresh_one() {
        use poly_kernels::quant::GgmlType;
        use poly_models::synth::plan::TypeChoice;
        use poly_models::synth::shapes::find_shape;
        use poly_models::synth::{SynthOptions, Synthesis};
        let dir = std::env::temp_dir().join(format!("poly-ds4-draft-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("deepseek4-tiny-mtp.gguf");
        let opts = SynthOptions {
            shape: find_shape("deepseek4", "tiny-mtp").expect("the tiny-mtp shape"),
            types: TypeChoice {
                default: GgmlType::Q8_0,
                overrides: Vec::new(),
            },
            seed: 3,
            route_skew: 0.0,
        };
        Synthesis::prepare(&opts)
            .expect("plan")
            .write(&path, |_, _| {})
            .expect("write");
        let model = Model::load(&path).expect("synthetic model");
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(
            model.draft_block_hidden_width(),
            4 * model.info().n_embd,
            "every stream"
        );
        after_kept_and_cut_guesses(model);
    }

    fn after_kept_and_cut_guesses(model: Model) {
        let model = model.with_arithmetic(Arithmetic::BatchInvariant);
        let n_vocab = model.info().n_vocab;
        let n_embd = model.draft_block_hidden_width();
        let prompt: Vec<u32> = (0..20).map(|i| (i * 97 + 13) % 2000).collect();
        // The answer without guesses: greedy, token by token.
        let mut plain = model.new_state(256);
        let mut logits = model
            .eval(&mut plain, &prompt, Logits::Last)
            .expect("prompt");
        let mut answer = Vec::new();
        for _ in 0..16 {
            let t = super::super::draft::greedy(&logits);
            answer.push(t);
            logits = model.eval(&mut plain, &[t], Logits::Last).expect("token");
        }

        let mut main = model.new_state(256);
        main.keep_hidden(true);
        model
            .eval(&mut main, &prompt, Logits::Last)
            .expect("prompt");
        let mut block = model.new_draft_block_state(256).expect("a draft block");
        // As the prompt's reads do: the block reads the prompt, and only one hidden row stays.
        catch_up(&model, &mut block, &mut main).expect("catch up");
        assert_eq!(block.n_past(), prompt.len());
        assert_eq!(main.hidden_rows_kept(), 1);
        let (mut i, mut windows, mut cut) = (0, 0, 0);
        while i + 1 < answer.len() {
            let token = answer[i];
            let ours = draft_logits(&model, &mut block, &mut main, token).expect("draft");

            // A fresh draft block over the kept tokens and the token, with one trunk call's hidden rows.
            let kept: Vec<u32> = [main.tokens(), &[token]].concat();
            let mut trunk = model.new_state(256);
            trunk.keep_hidden(true);
            model.eval(&mut trunk, &kept, Logits::Last).expect("trunk");
            let mut hidden = vec![0.0; n_embd];
            for q in 1..kept.len() {
                hidden.extend_from_slice(trunk.hidden_row(q - 1).expect("row"));
            }
            let mut fresh = model.new_draft_block_state(256).expect("a draft block");
            let want = model
                .eval_draft_block(&mut fresh, (&kept, &hidden), Logits::Last)
                .expect("fresh draft");
            assert_eq!(ours.len(), n_vocab);
            assert!(
                ours == want,
                "window {windows}: the draft block's logits differ from a fresh one's"
            );

            // Every other window guesses right.
            let right = answer[i + 1];
            let guess = match windows % 2 {
                0 => right,
                _ => (right + 1) % n_vocab as u32,
            };
            let start = main.checkpoint();
            model
                .eval(&mut main, &[token, guess], Logits::All)
                .expect("check");
            if guess == right {
                i += 2;
            } else {
                assert!(main.restore(&start), "restore");
                model
                    .eval(&mut main, &[token], Logits::Last)
                    .expect("again");
                // A pause in guessing: the block reads the kept rows without guessing.
                catch_up(&model, &mut block, &mut main).expect("catch up");
                i += 1;
                cut += 1;
            }
            windows += 1;
        }
        assert!(windows > 4 && cut > 1, "{windows} windows, {cut} cut");
    }
}
