//! The conversations the engine keeps between requests: the active one (the state the last request left)
//! and parked ones in RAM, bounded in bytes with the least recently used dropped first.
//!
//! A request takes its conversation out of the store ([`Store::take`]), works on it, and either publishes
//! it ([`Store::publish`]: it becomes the active conversation, the one it displaced is parked) or hands it
//! back as it was ([`Store::put_back`], after [`Undo::apply`]). So a state becomes visible only when its
//! request completes, and a cancelled or failed request leaves what was kept untouched.
//!
//! Recurrent layers cannot be rewound, so a conversation keeps [`Checkpoint`]s along its prompt reads;
//! going back to a position needs one at or before it. KV-only states are cut anywhere.

use std::sync::Arc;

use crate::state::{Checkpoint, PictureMark, SeqState};

/// Most checkpoints one conversation keeps (each holds every recurrent layer's state: tens of MiB on a
/// large model).
pub const MAX_CHECKPOINTS: usize = 16;

/// One kept conversation: its state and the checkpoints taken along it.
#[derive(Debug)]
pub struct Conversation {
    /// The name the server gave it (`None`: requests that named none).
    pub id: Option<String>,
    pub state: SeqState,
    /// The draft model's state of the same tokens (`--draft`), as the last answer left it: the next
    /// answer brings it up to the kept tokens instead of reading the conversation again.
    pub draft: Option<SeqState>,
    /// Sorted by position, all at or before the state's position, each taken on this very token
    /// history. Shared so that a request's undo copy costs nothing.
    checkpoints: Vec<Arc<Checkpoint>>,
    last_used: u64,
}

impl Conversation {
    /// A new, empty conversation.
    pub fn new(id: Option<String>, state: SeqState) -> Conversation {
        Conversation {
            id,
            state,
            draft: None,
            checkpoints: Vec::new(),
            last_used: 0,
        }
    }

    /// Bytes held: the state, its checkpoints and the draft model's state.
    pub fn bytes(&self) -> usize {
        self.state.bytes()
            + self.checkpoints.iter().map(|c| c.bytes()).sum::<usize>()
            + self.draft.as_ref().map_or(0, SeqState::bytes)
    }

    /// Checkpoints kept.
    pub fn n_checkpoints(&self) -> usize {
        self.checkpoints.len()
    }

    /// The furthest position of `prompt` this conversation can resume from: within the prefix the
    /// state shares with `prompt`, and before the prompt's last token (whose logits the request needs,
    /// so it is always read). KV-only states resume anywhere; others at their end or at a checkpoint.
    ///
    /// `pictures` are the prompt's: the state is the prompt's only up to the first picture that is not
    /// the same (same cells, same key) on both sides, as placeholders are alike for every picture of a
    /// size; and a read never resumes inside a picture, which is read whole.
    pub fn resume_point(&self, prompt: &[u32], pictures: &[PictureMark]) -> usize {
        let mut shared = common_prefix(self.state.tokens(), prompt);
        let kept = self.state.picture_marks();
        for m in kept.iter().chain(pictures) {
            if m.start < shared && !(kept.contains(m) && pictures.contains(m)) {
                shared = m.start;
            }
        }
        if let Some(m) = pictures.iter().find(|m| m.start < shared && shared < m.end) {
            shared = m.start;
        }
        let limit = shared.min(prompt.len().saturating_sub(1));
        if !self.state.has_recurrent() || limit == self.state.n_past() {
            return limit;
        }
        self.checkpoints
            .iter()
            .rev()
            .map(|c| c.n_past())
            .find(|&p| p <= limit)
            .unwrap_or(0)
    }

    /// Goes back to position `pos` (from [`Conversation::resume_point`]), dropping the checkpoints past
    /// it. Returns an [`Undo`] that brings the conversation back as it was.
    pub fn rewind(&mut self, pos: usize) -> Undo {
        let undo = if pos == self.state.n_past() {
            // Only extended: cutting back and restoring the recurrent layers' present state undoes it.
            UndoState::Extend(self.state.checkpoint())
        } else {
            UndoState::Whole(Box::new(self.state.clone()))
        };
        let undo = Undo {
            state: undo,
            checkpoints: self.checkpoints.clone(),
        };
        if pos < self.state.n_past() {
            let rewound = if pos == 0 {
                self.state.clear();
                true
            } else if self.state.has_recurrent() {
                self.checkpoints
                    .iter()
                    .find(|c| c.n_past() == pos)
                    .is_some_and(|c| self.state.restore(c))
            } else {
                self.state.truncate(pos)
            };
            if !rewound {
                // resume_point only names reachable positions; reading everything again is still right.
                self.state.clear();
            }
        }
        let n_past = self.state.n_past();
        self.checkpoints.retain(|c| c.n_past() <= n_past);
        undo
    }

    /// Keeps a checkpoint of the present state (a no-op without recurrent layers, which need none, or
    /// when one is already kept here). Beyond [`MAX_CHECKPOINTS`] the earliest is dropped: going back
    /// is mostly going back a little (a regenerated answer, an edited last message).
    pub fn add_checkpoint(&mut self) {
        let n_past = self.state.n_past();
        if !self.state.has_recurrent() || self.checkpoints.iter().any(|c| c.n_past() == n_past) {
            return;
        }
        self.checkpoints.push(Arc::new(self.state.checkpoint()));
        self.checkpoints.sort_by_key(|c| c.n_past());
        if self.checkpoints.len() > MAX_CHECKPOINTS {
            self.checkpoints.remove(0);
        }
    }
}

/// How many leading tokens `a` and `b` share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[derive(Debug)]
enum UndoState {
    /// The state was only extended: going back to this checkpoint restores it.
    Extend(Checkpoint),
    /// The state was rewound: a copy of it as it was.
    Whole(Box<SeqState>),
}

/// What [`Conversation::rewind`] needs to give back the conversation as it was before a request.
#[derive(Debug)]
pub struct Undo {
    state: UndoState,
    checkpoints: Vec<Arc<Checkpoint>>,
}

impl Undo {
    /// Brings `conv` back as it was before the request.
    pub fn apply(self, conv: &mut Conversation) {
        match self.state {
            UndoState::Extend(cp) => {
                if !conv.state.restore(&cp) {
                    // Cannot happen while the request only extended the state; an empty state is
                    // still a correct (if slower) one.
                    conv.state.clear();
                }
            }
            UndoState::Whole(state) => conv.state = *state,
        }
        conv.checkpoints = self.checkpoints;
        let n_past = conv.state.n_past();
        conv.checkpoints.retain(|c| c.n_past() <= n_past);
    }
}

/// Where a request's conversation came from, so that it can go back there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Active,
    Parked,
    New,
}

/// The active conversation and the parked ones.
#[derive(Debug)]
pub struct Store {
    active: Option<Conversation>,
    /// Parked conversations, in no order (few; the least recently used is found by scanning).
    parked: Vec<Conversation>,
    park_limit: usize,
    clock: u64,
    /// Conversations dropped to keep within `park_limit` (or too large to park at all).
    pub evicted: u64,
}

impl Store {
    /// An empty store whose parked conversations hold at most `park_limit` bytes.
    pub fn new(park_limit: usize) -> Store {
        Store {
            active: None,
            parked: Vec::new(),
            park_limit,
            clock: 0,
            evicted: 0,
        }
    }

    /// Takes out the conversation a request for `conversation` works on: the active one when the
    /// request names none or names it; else the parked one of that name; else a new one from `fresh`.
    pub fn take(
        &mut self,
        conversation: Option<&str>,
        fresh: impl FnOnce() -> SeqState,
    ) -> (Conversation, Origin) {
        let active_matches = match (&self.active, conversation) {
            (Some(_), None) => true,
            (Some(a), Some(name)) => a.id.as_deref() == Some(name),
            (None, _) => false,
        };
        if active_matches {
            if let Some(a) = self.active.take() {
                return (a, Origin::Active);
            }
        }
        if let Some(name) = conversation {
            if let Some(i) = self
                .parked
                .iter()
                .position(|c| c.id.as_deref() == Some(name))
            {
                return (self.parked.swap_remove(i), Origin::Parked);
            }
        }
        (
            Conversation::new(conversation.map(str::to_string), fresh()),
            Origin::New,
        )
    }

    /// Makes `conv`, whose request completed, the active conversation; a different active one is parked.
    /// One of the same name (requests of one conversation that ran at once, `--parallel`: the second
    /// started from a fresh state) is older and dropped, active or parked: the last to complete is kept.
    pub fn publish(&mut self, mut conv: Conversation) {
        self.clock += 1;
        conv.last_used = self.clock;
        if let Some(name) = conv.id.as_deref() {
            self.parked.retain(|c| c.id.as_deref() != Some(name));
        }
        if let Some(old) = self.active.take() {
            if old.id.is_none() || old.id != conv.id {
                self.park(old);
            }
        }
        self.active = Some(conv);
    }

    /// Hands back `conv` (already undone) whose request did not complete, to where it came from, unless
    /// a conversation of its name was published meanwhile (requests running at once): that one is newer.
    pub fn put_back(&mut self, conv: Conversation, origin: Origin) {
        let superseded = conv.id.as_deref().is_some_and(|name| {
            self.active
                .iter()
                .chain(&self.parked)
                .any(|c| c.id.as_deref() == Some(name))
        });
        match origin {
            _ if superseded => {}
            Origin::Active if self.active.is_none() => self.active = Some(conv),
            // Another conversation became active while this one's request ran.
            Origin::Active => self.park(conv),
            // It fit before the request and is as it was (others parked meanwhile may leave less room).
            Origin::Parked if self.parked_bytes() + conv.bytes() <= self.park_limit => {
                self.parked.push(conv)
            }
            Origin::Parked => self.park(conv),
            Origin::New => {}
        }
    }

    fn park(&mut self, mut conv: Conversation) {
        if conv.id.is_none() {
            // No request can name it again: parking it would only hold memory.
            return;
        }
        conv.state.shrink_to_fit();
        let need = conv.bytes();
        if need > self.park_limit {
            self.evicted += 1;
            return;
        }
        while self.parked_bytes() + need > self.park_limit {
            let Some(lru) = self
                .parked
                .iter()
                .enumerate()
                .min_by_key(|(_, c)| c.last_used)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.parked.swap_remove(lru);
            self.evicted += 1;
        }
        self.parked.push(conv);
    }

    /// The active conversation.
    pub fn active(&self) -> Option<&Conversation> {
        self.active.as_ref()
    }

    /// Parked conversations, in no order.
    pub fn parked(&self) -> &[Conversation] {
        &self.parked
    }

    /// Bytes the parked conversations hold.
    pub fn parked_bytes(&self) -> usize {
        self.parked.iter().map(Conversation::bytes).sum()
    }

    /// The bound on [`Store::parked_bytes`].
    pub fn park_limit(&self) -> usize {
        self.park_limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{KvPrecision, LayerState};
    use poly_models::arch::StateSpec;

    const KV: StateSpec = StateSpec::Kv {
        n_head_kv: 1,
        head_dim_k: 2,
        head_dim_v: 2,
        window: None,
    };
    const REC: StateSpec = StateSpec::Recurrent {
        conv_kernel: 2,
        conv_channels: 2,
        n_v_heads: 1,
        head_k: 1,
        head_v: 1,
    };

    /// Stands in for a forward call: every layer's state depends on every token read.
    fn read(s: &mut SeqState, tokens: &[u32]) {
        for &t in tokens {
            for il in 0..s.n_layers() {
                match s.layer_mut(il) {
                    LayerState::Kv(c) => c.append(&[t as f32; 2], &[t as f32; 2]),
                    LayerState::Recurrent(r) => r.delta[0] = r.delta[0] * 3.0 + t as f32,
                }
            }
            s.push_tokens(&[t]);
        }
    }

    fn fresh(specs: &[StateSpec], tokens: &[u32]) -> SeqState {
        let mut s = SeqState::with_precision(specs, 64, KvPrecision::F32);
        read(&mut s, tokens);
        s
    }

    #[test]
    fn resume_points_respect_what_can_be_rewound() {
        let mut kv = Conversation::new(None, fresh(&[KV], &[1, 2, 3, 4, 5]));
        assert_eq!(kv.resume_point(&[1, 2, 3, 4, 5, 6], &[]), 5);
        assert_eq!(kv.resume_point(&[1, 2, 3, 9], &[]), 3);
        assert_eq!(
            kv.resume_point(&[1, 2, 3], &[]),
            2,
            "the last token is read again"
        );
        assert_eq!(kv.resume_point(&[7], &[]), 0);
        kv.rewind(3);
        read(&mut kv.state, &[9]);
        assert_eq!(kv.state, fresh(&[KV], &[1, 2, 3, 9]));

        let mut h = Conversation::new(
            None,
            SeqState::with_precision(&[KV, REC], 64, KvPrecision::F32),
        );
        read(&mut h.state, &[1, 2]);
        h.add_checkpoint();
        h.add_checkpoint();
        read(&mut h.state, &[3, 4, 5]);
        assert_eq!(h.n_checkpoints(), 1);
        assert_eq!(h.resume_point(&[1, 2, 3, 4, 5, 6], &[]), 5, "its end");
        assert_eq!(
            h.resume_point(&[1, 2, 3, 9], &[]),
            2,
            "the checkpoint before the cut"
        );
        assert_eq!(h.resume_point(&[1, 9], &[]), 0);
        let undo = h.rewind(2);
        read(&mut h.state, &[3, 9]);
        assert_eq!(h.state, fresh(&[KV, REC], &[1, 2, 3, 9]));
        undo.apply(&mut h);
        assert_eq!(h.state, fresh(&[KV, REC], &[1, 2, 3, 4, 5]));
        assert_eq!(h.n_checkpoints(), 1);
        // Extending, then undoing.
        let undo = h.rewind(5);
        read(&mut h.state, &[6, 7]);
        h.add_checkpoint();
        undo.apply(&mut h);
        assert_eq!(h.state, fresh(&[KV, REC], &[1, 2, 3, 4, 5]));
        assert_eq!(h.n_checkpoints(), 1);
        // Past the bound, the earliest checkpoints go.
        for t in 0..MAX_CHECKPOINTS as u32 + 2 {
            read(&mut h.state, &[t]);
            h.add_checkpoint();
        }
        assert_eq!(h.n_checkpoints(), MAX_CHECKPOINTS);
        assert_eq!(
            h.resume_point(&[1, 2, 3, 9], &[]),
            0,
            "the checkpoint at 2 is gone"
        );
    }

    #[test]
    fn resume_points_stop_at_the_first_picture_that_differs() {
        let mark = |start, end, key| PictureMark { start, end, key };
        // Kept: [1, P P P, 2, 3] with picture 7 at cells 1..4.
        let mut state = fresh(&[KV], &[1, 0, 0, 0, 2, 3]);
        state.record_picture(4, 3, 3);
        state.key_last_picture(7);
        let kv = Conversation::new(None, state);
        let prompt = [1, 0, 0, 0, 2, 3, 4];
        assert_eq!(
            kv.resume_point(&prompt, &[mark(1, 4, 7)]),
            6,
            "the same picture"
        );
        assert_eq!(
            kv.resume_point(&prompt, &[mark(1, 4, 8)]),
            1,
            "another picture"
        );
        assert_eq!(
            kv.resume_point(&prompt, &[]),
            1,
            "text where the picture was"
        );
        // A prompt with a picture where the state holds text of the same tokens.
        let text = Conversation::new(None, fresh(&[KV], &[1, 0, 0, 0, 2, 3]));
        assert_eq!(text.resume_point(&prompt, &[mark(1, 4, 7)]), 1);
        // Never inside a picture: a state that ends within the prompt's picture resumes at its start.
        let short = Conversation::new(None, fresh(&[KV], &[1, 0, 0]));
        assert_eq!(short.resume_point(&prompt, &[mark(1, 4, 7)]), 1);
    }

    #[test]
    fn parking_keeps_the_most_recent_within_the_bound() {
        let one = fresh(&[KV], &[1, 2]).bytes();
        let mut store = Store::new(2 * one);
        let new_state = || SeqState::with_precision(&[KV], 64, KvPrecision::F32);
        for name in ["a", "b", "c", "d"] {
            let (mut conv, origin) = store.take(Some(name), new_state);
            assert_eq!(origin, Origin::New);
            read(&mut conv.state, &[1, 2]);
            store.publish(conv);
        }
        // d is active; a was dropped for b and c.
        assert_eq!(store.active().and_then(|c| c.id.as_deref()), Some("d"));
        let mut parked: Vec<_> = store.parked().iter().filter_map(|c| c.id.clone()).collect();
        parked.sort();
        assert_eq!(parked, ["b", "c"]);
        assert_eq!(store.parked_bytes(), 2 * one);
        assert_eq!(store.evicted, 1);
        // b comes back whole; a failed request on c hands it back unchanged.
        let (b, origin) = store.take(Some("b"), new_state);
        assert_eq!((origin, b.state.tokens()), (Origin::Parked, &[1, 2][..]));
        store.publish(b);
        let (mut c, origin) = store.take(Some("c"), new_state);
        let undo = c.rewind(0);
        read(&mut c.state, &[5]);
        undo.apply(&mut c);
        store.put_back(c, origin);
        assert_eq!(store.active().and_then(|c| c.id.as_deref()), Some("b"));
        let mut parked: Vec<_> = store.parked().iter().filter_map(|c| c.id.clone()).collect();
        parked.sort();
        assert_eq!(parked, ["c", "d"]);
        assert!(store.parked().iter().all(|c| c.state.tokens() == [1, 2]));
        // A request naming no conversation continues the active one.
        let (a, origin) = store.take(None, new_state);
        assert_eq!((origin, a.id.as_deref()), (Origin::Active, Some("b")));
        store.publish(a);
        // An unnamed conversation is not parked: nothing could bring it back.
        let mut store = Store::new(1 << 20);
        let (anon, origin) = store.take(None, new_state);
        assert_eq!(origin, Origin::New);
        store.publish(anon);
        let (named, _) = store.take(Some("n"), new_state);
        store.publish(named);
        assert!(store.parked().is_empty());
        assert_eq!(store.active().and_then(|c| c.id.as_deref()), Some("n"));
    }

    #[test]
    fn requests_of_one_conversation_at_once_keep_the_last_completed() {
        let mut store = Store::new(1 << 20);
        let new_state = || SeqState::with_precision(&[KV], 64, KvPrecision::F32);
        let (mut first, origin) = store.take(Some("c"), new_state);
        read(&mut first.state, &[1, 2]);
        store.publish(first);
        // Two requests of "c" at once: the second finds it taken and starts afresh.
        let (mut a, a_origin) = store.take(Some("c"), new_state);
        let (mut b, b_origin) = store.take(Some("c"), new_state);
        assert_eq!(
            (origin, a_origin, b_origin),
            (Origin::New, Origin::Active, Origin::New)
        );
        read(&mut a.state, &[3]);
        read(&mut b.state, &[1, 2, 4]);
        // b completes first, then a: a's state is kept, once.
        store.publish(b);
        store.publish(a);
        assert_eq!(
            store.active().map(|c| c.state.tokens()),
            Some(&[1, 2, 3][..])
        );
        assert!(store.parked().is_empty());
        // A request that did not complete gives way to one of its name that did meanwhile.
        let (c, c_origin) = store.take(Some("c"), new_state);
        let (mut d, _) = store.take(Some("c"), new_state);
        read(&mut d.state, &[9]);
        store.publish(d);
        store.put_back(c, c_origin);
        assert_eq!(store.active().map(|c| c.state.tokens()), Some(&[9][..]));
        assert!(store.parked().is_empty());
        // Another conversation published while the active one's request ran: the latter is parked.
        let (e, e_origin) = store.take(None, new_state);
        let (mut f, _) = store.take(Some("f"), new_state);
        read(&mut f.state, &[5]);
        store.publish(f);
        store.put_back(e, e_origin);
        assert_eq!(store.active().and_then(|c| c.id.as_deref()), Some("f"));
        assert_eq!(store.parked().len(), 1);
        assert_eq!(store.parked()[0].state.tokens(), [9]);
    }
}
