//! `kv-cache-utilization-scorer`: `1 - kv_usage`.

use super::{ScoreContext, Scorer, UNKNOWN_LOAD_SCORE};

pub struct KvCacheUtilization;

pub const NAME: &str = "kv-cache-utilization-scorer";

impl Scorer for KvCacheUtilization {
    fn name(&self) -> &'static str {
        NAME
    }

    fn doc(&self) -> &'static str {
        "free KV cache, `1 - kv_usage`"
    }

    fn metric(&self) -> Option<&'static str> {
        Some("kv_cache")
    }

    fn score(&self, ctx: &ScoreContext<'_>, out: &mut [f64]) {
        for (slot, e) in out.iter_mut().zip(ctx.candidates()) {
            *slot = match e.fresh_metrics(ctx.saturation.metrics_stale_ms) {
                Some(m) => (1.0 - m.kv_usage).clamp(0.0, 1.0),
                None => UNKNOWN_LOAD_SCORE,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorers::testing::{ep, score};

    #[test]
    fn free_cache() {
        let (a, b, c, stale) = (ep("a", 0.0, 0.2, 0), ep("b", 4.0, 0.5, 0), ep("c", 2.0, 1.0, 0), ep("d", 0.0, 0.0, 60_000));
        let kv = score(&KvCacheUtilization, &[&a, &b, &c, &stale], |_| {});
        assert!((kv[0] - 0.8).abs() < 1e-9 && (kv[1] - 0.5).abs() < 1e-9 && kv[2] == 0.0);
        assert_eq!(kv[3], UNKNOWN_LOAD_SCORE);
    }
}
