//! Figures over repeated runs, and comparisons that call a tie a tie.
//!
//! Each figure of a system is kept per seed. Its interval is the range the seeds gave, from the
//! lowest to the highest. A comparison between two systems is a win only when their intervals
//! do not overlap; otherwise it is a tie, reported with both intervals. With few seeds the
//! range is the honest spread: a t-interval on three points is wider than the range itself
//! (t = 4.3 at 95%) and would claim a distribution the runs have not shown.

use serde::{Deserialize, Serialize};

/// One figure over N runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Spread {
    pub mean: f64,
    pub min: f64,
    pub max: f64,
    /// The figure of each run, in seed order.
    pub runs: Vec<f64>,
}

impl Spread {
    /// `None` when no run gave a finite figure.
    pub fn of(runs: &[f64]) -> Option<Self> {
        let finite: Vec<f64> = runs.iter().copied().filter(|v| v.is_finite()).collect();
        if finite.is_empty() {
            return None;
        }
        let mean = finite.iter().sum::<f64>() / finite.len() as f64;
        let min = finite.iter().copied().fold(f64::INFINITY, f64::min);
        let max = finite.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Some(Self { mean, min, max, runs: runs.to_vec() })
    }
}

/// Which of two systems a figure favours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The first system's interval lies wholly on the better side of the second's.
    Win,
    /// The second's lies wholly on the better side of the first's.
    Loss,
    /// The intervals overlap: the difference is within the runs' spread.
    Tie,
}

/// Compare `a` with `b` on a figure where lower is better (`lower_better`) or higher is.
pub fn verdict(a: &Spread, b: &Spread, lower_better: bool) -> Verdict {
    let (a_better, b_better) =
        if lower_better { (a.max < b.min, b.max < a.min) } else { (a.min > b.max, b.min > a.max) };
    match (a_better, b_better) {
        (true, _) => Verdict::Win,
        (_, true) => Verdict::Loss,
        _ => Verdict::Tie,
    }
}

/// The order in which run `r` visits `n` systems: rotated by one each run, so that no system
/// always runs first (on a fresh page cache) or last (after the others warmed the machine).
pub fn rotation(n: usize, r: usize) -> impl Iterator<Item = usize> {
    (0..n).map(move |i| (i + r) % n.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interval_is_the_range_of_the_runs_and_ignores_missing_ones() {
        let s = Spread::of(&[3.0, f64::NAN, 1.0, 2.0]).unwrap();
        assert_eq!((s.min, s.max, s.mean), (1.0, 3.0, 2.0));
        assert_eq!(s.runs.len(), 4, "every run is kept, in order");
        assert!(Spread::of(&[f64::NAN]).is_none());
    }

    #[test]
    fn overlapping_intervals_are_a_tie_whichever_mean_is_better() {
        let a = Spread::of(&[100.0, 104.0, 108.0]).unwrap();
        let b = Spread::of(&[107.0, 112.0, 118.0]).unwrap();
        assert_eq!(verdict(&a, &b, true), Verdict::Tie, "a's mean is lower but 108 > 107");
        let c = Spread::of(&[110.0, 120.0]).unwrap();
        assert_eq!(verdict(&a, &c, true), Verdict::Win);
        assert_eq!(verdict(&c, &a, true), Verdict::Loss);
        // Higher is better (throughput): the same intervals read the other way.
        assert_eq!(verdict(&a, &c, false), Verdict::Loss);
        assert_eq!(verdict(&c, &a, false), Verdict::Win);
    }

    #[test]
    fn each_system_leads_one_run_in_turn() {
        let firsts: Vec<usize> = (0..3).map(|r| rotation(3, r).next().unwrap()).collect();
        assert_eq!(firsts, vec![0, 1, 2]);
        let mut all: Vec<usize> = rotation(4, 5).collect();
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3]);
    }
}
