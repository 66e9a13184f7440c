//! `no-hit-lru-scorer` (llm-d): for a cold request (no endpoint holds enough of its prefix),
//! endpoints that received a cold request least recently (or never) score up to 1, so new
//! prefixes spread evenly even when load metrics cannot tell endpoints apart. A warm request
//! scores 0.5 everywhere. A request for a LoRA adapter has its affinity already, where the
//! adapter runs: spreading it would weigh as much as a tier step and load the adapter elsewhere,
//! so it counts as warm.

use super::{lora_affinity, ScoreContext, Scorer};

pub struct NoHitLru;

pub const NAME: &str = "no-hit-lru-scorer";

impl Scorer for NoHitLru {
    fn name(&self) -> &'static str {
        NAME
    }

    fn doc(&self) -> &'static str {
        "spreads cold prefixes: the endpoint that least recently got a cold request scores 1"
    }

    fn score(&self, ctx: &ScoreContext<'_>) -> Vec<f64> {
        let eps = ctx.candidates;
        let cold = ctx.cold && eps.iter().all(|e| lora_affinity::tier(e, ctx.model) <= 0.0);
        if !cold || eps.len() < 2 {
            return vec![if cold { 1.0 } else { 0.5 }; eps.len()];
        }
        let ticks: Vec<u64> = eps.iter().map(|e| ctx.last_cold.last_cold(&e.address)).collect();
        let mut order: Vec<usize> = (0..ticks.len()).collect();
        order.sort_by_key(|&i| ticks.get(i).copied().unwrap_or(0));
        let mut scores = vec![0.0; ticks.len()];
        let n = (ticks.len() - 1) as f64;
        for (rank, i) in order.into_iter().enumerate() {
            if let Some(s) = scores.get_mut(i) {
                *s = 1.0 - rank as f64 / n;
            }
        }
        scores
    }
}

/// The scorer's state: when each endpoint last received a cold request.
#[derive(Debug, Default, Clone)]
pub struct LastCold {
    tick: u64,
    last_cold: hashbrown::HashMap<String, u64>,
}

impl LastCold {
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

    /// When `address` last received a cold request (0: never).
    pub fn last_cold(&self, address: &str) -> u64 {
        self.last_cold.get(address).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Endpoint;

    #[test]
    fn cold_requests_prefer_least_recently_used() {
        let eps: Vec<Endpoint> =
            ["a", "b", "c"].iter().map(|a| Endpoint { address: (*a).into(), ..Default::default() }).collect();
        let refs: Vec<&Endpoint> = eps.iter().collect();
        let mut lru = LastCold::default();
        lru.record("a");
        lru.record("c");
        let sat = crate::filters::saturation::SaturationConfig::default();
        let ctx = |cold| ScoreContext {
            model: "m",
            candidates: &refs,
            inflight: &[0, 0, 0],
            matched_blocks: &[0, 0, 0],
            total_blocks: 0,
            precise: None,
            cold,
            load_only: false,
            saturation: &sat,
            last_cold: &lru,
        };
        assert_eq!(NoHitLru.score(&ctx(true)), vec![0.5, 1.0, 0.0]);
        assert_eq!(NoHitLru.score(&ctx(false)), vec![0.5; 3]);
    }
}
