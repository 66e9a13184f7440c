//! Autoscaling signals for the pool, in the host's `/metrics`: what a KEDA `ScaledObject` or
//! an HPA on external metrics scales the model servers on (`docs/autoscaling.md`).
//!
//! | metric | from |
//! | --- | --- |
//! | `attache_pool_queue_depth` | the filters' flow-control queues, summed over the Envoys reporting to this host |
//! | `attache_pool_saturation` | the saturation detector the filters' flow control gates on |
//! | `attache_pool_running_requests`, `attache_pool_waiting_requests` | the engines' own gauges, summed |
//! | `attache_pool_inflight_tokens` | tokens held in the engines' KV caches: usage × blocks × block size |
//! | `attache_pool_ttft_seconds`, `attache_pool_tpot_seconds` | the engines' histograms over recent scrapes, averaged |
//! | `attache_pool_ttft_slo_ratio`, `attache_pool_tpot_slo_ratio` | the two above over the configured SLO |

use std::fmt::Write as _;

use attache_proto::v1;

/// `autoscaling:` in the host configuration.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AutoscalingConfig {
    /// The `pool` label on every `attache_pool_*` metric (the InferencePool's name).
    pub pool: String,
    /// Time-to-first-token objective, ms: `attache_pool_ttft_slo_ratio` is the pool's recent
    /// mean TTFT over it. 0 leaves the ratio out.
    pub ttft_slo_ms: f64,
    /// Time-per-output-token objective, ms, for `attache_pool_tpot_slo_ratio`. 0 leaves it out.
    pub tpot_slo_ms: f64,
}

impl Default for AutoscalingConfig {
    fn default() -> Self {
        Self { pool: "default".into(), ttft_slo_ms: 1_000.0, tpot_slo_ms: 100.0 }
    }
}

/// The pool's figures, computed from one snapshot and the fleet's queue reports.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct PoolSignals {
    /// `None` when no Envoy reports (fleet state off, or no flow control anywhere).
    pub queue_depth: Option<u64>,
    pub envoys: usize,
    /// `None` while the pool has no endpoints.
    pub saturation: Option<f64>,
    pub ready_endpoints: usize,
    pub running: f64,
    pub waiting: f64,
    pub inflight_tokens: f64,
    /// Means over the ready endpoints that have a figure, seconds.
    pub ttft_s: Option<f64>,
    pub tpot_s: Option<f64>,
}

fn mean(v: impl Iterator<Item = f64>) -> Option<f64> {
    let (n, sum) = v.fold((0usize, 0.0), |(n, s), x| (n + 1, s + x));
    (n > 0).then(|| sum / n as f64)
}

impl PoolSignals {
    pub fn compute(snap: &v1::Snapshot, queued: Option<(u64, usize)>) -> Self {
        let ready: Vec<&v1::Endpoint> = snap.endpoints.iter().filter(|e| e.ready && e.has_metrics).collect();
        Self {
            queue_depth: queued.filter(|(_, n)| *n > 0).map(|(q, _)| q),
            envoys: queued.map_or(0, |(_, n)| n),
            saturation: snap.saturation,
            ready_endpoints: ready.len(),
            running: ready.iter().map(|e| e.running).sum(),
            waiting: ready.iter().map(|e| e.waiting).sum(),
            inflight_tokens: ready
                .iter()
                .map(|e| e.kv_usage.clamp(0.0, 1.0) * e.num_gpu_blocks as f64 * f64::from(e.block_size))
                .sum(),
            ttft_s: mean(ready.iter().filter(|e| e.ttft_ms > 0.0).map(|e| e.ttft_ms / 1000.0)),
            tpot_s: mean(ready.iter().filter(|e| e.tpot_ms > 0.0).map(|e| e.tpot_ms / 1000.0)),
        }
    }

    /// Append the `attache_pool_*` families. A figure with no data (no Envoy reporting a
    /// queue, no latency sample yet) has no sample, so that a query sees "absent", not 0.
    pub fn render(&self, cfg: &AutoscalingConfig, out: &mut String) {
        let pool = cfg.pool.replace('\\', "\\\\").replace('"', "\\\"");
        let mut gauge = |name: &str, help: &str, v: Option<f64>| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            if let Some(v) = v.filter(|v| v.is_finite()) {
                let _ = writeln!(out, "{name}{{pool=\"{pool}\"}} {v}");
            }
        };
        gauge(
            "attache_pool_queue_depth",
            "Requests waiting in the filters' flow-control queues, summed over the Envoys reporting to this host.",
            self.queue_depth.map(|q| q as f64),
        );
        gauge("attache_pool_reporting_envoys", "Envoys whose queue report is current.", Some(self.envoys as f64));
        gauge(
            "attache_pool_saturation",
            "The pool's saturation as flow control sees it (1.0: saturated).",
            self.saturation,
        );
        gauge("attache_pool_ready_endpoints", "Ready endpoints with metrics.", Some(self.ready_endpoints as f64));
        gauge("attache_pool_running_requests", "Requests the engines are running, summed.", Some(self.running));
        gauge(
            "attache_pool_waiting_requests",
            "Requests waiting in the engines' own queues, summed.",
            Some(self.waiting),
        );
        gauge(
            "attache_pool_inflight_tokens",
            "Tokens held in the engines' KV caches (usage x blocks x block size), summed.",
            Some(self.inflight_tokens),
        );
        gauge("attache_pool_ttft_seconds", "Recent mean time to first token over the ready endpoints.", self.ttft_s);
        gauge("attache_pool_tpot_seconds", "Recent mean time per output token over the ready endpoints.", self.tpot_s);
        let ratio = |v: Option<f64>, slo_ms: f64| v.filter(|_| slo_ms > 0.0).map(|v| v * 1000.0 / slo_ms);
        gauge(
            "attache_pool_ttft_slo_ratio",
            "Recent mean TTFT over the TTFT objective.",
            ratio(self.ttft_s, cfg.ttft_slo_ms),
        );
        gauge(
            "attache_pool_tpot_slo_ratio",
            "Recent mean TPOT over the TPOT objective.",
            ratio(self.tpot_s, cfg.tpot_slo_ms),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(ready: bool, running: f64, kv: f64, ttft: f64, tpot: f64) -> v1::Endpoint {
        v1::Endpoint {
            ready,
            has_metrics: true,
            running,
            waiting: 1.0,
            kv_usage: kv,
            num_gpu_blocks: 100,
            block_size: 16,
            ttft_ms: ttft,
            tpot_ms: tpot,
            ..Default::default()
        }
    }

    #[test]
    fn sums_and_averages_over_ready_endpoints() {
        let snap = v1::Snapshot {
            saturation: Some(0.5),
            endpoints: vec![
                ep(true, 2.0, 0.5, 200.0, 20.0),
                ep(true, 4.0, 0.25, 0.0, 40.0),
                ep(false, 9.0, 1.0, 9e3, 9e3),
            ],
            ..Default::default()
        };
        let s = PoolSignals::compute(&snap, Some((7, 2)));
        assert_eq!(s.queue_depth, Some(7));
        assert_eq!(s.ready_endpoints, 2);
        assert_eq!(s.running, 6.0);
        assert_eq!(s.inflight_tokens, 0.5 * 1600.0 + 0.25 * 1600.0);
        assert_eq!(s.ttft_s, Some(0.2), "an endpoint with no TTFT yet is left out");
        assert!((s.tpot_s.unwrap() - 0.03).abs() < 1e-12);
        let mut text = String::new();
        s.render(&AutoscalingConfig { pool: "llama".into(), ttft_slo_ms: 400.0, tpot_slo_ms: 60.0 }, &mut text);
        assert!(text.contains("attache_pool_queue_depth{pool=\"llama\"} 7\n"), "{text}");
        assert!(text.contains("attache_pool_ttft_slo_ratio{pool=\"llama\"} 0.5\n"), "{text}");
        assert!(text.contains("attache_pool_saturation{pool=\"llama\"} 0.5\n"));
    }

    #[test]
    fn absent_data_has_no_sample() {
        let s = PoolSignals::compute(&v1::Snapshot::default(), None);
        let mut text = String::new();
        s.render(&AutoscalingConfig::default(), &mut text);
        assert!(text.contains("# TYPE attache_pool_queue_depth gauge"));
        assert!(!text.contains("attache_pool_queue_depth{"), "{text}");
        assert!(!text.contains("attache_pool_ttft_seconds{"));
        assert!(text.contains("attache_pool_reporting_envoys{pool=\"default\"} 0"));
    }
}
