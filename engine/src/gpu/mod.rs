//! The GPU backend: [`Compute`](poly_models::compute::Compute) on a CUDA card for models whose weights all
//! fit in VRAM.
//!
//! - [`weights`]: every dense matrix of the file uploaded once in its own type, small vectors as f32 on
//!   first use.
//! - [`expert_cache`]: the routed experts (issue 8): as many as fit in a VRAM cache sized after a warm-up
//!   call ([`Placement`]), the others staged through pinned memory for prompt calls or computed on the CPU
//!   for single tokens; the cache follows what the answers route to.
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
pub mod expert_cache;
pub mod forward;
mod kv_room;
mod lend;
pub mod lockstep;
mod pool;
pub mod profile;
pub mod reference;
pub mod seq;
pub mod weights;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use poly_kernels::cuda::{CudaError, CudaResult, Device};
use poly_models::arch::{Forward, ModelGraph};
use poly_models::compute::Logits;

use crate::cpu::CpuWeights;
use crate::model::EngineError;
use crate::state::{KvPrecision, SeqState};

use expert_cache::placement::{cache_bytes, default_reserve, state_bytes};
pub use expert_cache::placement::{Admissions, LendRefill, MissingExperts, Placement};
use expert_cache::profile::{profile_path, Binding, ExpertProfile};
pub use expert_cache::skip::{MissingSkip, Skipped};
pub use expert_cache::AdmissionRule;
use expert_cache::{CacheStats, ExpertCache};

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
    /// The routed experts, for a model that has some.
    experts: Mutex<Option<ExpertCache>>,
    /// `POLY_GPU_PROFILE`'s sums, printed when the backend is dropped.
    profile: Option<Profiler>,
    /// Whether one-token calls go through decode graphs ([`decode_graph::graphs_enabled`]).
    graphs: bool,
    /// Whether they do when the expert cache needs the host, as segmented graphs
    /// ([`decode_graph::segments_enabled`]).
    segments: bool,
    /// Routings of one token over all MoE layers, counted when a decode graph was captured: a replay
    /// adds them to the expert cache's figures, which a graph cannot count itself.
    routings_per_token: std::sync::atomic::AtomicU64,
    /// The most memory in use on the card seen after a prompt call ([`GpuBackend::keep_budget`]).
    vram_high: std::sync::atomic::AtomicUsize,
    /// Bytes the card keeps free when the expert cache was sized by a reserve (`--vram-reserve-mib`).
    reserve: std::sync::OnceLock<usize>,
    /// The warm-up call the budget counted the scratch of.
    warm: std::sync::OnceLock<lend::WarmCall>,
    /// Slots the expert cache gave up for the scratch of calls larger than the warm-up's ([`lend`]).
    lent: Mutex<Option<lend::Lent>>,
    /// Slots the expert cache gave up for KV rows beyond those counted at load ([`kv_room`]).
    kv_lent: Mutex<usize>,
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
    /// Opens GPU `ordinal`, uploads the dense weights of `cpu`'s file and places its routed experts as
    /// `placement` says.
    pub fn load(
        ordinal: usize,
        graph: &ModelGraph,
        cpu: &CpuWeights,
        placement: &Placement,
    ) -> Result<GpuBackend, EngineError> {
        if let Some(why) = GpuBackend::refuses(graph, cpu) {
            return Err(EngineError(why));
        }
        let dev = Device::open(ordinal).map_err(cuda_err)?;
        let layers = expert_cache::layout::expert_layers(cpu)?;
        let weights =
            GpuWeights::upload(&dev, cpu, |w| layers.iter().any(|l| l.has(w))).map_err(cuda_err)?;
        let cache = if layers.is_empty() {
            None
        } else {
            Some(ExpertCache::new(&dev, cpu, layers, !placement.staging_only).map_err(cuda_err)?)
        };
        let backend = GpuBackend {
            dev,
            weights,
            seq: Arc::new(Mutex::new(None)),
            pool: Mutex::new(PoolStore::default()),
            profile: Profiler::from_env(),
            graphs: decode_graph::graphs_enabled(),
            segments: decode_graph::segments_enabled(),
            experts: Mutex::new(cache),
            routings_per_token: std::sync::atomic::AtomicU64::new(0),
            vram_high: std::sync::atomic::AtomicUsize::new(0),
            reserve: std::sync::OnceLock::new(),
            warm: std::sync::OnceLock::new(),
            lent: Mutex::new(None),
            kv_lent: Mutex::new(0),
        };
        if lock(&backend.experts).is_some() {
            backend.place_experts(graph, cpu, placement)?;
        }
        Ok(backend)
    }

    /// Why the card cannot run `graph`'s forward pass (an operation, or a form of one, its kernels lack),
    /// found from what the graph uses ([`ModelGraph::uses`]) before anything is uploaded; `None` when it
    /// can.
    pub fn refuses(graph: &ModelGraph, cpu: &CpuWeights) -> Option<String> {
        let uses = graph.uses(cpu.file());
        let lacks: Vec<String> = [uses.needs_moe_selection_bias(), uses.needs_fused_moe()]
            .into_iter()
            .flatten()
            .map(str::to_owned)
            .chain(uses.needs_cpu_only_ops())
            .collect();
        (!lacks.is_empty()).then(|| {
            format!(
                "GPU: the card does not run this {} model yet: it lacks {} (run it on the CPU: --cpu)",
                graph.info().arch,
                lacks.join(", ")
            )
        })
    }

    /// Sizes and fills the expert cache: a warm-up call (every expert staged) leaves the calls' scratch
    /// allocated and counts routings; the free VRAM then measured, less the state and the reserve, is the
    /// cache; it starts with the experts the profile (else the warm-up) routed to most.
    fn place_experts(
        &self,
        graph: &ModelGraph,
        cpu: &CpuWeights,
        p: &Placement,
    ) -> Result<(), EngineError> {
        let info = graph.info();
        // The scratch the budget keeps is that of a call of this many tokens (larger calls borrow), so it
        // is allocated before the free VRAM is measured.
        let call_tokens = p.warm_tokens();
        let n_ctx_max = match p.n_ctx {
            0 => info.n_ctx_train.max(1) as usize,
            n => n,
        };
        let n_warm = call_tokens.min(n_ctx_max);
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let tokens: Vec<u32> = (0..n_warm)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((seed >> 33) % info.n_vocab.max(1) as u64) as u32
            })
            .collect();
        let specs = graph.layer_states();
        let mut warm = SeqState::with_precision(&specs, n_warm, KvPrecision::default());
        self.eval(graph, cpu, &mut warm, &tokens, Logits::Last)?;
        // The warm-up's state goes (its pending copy first: nothing is saved); its scratch buffers stay
        // in the pool.
        drop(warm);
        *lock(&self.seq) = None;
        // Later calls keep their scratch within what the warm-up's took (the budget counts it).
        let scratch = {
            let mut pool = lock(&self.pool);
            pool.cap_at_current();
            pool.bytes()
        };
        let _ = self.warm.set(lend::WarmCall {
            tokens: n_warm,
            scratch,
            refill: p.lend_refill,
        });
        self.dev.synchronize().map_err(cuda_err)?;
        let (free, total) = self.dev.memory_info().map_err(cuda_err)?;
        let n_ctx = if p.n_ctx == 0 {
            info.n_ctx_train as usize
        } else {
            p.n_ctx
        };
        if p.expert_budget.is_none() {
            let reserve = p
                .reserve_mib
                .map_or_else(|| default_reserve(total), |m| m.saturating_mul(1 << 20));
            let _ = self.reserve.set(reserve);
        }
        // Held to a reserve, the KV caches grow with the conversation ([`kv_room`]): the cache counts the
        // rows of a warm-up's call; with a fixed expert budget, the whole context.
        let kv_rows = match self.reserve.get() {
            Some(_) => seq::kv_rows_for(n_warm, n_ctx),
            None => n_ctx,
        };
        let budget = cache_bytes(p, free, total, state_bytes(&specs, kv_rows));
        let mut guard = lock(&self.experts);
        let Some(cache) = guard.as_mut() else {
            return Ok(());
        };
        let warm_counts = cache.take_counts();
        let binding = Binding::of(cpu.file());
        let shape: Vec<(u32, usize)> = cache
            .layers()
            .iter()
            .map(|l| (l.block, l.n_expert))
            .collect();
        let path = cpu.file().paths().first().map(|m| profile_path(m));
        let stored = match (&path, p.no_profile) {
            (Some(path), false) => ExpertProfile::load(path, binding, &shape),
            _ => None,
        };
        let profiled = stored
            .as_ref()
            .is_some_and(|prof| prof.layers.iter().any(|(_, c)| c.iter().any(|&v| v > 0)));
        let counts: Vec<Vec<u64>> = match &stored {
            Some(prof) if profiled => prof.layers.iter().map(|(_, c)| c.clone()).collect(),
            _ => warm_counts,
        };
        let n_slots = budget / cache.slot_bytes().max(1);
        let from = if profiled {
            "the profile"
        } else {
            "a warm-up read"
        };
        cache
            .fill(&self.dev, cpu, n_slots, &counts)
            .map_err(cuda_err)?;
        cache.set_following(p.uploads_per_layer, p.admissions, p.admission_rule);
        cache
            .set_missing_experts(&self.dev, p.missing_experts)
            .map_err(cuda_err)?;
        cache.set_skip(p.skip);
        // A few KiB of vectors after the cache was sized: n_expert floats per layer.
        cache
            .set_cache_bias(&self.dev, p.cache_bias)
            .map_err(cuda_err)?;
        if let (Some(path), false) = (path, p.no_profile) {
            let prof = stored.unwrap_or_else(|| ExpertProfile::empty(binding, &shape));
            cache.set_profile(path, prof);
        }
        eprintln!(
            "expert cache: {} of {} experts in VRAM ({} MiB of slots of {} KiB; {} MiB free before, \
             starting from {}; copies {})",
            cache.experts_resident(),
            cache.experts_total(),
            cache.stats().bytes >> 20,
            cache.slot_bytes() >> 10,
            free >> 20,
            from,
            if cache.direct_copies() {
                "straight from the page-locked file"
            } else {
                "through pinned staging buffers"
            },
        );
        Ok(())
    }

    /// The expert cache's figures, for a model with routed experts.
    pub fn expert_stats(&self) -> Option<CacheStats> {
        lock(&self.experts).as_ref().map(ExpertCache::stats)
    }

    /// Routed experts in VRAM now and over all layers (0, 0 for a dense model).
    pub fn experts_in_vram(&self) -> (usize, usize) {
        lock(&self.experts)
            .as_ref()
            .map_or((0, 0), |c| (c.experts_resident(), c.experts_total()))
    }

    /// Adds the routings since the last save to the expert profile beside the model and writes it.
    pub fn save_expert_profile(&self) -> std::io::Result<()> {
        match lock(&self.experts).as_mut() {
            Some(c) => c.save_profile(),
            None => Ok(()),
        }
    }

    /// `cuda:N <name>`, as READY says it.
    pub fn describe(&self) -> String {
        format!("cuda:{} {}", self.dev.ordinal(), self.dev.name())
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Bytes of weights on the card (dense weights and the expert cache's slots).
    pub fn weight_bytes(&self) -> usize {
        self.weights.bytes() + lock(&self.experts).as_ref().map_or(0, |c| c.device_bytes())
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
        // One token through a decode graph: a whole one when every routed expert is on the card, else
        // (the cache's copies and the CPU's share need the host in the middle of each MoE layer) one cut
        // into segments at those points.
        if tokens.len() == 1
            && logits == Logits::Last
            && self.graphs
            && (self.segments || self.experts_all_on_card())
        {
            return self.eval_decode(graph, cpu, state, tokens);
        }
        // The KV rows first, then a call larger than the warm-up's borrows its scratch from the expert
        // cache (the first one not larger gives it back).
        self.fit_kv(cpu, state, tokens.len()).map_err(cuda_err)?;
        if self.warm.get().is_some_and(|w| tokens.len() > w.tokens) {
            self.lend_scratch(cpu, tokens.len()).map_err(cuda_err)?;
        } else {
            self.take_back(cpu).map_err(cuda_err)?;
        }
        // A call the card has no memory for leaves the host state as it was: free the kept scratch,
        // then give up expert slots, and try again.
        for attempt in 0.. {
            match self.call_inner(cpu, state, tokens, logits, |c| (graph.forward(c), ())) {
                Ok((l, ())) => return Ok(l),
                Err(e) if is_out_of_memory(&e) && attempt < 3 => {
                    eprintln!(
                        "poly-engine: out of VRAM in a call ({e}); freeing memory and retrying"
                    );
                    self.free_memory(cpu, attempt).map_err(cuda_err)?;
                }
                Err(e) => return Err(cuda_err(e)),
            }
        }
        unreachable!("the loop returns")
    }

    /// Whether a token computes every routed expert on the card without the host: all in VRAM, read
    /// from the mapped file, or the model has none.
    fn experts_all_on_card(&self) -> bool {
        lock(&self.experts)
            .as_ref()
            .is_none_or(|c| c.decode_on_card())
    }

    /// Frees VRAM after a call ran out of it: the kept scratch buffers first, then (`attempt` ≥ 1) a
    /// quarter of the expert cache's slots.
    fn free_memory(&self, cpu: &CpuWeights, attempt: usize) -> CudaResult<()> {
        let emptied = lock(&self.pool).emptied();
        *lock(&self.pool) = emptied;
        {
            // Copies of the card's state that host states still point to go to host memory first.
            let mut seq = lock(&self.seq);
            if let Some(s) = seq.as_mut() {
                s.settle_all(&self.dev, false)?;
            }
            *seq = None;
        }
        if attempt >= 1 {
            if let Some(cache) = lock(&self.experts).as_mut() {
                cache.shrink(&self.dev, cpu, 4)?;
            }
        }
        self.dev.synchronize()
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
        self.take_back(cpu).map_err(cuda_err)?;
        let mut phases = CallPhases::default();
        let clock = Instant::now();
        // One-token calls overlap their kernels' launches (`--gpu-pdl`); a decode graph captured here
        // keeps the overlap in its edges.
        self.dev.set_launch_rows(tokens.len());
        let mut seq_slot = lock(&self.seq);
        let kv_rows = self
            .kv_room(cpu, &mut seq_slot, state, 1)
            .map_err(cuda_err)?;
        let seq = DeviceSeq::follow(&self.dev, &mut seq_slot, state, kv_rows).map_err(cuda_err)?;
        // `--cache-bias`: the token's routers read the residency as it is now, after the KV rows took
        // what slots they needed (a graph's replay too).
        if let Some(cache) = lock(&self.experts).as_mut() {
            cache.refresh_bias(&self.dev).map_err(cuda_err)?;
        }
        let pos0 = state.n_past();
        let rows = forward::decode_kv_rows(pos0 + 1, seq.rows());
        {
            // A whole graph holds only while every routed expert is on the card; a segmented one always
            // computes right, and gives way to a whole one once the cache holds every expert.
            let experts = lock(&self.experts);
            let on_card = experts.as_ref().is_none_or(|c| c.decode_on_card());
            let holds_all = experts.as_ref().is_none_or(|c| c.holds_all());
            if !on_card {
                seq.graphs.keep_kind(true);
            } else if holds_all {
                seq.graphs.keep_kind(false);
            }
        }
        // The call writes KV row `pos0` and the recurrent states: what copies of the card's state others
        // may read hold there goes to host memory first; the caller's own recurrent states too when the
        // call builds a graph (it allocates, so it may fail half way with them half advanced; KV rows
        // are rescued on failure instead).
        let keep_own = !state.has_recurrent() || seq.graphs.has(rows);
        seq.protect(
            &self.dev,
            pos0..pos0 + 1,
            true,
            state.deferred().filter(|_| keep_own),
        )
        .map_err(cuda_err)?;
        phases.follow = clock.elapsed();
        let clock = Instant::now();
        let mut marks = self.profile.as_ref().and_then(|p| p.begin(&self.dev));
        let result = if seq.graphs.has(rows) {
            let mut experts = lock(&self.experts);
            let queued = decode_graph::replay(
                (&self.dev, cpu),
                &mut seq.graphs,
                rows,
                (tokens[0], pos0),
                experts.as_mut(),
            );
            phases.queue = clock.elapsed();
            if let Some(m) = marks.as_mut() {
                m.end(&self.dev);
            }
            if let (Ok(false), Some(cache)) = (&queued, experts.as_mut()) {
                // A whole graph's routings: all from VRAM (a segmented one's were counted at its host
                // points).
                let n = self.routings_per_token.load(Ordering::Relaxed);
                cache.count_all_vram(n as usize);
            }
            drop(experts);
            if let Some(p) = &self.profile {
                if let Some(t) = seq.graphs.take_host_times(rows) {
                    p.add_host_points(&t);
                }
            }
            queued.and_then(|_| decode_graph::logits(&self.dev, &mut seq.graphs, rows))
        } else if seq.graphs.failed() {
            drop(seq_slot);
            return self
                .call(cpu, state, tokens, Logits::Last, |c| (graph.forward(c), ()))
                .map(|(l, ())| l);
        } else {
            let mut experts = lock(&self.experts);
            let routed_before = experts.as_ref().map(|c| c.stats().routed);
            let backing = forward::Backing {
                dev: &self.dev,
                weights: &self.weights,
                cpu,
                seq,
                pool: Pool::new(PoolStore::default()),
                experts: experts.as_mut(),
            };
            let result = decode_graph::run_and_capture(backing, graph, rows, tokens, pos0);
            if let (Some(before), Some(c)) = (routed_before, experts.as_ref()) {
                let per_token = c.stats().routed.saturating_sub(before);
                self.routings_per_token.store(per_token, Ordering::Relaxed);
            }
            drop(experts);
            if result.is_ok() {
                self.keep_budget(cpu, 1, pos0);
            }
            result
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
                if let Some(s) = seq_slot.as_mut() {
                    s.rescue(&self.dev);
                }
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
            s.push_tokens(tokens);
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
        self.call_inner(cpu, state, tokens, logits, run)
            .map_err(cuda_err)
    }

    fn call_inner<R>(
        &self,
        cpu: &CpuWeights,
        state: &mut SeqState,
        tokens: &[u32],
        logits: Logits,
        run: impl FnOnce(&mut GpuForward<'_>) -> (forward::DevAct, R),
    ) -> Result<(Vec<f32>, R), CudaError> {
        let mut phases = CallPhases::default();
        let clock = Instant::now();
        // The launches of a call of `tokens.len()` rows (`--gpu-pdl` decides whether they overlap).
        self.dev.set_launch_rows(tokens.len());
        let mut seq_slot = lock(&self.seq);
        let kv_rows = self.kv_room(cpu, &mut seq_slot, state, tokens.len())?;
        let seq = DeviceSeq::follow(&self.dev, &mut seq_slot, state, kv_rows)?;
        // `--cache-bias`: a single token's routers read the residency as it is now, after the KV rows
        // took what slots they needed.
        if let (1, Some(cache)) = (tokens.len(), lock(&self.experts).as_mut()) {
            cache.refresh_bias(&self.dev)?;
        }
        // The call writes KV rows `pos0..pos0 + n` and the recurrent states: what copies of the card's
        // state others may read hold there goes to host memory first. A prompt call may fail half way
        // (out of memory) with recurrent states half advanced: the caller's own recurrent states are
        // saved first too (KV rows are rescued on failure instead).
        let keep_own = !(state.has_recurrent() && tokens.len() > 1);
        let pos0 = state.n_past();
        seq.protect(
            &self.dev,
            pos0..pos0 + tokens.len(),
            true,
            state.deferred().filter(|_| keep_own),
        )?;
        phases.follow = clock.elapsed();
        let clock = Instant::now();
        let marks = self.profile.as_ref().and_then(|p| p.begin(&self.dev));
        let pool = Pool::new(std::mem::take(&mut *lock(&self.pool)));
        let mut marks_out = None;
        let mut experts = lock(&self.experts);
        let result = GpuForward::new(
            &self.dev,
            &self.weights,
            cpu,
            seq,
            pool.clone(),
            tokens,
            pos0,
            logits,
        )
        .and_then(|c| {
            let mut c = c.with_expert_cache(experts.as_mut());
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
        });
        drop(experts);
        if let Some(store) = Pool::into_store(pool) {
            *lock(&self.pool) = store;
        }
        if tokens.len() > 1 && result.is_ok() {
            self.keep_budget(cpu, tokens.len(), pos0);
        }
        let (logits, extra) = match result {
            Ok(l) => l,
            Err(e) => {
                // The card's state is in doubt: upload the host's next time. The host's is unchanged
                // (its copy on the card saved first where that is safe).
                if let Some(s) = seq_slot.as_mut() {
                    s.rescue(&self.dev);
                }
                *seq_slot = None;
                return Err(e);
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

impl GpuBackend {
    /// After a prompt call or a decode graph's capture (where the card's memory grows: scratch of
    /// another size, attention over a longer context, a graph's nodes): when less than the reserve is
    /// free, the expert cache gives up the excess (and a margin) so the budget holds whatever else grew;
    /// another program's use of the card counts the same. Logs the memory in use when it is the highest
    /// seen (stderr), so a budget's excess can be traced call by call (nvidia-smi sees the same figure).
    /// Bytes the scratch store may still make before its cap: free memory that a call's scratch will
    /// take (a long call's loan counted it), so room for KV rows must not count it.
    fn scratch_headroom(&self) -> usize {
        let pool = lock(&self.pool);
        pool.cap().map_or(0, |cap| cap.saturating_sub(pool.bytes()))
    }

    fn keep_budget(&self, cpu: &CpuWeights, n_tokens: usize, pos0: usize) {
        /// Given up beyond the excess, so the next growth does not shrink the cache again at once.
        const MARGIN: usize = 96 << 20;
        let Ok((free, total)) = self.dev.memory_info() else {
            return;
        };
        let used = total.saturating_sub(free);
        let before = self
            .vram_high
            .fetch_max(used, std::sync::atomic::Ordering::Relaxed);
        if used > before {
            eprintln!(
                "vram: {} MiB in use on the card after a call of {n_tokens} tokens at position {pos0} \
                 (scratch kept {} MiB)",
                used >> 20,
                lock(&self.pool).bytes() >> 20
            );
        }
        let Some(&reserve) = self.reserve.get().filter(|&&r| free < r) else {
            return;
        };
        let excess = reserve - free + MARGIN;
        if let Some(cache) = lock(&self.experts).as_mut() {
            let n = excess.div_ceil(cache.slot_bytes().max(1));
            match cache.give_up(&self.dev, cpu, n) {
                Ok(n) => eprintln!(
                    "expert cache: gave up {n} experts ({} MiB) to keep {} MiB free; {} in VRAM",
                    (n * cache.slot_bytes()) >> 20,
                    reserve >> 20,
                    cache.experts_resident()
                ),
                Err(e) => eprintln!("expert cache: could not give up experts ({e})"),
            }
        }
    }
}

fn is_out_of_memory(e: &CudaError) -> bool {
    e.is_out_of_memory()
}

/// Whether `graph` names layers the way `state` has them (a guard before the card's state is built).
pub fn layers_match(graph: &ModelGraph, state: &SeqState) -> bool {
    graph.layer_states().len() == state.n_layers()
}
