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

    fn score(&self, ctx: &ScoreContext<'_>, out: &mut [f64]) {
        let eps = ctx.candidates;
        let cold = ctx.cold && eps.iter().all(|e| lora_affinity::tier(e, ctx.model) <= 0.0);
        if !cold || eps.len() < 2 {
            out.fill(if cold { 1.0 } else { 0.5 });
            return;
        }
        // (last cold request, position): least recent first, ties in pool order.
        let mut order: Vec<(u64, usize)> =
            eps.iter().enumerate().map(|(i, e)| (ctx.last_cold.last_cold(&e.address), i)).collect();
        order.sort_unstable();
        let n = (order.len() - 1) as f64;
        for (rank, (_, i)) in order.into_iter().enumerate() {
            if let Some(s) = out.get_mut(i) {
                *s = 1.0 - rank as f64 / n;
            }
        }
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
        let sessions = crate::scorers::session_load::ActiveSessions::default();
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
            sessions: &sessions,
            session_key: None,
        };
        let scored = |c: &ScoreContext<'_>| {
            let mut out = vec![f64::NAN; 3];
            NoHitLru.score(c, &mut out);
            out
        };
        assert_eq!(scored(&ctx(true)), vec![0.5, 1.0, 0.0]);
        assert_eq!(scored(&ctx(false)), vec![0.5; 3]);
    }
}
