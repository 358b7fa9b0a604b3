//! Guessed tokens from the model's own draft block (issue 18's first source, `--draft-block on`): the
//! MTP head a Qwen3.5/3.6 file carries after its trunk reads the token just written with the trunk's
//! hidden row of the position before it and guesses the token after (llama.cpp's `draft-mtp`, one token
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
    let kept = main.tokens();
    let p = kept.len();
    // Rows of tokens the conversation still holds stay (a row depends only on the tokens up to its own).
    let same = common_prefix(block.tokens(), kept).min(p);
    if !block.truncate(same) {
        return Err(EngineError(
            "the draft block's state cannot be cut back".into(),
        ));
    }
    let tokens: Vec<u32> = kept[same..].iter().copied().chain([token]).collect();
    let n_embd = model.info().n_embd;
    let mut hidden = Vec::with_capacity(tokens.len() * n_embd);
    for q in same..=p {
        // A row no longer kept (a parked conversation's) reads zeros, as position 0 does: the guesses
        // are worse, the answer the same.
        match q.checked_sub(1).and_then(|r| main.hidden_row(r)) {
            Some(h) => hidden.extend_from_slice(h),
            None => hidden.resize(hidden.len() + n_embd, 0.0),
        }
    }
    let logits = model.eval_draft_block(block, (&tokens, &hidden), Logits::Last)?;
    // The next window reads from position p + 1, with the hidden row of p; the row of p − 1 stays for a
    // recurrent state restored to this window's start, which reads the token at p again.
    main.forget_hidden_before(p.saturating_sub(1));
    Ok(vec![super::draft::greedy(&logits)])
}
