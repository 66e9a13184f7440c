//! `queue-scorer`: min-max normalised load, `(max - q) / (max - min)`; all equal gives 1.
//! Load is the engine's waiting queue plus the requests this scheduler has in flight to it
//! (metrics lag by a scrape interval; in-flight counts do not). While the host is silent, the
//! in-flight counts alone, the one scorer that still counts.

use super::{ScoreContext, Scorer, UNKNOWN_LOAD_SCORE};

pub struct Queue;

pub const NAME: &str = "queue-scorer";

impl Scorer for Queue {
    fn name(&self) -> &'static str {
        NAME
    }

    fn doc(&self) -> &'static str {
        "min-max normalised waiting queue plus this scheduler's in-flight requests (in-flight alone while the host is silent, weighing at least 1)"
    }

    fn metric(&self) -> Option<&'static str> {
        Some("queue")
    }

    fn load_only_weight(&self, weight: f64) -> f64 {
        weight.max(1.0)
    }

    fn score(&self, ctx: &ScoreContext<'_>, out: &mut [f64]) {
        if ctx.load_only {
            return inflight_only(ctx.inflight, out);
        }
        let stale_ms = ctx.saturation.metrics_stale_ms;
        let loads = || {
            ctx.candidates()
                .zip(ctx.inflight.iter().chain(std::iter::repeat(&0)))
                .map(|(e, &f)| e.fresh_metrics(stale_ms).map(|m| m.waiting + f64::from(f)))
        };
        let (min, max) =
            loads().flatten().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), q| (lo.min(q), hi.max(q)));
        for (slot, l) in out.iter_mut().zip(loads()) {
            *slot = match l {
                None => UNKNOWN_LOAD_SCORE,
                Some(_) if max - min <= f64::EPSILON => 1.0,
                Some(q) => ((max - q) / (max - min)).clamp(0.0, 1.0),
            };
        }
    }
}

/// This scheduler's own in-flight counts, min-max normalised.
fn inflight_only(inflight: &[u32], out: &mut [f64]) {
    let min = inflight.iter().copied().min().unwrap_or(0);
    let max = inflight.iter().copied().max().unwrap_or(0);
    for (slot, &f) in out.iter_mut().zip(inflight) {
        *slot = if max == min { 1.0 } else { f64::from(max - f) / f64::from(max - min) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorers::testing::{ep, score};

    #[test]
    fn min_max_over_fresh_metrics_plus_inflight() {
        let (a, b, c, stale) = (ep("a", 0.0, 0.2, 0), ep("b", 4.0, 0.5, 0), ep("c", 2.0, 1.0, 0), ep("d", 0.0, 0.0, 60_000));
        assert_eq!(score(&Queue, &[&a, &b, &c, &stale], |_| {}), vec![1.0, 0.0, 0.5, UNKNOWN_LOAD_SCORE]);
        assert_eq!(score(&Queue, &[&a, &b], |c| c.inflight = &[4, 0]), vec![1.0, 1.0], "in-flight counts as load");
        assert_eq!(
            score(&Queue, &[&a, &b, &c], |c| {
                c.inflight = &[2, 0, 1];
                c.load_only = true;
            }),
            vec![0.0, 1.0, 0.5],
            "silent host: in-flight alone"
        );
        assert_eq!((Queue.load_only_weight(0.0), Queue.load_only_weight(2.0)), (1.0, 2.0));
    }
}
