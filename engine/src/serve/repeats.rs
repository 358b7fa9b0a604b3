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
//!
//! When to guess, and how many ([`GuessRates`], [`Repeats::window_len`]): a window is worth making only
//! while calls that guess write tokens faster than calls that do not. Both rates are measured (seconds
//! per written token, decayed so that recent calls count most) over the session, since they are the
//! model's and the machine's; when guessing is slower it pauses, its measurements are forgotten, and
//! after the pause it is tried afresh. A window is as long as the answer's measured acceptance says its
//! guesses are likely to last: `1 / (1 − acceptance)` guesses, at most 8 (2 before it is measured).

/// Most tokens guessed at once.
const MAX_WINDOW: usize = 8;

/// Guesses in an answer's first window, before its acceptance is measured: a window's rows cost about a
/// token each where the output matrix is large (a qwen35moe of 248,320 tokens on two threads lost a
/// quarter of its answer rate to one wrong window of 8), so the first is a short probe.
const FIRST_WINDOW: usize = 2;

/// Longest wait (in written tokens) after windows that kept nothing.
const MAX_BACKOFF: usize = 32;

/// How much a decayed sum keeps of what it held at each new call: the last ten or so calls count.
const DECAY: f64 = 0.9;

/// Written tokens without guesses after guessing measured slower, before it is tried again.
const PAUSE: usize = 32;

/// Tokens written by guessing calls (decayed) before their rate is judged: one unlucky probe (a
/// 3-row call that wrote one token) must not pause guessing for [`PAUSE`] tokens (SmolLM2 writing freely
/// paused after its first window; fruitless windows have their own back-off).
const GUESSING_EVIDENCE: f64 = 8.0;

/// Seconds and written tokens, decayed call by call.
#[derive(Clone, Copy, Debug, Default)]
struct Decayed {
    secs: f64,
    tokens: f64,
}

impl Decayed {
    fn add_call(&mut self, secs: f64, tokens: f64) {
        self.secs = DECAY * self.secs + secs;
        self.tokens = DECAY * self.tokens + tokens;
    }

    /// Seconds per written token, once at least `tokens` (decayed) were measured.
    fn rate(&self, tokens: f64) -> Option<f64> {
        (self.tokens >= tokens).then(|| self.secs / self.tokens)
    }
}

/// What a checking call costs by its rows, fitted over a session's checking calls only: `one` second
/// for its first row (the token written), `extra` for each guess. A call of one row without guesses
/// runs other kernels (SmolLM2 on 2 threads: 6.2 ms for a token alone, 17.9 ms for 3 rows, 30.2 for
/// 9), so it stays out of the line, which would read that jump as a dear row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowCost {
    pub one: f64,
    pub extra: f64,
}

/// A decayed least-squares line of seconds against rows.
#[derive(Clone, Copy, Debug, Default)]
struct CallFit {
    n: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl CallFit {
    fn add(&mut self, rows: f64, secs: f64) {
        let d = DECAY;
        self.n = d * self.n + 1.0;
        self.x = d * self.x + rows;
        self.y = d * self.y + secs;
        self.xx = d * self.xx + rows * rows;
        self.xy = d * self.xy + rows * secs;
    }

    /// The line, once calls of more than one size were measured (a negative slope, noise, reads 0).
    fn cost(&self) -> Option<RowCost> {
        let var = self.n * self.xx - self.x * self.x;
        if self.n < 3.0 || var <= 1e-9 * self.n * self.n {
            return None;
        }
        let extra = ((self.n * self.xy - self.x * self.y) / var).max(0.0);
        let base = (self.y - extra * self.x) / self.n;
        Some(RowCost {
            one: (base + extra).max(1e-9),
            extra,
        })
    }
}

/// The measured speeds of answer calls with guesses and without, over a session (the model's and the
/// machine's), and whether guessing pays.
#[derive(Clone, Copy, Debug, Default)]
pub struct GuessRates {
    /// Calls that wrote one token and read nothing again.
    plain: Decayed,
    /// Calls that checked guesses or read kept tokens again after a wrong one, and the tokens their
    /// rows wrote (the first row's, and each kept guess's).
    guessing: Decayed,
    /// Written tokens left before guessing is tried again.
    paused_for: usize,
    /// Checking calls' seconds against their rows.
    fit: CallFit,
    /// Times guessing was measured slower and paused.
    pub pauses: u64,
}

impl GuessRates {
    /// A call of one row without guesses took `secs`.
    pub fn plain_call(&mut self, secs: f64) {
        self.plain.add_call(secs, 1.0);
    }

    /// A call of `rows` rows that checked guesses (or read kept tokens again) took `secs`; its first row
    /// writes a token.
    pub fn guessing_call(&mut self, secs: f64, rows: usize) {
        self.guessing.add_call(secs, 1.0);
        self.fit.add(rows as f64, secs);
    }

    /// What a call's rows cost, once measured.
    pub fn row_cost(&self) -> Option<RowCost> {
        self.fit.cost()
    }

    /// One more token written from a guessing call's rows (a kept guess).
    pub fn guess_kept(&mut self) {
        self.guessing.tokens += 1.0;
    }

    /// Whether the next written token may start a window: not while paused; paused (and the guessing
    /// measurements forgotten, to be taken afresh after the pause) when guessing writes slower than not
    /// guessing; yes while either rate is unknown.
    pub fn allow(&mut self) -> bool {
        if self.paused_for > 0 {
            self.paused_for -= 1;
            return false;
        }
        match (self.guessing.rate(GUESSING_EVIDENCE), self.plain.rate(2.0)) {
            (Some(g), Some(p)) if g > p => {
                self.paused_for = PAUSE;
                self.pauses += 1;
                self.guessing = Decayed::default();
                false
            }
            _ => true,
        }
    }

    /// Milliseconds per written token without guesses and with them (null while unknown), and the
    /// pause's remaining tokens: STATS's `guesses`.
    pub fn report(&self) -> serde_json::Value {
        let ms = |r: Option<f64>| r.map(|s| s * 1e3);
        let cost = self.fit.cost();
        serde_json::json!({
            "call_ms": cost.map(|c| c.one * 1e3),
            "row_ms": cost.map(|c| c.extra * 1e3),
            "plain_ms_per_token": ms(self.plain.rate(2.0)),
            "guessing_ms_per_token": ms(self.guessing.rate(GUESSING_EVIDENCE)),
            "paused_for": self.paused_for,
            "pauses": self.pauses,
        })
    }
}

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
    /// Guesses in the window being checked.
    in_flight: usize,
    /// This answer's guesses reached (kept, or the first wrong one of a window) and kept, decayed window
    /// by window: its acceptance.
    reached: f64,
    kept_decayed: f64,
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
            in_flight: 0,
            reached: 0.0,
            kept_decayed: 0.0,
            proposed: 0,
            accepted: 0,
        }
    }

    /// Guesses to follow `history` then `last` (the conversation's tokens and the one just written), at
    /// most `room`: what followed the latest earlier occurrence of its last `min_match` tokens. None
    /// while backing off. Reads the conversation in place (no copy of it per token).
    pub fn propose(&mut self, history: &[u32], last: u32, room: usize) -> Vec<u32> {
        if !self.ready() {
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

    /// Whether this written token may start a window (not while backing off after fruitless ones).
    pub fn ready(&mut self) -> bool {
        if self.skip > 0 {
            self.skip -= 1;
            return false;
        }
        true
    }

    /// `guesses` from another source (a draft model) counted as proposed.
    pub fn count_proposed(&mut self, guesses: Vec<u32>) -> Vec<u32> {
        self.proposed += guesses.len() as u64;
        guesses
    }

    /// Most guesses in the next window, from the answer's measured acceptance `a` (a guess kept given the
    /// one before it was): with the calls' measured cost, the length that writes the most tokens a second,
    /// `(1 + a + a² + … + a^L) / (one + L·extra)`; without it, as long as a run of kept guesses lasts,
    /// `1 / (1 − a)`. Between 1 and [`MAX_WINDOW`]; [`FIRST_WINDOW`] before anything is measured.
    pub fn window_len(&self, cost: Option<RowCost>) -> usize {
        if self.reached < 1.0 {
            return FIRST_WINDOW;
        }
        let a = (self.kept_decayed / self.reached).clamp(0.0, 1.0);
        let Some(c) = cost else {
            if a >= 1.0 - 1.0 / MAX_WINDOW as f64 {
                return MAX_WINDOW;
            }
            return ((1.0 / (1.0 - a)).ceil() as usize).clamp(1, MAX_WINDOW);
        };
        let (mut best, mut best_rate) = (1, f64::MIN);
        let mut written = 1.0;
        let mut p = 1.0;
        for l in 1..=MAX_WINDOW {
            p *= a;
            written += p;
            let rate = written / (c.one + l as f64 * c.extra);
            if rate > best_rate * (1.0 + 1e-9) {
                (best, best_rate) = (l, rate);
            }
        }
        best
    }

    /// A window of `n` guesses went into a checking call.
    pub fn window_started(&mut self, n: usize) {
        self.kept = 0;
        self.in_flight = n;
    }

    /// The window's next guess was the token written (the last of the window ends it).
    pub fn kept_one(&mut self) {
        self.accepted += 1;
        self.kept += 1;
        self.backoff = 1;
        if self.kept == self.in_flight {
            self.window_ended(self.kept);
        }
    }

    /// The window's next guess was not the token written: the window ends; one that kept nothing
    /// makes the guesser wait, longer each time.
    pub fn window_missed(&mut self) {
        if self.kept == 0 {
            self.skip = self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        }
        self.window_ended(self.kept + 1);
    }

    /// A window ended having reached `reached` of its guesses (those kept, and a wrong one).
    fn window_ended(&mut self, reached: usize) {
        self.reached = DECAY * self.reached + reached as f64;
        self.kept_decayed = DECAY * self.kept_decayed + self.kept as f64;
        self.in_flight = 0;
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
    fn windows_are_as_long_as_the_acceptance_says() {
        let mut r = Repeats::new(3);
        assert_eq!(r.window_len(None), FIRST_WINDOW);
        // Every window's first guess wrong: one guess a window.
        for _ in 0..4 {
            r.window_started(8);
            r.window_missed();
        }
        assert_eq!(r.window_len(None), 1);
        // Windows keep 1 of 2 reached (one kept, then a wrong one): acceptance heads to 1/2, windows of 2.
        let mut r = Repeats::new(3);
        for _ in 0..40 {
            r.window_started(4);
            r.kept_one();
            r.window_missed();
        }
        assert_eq!(r.window_len(None), 2);
        // With the calls' cost: rows nearly free (a hundredth of a call) make windows longer at the
        // same acceptance; rows as dear as calls keep them short.
        let cheap = RowCost {
            one: 1.0,
            extra: 0.01,
        };
        let dear = RowCost {
            one: 1.0,
            extra: 1.0,
        };
        assert!(
            r.window_len(Some(cheap)) > 2,
            "{}",
            r.window_len(Some(cheap))
        );
        assert_eq!(r.window_len(Some(dear)), 1);
        // Whole windows kept: the longest.
        for _ in 0..40 {
            r.window_started(2);
            r.kept_one();
            r.kept_one();
        }
        assert_eq!(r.window_len(None), MAX_WINDOW);
        assert_eq!(
            r.window_len(Some(RowCost {
                one: 1.0,
                extra: 0.1
            })),
            MAX_WINDOW
        );
        // The room caps what is proposed.
        let mut r = Repeats::new(1);
        assert_eq!(r.propose(&[9, 1, 2, 3, 9], 1, 1), vec![2]);
    }

    #[test]
    fn guessing_pauses_while_it_writes_slower() {
        let mut rates = GuessRates::default();
        // Nothing measured: guess.
        assert!(rates.allow());
        // Plain calls 10 ms a token; windows 30 ms a call writing 2 tokens (15 ms a token): slower.
        for _ in 0..10 {
            rates.plain_call(0.010);
            rates.guessing_call(0.030, 3);
            rates.guess_kept();
        }
        assert!(!rates.allow());
        assert_eq!(rates.pauses, 1);
        // Paused for PAUSE tokens (the first refusal counted), then tried afresh.
        for _ in 0..PAUSE {
            assert!(!rates.allow());
        }
        assert!(rates.allow());
        // Windows that write 4 tokens a 30 ms call (7.5 ms a token) pay: no pause.
        for _ in 0..10 {
            rates.guessing_call(0.030, 3);
            for _ in 0..3 {
                rates.guess_kept();
            }
        }
        assert!(rates.allow());
        assert_eq!(rates.pauses, 1);
        // Checking calls of 3 rows at 30 ms, of 5 at 40 ms: 5 ms a guess, 20 ms for the first row (calls
        // of one row stay out of the line).
        for _ in 0..10 {
            rates.guessing_call(0.030, 3);
            rates.guessing_call(0.040, 5);
            rates.plain_call(0.001);
        }
        let c = rates.row_cost().expect("fitted");
        assert!(
            (c.extra - 0.005).abs() < 1e-6 && (c.one - 0.020).abs() < 1e-6,
            "{c:?}"
        );
        let report = rates.report();
        assert_eq!(report["paused_for"], 0);
        assert!(report["plain_ms_per_token"].as_f64().unwrap() > 0.0);
    }

    #[test]
    fn fruitless_windows_back_off() {
        let mut r = Repeats::new(3);
        let seq = [1, 2, 3, 9, 1, 2];
        let window = |r: &mut Repeats| {
            let g = r.propose(&seq, 3, 4);
            if !g.is_empty() {
                r.window_started(g.len());
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
