//! The VRAM expert cache (issue 8): which routed experts live on the card, and how a forward call gets
//! the others.
//!
//! - [`layout`]: the file's expert tensors per MoE layer and where an expert's three matrices lie in a slot.
//! - [`policy`]: the bookkeeping (initial set, admission, victims by recency and frequency); no device.
//! - [`profile`]: the routing counts saved beside the model, bound to its file.
//! - [`placement`]: how much VRAM the cache gets (`--vram-reserve-mib`, `--expert-budget-mib`).
//! - [`skip`] and [`bias`]: the approximate modes of issue 23, off by default (a single token's uncached
//!   experts left out; its routing leaned to the cached experts).
//! - this module: the device side. One [`SlotPool`] holds the cached experts; each layer's three
//!   [`ExpertTable`]s point at its resident experts and are null elsewhere (the kernels give zeros there).
//!   A second pool of one layer's worth of *scratch* slots receives a prompt call's uncached experts
//!   through two pinned [`StagingBuffer`]s on a [`CopyStream`]: the host fills one while the other is
//!   copied, the compute stream waits for the copies, the tables point at the scratch slots for that
//!   layer's launches and back after. For a single token the uncached experts are split two ways by
//!   measured cost ([`split_missing`]): some are copied to scratch slots on demand (straight from the
//!   page-locked file, as Krasis does) and computed by the card with the cached ones, the rest are
//!   computed on the CPU ([`CpuShare`]) meanwhile; and the policy may admit a few of them (uploads on the
//!   copy stream; a slot's entry switched only after its copy completed).

pub mod bias;
mod bus_later;
pub mod layout;
pub mod placement;
pub mod policy;
mod prefetch;
pub mod profile;
mod prompt_share;
mod resize;
pub mod skip;
mod split;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use poly_kernels::cuda::expert_slots::{
    CopyEvent, CopyStream, ExpertSource, HostRegistration, SlotPool, SlotRef, StagingBuffer,
};
use poly_kernels::cuda::{CudaError, CudaResult, Device, ExpertTable, HostFlags};
use poly_kernels::hot_pool::HotPool;
use poly_models::compute::WeightId;

use crate::cpu::CpuWeights;
use layout::ExpertLayer;
pub use placement::{Admissions, MissingExperts};
pub use policy::AdmissionRule;
use policy::{CachePolicy, ExpertKey, PolicyStats};
use profile::ExpertProfile;

/// Where an upload goes.
#[derive(Clone, Copy, Debug)]
enum Dest {
    /// The cache's pool.
    Cache,
    /// Scratch pool `i`.
    Scratch(usize),
}

/// The layer whose experts sit in scratch slots: its `(expert, scratch slot)` pairs in scratch pool
/// `pool` from slot `base` on, and whether its tables point there (a prompt call's; a single token of a
/// segmented graph reads its step's own table instead, [`ExpertCache::token_sources`]).
struct Staged {
    layer: usize,
    pool: usize,
    base: usize,
    map: Vec<(usize, usize)>,
    repointed: bool,
}

/// An upload whose copy is in flight.
struct Pending {
    slot: usize,
    key: ExpertKey,
    done: CopyEvent,
}

/// Figures for DONE and STATS.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CacheStats {
    /// Bytes of the cache's slots.
    pub bytes: usize,
    pub policy: PolicyStats,
    /// Routings of all calls so far, and those whose expert was in VRAM.
    pub routed: u64,
    pub routed_vram: u64,
    /// Experts copied to scratch slots for prompt calls.
    pub staged: u64,
    /// Of those, copied ahead into the second scratch pool while the card computed the layer before.
    pub prefetched: u64,
    /// Single tokens' experts guessed for the next layer and copied ahead (`--copy-ahead`), and of
    /// those, the ones the layer then routed to (computed on the card from their scratch slots).
    pub ahead_copied: u64,
    pub ahead_routed: u64,
    /// Single tokens' uncached experts left out (`--tail-skip`, `--skip-weight`, `--cold-mass`).
    pub skipped: skip::Skipped,
    /// Single tokens' routed choices that `--cache-bias` made (cached experts in place of uncached ones).
    pub swapped: bias::Swapped,
    /// Expert products the CPU computed for single tokens, and the wall seconds it took (the card
    /// computing its share meanwhile).
    pub cpu_experts: u64,
    pub cpu_seconds: f64,
    /// Uncached experts of single tokens copied to scratch slots on demand and computed by the card.
    pub staged_decode: u64,
    /// Admissions made from a scratch slot by a copy on the card (of the policy's uploads; the others
    /// went over the bus).
    pub admitted_on_card: u64,
    /// The measured costs that split them ([`MissingCosts`]), microseconds: per call on the CPU, and per
    /// expert each way.
    pub cpu_us_overhead: f64,
    pub cpu_us_per_expert: f64,
    pub copy_us_per_expert: f64,
    /// The card's measured wait at a single token's staged flag, µs: before any copy on demand, and per
    /// copy (a line fitted over the last ~50 MoE steps; 0 and 0 until the steps vary enough).
    pub card_wait_us_base: f64,
    pub card_wait_us_per_copy: f64,
    /// The measured skew of the routing: the share of the routings counted that went to each layer's
    /// most-routed tenth of its experts (0.1 for perfectly even routing; 0 before any).
    pub route_top10_share: f64,
}

/// The measured skew's definition, shared with the CPU backend's counts.
pub use crate::cpu::moe::top_tenth_share;
use split::{fetch_inputs, share_pool, soonest, CostFit, CpuProbe};
pub use split::{split_missing, CpuShare, MissingCosts, StepPrep};

/// The cache of one backend.
pub struct ExpertCache {
    layers: Vec<ExpertLayer>,
    /// A layer's index by its gate tensor.
    by_gate: HashMap<u32, usize>,
    /// `[layer]`: gate, up, down tables.
    tables: Vec<[ExpertTable; 3]>,
    slot_bytes: usize,
    pool: Option<SlotPool>,
    /// One layer's experts each: a prompt call's uncached experts, for that layer's launches. A second
    /// pool is allocated at the first large prompt call, so the next layer's experts are copied into one
    /// while the card computes this layer's from the other ([`prefetch`]).
    scratch: Vec<SlotPool>,
    staging: [StagingBuffer; 2],
    next_staging: usize,
    /// `[part]`: the model file's mapping page-locked, when that worked: experts are copied straight
    /// from it, without going through the staging buffers.
    registered: Vec<Option<HostRegistration>>,
    copy: CopyStream,
    policy: CachePolicy,
    pending: Vec<Pending>,
    /// Uploads the policy may start per layer and token (0: the cache is frozen).
    uploads_per_layer: usize,
    /// When a missing expert replaces a resident one (kept across refills).
    rule: AdmissionRule,
    /// Which missing experts those uploads take.
    admissions: Admissions,
    /// The layer whose tables point at scratch slots until [`ExpertCache::finish_layer`].
    staged: Option<Staged>,
    /// A layer's uncached experts being copied into a scratch pool ahead of its launches, and the
    /// plan for the next one ([`prefetch`]).
    prefetch: Option<prefetch::Prefetched>,
    prefetch_plan: Option<prefetch::Plan>,
    /// The cache was sized ([`ExpertCache::fill`]): no scratch is allocated from here on.
    filled: bool,
    stats: CacheStats,
    profile: Option<(PathBuf, ExpertProfile)>,
    /// Where a single token's missing experts are computed.
    missing: MissingExperts,
    /// Which of them a token may leave out (off: none).
    skip: skip::MissingSkip,
    /// `--cache-bias`: the vectors single tokens' routers read, and whether every layer's must be written
    /// before the next token (set, or a write failed).
    bias: bias::DeviceBias,
    bias_stale: bool,
    costs: MissingCosts,
    cpu_fit: CostFit,
    /// The card's waits at single tokens' staged flags against their copies on demand.
    card_wait_fit: CostFit,
    cpu_probe: CpuProbe,
    /// `[layer][matrix][expert]`: the card's address of each expert matrix in the page-locked file
    /// (empty when the file is not page-locked whole), for [`MissingExperts::Mapped`].
    mapped: Vec<[Vec<u64>; 3]>,
    /// The host's time in copies on demand, admissions and table rewrites since [`ExpertCache::take_host_phases`].
    host_phases: HostPhases,
    /// A single token's admission (its layer, routed experts and the CPU's experts, likeliest first),
    /// started at [`ExpertCache::finish_layer`]: the uploads are for later tokens, so their host work
    /// (choosing victims, queueing copies, clearing table entries) overlaps the card's experts instead of
    /// delaying them.
    admission: Option<(usize, Vec<usize>, Vec<usize>)>,
    /// Layers whose tables [`ExpertCache::prepare`] changed and rewrites once, at its end (or before the
    /// copy stream waits for the compute stream, when a victim's entry must be cleared first).
    dirty: Vec<usize>,
    /// Table rewrites wait for the next reader of the layers' tables: single tokens of segmented graphs
    /// ([`ExpertCache::prepare_step`]) read their steps' own tables, so between them the layers' tables
    /// are only marked, and a prompt call, an eager token or a whole-token graph flushes them first
    /// ([`ExpertCache::flush_deferred`]).
    defer_tables: bool,
    /// A one-graph token's host points are under way ([`ExpertCache::set_linked`]).
    linked: bool,
    /// `--bus-admissions-at ahead`: admissions over the bus planned at a layer's finish whose copies wait
    /// to be queued ([`ExpertCache::queue_bus_admissions`]); `None` queues them at once.
    bus_later: Option<Vec<policy::Upload>>,
    /// The copy stream could not set a flag (no stream memory operations): the host waits and sets it.
    host_sets_flags: bool,
    /// The threads of single tokens' CPU shares, once one was computed.
    cpu_pool: Option<Arc<HotPool>>,
    /// `[layer][expert]` routings counted since the cache was filled, for the measured skew.
    routed_counts: Vec<Vec<u64>>,
}

/// The host's time in parts of a single token's [`ExpertCache::prepare`].
#[derive(Clone, Copy, Debug, Default)]
pub struct HostPhases {
    /// Queueing the copies on demand ([`ExpertCache::stage`], tables included).
    pub stage: std::time::Duration,
    /// Choosing and starting uploads.
    pub admit: std::time::Duration,
    /// Rewriting tables ([`ExpertCache::point_tables`], wherever called).
    pub tables: std::time::Duration,
}

impl ExpertCache {
    /// A cache of no slots over `layers` of `cpu`'s file (every table null), with its scratch, staging
    /// and copy stream; with `register`, the file's mapping is page-locked for direct copies unless it is
    /// larger than half the host's memory.
    pub fn new(
        dev: &Device,
        cpu: &CpuWeights,
        layers: Vec<ExpertLayer>,
        register: bool,
    ) -> CudaResult<ExpertCache> {
        let slot_bytes = layout::slot_bytes(&layers);
        let max_experts = layers.iter().map(|l| l.n_expert).max().unwrap_or(0);
        if slot_bytes == 0 || max_experts == 0 {
            return Err(CudaError::Invalid("an expert cache without experts".into()));
        }
        let mut tables = Vec::with_capacity(layers.len());
        for l in &layers {
            // One address array for the layer's three tables: a repoint is one copy.
            let spec = |i: usize| (l.mats[i].ty, l.mats[i].rows, l.mats[i].cols);
            tables.push(ExpertTable::empty_group(
                dev,
                [spec(0), spec(1), spec(2)],
                l.n_expert,
            )?);
        }
        let by_gate = layers
            .iter()
            .enumerate()
            .map(|(i, l)| (l.mats[0].weight.0, i))
            .collect();
        let counts: Vec<usize> = layers.iter().map(|l| l.n_expert).collect();
        let registered = if register {
            register_file(dev, cpu)
        } else {
            Vec::new()
        };
        let mapped = mapped_addresses(cpu, &layers, &registered).unwrap_or_default();
        Ok(ExpertCache {
            by_gate,
            tables,
            slot_bytes,
            pool: None,
            scratch: vec![SlotPool::alloc(dev, slot_bytes, max_experts)?],
            staging: [
                StagingBuffer::new(dev, slot_bytes)?,
                StagingBuffer::new(dev, slot_bytes)?,
            ],
            next_staging: 0,
            registered,
            copy: CopyStream::new(dev)?,
            policy: CachePolicy::new(&counts, 0),
            pending: Vec::new(),
            uploads_per_layer: 0,
            rule: AdmissionRule::default(),
            admissions: Admissions::All,
            staged: None,
            prefetch: None,
            prefetch_plan: None,
            filled: false,
            stats: CacheStats::default(),
            profile: None,
            missing: MissingExperts::default(),
            skip: skip::MissingSkip::default(),
            bias: bias::DeviceBias::default(),
            bias_stale: false,
            costs: MissingCosts::guess(slot_bytes),
            cpu_fit: CostFit::default(),
            card_wait_fit: CostFit::default(),
            cpu_probe: CpuProbe::default(),
            mapped,
            layers,
            host_phases: HostPhases::default(),
            admission: None,
            dirty: Vec::new(),
            defer_tables: false,
            linked: false,
            bus_later: None,
            host_sets_flags: false,
            cpu_pool: None,
            routed_counts: counts.iter().map(|&n| vec![0; n]).collect(),
        })
    }

    /// The MoE layers.
    pub fn layers(&self) -> &[ExpertLayer] {
        &self.layers
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Whether experts are copied straight from the page-locked file mapping (else through staging).
    pub fn direct_copies(&self) -> bool {
        self.registered.iter().any(Option::is_some)
    }

    /// Bytes of the cache's slots and the scratch slots and staging buffers.
    pub fn device_bytes(&self) -> usize {
        self.pool.as_ref().map_or(0, SlotPool::bytes)
            + self.scratch.iter().map(SlotPool::bytes).sum::<usize>()
    }

    /// Experts over all layers.
    pub fn experts_total(&self) -> usize {
        self.layers.iter().map(|l| l.n_expert).sum()
    }

    /// Experts resident now.
    pub fn experts_resident(&self) -> usize {
        self.policy
            .stats()
            .occupied
            .saturating_sub(self.pending.len())
    }

    /// Whether `w` is an expert tensor the cache handles.
    pub fn covers(&self, w: WeightId) -> bool {
        self.layers.iter().any(|l| l.has(w))
    }

    /// The cache's layer of the MoE block whose gate experts are `gate`.
    pub fn layer_of(&self, gate: WeightId) -> Option<usize> {
        self.by_gate.get(&gate.0).copied()
    }

    /// Gate, up and down tables of `layer`.
    pub fn tables(&self, layer: usize) -> CudaResult<&[ExpertTable; 3]> {
        self.tables
            .get(layer)
            .ok_or_else(|| CudaError::Invalid(format!("no expert layer {layer}")))
    }

    /// Whether every expert is in VRAM (no call needs host routing).
    pub fn holds_all(&self) -> bool {
        self.pending.is_empty() && self.policy.holds_all()
    }

    /// The measured costs of a single token's missing expert, each way.
    pub fn missing_costs(&self) -> MissingCosts {
        self.costs
    }

    /// Where a single token's missing experts are computed (tables pointed again: mapped entries).
    pub fn set_missing_experts(&mut self, dev: &Device, missing: MissingExperts) -> CudaResult<()> {
        self.missing = missing;
        for l in 0..self.layers.len() {
            self.point_tables(dev, l)?;
        }
        Ok(())
    }

    /// Which of a single token's uncached experts it may leave out (`--tail-skip`, `--skip-weight`).
    pub fn set_skip(&mut self, skip: skip::MissingSkip) {
        self.skip = skip;
    }

    /// Whether the card reads the experts it lacks from the mapped file (`MissingExperts::Mapped`).
    pub fn reads_mapped(&self) -> bool {
        self.missing == MissingExperts::Mapped && !self.mapped.is_empty()
    }

    /// Whether a single token computes every routed expert on the card without the host: all of them in
    /// VRAM, or the missing ones read from the mapped file (a decode graph may then run the token).
    pub fn decode_on_card(&self) -> bool {
        self.holds_all() || (self.reads_mapped() && self.pending.is_empty())
    }

    /// How the cache follows the answer: the uploads the policy may start per layer and token (0
    /// freezes the cache), which missing experts they take, and when one replaces a resident expert.
    pub fn set_following(&mut self, n: usize, admissions: Admissions, rule: AdmissionRule) {
        self.uploads_per_layer = n;
        self.admissions = admissions;
        self.rule = rule;
        self.policy.set_rule(rule);
    }

    /// The profile to add routings to (and save at `path`).
    pub fn set_profile(&mut self, path: PathBuf, profile: ExpertProfile) {
        self.profile = Some((path, profile));
    }

    /// The counters.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            bytes: self.pool.as_ref().map_or(0, SlotPool::bytes),
            policy: self.policy.stats(),
            cpu_us_overhead: self.costs.cpu_overhead * 1e6,
            cpu_us_per_expert: self.costs.cpu_per_expert * 1e6,
            copy_us_per_expert: self.costs.copy_per_expert * 1e6,
            card_wait_us_base: self
                .card_wait_fit
                .fitted_line()
                .map_or(0.0, |(a, _)| a * 1e6),
            card_wait_us_per_copy: self
                .card_wait_fit
                .fitted_line()
                .map_or(0.0, |(_, b)| b * 1e6),
            route_top10_share: top_tenth_share(&self.routed_counts),
            ..self.stats
        }
    }

    /// The host's time in parts of single tokens' `prepare` since the last take.
    pub fn take_host_phases(&mut self) -> HostPhases {
        std::mem::take(&mut self.host_phases)
    }

    /// Counts `n` routings served from VRAM without looking at them (a cache that holds everything).
    pub fn count_all_vram(&mut self, n: usize) {
        self.stats.routed += n as u64;
        self.stats.routed_vram += n as u64;
    }

    /// The routings counted since the last call (`[layer][expert]`).
    pub fn take_counts(&mut self) -> Vec<Vec<u64>> {
        self.policy.take_counts()
    }

    /// Gives the cache `n_slots` slots (dropping what it held; `n_slots` 0: none) and fills them with the
    /// experts of the highest `counts` (`[layer][expert]`). Copies complete before it returns.
    pub fn fill(
        &mut self,
        dev: &Device,
        cpu: &CpuWeights,
        n_slots: usize,
        counts: &[Vec<u64>],
    ) -> CudaResult<()> {
        self.quiesce(dev)?;
        self.pool = None;
        let sizes: Vec<usize> = self.layers.iter().map(|l| l.n_expert).collect();
        self.policy = CachePolicy::new(&sizes, 0);
        self.policy.set_rule(self.rule);
        let total: usize = sizes.iter().sum();
        // An allocation that fails gives fewer slots, not an error.
        let chunk = resize::chunk_slots(total);
        let pool = resize::alloc_fewer(dev, (self.slot_bytes, chunk), n_slots.min(total))?;
        let want = pool.as_ref().map_or(0, SlotPool::n_slots);
        self.policy = CachePolicy::new(&sizes, want);
        self.policy.set_rule(self.rule);
        self.pool = pool;
        // The figures count from here (not the warm-up read's routings).
        self.stats = CacheStats::default();
        self.routed_counts.iter_mut().for_each(|c| c.fill(0));
        let set = self.policy.initial_set(counts);
        let clock = std::time::Instant::now();
        for (slot, key) in set.iter().enumerate() {
            self.upload(cpu, *key, slot, Dest::Cache)?;
        }
        self.copy.synchronize()?;
        // The copy rate, measured on a bulk copy large enough to mean something.
        if set.len() >= 32 && self.direct_copies() {
            self.costs.copy_per_expert = clock.elapsed().as_secs_f64() / set.len() as f64;
        }
        for (slot, key) in set.into_iter().enumerate() {
            self.policy.place(slot, key);
        }
        for l in 0..self.layers.len() {
            self.point_tables(dev, l)?;
        }
        dev.synchronize()
    }

    /// Gives up `1/fraction` of the slots (at least one), keeping the experts of the highest scores
    /// (resized in place: [`ExpertCache::set_slots_ranked`]; copies complete before it returns).
    pub fn shrink(&mut self, dev: &Device, cpu: &CpuWeights, fraction: usize) -> CudaResult<()> {
        let n = self.policy.n_slots();
        self.give_up(dev, cpu, (n / fraction.max(1)).max(1))
            .map(drop)
    }

    /// Gives up at least `n_slots` slots (all it has at most; more where the pool's allocations end past
    /// the count: [`ExpertCache::set_slots_ranked`]), keeping the experts of the highest scores, as
    /// [`ExpertCache::shrink`]. Returns how many it gave up.
    pub fn give_up(&mut self, dev: &Device, cpu: &CpuWeights, n_slots: usize) -> CudaResult<usize> {
        let n = self.policy.n_slots();
        if n == 0 || n_slots == 0 {
            return Ok(0);
        }
        self.set_slots(dev, cpu, n.saturating_sub(n_slots))?;
        Ok(n - self.policy.n_slots())
    }

    /// Slots of the cache now.
    pub fn n_slots(&self) -> usize {
        self.policy.n_slots()
    }

    /// Resizes the cache to `n_slots` slots (fewer or more: slots taken back after a long prompt's
    /// scratch was lent) holding the experts of the highest scores ([`ExpertCache::set_slots_ranked`]).
    pub fn set_slots(&mut self, dev: &Device, cpu: &CpuWeights, n_slots: usize) -> CudaResult<()> {
        let ranking = self.ranking();
        self.set_slots_ranked(dev, cpu, n_slots, &ranking)
    }

    /// The experts' scores now, as counts (`[layer][expert]`): what [`ExpertCache::set_slots`] ranks by.
    pub fn ranking(&self) -> Vec<Vec<u64>> {
        self.policy.score_counts()
    }

    /// [`ExpertCache::ranking`] with every resident expert ranked above every other (by its score
    /// among them): a fill of as many slots as now by it puts back the experts the cache holds now.
    pub fn resident_first_ranking(&self) -> Vec<Vec<u64>> {
        const RESIDENT: u64 = 1 << 62;
        let mut ranking = self.ranking();
        for (layer, row) in ranking.iter_mut().enumerate() {
            for (expert, score) in row.iter_mut().enumerate() {
                if self.policy.resident(ExpertKey { layer, expert }).is_some() {
                    *score = (*score).min(RESIDENT - 1) + RESIDENT;
                }
            }
        }
        ranking
    }

    /// Copies expert `key`'s three matrices from the mapped file into `slot` of the cache's pool or of
    /// a scratch pool (straight from the page-locked file, else through the next staging buffer).
    fn upload(
        &mut self,
        cpu: &CpuWeights,
        key: ExpertKey,
        slot: usize,
        to: Dest,
    ) -> CudaResult<()> {
        let layer = &self.layers[key.layer];
        let pool = match to {
            Dest::Cache => self
                .pool
                .as_ref()
                .ok_or_else(|| CudaError::Invalid("an upload into a cache of no slots".into()))?,
            Dest::Scratch(i) => self
                .scratch
                .get(i)
                .ok_or_else(|| CudaError::Invalid(format!("no scratch pool {i}")))?,
        };
        let part = cpu.info(layer.mats[0].weight).part;
        let direct = layer.mats.iter().all(|m| cpu.info(m.weight).part == part);
        if let (true, Some(Some(reg))) = (direct, self.registered.get(part)) {
            for m in &layer.mats {
                let src = &cpu.bytes(m.weight)[key.expert * m.bytes..][..m.bytes];
                let dst = SlotRef {
                    pool,
                    slot,
                    offset: m.offset,
                };
                self.copy.copy_from_host(reg, src, dst)?;
            }
            return Ok(());
        }
        let i = self.next_staging;
        self.next_staging = (i + 1) % self.staging.len();
        let buf = &mut self.staging[i];
        let host = buf.fill()?;
        let mut end = 0;
        for m in &layer.mats {
            let src = &cpu.bytes(m.weight)[key.expert * m.bytes..][..m.bytes];
            host[m.offset..m.offset + m.bytes].copy_from_slice(src);
            end = m.offset + m.bytes;
        }
        self.copy.copy(
            buf,
            end,
            SlotRef {
                pool,
                slot,
                offset: 0,
            },
        )
    }

    /// Points `layer`'s tables at its resident experts, and at scratch slots for the experts staged for
    /// it (while it is the staged layer); null elsewhere. Queued on the compute stream.
    fn point_tables(&mut self, dev: &Device, layer: usize) -> CudaResult<()> {
        let clock = std::time::Instant::now();
        let r = self.point_tables_now(dev, layer);
        self.host_phases.tables += clock.elapsed();
        r
    }

    fn point_tables_now(&mut self, dev: &Device, layer: usize) -> CudaResult<()> {
        let (staged, scratch): (&[(usize, usize)], &SlotPool) = match &self.staged {
            Some(s) if s.layer == layer => (&s.map, &self.scratch[s.pool]),
            _ => (&[], &self.scratch[0]),
        };
        let l = &self.layers[layer];
        let mapped = self.reads_mapped();
        // Each expert's slot looked up once for the three matrices.
        let resident: Vec<Option<usize>> = (0..l.n_expert)
            .map(|expert| self.policy.resident(ExpertKey { layer, expert }))
            .collect();
        let mut all: Vec<Vec<Option<ExpertSource<'_>>>> = Vec::with_capacity(3);
        for (i, m) in l.mats.iter().enumerate() {
            let mut entries: Vec<Option<ExpertSource<'_>>> = (0..l.n_expert)
                .map(|expert| {
                    let slot = resident[expert];
                    match (slot, self.pool.as_ref()) {
                        (Some(slot), Some(pool)) => Some(ExpertSource::Slot(SlotRef {
                            pool,
                            slot,
                            offset: m.offset,
                        })),
                        _ if mapped => Some(ExpertSource::Mapped(self.mapped[layer][i][expert])),
                        _ => None,
                    }
                })
                .collect();
            for &(expert, slot) in staged {
                entries[expert] = Some(ExpertSource::Slot(SlotRef {
                    pool: scratch,
                    slot,
                    offset: m.offset,
                }));
            }
            all.push(entries);
        }
        ExpertTable::point_group(dev, &mut self.tables[layer], &all)
    }

    /// Makes visible the uploads into `layer` whose copies completed.
    fn commit(&mut self, dev: &Device, layer: usize) -> CudaResult<()> {
        let mut any = false;
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].key.layer == layer && self.pending[i].done.is_complete() {
                let p = self.pending.swap_remove(i);
                dev.wait_for_copy(&p.done)?;
                self.policy.complete(p.slot);
                any = true;
            } else {
                i += 1;
            }
        }
        if any {
            self.mark_tables(layer);
        }
        Ok(())
    }

    /// Marks `layer`'s tables for the next [`ExpertCache::flush_tables`].
    fn mark_tables(&mut self, layer: usize) {
        if !self.dirty.contains(&layer) {
            self.dirty.push(layer);
        }
    }

    /// Whether a one-graph token's host points are under way (`--gpu-host-points flags`): the compute
    /// stream holds the whole token, waiting on flags, so nothing may make it wait for work queued later
    /// nor make the copy stream wait for it; the callers' points are moments when the card reads no
    /// routed expert's slot (between its router and its experts, which wait for the host).
    pub fn set_linked(&mut self, linked: bool) {
        self.linked = linked;
    }

    /// Makes the copies queued from here on wait for everything queued on the compute stream (after a
    /// one-graph token's last host point, before the last layer's admissions).
    pub fn copies_wait_for_compute(&self, dev: &Device) -> CudaResult<()> {
        self.copy.wait_for_compute(dev)
    }

    /// The experts of `layer` (its MoE block `m`) guessed for the one-token input `x` of an earlier
    /// layer that are not on the card: the layer's router's top `k` for `x` ([`crate::cpu::warm`]).
    pub fn guess_missing(
        &mut self,
        cpu: &CpuWeights,
        m: &poly_models::compute::Moe,
        layer: usize,
        x: &[f32],
    ) -> Vec<usize> {
        let Some(pool) = split::share_pool(&mut self.cpu_pool) else {
            return Vec::new();
        };
        // Leaning as the card's choice will (`--cache-bias`), by the vectors last written.
        let bias = self.host_bias(layer);
        let k = m.n_expert_used;
        let mut guess = crate::cpu::warm::likeliest_experts(cpu, m, x, (k, bias), &pool);
        guess.retain(|&expert| self.policy.resident(ExpertKey { layer, expert }).is_none());
        guess
    }

    /// A single token's layer waited `waited` at its staged flag on the card with `copies` experts
    /// copied on demand (read after the token), for the figures ([`CacheStats::card_wait_us_base`]).
    /// The split does not use it: priced by this line instead of the bulk rate it was slower on an
    /// H100 host (q35s 113.5 against 121.5 t/s; the line read 24–53 µs + 55–75 µs a copy, about the
    /// bulk rate).
    pub fn record_card_wait(&mut self, copies: usize, waited: std::time::Duration) {
        self.card_wait_fit.add(copies, waited.as_secs_f64());
    }

    /// Of `experts` (of `layer`), those not on the card, in their order.
    pub fn not_resident(&self, layer: usize, mut experts: Vec<usize>) -> Vec<usize> {
        experts.retain(|&expert| self.policy.resident(ExpertKey { layer, expert }).is_none());
        experts
    }

    /// `beside` (the wait for the card) on this thread while the share's threads read `experts` of `m`
    /// into the host's caches; returns its result and the bytes read.
    pub fn warm_beside<R>(
        &mut self,
        cpu: &CpuWeights,
        m: &poly_models::compute::Moe,
        experts: &[usize],
        beside: impl FnOnce() -> R,
    ) -> (R, usize) {
        match split::share_pool(&mut self.cpu_pool) {
            Some(pool) => crate::cpu::warm::warm_experts_beside(cpu, m, experts, &pool, beside),
            None => (beside(), 0),
        }
    }

    /// Readies the copy stream for `flags` outside any token: its first flag is set and waited for here,
    /// so a driver that refuses stream memory operations is found before a token needs them (the host
    /// then waits for the copies and sets the flags), and nothing the stream does first happens behind
    /// a card spinning at a flag.
    pub fn ready_flags(&mut self, flags: &HostFlags) -> CudaResult<()> {
        match self.copy.set_flag(flags, 0) {
            Ok(()) => self.copy.synchronize(),
            Err(e) => {
                eprintln!("expert cache: the host sets the flags after copies ({e})");
                self.host_sets_flags = true;
                Ok(())
            }
        }
    }

    /// Queues the setting of `flags`' flag `i` on the copy stream, after the copies queued so far. Where
    /// the driver refuses stream memory operations the host waits for the copies and sets it.
    pub fn flag_after_copies(&mut self, flags: &HostFlags, i: usize) -> CudaResult<()> {
        if !self.host_sets_flags {
            match self.copy.set_flag(flags, i) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    eprintln!("expert cache: the host sets the flags after copies ({e})");
                    self.host_sets_flags = true;
                }
            }
        }
        self.copy.synchronize()?;
        flags.set(i)
    }

    /// Rewrites the marked tables (queued on the compute stream).
    fn flush_tables(&mut self, dev: &Device) -> CudaResult<()> {
        while let Some(layer) = self.dirty.pop() {
            self.point_tables(dev, layer)?;
        }
        Ok(())
    }

    /// Before `layer`'s expert launches of a call of `n_tokens` whose routing ids are `ids`
    /// (`[n_tokens, k]`, on the host; `changed`: a single token's choices that `--cache-bias` made, the
    /// router's bits): counts the routings, and makes every routed expert computable:
    /// - a prompt call (`n_tokens > 1`): the uncached ones are staged into scratch slots and the tables
    ///   point there until [`ExpertCache::finish_layer`];
    /// - a single token: returns the uncached routings for the CPU (`fetch` gives the token's activation
    ///   and the routing weights), and starts the uploads the policy admits.
    pub fn prepare(
        &mut self,
        dev: &Device,
        cpu: &CpuWeights,
        (layer, n_tokens): (usize, usize),
        (ids, changed): (&[i32], u32),
        fetch: impl FnOnce() -> CudaResult<(Vec<f32>, Vec<f32>)>,
    ) -> CudaResult<Option<CpuShare>> {
        // This call's launches read the layers' tables.
        self.defer_tables = false;
        let share = self
            .prepare_routing(dev, cpu, (layer, n_tokens, ids, changed), fetch)
            .and_then(|StepPrep { share, copies, .. }| {
                self.stage_copies(dev, cpu, layer, &copies).map(|()| share)
            });
        // The tables it changed, rewritten once before the layer's launches.
        let flushed = self.flush_tables(dev);
        let share = share?;
        flushed.map(|()| share)
    }

    /// [`ExpertCache::prepare`] for one token of a segmented decode graph, whose expert launches read
    /// the step's own table of its `k` routings: their addresses go into `sources` (`[3][k]`: gate, up,
    /// down; [`ExpertCache::token_sources`]) and the layers' tables are not rewritten (only marked, for
    /// their next reader). The caller synchronized with the compute stream after the router and queued
    /// nothing since that reads a scratch slot.
    pub fn prepare_step(
        &mut self,
        (dev, cpu): (&Device, &CpuWeights),
        layer: usize,
        (ids, changed): (&[i32], u32),
        fetch: impl FnOnce() -> CudaResult<(Vec<f32>, Vec<f32>)>,
    ) -> CudaResult<StepPrep> {
        self.defer_tables = true;
        self.prepare_routing(dev, cpu, (layer, 1, ids, changed), fetch)
    }

    /// After [`ExpertCache::prepare_step`]: its copies on demand queued (the compute stream waits for
    /// them) and the token's sources written (`sources` `[3][k]`, [`ExpertCache::token_sources`]). The
    /// CPU's share may run meanwhile: this reads nothing it computes.
    pub fn stage_step(
        &mut self,
        (dev, cpu): (&Device, &CpuWeights),
        (layer, ids): (usize, &[i32]),
        copies: &[usize],
        sources: &mut [u64],
    ) -> CudaResult<()> {
        self.stage_copies(dev, cpu, layer, copies)?;
        let clock = std::time::Instant::now();
        self.token_sources(layer, ids, sources)?;
        self.host_phases.tables += clock.elapsed();
        Ok(())
    }

    /// A single token's copies on demand ([`ExpertCache::prepare_routing`]'s second result) queued.
    fn stage_copies(
        &mut self,
        dev: &Device,
        cpu: &CpuWeights,
        layer: usize,
        copies: &[usize],
    ) -> CudaResult<()> {
        if copies.is_empty() {
            return Ok(());
        }
        let clock = std::time::Instant::now();
        self.stage(dev, cpu, layer, copies)?;
        self.host_phases.stage += clock.elapsed();
        self.stats.staged_decode += copies.len() as u64;
        Ok(())
    }

    /// Where the card reads each of a token's routings `ids` of `layer` (`out` `[3][k]`: the gate, up and
    /// down matrices' addresses): a resident expert's slot, an expert copied for this token in its
    /// scratch slot, the mapped file when the kernels read missing experts there, else 0 (the CPU
    /// computes it; the kernels write zeros for it).
    pub fn token_sources(&self, layer: usize, ids: &[i32], out: &mut [u64]) -> CudaResult<()> {
        let k = ids.len();
        let (l, tables) = match (self.layers.get(layer), self.tables.get(layer)) {
            (Some(l), Some(t)) if out.len() == 3 * k => (l, t),
            _ => {
                return Err(CudaError::Invalid(format!(
                    "{} sources for {k} routings of expert layer {layer}",
                    out.len()
                )))
            }
        };
        let staged = self.staged.as_ref().filter(|s| s.layer == layer);
        let mapped = self.reads_mapped();
        for (j, &id) in ids.iter().enumerate() {
            let expert = id as usize;
            let known = id >= 0 && expert < l.n_expert;
            let slot = known
                .then(|| self.policy.resident(ExpertKey { layer, expert }))
                .flatten();
            let scratch = staged.and_then(|s| {
                let at = s.map.iter().find(|&&(e, _)| e == expert)?;
                Some((&self.scratch[s.pool], at.1))
            });
            for (i, m) in l.mats.iter().enumerate() {
                let source = match (slot, self.pool.as_ref(), scratch) {
                    (Some(slot), Some(pool), _) => Some(ExpertSource::Slot(SlotRef {
                        pool,
                        slot,
                        offset: m.offset,
                    })),
                    (_, _, Some((pool, slot))) => Some(ExpertSource::Slot(SlotRef {
                        pool,
                        slot,
                        offset: m.offset,
                    })),
                    _ if mapped && known => {
                        Some(ExpertSource::Mapped(self.mapped[layer][i][expert]))
                    }
                    _ => None,
                };
                out[i * k + j] = tables[i].source_address(source)?;
            }
        }
        Ok(())
    }

    /// The layers' tables rewritten where single tokens of segmented graphs left them marked: before a
    /// launch that reads them (a whole-token graph's replay, an eager token on a cache that needs no host).
    pub fn flush_deferred(&mut self, dev: &Device) -> CudaResult<()> {
        self.defer_tables = false;
        self.flush_tables(dev)
    }

    /// The routing counted and the cache's choices for it: a prompt call's uncached experts staged and
    /// its CPU share; for a single token the CPU's share and the experts to copy on demand, not yet queued
    /// (the caller queues them, [`ExpertCache::stage_copies`], perhaps while the CPU computes its share).
    fn prepare_routing(
        &mut self,
        dev: &Device,
        cpu: &CpuWeights,
        (layer, n_tokens, ids, changed): (usize, usize, &[i32], u32),
        fetch: impl FnOnce() -> CudaResult<(Vec<f32>, Vec<f32>)>,
    ) -> CudaResult<StepPrep> {
        let n_expert = self.layers[layer].n_expert;
        let routed: Vec<usize> = ids
            .iter()
            .map(|&e| e as usize)
            .filter(|&e| e < n_expert)
            .collect();
        self.commit(dev, layer)?;
        // Experts copied ahead for this layer are on the card now (a prefetch for another layer is stale).
        self.take_prefetch(dev, layer)?;
        self.policy.record(layer, &routed, n_tokens.max(1));
        for &e in &routed {
            self.routed_counts[layer][e] += 1;
        }
        let resident =
            |p: &CachePolicy, e: usize| p.resident(ExpertKey { layer, expert: e }).is_some();
        let hits = routed
            .iter()
            .filter(|&&e| resident(&self.policy, e))
            .count();
        self.stats.routed += ids.len() as u64;
        self.stats.routed_vram += hits as u64;
        // Experts already in a scratch slot for this layer (copied ahead): only then a lookup table, so
        // a token's route point allocates nothing for it.
        let mut in_scratch: Vec<bool> = Vec::new();
        if let Some(s) = self.staged.as_ref().filter(|s| s.layer == layer) {
            in_scratch.resize(n_expert, false);
            s.map.iter().for_each(|&(e, _)| in_scratch[e] = true);
        }
        let on_card = |p: &CachePolicy, e: usize| {
            in_scratch.get(e).copied().unwrap_or(false) || resident(p, e)
        };
        if n_tokens > 1 {
            let mut staged: Vec<usize> = routed
                .iter()
                .copied()
                .filter(|&e| !on_card(&self.policy, e))
                .collect();
            staged.sort_unstable();
            staged.dedup();
            // A small call's least-chosen uncached experts on the CPU, the rest copied. The CPU's inputs
            // come first: once the copies are queued, a download waits for them.
            let share = self.prompt_share((layer, n_tokens, ids, &routed), &mut staged, fetch)?;
            if !staged.is_empty() {
                self.stage(dev, cpu, layer, &staged)?;
                self.stats.staged += staged.len() as u64;
            }
            self.plan_prefetch(dev, layer, ids.len())?;
            return Ok(StepPrep::new(share, Vec::new(), false));
        }
        // One token: the experts copied ahead for it that it routes to are on the card (their copies
        // must be waited for); the missing ones split between on-demand copies (computed by the card
        // with the cached ones) and the CPU's share.
        let ahead = routed
            .iter()
            .filter(|&&e| in_scratch.get(e).copied().unwrap_or(false))
            .count();
        self.stats.ahead_routed += ahead as u64;
        let ahead = ahead > 0;
        let mut missing_slots: Vec<usize> = (0..ids.len())
            .filter(|&j| (ids[j] as usize) < n_expert && !on_card(&self.policy, ids[j] as usize))
            .collect();
        // The token's activation and routing weights, fetched once: before the copies are queued (a
        // download queued after them would wait for them), and before the skip and the bias's figures,
        // which read the weights.
        let mut fetch = Some(fetch);
        let mut fetched = None;
        let mut left_any = false;
        if !self.skip.is_off() {
            self.stats.skipped.steps += 1;
        }
        let skips = !self.skip.is_off() && !missing_slots.is_empty();
        // `--cache-bias`'s figures: a step that it changed needs the weights of its choices.
        let swapped = self.bias.is_on() && changed != 0;
        if self.bias.is_on() && !swapped {
            self.stats.swapped.add(0, &[]);
        }
        if skips || swapped {
            if let Some(f) = fetch.take() {
                let inputs = fetch_inputs(f, ids.len())?;
                if swapped {
                    self.stats.swapped.add(changed, &inputs.1);
                }
                let left = match skips {
                    true => self.skip.left_out(&missing_slots, &inputs.1),
                    false => Vec::new(),
                };
                if !left.is_empty() {
                    let s = &mut self.stats.skipped;
                    s.experts += left.len() as u64;
                    s.weight += skip::MissingSkip::weight_of(&left, &inputs.1);
                    s.bytes += (left.len() * self.layers[layer].expert_bytes()) as u64;
                    missing_slots.retain(|j| !left.contains(j));
                    left_any = true;
                }
                fetched = Some(inputs);
            }
        }
        if missing_slots.is_empty() {
            if ahead || left_any {
                // Those copied ahead may be admitted from their scratch slots, those left out over the
                // bus.
                self.admission = Some((layer, routed, Vec::new()));
            }
            return Ok(StepPrep::new(None, Vec::new(), ahead));
        }
        let n_copy = match self.missing {
            // Through the staging buffers the host's own copy would compete with the CPU's share.
            MissingExperts::Split if self.direct_copies() => {
                let n = missing_slots.len();
                self.cpu_probe.adjust(split_missing(n, &self.costs), n)
            }
            MissingExperts::Split | MissingExperts::Cpu => 0,
            MissingExperts::Card | MissingExperts::Mapped => missing_slots.len(),
        };
        // The CPU's inputs come first: once the copies below are queued, a download waits for them.
        let (x, weights, fetch_seconds) = match (missing_slots.len() > n_copy, fetched, fetch) {
            (false, ..) => (Vec::new(), Vec::new(), 0.0),
            (true, Some(inputs), _) => inputs,
            (true, None, Some(f)) => fetch_inputs(f, ids.len())?,
            (true, None, None) => {
                return Err(CudaError::Invalid(
                    "a token's CPU share without its inputs".into(),
                ))
            }
        };
        let copied: Vec<usize> = missing_slots
            .drain(..n_copy)
            .map(|j| ids[j] as usize)
            .collect();
        // An expert routed twice (never by one token, but kept correct) is on the card once copied.
        missing_slots.retain(|&j| !copied.contains(&(ids[j] as usize)));
        if missing_slots.is_empty() {
            self.admission = Some((layer, routed, Vec::new()));
            return Ok(StepPrep::new(None, copied, ahead));
        }
        let items: Vec<(usize, f32)> = missing_slots
            .iter()
            .map(|&j| (ids[j] as usize, weights[j]))
            .collect();
        // Admission candidates: the CPU's experts, likeliest first.
        let mut on_cpu: Vec<usize> = (0..items.len()).collect();
        on_cpu.sort_by(|&a, &b| items[b].1.total_cmp(&items[a].1));
        let on_cpu: Vec<usize> = on_cpu.into_iter().map(|i| items[i].0).collect();
        self.admission = Some((layer, routed, on_cpu));
        let share = CpuShare {
            x,
            all: items.len() == ids.len(),
            items,
            n_rows: 1,
            rows: Vec::new(),
            fetch_seconds,
            pool: share_pool(&mut self.cpu_pool),
        };
        Ok(StepPrep::new(Some(share), copied, ahead))
    }

    /// The scratch slots `(first, end)` of the first pool that a single token's copies into `layer` use
    /// (on demand and ahead): one half for even layers, the other for odd ones, so copies ahead for the
    /// next layer, queued while the card may still compute this one's experts, never overwrite a slot
    /// this layer reads. (The layer before it used the same half, and the card passed its experts before
    /// this layer's route point, where the host queues the next layer's copies.)
    fn token_slots(&self, layer: usize) -> (usize, usize) {
        let half = self.scratch[0].n_slots() / 2;
        let base = (layer % 2) * half;
        (base, base + half)
    }

    /// Copies `experts` of `layer` into scratch slots and points the layer's tables there until
    /// [`ExpertCache::finish_layer`]; the compute stream waits for the copies. They go after the
    /// layer's experts already in a scratch pool (copied ahead), else into the first pool.
    fn stage(
        &mut self,
        dev: &Device,
        cpu: &CpuWeights,
        layer: usize,
        experts: &[usize],
    ) -> CudaResult<()> {
        let repoint = !self.defer_tables;
        let Staged {
            pool,
            base,
            mut map,
            repointed,
            ..
        } = match self.staged.take() {
            Some(s) if s.layer == layer => s,
            other => {
                // A layer left pointing at scratch slots (a call that failed before finishing it)
                // points back at its own experts.
                if let Some(s) = other.filter(|s| s.repointed) {
                    self.mark_tables(s.layer);
                }
                // A single token's copies go into its layer's half of the first pool
                // ([`ExpertCache::token_slots`]) when they fit there.
                let (base, end) = self.token_slots(layer);
                let base = match self.defer_tables && experts.len() <= end - base {
                    true => base,
                    false => 0,
                };
                Staged {
                    layer,
                    pool: 0,
                    base,
                    map: Vec::new(),
                    repointed: false,
                }
            }
        };
        let first = base + map.len();
        if first + experts.len() > self.scratch[pool].n_slots() {
            return Err(CudaError::Invalid(format!(
                "{} experts of layer {layer} for {} scratch slots from slot {base}",
                map.len() + experts.len(),
                self.scratch[pool].n_slots()
            )));
        }
        // The scratch slots are free once the launches queued so far (the last staged layer's) ran. Only
        // `prepare_step` stages with the tables deferred, and its step synchronized with the card at the
        // route point, before anything that reads a scratch slot was queued.
        if !self.defer_tables {
            self.copy.wait_for_compute(dev)?;
        }
        for (i, &expert) in experts.iter().enumerate() {
            self.upload(
                cpu,
                ExpertKey { layer, expert },
                first + i,
                Dest::Scratch(pool),
            )?;
            map.push((expert, first + i));
        }
        // A one-graph token's card waits on a flag the copy stream sets after these copies instead
        // (its graph is queued whole: a wait queued now would come after it).
        if !self.linked {
            let copied = self.copy.record()?;
            dev.wait_for_copy(&copied)?;
        }
        let repointed = repointed || repoint;
        self.staged = Some(Staged {
            layer,
            pool,
            base,
            map,
            repointed,
        });
        if repointed {
            self.mark_tables(layer);
        }
        Ok(())
    }

    /// Starts the uploads the policy admits for a token of `layer` that routed to `routed`. The experts
    /// copied on demand for this token (`staged`: expert, scratch slot) are the first candidates: they sit in scratch slots, so admitting
    /// one is a copy on the card at its memory rate (microseconds) rather than another trip over the bus,
    /// which would queue before the next layer's copies on demand. The CPU's experts (`on_cpu`) come
    /// after them, over the bus. Each group is offered highest score first.
    fn admit(
        &mut self,
        dev: &Device,
        cpu: &CpuWeights,
        (layer, routed): (usize, &[usize]),
        staged: Option<&Staged>,
        on_cpu: &[usize],
    ) -> CudaResult<()> {
        if self.uploads_per_layer == 0 || self.pool.is_none() {
            return Ok(());
        }
        // The token's experts in scratch slots (copied on demand or ahead; one copied ahead but not
        // routed is no candidate).
        let mut on_card: Vec<usize> = staged.map_or(Vec::new(), |s| {
            s.map
                .iter()
                .map(|&(e, _)| e)
                .filter(|e| routed.contains(e))
                .collect()
        });
        self.policy.sort_by_score(layer, &mut on_card);
        let plan = self
            .policy
            .plan(layer, &on_card, routed, self.uploads_per_layer);
        self.admit_on_card(dev, &plan, staged)?;
        let left = self.uploads_per_layer - plan.len();
        if left == 0 || self.admissions == Admissions::Card {
            return Ok(());
        }
        let mut over_bus: Vec<usize> = on_cpu.to_vec();
        over_bus.extend(
            routed
                .iter()
                .filter(|&&e| {
                    self.policy
                        .resident(ExpertKey { layer, expert: e })
                        .is_none()
                })
                .filter(|e| !on_cpu.contains(e) && !on_card.contains(e)),
        );
        self.policy.sort_by_score(layer, &mut over_bus);
        let plan = self.policy.plan(layer, &over_bus, routed, left);
        self.start_uploads(dev, cpu, &plan)
    }

    /// Admits the experts of `plan` from their scratch slots (`staged`) by copies
    /// on the compute stream, after the victims' entries were cleared there: the launches before read the
    /// victims, those after see the newcomers once the staged layer's tables are pointed again
    /// ([`ExpertCache::finish_layer`]).
    fn admit_on_card(
        &mut self,
        dev: &Device,
        plan: &[policy::Upload],
        staged: Option<&Staged>,
    ) -> CudaResult<()> {
        let Some(staged) = staged.filter(|_| !plan.is_empty()) else {
            return Ok(());
        };
        for l in plan.iter().filter_map(|u| u.victim.map(|v| v.layer)) {
            self.mark_tables(l);
        }
        if !self.defer_tables {
            self.flush_tables(dev)?;
        }
        let pool = self
            .pool
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("an admission into a cache of no slots".into()))?;
        // The layers of the newcomers made resident at once.
        let mut placed = Vec::new();
        for u in plan {
            let from = staged
                .map
                .iter()
                .find(|&&(e, _)| e == u.expert.expert)
                .map(|&(_, s)| s);
            let r = match from {
                // A one-graph token's compute stream holds the rest of the token: the copy goes on the
                // copy stream, where the next layer's copies into the scratch slots follow it.
                Some(s) if self.linked => self
                    .copy
                    .copy_slot((&self.scratch[staged.pool], s), (pool, u.slot)),
                Some(s) => dev.copy_slot((&self.scratch[staged.pool], s), (pool, u.slot)),
                None => Err(CudaError::Invalid(format!(
                    "expert {} of layer {} is in no scratch slot",
                    u.expert.expert, u.expert.layer
                ))),
            };
            if let Err(e) = r {
                self.policy.abandon(u.slot);
                return Err(e);
            }
            if self.linked {
                // Resident once the copy stream passed it, as an upload over the bus.
                let done = self.copy.record()?;
                self.pending.push(Pending {
                    slot: u.slot,
                    key: u.expert,
                    done,
                });
            } else {
                // In stream order every later launch sees the copy: resident at once.
                self.policy.complete(u.slot);
                placed.push(u.expert.layer);
            }
            self.stats.admitted_on_card += 1;
        }
        // With the tables deferred (a segmented token with cuts) finish_layer does not point the
        // layer's tables again: marked, so their next reader (a prompt call, an eager token) finds the
        // newcomer in its slot rather than a null entry, which gives zeros.
        if self.defer_tables {
            placed.into_iter().for_each(|l| self.mark_tables(l));
        }
        Ok(())
    }

    /// Clears the victims' entries, then copies the newcomers (visible at a later [`commit`]).
    fn start_uploads(
        &mut self,
        dev: &Device,
        cpu: &CpuWeights,
        plan: &[policy::Upload],
    ) -> CudaResult<()> {
        if plan.is_empty() {
            return Ok(());
        }
        let mut victim_layers: Vec<usize> = plan
            .iter()
            .filter_map(|u| u.victim.map(|v| v.layer))
            .collect();
        victim_layers.sort_unstable();
        victim_layers.dedup();
        for l in victim_layers {
            self.mark_tables(l);
        }
        if !self.defer_tables {
            self.flush_tables(dev)?;
        }
        // No launch queued after this reads the victims' slots; those before must finish before the copy.
        // A one-graph token's host point is a moment when the card reads no routed slot (and its compute
        // stream holds the rest of the token, which waits for this stream's flags).
        if !self.linked {
            self.copy.wait_for_compute(dev)?;
        }
        if let Some(later) = self.bus_later.as_mut() {
            later.extend_from_slice(plan);
            return Ok(());
        }
        self.queue_uploads(cpu, plan)
    }

    /// Queues the copies of `plan`'s newcomers (their victims' entries cleared) on the copy stream, each
    /// resident once the stream passed it.
    fn queue_uploads(&mut self, cpu: &CpuWeights, plan: &[policy::Upload]) -> CudaResult<()> {
        for u in plan {
            if let Err(e) = self.upload(cpu, u.expert, u.slot, Dest::Cache) {
                self.policy.abandon(u.slot);
                return Err(e);
            }
            let done = self.copy.record()?;
            self.pending.push(Pending {
                slot: u.slot,
                key: u.expert,
                done,
            });
        }
        Ok(())
    }

    /// After `layer`'s expert launches: tables that point at scratch slots point back.
    pub fn finish_layer(&mut self, dev: &Device, cpu: &CpuWeights, layer: usize) -> CudaResult<()> {
        // The layer's launches are queued: its tables may lose the scratch entries from here on.
        let staged = match self.staged.take() {
            Some(s) if s.layer == layer => Some(s),
            other => {
                self.staged = other;
                None
            }
        };
        if let Some((l, routed, on_cpu)) = self.admission.take() {
            if l == layer {
                let clock = std::time::Instant::now();
                self.admit(dev, cpu, (layer, &routed), staged.as_ref(), &on_cpu)?;
                self.host_phases.admit += clock.elapsed();
            }
        }
        if staged.as_ref().is_some_and(|s| s.repointed) {
            self.point_tables(dev, layer)?;
        }
        // The next layer's experts copied while the card computes this one's.
        self.start_prefetch(cpu, layer)
    }

    /// Adds the routings counted since the last call to the profile and saves it.
    pub fn save_profile(&mut self) -> std::io::Result<()> {
        let counts = self.policy.take_counts();
        let Some((path, profile)) = &mut self.profile else {
            return Ok(());
        };
        if counts.iter().all(|c| c.iter().all(|&v| v == 0)) {
            return Ok(());
        }
        profile.add(&counts);
        profile.save(path)
    }
}

/// The card's address of every expert matrix of `layers` in the page-locked file, when every part
/// holding one is page-locked.
fn mapped_addresses(
    cpu: &CpuWeights,
    layers: &[ExpertLayer],
    registered: &[Option<HostRegistration>],
) -> Option<Vec<[Vec<u64>; 3]>> {
    layers
        .iter()
        .map(|l| {
            let per_matrix = |i: usize| -> Option<Vec<u64>> {
                let m = &l.mats[i];
                let reg = registered.get(cpu.info(m.weight).part)?.as_ref()?;
                let bytes = cpu.bytes(m.weight);
                (0..l.n_expert)
                    .map(|e| reg.device_address(bytes.get(e * m.bytes..(e + 1) * m.bytes)?))
                    .collect()
            };
            Some([per_matrix(0)?, per_matrix(1)?, per_matrix(2)?])
        })
        .collect()
}

/// Page-locks each part of `cpu`'s file for direct copies, where allowed and possible (see
/// [`ExpertCache::new`]); a part that cannot be is copied through the staging buffers.
fn register_file(dev: &Device, cpu: &CpuWeights) -> Vec<Option<HostRegistration>> {
    let file = cpu.shared_file();
    let limit = crate::serve::memory::host_bytes("MemTotal:").map_or(0, |m| m as usize / 2);
    (0..file.n_parts())
        .map(|part| {
            let bytes = file.part_bytes(part)?;
            if bytes.len() > limit {
                return None;
            }
            let owner: std::sync::Arc<dyn std::any::Any + Send + Sync> = file.clone();
            // SAFETY: the part's mapping is read-only and lives as long as the file, which `owner`
            // keeps alive for the registration's life.
            match unsafe { HostRegistration::new(dev, bytes, owner) } {
                Ok(r) => Some(r),
                Err(e) => {
                    eprintln!("expert cache: copying through staging buffers ({e})");
                    None
                }
            }
        })
        .collect()
}

impl Drop for ExpertCache {
    fn drop(&mut self) {
        // The staging buffers must outlive the copies reading them.
        let _ = self.copy.synchronize();
    }
}
