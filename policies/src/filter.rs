//! Filters narrow the candidate endpoints. Each returns the indices it keeps; a filter that
//! would drop every candidate for a soft reason (saturation, stale metrics) keeps them all,
//! so the pool degrades to load-only scheduling instead of failing.

use crate::config::SaturationConfig;
use crate::endpoint::{Endpoint, Role};

/// Keep endpoints that serve `model`.
pub fn by_model(endpoints: &[Endpoint], candidates: &mut Vec<usize>, model: &str) {
    candidates.retain(|&i| endpoints.get(i).is_some_and(|e| e.serves(model)));
}

/// Keep ready endpoints that can take whole requests (role `both` or `decode`).
pub fn by_health(endpoints: &[Endpoint], candidates: &mut Vec<usize>) {
    candidates.retain(|&i| endpoints.get(i).is_some_and(|e| e.ready && e.role != Role::Prefill));
}

/// Keep ready endpoints of the prefill role (the P/D prefill profile).
pub fn prefill_role(endpoints: &[Endpoint], candidates: &mut Vec<usize>) {
    candidates.retain(|&i| endpoints.get(i).is_some_and(|e| e.ready && e.role == Role::Prefill));
}

/// Whether an endpoint's fresh metrics say it is saturated.
pub fn is_saturated(e: &Endpoint, cfg: &SaturationConfig) -> bool {
    match e.fresh_metrics(cfg.metrics_stale_ms) {
        Some(m) => m.waiting >= cfg.queue_threshold || m.kv_usage >= cfg.kv_threshold,
        None => false,
    }
}

/// Drop saturated endpoints, unless every candidate is saturated.
pub fn by_saturation(endpoints: &[Endpoint], candidates: &mut Vec<usize>, cfg: &SaturationConfig) {
    let keep: Vec<usize> =
        candidates.iter().copied().filter(|&i| endpoints.get(i).is_some_and(|e| !is_saturated(e, cfg))).collect();
    if !keep.is_empty() {
        *candidates = keep;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointMetrics;

    fn ep(addr: &str, waiting: f64, kv: f64, age: u64) -> Endpoint {
        Endpoint {
            address: addr.into(),
            models: vec!["m".into()],
            role: Role::Both,
            ready: true,
            metrics: Some(EndpointMetrics { waiting, running: 0.0, kv_usage: kv, age_ms: age, ttft_ms: 0.0 }),
            ..Default::default()
        }
    }

    #[test]
    fn saturation_drops_busy_but_never_all() {
        let cfg = SaturationConfig::default();
        let eps = vec![ep("a", 10.0, 0.1, 0), ep("b", 0.0, 0.97, 0), ep("c", 1.0, 0.1, 0), ep("d", 50.0, 0.1, 99_999)];
        let mut c = vec![0, 1, 2, 3];
        by_saturation(&eps, &mut c, &cfg);
        assert_eq!(c, vec![2, 3], "stale metrics do not count as saturation here");
        let mut c = vec![0, 1];
        by_saturation(&eps, &mut c, &cfg);
        assert_eq!(c, vec![0, 1]);
    }

    #[test]
    fn model_and_health() {
        let mut eps = vec![ep("a", 0.0, 0.0, 0), ep("b", 0.0, 0.0, 0), ep("c", 0.0, 0.0, 0)];
        eps[1].ready = false;
        eps[2].models = vec!["other".into()];
        let mut c = vec![0, 1, 2];
        by_model(&eps, &mut c, "m");
        assert_eq!(c, vec![0, 1]);
        by_health(&eps, &mut c);
        assert_eq!(c, vec![0]);
    }
}
