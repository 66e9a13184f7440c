//! `saturation-filter` (llm-d's utilization detector): drops endpoints whose fresh metrics say
//! they are saturated (queue or KV cache at the `saturation` thresholds), unless every
//! candidate is. Stale metrics do not count as saturation.

use serde::{Deserialize, Serialize};

use super::{Filter, FilterContext};
use crate::endpoint::Endpoint;
use crate::error::ScheduleError;

pub struct Saturation;

impl Filter for Saturation {
    fn name(&self) -> &'static str {
        "saturation-filter"
    }

    fn doc(&self) -> &'static str {
        "drops endpoints at the `saturation` queue or KV thresholds, unless all are"
    }

    fn filter(&self, ctx: &FilterContext<'_>, candidates: &mut Vec<usize>) -> Result<(), ScheduleError> {
        let open = |i: &usize| ctx.endpoints.get(*i).is_some_and(|e| !is_saturated(e, ctx.saturation));
        // In place, and only when some but not all are saturated (all saturated: keep them all).
        let open_count = candidates.iter().filter(|i| open(i)).count();
        if open_count > 0 && open_count < candidates.len() {
            candidates.retain(open);
        }
        Ok(())
    }
}

/// When an endpoint counts as saturated and is filtered out (unless every endpoint is).
/// The queue default follows llm-d's utilization detector (5 waiting requests;
/// `reference/llmd.md` §2). The KV default is higher than the detector's 0.8: running requests
/// that share a cached prefix all reference its blocks, so an endpoint that holds hot prefixes
/// sits near 0.8 by design, and filtering it there would defeat prefix affinity.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SaturationConfig {
    pub queue_threshold: f64,
    pub kv_threshold: f64,
    /// Metrics older than this are stale: the endpoint is scored as unknown load.
    pub metrics_stale_ms: u64,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        Self { queue_threshold: 5.0, kv_threshold: 0.95, metrics_stale_ms: 1_000 }
    }
}

/// Whether an endpoint's fresh metrics say it is saturated.
pub fn is_saturated(e: &Endpoint, cfg: &SaturationConfig) -> bool {
    match e.fresh_metrics(cfg.metrics_stale_ms) {
        Some(m) => m.waiting >= cfg.queue_threshold || m.kv_usage >= cfg.kv_threshold,
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorers::testing::ep;

    #[test]
    fn drops_busy_but_never_all() {
        let cfg = SaturationConfig::default();
        let eps = vec![ep("a", 10.0, 0.1, 0), ep("b", 0.0, 0.97, 0), ep("c", 1.0, 0.1, 0), ep("d", 50.0, 0.1, 99_999)];
        let ctx = FilterContext { endpoints: &eps, model: "m", saturation: &cfg, exclude: None };
        let mut c = vec![0, 1, 2, 3];
        Saturation.filter(&ctx, &mut c).unwrap();
        assert_eq!(c, vec![2, 3], "stale metrics do not count as saturation");
        let mut c = vec![0, 1];
        Saturation.filter(&ctx, &mut c).unwrap();
        assert_eq!(c, vec![0, 1]);
    }
}
