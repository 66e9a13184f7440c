//! Scorers: each returns a score in 0..=1 per candidate; the scheduler sums them by weight.
//! Formulas follow llm-d's scorers (`reference/llmd.md` §1.3).

use crate::config::SaturationConfig;
use crate::endpoint::Endpoint;

/// Score given to an endpoint whose metrics are unknown or stale.
pub const UNKNOWN_LOAD_SCORE: f64 = 0.5;

/// `prefix-cache-scorer`: matched blocks / total blocks of the request.
pub fn prefix(matched_blocks: &[usize], total_blocks: usize) -> Vec<f64> {
    matched_blocks
        .iter()
        .map(|&m| if total_blocks == 0 { 0.0 } else { (m as f64 / total_blocks as f64).clamp(0.0, 1.0) })
        .collect()
}

/// `queue-scorer`: min-max normalised load, `(max - q) / (max - min)`; all equal gives 1.
/// Load is the engine's waiting queue plus the requests this scheduler has in flight to it
/// (metrics lag by a scrape interval; in-flight counts do not).
pub fn queue(endpoints: &[&Endpoint], inflight: &[u32], cfg: &SaturationConfig) -> Vec<f64> {
    let loads: Vec<Option<f64>> = endpoints
        .iter()
        .zip(inflight.iter().chain(std::iter::repeat(&0)))
        .map(|(e, &f)| e.fresh_metrics(cfg.metrics_stale_ms).map(|m| m.waiting + f64::from(f)))
        .collect();
    let known = loads.iter().flatten();
    let min = known.clone().copied().fold(f64::INFINITY, f64::min);
    let max = known.copied().fold(f64::NEG_INFINITY, f64::max);
    loads
        .iter()
        .map(|l| match l {
            None => UNKNOWN_LOAD_SCORE,
            Some(_) if max - min <= f64::EPSILON => 1.0,
            Some(q) => ((max - q) / (max - min)).clamp(0.0, 1.0),
        })
        .collect()
}

/// Load from this scheduler's own in-flight counts alone, min-max normalised as [`queue`]:
/// what is left to go on when the host's metrics cannot be trusted.
pub fn inflight(inflight: &[u32]) -> Vec<f64> {
    let min = inflight.iter().copied().min().unwrap_or(0);
    let max = inflight.iter().copied().max().unwrap_or(0);
    inflight.iter().map(|&f| if max == min { 1.0 } else { f64::from(max - f) / f64::from(max - min) }).collect()
}

/// `kv-cache-utilization-scorer`: `1 - kv_usage`.
pub fn kv_cache(endpoints: &[&Endpoint], cfg: &SaturationConfig) -> Vec<f64> {
    endpoints
        .iter()
        .map(|e| match e.fresh_metrics(cfg.metrics_stale_ms) {
            Some(m) => (1.0 - m.kv_usage).clamp(0.0, 1.0),
            None => UNKNOWN_LOAD_SCORE,
        })
        .collect()
}

/// `lora-affinity-scorer` (llm-d's tiers): for a request naming an adapter, 1.0 where the
/// adapter is loaded and running, 0.8 where a slot is free to load it, 0.6 where requests wait
/// for it, else 0. A request for an endpoint's base model scores 0 everywhere (no preference).
pub fn lora(endpoints: &[&Endpoint], model: &str) -> Vec<f64> {
    endpoints
        .iter()
        .map(|e| match &e.lora {
            _ if e.base_model() == Some(model) => 0.0,
            None => 0.0,
            Some(l) if l.running.iter().any(|a| a == model) => 1.0,
            Some(l) if (l.running.len() + l.waiting.len()) < l.max_lora as usize => 0.8,
            Some(l) if l.waiting.iter().any(|a| a == model) => 0.6,
            Some(_) => 0.0,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::{EndpointMetrics, Role};

    fn ep(waiting: f64, kv: f64, age: u64) -> Endpoint {
        Endpoint {
            address: "x".into(),
            models: vec![],
            role: Role::Both,
            ready: true,
            metrics: Some(EndpointMetrics { waiting, running: 0.0, kv_usage: kv, age_ms: age, ttft_ms: 0.0 }),
            ..Default::default()
        }
    }

    #[test]
    fn formulas() {
        let cfg = SaturationConfig::default();
        assert_eq!(prefix(&[0, 2, 4], 4), vec![0.0, 0.5, 1.0]);
        assert_eq!(prefix(&[0], 0), vec![0.0]);
        let (a, b, c, stale) = (ep(0.0, 0.2, 0), ep(4.0, 0.5, 0), ep(2.0, 1.0, 0), ep(0.0, 0.0, 60_000));
        let eps = [&a, &b, &c, &stale];
        assert_eq!(queue(&eps, &[0, 0, 0, 0], &cfg), vec![1.0, 0.0, 0.5, UNKNOWN_LOAD_SCORE]);
        // In-flight requests count as load.
        assert_eq!(queue(&eps[..2], &[4, 0], &cfg), vec![1.0, 1.0]);
        let kv = kv_cache(&eps, &cfg);
        assert!(
            (kv[0] - 0.8).abs() < 1e-9 && (kv[1] - 0.5).abs() < 1e-9 && kv[2] == 0.0 && kv[3] == UNKNOWN_LOAD_SCORE
        );
    }

    #[test]
    fn lora_tiers() {
        use crate::endpoint::LoraState;
        let with = |running: &[&str], waiting: &[&str], max_lora: u32| Endpoint {
            models: vec!["base".into(), "sql".into(), "tweet".into()],
            lora: Some(LoraState {
                running: running.iter().map(|s| s.to_string()).collect(),
                waiting: waiting.iter().map(|s| s.to_string()).collect(),
                max_lora,
            }),
            ..Default::default()
        };
        let (active, free, waiting, full, none) = (
            with(&["sql"], &[], 2),
            with(&["tweet"], &[], 2),
            with(&["tweet"], &["sql"], 2),
            with(&["tweet", "x"], &[], 2),
            Endpoint { models: vec!["base".into(), "sql".into()], ..Default::default() },
        );
        let eps = [&active, &free, &waiting, &full, &none];
        assert_eq!(lora(&eps, "sql"), vec![1.0, 0.8, 0.6, 0.0, 0.0]);
        assert_eq!(lora(&eps, "base"), vec![0.0; 5], "the base model has no LoRA preference");
    }
}

/// State of the `no-hit-lru` scorer: when each endpoint last received a cold request.
#[derive(Debug, Default, Clone)]
pub struct NoHitLru {
    tick: u64,
    last_cold: hashbrown::HashMap<String, u64>,
}

impl NoHitLru {
    /// Remember that `address` received a cold request.
    pub fn record(&mut self, address: &str) {
        self.tick += 1;
        if self.last_cold.len() > 4096 && !self.last_cold.contains_key(address) {
            self.last_cold.clear();
        }
        match self.last_cold.get_mut(address) {
            Some(t) => *t = self.tick,
            None => {
                self.last_cold.insert(address.to_owned(), self.tick);
            }
        }
    }
}

/// llm-d's `no-hit-lru-scorer`: for a cold request (no endpoint holds any of its prefix),
/// endpoints that received a cold request least recently (or never) score up to 1, so new
/// prefixes spread evenly even when load metrics cannot tell endpoints apart. A warm request
/// scores 0.5 everywhere.
pub fn no_hit_lru(endpoints: &[&Endpoint], cold: bool, lru: &NoHitLru) -> Vec<f64> {
    if !cold || endpoints.len() < 2 {
        return vec![if cold { 1.0 } else { 0.5 }; endpoints.len()];
    }
    let ticks: Vec<u64> = endpoints.iter().map(|e| lru.last_cold.get(&e.address).copied().unwrap_or(0)).collect();
    let mut order: Vec<usize> = (0..ticks.len()).collect();
    order.sort_by_key(|&i| ticks[i]);
    let mut scores = vec![0.0; ticks.len()];
    let n = (ticks.len() - 1) as f64;
    for (rank, i) in order.into_iter().enumerate() {
        scores[i] = 1.0 - rank as f64 / n;
    }
    scores
}

#[cfg(test)]
mod lru_tests {
    use super::*;

    #[test]
    fn cold_requests_prefer_least_recently_used() {
        let eps: Vec<Endpoint> =
            ["a", "b", "c"].iter().map(|a| Endpoint { address: (*a).into(), ..Default::default() }).collect();
        let refs: Vec<&Endpoint> = eps.iter().collect();
        let mut lru = NoHitLru::default();
        lru.record("a");
        lru.record("c");
        assert_eq!(no_hit_lru(&refs, true, &lru), vec![0.5, 1.0, 0.0]);
        assert_eq!(no_hit_lru(&refs, false, &lru), vec![0.5; 3]);
    }
}
