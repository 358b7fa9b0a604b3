//! Decode graphs: the launches of a one-token forward call captured once into a CUDA graph and replayed for
//! every later token, so writing a token costs the host two small uploads, one graph launch and the logits'
//! download instead of queueing some 1,500 kernels.
//!
//! A graph is valid for one [`super::seq::DeviceSeq`] (its KV caches and recurrent states are the buffers the launches
//! write; a new `DeviceSeq` starts without graphs) and one bucket of context rows
//! ([`super::forward::decode_kv_rows`]: the attention's split is the bucket's). Everything that changes
//! between tokens is read on the card: the position (its own buffer), the token's embedding row (its own
//! buffer, written by the host before each replay), the routed experts (computed on the card). The graph's
//! activations come from a pool store of its own, so their addresses stay as captured.
//!
//! The first token of a bucket runs as an ordinary call in graph mode (its results are the token's), which
//! fills the graph's pool and the weights' vectors, and then the same launches are captured (nothing runs).
//! A capture that fails turns graphs off for that sequence; `POLY_GPU_GRAPHS=0` turns them off entirely.

use std::collections::HashMap;

use poly_kernels::cuda::{CudaError, CudaResult, Device, DeviceBuffer, LaunchGraph};
use poly_models::arch::{Forward, ModelGraph};
use poly_models::compute::WeightId;

use super::forward::{Backing, GpuForward, GraphInputs, GraphMode};
use super::pool::{Pool, PoolStore};
use crate::cpu::CpuWeights;

/// Whether decode graphs are on (`POLY_GPU_GRAPHS=0` turns them off).
pub fn graphs_enabled() -> bool {
    std::env::var("POLY_GPU_GRAPHS").map_or(true, |v| v.trim() != "0")
}

/// One captured decode call.
pub struct DecodeGraph {
    graph: LaunchGraph,
    /// `[n_vocab]`: where the replays leave the logits.
    logits: DeviceBuffer<f32>,
    inputs: GraphInputs,
    /// The embedding table and width the host fills `inputs.row` from.
    embed: (WeightId, usize),
    /// The activations' buffers the launches use (kept for their addresses).
    _store: PoolStore,
}

/// The graphs of one sequence's buffers, by the context rows their attention reads.
#[derive(Default)]
pub struct DecodeGraphs {
    by_rows: HashMap<usize, DecodeGraph>,
    /// A capture failed: this sequence runs without graphs.
    failed: bool,
}

impl DecodeGraphs {
    /// Whether a graph for `rows` exists.
    pub fn has(&self, rows: usize) -> bool {
        self.by_rows.contains_key(&rows)
    }

    /// Whether captures failed here.
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// Graphs held.
    pub fn len(&self) -> usize {
        self.by_rows.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.by_rows.is_empty()
    }
}

/// Replays the graph of `rows` for `token` at `pos0`; returns the logits. The caller checked
/// [`DecodeGraphs::has`].
pub fn replay(
    (dev, cpu): (&Device, &CpuWeights),
    graphs: &mut DecodeGraphs,
    rows: usize,
    token: u32,
    pos0: usize,
) -> CudaResult<Vec<f32>> {
    let g = graphs
        .by_rows
        .get_mut(&rows)
        .ok_or_else(|| CudaError::Invalid(format!("no decode graph for {rows} rows")))?;
    let (table, n_embd) = g.embed;
    let mut row = vec![0f32; n_embd];
    cpu.row_into(table, token as usize, &mut row);
    let r = g
        .inputs
        .row
        .as_mut()
        .ok_or_else(|| CudaError::Invalid("a decode graph without its row".into()))?;
    dev.write(&row, r)?;
    dev.write(&[pos0 as i32], &mut g.inputs.positions)?;
    g.graph.replay()?;
    dev.download(&g.logits)
}

/// Runs `token` at `pos0` as the first call of bucket `rows` in graph mode and then captures the same
/// launches into a graph kept in `seq`'s graphs; returns this call's logits. When the capture fails the
/// logits are still this call's, and the sequence runs without graphs from then on.
pub fn run_and_capture(
    backing: Backing<'_>,
    graph: &ModelGraph,
    rows: usize,
    token: &[u32],
    pos0: usize,
) -> CudaResult<Vec<f32>> {
    let Backing {
        dev,
        weights,
        cpu,
        seq,
        pool: _,
        mut experts,
    } = backing;
    let mut inputs = GraphInputs {
        row: None,
        positions: dev.zeros(1)?,
    };
    dev.write(&[pos0 as i32], &mut inputs.positions)?;
    let pool = Pool::new(PoolStore::default());
    let (logits, embed) = {
        let mode = GraphMode {
            inputs: &mut inputs,
            capturing: false,
            embed: None,
        };
        let b = Backing {
            dev,
            weights,
            cpu,
            seq: &mut *seq,
            pool: pool.clone(),
            experts: experts.as_deref_mut(),
        };
        let mut c = GpuForward::for_graph(b, token, pos0, mode);
        let out = graph.forward(&mut c);
        let embed = c.graph_embed();
        (c.finish(out)?, embed)
    };
    let captured = match (embed, Pool::into_store(pool)) {
        (Some(embed), Some(store)) => capture(
            Backing {
                dev,
                weights,
                cpu,
                seq: &mut *seq,
                pool: Pool::new(store),
                experts,
            },
            graph,
            (token, pos0),
            inputs,
            embed,
        ),
        _ => Err(CudaError::Invalid(
            "the decode call read no embedding or kept its buffers".into(),
        )),
    };
    match captured {
        Ok(g) => {
            seq.graphs.by_rows.insert(rows, g);
        }
        Err(e) => {
            eprintln!("poly-engine: decode graphs off for this sequence (capture failed: {e})");
            seq.graphs.failed = true;
        }
    }
    Ok(logits)
}

fn capture(
    backing: Backing<'_>,
    graph: &ModelGraph,
    (token, pos0): (&[u32], usize),
    mut inputs: GraphInputs,
    embed: (WeightId, usize),
) -> CudaResult<DecodeGraph> {
    let Backing {
        dev,
        weights,
        cpu,
        seq,
        pool,
        mut experts,
    } = backing;
    let mut logits = None;
    let launch_graph = dev.capture(|_| {
        let mode = GraphMode {
            inputs: &mut inputs,
            capturing: true,
            embed: None,
        };
        let b = Backing {
            dev,
            weights,
            cpu,
            seq: &mut *seq,
            pool: pool.clone(),
            experts: experts.take(),
        };
        let mut c = GpuForward::for_graph(b, token, pos0, mode);
        let out = graph.forward(&mut c);
        logits = Some(c.finish_captured(out)?);
        Ok(())
    })?;
    let logits = logits.ok_or_else(|| CudaError::Invalid("the capture left no logits".into()))?;
    let store = Pool::into_store(pool)
        .ok_or_else(|| CudaError::Invalid("a captured activation outlived the call".into()))?;
    Ok(DecodeGraph {
        graph: launch_graph,
        logits,
        inputs,
        embed,
        _store: store,
    })
}
