//! Fairness state shared between the scheduler instances of one Envoy.
//!
//! Each Envoy worker queues its own requests, but the tenants' usage must be one figure: a
//! tenant whose connections all land on one worker must not get that worker's whole share. The
//! [`Board`] lives in proxy-wasm shared data (one per Envoy): every worker folds its dispatched
//! tokens into the decayed per-tenant usage and posts what it has waiting, once per tick. A
//! worker then serves its least-served tenant, but holds it back while another worker waits
//! with a higher band, or with a tenant that has had clearly less ([`Rivals`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::FlowConfig;

/// What other workers have waiting: per band, the least usage among the tenants waiting there.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rivals {
    bands: BTreeMap<i32, f64>,
}

impl Rivals {
    /// Another worker waits with a tenant of `usage` in band `priority`.
    pub fn note(&mut self, priority: i32, usage: f64) {
        let e = self.bands.entry(priority).or_insert(usage);
        *e = e.min(usage);
    }

    /// The highest band another worker waits in.
    pub fn top(&self) -> Option<i32> {
        self.bands.keys().next_back().copied()
    }

    pub fn least_usage(&self, priority: i32) -> Option<f64> {
        self.bands.get(&priority).copied()
    }
}

/// One worker's waiting requests, as posted on the board.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Demand {
    pub at_ms: u64,
    /// (priority, tenant, queued requests).
    pub waiting: Vec<(i32, String, u32)>,
}

/// The per-Envoy fairness record in shared data.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Board {
    /// When `usage` was last decayed.
    pub at_ms: u64,
    /// Tenant → decayed estimated tokens dispatched, over all workers.
    pub usage: BTreeMap<String, f64>,
    /// Worker id → what it has waiting.
    pub workers: BTreeMap<String, Demand>,
    /// The other Envoys' usage (fleet state from the host), decayed to when it was read. Not
    /// in shared data: each worker adds it after reading the board.
    #[serde(skip)]
    pub remote: BTreeMap<String, f64>,
}

impl Board {
    pub fn decode(bytes: &[u8]) -> Option<Board> {
        serde_json::from_slice(bytes).ok()
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Requests waiting on every worker of this Envoy, as they last posted.
    pub fn queued(&self) -> u32 {
        let n: u64 = self.workers.values().flat_map(|d| d.waiting.iter()).map(|(_, _, n)| u64::from(*n)).sum();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// The tenant's usage over the fleet: this Envoy's, plus the others' when known.
    pub fn usage(&self, tenant: &str) -> f64 {
        self.usage.get(tenant).copied().unwrap_or(0.0) + self.remote.get(tenant).copied().unwrap_or(0.0)
    }

    /// Fold in one worker's tick: the tokens it dispatched per tenant since its last merge
    /// (`dispatched`), and what it has waiting now. Usage decays with `cfg.usage_half_life_ms`;
    /// at most `cfg.max_tenants` are kept (the least-served are forgotten first); workers silent
    /// for `cfg.board_stale_ms` are dropped.
    pub fn merge(
        &mut self,
        worker: &str,
        now_ms: u64,
        dispatched: &BTreeMap<String, f64>,
        waiting: Vec<(i32, String, u32)>,
        cfg: &FlowConfig,
    ) {
        if now_ms > self.at_ms && cfg.usage_half_life_ms > 0 {
            let f = 0.5f64.powf((now_ms - self.at_ms) as f64 / cfg.usage_half_life_ms as f64);
            self.usage.values_mut().for_each(|v| *v *= f);
            self.usage.retain(|_, v| *v >= 0.5);
        }
        self.at_ms = self.at_ms.max(now_ms);
        for (t, n) in dispatched {
            *self.usage.entry(t.clone()).or_default() += n;
        }
        if self.usage.len() > cfg.max_tenants {
            let mut v: Vec<f64> = self.usage.values().copied().collect();
            v.sort_by(|a, b| b.total_cmp(a));
            let floor = v.get(cfg.max_tenants.saturating_sub(1)).copied().unwrap_or(0.0);
            self.usage.retain(|_, u| *u >= floor);
            while self.usage.len() > cfg.max_tenants {
                let Some(k) = self.usage.iter().min_by(|a, b| a.1.total_cmp(b.1)).map(|(k, _)| k.clone()) else {
                    break;
                };
                self.usage.remove(&k);
            }
        }
        if waiting.is_empty() {
            self.workers.remove(worker);
        } else {
            self.workers.insert(worker.to_owned(), Demand { at_ms: now_ms, waiting });
        }
        self.workers.retain(|_, d| now_ms.saturating_sub(d.at_ms) <= cfg.board_stale_ms);
    }

    /// What the other (live) workers have waiting.
    pub fn rivals(&self, me: &str, now_ms: u64, stale_ms: u64) -> Rivals {
        let mut r = Rivals::default();
        for (id, d) in &self.workers {
            if id == me || now_ms.saturating_sub(d.at_ms) > stale_ms {
                continue;
            }
            for (p, t, n) in &d.waiting {
                if *n > 0 {
                    r.note(*p, self.usage(t));
                }
            }
        }
        r
    }
}

/// Jain's fairness index of per-tenant allocations: 1.0 is perfectly fair, 1/n is one tenant
/// taking everything.
pub fn jain_index(x: &[f64]) -> f64 {
    let n = x.len() as f64;
    let sum: f64 = x.iter().sum();
    let sq: f64 = x.iter().map(|v| v * v).sum();
    if n == 0.0 || sq == 0.0 {
        return 1.0;
    }
    sum * sum / (n * sq)
}

#[cfg(test)]
mod tests {
    use super::super::{FlowQueue, RequestClass};
    use super::*;

    #[test]
    fn jain_index_bounds() {
        assert!((jain_index(&[1.0, 1.0, 1.0, 1.0]) - 1.0).abs() < 1e-12);
        assert!((jain_index(&[1.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
    }

    #[test]
    fn board_decays_bounds_and_forgets_silent_workers() {
        let cfg = FlowConfig { usage_half_life_ms: 1000, max_tenants: 2, board_stale_ms: 500, ..Default::default() };
        let mut b = Board::default();
        let d = |pairs: &[(&str, f64)]| pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        b.merge("w1", 1000, &d(&[("a", 100.0), ("b", 10.0)]), vec![(0, "a".into(), 3)], &cfg);
        b.merge("w2", 1000, &d(&[("c", 50.0)]), vec![(5, "c".into(), 1)], &cfg);
        assert_eq!(b.usage.len(), 2, "bounded: {:?}", b.usage);
        assert!(b.usage.contains_key("a") && b.usage.contains_key("c"), "the least-served is forgotten");
        b.merge("w1", 2000, &d(&[]), vec![(0, "a".into(), 3)], &cfg);
        assert!((b.usage("a") - 50.0).abs() < 1e-9, "one half-life: {}", b.usage("a"));
        assert!(!b.workers.contains_key("w2"), "w2 silent for 1000 ms > 500");
        let r = b.rivals("w2", 2000, 500);
        assert_eq!((r.top(), r.least_usage(0)), (Some(0), Some(b.usage("a"))));
        assert_eq!(b.rivals("w1", 2000, 500), Rivals::default(), "a worker is not its own rival");
        b.merge("w1", 2100, &d(&[]), vec![], &cfg);
        assert!(b.workers.is_empty(), "nothing waiting, nothing posted");
        assert_eq!(Board::decode(&b.encode()), Some(b));
    }

    /// Two workers, four tenants: w1 holds only tenant a's requests, w2 holds b, c and d. Without
    /// the board, each worker splits its dispatches between its own tenants (a gets half the
    /// pool); with it, service evens out across all four.
    #[test]
    fn the_board_evens_out_tenants_split_unevenly_across_workers() {
        let cfg = FlowConfig { quantum_tokens: 100, ..Default::default() };
        let served = |board_on: bool| {
            let mut w1 = FlowQueue::default();
            let mut w2 = FlowQueue::default();
            let mut id = 0u64;
            for _ in 0..200 {
                for t in ["a", "b", "c", "d"] {
                    id += 1;
                    let q = if t == "a" { &mut w1 } else { &mut w2 };
                    q.enqueue(
                        &cfg,
                        id,
                        &RequestClass { priority: 0, tenant: t.into(), continuing: false },
                        1,
                        100,
                        0,
                        (),
                    )
                    .unwrap();
                }
            }
            let mut board = Board::default();
            let mut tokens: BTreeMap<String, f64> = BTreeMap::new();
            // Each tick the pool has room for 2 requests; workers take turns asking first.
            for tick in 0..100u64 {
                let now = tick * 20;
                for w in 0..2 {
                    let (name, q) = if (w + tick) % 2 == 0 { ("w1", &mut w1) } else { ("w2", &mut w2) };
                    let mut pending = BTreeMap::new();
                    let rivals = if board_on { board.rivals(name, now, 500) } else { Rivals::default() };
                    let u = board.clone();
                    if let Some(p) = q.pop(|t| u.usage(t), &rivals, cfg.quantum_tokens as f64, |_| true) {
                        *tokens.entry(p.tenant.clone()).or_default() += p.tokens as f64;
                        *pending.entry(p.tenant).or_default() += p.tokens as f64;
                    }
                    let waiting = q.depths().into_iter().map(|(p, t, n)| (p, t, n as u32)).collect();
                    board.merge(name, now, &pending, waiting, &cfg);
                }
            }
            jain_index(&tokens.values().copied().collect::<Vec<_>>())
        };
        let (without, with) = (served(false), served(true));
        assert!(without < 0.8, "per-worker fairness alone: {without}");
        assert!(with > 0.95, "with the board: {with}");
    }
}
