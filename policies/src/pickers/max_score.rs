//! `max-score-picker`: highest total score first, ties broken at random (llm-d shuffles
//! before sorting); candidates in a higher tier lead, and within a tier the score order stands.

use super::{tier, Picker};
use crate::rng::SplitMix64;

pub struct MaxScore;

impl Picker for MaxScore {
    fn name(&self) -> &'static str {
        "max-score-picker"
    }

    fn doc(&self) -> &'static str {
        "highest weighted total first (seeded random tie-break), sticky then affine candidates leading"
    }

    fn pick(&self, totals: &[f64], tiers: &[u8], seed: u64) -> Vec<usize> {
        let mut order = max_score(totals, totals.len(), seed);
        by_tier(&mut order, |i| tiers.get(i).copied().unwrap_or(tier::NONE));
        order
    }
}

/// Order candidate positions by descending score with a seeded random tie-break, keep `max`.
pub fn max_score(scores: &[f64], max: usize, seed: u64) -> Vec<usize> {
    let mut rng = SplitMix64::new(seed);
    let mut order: Vec<(usize, f64, u64)> = scores
        .iter()
        .enumerate()
        .map(|(i, &s)| (i, if s.is_finite() { s } else { f64::NEG_INFINITY }, rng.next_u64()))
        .collect();
    order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.2.cmp(&b.2)));
    order.into_iter().take(max.max(1)).map(|(i, _, _)| i).collect()
}

/// Reorder positions (already in score order) so higher tiers lead; within a tier the score
/// order stands (a stable sort). One logic for the scheduler and the custom-scorer picker.
pub fn by_tier(order: &mut [usize], tier: impl Fn(usize) -> u8) {
    order.sort_by_key(|&i| std::cmp::Reverse(tier(i)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn highest_first_and_ties_vary_with_seed() {
        assert_eq!(max_score(&[0.1, 0.9, 0.5], 3, 1), vec![1, 2, 0]);
        assert_eq!(max_score(&[0.1, 0.9, 0.5], 1, 1), vec![1]);
        assert_eq!(max_score(&[f64::NAN, 0.2], 2, 1), vec![1, 0]);
        let firsts: std::collections::HashSet<usize> = (0..64).map(|s| max_score(&[1.0; 4], 1, s)[0]).collect();
        assert!(firsts.len() >= 3, "ties should spread over candidates, got {firsts:?}");
        assert_eq!(max_score(&[1.0; 4], 4, 9), max_score(&[1.0; 4], 4, 9));
    }

    #[test]
    fn higher_tiers_lead_and_keep_their_score_order() {
        let mut order = vec![3, 0, 2, 1, 4];
        let tiers = [tier::AFFINE, tier::NONE, tier::AFFINE, tier::NONE, tier::STICKY];
        by_tier(&mut order, |i| tiers[i]);
        assert_eq!(order, vec![4, 0, 2, 3, 1]);
        let mut flat = vec![2, 1, 0];
        by_tier(&mut flat, |_| tier::NONE);
        assert_eq!(flat, vec![2, 1, 0], "no tiers: the score order stands");
        assert_eq!(MaxScore.pick(&[0.1, 0.9, 0.5], &[tier::AFFINE, 0, 0], 1), vec![0, 1, 2]);
    }
}
