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

    /// [`max_score`] then [`by_tier`], in one unstable sort: the keys (tier, score, the seeded
    /// draw, position) are distinct, so no stable sort and its scratch buffer are needed.
    fn pick(&self, totals: &[f64], tiers: &[u8], seed: u64) -> Vec<usize> {
        let mut keyed = crate::scratch::Buf::<(usize, f64, u64)>::take();
        keyed.extend(keyed_iter(totals, seed));
        let tier_of = |i: usize| tiers.get(i).copied().unwrap_or(tier::NONE);
        keyed.sort_unstable_by(|a, b| {
            tier_of(b.0).cmp(&tier_of(a.0)).then(b.1.total_cmp(&a.1)).then(a.2.cmp(&b.2)).then(a.0.cmp(&b.0))
        });
        keyed.iter().map(|&(i, _, _)| i).collect()
    }
}

/// Order candidate positions by descending score with a seeded random tie-break, keep `max`.
pub fn max_score(scores: &[f64], max: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<(usize, f64, u64)> = keyed_iter(scores, seed).collect();
    order.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.2.cmp(&b.2)).then(a.0.cmp(&b.0)));
    order.into_iter().take(max.max(1)).map(|(i, _, _)| i).collect()
}

/// Each position with its score (a non-finite one last) and its seeded tie-break draw.
fn keyed_iter(scores: &[f64], seed: u64) -> impl Iterator<Item = (usize, f64, u64)> + '_ {
    let mut rng = SplitMix64::new(seed);
    scores.iter().enumerate().map(move |(i, &s)| (i, if s.is_finite() { s } else { f64::NEG_INFINITY }, rng.next_u64()))
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
        // One sort gives what the two steps give.
        for seed in 0..50u64 {
            let totals: Vec<f64> = (0..40).map(|i| ((i * 7 + seed as usize) % 5) as f64).collect();
            let tiers: Vec<u8> =
                (0..40).map(|i| [tier::NONE, tier::AFFINE, tier::STICKY][(i * 3 + seed as usize) % 7 % 3]).collect();
            let mut two = max_score(&totals, totals.len(), seed);
            by_tier(&mut two, |i| tiers[i]);
            assert_eq!(MaxScore.pick(&totals, &tiers, seed), two, "seed {seed}");
        }
    }
}
