//! Speed for quality, off by default (issue 23): a single token's uncached experts left out instead of
//! copied or computed on the CPU, so a partly resident answer reads less host memory at a measured
//! distance from the exact path (`polystrata verify`, `poly-engine kl`).
//!
//! - `--tail-skip N`: an uncached expert that ranks `N`+1 or later among the token's `k` choices (the
//!   router's order, likeliest first) is left out.
//! - `--skip-weight F`: an uncached expert whose routing weight is below `F` of the token's routed
//!   weight is left out (it overrides `--tail-skip`).
//! - `--cold-mass P` (with `--cold-max M`): Krasis's cold-mass pruning as issue 23 describes it — the
//!   token's lightest uncached experts are left out, lightest first, as long as together they carry at
//!   most `P` of its routed weight and number at most `M` (default: no cap but the budget). It is not
//!   `--skip-weight` under another name: that one judges each expert against `F` alone, so several light
//!   experts may together take far more than `F` of the token and nothing caps their number, while the
//!   cold mass bounds what a token loses as a whole (and by count); nor `--tail-skip`, which goes by rank
//!   whatever the weights. It overrides both.
//!
//! A left-out expert adds nothing to the token's weighted sum (its table entry stays null, and the card's
//! kernels write zeros for it); the others keep their weights (no renormalization, as a dropped expert
//! in Krasis's cold-mass pruning). Prompts are untouched, and the cache's admissions still count the
//! routing, so an expert left out often is admitted like any other. Experts cached on the card are never
//! left out: the skip costs nothing there.

/// What a single token may leave out of its uncached experts (the placement's `--tail-skip`,
/// `--skip-weight`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MissingSkip {
    /// Leave out those ranked `tail`+1 or later.
    pub tail: Option<usize>,
    /// Leave out those below this share of the token's routed weight (0 < F < 1); overrides `tail`.
    pub weight: Option<f32>,
    /// Leave out the lightest, together at most this share of the token's routed weight (0 < P < 1);
    /// overrides `weight` and `tail`.
    pub cold_mass: Option<f32>,
    /// With `cold_mass`: at most this many (none: no cap but the share).
    pub cold_max: Option<usize>,
}

impl MissingSkip {
    /// Nothing is left out (the default: exact).
    pub fn is_off(&self) -> bool {
        self.tail.is_none() && self.weight.is_none() && self.cold_mass.is_none()
    }

    /// Of a token's `missing` routings (its slots `j` among the `k` choices, in the router's order,
    /// likeliest first) with the token's routing `weights` (`[k]`), those left out.
    pub fn left_out(&self, missing: &[usize], weights: &[f32]) -> Vec<usize> {
        if let Some(p) = self.cold_mass {
            return cold_mass(missing, weights, p, self.cold_max.unwrap_or(usize::MAX));
        }
        match (self.weight, self.tail) {
            (Some(f), _) => {
                let total: f32 = weights.iter().sum();
                missing
                    .iter()
                    .copied()
                    .filter(|&j| weights.get(j).is_some_and(|&w| w < f * total))
                    .collect()
            }
            (None, Some(n)) => missing.iter().copied().filter(|&j| j >= n).collect(),
            (None, None) => Vec::new(),
        }
    }

    /// The share of the token's routed weight that `left` (slots) carried.
    pub fn weight_of(left: &[usize], weights: &[f32]) -> f64 {
        let total: f64 = weights.iter().map(|&w| w as f64).sum();
        if total <= 0.0 {
            return 0.0;
        }
        left.iter()
            .filter_map(|&j| weights.get(j))
            .map(|&w| w as f64)
            .sum::<f64>()
            / total
    }
}

/// `--cold-mass`: of the `missing` slots, the lightest by `weights`, lightest first (equal weights: the
/// later choice first, which the router ranked lower), while together they carry at most `p` of the
/// routed weight and number at most `max`; in slot order.
fn cold_mass(missing: &[usize], weights: &[f32], p: f32, max: usize) -> Vec<usize> {
    let total: f64 = weights.iter().map(|&w| w as f64).sum();
    let budget = p as f64 * total;
    let mut by_weight: Vec<usize> = missing
        .iter()
        .copied()
        .filter(|&j| j < weights.len())
        .collect();
    by_weight.sort_by(|&a, &b| weights[a].total_cmp(&weights[b]).then(b.cmp(&a)));
    let mut mass = 0.0f64;
    let mut left = Vec::new();
    for j in by_weight {
        let w = weights[j] as f64;
        // The rest are no lighter: once one does not fit, none does.
        if left.len() >= max || mass + w > budget {
            break;
        }
        mass += w;
        left.push(j);
    }
    left.sort_unstable();
    left
}

/// What the skip left out so far (DONE's and STATS's figures).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Skipped {
    /// Single-token MoE steps (a token's layer) seen while a skip was set.
    pub steps: u64,
    /// Experts left out (a token's routing each).
    pub experts: u64,
    /// The routed weight they carried, summed over the steps as shares of each step's routed weight.
    pub weight: f64,
    /// Expert bytes not read (neither copied nor computed).
    pub bytes: u64,
}

impl Skipped {
    /// What was left out since `before`.
    pub fn since(&self, before: &Skipped) -> Skipped {
        Skipped {
            steps: self.steps - before.steps,
            experts: self.experts - before.experts,
            weight: self.weight - before.weight,
            bytes: self.bytes - before.bytes,
        }
    }

    /// The mean share of a step's routed weight left out (0 without steps).
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

    #[test]
    fn off_leaves_nothing_out() {
        let s = MissingSkip::default();
        assert!(s.is_off());
        assert!(s.left_out(&[0, 3, 7], &[0.5; 8]).is_empty());
    }

    #[test]
    fn tail_skip_leaves_out_the_uncached_ranked_past_n() {
        let s = MissingSkip {
            tail: Some(2),
            ..MissingSkip::default()
        };
        // Slots 0..8 in the router's order; 1, 2, 5 and 7 are uncached.
        assert_eq!(s.left_out(&[1, 2, 5, 7], &[]), vec![2, 5, 7]);
        // Tail 0: every uncached one.
        let all = MissingSkip {
            tail: Some(0),
            ..MissingSkip::default()
        };
        assert_eq!(all.left_out(&[1, 2], &[]), vec![1, 2]);
        // Tail k: none.
        let none = MissingSkip {
            tail: Some(8),
            ..MissingSkip::default()
        };
        assert!(none.left_out(&[1, 2, 7], &[]).is_empty());
    }

    #[test]
    fn skip_weight_leaves_out_the_light_ones_and_overrides_tail() {
        let s = MissingSkip {
            tail: Some(0),
            weight: Some(0.1),
            ..MissingSkip::default()
        };
        let w = [0.4, 0.25, 0.15, 0.08, 0.06, 0.03, 0.02, 0.01];
        // Uncached: 1 (0.25), 3 (0.08), 6 (0.02). The tail of 0 would take all three.
        assert_eq!(s.left_out(&[1, 3, 6], &w), vec![3, 6]);
        let share = MissingSkip::weight_of(&[3, 6], &w);
        assert!((share - 0.10).abs() < 1e-6, "{share}");
        // Against the routed weight, not 1: weights scaled by 2 leave out the same.
        let w2: Vec<f32> = w.iter().map(|x| x * 2.0).collect();
        assert_eq!(s.left_out(&[1, 3, 6], &w2), vec![3, 6]);
        assert_eq!(MissingSkip::weight_of(&[], &w), 0.0);
        assert_eq!(MissingSkip::weight_of(&[1], &[0.0; 8]), 0.0);
    }

    /// Where the cold mass differs from `--skip-weight`: a budget over the experts together, and a cap.
    #[test]
    fn cold_mass_leaves_out_the_lightest_within_a_budget_and_a_count() {
        let w = [0.4f32, 0.2, 0.12, 0.09, 0.08, 0.05, 0.04, 0.02];
        // Uncached: 2 (0.12), 4 (0.08), 5 (0.05), 6 (0.04), 7 (0.02).
        let missing = [2, 4, 5, 6, 7];
        let cold = |p: f32, max: Option<usize>| MissingSkip {
            cold_mass: Some(p),
            cold_max: max,
            ..MissingSkip::default()
        };
        // 0.1 of the mass: 0.02 + 0.04 = 0.06, + 0.05 = 0.11 does not fit.
        assert_eq!(cold(0.1, None).left_out(&missing, &w), vec![6, 7]);
        // `--skip-weight 0.1` would leave out all four below 0.1 (0.19 of the mass together).
        let each = MissingSkip {
            weight: Some(0.1),
            ..MissingSkip::default()
        };
        assert_eq!(each.left_out(&missing, &w), vec![4, 5, 6, 7]);
        // 0.2 of the mass: 0.02 + 0.04 + 0.05 + 0.08 = 0.19; the cap takes the two lightest.
        assert_eq!(cold(0.2, None).left_out(&missing, &w), vec![4, 5, 6, 7]);
        assert_eq!(cold(0.2, Some(2)).left_out(&missing, &w), vec![6, 7]);
        assert!(cold(0.2, Some(0)).left_out(&missing, &w).is_empty());
        // Against the routed weight, not 1; cached experts never.
        let w2: Vec<f32> = w.iter().map(|x| x * 3.0).collect();
        assert_eq!(cold(0.1, None).left_out(&missing, &w2), vec![6, 7]);
        assert!(cold(0.5, None).left_out(&[], &w).is_empty());
        // A budget below the lightest leaves nothing out; equal weights go later choice first.
        assert!(cold(0.01, None).left_out(&missing, &w).is_empty());
        assert_eq!(
            cold(0.3, Some(1)).left_out(&[1, 2], &[0.5, 0.25, 0.25]),
            vec![2]
        );
        // It overrides the other two.
        let all = MissingSkip {
            tail: Some(0),
            weight: Some(0.5),
            cold_mass: Some(0.1),
            cold_max: None,
        };
        assert_eq!(all.left_out(&missing, &w), vec![6, 7]);
        assert!(!cold(0.1, None).is_off());
    }

    #[test]
    fn the_figures_since_a_point_and_their_mean() {
        let a = Skipped {
            steps: 10,
            experts: 4,
            weight: 0.3,
            bytes: 400,
        };
        let b = Skipped {
            steps: 30,
            experts: 9,
            weight: 0.7,
            bytes: 900,
        };
        let d = b.since(&a);
        assert_eq!((d.steps, d.experts, d.bytes), (20, 5, 500));
        assert!((d.mean_weight() - 0.02).abs() < 1e-12);
        assert_eq!(Skipped::default().mean_weight(), 0.0);
    }
}
