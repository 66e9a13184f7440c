//! `prefix-cache-affinity-filter` (llm-d, with its TTFT load gate): where some candidates hold
//! at least `prefix.affinity_threshold` of the prompt, the primary is chosen among them alone.
//! Attaché applies it after scoring, as a tier the picker keeps (`pickers::tier`),
//! rather than by dropping the others: they stay as fallbacks, and the load scorers still order
//! the holders.

use serde::{Deserialize, Serialize};

/// When the affinity filter yields to load (llm-d's TTFT load gate): each endpoint's
/// time to first token is estimated as (its in-flight uncached prompt tokens + this request's
/// uncached tokens there) / `peak_prefill_tokens_per_s`; if the best affine endpoint's estimate
/// is more than `max_ttft_penalty_ms` worse than the best other's, the filter is skipped for
/// this request. Saturated endpoints are filtered out before this, whatever their cache.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AffinityGate {
    pub enabled: bool,
    /// llm-d's default, calibrated for Qwen3-32B on 2×H100: 15,928 tokens/s.
    pub peak_prefill_tokens_per_s: f64,
    /// llm-d's default: 18,000 ms.
    pub max_ttft_penalty_ms: f64,
}

impl Default for AffinityGate {
    fn default() -> Self {
        Self { enabled: true, peak_prefill_tokens_per_s: 15_928.0, max_ttft_penalty_ms: 18_000.0 }
    }
}

impl AffinityGate {
    /// Estimated time to first token (ms) behind `tokens` uncached prompt tokens.
    pub fn ttft_ms(&self, tokens: u64) -> f64 {
        if self.peak_prefill_tokens_per_s <= 0.0 {
            return 0.0;
        }
        tokens as f64 * 1000.0 / self.peak_prefill_tokens_per_s
    }
}

/// Whether the affinity filter applies: some candidate is affine (not all), and the best
/// affine one's estimated TTFT is within the penalty of the best other's. Each candidate is
/// `(affine, uncached prompt tokens ahead of this request's first token there)`: those in
/// flight to it plus this prompt's own.
pub fn holds(gate: &AffinityGate, candidates: &[(bool, u64)]) -> bool {
    if !gate.enabled || candidates.iter().all(|c| !c.0) || candidates.iter().all(|c| c.0) {
        return false;
    }
    let best = |affine: bool| {
        candidates.iter().filter(|c| c.0 == affine).map(|c| gate.ttft_ms(c.1)).fold(f64::INFINITY, f64::min)
    };
    best(true) - best(false) <= gate.max_ttft_penalty_ms
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_within_the_ttft_penalty_only() {
        let gate = AffinityGate::default();
        // 300,000 queued tokens at 15,928/s is 18.8 s behind an idle 0.4 s: over 18 s.
        assert!(!holds(&gate, &[(true, 306_400), (false, 6_400)]));
        assert!(holds(&gate, &[(true, 286_400), (false, 6_400)]));
        assert!(!holds(&gate, &[(true, 1), (true, 1)]), "every candidate affine: nothing to filter");
        assert!(!holds(&gate, &[(false, 1), (false, 1)]));
        assert!(!holds(&AffinityGate { enabled: false, ..gate }, &[(true, 1), (false, 1)]));
    }
}
