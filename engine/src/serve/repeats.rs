//! Guessed tokens from repeats (issue 18's third source, for models without a draft block): when the
//! conversation's last tokens occurred before, the tokens that followed them then are guessed to follow
//! now, and one forward call checks them all (the token just written and its guesses, every row's
//! logits). Each guess the sampler would have chosen anyway is kept; the state is cut back to the last
//! kept one.
//!
//! Exact for any sampler: every written token is still drawn from its own row's logits, in order, with
//! the sampler's own random stream; a guess only says whether the next row was computed on the right
//! token. In batch-invariant arithmetic a row's logits do not depend on the call's other rows, so the
//! answer is the one written token by token, bit for bit (`tests/serve_guesses.rs`).
//!
//! Where it runs: models on the CPU, where a call of a few rows costs little more than one (the weights
//! are read once). KV caches are cut anywhere; recurrent layers (qwen35moe's delta-net, lfm2moe's short
//! convolutions) cannot be cut back, so a window on such a state starts from a checkpoint, and after a
//! wrong guess the state is restored to it and the next call reads the kept tokens again before its own
//! (their rows' logits are dropped: the recurrences run token by token, so the state they leave is the
//! one token-by-token reading leaves). Not on the card yet: one that holds only part of the experts would
//! stage them for every checking call.

/// Most tokens guessed at once.
const MAX_WINDOW: usize = 8;

/// Longest wait (in written tokens) after windows that kept nothing.
const MAX_BACKOFF: usize = 32;

/// The guesser's state for one answer, and its counts.
#[derive(Debug)]
pub struct Repeats {
    /// Written tokens to pass before guessing again (after a window that kept nothing).
    skip: usize,
    /// The next wait after a fruitless window: doubled each time, back to one after a kept guess.
    backoff: usize,
    /// Guesses kept of the current window.
    kept: usize,
    /// Fewest tokens that must match before their sequel is guessed (`--repeats-min-match`).
    min_match: usize,
    pub proposed: u64,
    pub accepted: u64,
}

impl Repeats {
    /// A guesser that needs `min_match` (at least 1) tokens to repeat.
    pub fn new(min_match: usize) -> Self {
        Repeats {
            skip: 0,
            backoff: 1,
            kept: 0,
            min_match: min_match.max(1),
            proposed: 0,
            accepted: 0,
        }
    }

    /// Guesses to follow `history` then `last` (the conversation's tokens and the one just written), at
    /// most `room`: what followed the latest earlier occurrence of its last `min_match` tokens. None
    /// while backing off. Reads the conversation in place (no copy of it per token).
    pub fn propose(&mut self, history: &[u32], last: u32, room: usize) -> Vec<u32> {
        if self.skip > 0 {
            self.skip -= 1;
            return Vec::new();
        }
        let room = room.min(MAX_WINDOW);
        let len = history.len() + 1;
        let n = self.min_match;
        if room == 0 || len <= n {
            return Vec::new();
        }
        let at = |i: usize| history.get(i).copied().unwrap_or(last);
        let tail = len - n;
        // The latest occurrence that ends before the tail itself, so something follows it.
        let found = (0..tail)
            .rev()
            .find(|&i| (0..n).all(|k| at(i + k) == at(tail + k)));
        let Some(i) = found else {
            return Vec::new();
        };
        let guesses: Vec<u32> = (i + n..len).take(room).map(at).collect();
        self.proposed += guesses.len() as u64;
        guesses
    }

    /// A window of guesses went into a checking call.
    pub fn window_started(&mut self) {
        self.kept = 0;
    }

    /// The window's next guess was the token written.
    pub fn kept_one(&mut self) {
        self.accepted += 1;
        self.kept += 1;
        self.backoff = 1;
    }

    /// The window's next guess was not the token written: the window ends; one that kept nothing
    /// makes the guesser wait, longer each time.
    pub fn window_missed(&mut self) {
        if self.kept == 0 {
            self.skip = self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequel_of_the_latest_match_is_guessed() {
        let mut r = Repeats::new(3);
        // 7 8 9 occurred twice before; the latest is followed by 4 5.
        let seq = [7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 7, 8];
        assert_eq!(r.propose(&seq, 9, 8), vec![4, 5, 6, 7, 8, 9]);
        assert_eq!(r.propose(&seq, 9, 2), vec![4, 5]);
        assert_eq!(r.proposed, 8);
        // No earlier occurrence of the tail, or too short a sequence.
        assert!(r.propose(&[1, 2, 3, 4, 5], 6, 8).is_empty());
        assert!(r.propose(&[1, 1], 1, 8).is_empty());
        assert!(r.propose(&seq, 9, 0).is_empty());
        // One matching token is enough with a minimum of one: the latest earlier 9 is followed by 4.
        let mut one = Repeats::new(1);
        assert_eq!(one.propose(&[9, 1, 9, 4], 9, 2), vec![4, 9]);
        // Two needed: 4 9 never occurred before.
        assert!(Repeats::new(2).propose(&[9, 1, 9, 4], 9, 2).is_empty());
    }

    #[test]
    fn fruitless_windows_back_off() {
        let mut r = Repeats::new(3);
        let seq = [1, 2, 3, 9, 1, 2];
        let window = |r: &mut Repeats| {
            let g = r.propose(&seq, 3, 4);
            if !g.is_empty() {
                r.window_started();
            }
            !g.is_empty()
        };
        assert!(window(&mut r));
        r.window_missed();
        // One token without guesses, then guesses again; after a second miss two.
        assert!(!window(&mut r));
        assert!(window(&mut r));
        r.window_missed();
        assert!(!window(&mut r));
        assert!(!window(&mut r));
        assert!(window(&mut r));
        // A kept guess ends the backing off; a miss after it in the same window waits not at all.
        r.kept_one();
        r.window_missed();
        assert_eq!(r.accepted, 1);
        assert!(window(&mut r));
        r.window_missed();
        assert!(!window(&mut r));
        assert!(window(&mut r));
    }
}
