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
//!   written to the card per layer as F or 0 (`[n_expert]` floats the router kernels read, so a decode
//!   graph's replays read the residency of their own token). Experts in scratch slots (a prompt call's
//!   staged ones, a token's copies ahead or on demand) are not cached: they are there for one token,
//!   and a copy ahead is the guess of the unbiased choice. The expert tables are not the signal: a
//!   segmented token's layers' tables are rewritten only for their next reader (so they lag the
//!   residency), with `--missing-experts mapped` every entry is non-null, and a prompt's point at scratch.
//! - **When the vectors are written**: at the start of each single-token call, for the layers whose
//!   residency changed since ([`super::policy::CachePolicy::take_residency_changes`]), in stream order
//!   before the token's launches. So a token routes by the residency at its start: an expert that a later
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

/// The bias vectors on the card, one per MoE layer of the cache (none while off).
#[derive(Default)]
pub struct DeviceBias {
    f: f32,
    vectors: Vec<DeviceBuffer<f32>>,
}

impl DeviceBias {
    /// Vectors of `n_experts[l]` zeros for `f` > 0 (none for 0); the caller writes them before the
    /// first token that reads them.
    pub fn new(dev: &Device, f: f32, n_experts: &[usize]) -> CudaResult<DeviceBias> {
        let vectors = match is_on(f) {
            true => n_experts
                .iter()
                .map(|&n| dev.zeros::<f32>(n))
                .collect::<CudaResult<_>>()?,
            false => Vec::new(),
        };
        Ok(DeviceBias { f, vectors })
    }

    /// The bias F (0: off).
    pub fn f(&self) -> f32 {
        self.f
    }

    /// Whether the routers of single tokens get a bias.
    pub fn is_on(&self) -> bool {
        is_on(self.f) && !self.vectors.is_empty()
    }

    /// Layer `layer`'s vector on the card.
    pub fn layer(&self, layer: usize) -> Option<&DeviceBuffer<f32>> {
        self.vectors.get(layer).filter(|_| is_on(self.f))
    }

    /// Writes layer `layer`'s vector (in stream order on the compute stream).
    pub fn write(
        &mut self,
        dev: &Device,
        layer: usize,
        resident: impl Fn(usize) -> bool,
    ) -> CudaResult<()> {
        let f = self.f;
        match self.vectors.get_mut(layer) {
            Some(v) => dev.write(&vector(v.len(), f, resident), v),
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

    /// The bias vector a single token's router of `layer` reads: `--cache-bias` set and the cache lacking
    /// experts (one that holds them all chooses without it).
    pub fn selection_bias(&self, layer: usize) -> Option<&DeviceBuffer<f32>> {
        match self.bias.is_on() && !self.holds_all() {
            true => self.bias.layer(layer),
            false => None,
        }
    }

    /// Before a single-token call: the bias vectors of the layers whose residency changed since the last
    /// call (all of them after [`super::ExpertCache::set_cache_bias`]) written, in stream order before the
    /// call's launches. Nothing while the bias is off.
    pub fn refresh_bias(&mut self, dev: &Device) -> CudaResult<()> {
        if !self.bias.is_on() {
            return Ok(());
        }
        let changed = self.policy.take_residency_changes();
        let layers: Vec<usize> = match std::mem::take(&mut self.bias_stale) {
            true => (0..self.layers.len()).collect(),
            false => changed,
        };
        for layer in layers {
            let policy = &self.policy;
            let resident = |expert: usize| {
                policy
                    .resident(super::policy::ExpertKey { layer, expert })
                    .is_some()
            };
            if let Err(e) = self.bias.write(dev, layer, resident) {
                self.bias_stale = true;
                return Err(e);
            }
        }
        Ok(())
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
