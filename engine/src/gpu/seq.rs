//! The state of the sequence on the card: per layer an f16 KV cache sized for the whole context (rows of
//! `n_head_kv·head_dim` f16 per position, filled up to the positions read) or the recurrent state (conv
//! rows and delta-rule matrices, f32).
//!
//! The engine's host [`SeqState`] stays the state the rest of the engine works with (conversations parked
//! and resumed, checkpoints, truncation). The card holds the state of one sequence: the tokens it has read
//! tell which. Before a call, [`DeviceSeq::follow`] keeps the card's state when it is the host's (the same
//! tokens; or, without recurrent layers, a prefix of them: the KV caches are simply read less far), and
//! otherwise uploads the host's.
//!
//! After a call nothing is copied back: the host state gets a [`PendingCopy`] ([`crate::state::Deferred`])
//! that copies the new KV rows and the recurrent states to the host when the host reads them
//! ([`SeqState::sync`]: checkpoints, parking, the CPU). Before the card's state changes (every call, an
//! upload of another sequence, new buffers), every pending copy of it that someone may still read is
//! fetched into host memory first ([`DeviceSeq::settle`]), except the calling state's own when nothing else
//! holds it (the call supersedes it). So writing a token moves no state over the bus.

use std::sync::{Arc, Mutex, Weak};

use poly_kernels::cuda::{CudaError, CudaResult, Device, DeviceBuffer};

use super::decode_graph::DecodeGraphs;
use crate::state::{Deferred, DeferredState, LayerState, RecurrentState, SeqState};

/// Where the card's sequence lives (the backend's slot); pending copies reach it through a weak link.
pub type SeqSlot = Arc<Mutex<Option<DeviceSeq>>>;

/// One layer's state on the card.
pub enum DeviceLayer {
    Kv {
        /// `[n_ctx, k_width]` f16 bits.
        k: DeviceBuffer<u16>,
        /// `[n_ctx, v_width]` f16 bits.
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
    n_ctx: usize,
    tokens: Vec<u32>,
    pub layers: Vec<DeviceLayer>,
    /// The decode graphs captured over these buffers (dropped with them).
    pub graphs: DecodeGraphs,
    /// Bumped whenever the buffers' contents change; a pending copy of another epoch is stale.
    epoch: u64,
    /// The pending copies handed out for these buffers (the live ones are settled before a change).
    issued: Vec<Weak<PendingCopy>>,
}

fn to_f16(x: &[f32]) -> Vec<u16> {
    x.iter()
        .map(|&v| half::f16::from_f32(v).to_bits())
        .collect()
}

fn from_f16(x: &[u16]) -> Vec<f32> {
    x.iter()
        .map(|&b| half::f16::from_bits(b).to_f32())
        .collect()
}

impl DeviceSeq {
    /// Buffers for `state`'s layers, empty.
    fn alloc(dev: &Device, state: &SeqState) -> CudaResult<DeviceSeq> {
        let n_ctx = state.n_ctx().max(1);
        let mut layers = Vec::with_capacity(state.n_layers());
        for il in 0..state.n_layers() {
            layers.push(match state.layer(il) {
                LayerState::Kv(c) => DeviceLayer::Kv {
                    k: dev.zeros(n_ctx * c.k_width().max(1))?,
                    v: dev.zeros(n_ctx * c.v_width().max(1))?,
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
            n_ctx,
            tokens: Vec::new(),
            layers,
            graphs: DecodeGraphs::default(),
            epoch: 0,
            issued: Vec::new(),
        })
    }

    /// Positions the buffers hold.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Whether the buffers have the shapes of `state`'s layers.
    fn fits(&self, state: &SeqState) -> bool {
        self.n_ctx >= state.n_ctx()
            && self.layers.len() == state.n_layers()
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

    /// Makes the card hold `state` (see the module documentation) and returns it.
    pub fn follow<'a>(
        dev: &Device,
        slot: &'a mut Option<DeviceSeq>,
        state: &mut SeqState,
    ) -> CudaResult<&'a mut DeviceSeq> {
        if !slot.as_ref().is_some_and(|s| s.fits(state)) {
            if let Some(old) = slot.as_mut() {
                old.settle(dev, None)?;
            }
            *slot = None;
            *slot = Some(DeviceSeq::alloc(dev, state)?);
        }
        let Some(seq) = slot.as_mut() else {
            unreachable!("the slot was filled above")
        };
        let host = state.tokens();
        let same = seq.tokens == host;
        let prefix = !state.has_recurrent()
            && seq.tokens.len() >= host.len()
            && seq.tokens.starts_with(host);
        if same || prefix {
            seq.tokens.truncate(host.len());
            return Ok(seq);
        }
        // Another sequence: whatever is read of this one later must be in host memory first, and the
        // incoming state's host copy complete (its own pending copy, if any, was settled when the card
        // moved on from it, so this does not reach for the card).
        seq.settle(dev, None)?;
        state.sync().map_err(CudaError::Invalid)?;
        seq.upload(dev, state)?;
        Ok(seq)
    }

    /// Fetches into host memory every pending copy of the buffers' present contents that someone may
    /// still read, before the contents change (then bumps the epoch). `own` is the calling state's pending
    /// copy: left on the card when nothing but that state holds it (the coming call supersedes it).
    pub fn settle(&mut self, dev: &Device, own: Option<&Deferred>) -> CudaResult<()> {
        let issued = std::mem::take(&mut self.issued);
        for weak in issued {
            let Some(p) = weak.upgrade() else { continue };
            let is_own = own.is_some_and(|d| std::ptr::addr_eq(Arc::as_ptr(&d.0), Arc::as_ptr(&p)));
            // Held by the state and by `p` here: nobody else reads it.
            if is_own && Arc::strong_count(&p) <= 2 {
                continue;
            }
            p.settle_from(dev, self)?;
        }
        self.epoch += 1;
        Ok(())
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
            epoch: self.epoch,
            host_rows,
            n_past,
            fetched: Mutex::new(None),
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

    /// The host's missing part of the present contents: KV rows `host_rows..n_past` of every KV layer
    /// (with `kv`) and the recurrent states.
    fn download(
        &self,
        dev: &Device,
        (host_rows, n_past): (usize, usize),
        kv: bool,
    ) -> CudaResult<HostCopy> {
        let mut copy = HostCopy::default();
        let n = n_past.saturating_sub(host_rows);
        for (il, layer) in self.layers.iter().enumerate() {
            match layer {
                DeviceLayer::Kv {
                    k,
                    v,
                    k_width,
                    v_width,
                } if kv => {
                    let keys = dev.download_range(k, host_rows * k_width, n * k_width)?;
                    let values = dev.download_range(v, host_rows * v_width, n * v_width)?;
                    copy.kv.push((il, from_f16(&keys), from_f16(&values)));
                }
                DeviceLayer::Recurrent { conv, delta } => {
                    copy.recurrent
                        .push((il, dev.download(conv)?, dev.download(delta)?));
                }
                DeviceLayer::Kv { .. } => {}
            }
        }
        Ok(copy)
    }

    /// Records the tokens the card's state has read.
    pub fn set_tokens(&mut self, tokens: &[u32]) {
        self.tokens = tokens.to_vec();
    }
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

/// The part of a state the host lacks, in host memory.
#[derive(Clone, Default)]
struct HostCopy {
    /// `(layer, keys, values)`: rows `host_rows..n_past`.
    kv: Vec<(usize, Vec<f32>, Vec<f32>)>,
    /// `(layer, conv, delta)`.
    recurrent: Vec<(usize, Vec<f32>, Vec<f32>)>,
}

/// What a host state lacks of the card's after a call ([`DeviceSeq::defer`]): fetched from the card when
/// the host asks, or from host memory once the card has moved on ([`DeviceSeq::settle`]).
pub struct PendingCopy {
    dev: Arc<Device>,
    slot: Weak<Mutex<Option<DeviceSeq>>>,
    /// The card's contents this copy is of.
    epoch: u64,
    /// KV rows the host layers hold.
    host_rows: usize,
    n_past: usize,
    /// The copy, once fetched.
    fetched: Mutex<Option<HostCopy>>,
}

impl PendingCopy {
    fn fetched(&self) -> std::sync::MutexGuard<'_, Option<HostCopy>> {
        // Whole values are stored under this lock: a panic leaves it consistent.
        self.fetched.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fetches the copy from `seq` (the card's sequence, its slot locked by the caller) unless fetched.
    fn settle_from(&self, dev: &Device, seq: &DeviceSeq) -> CudaResult<()> {
        let mut fetched = self.fetched();
        if fetched.is_none() {
            if seq.epoch != self.epoch {
                return Err(CudaError::Invalid(
                    "a pending state copy outlived the card's contents".into(),
                ));
            }
            *fetched = Some(seq.download(dev, (self.host_rows, self.n_past), true)?);
        }
        Ok(())
    }

    /// The copy (with the KV rows when `kv`), from host memory or the card.
    fn copy(&self, kv: bool) -> Result<HostCopy, String> {
        if let Some(c) = self.fetched().as_ref() {
            return Ok(c.clone());
        }
        let slot = self
            .slot
            .upgrade()
            .ok_or("the GPU backend holding the state is gone")?;
        let guard = slot.lock().unwrap_or_else(|p| p.into_inner());
        // Settled while this waited for the lock?
        if let Some(c) = self.fetched().as_ref() {
            return Ok(c.clone());
        }
        match guard.as_ref() {
            Some(seq) if seq.epoch == self.epoch => seq
                .download(&self.dev, (self.host_rows, self.n_past), kv)
                .map_err(|e| format!("GPU: {e}")),
            _ => Err("the card's state was lost (a failed call)".into()),
        }
    }
}

impl DeferredState for PendingCopy {
    fn fetch_into(&self, layers: &mut [LayerState]) -> Result<(), String> {
        let copy = self.copy(true)?;
        for (il, keys, values) in &copy.kv {
            if let Some(LayerState::Kv(c)) = layers.get_mut(*il) {
                c.truncate(self.host_rows);
                c.append(keys, values);
            }
        }
        for (il, conv, delta) in copy.recurrent {
            if let Some(LayerState::Recurrent(r)) = layers.get_mut(il) {
                if !r.conv.is_empty() {
                    r.conv = conv;
                }
                if !r.delta.is_empty() {
                    r.delta = delta;
                }
            }
        }
        Ok(())
    }

    fn recurrent_now(&self, layers: &[LayerState]) -> Result<Vec<(usize, RecurrentState)>, String> {
        let copy = self.copy(false)?;
        let mut out = Vec::new();
        for (il, conv, delta) in copy.recurrent {
            if let Some(LayerState::Recurrent(r)) = layers.get(il) {
                let mut r = r.clone();
                if !r.conv.is_empty() {
                    r.conv = conv;
                }
                if !r.delta.is_empty() {
                    r.delta = delta;
                }
                out.push((il, r));
            }
        }
        Ok(out)
    }
}
