//! The state of the sequence on the card: per layer an f16 KV cache (rows of `n_head_kv·head_dim` f16 per
//! position, filled up to the positions read) or the recurrent state (conv rows and delta-rule matrices,
//! f32). The KV buffers hold the rows the conversation needs, rounded up to [`KV_GROWTH_ROWS`], not the
//! whole context: [`DeviceSeq::follow`] grows them in place (the rows copied on the card, the same
//! buffers' identity for pending copies, the decode graphs captured again) when a call needs more; the
//! backend decides how many rows a call gets and what the expert cache gives up for them.
//!
//! The engine's host [`SeqState`] stays the state the rest of the engine works with (conversations parked
//! and resumed, checkpoints, truncation). The card holds the state of one sequence: the tokens it has read
//! tell which. Before a call, [`DeviceSeq::follow`] keeps the card's state when it is the host's (the same
//! tokens; or, without recurrent layers, a prefix of them: the KV caches are simply read less far), and
//! otherwise uploads the host's.
//!
//! After a call nothing is copied back: the host state gets a [`PendingCopy`] ([`crate::state::Deferred`])
//! that copies the new KV rows and the recurrent states to the host when the host reads them
//! ([`SeqState::sync`]: checkpoints, the CPU, a conversation switched back onto the card). The card's
//! state changes by writes of KV rows `a..b` (a call, an upload of another sequence) and of the recurrent
//! states (every call): before one, [`DeviceSeq::protect`] saves into host memory the part of every
//! pending copy that someone may still read and the write would overwrite — copy on write, only those
//! rows (in chunks that grow with what was saved, so a conversation written token by token over an
//! older one costs a few copies, not one per token), as f16 bits (the card's format, converted to the
//! host's f32 only when the host reads them). The calling state's own copy is left on the card when
//! nothing else holds it (the call supersedes it). Buffers are only dropped after every copy of them is
//! saved whole ([`DeviceSeq::settle_all`]). So writing a token moves no state over the bus, and a new
//! conversation after a long one copies only the rows it overwrites of the kept one (which a cancelled
//! request would need back), not the whole context. A conversation switched back onto the card whose
//! copy still has rows there gets only the overwritten rows uploaded again (its host layers stay behind).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use poly_kernels::cuda::{CudaError, CudaResult, Device, DeviceBuffer};

use super::decode_graph::DecodeGraphs;
use crate::state::{Deferred, DeferredState, LayerState, RecurrentState, SeqState};

/// Where the card's sequence lives (the backend's slot); pending copies reach it through a weak link.
pub type SeqSlot = Arc<Mutex<Option<DeviceSeq>>>;

/// Fewest KV rows a pending copy saves at once when a write reaches its rows (then as many as it saved
/// so far): a conversation written token by token over a kept one costs a few copies, not one a token.
const SAVE_CHUNK_ROWS: usize = 256;

/// KV rows the card's buffers grow by: a conversation's caches take what it has read and the call in
/// hand need, rounded up to this (a growth copies the rows on the card, about a millisecond for a
/// 30B model's 2,048 rows, and captures the decode graphs again), never more than the context.
pub const KV_GROWTH_ROWS: usize = 2048;

/// KV rows the buffers of a sequence get for a call that needs `needed` rows of a context of `n_ctx`.
pub fn kv_rows_for(needed: usize, n_ctx: usize) -> usize {
    needed
        .max(1)
        .div_ceil(KV_GROWTH_ROWS)
        .saturating_mul(KV_GROWTH_ROWS)
        .min(n_ctx.max(1))
}

/// Numbers [`DeviceSeq`]s: a pending copy names the buffers its card part lives in.
static NEXT_SEQ_ID: AtomicU64 = AtomicU64::new(1);

/// One layer's state on the card.
pub enum DeviceLayer {
    Kv {
        /// `[rows, k_width]` f16 bits.
        k: DeviceBuffer<u16>,
        /// `[rows, v_width]` f16 bits.
        v: DeviceBuffer<u16>,
        k_width: usize,
        v_width: usize,
    },
    Recurrent {
        conv: DeviceBuffer<f32>,
        delta: DeviceBuffer<f32>,
    },
}

/// The sequence on the card.
pub struct DeviceSeq {
    /// KV rows the buffers hold (at most the context).
    rows: usize,
    tokens: Vec<u32>,
    pub layers: Vec<DeviceLayer>,
    /// The decode graphs captured over these buffers (dropped with them).
    pub graphs: DecodeGraphs,
    /// Which buffers these are (unique in the process).
    id: u64,
    /// The pending copies handed out for these buffers that still have a part on the card.
    issued: Vec<Weak<PendingCopy>>,
}

fn to_f16(x: &[f32]) -> Vec<u16> {
    use half::slice::HalfFloatSliceExt;
    let mut out = vec![half::f16::ZERO; x.len()];
    out.convert_from_f32_slice(x);
    out.into_iter().map(half::f16::to_bits).collect()
}

impl DeviceSeq {
    /// Buffers for `state`'s layers of `rows` KV rows, empty.
    fn alloc(dev: &Device, state: &SeqState, rows: usize) -> CudaResult<DeviceSeq> {
        let rows = rows.max(1);
        let mut layers = Vec::with_capacity(state.n_layers());
        for il in 0..state.n_layers() {
            layers.push(match state.layer(il) {
                LayerState::Kv(c) => DeviceLayer::Kv {
                    k: dev.zeros(rows * c.k_width().max(1))?,
                    v: dev.zeros(rows * c.v_width().max(1))?,
                    k_width: c.k_width(),
                    v_width: c.v_width(),
                },
                LayerState::Recurrent(r) => DeviceLayer::Recurrent {
                    conv: dev.zeros(r.conv.len().max(1))?,
                    delta: dev.zeros(r.delta.len().max(1))?,
                },
            });
        }
        Ok(DeviceSeq {
            rows,
            tokens: Vec::new(),
            layers,
            graphs: DecodeGraphs::default(),
            id: NEXT_SEQ_ID.fetch_add(1, Ordering::Relaxed),
            issued: Vec::new(),
        })
    }

    /// KV rows the buffers hold.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes of the KV buffers.
    pub fn kv_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                DeviceLayer::Kv { k, v, .. } => k.num_bytes() + v.num_bytes(),
                DeviceLayer::Recurrent { .. } => 0,
            })
            .sum()
    }

    /// Whether a call of `state` keeps the card's sequence (the same tokens, or a prefix of them
    /// without recurrent layers) rather than uploading another.
    fn continues(&self, state: &SeqState) -> bool {
        let host = state.tokens();
        self.tokens == host
            || (!state.has_recurrent()
                && self.tokens.len() >= host.len()
                && self.tokens.starts_with(host))
    }

    /// Whether the buffers have the shapes of `state`'s layers (any number of KV rows).
    pub fn same_shapes(&self, state: &SeqState) -> bool {
        self.layers.len() == state.n_layers()
            && self
                .layers
                .iter()
                .enumerate()
                .all(|(il, l)| match (l, state.layer(il)) {
                    (
                        DeviceLayer::Kv {
                            k_width, v_width, ..
                        },
                        LayerState::Kv(c),
                    ) => *k_width == c.k_width() && *v_width == c.v_width(),
                    (DeviceLayer::Recurrent { conv, delta }, LayerState::Recurrent(r)) => {
                        conv.len() == r.conv.len().max(1) && delta.len() == r.delta.len().max(1)
                    }
                    _ => false,
                })
    }

    /// Grows the KV buffers to `rows` in place: the rows are copied on the card and the buffers keep
    /// their identity (pending copies read the same rows from the new ones); the decode graphs, captured
    /// over the old buffers, go.
    fn grow(&mut self, dev: &Device, rows: usize) -> CudaResult<()> {
        for layer in &mut self.layers {
            if let DeviceLayer::Kv {
                k,
                v,
                k_width,
                v_width,
            } = layer
            {
                let mut k_new = dev.zeros(rows * (*k_width).max(1))?;
                let mut v_new = dev.zeros(rows * (*v_width).max(1))?;
                dev.copy_prefix(k, &mut k_new, k.len())?;
                dev.copy_prefix(v, &mut v_new, v.len())?;
                *k = k_new;
                *v = v_new;
            }
        }
        self.rows = rows;
        self.graphs = DecodeGraphs::default();
        Ok(())
    }

    /// Makes the card hold `state` (see the module documentation) in buffers of at least `rows` KV rows
    /// (`rows` for new buffers) and returns it.
    pub fn follow<'a>(
        dev: &Device,
        slot: &'a mut Option<DeviceSeq>,
        state: &mut SeqState,
        rows: usize,
    ) -> CudaResult<&'a mut DeviceSeq> {
        let rows = rows.max(state.n_past()).max(1);
        if !slot.as_ref().is_some_and(|s| s.same_shapes(state)) {
            if let Some(old) = slot.as_mut() {
                old.settle_all(dev, false)?;
            }
            *slot = None;
            *slot = Some(DeviceSeq::alloc(dev, state, rows)?);
        }
        let Some(seq) = slot.as_mut() else {
            unreachable!("the slot was filled above")
        };
        if seq.rows < rows {
            seq.grow(dev, rows)?;
        }
        if seq.continues(state) {
            seq.tokens.truncate(state.tokens().len());
            return Ok(seq);
        }
        // Another sequence whose pending copy is whole in host memory or still has its unsaved rows
        // here (a conversation switched back): only what the card lacks goes up, from the host's rows
        // and the copy's saved part (f16, as the card keeps it); the host stays behind.
        let back = state
            .deferred()
            .and_then(|d| d.0.as_any().downcast_ref::<PendingCopy>());
        if let Some(p) = back.filter(|p| host_kv_rows(state) == p.host_rows && p.n_past <= seq.rows)
        {
            let (saved, lost, recurrent_saved) = {
                let s = p.saved();
                (s.lo..s.hi, s.lost, s.recurrent.is_some())
            };
            let here = p.seq_id == seq.id
                && seq
                    .issued
                    .iter()
                    .any(|w| std::ptr::eq(w.as_ptr(), p as *const PendingCopy));
            if !lost && (here || p.complete(true)) {
                // The recurrent states on the card are the copy's unless it saved them. The upload
                // writes the host's rows and the saved ones.
                let write_recurrent = p.recurrent && recurrent_saved;
                // The copy itself is not saved from what is its own.
                let me: *const PendingCopy = p;
                let listed = seq.issued.iter().position(|w| std::ptr::eq(w.as_ptr(), me));
                let mine = listed.map(|i| seq.issued.swap_remove(i));
                let protected = seq
                    .protect(dev, 0..p.host_rows, write_recurrent, None)
                    .and_then(|()| seq.protect(dev, saved, false, None));
                seq.issued.extend(mine);
                protected?;
                seq.upload_behind(dev, state, p, write_recurrent)?;
                return Ok(seq);
            }
        }
        // Else its host copy must be complete (its own pending copy's card part, if it is of these
        // buffers, is read from them now: the host cannot reach for the locked slot), and whatever
        // others may read of the rows and states the upload overwrites saved first.
        if let Some(own) = state.deferred() {
            for weak in &seq.issued {
                if let Some(p) = weak.upgrade().filter(|p| is_same(own, p)) {
                    p.save_from(dev, seq, 0..usize::MAX, true)?;
                }
            }
        }
        seq.protect(dev, 0..state.n_past(), true, None)?;
        state.sync().map_err(CudaError::Invalid)?;
        seq.upload(dev, state)?;
        Ok(seq)
    }

    /// Before a write of KV rows `rows` (and of the recurrent states, with `recurrent`): saves into host
    /// memory the part of every pending copy of these buffers that the write would overwrite and someone
    /// may still read. `own` is the calling state's pending copy: left on the card when nothing but that
    /// state holds it (the coming call supersedes it); it stays listed, for [`DeviceSeq::settle_all`]
    /// when the call fails.
    pub fn protect(
        &mut self,
        dev: &Device,
        rows: Range<usize>,
        recurrent: bool,
        own: Option<&Deferred>,
    ) -> CudaResult<()> {
        // A copy that could not be saved stays listed (with those not reached), so that it is never
        // read from rows overwritten since.
        let mut result = Ok(());
        for weak in std::mem::take(&mut self.issued) {
            let Some(p) = weak.upgrade() else { continue };
            // Held by the state and by `p` here: nobody else reads it.
            let kept_own = own.is_some_and(|d| is_same(d, &p)) && Arc::strong_count(&p) <= 2;
            if kept_own || result.is_err() {
                self.issued.push(weak);
                continue;
            }
            let (lo, hi) = {
                let s = p.saved();
                (s.lo, s.hi)
            };
            // The copy's rows the write reaches; a hit unless they are saved already.
            let (a, b) = (rows.start.max(p.host_rows), rows.end.min(p.n_past));
            let kv_hit = a < b && !(lo <= a && b <= hi);
            if kv_hit || recurrent {
                let want = if kv_hit {
                    a..b.max(a + SAVE_CHUNK_ROWS.max(hi - lo))
                } else {
                    0..0
                };
                result = p.save_from(dev, self, want, recurrent);
            }
            if result.is_err() || !p.complete(true) {
                self.issued.push(weak);
            }
        }
        result
    }

    /// Saves every pending copy of these buffers whole, before they are dropped. After a failed call
    /// (`failed`), a copy whose recurrent states were not saved before the call (the caller's own) is
    /// lost instead: the call may have advanced them half way (KV rows it wrote lie past every copy's).
    pub fn settle_all(&mut self, dev: &Device, failed: bool) -> CudaResult<()> {
        let mut result = Ok(());
        for weak in std::mem::take(&mut self.issued) {
            let Some(p) = weak.upgrade() else { continue };
            if result.is_err() {
                self.issued.push(weak);
                continue;
            }
            if failed && p.recurrent && p.saved().recurrent.is_none() {
                p.saved().lost = true;
                continue;
            }
            result = p.save_from(dev, self, 0..usize::MAX, true);
            if result.is_err() {
                self.issued.push(weak);
            }
        }
        result
    }

    /// After a failed call, before these buffers are dropped: [`DeviceSeq::settle_all`], its errors
    /// logged (the copies it could not save report it when read).
    pub fn rescue(&mut self, dev: &Device) {
        if let Err(e) = self.settle_all(dev, true) {
            eprintln!("poly-engine: a state copy could not be saved from the card: {e}");
            for weak in std::mem::take(&mut self.issued) {
                if let Some(p) = weak.upgrade() {
                    if !p.complete(true) {
                        p.saved().lost = true;
                    }
                }
            }
        }
    }

    /// A pending copy of what the card holds for `state` after a call (`n_past` tokens read): the KV rows
    /// past those its host layers hold, and the recurrent states.
    pub fn defer(
        &mut self,
        dev: &Arc<Device>,
        slot: &SeqSlot,
        state: &SeqState,
        n_past: usize,
    ) -> Deferred {
        // The host layers are as the last fetch left them (a pending copy not fetched changed nothing).
        let host_rows = host_kv_rows(state);
        let p = Arc::new(PendingCopy {
            dev: dev.clone(),
            slot: Arc::downgrade(slot),
            seq_id: self.id,
            host_rows,
            n_past,
            recurrent: state.has_recurrent(),
            kv_row_elems: self
                .layers
                .iter()
                .map(|l| match l {
                    DeviceLayer::Kv {
                        k_width, v_width, ..
                    } => k_width + v_width,
                    DeviceLayer::Recurrent { .. } => 0,
                })
                .sum(),
            saved: Mutex::new(Saved {
                lo: host_rows.min(n_past),
                hi: host_rows.min(n_past),
                ..Saved::default()
            }),
        });
        self.issued.push(Arc::downgrade(&p));
        Deferred(p)
    }

    /// Writes the host's state onto the card.
    fn upload(&mut self, dev: &Device, state: &SeqState) -> CudaResult<()> {
        self.tokens.clear();
        for (il, layer) in self.layers.iter_mut().enumerate() {
            match (layer, state.layer(il)) {
                (DeviceLayer::Kv { k, v, .. }, LayerState::Kv(c)) => {
                    dev.write_at(&to_f16(c.keys()), k, 0)?;
                    dev.write_at(&to_f16(c.values()), v, 0)?;
                }
                (DeviceLayer::Recurrent { conv, delta }, LayerState::Recurrent(r)) => {
                    if !r.conv.is_empty() {
                        dev.write_at(&r.conv, conv, 0)?;
                    }
                    if !r.delta.is_empty() {
                        dev.write_at(&r.delta, delta, 0)?;
                    }
                }
                // `fits` checked the kinds.
                _ => {}
            }
        }
        self.tokens = state.tokens().to_vec();
        Ok(())
    }

    /// Writes onto the card what of `state` it lacks while `p`, the state's pending copy of these
    /// buffers, still has its unsaved rows here: the host's KV rows, the copy's saved rows after them,
    /// and (with `recurrent`) the copy's saved recurrent states.
    fn upload_behind(
        &mut self,
        dev: &Device,
        state: &SeqState,
        p: &PendingCopy,
        recurrent: bool,
    ) -> CudaResult<()> {
        self.tokens.clear();
        let saved = p.saved();
        for (il, layer) in self.layers.iter_mut().enumerate() {
            match (layer, state.layer(il)) {
                (
                    DeviceLayer::Kv {
                        k,
                        v,
                        k_width,
                        v_width,
                    },
                    LayerState::Kv(c),
                ) => {
                    dev.write_at(&to_f16(c.keys()), k, 0)?;
                    dev.write_at(&to_f16(c.values()), v, 0)?;
                    if let Some((_, ks, vs)) = saved.kv.iter().find(|(l, _, _)| *l == il) {
                        dev.write_at(ks, k, saved.lo * *k_width)?;
                        dev.write_at(vs, v, saved.lo * *v_width)?;
                    }
                }
                (DeviceLayer::Recurrent { conv, delta }, LayerState::Recurrent(_)) if recurrent => {
                    let states = saved.recurrent.iter().flatten();
                    if let Some((_, c, d)) = states.into_iter().find(|(l, _, _)| *l == il) {
                        if !c.is_empty() {
                            dev.write_at(c, conv, 0)?;
                        }
                        if !d.is_empty() {
                            dev.write_at(d, delta, 0)?;
                        }
                    }
                }
                _ => {}
            }
        }
        self.tokens = state.tokens().to_vec();
        Ok(())
    }

    /// Records the tokens a call has just read (after [`DeviceSeq::follow`] made the card's tokens the
    /// calling state's).
    pub fn push_tokens(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }
}

/// Whether `d` is the pending copy `p`.
fn is_same(d: &Deferred, p: &Arc<PendingCopy>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(&d.0), Arc::as_ptr(p))
}

/// KV rows the host layers of `state` hold (0 without KV layers).
fn host_kv_rows(state: &SeqState) -> usize {
    (0..state.n_layers())
        .find_map(|il| match state.layer(il) {
            LayerState::Kv(c) => Some(c.len()),
            LayerState::Recurrent(_) => None,
        })
        .unwrap_or(0)
}

/// `(layer, conv, delta)`: one recurrent layer's states.
type RecurrentCopy = (usize, Vec<f32>, Vec<f32>);

/// The part of a pending copy saved in host memory.
#[derive(Default)]
struct Saved {
    /// `(layer, keys, values)` as f16 bits: rows `lo..hi` of every KV layer.
    kv: Vec<(usize, Vec<u16>, Vec<u16>)>,
    /// The KV rows saved (the copy's others, `host_rows..lo` and `hi..n_past`, are on the card; rows
    /// below a write's that it does not reach stay there: a fork sharing a prefix saves none of it).
    /// Empty as `lo == hi == host_rows`.
    lo: usize,
    hi: usize,
    /// `(layer, conv, delta)` of every recurrent layer, once saved.
    recurrent: Option<Vec<RecurrentCopy>>,
    /// The card's part went (a failed call) before it was saved.
    lost: bool,
}

/// What a host state lacks of the card's after a call ([`DeviceSeq::defer`]): partly saved in host
/// memory as the card's rows are overwritten ([`DeviceSeq::protect`]), the rest read from the card when
/// the host asks.
pub struct PendingCopy {
    dev: Arc<Device>,
    slot: Weak<Mutex<Option<DeviceSeq>>>,
    /// The [`DeviceSeq`] whose buffers hold the unsaved part.
    seq_id: u64,
    /// KV rows the host layers hold.
    host_rows: usize,
    n_past: usize,
    /// Whether the state has recurrent layers (their states are part of the copy).
    recurrent: bool,
    /// Keys and values of one position over all KV layers.
    kv_row_elems: usize,
    saved: Mutex<Saved>,
}

impl PendingCopy {
    fn saved(&self) -> MutexGuard<'_, Saved> {
        // Whole values are stored under this lock: a panic leaves it consistent.
        self.saved.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether host memory holds all of it (the KV rows only when `kv`).
    fn complete(&self, kv: bool) -> bool {
        let s = self.saved();
        (!kv || (s.lo <= self.host_rows && s.hi >= self.n_past))
            && (!self.recurrent || s.recurrent.is_some())
    }

    /// Saves from `seq` (the card's sequence, its slot locked by the caller) the KV rows of `want`
    /// (within `host_rows..n_past`) not saved yet, with those between them and the saved ones (the saved
    /// rows stay one range), and with `recurrent` the recurrent states.
    fn save_from(
        &self,
        dev: &Device,
        seq: &DeviceSeq,
        want: Range<usize>,
        recurrent: bool,
    ) -> CudaResult<()> {
        let mut s = self.saved();
        let want_recurrent = recurrent && self.recurrent && s.recurrent.is_none();
        let want = want.start.max(self.host_rows)..want.end.min(self.n_past);
        let (lo, hi) = if s.lo == s.hi {
            (want.start, want.start)
        } else {
            (s.lo, s.hi)
        };
        let (new_lo, new_hi) = if want.is_empty() {
            (lo, hi)
        } else {
            (lo.min(want.start), hi.max(want.end))
        };
        let kv_needed = !want.is_empty() && (new_lo < lo || new_hi > hi);
        if !kv_needed && !want_recurrent {
            return Ok(());
        }
        if s.lost || seq.id != self.seq_id {
            return Err(CudaError::Invalid(
                "a pending state copy outlived the card's buffers".into(),
            ));
        }
        if kv_needed {
            for (il, layer) in seq.layers.iter().enumerate() {
                if let DeviceLayer::Kv {
                    k,
                    v,
                    k_width,
                    v_width,
                } = layer
                {
                    let fetch = |buf: &DeviceBuffer<u16>, w: usize, r: Range<usize>| {
                        dev.download_range(buf, r.start * w, r.len() * w)
                    };
                    let (k_below, v_below) = (
                        fetch(k, *k_width, new_lo..lo)?,
                        fetch(v, *v_width, new_lo..lo)?,
                    );
                    let (k_above, v_above) = (
                        fetch(k, *k_width, hi..new_hi)?,
                        fetch(v, *v_width, hi..new_hi)?,
                    );
                    let at = match s.kv.iter().position(|(l, _, _)| *l == il) {
                        Some(at) => at,
                        None => {
                            s.kv.push((il, Vec::new(), Vec::new()));
                            s.kv.len() - 1
                        }
                    };
                    let (_, ks, vs) = &mut s.kv[at];
                    for (saved, below, above) in [(ks, k_below, k_above), (vs, v_below, v_above)] {
                        if saved.is_empty() && below.is_empty() {
                            // The first rows saved: the download itself, not a copy of it.
                            *saved = above;
                        } else if below.is_empty() {
                            saved.extend_from_slice(&above);
                        } else {
                            let mut rows = below;
                            rows.extend_from_slice(saved);
                            rows.extend_from_slice(&above);
                            *saved = rows;
                        }
                    }
                }
            }
            (s.lo, s.hi) = (new_lo, new_hi);
        }
        if want_recurrent {
            let mut states = Vec::new();
            for (il, layer) in seq.layers.iter().enumerate() {
                if let DeviceLayer::Recurrent { conv, delta } = layer {
                    states.push((il, dev.download(conv)?, dev.download(delta)?));
                }
            }
            s.recurrent = Some(states);
        }
        Ok(())
    }

    /// The saved copy, completed from the card first (the KV rows only when `kv`).
    fn completed(&self, kv: bool) -> Result<MutexGuard<'_, Saved>, String> {
        if self.saved().lost {
            return Err("the card's state was lost (a failed call)".into());
        }
        if !self.complete(kv) {
            let slot = self
                .slot
                .upgrade()
                .ok_or("the GPU backend holding the state is gone")?;
            let guard = slot.lock().unwrap_or_else(|p| p.into_inner());
            match guard.as_ref() {
                Some(seq) if seq.id == self.seq_id => self
                    .save_from(&self.dev, seq, if kv { 0..usize::MAX } else { 0..0 }, true)
                    .map_err(|e| format!("GPU: {e}"))?,
                // Saved while this waited for the lock?
                _ if self.complete(kv) => {}
                _ => return Err("the card's state was lost (a failed call)".into()),
            }
        }
        Ok(self.saved())
    }
}

/// `r` with the conv and delta states `conv`, `delta` (a layer without one keeps its empty one).
fn with_states(r: &RecurrentState, conv: &[f32], delta: &[f32]) -> RecurrentState {
    let mut r = r.clone();
    if !r.conv.is_empty() {
        r.conv = conv.to_vec();
    }
    if !r.delta.is_empty() {
        r.delta = delta.to_vec();
    }
    r
}

impl DeferredState for PendingCopy {
    fn fetch_into(&self, layers: &mut [LayerState]) -> Result<(), String> {
        let s = self.completed(true)?;
        for (il, keys, values) in &s.kv {
            if let Some(LayerState::Kv(c)) = layers.get_mut(*il) {
                c.truncate(self.host_rows);
                c.append_f16(keys, values);
            }
        }
        for (il, conv, delta) in s.recurrent.iter().flatten() {
            if let Some(LayerState::Recurrent(r)) = layers.get_mut(*il) {
                *r = with_states(r, conv, delta);
            }
        }
        Ok(())
    }

    fn recurrent_now(&self, layers: &[LayerState]) -> Result<Vec<(usize, RecurrentState)>, String> {
        let s = self.completed(false)?;
        let mut out = Vec::new();
        for (il, conv, delta) in s.recurrent.iter().flatten() {
            if let Some(LayerState::Recurrent(r)) = layers.get(*il) {
                out.push((*il, with_states(r, conv, delta)));
            }
        }
        Ok(out)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn truncated(&self, n: usize) -> Option<Deferred> {
        if self.recurrent || n < self.host_rows || n > self.n_past {
            return None;
        }
        let s = self.saved();
        if s.lost {
            return None;
        }
        // The saved rows below `n` (each layer's row width from what it saved).
        let saved_rows = s.hi - s.lo;
        let keep = n.min(s.hi).saturating_sub(s.lo);
        let (lo, hi) = if keep == 0 {
            (self.host_rows, self.host_rows)
        } else {
            (s.lo, s.lo + keep)
        };
        let kv =
            s.kv.iter()
                .filter(|_| keep > 0)
                .map(|(il, k, v)| {
                    let (kw, vw) = (k.len() / saved_rows.max(1), v.len() / saved_rows.max(1));
                    (*il, k[..keep * kw].to_vec(), v[..keep * vw].to_vec())
                })
                .collect();
        let cut = Arc::new(PendingCopy {
            dev: self.dev.clone(),
            slot: self.slot.clone(),
            seq_id: self.seq_id,
            host_rows: self.host_rows,
            n_past: n,
            recurrent: false,
            kv_row_elems: self.kv_row_elems,
            saved: Mutex::new(Saved {
                kv,
                lo,
                hi,
                recurrent: None,
                lost: false,
            }),
        });
        drop(s);
        if !cut.complete(true) {
            // Its card part is this copy's: listed beside it, so that writes save it too.
            let slot = self.slot.upgrade()?;
            let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
            let seq = guard.as_mut().filter(|seq| seq.id == self.seq_id)?;
            let me: *const PendingCopy = self;
            if !seq.issued.iter().any(|w| std::ptr::eq(w.as_ptr(), me)) {
                return None;
            }
            seq.issued.push(Arc::downgrade(&cut));
        }
        Some(Deferred(cut))
    }

    fn pending_bytes(&self) -> usize {
        // What the host will hold once it reads the copy (f32 rows), less what it holds already.
        self.kv_row_elems * 4 * (self.n_past - self.host_rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_rows_round_up_to_the_growth_step_within_the_context() {
        assert_eq!(kv_rows_for(1, 34_000), KV_GROWTH_ROWS);
        assert_eq!(kv_rows_for(KV_GROWTH_ROWS, 34_000), KV_GROWTH_ROWS);
        assert_eq!(kv_rows_for(KV_GROWTH_ROWS + 1, 34_000), 2 * KV_GROWTH_ROWS);
        assert_eq!(kv_rows_for(33_000, 34_000), 34_000);
        assert_eq!(kv_rows_for(40, 512), 512);
        assert_eq!(kv_rows_for(0, 0), 1);
    }
}
