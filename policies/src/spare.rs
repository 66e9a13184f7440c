//! Sheddable work in spare capacity. A request of a sheddable band (a negative flow-control
//! priority: the async worker's batch jobs, background responses) goes to the endpoints that
//! have served no interactive request lately, when any such endpoint is a candidate. An engine
//! runs one step at a time, prefills and decodes together: a batch job's long prefill on the
//! engine an interactive request reaches makes that request wait for the step, however idle
//! the rest of the pool is. Kept apart, interactive prefills share steps only with each other,
//! and batch work fills the engines interactive traffic leaves.
//!
//! The endpoints an interactive band uses are learned from this scheduler's own decisions
//! ([`InteractiveHomes`], per scheduler instance): prefix affinity keeps a workload's
//! interactive requests on the engines holding its prefixes, so they are stable. When every
//! candidate served interactive traffic lately (or none did), nothing changes.

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

use crate::endpoint::Endpoint;

/// `scheduler.spare` in the filter configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SpareConfig {
    /// Place sheddable requests away from the endpoints serving interactive requests.
    pub enabled: bool,
    /// How long an endpoint counts as serving interactive traffic after the last interactive
    /// request this scheduler sent it.
    pub window_ms: u64,
}

impl Default for SpareConfig {
    fn default() -> Self {
        Self { enabled: true, window_ms: 2_000 }
    }
}

/// Most endpoints remembered; past it, those outside the window are forgotten.
const MAX_ENTRIES: usize = 4_096;

/// When this scheduler last sent each endpoint an interactive (not sheddable) request.
#[derive(Debug, Default)]
pub struct InteractiveHomes {
    last: HashMap<String, u64>,
}

impl InteractiveHomes {
    /// An interactive request went to `endpoint` at `now_ms`.
    pub fn record(&mut self, endpoint: &str, now_ms: u64) {
        if let Some(t) = self.last.get_mut(endpoint) {
            *t = now_ms;
            return;
        }
        if self.last.len() >= MAX_ENTRIES {
            self.last.retain(|_, t| now_ms.saturating_sub(*t) < 60_000);
            if self.last.len() >= MAX_ENTRIES {
                return;
            }
        }
        self.last.insert(endpoint.to_owned(), now_ms);
    }

    /// Whether `endpoint` served an interactive request within the window.
    pub fn serving(&self, endpoint: &str, now_ms: u64, window_ms: u64) -> bool {
        self.last.get(endpoint).is_some_and(|t| now_ms.saturating_sub(*t) < window_ms)
    }

    /// A sheddable request's candidates (positions in `endpoints`): those serving no
    /// interactive traffic, when there are some and not all are; else unchanged.
    pub fn keep_spare(&self, cfg: &SpareConfig, endpoints: &[Endpoint], candidates: &mut Vec<usize>, now_ms: u64) {
        if !cfg.enabled || self.last.is_empty() {
            return;
        }
        let spare = |i: &usize| endpoints.get(*i).is_some_and(|e| !self.serving(&e.address, now_ms, cfg.window_ms));
        let n = candidates.iter().filter(|i| spare(i)).count();
        if n > 0 && n < candidates.len() {
            candidates.retain(spare);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> Vec<Endpoint> {
        (0..n).map(|i| Endpoint::idle(format!("10.0.0.{i}:8000"), "m")).collect()
    }

    #[test]
    fn sheddable_work_keeps_to_the_endpoints_interactive_traffic_left() {
        let eps = pool(3);
        let cfg = SpareConfig::default();
        let mut homes = InteractiveHomes::default();
        let mut all = vec![0, 1, 2];
        homes.keep_spare(&cfg, &eps, &mut all, 1_000);
        assert_eq!(all, [0, 1, 2], "no interactive traffic seen: unchanged");
        homes.record("10.0.0.1:8000", 1_000);
        homes.keep_spare(&cfg, &eps, &mut all, 1_500);
        assert_eq!(all, [0, 2]);
        // Past the window the endpoint is spare again.
        let mut later = vec![0, 1, 2];
        homes.keep_spare(&cfg, &eps, &mut later, 3_000);
        assert_eq!(later, [0, 1, 2]);
        // Every candidate busy with interactive traffic: unchanged, the scores decide.
        homes.record("10.0.0.0:8000", 3_000);
        homes.record("10.0.0.2:8000", 3_000);
        let mut busy = vec![0, 2];
        homes.keep_spare(&cfg, &eps, &mut busy, 3_100);
        assert_eq!(busy, [0, 2]);
        let off = SpareConfig { enabled: false, ..cfg };
        let mut any = vec![0, 1];
        homes.record("10.0.0.1:8000", 3_100);
        homes.keep_spare(&off, &eps, &mut any, 3_200);
        assert_eq!(any, [0, 1]);
    }

    #[test]
    fn the_memory_is_bounded() {
        let mut homes = InteractiveHomes::default();
        for i in 0..(MAX_ENTRIES + 10) {
            homes.record(&format!("e{i}"), 0);
        }
        assert_eq!(homes.last.len(), MAX_ENTRIES);
        homes.record("fresh", 120_000);
        assert_eq!(homes.last.len(), 1, "old entries are forgotten first");
    }
}
