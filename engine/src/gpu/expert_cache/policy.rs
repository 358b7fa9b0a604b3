//! Which experts the VRAM cache holds: pure bookkeeping, no device (its tests run without a GPU).
//!
//! The cache has `n_slots` slots, each holding one (layer, expert) — the three matrices of a routed expert.
//! Every expert has a score, the routings to it decayed by [`CachePolicy::decay`] per token (so it weighs
//! frequency and recency together), and the token it was last routed at. The policy:
//! - picks the initial set from counts (a profile or a warm-up read): the highest counts win;
//! - follows the answer: [`CachePolicy::plan`] admits at most a bounded number of missing experts per layer
//!   and token, each into a free slot or in place of the resident expert of the lowest score (older last
//!   use breaking ties), only when the newcomer scores higher by a margin ([`AdmissionRule`]: a fixed part
//!   and a part in units of the two scores' sampling noise) and the victim is not routed by the token
//!   being computed;
//! - a slot being filled is [`SlotState::Loading`]: its expert is not resident (not computed on the card)
//!   until [`CachePolicy::complete`] says its copy finished.

/// A routed expert: the cache's layer index (not the file's layer number) and the expert id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExpertKey {
    pub layer: usize,
    pub expert: usize,
}

/// What a slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    Free,
    /// A copy into it is in flight; its expert is not visible yet.
    Loading(ExpertKey),
    Holds(ExpertKey),
}

/// An upload the policy decided: `expert` into `slot`, which held `victim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Upload {
    pub expert: ExpertKey,
    pub slot: usize,
    pub victim: Option<ExpertKey>,
}

/// When a missing expert may replace a resident one (`--expert-decay`, `--expert-margin`,
/// `--expert-noise-margin`).
///
/// A score is a decayed count: an expert routed at a steady rate `p` per token scores `p / (1 − d)` on
/// average, with a variance of about that mean over `1 + d`. With thousands of residents the coldest one
/// scores near zero by chance alone, and an expert routed once a moment ago scores about 1: a fixed
/// margin below that admits on every miss, though on routing that does not change the newcomer is no
/// likelier than its victim — a copy over the bus and through host memory (which the CPU's share of
/// the same token competes for) that buys nothing. The noise part asks the difference to stand out of
/// the two scores' noise by `noise_margin` standard deviations, so admissions follow routing that
/// changes and stop where it does not.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdmissionRule {
    /// Decay of the scores per token (0 < d < 1; half-life `ln 2 / −ln d` tokens).
    pub decay: f32,
    /// A newcomer must score this much above its victim ...
    pub margin: f32,
    /// ... plus this many standard deviations of the difference of the two scores.
    pub noise_margin: f32,
}

impl Default for AdmissionRule {
    fn default() -> Self {
        AdmissionRule {
            decay: 0.98,
            margin: 0.5,
            noise_margin: 1.5,
        }
    }
}

impl AdmissionRule {
    /// Whether a newcomer scoring `newcomer` may replace a resident scoring `victim`. The bar rises
    /// with `victim`, so one that beats no bound below every resident's score beats no resident.
    pub fn admits(&self, newcomer: f32, victim: f32) -> bool {
        let noise = ((newcomer + victim).max(0.0) / (1.0 + self.decay)).sqrt();
        newcomer > victim + self.margin + self.noise_margin * noise
    }
}

/// Counts the cache reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyStats {
    pub slots: usize,
    pub occupied: usize,
    pub uploads: u64,
    pub evictions: u64,
}

/// The cache's bookkeeping.
pub struct CachePolicy {
    slots: Vec<SlotState>,
    /// `[layer][expert]`: the slot holding or loading it.
    slot_of: Vec<Vec<Option<usize>>>,
    /// `[layer][expert]`: routings, decayed per token of the layer.
    score: Vec<Vec<f32>>,
    /// `[layer][expert]`: the token it was last routed at (0: never).
    last_use: Vec<Vec<u64>>,
    /// `[layer][expert]`: routings counted since the counts were last taken (for the profile).
    counts: Vec<Vec<u64>>,
    /// Tokens seen, per layer.
    tick: Vec<u64>,
    rule: AdmissionRule,
    uploads: u64,
    evictions: u64,
    /// Slots in [`SlotState::Free`] and in [`SlotState::Holds`], kept by [`CachePolicy::set`] (asked per
    /// token, where counting thousands of slots would cost more than the question).
    n_free: usize,
    n_holding: usize,
    /// Experts of every layer.
    n_experts: usize,
    /// A lower bound of every resident expert's score: the lowest at the last full scan and each layer's
    /// tick then. Scores only fall by decay and newcomers enter above their victims, so the bound decayed
    /// by the ticks since holds; a missing expert at or below it plus the margin cannot be admitted, and
    /// [`CachePolicy::plan`] stops before scanning every slot (thousands, up to twice per layer and token).
    coldest: Option<(f32, Vec<u64>)>,
    /// `[layer]`: an expert of the layer became or stopped being resident since
    /// [`CachePolicy::take_residency_changes`] (for `--cache-bias`'s vectors on the card).
    residency_changed: Vec<bool>,
}

/// A policy's scores, last uses and tokens seen ([`CachePolicy::history`]).
pub struct PolicyHistory {
    score: Vec<Vec<f32>>,
    last_use: Vec<Vec<u64>>,
    tick: Vec<u64>,
}

impl CachePolicy {
    /// A cache of `n_slots` empty slots over layers of `experts_per_layer[l]` experts.
    pub fn new(experts_per_layer: &[usize], n_slots: usize) -> CachePolicy {
        CachePolicy {
            slots: vec![SlotState::Free; n_slots],
            slot_of: experts_per_layer.iter().map(|&n| vec![None; n]).collect(),
            score: experts_per_layer.iter().map(|&n| vec![0.0; n]).collect(),
            last_use: experts_per_layer.iter().map(|&n| vec![0; n]).collect(),
            counts: experts_per_layer.iter().map(|&n| vec![0; n]).collect(),
            tick: vec![0; experts_per_layer.len()],
            rule: AdmissionRule::default(),
            uploads: 0,
            evictions: 0,
            n_free: n_slots,
            n_holding: 0,
            n_experts: experts_per_layer.iter().sum(),
            coldest: None,
            // A new cache: every layer's residency is news.
            residency_changed: vec![true; experts_per_layer.len()],
        }
    }

    /// What the policy learned from the routings (scores, last uses, tokens seen), to carry into a policy
    /// of another size ([`CachePolicy::restore_history`]).
    pub fn history(&self) -> PolicyHistory {
        PolicyHistory {
            score: self.score.clone(),
            last_use: self.last_use.clone(),
            tick: self.tick.clone(),
        }
    }

    /// Takes `h` (from a policy over the same layers) as this policy's scores, last uses and tokens seen:
    /// a cache allocated again keeps ranking and admitting as before, not from scores reset to its fill's
    /// ranking.
    pub fn restore_history(&mut self, h: PolicyHistory) {
        let fits = h.score.len() == self.score.len()
            && h.score
                .iter()
                .zip(&self.score)
                .all(|(a, b)| a.len() == b.len());
        if fits {
            self.score = h.score;
            self.last_use = h.last_use;
            self.tick = h.tick;
            // The bound of resident scores was the old scores'.
            self.coldest = None;
        }
    }

    /// The layers whose residency changed since the last call (a new policy: all of them), in order.
    pub fn take_residency_changes(&mut self) -> Vec<usize> {
        let changed = self
            .residency_changed
            .iter()
            .enumerate()
            .filter_map(|(l, &c)| c.then_some(l))
            .collect();
        self.residency_changed.iter_mut().for_each(|c| *c = false);
        changed
    }

    /// Admissions decided by `rule` from here on (the scores kept, taken as decayed by the new rate).
    pub fn set_rule(&mut self, rule: AdmissionRule) {
        self.rule = rule;
        self.coldest = None;
    }

    /// Decay per token.
    pub fn decay(&self) -> f32 {
        self.rule.decay
    }

    /// Layers.
    pub fn n_layers(&self) -> usize {
        self.slot_of.len()
    }

    /// Experts of `layer`.
    pub fn n_expert(&self, layer: usize) -> usize {
        self.slot_of.get(layer).map_or(0, Vec::len)
    }

    /// Slots.
    pub fn n_slots(&self) -> usize {
        self.slots.len()
    }

    /// What slot `slot` holds.
    pub fn slot(&self, slot: usize) -> SlotState {
        self.slots.get(slot).copied().unwrap_or(SlotState::Free)
    }

    /// The slot of `key` when its matrices are on the card (not while loading).
    pub fn resident(&self, key: ExpertKey) -> Option<usize> {
        let s = (*self.slot_of.get(key.layer)?.get(key.expert)?)?;
        matches!(self.slots[s], SlotState::Holds(k) if k == key).then_some(s)
    }

    /// Whether every expert of every layer is resident.
    pub fn holds_all(&self) -> bool {
        self.n_holding == self.n_experts
    }

    /// Puts `slot` in `state`, keeping the counts of free and holding slots.
    fn set(&mut self, slot: usize, state: SlotState) {
        let holds = |s: SlotState| matches!(s, SlotState::Holds(_));
        let old = self.slots[slot];
        self.n_free = self.n_free + usize::from(state == SlotState::Free)
            - usize::from(old == SlotState::Free);
        self.n_holding = self.n_holding + usize::from(holds(state)) - usize::from(holds(old));
        for s in [old, state] {
            if let SlotState::Holds(k) = s {
                if let Some(c) = self.residency_changed.get_mut(k.layer) {
                    *c |= old != state;
                }
            }
        }
        self.slots[slot] = state;
    }

    /// The initial set: the experts of the highest `counts[layer][expert]`, as many as there are slots
    /// (ties: lower layer, then lower id). Scores start at the counts scaled to at most 1 per expert.
    pub fn initial_set(&mut self, counts: &[Vec<u64>]) -> Vec<ExpertKey> {
        let mut all: Vec<(u64, ExpertKey)> = Vec::new();
        for (layer, row) in self.slot_of.iter().enumerate() {
            let max = counts
                .get(layer)
                .and_then(|c| c.iter().max().copied())
                .unwrap_or(0);
            for expert in 0..row.len() {
                let c = counts
                    .get(layer)
                    .and_then(|c| c.get(expert))
                    .copied()
                    .unwrap_or(0);
                if max > 0 {
                    self.score[layer][expert] = c as f32 / max as f32;
                }
                all.push((c, ExpertKey { layer, expert }));
            }
        }
        all.sort_by(|a, b| {
            b.0.cmp(&a.0)
                .then(a.1.layer.cmp(&b.1.layer))
                .then(a.1.expert.cmp(&b.1.expert))
        });
        all.truncate(self.slots.len());
        all.into_iter().map(|(_, k)| k).collect()
    }

    /// Puts `key` in slot `slot` at once (the initial fill, whose copies completed before any call).
    pub fn place(&mut self, slot: usize, key: ExpertKey) {
        if let Some(SlotState::Holds(old) | SlotState::Loading(old)) = self.slots.get(slot).copied()
        {
            self.slot_of[old.layer][old.expert] = None;
        }
        // A placed expert may score below the bound.
        self.coldest = None;
        if slot < self.slots.len() {
            self.set(slot, SlotState::Holds(key));
            self.slot_of[key.layer][key.expert] = Some(slot);
        }
    }

    /// Counts one token's (or a batch's) routings of `layer`: `routed` lists every routing (an expert
    /// may repeat across tokens), `tokens` how many tokens they came from.
    pub fn record(&mut self, layer: usize, routed: &[usize], tokens: usize) {
        let Some(scores) = self.score.get_mut(layer) else {
            return;
        };
        let d = self.rule.decay.powi(tokens.min(i32::MAX as usize) as i32);
        scores.iter_mut().for_each(|s| *s *= d);
        self.tick[layer] += tokens as u64;
        let now = self.tick[layer];
        for &e in routed {
            if e < scores.len() {
                scores[e] += 1.0;
                self.last_use[layer][e] = now;
                self.counts[layer][e] += 1;
            }
        }
    }

    /// Decides up to `max` uploads among `missing` experts of `layer` (those its token routes to that are
    /// not resident, likeliest first); `in_use` are the layer's experts the token routes to, never
    /// evicted. The chosen slots become [`SlotState::Loading`], their victims leave at once.
    pub fn plan(
        &mut self,
        layer: usize,
        missing: &[usize],
        in_use: &[usize],
        max: usize,
    ) -> Vec<Upload> {
        let mut out = Vec::new();
        for &e in missing {
            if out.len() >= max {
                break;
            }
            if self
                .slot_of
                .get(layer)
                .and_then(|r| r.get(e))
                .is_none_or(|s| s.is_some())
            {
                // Unknown, resident or already loading.
                continue;
            }
            let score = self.score[layer][e];
            if self.n_free == 0
                && self
                    .coldest_bound()
                    .is_some_and(|b| !self.rule.admits(score, b))
            {
                // No resident expert scores low enough for this one to replace it.
                break;
            }
            let free = if self.n_free > 0 {
                self.slots.iter().position(|s| *s == SlotState::Free)
            } else {
                None
            };
            let slot = match free {
                Some(free) => Some((free, None)),
                None => self.victim(layer, in_use).and_then(|(slot, victim)| {
                    let vs = self.score[victim.layer][victim.expert];
                    self.rule.admits(score, vs).then_some((slot, Some(victim)))
                }),
            };
            let Some((slot, victim)) = slot else {
                // The weakest resident expert beats this one; the rest score no higher.
                break;
            };
            if let Some(v) = victim {
                self.slot_of[v.layer][v.expert] = None;
                self.evictions += 1;
            }
            let key = ExpertKey { layer, expert: e };
            self.set(slot, SlotState::Loading(key));
            self.slot_of[layer][e] = Some(slot);
            self.uploads += 1;
            out.push(Upload {
                expert: key,
                slot,
                victim,
            });
        }
        out
    }

    /// [`CachePolicy::coldest`] decayed to now.
    fn coldest_bound(&self) -> Option<f32> {
        let (lowest, ticks) = self.coldest.as_ref()?;
        let since = self
            .tick
            .iter()
            .zip(ticks)
            .map(|(now, then)| now.saturating_sub(*then))
            .max()
            .unwrap_or(0);
        Some(lowest * self.rule.decay.powi(since.min(i32::MAX as u64) as i32))
    }

    /// The resident expert of the lowest score (then the oldest last use), not among `in_use` of `layer`;
    /// the scan also renews [`CachePolicy::coldest`].
    fn victim(&mut self, layer: usize, in_use: &[usize]) -> Option<(usize, ExpertKey)> {
        let mut best: Option<(f32, u64, usize, ExpertKey)> = None;
        let mut lowest = f32::INFINITY;
        for (slot, s) in self.slots.iter().enumerate() {
            let SlotState::Holds(k) = *s else { continue };
            let (score, last) = (
                self.score[k.layer][k.expert],
                self.last_use[k.layer][k.expert],
            );
            lowest = lowest.min(score);
            if k.layer == layer && in_use.contains(&k.expert) {
                continue;
            }
            let better = match best {
                None => true,
                Some((bs, bl, _, _)) => score < bs || (score == bs && last < bl),
            };
            if better {
                best = Some((score, last, slot, k));
            }
        }
        // Slots still loading hold experts that entered above their victims: above this bound too.
        self.coldest = lowest.is_finite().then(|| (lowest, self.tick.clone()));
        best.map(|(_, _, slot, k)| (slot, k))
    }

    /// Orders `experts` of `layer` by score, highest first (the order [`CachePolicy::plan`] wants).
    pub fn sort_by_score(&self, layer: usize, experts: &mut [usize]) {
        let score = |e: usize| {
            self.score
                .get(layer)
                .and_then(|r| r.get(e))
                .copied()
                .unwrap_or(0.0)
        };
        experts.sort_by(|&a, &b| score(b).total_cmp(&score(a)));
    }

    /// The copy into `slot` completed: its expert is resident.
    pub fn complete(&mut self, slot: usize) {
        if let Some(SlotState::Loading(k)) = self.slots.get(slot).copied() {
            self.set(slot, SlotState::Holds(k));
        }
    }

    /// A planned upload failed: the slot is free again.
    pub fn abandon(&mut self, slot: usize) {
        if let Some(SlotState::Loading(k) | SlotState::Holds(k)) = self.slots.get(slot).copied() {
            self.slot_of[k.layer][k.expert] = None;
            self.set(slot, SlotState::Free);
        }
    }

    /// The scores as counts (`[layer][expert]`, scaled to integers), to rank experts for a new fill.
    pub fn score_counts(&self) -> Vec<Vec<u64>> {
        self.score
            .iter()
            .map(|r| r.iter().map(|&s| (s.max(0.0) * 1e6) as u64).collect())
            .collect()
    }

    /// The routings counted since the last call, `[layer][expert]`, and resets them.
    pub fn take_counts(&mut self) -> Vec<Vec<u64>> {
        self.counts
            .iter_mut()
            .map(|c| {
                let taken = c.clone();
                c.iter_mut().for_each(|v| *v = 0);
                taken
            })
            .collect()
    }

    /// Adds `counts` (`[layer][expert]`) to the routings counted.
    pub fn add_counts(&mut self, counts: &[Vec<u64>]) {
        for (mine, add) in self.counts.iter_mut().zip(counts) {
            mine.iter_mut().zip(add).for_each(|(a, b)| *a += b);
        }
    }

    /// Slots, occupied slots, uploads and evictions so far.
    pub fn stats(&self) -> PolicyStats {
        PolicyStats {
            slots: self.slots.len(),
            occupied: self
                .slots
                .iter()
                .filter(|s| !matches!(s, SlotState::Free))
                .count(),
            uploads: self.uploads,
            evictions: self.evictions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(layer: usize, expert: usize) -> ExpertKey {
        ExpertKey { layer, expert }
    }

    #[test]
    fn a_policy_of_another_size_takes_the_scores_learned_so_far() {
        let mut p = CachePolicy::new(&[4, 4], 3);
        p.record(0, &[1, 1, 2], 2);
        p.record(1, &[3], 1);
        let before = p.score_counts();
        let history = p.history();
        // A cache allocated again: its fill ranks from scratch (each layer's best at 1).
        let mut q = CachePolicy::new(&[4, 4], 5);
        q.initial_set(&before);
        assert_ne!(q.score_counts(), before);
        q.restore_history(history);
        assert_eq!(q.score_counts(), before);
        assert_eq!(q.tick, vec![2, 1]);
        // A history of other layers is not taken.
        let mut r = CachePolicy::new(&[4], 2);
        r.restore_history(q.history());
        assert_eq!(r.score_counts(), vec![vec![0; 4]]);
    }

    #[test]
    fn initial_set_takes_the_highest_counts_across_layers() {
        let mut p = CachePolicy::new(&[4, 4], 3);
        let counts = vec![vec![5, 0, 9, 1], vec![7, 2, 0, 0]];
        let set = p.initial_set(&counts);
        assert_eq!(set, vec![key(0, 2), key(1, 0), key(0, 0)]);
        for (slot, k) in set.iter().enumerate() {
            p.place(slot, *k);
        }
        assert_eq!(p.resident(key(0, 2)), Some(0));
        assert_eq!(p.resident(key(0, 1)), None);
        assert!(!p.holds_all());
        assert_eq!(p.stats().occupied, 3);
    }

    #[test]
    fn holds_all_when_every_expert_fits() {
        let mut p = CachePolicy::new(&[2, 3], 8);
        let set = p.initial_set(&[]);
        assert_eq!(set.len(), 5);
        for (slot, k) in set.iter().enumerate() {
            p.place(slot, *k);
        }
        assert!(p.holds_all());
    }

    #[test]
    fn free_slots_are_filled_first_and_visible_only_after_completion() {
        let mut p = CachePolicy::new(&[4], 2);
        p.record(0, &[3], 1);
        let ups = p.plan(0, &[3], &[3], 2);
        assert_eq!(
            ups,
            vec![Upload {
                expert: key(0, 3),
                slot: 0,
                victim: None
            }]
        );
        assert_eq!(p.resident(key(0, 3)), None, "loading is not resident");
        // Planning it again while loading does nothing.
        assert!(p.plan(0, &[3], &[3], 2).is_empty());
        p.complete(0);
        assert_eq!(p.resident(key(0, 3)), Some(0));
        assert_eq!(p.stats().uploads, 1);
        assert_eq!(p.stats().evictions, 0);
    }

    /// What `--cache-bias` rewrites on the card: the layers an expert entered or left, each once.
    #[test]
    fn residency_changes_name_the_layers_whose_experts_came_or_went() {
        let mut p = CachePolicy::new(&[4, 4, 4], 2);
        assert_eq!(p.take_residency_changes(), vec![0, 1, 2], "a new cache");
        assert!(p.take_residency_changes().is_empty());
        p.place(0, key(1, 0));
        p.place(1, key(2, 3));
        assert_eq!(p.take_residency_changes(), vec![1, 2]);
        // A layer-0 expert routed often replaces the cold one of layer 2 (or 1): loading is no change
        // for layer 0 yet, the victim's leaving is one for its layer.
        for _ in 0..10 {
            p.record(0, &[2], 1);
            p.record(1, &[0], 1);
        }
        let ups = p.plan(0, &[2], &[2], 1);
        assert_eq!(ups.len(), 1);
        let victim = ups[0].victim.map(|v| v.layer);
        assert_eq!(victim, Some(2));
        assert_eq!(p.take_residency_changes(), vec![2]);
        p.complete(ups[0].slot);
        assert_eq!(
            p.take_residency_changes(),
            vec![0],
            "resident once its copy completed"
        );
        // Completing again (nothing loading) and abandoning a free slot change nothing.
        p.complete(ups[0].slot);
        assert!(p.take_residency_changes().is_empty());
        p.abandon(ups[0].slot);
        assert_eq!(
            p.take_residency_changes(),
            vec![0],
            "a resident expert abandoned leaves"
        );
    }

    #[test]
    fn the_victim_is_the_coldest_and_never_in_use() {
        let mut p = CachePolicy::new(&[6], 2);
        p.place(0, key(0, 0));
        p.place(1, key(0, 1));
        // Expert 0 hot, expert 1 cold; then expert 5 routed often.
        for _ in 0..10 {
            p.record(0, &[0], 1);
        }
        for _ in 0..3 {
            p.record(0, &[5], 1);
        }
        let ups = p.plan(0, &[5], &[5], 1);
        assert_eq!(ups.len(), 1);
        assert_eq!(ups[0].victim, Some(key(0, 1)));
        assert_eq!(ups[0].slot, 1);
        assert_eq!(p.resident(key(0, 1)), None, "the victim leaves at once");
        assert_eq!(p.stats().evictions, 1);
        // Protecting the cold expert moves the choice to the other one only if the newcomer beats it.
        let mut q = CachePolicy::new(&[6], 2);
        q.place(0, key(0, 0));
        q.place(1, key(0, 1));
        for _ in 0..3 {
            q.record(0, &[0, 4], 1);
        }
        let ups = q.plan(0, &[4], &[1, 4], 1);
        assert!(
            ups.is_empty(),
            "expert 0 scores as high as 4 and 1 is in use: {ups:?}"
        );
    }

    /// Over a long run of skewed routings with admissions, the uploads planned with the bound equal those
    /// a plan that scans every slot for every candidate would choose (the bound only skips scans).
    #[test]
    fn the_coldest_bound_changes_no_decision() {
        let (layers, experts, slots) = (4, 32, 40);
        for (rule, least) in [(EAGER, 50), (AdmissionRule::default(), 20)] {
            let run = |bounded: bool| {
                let mut p = CachePolicy::new(&vec![experts; layers], slots);
                p.set_rule(rule);
                for (slot, k) in p
                    .initial_set(&vec![vec![1; experts]; layers])
                    .into_iter()
                    .enumerate()
                {
                    p.place(slot, k);
                }
                let mut state = 12345u64;
                let mut next = move |n: usize| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    // Skewed: the square of a uniform draw favours low ids.
                    let u = ((state >> 33) as f64) / (1u64 << 31) as f64;
                    ((u * u) * n as f64) as usize
                };
                let mut planned = Vec::new();
                for _token in 0..300 {
                    for layer in 0..layers {
                        let mut routed: Vec<usize> = (0..4).map(|_| next(experts)).collect();
                        routed.sort_unstable();
                        routed.dedup();
                        p.record(layer, &routed, 1);
                        if !bounded {
                            p.coldest = None;
                        }
                        let missing: Vec<usize> = routed
                            .iter()
                            .copied()
                            .filter(|&e| p.resident(key(layer, e)).is_none())
                            .collect();
                        for u in p.plan(layer, &missing, &routed, 2) {
                            p.complete(u.slot);
                            planned.push(u);
                        }
                    }
                }
                planned
            };
            let (with, without) = (run(true), run(false));
            assert!(
                with.len() > least,
                "{rule:?}: {} uploads: the run admitted too little",
                with.len()
            );
            assert_eq!(with, without);
        }
    }

    #[test]
    fn a_newcomer_needs_a_margin_and_uploads_are_bounded() {
        let mut p = CachePolicy::new(&[8], 2);
        p.place(0, key(0, 0));
        p.place(1, key(0, 1));
        p.record(0, &[0, 1], 1);
        // One routing of 2 ties the residents' fresh scores: no churn.
        p.record(0, &[2], 1);
        assert!(p.plan(0, &[2], &[2], 4).is_empty());
        // Many routings of 3, 4, 5: at most 1 upload per call.
        for _ in 0..5 {
            p.record(0, &[3, 4, 5], 1);
        }
        let ups = p.plan(0, &[3, 4, 5], &[3, 4, 5], 1);
        assert_eq!(ups.len(), 1);
        assert_eq!(ups[0].expert, key(0, 3));
    }

    #[test]
    fn of_two_experts_routed_as_often_the_older_use_goes() {
        let mut p = CachePolicy::new(&[4], 2);
        p.set_rule(EAGER);
        p.place(0, key(0, 0));
        p.place(1, key(0, 1));
        p.record(0, &[0], 1);
        for _ in 0..20 {
            p.record(0, &[], 1);
        }
        p.record(0, &[1], 1);
        for _ in 0..3 {
            p.record(0, &[3], 1);
        }
        let ups = p.plan(0, &[3], &[3], 1);
        assert_eq!(
            ups[0].victim,
            Some(key(0, 0)),
            "0 was used 21 tokens before 1"
        );
    }

    #[test]
    fn counts_are_taken_and_reset() {
        let mut p = CachePolicy::new(&[3, 2], 1);
        p.record(0, &[0, 2, 2], 2);
        p.record(1, &[1], 1);
        assert_eq!(p.take_counts(), vec![vec![1, 0, 2], vec![0, 1]]);
        assert_eq!(p.take_counts(), vec![vec![0, 0, 0], vec![0, 0]]);
    }

    #[test]
    fn scores_rank_a_new_fill_and_counts_carry_over() {
        let mut p = CachePolicy::new(&[3], 3);
        for _ in 0..4 {
            p.record(0, &[2], 1);
        }
        p.record(0, &[0], 1);
        let counts = p.take_counts();
        let mut q = CachePolicy::new(&[3], 1);
        assert_eq!(q.initial_set(&p.score_counts()), vec![key(0, 2)]);
        q.add_counts(&counts);
        assert_eq!(q.take_counts(), vec![vec![1, 0, 4]]);
    }

    #[test]
    fn abandon_frees_the_slot() {
        let mut p = CachePolicy::new(&[3], 1);
        p.record(0, &[2], 1);
        let ups = p.plan(0, &[2], &[2], 1);
        p.abandon(ups[0].slot);
        assert_eq!(p.slot(0), SlotState::Free);
        assert_eq!(p.resident(key(0, 2)), None);
        assert_eq!(p.plan(0, &[2], &[2], 1).len(), 1);
    }

    /// Routing drawn per layer from a fixed distribution that a "topic change" swaps for a new one.
    struct Routing {
        state: u64,
        /// `[layer][expert]`: cumulative probabilities.
        cdf: Vec<Vec<f64>>,
        skew: f64,
    }

    impl Routing {
        fn new(layers: usize, experts: usize, skew: f64, seed: u64) -> Routing {
            let mut r = Routing {
                state: seed,
                cdf: vec![vec![0.0; experts]; layers],
                skew,
            };
            for l in 0..layers {
                r.topic(l, 1.0);
            }
            r
        }

        fn uniform(&mut self) -> f64 {
            self.state = self
                .state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.state >> 11) as f64) / (1u64 << 53) as f64
        }

        /// Moves `share` of layer `l`'s routing to a new random ranking of its experts (1: all).
        fn topic(&mut self, l: usize, share: f64) {
            let n = self.cdf[l].len();
            let mut rank: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                let j = (self.uniform() * (i + 1) as f64) as usize;
                rank.swap(i, j.min(i));
            }
            let w: Vec<f64> = (0..n)
                .map(|i| (-6.0 * self.skew * i as f64 / n as f64).exp())
                .collect();
            let total: f64 = w.iter().sum();
            let old = self.probabilities(l);
            let mut acc = 0.0;
            for e in 0..n {
                acc += (1.0 - share) * old[e] + share * w[rank[e]] / total;
                self.cdf[l][e] = acc;
            }
        }

        fn probabilities(&self, l: usize) -> Vec<f64> {
            let c = &self.cdf[l];
            (0..c.len())
                .map(|e| c[e] - if e > 0 { c[e - 1] } else { 0.0 })
                .collect()
        }

        /// `k` distinct experts of layer `l`.
        fn route(&mut self, l: usize, k: usize) -> Vec<usize> {
            let mut out = Vec::with_capacity(k);
            while out.len() < k {
                let u = self.uniform() * self.cdf[l].last().copied().unwrap_or(1.0);
                let e = self.cdf[l]
                    .partition_point(|&c| c < u)
                    .min(self.cdf[l].len() - 1);
                if !out.contains(&e) {
                    out.push(e);
                }
            }
            out
        }
    }

    /// What a rule does over a run: the share of routings found resident, the misses and the uploads
    /// per token, over the tokens after `warm`.
    #[derive(Debug)]
    struct Followed {
        hit: f64,
        misses: f64,
        uploads: f64,
    }

    /// `tokens` tokens of `layers` × `experts` (8 used), 30% of the experts in slots, placed from the
    /// routing's true probabilities (a profile); a topic change every `change_every` tokens moves
    /// half of each layer's routing; `rule` None freezes the cache, else 2 uploads per layer and token.
    fn follow(
        (layers, experts, skew): (usize, usize, f64),
        rule: Option<AdmissionRule>,
        (tokens, warm, change_every): (usize, usize, usize),
    ) -> Followed {
        let mut routing = Routing::new(layers, experts, skew, 7);
        let mut p = CachePolicy::new(&vec![experts; layers], layers * experts * 3 / 10);
        p.set_rule(rule.unwrap_or_default());
        let counts: Vec<Vec<u64>> = (0..layers)
            .map(|l| {
                let pr = routing.probabilities(l);
                pr.iter().map(|&x| (x * 1e6) as u64).collect()
            })
            .collect();
        for (slot, k) in p.initial_set(&counts).into_iter().enumerate() {
            p.place(slot, k);
        }
        let (mut hits, mut misses, mut uploads) = (0u64, 0u64, 0u64);
        for t in 0..tokens {
            if change_every > 0 && t > 0 && t % change_every == 0 {
                (0..layers).for_each(|l| routing.topic(l, 0.5));
            }
            for l in 0..layers {
                let routed = routing.route(l, 8);
                p.record(l, &routed, 1);
                let mut missing: Vec<usize> = routed
                    .iter()
                    .copied()
                    .filter(|&e| p.resident(key(l, e)).is_none())
                    .collect();
                let ups = match rule {
                    Some(_) => {
                        p.sort_by_score(l, &mut missing);
                        p.plan(l, &missing, &routed, 2)
                    }
                    None => Vec::new(),
                };
                ups.iter().for_each(|u| p.complete(u.slot));
                if t >= warm {
                    hits += (routed.len() - missing.len()) as u64;
                    misses += missing.len() as u64;
                    uploads += ups.len() as u64;
                }
            }
        }
        let n = (tokens - warm) as f64;
        Followed {
            hit: hits as f64 / (hits + misses) as f64,
            misses: misses as f64 / n,
            uploads: uploads as f64 / n,
        }
    }

    const EAGER: AdmissionRule = AdmissionRule {
        decay: 0.98,
        margin: 0.5,
        noise_margin: 0.0,
    };

    #[test]
    fn routing_that_does_not_change_is_not_churned() {
        for skew in [0.0, 1.0] {
            let shape = (4, 64, skew);
            let run = (2500, 500, 0);
            let frozen = follow(shape, None, run);
            let eager = follow(shape, Some(EAGER), run);
            let default = follow(shape, Some(AdmissionRule::default()), run);
            assert!(
                default.uploads * 4.0 < eager.uploads,
                "skew {skew}: {default:?} against the fixed margin's {eager:?}"
            );
            assert!(
                default.hit > frozen.hit - 0.01,
                "skew {skew}: {default:?} against the frozen cache's {frozen:?}"
            );
        }
    }

    #[test]
    fn routing_that_changes_is_followed() {
        // Every 300 tokens half of every layer's routing moves to experts ranked anew.
        let shape = (4, 64, 1.0);
        let run = (3000, 300, 300);
        let frozen = follow(shape, None, run);
        let eager = follow(shape, Some(EAGER), run);
        let default = follow(shape, Some(AdmissionRule::default()), run);
        assert!(
            default.hit > frozen.hit + 0.1 && default.hit > eager.hit - 0.03,
            "{default:?} against frozen {frozen:?} and the fixed margin's {eager:?}"
        );
        assert!(
            default.uploads < eager.uploads / 2.0,
            "{default:?} against the fixed margin's {eager:?}"
        );
    }

    /// The table of BENCHMARKS.md's admission rules: `cargo test --release -p poly-engine --lib
    /// admission_rule_table -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn admission_rule_table() {
        let rules: [(&str, Option<AdmissionRule>); 5] = [
            ("frozen", None),
            ("fixed margin 0.5 (before)", Some(EAGER)),
            (
                "+1.0 sd",
                Some(AdmissionRule {
                    noise_margin: 1.0,
                    ..EAGER
                }),
            ),
            ("+1.5 sd (default)", Some(AdmissionRule::default())),
            (
                "+2.5 sd",
                Some(AdmissionRule {
                    noise_margin: 2.5,
                    ..EAGER
                }),
            ),
        ];
        for (layers, experts) in [(8, 128), (8, 256)] {
            for (skew, change) in [(0.0, 0), (1.0, 0), (1.0, 300), (1.0, 100)] {
                for (name, rule) in rules {
                    let f = follow((layers, experts, skew), rule, (4000, 1000, change));
                    println!(
                        "| {layers}x{experts} | {skew} | {change} | {name} | {:.3} | {:.1} | {:.2} |",
                        f.hit, f.misses, f.uploads
                    );
                }
            }
        }
    }
}
