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
//! A capture that fails turns graphs off for that sequence; `--gpu-graphs off` turns them off entirely.
//!
//! When the expert cache lacks experts, an MoE layer needs the host in its middle: the token's routing
//! decides which experts are copied to the card and which the CPU computes. Such a token's graph is
//! *segmented* ([`MoeSteps`]): the capture is cut after each MoE layer's router (the host reads the ids and
//! makes every routed expert computable) and after the card's experts (the host computes the CPU's share
//! while the card computes its own, and writes the sum), so a token costs some 2 graph launches and one
//! wait per MoE layer instead of ~25 kernel launches per layer. A layer with a shared expert has a third
//! segment, the shared expert alone, replayed right after the route point so the card computes it while
//! the host decides. The card's experts of a step read the step's own table of the token's `k` routings
//! ([`MoeStep::tables`]), which the host fills at the route point, so the layer's tables are not rewritten
//! per token. `--gpu-segments off` runs such tokens without graphs, as before. The hand-overs at the host
//! points (ids, weights and input down; the token's expert addresses and the CPU's sum up) are one
//! `copy_words` kernel each, reading and writing the steps' page-locked buffers, rather than five
//! copy-engine transfers a layer (`--gpu-handoff copy`): 7% more answers on the H200 at 8 GB.
//!
//! By default (`--gpu-host-points flags`) such a token is still *one* graph, queued whole: at a route
//! point the card signals a page-locked flag that the host spins on (no synchronize), and before its
//! experts and before adding the CPU's sum it waits on flags that the host sets (after the copies on
//! demand, on the copy stream) instead of the host launching the next segment ([`HostFlags`]). The
//! serial chain of a layer then holds no graph launch and no synchronize. `--gpu-host-points cuts`
//! keeps the segments.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use poly_kernels::cuda::{
    CudaError, CudaResult, Device, DeviceBuffer, ExpertTable, HostCopies, HostFlags, LaunchGraph,
    PinnedHost,
};
use poly_models::arch::{Forward, ModelGraph};
use poly_models::compute::{Moe, WeightId};

use super::expert_cache::{CpuShare, ExpertCache, StepPrep};
use super::forward::{Backing, GpuForward, GraphInputs, GraphMode};
use super::pool::{Pool, PoolStore};
use crate::cpu::CpuWeights;

/// Whether decode graphs are on (`--gpu-graphs off` turns them off).
pub fn graphs_enabled() -> bool {
    crate::knobs::forward().gpu_graphs
}

/// Whether tokens whose MoE layers need the host (an expert cache lacking experts) go through segmented
/// graphs (`--gpu-segments off` runs them without graphs).
pub fn segments_enabled() -> bool {
    crate::knobs::forward().gpu_segments
}

/// Whether the hand-overs between the card and the host are kernels (`--gpu-handoff kernel`, the
/// default) rather than copy-engine transfers.
fn handoff_by_kernel() -> bool {
    crate::knobs::forward().handoff == crate::knobs::Handoff::Kernel
}

/// Whether a segmented token is one graph meeting the host through flags (`--gpu-host-points flags`)
/// rather than a graph per stretch between host points.
fn host_points_by_flags() -> bool {
    crate::knobs::forward().host_points == crate::knobs::HostPoints::Flags
}

/// How long the card waits at a flag for the host, and the host for the card to reach a route point,
/// before either gives up (a failed host releases the card at once; this bounds what cannot).
const FLAG_WAIT: Duration = Duration::from_secs(10);

/// Flags a step holds when its token is one graph.
const FLAGS_PER_STEP: usize = 4;

/// Step `i`'s flags: the card passed its router (the host may read the ids); its copies on demand and
/// sources are in place (the card's experts may start); the CPU's sum is written (the card adds it); the
/// card's guess of the next step's experts is down (queued after the route point, so the router's
/// hand-over does not wait for a second router).
fn route_flag(i: usize) -> usize {
    FLAGS_PER_STEP * i
}
fn staged_flag(i: usize) -> usize {
    FLAGS_PER_STEP * i + 1
}
fn sum_flag(i: usize) -> usize {
    FLAGS_PER_STEP * i + 2
}
fn guess_flag(i: usize) -> usize {
    FLAGS_PER_STEP * i + 3
}

/// Queues the card's signal that step `i`'s guess of the next step's experts is down (a token of one
/// graph, after the guess's download).
pub fn queue_guess_signal(dev: &Device, flags: &HostFlags, i: usize) -> CudaResult<()> {
    flags.queue_signal(dev, guess_flag(i))
}

/// Where a segmented graph meets the host: with cuts, after one of its graphs; with flags, at a flag.
#[derive(Clone, Copy, Debug)]
pub enum HostPoint {
    /// Step `i`'s router ran: the host reads the ids and (without a shared expert) makes every routed
    /// expert computable.
    Route(usize),
    /// Step `i`'s shared expert is queued: the host makes every routed expert computable while the card
    /// computes it.
    Prepare(usize),
    /// Step `i`'s card experts are queued: the host computes the CPU's share and writes its sum.
    CpuShare(usize),
    /// Step `i`'s copies on demand and sources are in place (a flag only: with cuts the experts'
    /// segment is launched after the host staged them).
    Staged(usize),
}

impl HostPoint {
    /// The step it belongs to.
    pub fn step(self) -> usize {
        match self {
            HostPoint::Route(i)
            | HostPoint::Prepare(i)
            | HostPoint::CpuShare(i)
            | HostPoint::Staged(i) => i,
        }
    }

    /// What a capture queues at this point when the token's graph meets the host through `flags`: the
    /// card's signal or wait (nothing at `Prepare`: the host prepares as soon as it sees the route).
    pub fn queue_on_flags(self, dev: &Device, flags: &HostFlags) -> CudaResult<()> {
        match self {
            HostPoint::Route(i) => flags.queue_signal(dev, route_flag(i)),
            HostPoint::Prepare(_) => Ok(()),
            HostPoint::Staged(i) => flags.queue_wait(dev, staged_flag(i), FLAG_WAIT),
            HostPoint::CpuShare(i) => flags.queue_wait(dev, sum_flag(i), FLAG_WAIT),
        }
    }
}

/// The buffers of one MoE layer of a segmented graph, which the host reads and writes between its graphs.
/// The running call makes them; the capture and every replay use the same ones.
pub struct MoeStep {
    /// The expert cache's layer.
    pub layer: usize,
    pub moe: Moe,
    /// `[k]` the token's routed experts and their weights, written by the router.
    pub ids: DeviceBuffer<i32>,
    pub weights: DeviceBuffer<f32>,
    /// `[n_embd]` the CPU's weighted sum, written by the host at the CPU-share point and uploaded by
    /// the next segment (a graph's node, so a replay copies the sum of its token) where the card's sum
    /// adds to it.
    host_sum: PinnedHost<f32>,
    /// The step's own gate, up and down tables of `k` entries (one per routing, in routing order), which
    /// the card's expert launches read with the ids `0..k` (`slot_ids`): the host writes the token's
    /// addresses into `host_sources` at the route point and the graph copies them there, so a token's
    /// copies on demand and admissions rewrite no table of the layer's.
    pub tables: [ExpertTable; 3],
    pub slot_ids: DeviceBuffer<i32>,
    host_sources: PinnedHost<u64>,
    /// The layer has a shared expert, computed between the route point and [`HostPoint::Prepare`].
    pub shared: bool,
    /// Host copies of `ids`, `weights` and the layer's input, queued behind the router (a graph's nodes, so a replay
    /// leaves them there): the route point waits for the card once and reads all three, where three
    /// synchronous downloads cost a round trip each.
    host_ids: PinnedHost<i32>,
    host_weights: PinnedHost<f32>,
    host_x: PinnedHost<f32>,
    /// `host_sum` holds zeros (the host skips writing them again).
    sum_is_zero: bool,
    /// `--guess-on card`: the next MoE step's experts guessed on the card (none at the last step).
    guess: Option<CardGuess>,
    /// The experts the last token copied on demand for this step (beside the card's wait at its staged
    /// flag, the split's measure of the card's side).
    copied_on_demand: usize,
    /// `--cache-bias`: the router reads the cache's bias vector of the layer and writes which choices it
    /// made into `changed` (`[1]`), handed down with the ids; false: no bias, nothing more handed down.
    pub biased: bool,
    pub changed: DeviceBuffer<i32>,
    host_changed: PinnedHost<i32>,
}

/// The next MoE step's experts guessed on the card (`--guess-on card`): its router applied to this step's
/// input, so the host knows the guess without reading a router itself (on the share's threads it took
/// 31–38 µs a layer after the share, reading the f32 router from host memory, before the copies ahead
/// could start). In a token of one graph it is queued after the route point and handed down behind its
/// own flag ([`guess_flag`]): the host needs it only once the CPU's share is under way, and queued before
/// the route point its router delayed every layer's hand-over by one more router launch. With cuts it
/// comes down with the step's ids.
struct CardGuess {
    /// The next step's MoE layer (its router and `k`).
    moe: Moe,
    /// `[k]` its likeliest experts, likeliest first, and their weights (unused).
    ids: DeviceBuffer<i32>,
    weights: DeviceBuffer<f32>,
    host_ids: PinnedHost<i32>,
}

/// Whether the steps guess the next layer's experts on the card: `--guess-on card` with a use for the
/// guess (`--copy-ahead` or `--cpu-warm`).
pub fn guesses_on_card() -> bool {
    let f = crate::knobs::forward();
    f.guess_on == crate::knobs::GuessOn::Card && (f.copy_ahead > 0 || f.cpu_warm)
}

impl MoeStep {
    /// Buffers for layer `layer` of `moe` with rows of `n_embd`, its tables shaped as `layer_tables`
    /// (the cache's layer), `shared` with a shared expert.
    pub fn new(
        dev: &Device,
        (layer, layer_tables): (usize, &[ExpertTable; 3]),
        moe: &Moe,
        (n_embd, shared, biased): (usize, bool, bool),
    ) -> CudaResult<MoeStep> {
        let k = moe.n_expert_used;
        let spec = |t: &ExpertTable| (t.ty, t.rows, t.cols);
        let [g, u, d] = layer_tables;
        let slot_ids: Vec<i32> = (0..k as i32).collect();
        let mut ids_buf = dev.zeros(k)?;
        dev.write(&slot_ids, &mut ids_buf)?;
        Ok(MoeStep {
            layer,
            moe: *moe,
            ids: dev.zeros(k)?,
            weights: dev.zeros(k)?,
            host_sum: dev.pinned(n_embd)?,
            tables: ExpertTable::empty_group(dev, [spec(g), spec(u), spec(d)], k)?,
            slot_ids: ids_buf,
            host_sources: dev.pinned(3 * k)?,
            shared,
            host_ids: dev.pinned(k)?,
            host_weights: dev.pinned(k)?,
            host_x: dev.pinned(n_embd)?,
            sum_is_zero: true,
            guess: None,
            copied_on_demand: 0,
            biased,
            changed: dev.zeros(1)?,
            host_changed: dev.pinned(1)?,
        })
    }

    /// Makes the step guess the experts of the next MoE step, `next`, on the card (its router applied to
    /// this step's input): buffers for a capture's launches ([`MoeStep::card_guess`]) and their download.
    pub fn guess_next_on_card(&mut self, dev: &Device, next: &Moe) -> CudaResult<()> {
        let k = next.n_expert_used;
        self.guess = Some(CardGuess {
            moe: *next,
            ids: dev.zeros(k)?,
            weights: dev.zeros(k)?,
            host_ids: dev.pinned(k)?,
        });
        Ok(())
    }

    /// The next step's MoE layer and the buffers its guessed ids and weights go into, where the step
    /// guesses on the card.
    pub fn card_guess(&mut self) -> Option<(Moe, &mut DeviceBuffer<i32>, &mut DeviceBuffer<f32>)> {
        self.guess
            .as_mut()
            .map(|g| (g.moe, &mut g.ids, &mut g.weights))
    }

    /// After the route point: the next step's experts the card guessed, likeliest first (none where the
    /// step does not guess on the card).
    pub fn guessed_on_card(&self) -> CudaResult<Vec<usize>> {
        match &self.guess {
            Some(g) => Ok(g
                .host_ids
                .as_slice()?
                .iter()
                .filter_map(|&e| usize::try_from(e).ok())
                .filter(|&e| e < g.moe.n_expert)
                .collect()),
            None => Ok(Vec::new()),
        }
    }

    /// The next step's experts the card guessed, once `flags` says they are down (a token of one graph
    /// queues the guess after the route point); none where the step does not guess on the card.
    pub fn guessed_on_card_after(
        &self,
        dev: &Device,
        flags: &HostFlags,
        i: usize,
    ) -> CudaResult<Vec<usize>> {
        if self.guess.is_some() {
            flags.wait_set(dev, guess_flag(i), FLAG_WAIT)?;
        }
        self.guessed_on_card()
    }

    /// Queues the host copy of the card's guess of the next step's experts (after its router, in stream
    /// order), for a token of one graph that queues the guess after the route point; the caller signals
    /// [`guess_flag`] after it.
    pub fn queue_guess_download(&mut self, dev: &Device) -> CudaResult<()> {
        let Some(g) = self.guess.as_mut() else {
            return Ok(());
        };
        // SAFETY: the host reads the pinned copy only after the guess flag, which the card sets after
        // it; the step owns it for as long as the graph holding the copy (as in `queue_downloads`).
        unsafe {
            if handoff_by_kernel() {
                let mut copies = HostCopies::new();
                copies.download(&g.ids, &mut g.host_ids)?;
                return copies.queue(dev);
            }
            dev.queue_download(&g.ids, &mut g.host_ids)
        }
    }

    /// Queues the host copies of the router's ids and weights and of the layer's input `x` (after the
    /// router, in stream order; captured, every replay makes them: a graph's activations keep their
    /// addresses): one kernel, or three copy-engine transfers with `--gpu-handoff copy`. `with_guess`:
    /// the card's guess of the next step comes down with them (else [`MoeStep::queue_guess_download`]).
    pub fn queue_downloads(
        &mut self,
        dev: &Device,
        x: &DeviceBuffer<f32>,
        with_guess: bool,
    ) -> CudaResult<()> {
        let guess = match with_guess {
            true => self.guess.as_mut(),
            false => None,
        };
        // SAFETY: the host reads the pinned copies only after the route point: a synchronize with the
        // stream that ran them, or (one graph a token) the route flag, which the card sets after them;
        // the step owns them for as long as the graph holding the copies (the decode graph drops its
        // graphs and flags before its steps).
        unsafe {
            if handoff_by_kernel() {
                let mut copies = HostCopies::new();
                copies
                    .download(&self.ids, &mut self.host_ids)?
                    .download(&self.weights, &mut self.host_weights)?
                    .download(x, &mut self.host_x)?;
                if let Some(g) = guess {
                    copies.download(&g.ids, &mut g.host_ids)?;
                }
                if self.biased {
                    copies.download(&self.changed, &mut self.host_changed)?;
                }
                return copies.queue(dev);
            }
            dev.queue_download(&self.ids, &mut self.host_ids)?;
            dev.queue_download(&self.weights, &mut self.host_weights)?;
            dev.queue_download(x, &mut self.host_x)?;
            if let Some(g) = guess {
                dev.queue_download(&g.ids, &mut g.host_ids)?;
            }
            if self.biased {
                dev.queue_download(&self.changed, &mut self.host_changed)?;
            }
        }
        Ok(())
    }

    /// At the route point: waits for the router (the host copies of its ids, weights and input).
    pub fn wait_route(&self, dev: &Device, times: &mut HostTimes) -> CudaResult<()> {
        let clock = Instant::now();
        dev.synchronize()?;
        times.route_wait += clock.elapsed();
        Ok(())
    }

    /// After [`MoeStep::wait_route`]: the routings counted and the cache's choices for them (the CPU's
    /// share, the copies on demand), nothing queued yet ([`MoeStep::stage`]).
    pub fn prepare(
        &mut self,
        (dev, cpu): (&Device, &CpuWeights),
        cache: &mut ExpertCache,
        times: &mut HostTimes,
    ) -> CudaResult<StepPrep> {
        let clock = Instant::now();
        let MoeStep {
            host_ids,
            host_x,
            host_weights,
            host_changed,
            layer,
            biased,
            ..
        } = self;
        let ids = host_ids.as_slice()?;
        let changed = match biased {
            true => host_changed.as_slice()?.first().map_or(0, |&c| c as u32),
            false => 0,
        };
        let fetch = || {
            Ok((
                host_x.as_slice()?.to_vec(),
                host_weights.as_slice()?.to_vec(),
            ))
        };
        let prep = cache.prepare_step((dev, cpu), *layer, (ids, changed), fetch);
        times.prepare += clock.elapsed();
        times.steps += 1;
        prep
    }

    /// The copies on demand of [`MoeStep::prepare`] queued before the card's experts and the token's
    /// sources written for the graph's copy into the step's tables.
    pub fn stage(
        &mut self,
        (dev, cpu): (&Device, &CpuWeights),
        cache: &mut ExpertCache,
        copies: &[usize],
        times: &mut HostTimes,
    ) -> CudaResult<()> {
        let MoeStep {
            host_ids,
            host_sources,
            layer,
            ..
        } = self;
        let ids = host_ids.as_slice()?;
        // SAFETY of the write: the graph's copy of the previous token's sources ran before this step's
        // route point (the host synchronized with the card there, or saw the card's route flag, which the
        // card sets after it).
        let sources = host_sources.as_mut_slice()?;
        cache.take_host_phases();
        let r = cache.stage_step((dev, cpu), (*layer, ids), copies, sources);
        let parts = cache.take_host_phases();
        times.stage += parts.stage;
        times.tables += parts.tables;
        r
    }

    /// Queues the copy of the step's sources (written by [`MoeStep::stage`]) into its tables: before
    /// the card's expert launches, in stream order (a capture records it, so every replay copies the
    /// sources of its token).
    pub fn queue_sources(&self, dev: &Device) -> CudaResult<()> {
        // SAFETY: the host writes `host_sources` only in `stage`, after the route point (a synchronize,
        // or the card's route flag), which follows every earlier copy of them, and before this copy
        // runs (queued after, or behind the card's wait at the step's staged flag); the step owns them as
        // long as the graph holding the copy (the decode graph drops its graphs before its steps).
        unsafe {
            if handoff_by_kernel() {
                let mut copies = HostCopies::new();
                ExpertTable::add_group_upload(&mut copies, &self.tables, &self.host_sources)?;
                return copies.queue(dev);
            }
            ExpertTable::queue_group_upload(dev, &self.tables, &self.host_sources)
        }
    }

    /// Queues the upload of the CPU's sum (written at the CPU-share point) into `out`, where the card's
    /// weighted sum adds to it: the first node of the segment after that point.
    pub fn queue_sum(&self, dev: &Device, out: &mut DeviceBuffer<f32>) -> CudaResult<()> {
        // SAFETY: the host writes `host_sum` only at the CPU-share point, before this segment is queued
        // or replayed (or before it sets the sum flag the card waits on ahead of this copy) and after the
        // route point (a synchronize, or the route flag), which follows every earlier upload of it; the
        // step owns it as long as the graph holding the copy.
        unsafe {
            if handoff_by_kernel() {
                return HostCopies::new().upload(&self.host_sum, out)?.queue(dev);
            }
            dev.queue_upload(&self.host_sum, out)
        }
    }

    /// The card's experts (`launch`: replayed, or released at their flag; told whether copies on demand
    /// were queued, and given the step to read) with the step's copies staged before them, and the CPU's share computed meanwhile:
    /// its threads start first, then this thread stages and launches beside them. Its sum (zeros without
    /// a share) goes into `host_sum`. [`MoeStep::finish`] finishes the layer in the cache after it.
    pub fn experts(
        &mut self,
        (dev, cpu): (&Device, &CpuWeights),
        cache: &mut ExpertCache,
        prep: StepPrep,
        times: &mut HostTimes,
        launch: impl FnOnce(&mut ExpertCache, bool, &MoeStep) -> CudaResult<()>,
    ) -> CudaResult<()> {
        let copied = prep.waits_for_copies();
        let StepPrep { share, copies, .. } = prep;
        self.copied_on_demand = copies.len();
        let Some(share) = share else {
            self.stage((dev, cpu), cache, &copies, times)?;
            launch(cache, copied, self)?;
            return self.write_sum(None);
        };
        let clock = Instant::now();
        let mut beside_time = Duration::ZERO;
        let moe = self.moe;
        let (sum, r, seconds) = share.compute_beside(cpu, &moe, || {
            let t = Instant::now();
            let r = self
                .stage((dev, cpu), cache, &copies, times)
                .and_then(|()| launch(cache, copied, self));
            beside_time = t.elapsed();
            r
        });
        r?;
        share.record(cache, seconds);
        let r = self.write_sum(Some(&sum));
        times.cpu_share += Duration::from_secs_f64(seconds);
        times.share_wait += clock.elapsed().saturating_sub(beside_time);
        r
    }

    /// The CPU's share without anything beside it (a call that runs its host points as it queues its
    /// launches, which borrow the forward): computed and written into `host_sum`.
    pub fn cpu_share(
        &mut self,
        cpu: &CpuWeights,
        cache: &mut ExpertCache,
        share: Option<CpuShare>,
        times: &mut HostTimes,
    ) -> CudaResult<()> {
        let clock = Instant::now();
        let r = match share {
            Some(share) => {
                let sum = share.compute_for(Some(&mut *cache), cpu, &self.moe);
                self.write_sum(Some(&sum))
            }
            None => self.write_sum(None),
        };
        times.cpu_share += clock.elapsed();
        times.share_wait += clock.elapsed();
        r
    }

    /// `sum` (zeros for `None`) into `host_sum`, for the next segment's upload.
    fn write_sum(&mut self, sum: Option<&[f32]>) -> CudaResult<()> {
        let _span = crate::cpu::profile::span("share write");
        match sum {
            Some(sum) => {
                self.host_sum.as_mut_slice()?.copy_from_slice(sum);
                self.sum_is_zero = false;
            }
            None if !self.sum_is_zero => {
                self.host_sum.as_mut_slice()?.fill(0.0);
                self.sum_is_zero = true;
            }
            None => {}
        }
        Ok(())
    }

    /// The layer finished in the cache (its tables pointed back, the admissions it earned started). A
    /// replay does it after queueing the next segment: nothing in that segment reads this layer's experts,
    /// and the host's choices then overlap the card's next dense layer instead of delaying its launch.
    pub fn finish(
        &self,
        (dev, cpu): (&Device, &CpuWeights),
        cache: &mut ExpertCache,
        times: &mut HostTimes,
    ) -> CudaResult<()> {
        let clock = Instant::now();
        cache.take_host_phases();
        let r = cache.finish_layer(dev, cpu, self.layer);
        times.admit += cache.take_host_phases().admit;
        times.finish += clock.elapsed();
        r
    }
}

/// The host's time at a segmented graph's host points, summed.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostTimes {
    /// MoE steps run.
    pub steps: u64,
    /// Waiting for the router's ids (the card's work before them).
    pub route_wait: Duration,
    /// The cache's decisions ([`ExpertCache::prepare_step`]).
    pub prepare: Duration,
    /// The CPU's share: its own compute time.
    pub cpu_share: Duration,
    /// The host waiting for the CPU's share after staging and launching the card's experts beside it
    /// (the share's time the card's launches did not hide).
    pub share_wait: Duration,
    /// [`ExpertCache::finish_layer`].
    pub finish: Duration,
    /// Parts: the copies on demand queued and the sources written (beside the CPU's share), the admissions (started
    /// when the layer finishes, within `finish`).
    pub stage: Duration,
    pub admit: Duration,
    pub tables: Duration,
    /// `--cpu-warm`: next-layer experts guessed missing, those the layer then routed to, and the bytes
    /// read into the host's caches before the card reached the layer.
    pub guessed: u64,
    pub guessed_right: u64,
    pub warmed_bytes: u64,
    /// `--copy-ahead`: queueing the next layer's copies ahead.
    pub ahead: Duration,
    /// One graph a token: the card's own waits at the staged flags (for the host's decisions and the
    /// copies on demand or ahead) and at the sum flags (for the CPU's share), and the tokens they cover.
    pub card_staged_wait: Duration,
    pub card_sum_wait: Duration,
    pub card_tokens: u64,
}

impl HostTimes {
    /// Adds `o`.
    pub fn add(&mut self, o: &HostTimes) {
        self.steps += o.steps;
        self.route_wait += o.route_wait;
        self.prepare += o.prepare;
        self.cpu_share += o.cpu_share;
        self.share_wait += o.share_wait;
        self.finish += o.finish;
        self.stage += o.stage;
        self.admit += o.admit;
        self.tables += o.tables;
        self.guessed += o.guessed;
        self.guessed_right += o.guessed_right;
        self.warmed_bytes += o.warmed_bytes;
        self.ahead += o.ahead;
        self.card_staged_wait += o.card_staged_wait;
        self.card_sum_wait += o.card_sum_wait;
        self.card_tokens += o.card_tokens;
    }
}

/// The MoE steps of a segmented graph: their buffers, and the graphs captured before each host point.
#[derive(Default)]
pub struct MoeSteps {
    /// The graphs cut so far, each followed by its host point (before `steps`: dropped first, as they
    /// copy into the steps' pinned buffers).
    pub segments: Vec<(LaunchGraph, HostPoint)>,
    /// In the order the call reaches them (taken out while a call works on one).
    pub steps: Vec<Option<MoeStep>>,
    /// The step the call reaches next.
    pub next: usize,
    /// With `--gpu-host-points flags`, the flags of a captured token's host points
    /// ([`FLAGS_PER_STEP`] a step), and no segments: the whole token is one graph.
    pub flags: Option<HostFlags>,
    /// The host points' time since [`DecodeGraphs::take_host_times`].
    times: HostTimes,
}

impl MoeSteps {
    /// Replays the token: its one graph meeting the host at flags, or its segments.
    fn replay(
        &mut self,
        (dev, cpu): (&Device, &CpuWeights),
        cache: &mut ExpertCache,
        last: &LaunchGraph,
    ) -> CudaResult<()> {
        if self.flags.is_none() {
            return self.replay_cuts((dev, cpu), cache, last);
        }
        let MoeSteps {
            steps,
            flags,
            times,
            ..
        } = self;
        let flags = flags
            .as_mut()
            .ok_or_else(|| CudaError::Invalid("a one-graph token without its flags".into()))?;
        // The card's waits of the token before (past them all: the host read its logits since); those
        // at the staged flags measure the card's side of the split.
        if flags.token() > 0 {
            for (i, step) in steps.iter().enumerate() {
                let staged = flags.card_waited(staged_flag(i))?;
                if let Some(step) = step {
                    cache.record_card_wait(step.copied_on_demand, staged);
                }
                times.card_staged_wait += staged;
                times.card_sum_wait += flags.card_waited(sum_flag(i))?;
            }
            times.card_tokens += 1;
        }
        flags.next_token()?;
        last.replay()?;
        cache.set_linked(true);
        let r = meet_host(steps, flags, (dev, cpu), cache, times);
        cache.set_linked(false);
        if r.is_err() {
            // The card must not wait for a host that gave up.
            flags.release();
        }
        r?;
        // The card is past every point: the last layer's admissions may wait for it as usual (finished
        // at its own sum, `--finish-layers-at sum`, it is done).
        match (steps.len(), AheadPlan::in_force().finish_at_sum) {
            (0, _) | (_, true) => Ok(()),
            (n, false) => step_at(steps, n - 1)?.finish((dev, cpu), cache, times),
        }
    }

    /// Replays the segments, each followed by its host point, then `last`; the CPU's share of a step goes
    /// from its route point to its CPU-share point.
    fn replay_cuts(
        &mut self,
        (dev, cpu): (&Device, &CpuWeights),
        cache: &mut ExpertCache,
        last: &LaunchGraph,
    ) -> CudaResult<()> {
        let MoeSteps {
            steps,
            segments,
            times,
            ..
        } = self;
        let plan = AheadPlan::in_force();
        // The choices of the step whose experts' segment comes next.
        let mut prep: Option<(usize, StepPrep)> = None;
        // The step whose layer is finished once the next segment is queued.
        let mut unfinished: Option<usize> = None;
        for (segment, point) in segments.iter() {
            match (point, prep.take()) {
                // The card's experts, staged and replayed beside the CPU's share of them.
                (HostPoint::CpuShare(i), Some((j, p))) if *i == j => {
                    let next = next_step(steps, j);
                    let step = step_at(steps, j)?;
                    let card_guess = step.guessed_on_card()?;
                    let mut early = Duration::ZERO;
                    step.experts((dev, cpu), cache, p, times, |cache, _, _| {
                        segment.replay()?;
                        if plan.at_route {
                            let clock = Instant::now();
                            copy_ahead(next, &card_guess, (cpu, cache))?;
                            early = clock.elapsed();
                        }
                        Ok(())
                    })?;
                    times.ahead += early;
                    if plan.after_share {
                        let clock = Instant::now();
                        let guess = plan.next_guess(steps, j, card_guess, (cpu, cache))?;
                        copy_ahead(next, &guess, (cpu, cache))?;
                        times.ahead += clock.elapsed();
                    }
                }
                (HostPoint::CpuShare(i), _) => {
                    return Err(CudaError::Invalid(format!(
                        "MoE step {i}'s experts without the cache's choices for them"
                    )))
                }
                (_, Some((j, _))) => {
                    return Err(CudaError::Invalid(format!(
                        "MoE step {j}'s choices without its experts' segment"
                    )))
                }
                (_, None) => segment.replay()?,
            }
            if let Some(j) = unfinished.take() {
                step_at(steps, j)?.finish((dev, cpu), cache, times)?;
            }
            let i = point.step();
            let step = step_at(steps, i)?;
            match point {
                HostPoint::Route(_) => {
                    step.wait_route(dev, times)?;
                    if !step.shared {
                        prep = Some((i, step.prepare((dev, cpu), cache, times)?));
                    }
                }
                HostPoint::Prepare(_) => prep = Some((i, step.prepare((dev, cpu), cache, times)?)),
                HostPoint::CpuShare(_) => unfinished = Some(i),
                HostPoint::Staged(_) => {
                    return Err(CudaError::Invalid(format!(
                        "a segment cut at step {i}'s staging point"
                    )))
                }
            }
        }
        last.replay()?;
        match unfinished {
            Some(j) => step_at(steps, j)?.finish((dev, cpu), cache, times),
            None => Ok(()),
        }
    }
}

/// The host's side of a one-graph token (queued whole): at each step's route flag this layer is
/// prepared; its copies on demand are queued and its staged flag set after them (by the copy stream, or
/// at once without copies) beside the CPU's share, whose sum then releases the card. The next layer's
/// likeliest missing experts are copied ahead after the staged flag (`--copy-ahead-at route`) or once
/// the sum is written (`sum`). The layer is finished (its admissions planned) right after that, while
/// the card computes on (`--finish-layers-at sum`), or at the next step's route flag, when the card
/// passed its experts (`route`).
fn meet_host(
    steps: &mut [Option<MoeStep>],
    flags: &HostFlags,
    (dev, cpu): (&Device, &CpuWeights),
    cache: &mut ExpertCache,
    times: &mut HostTimes,
) -> CudaResult<()> {
    let plan = AheadPlan::in_force();
    cache.hold_bus_admissions(plan.bus_later);
    let r = meet_steps(steps, flags, (dev, cpu), cache, times, plan);
    cache.hold_bus_admissions(false);
    r
}

/// [`meet_host`]'s steps in order.
fn meet_steps(
    steps: &mut [Option<MoeStep>],
    flags: &HostFlags,
    (dev, cpu): (&Device, &CpuWeights),
    cache: &mut ExpertCache,
    times: &mut HostTimes,
    plan: AheadPlan,
) -> CudaResult<()> {
    // This layer's experts guessed (missing from the card) at the previous layer's point.
    let mut guess: Vec<usize> = Vec::new();
    for i in 0..steps.len() {
        let wait = || flags.wait_set(dev, route_flag(i), FLAG_WAIT);
        let waited = match guess.is_empty() {
            true => wait(),
            false => {
                let moe = step_at(steps, i)?.moe;
                let (waited, bytes) = cache.warm_beside(cpu, &moe, &guess, wait);
                times.warmed_bytes += bytes as u64;
                waited
            }
        };
        times.route_wait += waited?;
        if i > 0 && !plan.finish_at_sum {
            step_at(steps, i - 1)?.finish((dev, cpu), cache, times)?;
        }
        let next = next_step(steps, i);
        let step = step_at(steps, i)?;
        if !guess.is_empty() {
            let ids = step.host_ids.as_slice()?;
            times.guessed += guess.len() as u64;
            times.guessed_right +=
                guess.iter().filter(|&&e| ids.contains(&(e as i32))).count() as u64;
            guess.clear();
        }
        let prep = step.prepare((dev, cpu), cache, times)?;
        let mut early = Duration::ZERO;
        // The card's guess comes down behind its own flag, after the route point.
        let mut card_guess = None;
        step.experts((dev, cpu), cache, prep, times, |cache, copied, step| {
            match copied {
                true => cache.flag_after_copies(flags, staged_flag(i))?,
                false => flags.set(staged_flag(i))?,
            }
            if plan.at_route {
                let clock = Instant::now();
                let guess = step.guessed_on_card_after(dev, flags, i)?;
                copy_ahead(next, &guess, (cpu, cache))?;
                card_guess = Some(guess);
                early = clock.elapsed();
            }
            Ok(())
        })?;
        flags.set(sum_flag(i))?;
        times.ahead += early;
        // One guess of the next layer serves both the copies ahead and `--cpu-warm`.
        if plan.after_share || plan.warm {
            let clock = Instant::now();
            let card_guess = match card_guess {
                Some(g) => g,
                None => step.guessed_on_card_after(dev, flags, i)?,
            };
            let next_guess = plan.next_guess(steps, i, card_guess, (cpu, cache))?;
            if plan.after_share {
                copy_ahead(next, &next_guess, (cpu, cache))?;
                times.ahead += clock.elapsed();
            }
            if plan.warm {
                guess = next_guess;
            }
        }
        // The admissions the previous layer earned over the bus, behind this layer's copies.
        if plan.bus_later {
            let clock = Instant::now();
            cache.queue_bus_admissions(cpu)?;
            times.admit += clock.elapsed();
        }
        // This layer finished while the card computes on towards the next router (its admissions
        // planned; their copies over the bus held behind the next layer's when `bus_later`). Its
        // on-card copies read this layer's half of the scratch slots, which the next copies ahead
        // leave alone; their victims are never experts this layer routed to, which the card may
        // still be reading.
        if plan.finish_at_sum {
            step_at(steps, i)?.finish((dev, cpu), cache, times)?;
        }
    }
    // The last layer's admissions held for a next layer that does not come.
    if plan.bus_later && plan.finish_at_sum {
        let clock = Instant::now();
        cache.queue_bus_admissions(cpu)?;
        times.admit += clock.elapsed();
    }
    Ok(())
}

/// What a token's host points do with the next layer's guess (the knobs in force).
#[derive(Clone, Copy)]
struct AheadPlan {
    /// Copies ahead queued at the route point, after the layer's copies on demand (the card's guess).
    at_route: bool,
    /// Copies ahead queued once the layer's share is done.
    after_share: bool,
    /// `--cpu-warm`.
    warm: bool,
    /// The guess is the card's (else the share's threads make it after the share).
    on_card: bool,
    /// `--bus-admissions-at ahead`: a finished layer's admissions over the bus queued after the next
    /// layer's staged flag and copies ahead.
    bus_later: bool,
    /// `--finish-layers-at sum`: a layer finished once its own sum and copies ahead are queued, not at
    /// the next layer's route point.
    finish_at_sum: bool,
}

impl AheadPlan {
    fn in_force() -> AheadPlan {
        let f = crate::knobs::forward();
        let ahead = f.copy_ahead > 0;
        let on_card = guesses_on_card();
        let at_route = ahead && on_card && f.copy_ahead_at == crate::knobs::CopyAheadAt::Route;
        AheadPlan {
            at_route,
            after_share: ahead && !at_route,
            warm: f.cpu_warm,
            on_card,
            bus_later: f.bus_admissions_at == crate::knobs::BusAdmissionsAt::Ahead,
            finish_at_sum: f.finish_layers_at == crate::knobs::FinishLayersAt::Sum,
        }
    }

    /// Step `i + 1`'s experts not on the card, likeliest first: of the card's guess `on_card` (handed
    /// down at step `i`'s route point), or guessed now on the share's threads.
    fn next_guess(
        self,
        steps: &[Option<MoeStep>],
        i: usize,
        on_card: Vec<usize>,
        (cpu, cache): (&CpuWeights, &mut ExpertCache),
    ) -> CudaResult<Vec<usize>> {
        match (self.on_card, next_step(steps, i)) {
            (true, Some((layer, _))) => Ok(cache.not_resident(layer, on_card)),
            (true, None) => Ok(Vec::new()),
            (false, _) => guess_next(steps, i, (cpu, cache)),
        }
    }
}

/// Step `i + 1`'s cache layer and experts per token (none at the last step).
fn next_step(steps: &[Option<MoeStep>], i: usize) -> Option<(usize, usize)> {
    match steps.get(i + 1) {
        Some(Some(next)) => Some((next.layer, next.moe.n_expert_used)),
        _ => None,
    }
}

/// `--guess-on host`: once step `i`'s share is done (the share's threads free, host memory idle while
/// the card computes the layer between), step `i + 1`'s experts not on the card, guessed on the share's
/// threads from step `i`'s input (its page-locked copy, read in place), likeliest first; none at the
/// last step. (On one thread beside the share the guess read an f32 router at a single core's memory
/// rate, 2 MB a qwen35moe layer: some 300 µs, longer than the share, measured on an H100 host.)
fn guess_next(
    steps: &[Option<MoeStep>],
    i: usize,
    (cpu, cache): (&CpuWeights, &mut ExpertCache),
) -> CudaResult<Vec<usize>> {
    match (steps.get(i), steps.get(i + 1)) {
        (Some(Some(step)), Some(Some(next))) => {
            Ok(cache.guess_missing(cpu, &next.moe, next.layer, step.host_x.as_slice()?))
        }
        _ => Ok(Vec::new()),
    }
}

/// `--copy-ahead`: the likeliest of `guess` (as many as `--copy-ahead-us` allows, up to `--copy-ahead`) (experts of the next step, `next`: its cache
/// layer and experts per token) not on the card, copied to it while it computes the layer before.
fn copy_ahead(
    next: Option<(usize, usize)>,
    guess: &[usize],
    (cpu, cache): (&CpuWeights, &mut ExpertCache),
) -> CudaResult<()> {
    let f = crate::knobs::forward();
    let n = cache.copies_ahead(f.copy_ahead, f.copy_ahead_us);
    match next {
        Some(next) if n > 0 && !guess.is_empty() => {
            cache.copy_ahead(cpu, next, guess, n).map(|_| ())
        }
        _ => Ok(()),
    }
}

/// Step `i` of a segmented graph.
fn step_at(steps: &mut [Option<MoeStep>], i: usize) -> CudaResult<&mut MoeStep> {
    steps
        .get_mut(i)
        .and_then(Option::as_mut)
        .ok_or_else(|| CudaError::Invalid(format!("a segmented graph without step {i}")))
}

/// One captured decode call.
pub struct DecodeGraph {
    graph: LaunchGraph,
    /// `[n_vocab]`: where the replays leave the logits.
    logits: DeviceBuffer<f32>,
    /// Their host copy.
    host_logits: PinnedHost<f32>,
    inputs: GraphInputs,
    /// The embedding table and width the host fills `inputs.row` from.
    embed: (WeightId, usize),
    /// The host's copy of the token's row, kept between replays.
    host_row: Vec<f32>,
    /// The activations' buffers the launches use (kept for their addresses).
    _store: PoolStore,
    /// A segmented graph's steps (`graph` is then its last segment); empty for a whole-token graph.
    steps: MoeSteps,
}

impl DecodeGraph {
    /// Whether the token's MoE layers meet the host (between graphs, or at flags).
    pub fn segmented(&self) -> bool {
        !self.steps.steps.is_empty()
    }
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

    /// The host points' time of the graph of `rows` since the last call, if it is segmented.
    pub fn take_host_times(&mut self, rows: usize) -> Option<HostTimes> {
        let g = self.by_rows.get_mut(&rows)?;
        g.segmented().then(|| std::mem::take(&mut g.steps.times))
    }

    /// Drops the graphs whose kind (segmented or whole) is not `segmented`: what the expert cache needs
    /// changed since they were captured.
    pub fn keep_kind(&mut self, segmented: bool) {
        self.by_rows.retain(|_, g| g.segmented() == segmented);
    }
}

/// Queues a replay of the graph of `rows` for `token` at `pos0` (the caller checked [`DecodeGraphs::has`]);
/// [`logits`] waits for it. A segmented graph's host points run with `experts`, the cache. Returns whether
/// the graph was segmented (its routings counted by the cache; a whole graph's are the caller's to count).
pub fn replay(
    (dev, cpu): (&Device, &CpuWeights),
    graphs: &mut DecodeGraphs,
    rows: usize,
    (token, pos0): (u32, usize),
    experts: Option<&mut ExpertCache>,
) -> CudaResult<bool> {
    let g = graphs
        .by_rows
        .get_mut(&rows)
        .ok_or_else(|| CudaError::Invalid(format!("no decode graph for {rows} rows")))?;
    let (table, n_embd) = g.embed;
    g.host_row.resize(n_embd, 0.0);
    cpu.row_into(table, token as usize, &mut g.host_row);
    let r = g
        .inputs
        .row
        .as_mut()
        .ok_or_else(|| CudaError::Invalid("a decode graph without its row".into()))?;
    dev.write(&g.host_row, r)?;
    dev.write(&[pos0 as i32], &mut g.inputs.positions)?;
    if !g.segmented() {
        // A whole graph reads the layers' tables: what segmented tokens left marked is rewritten first.
        if let Some(cache) = experts {
            cache.flush_deferred(dev)?;
        }
        g.graph.replay()?;
        return Ok(false);
    }
    let cache = experts.ok_or_else(|| {
        CudaError::Invalid("a segmented decode graph without its expert cache".into())
    })?;
    g.steps.replay((dev, cpu), cache, &g.graph)?;
    Ok(true)
}

/// The logits of the last replay of `rows` (waits for it).
pub fn logits(dev: &Device, graphs: &mut DecodeGraphs, rows: usize) -> CudaResult<Vec<f32>> {
    let g = graphs
        .by_rows
        .get_mut(&rows)
        .ok_or_else(|| CudaError::Invalid(format!("no decode graph for {rows} rows")))?;
    let logits = dev.download_pinned(&g.logits, &mut g.host_logits)?.to_vec();
    if let Some(token) = g.steps.flags.as_ref().and_then(HostFlags::timed_out) {
        return Err(CudaError::Invalid(format!(
            "the card gave up waiting for the host at token {token} (after {FLAG_WAIT:?}): this \
             sequence's state is not to be trusted"
        )));
    }
    Ok(logits)
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
    let mut steps = MoeSteps::default();
    // Decided once for the call and its capture (uploads completing during the call must not change it).
    let segmented = experts.as_deref().is_some_and(|c| !c.decode_on_card());
    let (logits, embed) = {
        let mode = GraphMode {
            inputs: &mut inputs,
            capturing: false,
            embed: None,
            segmented,
            steps: &mut steps,
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
            (inputs, steps, segmented),
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
    (mut inputs, mut steps, segmented): (GraphInputs, MoeSteps, bool),
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
    let made_steps = steps.steps.len();
    // Two host points per step, three with a shared expert between the router and the experts.
    let cuts: usize = steps
        .steps
        .iter()
        .map(|s| 2 + s.as_ref().is_some_and(|s| s.shared) as usize)
        .sum();
    steps.next = 0;
    let by_flags = host_points_by_flags() && made_steps > 0;
    if by_flags {
        let flags = HostFlags::new(dev, FLAGS_PER_STEP * made_steps)?;
        if let Some(cache) = experts.as_deref_mut() {
            cache.ready_flags(&flags)?;
        }
        steps.flags = Some(flags);
    }
    let launch_graph = dev.capture(|_| {
        let mode = GraphMode {
            inputs: &mut inputs,
            capturing: true,
            embed: None,
            segmented,
            steps: &mut steps,
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
    let cuts = if by_flags { 0 } else { cuts };
    if steps.next != made_steps || steps.segments.len() != cuts {
        return Err(CudaError::Invalid(format!(
            "the capture reached {} of the call's {made_steps} MoE steps",
            steps.next
        )));
    }
    let store = Pool::into_store(pool)
        .ok_or_else(|| CudaError::Invalid("a captured activation outlived the call".into()))?;
    let host_logits = dev.pinned(logits.len())?;
    Ok(DecodeGraph {
        graph: launch_graph,
        logits,
        host_logits,
        inputs,
        embed,
        host_row: Vec::new(),
        _store: store,
        steps,
    })
}
