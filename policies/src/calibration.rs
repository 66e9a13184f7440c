//! Calibrating what the scheduler believes its endpoints hold against what their engines
//! report.
//!
//! The prefix indexes record routing decisions; an engine's cache holds what it actually
//! kept. They part ways where the index cannot see: another Envoy worker's decisions inside the
//! affinity table's flush interval, another gateway replica's, traffic that bypasses the
//! gateway, or evictions the capacity model gets wrong. vLLM counts the prompt tokens it looked
//! up in its prefix cache and those it found (`vllm:prefix_cache_queries_total`,
//! `vllm:prefix_cache_hits_total`); the host passes both on in the snapshot.
//!
//! Per endpoint, [`HitCalibration`] compares two rates over the same stretches of time:
//! - the **engine's** hit rate, hits over queries between two readings of its counters;
//! - the **belief** rate, over the requests this scheduler routed there in between: the prompt
//!   tokens it expected cached over the prompt tokens it sent.
//!
//! Each is a sum that halves for every [`HALF_LIFE_TOKENS`] prompt tokens the engine is sent,
//! so the figures follow a change within a few times that much traffic, however often the
//! counters are read. A belief `x` (the share of one prompt the scheduler expects cached) then maps to
//! an expected hit that keeps the rates equal on average, linear in `x`:
//! - believed more than the engine finds (`B > H`): `x · H / B`;
//! - believed less (`B < H`): `x + (1 − x) · (H − B) / (1 − B)`, the engine's surplus spread
//!   over what the scheduler did not expect.
//!
//! Until both rates rest on [`MIN_TOKENS`] prompt tokens the belief stands as it is.

use hashbrown::HashMap;

/// Prompt tokens sent to an engine over which the sums lose half their weight.
pub const HALF_LIFE_TOKENS: f64 = 65_536.0;
/// Prompt tokens, engine's and belief's, before a calibration is applied.
pub const MIN_TOKENS: f64 = 4_096.0;
/// Endpoints tracked; past this the table starts over (a bound no real pool reaches).
const MAX_ENDPOINTS: usize = 65_536;

/// An engine's prefix-cache counters at one reading: prompt tokens looked up and found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheCounters {
    pub queries: u64,
    pub hits: u64,
}

impl CacheCounters {
    /// From the snapshot's form: tokens written into the cache (queries − hits) and hits.
    pub fn from_written(written: Option<u64>, hits: Option<u64>) -> Option<Self> {
        let (written, hits) = (written?, hits?);
        Some(Self { queries: written.saturating_add(hits), hits })
    }
}

/// Tokens over tokens, decayed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Rate {
    hit: f64,
    of: f64,
}

impl Rate {
    /// Add `hit` of `of`, the sums so far weighted by `keep`.
    fn fold(&mut self, keep: f64, hit: f64, of: f64) {
        self.hit = self.hit * keep + hit;
        self.of = self.of * keep + of;
    }

    fn value(&self) -> Option<f64> {
        (self.of >= MIN_TOKENS).then(|| (self.hit / self.of).clamp(0.0, 1.0))
    }
}

/// One endpoint's readings.
#[derive(Debug, Clone, Default)]
struct EndpointCalibration {
    /// The counters at the last reading.
    last: Option<CacheCounters>,
    /// This scheduler's belief since that reading: tokens expected cached, tokens sent.
    window: (u64, u64),
    engine: Rate,
    belief: Rate,
}

/// Per-endpoint calibration of the expected prefix hit (module docs).
#[derive(Debug, Clone, Default)]
pub struct HitCalibration {
    endpoints: HashMap<String, EndpointCalibration>,
}

/// Both rates of one endpoint, once calibrated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    pub engine: f64,
    pub belief: f64,
}

impl HitCalibration {
    /// A request went to `address`, expected to find `believed` of its `prompt` tokens cached;
    /// `counters`, the engine's as the decision saw them (`None`: it reports none, and there
    /// is nothing to calibrate against). A change in the counters closes the window before it.
    pub fn record(&mut self, address: &str, believed: u64, prompt: u64, counters: Option<CacheCounters>) {
        let Some(now) = counters else { return };
        if !self.endpoints.contains_key(address) {
            if self.endpoints.len() >= MAX_ENDPOINTS {
                self.endpoints.clear();
            }
            self.endpoints.insert(address.to_owned(), EndpointCalibration::default());
        }
        let Some(e) = self.endpoints.get_mut(address) else { return };
        match e.last {
            Some(last) if now.queries < last.queries || now.hits < last.hits => {
                // The engine restarted: its cache and counters start over.
                *e = EndpointCalibration { last: Some(now), ..Default::default() };
            }
            Some(last) if now != last => {
                let (queries, hits) = (now.queries - last.queries, now.hits - last.hits);
                let keep = 0.5f64.powf(queries as f64 / HALF_LIFE_TOKENS);
                e.engine.fold(keep, hits as f64, queries as f64);
                e.belief.fold(keep, e.window.0 as f64, e.window.1 as f64);
                e.window = (0, 0);
                e.last = Some(now);
            }
            Some(_) => {}
            None => e.last = Some(now),
        }
        e.window.0 += believed.min(prompt);
        e.window.1 += prompt;
    }

    /// The engine's and the belief's rates at `address`, when both rest on enough tokens.
    pub fn rates(&self, address: &str) -> Option<Rates> {
        let e = self.endpoints.get(address)?;
        Some(Rates { engine: e.engine.value()?, belief: e.belief.value()? })
    }

    /// The share of a prompt expected cached at `address`, given the scheduler believes
    /// `share` (0..1) of it is.
    pub fn expected(&self, address: &str, share: f64) -> f64 {
        let x = share.clamp(0.0, 1.0);
        let Some(Rates { engine: h, belief: b }) = self.rates(address) else { return x };
        if b > h {
            x * h / b
        } else if b < 1.0 {
            x + (1.0 - x) * (h - b) / (1.0 - b)
        } else {
            x
        }
    }

    /// Expected cached tokens of a `prompt`-token request believed to find `believed` cached.
    pub fn expected_tokens(&self, address: &str, believed: usize, prompt: usize) -> usize {
        if prompt == 0 {
            return 0;
        }
        let share = believed.min(prompt) as f64 / prompt as f64;
        (self.expected(address, share) * prompt as f64).round() as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Route `n` requests of `prompt` tokens believed to hit `belief`, to an engine that hits
    /// `truth`, with a counter reading every `per_reading` requests.
    fn drive(c: &mut HitCalibration, n: u64, prompt: u64, belief: f64, truth: f64, per_reading: u64) {
        let mut counters = CacheCounters::default();
        let mut pending = (0u64, 0u64);
        for i in 0..n {
            c.record("a:1", (prompt as f64 * belief) as u64, prompt, Some(counters));
            pending.0 += prompt;
            pending.1 += (prompt as f64 * truth) as u64;
            if (i + 1) % per_reading == 0 {
                counters.queries += pending.0;
                counters.hits += pending.1;
                pending = (0, 0);
            }
        }
    }

    #[test]
    fn an_under_believing_index_is_lifted_to_the_engine_rate() {
        let mut c = HitCalibration::default();
        drive(&mut c, 200, 1_024, 0.75, 0.86, 4);
        let r = c.rates("a:1").expect("calibrated");
        assert!((r.engine - 0.86).abs() < 0.01 && (r.belief - 0.75).abs() < 0.01, "{r:?}");
        // The mean belief maps onto the engine's rate; full and empty beliefs stay ordered.
        assert!((c.expected("a:1", 0.75) - 0.86).abs() < 0.01);
        assert!(c.expected("a:1", 0.0) > 0.0 && c.expected("a:1", 0.0) < c.expected("a:1", 0.5));
        assert!((c.expected("a:1", 1.0) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn an_over_believing_index_is_scaled_down_and_ordering_is_kept() {
        let mut c = HitCalibration::default();
        drive(&mut c, 200, 2_048, 0.8, 0.2, 2);
        assert!((c.expected("a:1", 0.8) - 0.2).abs() < 0.01, "{}", c.expected("a:1", 0.8));
        assert_eq!(c.expected("a:1", 0.0), 0.0, "nothing believed, nothing expected");
        assert_eq!(c.expected_tokens("a:1", 800, 1_000), 200);
    }

    #[test]
    fn too_few_tokens_or_no_counters_leave_the_belief_as_it_is() {
        let mut c = HitCalibration::default();
        drive(&mut c, 2, 100, 0.5, 0.9, 1);
        assert_eq!(c.rates("a:1"), None);
        assert_eq!(c.expected("a:1", 0.5), 0.5);
        c.record("b:1", 50, 100, None);
        assert_eq!(c.expected("b:1", 0.5), 0.5, "an engine without counters is not tracked");
        assert_eq!(c.expected("b:1", 1.5), 1.0, "clamped");
    }

    #[test]
    fn an_engine_restart_starts_over() {
        let mut c = HitCalibration::default();
        drive(&mut c, 100, 1_024, 0.5, 0.9, 2);
        assert!(c.rates("a:1").is_some());
        c.record("a:1", 0, 1_024, Some(CacheCounters { queries: 10, hits: 0 }));
        assert_eq!(c.rates("a:1"), None, "counters that went back mean a new engine");
        assert_eq!(CacheCounters::from_written(Some(70), Some(30)), Some(CacheCounters { queries: 100, hits: 30 }));
        assert_eq!(CacheCounters::from_written(Some(70), None), None);
    }
}
