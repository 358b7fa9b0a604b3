//! The GPU backend: [`Compute`](poly_models::compute::Compute) on a CUDA card for models whose weights all
//! fit in VRAM.
//!
//! - [`weights`]: every matrix of the file uploaded once in its own type (experts as [`StackedExperts`]
//!   behind the expert table the cache of issue 8 will point elsewhere), small vectors as f32 on first use.
//! - [`forward`]: one forward call on the card ([`forward::GpuForward`]): activations are device buffers
//!   from a [`pool`], every operation is queued on the device's compute stream with no host wait; the
//!   logits are the one download of a call.
//! - [`lockstep`]: a diagnosis running the CPU and the card side by side, operation by operation.
//! - [`reference`]: the CPU with the card's activation rounding, the reference tests hold the card to.
//! - [`seq`]: the sequence state on the card (KV caches in f16, recurrent states) and how it follows the
//!   engine's host [`SeqState`], which stays the state the rest of the engine (conversations, checkpoints)
//!   works with: after each call the host state is marked behind, the new KV rows and recurrent states
//!   copied to it only when it is read; a state that is not the one on the card is uploaded before a call.
//! - [`decode_graph`]: one-token calls captured as CUDA graphs and replayed.
//! - [`profile`]: `POLY_GPU_PROFILE`, where a call's time goes.
//!
//! [`DeviceChoice`] says whether a model runs here: `Auto` takes GPU 0 when there is one, so a machine
//! without a GPU (CI) runs on the CPU as before.

pub mod decode_graph;
pub mod forward;
pub mod lockstep;
pub mod pool;
pub mod profile;
pub mod reference;
pub mod seq;
pub mod weights;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use poly_kernels::cuda::{CudaError, Device};
use poly_models::arch::{Forward, ModelGraph};
use poly_models::compute::Logits;

use crate::cpu::CpuWeights;
use crate::model::EngineError;
use crate::state::SeqState;

use forward::GpuForward;
use pool::{Pool, PoolStore};
use profile::{CallPhases, Profiler};
use seq::{DeviceSeq, SeqSlot};
use weights::GpuWeights;

pub use poly_kernels::cuda::StackedExperts;

/// Where a model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// GPU 0 when there is one, else the CPU.
    #[default]
    Auto,
    /// The CPU, even when there is a GPU.
    Cpu,
    /// GPU `n`; an error when there is none.
    Gpu(usize),
}

impl DeviceChoice {
    /// From the command line's `--cpu` and `--gpu N`.
    pub fn from_flags(cpu: bool, gpu: Option<usize>) -> Result<DeviceChoice, EngineError> {
        match (cpu, gpu) {
            (true, Some(_)) => Err(EngineError("--cpu and --gpu exclude each other".into())),
            (true, None) => Ok(DeviceChoice::Cpu),
            (false, Some(n)) => Ok(DeviceChoice::Gpu(n)),
            (false, None) => Ok(DeviceChoice::Auto),
        }
    }

    /// The device to open, or `None` for the CPU.
    pub fn ordinal(self) -> Result<Option<usize>, EngineError> {
        match self {
            DeviceChoice::Cpu => Ok(None),
            DeviceChoice::Gpu(n) => Ok(Some(n)),
            DeviceChoice::Auto => Ok((Device::count() > 0).then_some(0)),
        }
    }
}

fn cuda_err(e: CudaError) -> EngineError {
    EngineError(format!("GPU: {e}"))
}

/// A model's weights and sequence state on one card.
pub struct GpuBackend {
    dev: Arc<Device>,
    weights: GpuWeights,
    /// The sequence whose state is on the card now.
    seq: SeqSlot,
    /// Buffers kept between calls.
    pool: Mutex<PoolStore>,
    /// `POLY_GPU_PROFILE`'s sums, printed when the backend is dropped.
    profile: Option<Profiler>,
    /// Whether one-token calls go through decode graphs ([`decode_graph::graphs_enabled`]).
    graphs: bool,
}

impl Drop for GpuBackend {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            eprint!("{}", p.summary());
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing is left half-updated under these locks by a panic that matters: a poisoned lock's data is
    // still usable (the resident sequence is re-uploaded when in doubt).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl GpuBackend {
    /// Opens GPU `ordinal` and uploads every weight of `cpu`'s file.
    pub fn load(ordinal: usize, cpu: &CpuWeights) -> Result<GpuBackend, EngineError> {
        let dev = Device::open(ordinal).map_err(cuda_err)?;
        let weights = GpuWeights::upload(&dev, cpu).map_err(cuda_err)?;
        Ok(GpuBackend {
            dev,
            weights,
            seq: Arc::new(Mutex::new(None)),
            pool: Mutex::new(PoolStore::default()),
            profile: Profiler::from_env(),
            graphs: decode_graph::graphs_enabled(),
        })
    }

    /// `cuda:N <name>`, as READY says it.
    pub fn describe(&self) -> String {
        format!("cuda:{} {}", self.dev.ordinal(), self.dev.name())
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Bytes of weights on the card.
    pub fn weight_bytes(&self) -> usize {
        self.weights.bytes()
    }

    /// One forward call of `tokens` into `state` on the card (the caller checked tokens, room and layers);
    /// returns the logits `logits` asks for and records the tokens in `state`.
    pub fn eval(
        &self,
        graph: &ModelGraph,
        cpu: &CpuWeights,
        state: &mut SeqState,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>, EngineError> {
        if tokens.len() == 1 && logits == Logits::Last && self.graphs {
            return self.eval_decode(graph, cpu, state, tokens);
        }
        self.call(cpu, state, tokens, logits, |c| (graph.forward(c), ()))
            .map(|(l, ())| l)
    }

    /// [`GpuBackend::eval`] of one token through a decode graph ([`decode_graph`]): replayed when this
    /// context bucket has one, else run and captured.
    fn eval_decode(
        &self,
        graph: &ModelGraph,
        cpu: &CpuWeights,
        state: &mut SeqState,
        tokens: &[u32],
    ) -> Result<Vec<f32>, EngineError> {
        let mut phases = CallPhases::default();
        let clock = Instant::now();
        let mut seq_slot = lock(&self.seq);
        let seq = DeviceSeq::follow(&self.dev, &mut seq_slot, state).map_err(cuda_err)?;
        // The call changes the card's state: copies of it others may read go to host memory first.
        seq.settle(&self.dev, state.deferred()).map_err(cuda_err)?;
        phases.follow = clock.elapsed();
        let clock = Instant::now();
        let mut marks = self.profile.as_ref().and_then(|p| p.begin(&self.dev));
        let pos0 = state.n_past();
        let rows = forward::decode_kv_rows(pos0 + 1, seq.n_ctx());
        let result = if seq.graphs.has(rows) {
            let queued =
                decode_graph::replay((&self.dev, cpu), &mut seq.graphs, rows, tokens[0], pos0);
            phases.queue = clock.elapsed();
            if let Some(m) = marks.as_mut() {
                m.end(&self.dev);
            }
            queued.and_then(|()| decode_graph::logits(&self.dev, &mut seq.graphs, rows))
        } else if seq.graphs.failed() {
            drop(seq_slot);
            return self
                .call(cpu, state, tokens, Logits::Last, |c| (graph.forward(c), ()))
                .map(|(l, ())| l);
        } else {
            let backing = forward::Backing {
                dev: &self.dev,
                weights: &self.weights,
                cpu,
                seq,
                pool: Pool::new(PoolStore::default()),
            };
            decode_graph::run_and_capture(backing, graph, rows, tokens, pos0)
        };
        if phases.queue.is_zero() {
            // A run and capture: no phase split.
            phases.queue = clock.elapsed();
            if let Some(m) = marks.as_mut() {
                m.end(&self.dev);
            }
        }
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                *seq_slot = None;
                return Err(cuda_err(e));
            }
        };
        phases.finish = clock.elapsed().saturating_sub(phases.queue);
        let clock = Instant::now();
        self.after_call(&mut seq_slot, state, tokens);
        phases.copy_back = clock.elapsed();
        if let Some(p) = &self.profile {
            p.record(&self.dev, tokens.len(), phases, marks);
        }
        Ok(logits)
    }

    /// After a call of `tokens`: the host state records them and is marked behind the card's.
    fn after_call(&self, seq_slot: &mut Option<DeviceSeq>, state: &mut SeqState, tokens: &[u32]) {
        state.push_tokens(tokens);
        if let Some(s) = seq_slot.as_mut() {
            let pending = s.defer(&self.dev, &self.seq, state, state.n_past());
            state.set_deferred(Some(pending));
            s.set_tokens(state.tokens());
        }
    }

    /// One forward call whose operations `run` queues on `c` (it returns the logits' activation and
    /// anything else it found), with the state following `state` as [`GpuBackend::eval`] keeps it.
    pub(crate) fn call<R>(
        &self,
        cpu: &CpuWeights,
        state: &mut SeqState,
        tokens: &[u32],
        logits: Logits,
        run: impl FnOnce(&mut GpuForward<'_>) -> (forward::DevAct, R),
    ) -> Result<(Vec<f32>, R), EngineError> {
        let mut phases = CallPhases::default();
        let clock = Instant::now();
        let mut seq_slot = lock(&self.seq);
        let seq = DeviceSeq::follow(&self.dev, &mut seq_slot, state).map_err(cuda_err)?;
        // The call changes the card's state: copies of it others may read go to host memory first.
        seq.settle(&self.dev, state.deferred()).map_err(cuda_err)?;
        phases.follow = clock.elapsed();
        let clock = Instant::now();
        let marks = self.profile.as_ref().and_then(|p| p.begin(&self.dev));
        let pos0 = state.n_past();
        let pool = Pool::new(std::mem::take(&mut *lock(&self.pool)));
        let mut marks_out;
        let result = {
            let mut c = GpuForward::new(
                &self.dev,
                &self.weights,
                cpu,
                seq,
                pool.clone(),
                tokens,
                pos0,
                logits,
            )
            .map_err(cuda_err)?;
            c.set_marks(marks);
            let (out, extra) = run(&mut c);
            marks_out = c.take_marks();
            if let Some(m) = marks_out.as_mut() {
                m.end(&self.dev);
            }
            phases.queue = clock.elapsed();
            let clock = Instant::now();
            let r = c.finish(out).map(|l| (l, extra));
            phases.finish = clock.elapsed();
            r
        };
        if let Some(store) = Pool::into_store(pool) {
            *lock(&self.pool) = store;
        }
        let (logits, extra) = match result {
            Ok(l) => l,
            Err(e) => {
                // The card's state is in doubt: upload the host's next time.
                *seq_slot = None;
                return Err(cuda_err(e));
            }
        };
        let clock = Instant::now();
        self.after_call(&mut seq_slot, state, tokens);
        phases.copy_back = clock.elapsed();
        if let Some(p) = &self.profile {
            p.record(&self.dev, tokens.len(), phases, marks_out);
        }
        Ok((logits, extra))
    }
}

/// Whether `graph` names layers the way `state` has them (a guard before the card's state is built).
pub fn layers_match(graph: &ModelGraph, state: &SeqState) -> bool {
    graph.layer_states().len() == state.n_layers()
}
