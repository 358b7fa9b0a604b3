//! How much VRAM the expert cache gets. Dense weights go first; then a warm-up call (which also leaves
//! the forward calls' scratch buffers allocated) and a measurement of the free memory; the cache gets what
//! is free less the sequence state (a warm-up call's KV rows where the caches grow with the conversation,
//! `gpu::kv_room`; the whole context with a fixed budget), the staging scratch (already allocated) and a
//! reserve (`--vram-reserve-mib`, default a 32nd of the card clamped to
//! 256–768 MiB). `--expert-budget-mib` sets the cache's size instead (still no more than what is free).

use super::policy::AdmissionRule;
use super::skip::MissingSkip;
use poly_models::arch::StateSpec;

const MIB: usize = 1 << 20;

/// The placement flags.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Placement {
    /// VRAM left free, MiB (`None`: [`default_reserve`]).
    pub reserve_mib: Option<usize>,
    /// The cache's size, bytes (`None`: all that is left; `--expert-budget-mib` gives MiB).
    pub expert_budget: Option<usize>,
    /// Uploads the cache may start per layer and token while answering (0: frozen).
    pub uploads_per_layer: usize,
    /// Which of a token's missing experts those uploads may take.
    pub admissions: Admissions,
    /// When a missing expert replaces a resident one.
    pub admission_rule: AdmissionRule,
    /// The context the sequences will have (0: the model's training context).
    pub n_ctx: usize,
    /// Don't read or write the expert profile beside the model.
    pub no_profile: bool,
    /// Copy experts through the pinned staging buffers only, never straight from the page-locked file
    /// mapping.
    pub staging_only: bool,
    /// Where a single token's uncached experts are computed.
    pub missing_experts: MissingExperts,
    /// Which of them a token may leave out (`--tail-skip`, `--skip-weight`, `--cold-mass`; off: none).
    pub skip: MissingSkip,
    /// Added to a single token's router probabilities of the cached experts before its top-k
    /// (`--cache-bias`; 0: off; [`super::bias`]).
    pub cache_bias: f32,
    /// The most tokens one forward call will carry (0: [`crate::generate::DEFAULT_UBATCH`]).
    pub call_tokens: usize,
    /// `--scratch-tokens`: the tokens of the warm-up call whose scratch the budget keeps (`None`:
    /// [`Placement::warm_tokens`]'s rule).
    pub scratch_tokens: Option<usize>,
    /// What the cache holds again when it takes back the slots it lent to a large call's scratch.
    pub lend_refill: LendRefill,
}

/// `--lend-refill`: what the expert cache fills the slots it takes back after a large prompt call with
/// (`gpu::lend`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LendRefill {
    /// The experts of the highest scores before the first call it lent to (the prompt's routings not
    /// counted).
    #[default]
    Before,
    /// The experts of the highest scores now, the prompt's routings counted: the answer goes on from the
    /// prompt's end.
    Now,
    /// The experts it held before it lent: the cache as it was.
    Resident,
}

/// Which of a token's missing experts the cache admits while answering (`--expert-admissions`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Admissions {
    /// Those copied to the card on demand for the token (copied on the card from their scratch slots),
    /// then those the CPU computed (uploaded over the bus).
    All,
    /// Only those already on the card for the token (copied on demand or ahead, copied on the card from
    /// their scratch slots): no admission reads host memory or crosses the bus, where the CPU's share
    /// and the copies compete for both. The default: measured on an H100 host at 8 GB (2026-12-06,
    /// three alternating rounds) faster than `all` on all four synthetic files (q3u +8%, q35s +3%,
    /// q3s +6%, q35u +7%), at a share of routings from VRAM within a point of `all`'s.
    #[default]
    Card,
}

/// Where a single token's uncached experts are computed (`--missing-experts`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MissingExperts {
    /// Split by measured cost: some copied to the card on demand, the rest on the CPU meanwhile (the
    /// CPU alone when experts can only be copied through the staging buffers).
    Split,
    /// All on the CPU, from the mapped file, while the card computes its own (those cached and those
    /// copied ahead, `--copy-ahead`). The default: a copy on demand sits between the route point and
    /// the card's experts, while the CPU's share runs beside them; measured on two H100 hosts at 8 GB
    /// (2026-12-06) with two copies ahead as fast as the split or faster on all four synthetic files.
    /// Small prompt calls still split their missing experts by cost.
    #[default]
    Cpu,
    /// All copied to the card on demand and computed there.
    Card,
    /// Read by the card's kernels straight from the page-locked model file over the bus: no copy, no
    /// CPU, so a token's whole forward pass stays on the card (decode graphs); prompts still stage
    /// them. The cache stays as placed while answering. Needs the file page-locked (else: `split`).
    Mapped,
}

impl Placement {
    /// Tokens of the warm-up call before the cache is sized: the scratch buffers it leaves are those the
    /// budget keeps for good. `--scratch-tokens` if given, else [`Placement::DEFAULT_SCRATCH_TOKENS`], at
    /// most the largest call's. A larger call borrows VRAM from the cache for its scratch and gives it back
    /// before the answer ([`crate::gpu::lend`]'s path, or free room above the reserve where the card has
    /// it); the cache is resized in place, so only experts new to it cross the bus. Measured through the
    /// server at 8 GB on an H100 (2026-12-07, sixteenth session) against the largest call's (2,048): a chat
    /// answer +1-6% (a larger cache), a 2,000-token prompt +21-38%, prompts of 8,000 and 30,000 within
    /// 1-4% either way, the answers after them -6% to +4% (taking 484 slots back costs 30 ms).
    pub fn warm_tokens(&self) -> usize {
        let largest = match self.call_tokens {
            0 => crate::generate::DEFAULT_UBATCH,
            n => n,
        };
        self.scratch_tokens
            .unwrap_or(Self::DEFAULT_SCRATCH_TOKENS)
            .clamp(1, largest)
    }

    /// The call whose scratch the budget keeps unless `--scratch-tokens` says otherwise.
    pub const DEFAULT_SCRATCH_TOKENS: usize = 512;

    /// Uploads per layer and token unless set otherwise.
    pub const DEFAULT_UPLOADS_PER_LAYER: usize = 2;

    /// The defaults of the command line.
    pub fn new() -> Placement {
        Placement {
            uploads_per_layer: Self::DEFAULT_UPLOADS_PER_LAYER,
            ..Placement::default()
        }
    }

    /// The settings that differ from the command line's defaults, by flag name without `--` (READY
    /// echoes them beside the execution knobs).
    pub fn non_default(&self) -> Vec<(String, String)> {
        fn name(v: impl clap::ValueEnum) -> String {
            v.to_possible_value()
                .map_or_else(String::new, |p| p.get_name().to_string())
        }
        let (d, r, dr) = (
            Placement::new(),
            self.admission_rule,
            AdmissionRule::default(),
        );
        [
            (
                self.uploads_per_layer != d.uploads_per_layer,
                "expert-uploads",
                self.uploads_per_layer.to_string(),
            ),
            (
                self.admissions != d.admissions,
                "expert-admissions",
                name(self.admissions),
            ),
            (r.decay != dr.decay, "expert-decay", r.decay.to_string()),
            (r.margin != dr.margin, "expert-margin", r.margin.to_string()),
            (
                r.noise_margin != dr.noise_margin,
                "expert-noise-margin",
                r.noise_margin.to_string(),
            ),
            (
                self.missing_experts != d.missing_experts,
                "missing-experts",
                name(self.missing_experts),
            ),
            (self.staging_only, "expert-staging-only", "on".into()),
            (
                self.skip.tail.is_some(),
                "tail-skip",
                self.skip.tail.map_or_else(String::new, |n| n.to_string()),
            ),
            (
                self.skip.weight.is_some(),
                "skip-weight",
                self.skip.weight.map_or_else(String::new, |f| f.to_string()),
            ),
            (
                self.skip.cold_mass.is_some(),
                "cold-mass",
                self.skip
                    .cold_mass
                    .map_or_else(String::new, |f| f.to_string()),
            ),
            (
                self.skip.cold_max.is_some(),
                "cold-max",
                self.skip
                    .cold_max
                    .map_or_else(String::new, |n| n.to_string()),
            ),
            (
                self.cache_bias != d.cache_bias,
                "cache-bias",
                self.cache_bias.to_string(),
            ),
            (
                self.lend_refill != d.lend_refill,
                "lend-refill",
                name(self.lend_refill),
            ),
            (
                self.scratch_tokens.is_some(),
                "scratch-tokens",
                self.scratch_tokens
                    .map_or_else(String::new, |n| n.to_string()),
            ),
        ]
        .into_iter()
        .filter(|(changed, ..)| *changed)
        .map(|(_, flag, value)| (flag.to_string(), value))
        .collect()
    }
}

/// The default reserve of a card of `total` bytes: a 32nd, at least 256 MiB and at most 768 MiB.
pub fn default_reserve(total: usize) -> usize {
    (total / 32).clamp(256 * MIB, 768 * MIB)
}

/// Bytes the card's state of a sequence of `n_ctx` tokens takes (f16 KV rows, f32 recurrent states).
pub fn state_bytes(specs: &[StateSpec], n_ctx: usize) -> usize {
    specs
        .iter()
        .map(|s| match *s {
            StateSpec::Kv {
                n_head_kv,
                head_dim_k,
                head_dim_v,
                ..
            } => n_ctx.max(1) * n_head_kv * (head_dim_k + head_dim_v) * 2,
            StateSpec::Recurrent {
                conv_kernel,
                conv_channels,
                n_v_heads,
                head_k,
                head_v,
            } => (conv_kernel.saturating_sub(1) * conv_channels + n_v_heads * head_v * head_k) * 4,
        })
        .sum()
}

/// The cache's bytes: `free` less `state` and the reserve, or the budget when one is given (at most that).
pub fn cache_bytes(p: &Placement, free: usize, total: usize, state: usize) -> usize {
    let reserve = p
        .reserve_mib
        .map_or_else(|| default_reserve(total), |m| m.saturating_mul(MIB));
    let room = free.saturating_sub(reserve).saturating_sub(state);
    match p.expert_budget {
        Some(b) => b.min(free.saturating_sub(state)),
        None => room,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_reserve_is_a_32nd_clamped() {
        assert_eq!(default_reserve(4 << 30), 256 * MIB);
        assert_eq!(default_reserve(16 << 30), 512 * MIB);
        assert_eq!(default_reserve(141 << 30), 768 * MIB);
    }

    #[test]
    fn state_counts_kv_rows_and_recurrent_states() {
        let specs = [
            StateSpec::Kv {
                n_head_kv: 4,
                head_dim_k: 128,
                head_dim_v: 128,
                window: None,
            },
            StateSpec::Recurrent {
                conv_kernel: 4,
                conv_channels: 10,
                n_v_heads: 2,
                head_k: 3,
                head_v: 5,
            },
        ];
        assert_eq!(
            state_bytes(&specs, 100),
            100 * 4 * 256 * 2 + (3 * 10 + 30) * 4
        );
    }

    #[test]
    fn budget_and_reserve() {
        let p = Placement::new();
        let total = 141 << 30;
        // Free 10 GiB, state 1 GiB, reserve 768 MiB.
        assert_eq!(
            cache_bytes(&p, 10 << 30, total, 1 << 30),
            (9 << 30) - 768 * MIB
        );
        let p = Placement {
            reserve_mib: Some(2048),
            ..Placement::new()
        };
        assert_eq!(cache_bytes(&p, 10 << 30, total, 1 << 30), 7 << 30);
        let p = Placement {
            expert_budget: Some(100 * MIB),
            ..Placement::new()
        };
        assert_eq!(cache_bytes(&p, 10 << 30, total, 1 << 30), 100 * MIB);
        let p = Placement {
            expert_budget: Some(0),
            ..Placement::new()
        };
        assert_eq!(cache_bytes(&p, 10 << 30, total, 1 << 30), 0);
        // Nothing free: nothing, never an underflow.
        assert_eq!(cache_bytes(&Placement::new(), 1 << 20, total, 1 << 30), 0);
    }

    #[test]
    fn the_budget_keeps_a_512_token_call_s_scratch_unless_told() {
        let serve = |scratch_tokens| Placement {
            call_tokens: 2048,
            scratch_tokens,
            ..Placement::new()
        };
        assert_eq!(serve(None).warm_tokens(), 512);
        // Asked: within 1 ..= the largest call; larger calls then borrow from the cache.
        assert_eq!(serve(Some(2048)).warm_tokens(), 2048);
        assert_eq!(serve(Some(100)).warm_tokens(), 100);
        assert_eq!(serve(Some(100_000)).warm_tokens(), 2048);
        // Calls of the default size (0, 512 tokens) or smaller: the largest.
        assert_eq!(Placement::new().warm_tokens(), 512);
        let small = Placement {
            call_tokens: 64,
            ..Placement::new()
        };
        assert_eq!(small.warm_tokens(), 64);
    }

    #[test]
    fn only_changed_settings_are_echoed() {
        assert!(Placement::new().non_default().is_empty());
        let p = Placement {
            uploads_per_layer: 0,
            admissions: Admissions::All,
            admission_rule: AdmissionRule {
                noise_margin: 0.0,
                ..AdmissionRule::default()
            },
            missing_experts: MissingExperts::Split,
            skip: MissingSkip {
                tail: Some(3),
                weight: Some(0.05),
                cold_mass: Some(0.1),
                cold_max: Some(2),
            },
            cache_bias: 0.25,
            scratch_tokens: Some(2048),
            ..Placement::new()
        };
        let echoed: Vec<(String, String)> = p.non_default();
        let want = [
            ("expert-uploads", "0"),
            ("expert-admissions", "all"),
            ("expert-noise-margin", "0"),
            ("missing-experts", "split"),
            ("tail-skip", "3"),
            ("skip-weight", "0.05"),
            ("cold-mass", "0.1"),
            ("cold-max", "2"),
            ("cache-bias", "0.25"),
            ("scratch-tokens", "2048"),
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()));
        assert_eq!(echoed, want);
    }
}
