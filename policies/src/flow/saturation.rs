//! Pool saturation: llm-d's utilization detector (computed by the host, pushed with each
//! snapshot) and the [`Gate`] each scheduler instance keeps between two snapshots, so that it does
//! not keep dispatching into a pool whose metrics have not caught up yet.

use std::collections::VecDeque;

use serde::Deserialize;

use crate::endpoint::Endpoint;

/// Saturation settings of llm-d's utilization detector.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DetectorConfig {
    pub queue_threshold: f64,
    pub kv_threshold: f64,
    /// Metrics this old or older count as fully saturated (0: every endpoint does).
    pub stale_ms: u64,
}

impl Default for DetectorConfig {
    fn default() -> Self {
        Self { queue_threshold: 5.0, kv_threshold: 0.8, stale_ms: 200 }
    }
}

/// Pool saturation: the mean over endpoints of `max(waiting/queue_threshold,
/// kv_usage/kv_threshold)`; an endpoint without fresh metrics counts as 1.0. `None` when the
/// pool has no endpoint.
pub fn pool_saturation<'a>(endpoints: impl IntoIterator<Item = &'a Endpoint>, cfg: &DetectorConfig) -> Option<f64> {
    let (mut sum, mut n) = (0.0, 0usize);
    for e in endpoints {
        n += 1;
        sum += match e.fresh_metrics(cfg.stale_ms) {
            Some(m) if e.ready => {
                let q = if cfg.queue_threshold > 0.0 { m.waiting / cfg.queue_threshold } else { 0.0 };
                let kv = if cfg.kv_threshold > 0.0 { m.kv_usage / cfg.kv_threshold } else { 0.0 };
                q.max(kv)
            }
            _ => 1.0,
        };
    }
    (n > 0).then(|| sum / n as f64)
}

/// The saturation one more request adds to the pool, as the detector will see it once it is
/// queued on an engine: `1 / (queue_threshold × endpoints)`. The host pushes it with each
/// snapshot, so filters need not know the detector's settings.
pub fn dispatch_cost(endpoints: usize, cfg: &DetectorConfig) -> f64 {
    let per_endpoint = if cfg.queue_threshold > 0.0 { 1.0 / cfg.queue_threshold } else { 1.0 };
    per_endpoint / endpoints.max(1) as f64
}

/// Events kept between two snapshots at most (older ones are folded away).
const MAX_EVENTS: usize = 8192;

/// One scheduler instance's estimate of saturation between snapshots: the host's figure plus
/// what this instance dispatched, minus what completed, since the engines were scraped.
///
/// Other instances' dispatches are not seen until the next snapshot, so with `W` workers and
/// replicas dispatching at once the pool can overshoot by at most `W` times the headroom for one
/// snapshot interval (scrape plus publish, about 100 ms with the defaults).
#[derive(Debug, Default)]
pub struct Gate {
    /// (time ms, +1 dispatched / -1 completed), oldest first.
    events: VecDeque<(u64, i8)>,
}

impl Gate {
    fn push(&mut self, now_ms: u64, d: i8) {
        if self.events.len() >= MAX_EVENTS {
            self.events.pop_front();
        }
        self.events.push_back((now_ms, d));
    }

    pub fn dispatched(&mut self, now_ms: u64) {
        self.push(now_ms, 1);
    }

    pub fn completed(&mut self, now_ms: u64) {
        self.push(now_ms, -1);
    }

    /// Saturation as it will be once this instance's recent work shows: `host` is the
    /// snapshot's figure, built from metrics scraped at `observed_ms` (events up to then are in
    /// it already), `cost` the snapshot's saturation per request.
    pub fn estimate(&mut self, host: f64, observed_ms: u64, cost: f64) -> f64 {
        while self.events.front().is_some_and(|(t, _)| *t <= observed_ms) {
            self.events.pop_front();
        }
        // A completion lets a request waiting on the engine start (or frees its KV), so it
        // counts down as a dispatch counts up; never below an empty pool.
        let net: i64 = self.events.iter().map(|(_, d)| i64::from(*d)).sum();
        (host + cost * net as f64).max(0.0)
    }

    /// [`Self::estimate`] on a pool's snapshot; `None` when the pool has no endpoints.
    pub fn estimate_pool(&mut self, pool: &crate::endpoint::PoolState) -> Option<f64> {
        pool.saturation.map(|s| self.estimate(s, pool.observed_ms, pool.dispatch_cost))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointMetrics;

    #[test]
    fn the_pool_estimate_follows_the_snapshot_and_is_none_without_endpoints() {
        let mut g = Gate::default();
        assert_eq!(g.estimate_pool(&crate::endpoint::PoolState::default()), None);
        g.dispatched(10);
        g.dispatched(11);
        let pool = crate::endpoint::PoolState {
            saturation: Some(0.5),
            observed_ms: 5,
            dispatch_cost: 0.1,
            ..Default::default()
        };
        assert_eq!(g.estimate_pool(&pool), Some(g.estimate(0.5, 5, 0.1)));
        assert!((g.estimate_pool(&pool).unwrap() - 0.7).abs() < 1e-9, "two dispatches since the scrape");
    }

    #[test]
    fn saturation_is_the_mean_of_per_endpoint_pressure_and_stale_counts_as_full() {
        let ep = |waiting: f64, kv: f64, age_ms: u64| Endpoint {
            ready: true,
            metrics: Some(EndpointMetrics { waiting, kv_usage: kv, age_ms, ..Default::default() }),
            ..Default::default()
        };
        let cfg = DetectorConfig::default();
        let s = pool_saturation(&[ep(0.0, 0.4, 0), ep(10.0, 0.0, 0)], &cfg).unwrap();
        assert!((s - (0.5 + 2.0) / 2.0).abs() < 1e-9, "{s}");
        let s = pool_saturation(&[ep(0.0, 0.0, 0), ep(0.0, 0.0, 500)], &cfg).unwrap();
        assert!((s - 0.5).abs() < 1e-9, "stale counts as 1.0: {s}");
        assert_eq!(pool_saturation(&[], &cfg), None);
    }

    #[test]
    fn the_gate_adds_work_the_metrics_have_not_seen_yet() {
        let cfg = DetectorConfig::default();
        let cost = dispatch_cost(2, &cfg);
        assert!((cost - 0.1).abs() < 1e-12, "1/(5*2): {cost}");
        let mut g = Gate::default();
        assert_eq!(g.estimate(0.5, 0, cost), 0.5);
        g.dispatched(100);
        g.dispatched(110);
        g.dispatched(120);
        assert!((g.estimate(0.5, 50, cost) - 0.8).abs() < 1e-9);
        g.completed(130);
        assert!((g.estimate(0.5, 50, cost) - 0.7).abs() < 1e-9);
        // A snapshot scraped at 115 already counts the first two dispatches.
        assert!((g.estimate(0.6, 115, cost) - 0.6).abs() < 1e-9, "net of +1 -1 since 115");
        // Completions free room the metrics have not seen yet either, down to an empty pool.
        g.completed(140);
        assert!((g.estimate(0.6, 115, cost) - 0.5).abs() < 1e-9);
        for t in 150..170 {
            g.completed(t);
        }
        assert_eq!(g.estimate(0.6, 115, cost), 0.0);
    }
}
