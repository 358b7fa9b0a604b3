//! The state of the sequence on the card: per layer an f16 KV cache sized for the whole context (rows of
//! `n_head_kv·head_dim` f16 per position, filled up to the positions read) or the recurrent state (conv
//! rows and delta-rule matrices, f32).
//!
//! The engine's host [`SeqState`] stays the authority the rest of the engine works with (conversations
//! parked and resumed, checkpoints, truncation). The card holds the state of one sequence: the tokens it
//! has read tell which. Before a call, [`DeviceSeq::follow`] keeps the card's state when it is the host's
//! (the same tokens; or, without recurrent layers, a prefix of them: the KV caches are simply read less
//! far), and otherwise uploads the host's. After a call, [`DeviceSeq::copy_back`] copies the new KV rows and
//! the recurrent states into the host state, so the two stay equal.

use poly_kernels::cuda::{CudaResult, Device, DeviceBuffer};

use super::decode_graph::DecodeGraphs;
use crate::state::{LayerState, SeqState};

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
        state: &SeqState,
    ) -> CudaResult<&'a mut DeviceSeq> {
        if !slot.as_ref().is_some_and(|s| s.fits(state)) {
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
        seq.upload(dev, state)?;
        Ok(seq)
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

    /// Copies what a call of `n` tokens at `pos0` wrote into the host state: the new KV rows, the
    /// recurrent states.
    pub fn copy_back(
        &self,
        dev: &Device,
        state: &mut SeqState,
        pos0: usize,
        n: usize,
    ) -> CudaResult<()> {
        for (il, layer) in self.layers.iter().enumerate() {
            match (layer, state.layer_mut(il)) {
                (
                    DeviceLayer::Kv {
                        k,
                        v,
                        k_width,
                        v_width,
                    },
                    LayerState::Kv(c),
                ) => {
                    let keys = dev.download_range(k, pos0 * k_width, n * k_width)?;
                    let values = dev.download_range(v, pos0 * v_width, n * v_width)?;
                    c.truncate(pos0);
                    c.append(&from_f16(&keys), &from_f16(&values));
                }
                (DeviceLayer::Recurrent { conv, delta }, LayerState::Recurrent(r)) => {
                    if !r.conv.is_empty() {
                        r.conv = dev.download(conv)?;
                    }
                    if !r.delta.is_empty() {
                        r.delta = dev.download(delta)?;
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Records the tokens the card's state has read.
    pub fn set_tokens(&mut self, tokens: &[u32]) {
        self.tokens = tokens.to_vec();
    }
}
