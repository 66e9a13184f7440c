//! The host's pool state and the snapshots built from it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use attache_proto::v1;

use crate::discovery::StaticEndpoint;
use crate::prom::EngineMetrics;

/// What the host knows about one endpoint.
#[derive(Debug, Clone)]
pub struct EndpointState {
    pub spec: StaticEndpoint,
    pub metrics: Option<EngineMetrics>,
    pub last_ok: Option<Instant>,
    pub consecutive_failures: u32,
    pub last_error: Option<String>,
}

/// The whole pool, keyed by address.
#[derive(Debug, Default)]
pub struct PoolState {
    pub endpoints: BTreeMap<String, EndpointState>,
    /// Bumped on every change; the publisher compares it to decide whether to publish.
    pub generation: u64,
    /// Stable small ids per address, used by the precise index and its deltas.
    ids: BTreeMap<String, u16>,
    next_id: u16,
}

impl PoolState {
    /// The stable id of `address`, assigned on first sight.
    pub fn id_of(&mut self, address: &str) -> u16 {
        if let Some(id) = self.ids.get(address) {
            return *id;
        }
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        self.ids.insert(address.to_owned(), id);
        id
    }

    /// Replace the endpoint set, keeping metrics of endpoints that stay.
    pub fn set_endpoints(&mut self, specs: Vec<StaticEndpoint>) {
        for s in &specs {
            self.id_of(&s.address);
        }
        let mut next = BTreeMap::new();
        for spec in specs {
            let prev = self.endpoints.remove(&spec.address);
            let st = match prev {
                Some(mut p) => {
                    p.spec = spec.clone();
                    p
                }
                None => EndpointState {
                    spec: spec.clone(),
                    metrics: None,
                    last_ok: None,
                    consecutive_failures: 0,
                    last_error: None,
                },
            };
            next.insert(spec.address, st);
        }
        self.endpoints = next;
        self.generation += 1;
    }

    pub fn record_scrape(&mut self, address: &str, result: Result<EngineMetrics, String>, now: Instant) {
        let Some(e) = self.endpoints.get_mut(address) else {
            return;
        };
        // Only a change of what the filters see bumps the generation; readiness that changes
        // with time alone (metrics ageing out) is caught by the publisher.
        let changed = match result {
            Ok(m) => {
                let changed = e.metrics.as_ref() != Some(&m) || e.consecutive_failures > 0;
                e.metrics = Some(m);
                e.last_ok = Some(now);
                e.consecutive_failures = 0;
                e.last_error = None;
                changed
            }
            Err(err) => {
                e.consecutive_failures += 1;
                e.last_error = Some(err);
                e.consecutive_failures == 1
            }
        };
        if changed {
            self.generation += 1;
        }
    }

    /// Build the wire snapshot. An endpoint whose last good scrape is older than
    /// `unready_after` (or that never answered) is marked not ready.
    pub fn snapshot(&self, version: u64, epoch: u64, now: Instant, unready_after: Duration) -> v1::Snapshot {
        let endpoints = self
            .endpoints
            .values()
            .map(|e| {
                let age = e.last_ok.map(|t| now.saturating_duration_since(t));
                let fresh = age.is_some_and(|a| a <= unready_after);
                let m = e.metrics.clone().unwrap_or_default();
                v1::Endpoint {
                    id: u32::from(self.ids.get(&e.spec.address).copied().unwrap_or(u16::MAX)),
                    address: e.spec.address.clone(),
                    models: e.spec.models.clone(),
                    role: e.spec.role.clone(),
                    ready: fresh,
                    has_metrics: e.metrics.is_some(),
                    waiting: m.waiting,
                    running: m.running,
                    kv_usage: m.kv_usage,
                    metrics_age_ms: age.map(|a| a.as_millis() as u64).unwrap_or(u64::MAX),
                    block_size: m.block_size.unwrap_or(0),
                    num_gpu_blocks: m.num_gpu_blocks.unwrap_or(0),
                    engine: e.spec.engine.clone(),
                }
            })
            .collect();
        v1::Snapshot {
            version,
            host_epoch: epoch,
            generated_unix_ms: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
            endpoints,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(a: &str) -> StaticEndpoint {
        StaticEndpoint {
            address: a.into(),
            models: vec!["m".into()],
            role: "both".into(),
            engine: "vllm".into(),
            metrics_path: "/metrics".into(),
            kv_events: None,
        }
    }

    #[test]
    fn readiness_follows_scrapes() {
        let mut p = PoolState::default();
        p.set_endpoints(vec![spec("1.1.1.1:1"), spec("1.1.1.2:1")]);
        let t0 = Instant::now();
        p.record_scrape("1.1.1.1:1", Ok(EngineMetrics { waiting: 3.0, ..Default::default() }), t0);
        p.record_scrape("1.1.1.2:1", Err("refused".into()), t0);
        let s = p.snapshot(1, 9, t0, Duration::from_secs(1));
        assert!(s.endpoints[0].ready && s.endpoints[0].has_metrics);
        assert_eq!(s.endpoints[0].waiting, 3.0);
        assert!(!s.endpoints[1].ready && !s.endpoints[1].has_metrics);
        let later = t0 + Duration::from_secs(5);
        assert!(!p.snapshot(2, 9, later, Duration::from_secs(1)).endpoints[0].ready);
        let g = p.generation;
        p.set_endpoints(vec![spec("1.1.1.1:1")]);
        assert!(p.generation > g);
        assert_eq!(p.endpoints.len(), 1);
        assert!(p.endpoints["1.1.1.1:1"].metrics.is_some(), "metrics survive rediscovery");
    }
}
