//! Guessed tokens from a draft model (issue 18's second source, `--draft FILE`): a smaller model of the
//! same vocabulary writes the next few tokens greedily, and the main model checks them in one call as
//! it checks guesses from repeats ([`super::repeats`]: the same windows, the same rule for keeping a
//! guess, so the answer is the one written without guesses, bit for bit).
//!
//! The draft model runs on the CPU and keeps a state of its own per answer, read from the conversation's
//! tokens when the answer starts and brought up to the main model's kept tokens before each window: a
//! wrong guess leaves its extra rows, which the next window cuts back (KV caches only: a draft model
//! with recurrent layers is refused at load).

use poly_models::compute::Logits;

use super::store::common_prefix;
use crate::model::{EngineError, Model};
use crate::state::SeqState;

/// Why `draft` cannot guess for `main`, if it cannot.
pub fn refuses(main: &Model, draft: &Model) -> Option<String> {
    let (a, b) = (main.info().n_vocab, draft.info().n_vocab);
    if a != b {
        return Some(format!(
            "its vocabulary has {b} tokens, the model's {a}: a draft model must share the model's vocabulary"
        ));
    }
    if draft.new_state(1).has_recurrent() {
        return Some(format!(
            "its architecture ({}) has recurrent layers, which a draft model cannot cut back yet",
            draft.info().arch
        ));
    }
    None
}

/// The draft model's state brought to the main model's kept tokens, `history` then `tail` (the tokens
/// read again after a restore and the one just written; passed in two parts so that a token's window
/// does not copy the conversation), then up to `n` tokens it writes greedily after them.
pub fn guesses(
    draft: &Model,
    state: &mut SeqState,
    (history, tail): (&[u32], &[u32]),
    n: usize,
) -> Result<Vec<u32>, EngineError> {
    let len = history.len() + tail.len();
    if n == 0 || len == 0 {
        return Ok(Vec::new());
    }
    let mut same = common_prefix(state.tokens(), history);
    if same == history.len() {
        same += common_prefix(&state.tokens()[same..], tail);
    }
    // At least the last kept token is read again: its row's logits give the first guess.
    let same = same.min(len - 1);
    if !state.truncate(same) {
        return Err(EngineError(
            "the draft model's state cannot be cut back".into(),
        ));
    }
    // What the state lacks: a few tokens, unless the conversation went back since the last window.
    let unread: Vec<u32> = match same.checked_sub(history.len()) {
        Some(t) => tail[t..].to_vec(),
        None => [&history[same..], tail].concat(),
    };
    let mut logits = draft.eval(state, &unread, Logits::Last)?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let g = greedy(&logits);
        out.push(g);
        if i + 1 < n {
            logits = draft.eval(state, &[g], Logits::Last)?;
        }
    }
    Ok(out)
}

/// The likeliest token (the lowest id among equals).
pub(crate) fn greedy(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_likeliest_token_and_ties_to_the_lower() {
        assert_eq!(greedy(&[0.1, 0.5, 0.2]), 1);
        assert_eq!(greedy(&[0.5, 0.5, 0.2]), 0);
    }
}
