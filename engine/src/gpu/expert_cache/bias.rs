//! Speed for quality, off by default (issue 23): `--cache-bias F` leans a single token's routing to the
//! experts in VRAM. F is added to the router's probability (softmax or sigmoid, the score the top-k
//! compares) of every expert the cache holds before the top-k, so an uncached expert that ranks barely
//! above a cached one gives way to it and is neither copied nor computed on the CPU.
//!
//! - **Weights from the unbiased scores.** The bias only chooses; each chosen expert's routing weight is
//!   its unbiased probability, renormalized over the chosen ones where the model renormalizes — as
//!   llama.cpp treats DeepSeek V3's and LFM2's selection bias (`exp_probs_b`,
//!   [`poly_kernels::ops::topk::route_biased`]). Weighting by the biased score instead would give a
//!   cached expert F more weight than the router meant even when it was chosen anyway, and with F near
//!   1 flatten every token's mixture towards uniform: the approximation would reach every token, not
//!   only those whose choice it changed.
//! - **What counts as cached**: an expert resident in the cache's pool (the policy's `resident`),
//!   written to the card as F or 0 per expert (one buffer of every layer's `n_expert` floats, each
//!   layer's router reading its own part, so a decode graph's replays read the residency of their own
//!   token). Experts in scratch slots (a prompt call's
//!   staged ones, a token's copies ahead or on demand) are not cached: they are there for one token,
//!   and a copy ahead is the guess of the unbiased choice. The expert tables are not the signal: a
//!   segmented token's layers' tables are rewritten only for their next reader (so they lag the
//!   residency), with `--missing-experts mapped` every entry is non-null, and a prompt's point at scratch.
//! - **When the vectors are written**: at each single-token call where a layer's residency changed since
//!   the last ([`super::policy::CachePolicy::take_residency_changes`]), once its KV rows found room (which
//!   may give up or take back slots), in stream order before its launches: those layers' parts of a host
//!   copy are rewritten and the buffer goes to the card in one copy (an admission changes a few layers a
//!   token; one write per layer would cost an API call each). So a token routes by the residency at its start: an expert that a later
//!   layer's admission evicts during the token may still be preferred (and is then copied or computed on
//!   the CPU, exact either way), and one admitted during the token counts from the next.
//! - **Where**: single-token calls (answers) on a partly resident cache; prompt calls are untouched (a
//!   prompt stages its uncached experts in bulk, where one more is cheap, and its routing shapes the
//!   state every answer reads). A cache that holds every expert chooses without the bias.
//! - **F**: 0 < F ≤ 1. Probabilities lie in [0, 1], so F = 1 puts every cached expert before every
//!   uncached one (a token's k experts are all cached where the layer holds k); a larger F would choose
//!   the same while rounding the cached experts' scores more coarsely (near-ties then fall to the lower
//!   id). A small F (0.01–0.05) swaps only near-ties. F = 0 is off: the routers get no bias at all, the
//!   launches and values of a run without the flag.
//!
//! The guesses of the next layer's experts for `--copy-ahead` and `--cpu-warm` lean the same way (the
//! card's guess reads the layer's vector; the host's, `--guess-on host`, the host copy of it), so what is
//! copied ahead is what the biased choice will want.
//!
//! The router kernels also say which of a token's choices the bias made (those not among the unbiased
//! top-k): DONE's `experts_swapped_in` and STATS count them and the share of the routed weight they carry
//! ([`Swapped`]), where the host sees the token's routing (not with `--missing-experts mapped`, whose
//! tokens need no host).

use poly_kernels::cuda::{CudaResult, Device, DeviceBuffer};

/// The placement's `--cache-bias` (0: off).
pub fn is_on(f: f32) -> bool {
    f > 0.0
}

/// Layer `l`'s vector: `f` where `resident(e)`, else 0.
pub fn vector(n_expert: usize, f: f32, resident: impl Fn(usize) -> bool) -> Vec<f32> {
    (0..n_expert)
        .map(|e| if resident(e) { f } else { 0.0 })
        .collect()
}

/// The bias vectors on the card: one buffer of every MoE layer's `n_expert` floats (none while off),
/// and its host copy.
#[derive(Default)]
pub struct DeviceBias {
    f: f32,
    /// `[layer]`: where the layer's vector starts; one more entry, the end.
    offsets: Vec<usize>,
    host: Vec<f32>,
    buffer: Option<DeviceBuffer<f32>>,
}

impl DeviceBias {
    /// Vectors of `n_experts[l]` zeros for `f` > 0 (none for 0); the caller writes them before the
    /// first token that reads them.
    pub fn new(dev: &Device, f: f32, n_experts: &[usize]) -> CudaResult<DeviceBias> {
        let mut offsets = vec![0];
        for &n in n_experts {
            offsets.push(offsets[offsets.len() - 1] + n);
        }
        let total = offsets[offsets.len() - 1];
        let buffer = match is_on(f) && total > 0 {
            true => Some(dev.zeros::<f32>(total)?),
            false => None,
        };
        Ok(DeviceBias {
            f,
            host: vec![0.0; if buffer.is_some() { total } else { 0 }],
            offsets,
            buffer,
        })
    }

    /// Whether the routers of single tokens get a bias.
    pub fn is_on(&self) -> bool {
        self.buffer.is_some()
    }

    /// Layer `layer`'s vector on the card: the buffer and where in it the vector starts.
    pub fn layer(&self, layer: usize) -> Option<(&DeviceBuffer<f32>, usize)> {
        let start = *self.offsets.get(layer)?;
        self.offsets.get(layer + 1)?;
        self.buffer.as_ref().map(|b| (b, start))
    }

    /// Rewrites layer `layer`'s part of the host copy (F where `resident`).
    pub fn set_layer(&mut self, layer: usize, resident: impl Fn(usize) -> bool) {
        let (Some(&start), Some(&end)) = (self.offsets.get(layer), self.offsets.get(layer + 1))
        else {
            return;
        };
        let f = self.f;
        if let Some(part) = self.host.get_mut(start..end) {
            for (e, v) in part.iter_mut().enumerate() {
                *v = if resident(e) { f } else { 0.0 };
            }
        }
    }

    /// Layer `layer`'s part of the host copy (what the card holds since the last upload).
    pub fn host_layer(&self, layer: usize) -> Option<&[f32]> {
        let (&start, &end) = (self.offsets.get(layer)?, self.offsets.get(layer + 1)?);
        self.host.get(start..end).filter(|_| self.is_on())
    }

    /// The host copy to the card (in stream order on the compute stream).
    pub fn upload(&mut self, dev: &Device) -> CudaResult<()> {
        match self.buffer.as_mut() {
            Some(b) => dev.write(&self.host, b),
            None => Ok(()),
        }
    }
}

impl super::ExpertCache {
    /// Leans single tokens' routing to the cached experts by `f` (`--cache-bias`; 0: off). The vectors
    /// are written before the next single token ([`super::ExpertCache::refresh_bias`]).
    pub fn set_cache_bias(&mut self, dev: &Device, f: f32) -> CudaResult<()> {
        let sizes: Vec<usize> = self.layers.iter().map(|l| l.n_expert).collect();
        self.bias = DeviceBias::new(dev, f, &sizes)?;
        self.bias_stale = true;
        Ok(())
    }

    /// The bias vector a single token's router of `layer` reads (the buffer and the vector's offset in
    /// it): `--cache-bias` set and the cache lacking experts (one that holds them all chooses without it).
    pub fn selection_bias(&self, layer: usize) -> Option<(&DeviceBuffer<f32>, usize)> {
        match self.holds_all() {
            true => None,
            false => self.bias_vector(layer),
        }
    }

    /// The host's copy of the vector a single token's router of `layer` reads (as
    /// [`super::ExpertCache::selection_bias`]), for the host's guess of its choice (`--guess-on host`).
    pub fn host_bias(&self, layer: usize) -> Option<&[f32]> {
        match self.holds_all() {
            true => None,
            false => self.bias.host_layer(layer),
        }
    }

    /// The bias vector of `layer` whenever `--cache-bias` is set (a segmented step made biased keeps its
    /// bias: its downloads include the choices' word).
    pub fn bias_vector(&self, layer: usize) -> Option<(&DeviceBuffer<f32>, usize)> {
        self.bias.layer(layer)
    }

    /// Before a single-token call: the bias vectors of the layers whose residency changed since the last
    /// call (all of them after [`super::ExpertCache::set_cache_bias`]) rewritten and the buffer written to
    /// the card in one copy, in stream order before the call's launches. Nothing while the bias is off or
    /// nothing changed.
    pub fn refresh_bias(&mut self, dev: &Device) -> CudaResult<()> {
        if !self.bias.is_on() {
            return Ok(());
        }
        let changed = self.policy.take_residency_changes();
        let layers: Vec<usize> = match std::mem::take(&mut self.bias_stale) {
            true => (0..self.layers.len()).collect(),
            false => changed,
        };
        if layers.is_empty() {
            return Ok(());
        }
        for layer in layers {
            let policy = &self.policy;
            let resident = |expert: usize| {
                policy
                    .resident(super::policy::ExpertKey { layer, expert })
                    .is_some()
            };
            self.bias.set_layer(layer, resident);
        }
        let r = self.bias.upload(dev);
        // A failed write leaves the card's copy in doubt: all of it again next time.
        self.bias_stale = r.is_err();
        r
    }
}

/// What the bias changed so far (DONE's and STATS's figures).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Swapped {
    /// Single-token MoE steps (a token's layer) whose routing the host saw while the bias was on.
    pub steps: u64,
    /// Routed choices the bias made (cached experts chosen in place of uncached ones).
    pub experts: u64,
    /// The routed weight they carry, summed over the steps as shares of each step's routed weight.
    pub weight: f64,
}

impl Swapped {
    /// Counts one step: the router's `changed` bits (bit `j`: choice `j` is the bias's) and the step's
    /// routing `weights` (`[k]`).
    pub fn add(&mut self, changed: u32, weights: &[f32]) {
        self.steps += 1;
        let chosen: Vec<usize> = (0..weights.len().min(32))
            .filter(|&j| changed & (1 << j) != 0)
            .collect();
        self.experts += chosen.len() as u64;
        self.weight += super::skip::MissingSkip::weight_of(&chosen, weights);
    }

    /// What changed since `before`.
    pub fn since(&self, before: &Swapped) -> Swapped {
        Swapped {
            steps: self.steps - before.steps,
            experts: self.experts - before.experts,
            weight: self.weight - before.weight,
        }
    }

    /// The mean share of a step's routed weight that went to experts the bias chose (0 without steps).
    pub fn mean_weight(&self) -> f64 {
        match self.steps {
            0 => 0.0,
            n => self.weight / n as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use poly_kernels::ops::topk::{changed_by_bias, route, route_biased, Gating};

    #[test]
    fn the_vector_is_f_on_the_resident_experts() {
        let v = vector(6, 0.25, |e| e == 1 || e == 4);
        assert_eq!(v, vec![0.0, 0.25, 0.0, 0.0, 0.25, 0.0]);
        assert!(vector(3, 0.5, |_| false).iter().all(|&x| x == 0.0));
        assert!(!is_on(0.0) && is_on(0.01));
    }

    /// The rule the card applies (the CPU's `route_biased` with this module's vector): a bias of 1 takes
    /// every choice from the cached experts while k exist, the weights stay the unbiased probabilities,
    /// a small bias swaps only near-ties, and a zero bias chooses as none.
    #[test]
    fn the_bias_leans_the_choice_to_cached_experts_and_keeps_the_weights() {
        // Softmax probabilities of 8 experts; 2, 5, 6 and 7 cached.
        let logits = [2.0f32, 1.9, 1.0, 1.5, 0.2, 1.85, -1.0, 0.5];
        let cached = |e: usize| [2, 5, 6, 7].contains(&e);
        let k = 3;
        let plain = route(&logits, Gating::Softmax, k, true, 1.0);
        let ids = |r: &[(u32, f32)]| r.iter().map(|p| p.0).collect::<Vec<u32>>();
        assert_eq!(ids(&plain), vec![0, 1, 5]);
        // A bias of 1: all three from the cached ones, in their unbiased order.
        let full = vector(8, 1.0, cached);
        let all = route_biased(&logits, Gating::Softmax, Some(&full), k, true, 1.0);
        assert_eq!(ids(&all), vec![5, 2, 7]);
        assert_eq!(changed_by_bias(&logits, Gating::Softmax, &full, k), 0b110);
        // Weights: the unbiased probabilities renormalized over the three.
        let mut p = logits.map(|l| l.exp());
        let z: f32 = p.iter().sum();
        p.iter_mut().for_each(|v| *v /= z);
        let s = p[5] + p[2] + p[7];
        for (e, w) in &all {
            assert!((w - p[*e as usize] / s).abs() < 1e-5, "{e}: {w}");
        }
        // A small bias: only expert 5 (just below expert 1) moves up; 2 stays out.
        let small = vector(8, 0.02, cached);
        let near = route_biased(&logits, Gating::Softmax, Some(&small), k, true, 1.0);
        assert_eq!(ids(&near), vec![0, 5, 1]);
        assert_eq!(changed_by_bias(&logits, Gating::Softmax, &small, k), 0);
        // A bias that lifts expert 2 (0.088) over expert 1 (0.217), not over 0 (0.239); 5 goes first.
        let mid = vector(8, 0.14, cached);
        let r = route_biased(&logits, Gating::Softmax, Some(&mid), k, true, 1.0);
        assert_eq!(ids(&r), vec![5, 0, 2]);
        assert_eq!(changed_by_bias(&logits, Gating::Softmax, &mid, k), 0b100);
        // Zero: the unbiased choice and weights.
        let zero = vector(8, 0.0, cached);
        assert_eq!(
            route_biased(&logits, Gating::Softmax, Some(&zero), k, true, 1.0),
            plain
        );
    }

    /// The host copy of one buffer for all layers: each layer's part at its offset, rewritten alone.
    #[test]
    fn each_layer_has_its_part_of_the_one_buffer() {
        let mut b = DeviceBias {
            f: 0.5,
            offsets: vec![0, 3, 7],
            host: vec![0.0; 7],
            buffer: None,
        };
        b.set_layer(1, |e| e == 0 || e == 3);
        assert_eq!(b.host, vec![0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.5]);
        b.set_layer(0, |e| e == 2);
        assert_eq!(b.host[..3], [0.0, 0.0, 0.5]);
        b.set_layer(1, |_| false);
        assert_eq!(b.host[3..], [0.0; 4]);
        // A layer past the end changes nothing; without a buffer no layer is offered.
        b.set_layer(2, |_| true);
        assert_eq!(b.host.iter().filter(|&&v| v > 0.0).count(), 1);
        assert!(b.layer(0).is_none() && b.host_layer(1).is_none() && !b.is_on());
    }

    #[test]
    fn swapped_choices_count_their_share_of_the_routed_weight() {
        let mut s = Swapped::default();
        let w = [0.4f32, 0.3, 0.2, 0.1];
        s.add(0b1010, &w);
        assert_eq!((s.steps, s.experts), (1, 2));
        assert!((s.weight - 0.4).abs() < 1e-6);
        s.add(0, &w);
        assert_eq!((s.steps, s.experts), (2, 2));
        assert!((s.mean_weight() - 0.2).abs() < 1e-6);
        // Bits past k are not choices.
        let before = s;
        s.add(0b1_0000, &w);
        let d = s.since(&before);
        assert_eq!((d.steps, d.experts), (1, 0));
        assert_eq!(d.weight, 0.0);
        assert_eq!(Swapped::default().mean_weight(), 0.0);
    }
}
