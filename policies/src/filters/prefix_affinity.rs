//! `prefix-cache-affinity-filter` (llm-d, with its TTFT load gate): where some candidates hold
//! at least `prefix.affinity_threshold` of the prompt, the primary is chosen among them alone.
//! Attaché applies it after scoring, as a tier the picker keeps (`pickers::tier`),
//! rather than by dropping the others: they stay as fallbacks, and the load scorers still order
//! the holders.

use serde::{Deserialize, Serialize};

/// When the affinity filter, and a session's binding, yield to load (llm-d's TTFT load gate):
/// each endpoint's time to first token is estimated as the wait ahead of this request plus
/// this request's uncached tokens there over its prefill rate. The wait is the in-flight
/// uncached prompt tokens over the same rate, or, when the engine reports requests waiting
/// and `engine_backlog` is on, its recent mean TTFT if that is longer: a queue held back by a
/// full KV cache, which no count of prompt tokens shows. The rate is the one the host learned
/// from the engine's metrics; `peak_prefill_tokens_per_s` stands in until it has one.
/// - If the best affine endpoint's estimate is more than `max_ttft_penalty_ms` worse than the
///   best other's, the filter is skipped for this request.
/// - A session stays on its bound endpoint while that endpoint's estimate is at most
///   `max_session_penalty_ms` worse than the best other's: the context it holds saves more
///   prefill than its queue costs. Otherwise the session is routed afresh, and rebound.
///
/// - A hot prefix spreads: when even the best affine endpoint's estimate exceeds
///   `hot_prefix_ttft_ms`, and some spare candidate (its own wait within that target) would
///   answer sooner while computing the whole prompt, the request goes to that one, which then
///   holds the prefix too. Its holders' queues stay near the target instead of growing to the
///   penalty. When every engine queues, nothing spreads: a replica would evict other prefixes.
///
/// Saturated endpoints are filtered out before this, whatever their cache.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AffinityGate {
    pub enabled: bool,
    /// llm-d's default, calibrated for Qwen3-32B on 2×H100: 15,928 tokens/s.
    pub peak_prefill_tokens_per_s: f64,
    /// llm-d's default: 18,000 ms.
    pub max_ttft_penalty_ms: f64,
    /// How much later a session's bound endpoint may be expected to give the first token than
    /// the best other candidate before the session moves. The estimates are coarse (a worker
    /// counts only its own in-flight prompts, until each request ends), so a session moves
    /// only on a clear difference rather than flapping between engines on noise; 0 moves it
    /// whenever holding is estimated not to pay.
    pub max_session_penalty_ms: f64,
    /// The estimated TTFT on a prefix's best holder above which the prefix counts as hot and
    /// spreads to the candidate that would answer first (0: never spread).
    pub hot_prefix_ttft_ms: f64,
    /// Count an engine's reported backlog (requests waiting, at its recent mean TTFT) in the
    /// estimate. When contexts near the KV capacity, a request waits for the KV that running
    /// requests hold until they finish decoding; only the engine's own figures show it.
    pub engine_backlog: bool,
}

impl Default for AffinityGate {
    fn default() -> Self {
        Self {
            enabled: true,
            peak_prefill_tokens_per_s: 15_928.0,
            max_ttft_penalty_ms: 18_000.0,
            max_session_penalty_ms: 1_000.0,
            hot_prefix_ttft_ms: 250.0,
            engine_backlog: true,
        }
    }
}

impl AffinityGate {
    /// Estimated time to first token (ms) behind `tokens` uncached prompt tokens, at the
    /// endpoint's learned prefill rate (`learned`, tokens/s; 0 = none yet).
    pub fn ttft_ms(&self, tokens: u64, learned: f64) -> f64 {
        let rate = if learned > 0.0 { learned } else { self.peak_prefill_tokens_per_s };
        if rate <= 0.0 {
            return 0.0;
        }
        tokens as f64 * 1000.0 / rate
    }

    /// Estimated time to first token (ms) of a request needing `own` uncached tokens on an
    /// endpoint with `queued` uncached prompt tokens in flight, prefilling at `learned`
    /// tokens/s, whose engine reports `waiting` requests and a recent mean TTFT of
    /// `recent_ttft_ms`.
    pub fn estimate_ms(&self, queued: u64, own: u64, learned: f64, waiting: f64, recent_ttft_ms: f64) -> f64 {
        self.wait_ms(queued, learned, waiting, recent_ttft_ms) + self.ttft_ms(own, learned)
    }

    /// The part of [`estimate_ms`](Self::estimate_ms) ahead of the request: the queue or the
    /// engine's backlog, without its own prefill.
    pub fn wait_ms(&self, queued: u64, learned: f64, waiting: f64, recent_ttft_ms: f64) -> f64 {
        let queue = self.ttft_ms(queued, learned);
        let backlog = if self.engine_backlog && waiting > 0.0 { recent_ttft_ms.max(0.0) } else { 0.0 };
        queue.max(backlog)
    }
}

/// A candidate as the gate sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// It holds at least the affinity threshold of the prompt.
    pub affine: bool,
    /// Its estimated time to first token for this request, ms.
    pub ttft_ms: f64,
    /// The part of it spent waiting behind other work, ms.
    pub wait_ms: f64,
}

crate::scratch::pooled!(Estimate);

/// Whether the affinity filter applies: some candidate is affine (not all), and the best
/// affine one's estimated TTFT is within the penalty of the best other's.
pub fn holds(gate: &AffinityGate, candidates: &[Estimate]) -> bool {
    if !gate.enabled || candidates.iter().all(|c| !c.affine) || candidates.iter().all(|c| c.affine) {
        return false;
    }
    let best = |affine: bool| {
        candidates.iter().filter(|c| c.affine == affine).map(|c| c.ttft_ms).fold(f64::INFINITY, f64::min)
    };
    best(true) - best(false) <= gate.max_ttft_penalty_ms
}

/// The candidate a hot prefix spreads to: when the best affine candidate's estimate exceeds
/// `hot_prefix_ttft_ms`, the spare non-affine candidate with the lowest estimate, if it is
/// lower. Spare: its own wait is within `hot_prefix_ttft_ms`. When every engine queues (the
/// pool is saturated), a replica adds a whole prefill and evicts other prefixes to make room,
/// for no engine that answers sooner in earnest, so nothing spreads.
pub fn spread_to(gate: &AffinityGate, candidates: &[Estimate]) -> Option<usize> {
    if !gate.enabled || gate.hot_prefix_ttft_ms <= 0.0 {
        return None;
    }
    let best = |keep: &dyn Fn(&Estimate) -> bool| {
        candidates.iter().enumerate().filter(|(_, c)| keep(c)).min_by(|(_, a), (_, b)| a.ttft_ms.total_cmp(&b.ttft_ms))
    };
    let (_, holder) = best(&|c| c.affine)?;
    let (i, other) = best(&|c| !c.affine && c.wait_ms <= gate.hot_prefix_ttft_ms)?;
    (holder.ttft_ms > gate.hot_prefix_ttft_ms && other.ttft_ms < holder.ttft_ms).then_some(i)
}

/// Whether a session stays on candidate `bound`: its estimated TTFT is within the session
/// penalty of the best other candidate's (or it is the only one).
pub fn session_holds(gate: &AffinityGate, candidates: &[Estimate], bound: usize) -> bool {
    let Some(own) = candidates.get(bound) else { return false };
    let best_other = candidates
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != bound)
        .map(|(_, c)| c.ttft_ms)
        .fold(f64::INFINITY, f64::min);
    !gate.enabled || own.ttft_ms - best_other <= gate.max_session_penalty_ms
}

#[cfg(test)]
mod tests {
    use super::*;

    fn est(gate: &AffinityGate, affine: bool, tokens: u64) -> Estimate {
        Estimate { affine, ttft_ms: gate.ttft_ms(tokens, 0.0), wait_ms: 0.0 }
    }

    #[test]
    fn holds_within_the_ttft_penalty_only() {
        let gate = AffinityGate::default();
        let e = |affine, tokens| est(&gate, affine, tokens);
        // 300,000 queued tokens at 15,928/s is 18.8 s behind an idle 0.4 s: over 18 s.
        assert!(!holds(&gate, &[e(true, 306_400), e(false, 6_400)]));
        assert!(holds(&gate, &[e(true, 286_400), e(false, 6_400)]));
        assert!(!holds(&gate, &[e(true, 1), e(true, 1)]), "every candidate affine: nothing to filter");
        assert!(!holds(&gate, &[e(false, 1), e(false, 1)]));
        assert!(!holds(&AffinityGate { enabled: false, ..gate }, &[e(true, 1), e(false, 1)]));
    }

    #[test]
    fn a_hot_prefix_spreads_to_whoever_answers_first_computing_it_all() {
        let gate = AffinityGate::default();
        let e = |affine, tokens| est(&gate, affine, tokens);
        // The holder: 200 new tokens behind 1,000 queued (75 ms). Under the 250 ms target.
        assert_eq!(spread_to(&gate, &[e(true, 1_200), e(false, 1_700)]), None);
        // Behind 6,000 queued (389 ms): hot. Idle others compute 1,700 tokens in 107 ms.
        let c = [e(true, 6_200), e(false, 2_500), e(false, 1_700), e(true, 9_000)];
        assert_eq!(spread_to(&gate, &c), Some(2));
        // Hot, but every other would answer later still.
        assert_eq!(spread_to(&gate, &[e(true, 6_200), e(false, 7_000)]), None);
        // Every candidate holds it, or none does: nothing to spread.
        assert_eq!(spread_to(&gate, &[e(true, 6_200), e(true, 1_000)]), None);
        assert_eq!(spread_to(&gate, &[e(false, 6_200), e(false, 1_000)]), None);
        // Saturated: the other that would answer sooner waits 5 s itself. A replica there
        // would only evict; one that waits 100 ms is spare.
        let busy = |tokens, wait_ms| Estimate { wait_ms, ..e(false, tokens) };
        assert_eq!(spread_to(&gate, &[e(true, 90_000), busy(85_000, 5_000.0)]), None);
        assert_eq!(spread_to(&gate, &[e(true, 90_000), busy(85_000, 5_000.0), busy(88_000, 100.0)]), Some(2));
        let off = AffinityGate { hot_prefix_ttft_ms: 0.0, ..gate.clone() };
        assert_eq!(spread_to(&off, &c), None);
        assert_eq!(spread_to(&AffinityGate { enabled: false, ..gate }, &c), None);
    }

    #[test]
    fn an_engine_backlog_counts_only_while_requests_wait() {
        let gate = AffinityGate::default();
        // 1,000 tokens in flight (500 ms at 2,000/s) and 2,000 own (1 s).
        assert!((gate.estimate_ms(1_000, 2_000, 2_000.0, 0.0, 9_000.0) - 1_500.0).abs() < 1e-9, "nothing waits");
        // Requests wait behind a full KV cache: the engine's first tokens take 9 s.
        assert!((gate.estimate_ms(1_000, 2_000, 2_000.0, 3.0, 9_000.0) - 10_000.0).abs() < 1e-9);
        // The in-flight tokens alone would take longer: they stand.
        assert!((gate.estimate_ms(30_000, 2_000, 2_000.0, 3.0, 9_000.0) - 16_000.0).abs() < 1e-9);
        let off = AffinityGate { engine_backlog: false, ..gate };
        assert!((off.estimate_ms(1_000, 2_000, 2_000.0, 3.0, 9_000.0) - 1_500.0).abs() < 1e-9, "off");
    }

    #[test]
    fn a_learned_rate_replaces_the_configured_one() {
        let gate = AffinityGate::default();
        assert!((gate.ttft_ms(15_928, 0.0) - 1000.0).abs() < 1e-9, "none learned: the configured rate");
        assert!((gate.ttft_ms(4_000, 8_000.0) - 500.0).abs() < 1e-9);
    }

    #[test]
    fn a_session_stays_only_while_its_cache_saves_more_than_its_queue_costs() {
        let gate = AffinityGate { max_session_penalty_ms: 0.0, ..AffinityGate::default() };
        let e = |tokens| est(&gate, false, tokens);
        // Bound endpoint: 2,000 new tokens behind 10,000 queued; another: the whole 30,000.
        assert!(session_holds(&gate, &[e(12_000), e(30_000)], 0));
        // The engine evicted the context: 30,000 uncached there too, plus its queue.
        assert!(!session_holds(&gate, &[e(40_000), e(30_000)], 0));
        // A penalty allowance keeps it within that much.
        let default = AffinityGate::default();
        assert!(session_holds(&default, &[e(40_000), e(30_000)], 0), "0.63 s worse, 1 s allowed");
        assert!(!session_holds(&default, &[e(50_000), e(30_000)], 0), "1.26 s worse");
        assert!(session_holds(&gate, &[e(40_000)], 0), "the only candidate");
        assert!(session_holds(&AffinityGate { enabled: false, ..gate.clone() }, &[e(40_000), e(1)], 0));
        assert!(!session_holds(&gate, &[e(1)], 3), "not a candidate");
    }
}
