//! SLO-aware scorer: prefers endpoints expected to meet a time-to-first-token objective.
//!
//! Expected TTFT on an endpoint = its recent mean TTFT (from the engine's TTFT histogram, via
//! the host), stretched by its queue (`waiting` per running request), plus the prefill of the
//! prompt part the endpoint does not hold in its prefix cache. Endpoints within the SLO score
//! 0.5..1 by headroom; endpoints over it score below 0.5, falling with the overshoot.
//!
//! `params`: `ttft_slo_ms` (default 1000), `prefill_ms_per_1k_tokens` (default 50, uncached
//! prefill cost), `default_ttft_ms` (when the engine has no TTFT yet, default 100).

use attache_scorer_sdk::{scorer, Candidate, Params, Request, Scorer};

pub struct SloTtft {
    slo_ms: f32,
    prefill_ms_per_1k: f32,
    default_ttft_ms: f32,
}

fn number(params: &Params, key: &str, default: f32) -> Result<f32, String> {
    match params.get(key) {
        None => Ok(default),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && x >= 0.0 => Ok(x as f32),
            _ => Err(format!("{key} must be a number >= 0, got {v}")),
        },
    }
}

impl SloTtft {
    /// The TTFT this endpoint is expected to give this request, ms.
    pub fn expected_ttft_ms(&self, request: &Request, e: &Candidate) -> f32 {
        let base = if e.ttft_ms > 0.0 { e.ttft_ms } else { self.default_ttft_ms };
        let queue = 1.0 + e.waiting.max(0.0) / (e.running.max(0.0) + 1.0);
        let uncached = request.prompt_tokens as f32 * (1.0 - e.prefix_hit.clamp(0.0, 1.0));
        base * queue + uncached / 1000.0 * self.prefill_ms_per_1k
    }
}

impl Scorer for SloTtft {
    fn configure(params: &Params) -> Result<Self, String> {
        let slo_ms = number(params, "ttft_slo_ms", 1000.0)?;
        if slo_ms <= 0.0 {
            return Err("ttft_slo_ms must be > 0".into());
        }
        Ok(Self {
            slo_ms,
            prefill_ms_per_1k: number(params, "prefill_ms_per_1k_tokens", 50.0)?,
            default_ttft_ms: number(params, "default_ttft_ms", 100.0)?,
        })
    }

    fn score(&self, request: &Request, endpoint: &Candidate) -> f32 {
        let t = self.expected_ttft_ms(request, endpoint);
        if t <= self.slo_ms {
            0.5 + 0.5 * (1.0 - t / self.slo_ms)
        } else {
            0.5 * self.slo_ms / t
        }
    }
}

scorer!(SloTtft);

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(ttft: f32, waiting: f32, hit: f32) -> Candidate {
        Candidate { ttft_ms: ttft, waiting, running: 1.0, prefix_hit: hit, ..Default::default() }
    }

    #[test]
    fn faster_emptier_and_cached_endpoints_score_higher() {
        let s = SloTtft::configure(&serde_json::json!({"ttft_slo_ms": 500})).unwrap();
        let r = Request { prompt_tokens: 4000, ..Default::default() };
        let fast = s.score(&r, &ep(100.0, 0.0, 0.9));
        let slow = s.score(&r, &ep(400.0, 0.0, 0.9));
        let queued = s.score(&r, &ep(100.0, 8.0, 0.9));
        let cold = s.score(&r, &ep(100.0, 0.0, 0.0));
        assert!(fast > slow && fast > queued && fast > cold, "{fast} {slow} {queued} {cold}");
        assert!(fast > 0.5, "within SLO scores above 0.5");
        assert!(queued < 0.5, "100 ms x 5 + 20 ms misses a 500 ms SLO: {queued}");
        assert!((0.0..=1.0).contains(&s.score(&r, &ep(1e9, 1e9, 0.0))));
    }

    #[test]
    fn bad_params_are_refused() {
        assert!(SloTtft::configure(&serde_json::json!({"ttft_slo_ms": 0})).is_err());
        assert!(SloTtft::configure(&serde_json::json!({"ttft_slo_ms": "fast"})).is_err());
        assert!(SloTtft::configure(&serde_json::json!({})).is_ok());
    }
}
