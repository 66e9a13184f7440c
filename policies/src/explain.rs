//! Explanations: a request that carries an authorized debug header gets, in a response header,
//! what the scheduler saw. Per candidate it lists each filter's verdict and why, and each
//! scorer's score. It is computed only for such requests, after the decision and from the pool
//! the decision used, so the decision is the same with or without it.
//!
//! The token is configured as its SHA-256 (`debug.token_sha256`), so the Envoy configuration
//! does not hold it. The header is removed from every request before it goes upstream, whether
//! or not its token is right. A wrong token gets no explanation and is counted
//! (`attache.debug.refused`), and the request is routed as any other.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use crate::endpoint::{Endpoint, PoolState, Role};
use crate::filters::FilterContext;
use crate::pickers::tier;
use crate::scheduler::{Decision, Scheduler};

/// Explanations of decisions, for operators (off unless a token is configured).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DebugConfig {
    /// Hex SHA-256 of the token a request must present in `header`
    /// (`printf %s "$TOKEN" | sha256sum`). Unset: explanations are off.
    pub token_sha256: Option<String>,
    /// The request header carrying the token.
    pub header: String,
    /// The response header the explanation is written to (one line of JSON).
    pub response_header: String,
    /// The most candidates listed: the picked ones, then the other scored ones by total, then
    /// the filtered out. The rest are counted in `omitted`.
    pub max_candidates: usize,
}

impl Default for DebugConfig {
    fn default() -> Self {
        Self {
            token_sha256: None,
            header: "x-attache-debug".into(),
            response_header: "x-attache-explain".into(),
            max_candidates: 16,
        }
    }
}

impl DebugConfig {
    /// Explanations are on.
    pub fn enabled(&self) -> bool {
        self.token_sha256.is_some()
    }

    /// `presented` is the configured token: its SHA-256 equals `token_sha256`, compared in
    /// constant time.
    pub fn authorized(&self, presented: &str) -> bool {
        let Some(want) = self.token_sha256.as_deref().and_then(decode_hex) else {
            return false;
        };
        let got = Sha256::digest(presented.as_bytes());
        want.len() == got.len() && want.iter().zip(got.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }

    /// The configuration is usable: a token hash, if set, is 64 hex digits.
    pub fn check(&self) -> Result<(), String> {
        match self.token_sha256.as_deref() {
            Some(h) if decode_hex(h).is_none_or(|b| b.len() != 32) => {
                Err("debug.token_sha256 must be 64 hex digits (the SHA-256 of the token)".into())
            }
            _ => Ok(()),
        }
    }
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| s.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok())).collect()
}

/// Why filter `name` removed `ep` (the filter's rule, with the endpoint's figures it read).
fn reason(name: &str, ep: &Endpoint, model: &str, ctx: &FilterContext<'_>) -> String {
    let m = ep.metrics.as_ref();
    match name {
        "model-filter" if !ep.ready => "not ready".into(),
        "model-filter" => format!("does not serve {model:?}"),
        "decode-filter" | "prefill-filter" => format!("role {:?}", ep.role),
        "saturation-filter" => match m {
            Some(m) => format!(
                "saturated: {} waiting (limit {}), KV {:.2} used (limit {:.2})",
                m.waiting, ctx.saturation.queue_threshold, m.kv_usage, ctx.saturation.kv_threshold
            ),
            None => "saturated: no metrics".into(),
        },
        _ => format!("removed by {name}"),
    }
}

fn tier_name(t: u8) -> &'static str {
    match t {
        tier::AFFINE => "affine",
        tier::STICKY => "sticky",
        _ => "none",
    }
}

/// What the profile's filters did to the pool: per endpoint the filter that removed it and
/// why, which endpoints passed them all, and the error of a filter that stopped the run.
struct Verdicts {
    removed: Vec<Option<(&'static str, String)>>,
    kept: Vec<bool>,
    passed: usize,
    stopped: Option<String>,
}

/// Run the profile's filters in turn over the whole pool, as the profile runs them: what each
/// removes is its verdict. Masks over the pool, so that a large pool costs one pass per filter.
fn filter_verdicts(profile: &crate::profiles::Profile, ctx: &FilterContext<'_>) -> Verdicts {
    let n = ctx.endpoints.len();
    let mut removed: Vec<Option<(&'static str, String)>> = vec![None; n];
    let mut left: Vec<usize> = (0..n).collect();
    let mut kept = vec![true; n];
    let mut stopped = None;
    for f in &profile.filters {
        let before = left.clone();
        if let Err(e) = f.filter(ctx, &mut left) {
            stopped = Some(format!("{}: {e}", f.name()));
            left = before;
            break;
        }
        kept.fill(false);
        for &i in &left {
            if let Some(k) = kept.get_mut(i) {
                *k = true;
            }
        }
        for i in before.into_iter().filter(|&i| !kept.get(i).copied().unwrap_or(false)) {
            if let (Some(slot), Some(ep)) = (removed.get_mut(i), ctx.endpoints.get(i)) {
                *slot = Some((f.name(), reason(f.name(), ep, ctx.model, ctx)));
            }
        }
    }
    Verdicts { removed, kept, passed: left.len(), stopped }
}

/// The explanation of `decision` for a request for `model`, made on `pool`: one line of JSON.
pub fn explain(scheduler: &Scheduler, pool: &PoolState, model: &str, decision: &Decision, max: usize) -> String {
    let profile = scheduler.decode_profile();
    let ctx =
        FilterContext { endpoints: &pool.endpoints, model, saturation: &scheduler.config.saturation, exclude: None };
    let Verdicts { removed, kept, passed, stopped } = filter_verdicts(profile, &ctx);
    let n = pool.endpoints.len();
    let mut scored_mask = vec![false; n];
    for s in &decision.all {
        if let Some(m) = scored_mask.get_mut(s.position) {
            *m = true;
        }
    }
    let address = |i: usize| pool.endpoints.get(i).map_or("", |e| e.address.as_str());
    let rank = |a: &str| decision.endpoints.iter().position(|e| e == a);

    // The scored candidates: picked first (in pick order), then by total.
    let mut scored: Vec<(usize, &crate::Scored)> = decision.all.iter().enumerate().collect();
    scored.sort_by(|(_, a), (_, b)| {
        let (ra, rb) = (rank(address(a.position)), rank(address(b.position)));
        match (ra, rb) {
            (Some(x), Some(y)) => x.cmp(&y),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => b.total.total_cmp(&a.total),
        }
    });
    let mut rows = Vec::new();
    for (k, s) in &scored {
        let scores: Map<String, Value> = s.scores.iter().map(|(n, v)| ((*n).to_owned(), json!(round(*v)))).collect();
        rows.push(json!({
            "endpoint": address(s.position),
            "verdict": "scored",
            "pick": rank(address(s.position)),
            "total": round(s.total),
            "tier": tier_name(decision.tiers.get(*k).copied().unwrap_or(tier::NONE)),
            "prefix_hit": round(s.prefix_hit),
            "scores": scores,
        }));
    }
    for (i, why) in removed.iter().enumerate() {
        match why {
            Some((filter, reason)) => {
                rows.push(json!({"endpoint": address(i), "verdict": "filtered", "filter": filter, "reason": reason}));
            }
            None if scored_mask.get(i) == Some(&false) && kept.get(i) == Some(&true) => {
                rows.push(
                    json!({"endpoint": address(i), "verdict": "passed", "reason": "not drawn into the shortlist"}),
                );
            }
            None => {}
        }
    }
    let omitted = rows.len().saturating_sub(max);
    rows.truncate(max);
    let role = |r: Role| format!("{r:?}").to_lowercase();
    let mut out = json!({
        "model": model,
        "profile": profile.name,
        "pool": pool.endpoints.len(),
        "passed_filters": passed,
        "picked": decision.endpoints,
        "candidates": rows,
        "omitted": omitted,
    });
    if let Some(p) = &decision.prefill {
        out["prefill"] = json!({"endpoint": p.address, "role": role(Role::Prefill)});
    }
    if let Some(s) = stopped {
        out["stopped"] = json!(s);
    }
    out.to_string()
}

fn round(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use hashbrown::HashMap;

    use crate::endpoint::EndpointMetrics;
    use crate::plan::{plan, PlanConfig, PlanRequest, StateView};
    use crate::plugin_config::ScoringConfig;
    use crate::request::{parse, Api};
    use crate::session::SessionConfig;
    use crate::SchedulerConfig;

    const TOKEN: &str = "operator-debug-token-1234";

    fn sha(s: &str) -> String {
        Sha256::digest(s.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn only_the_configured_token_is_authorized() {
        let off = DebugConfig::default();
        assert!(!off.enabled() && !off.authorized(TOKEN));
        let on = DebugConfig { token_sha256: Some(sha(TOKEN)), ..DebugConfig::default() };
        assert!(on.enabled() && on.check().is_ok());
        assert!(on.authorized(TOKEN));
        for wrong in ["", "operator-debug-token-1235", &sha(TOKEN), "operator-debug-token-1234 "] {
            assert!(!on.authorized(wrong), "{wrong:?}");
        }
        let bad = DebugConfig { token_sha256: Some("abc".into()), ..DebugConfig::default() };
        assert!(bad.check().is_err() && !bad.authorized(TOKEN));
    }

    #[test]
    fn the_explanation_gives_each_filters_verdict_and_each_scorers_score() {
        let mut endpoints: Vec<Endpoint> = (0..4).map(|i| Endpoint::idle(format!("10.0.0.{i}:8000"), "m")).collect();
        endpoints[1].metrics = Some(EndpointMetrics { waiting: 50.0, kv_usage: 0.99, ..Default::default() });
        endpoints[2].models = vec!["other".into()];
        endpoints[3].role = Role::Prefill;
        let pool = PoolState { version: 1, endpoints, ..Default::default() };
        let scheduler = Scheduler::new(SchedulerConfig::default()).unwrap();
        let state = scheduler.new_state();
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hello there"}]}"#;
        let req = parse(Api::ChatCompletions, body).unwrap();
        let (inflight, tokens) = (HashMap::new(), HashMap::new());
        let view = StateView {
            pool: &pool,
            state: &state,
            affinity: None,
            kv: None,
            inflight: &inflight,
            inflight_tokens: &tokens,
            host_silent_ms: 0,
        };
        let (sessions, scoring) = (SessionConfig::default(), ScoringConfig::default());
        let config = PlanConfig { scheduler: &scheduler, sessions: &sessions, scoring: &scoring };
        let request = PlanRequest { body_len: body.len(), ..crate::plan::tests::req(&req) };
        let decision = plan(&request, &view, &config).unwrap().decision;
        let x: Value = serde_json::from_str(&explain(&scheduler, &pool, "m", &decision, 16)).unwrap();
        assert_eq!(x["picked"][0], "10.0.0.0:8000", "{x}");
        let row = |a: &str| x["candidates"].as_array().unwrap().iter().find(|r| r["endpoint"] == a).cloned().unwrap();
        let picked = row("10.0.0.0:8000");
        assert_eq!((picked["verdict"].as_str(), picked["pick"].as_u64()), (Some("scored"), Some(0)), "{x}");
        assert!(picked["scores"].as_object().is_some_and(|s| !s.is_empty()), "{x}");
        assert_eq!(row("10.0.0.1:8000")["filter"], "saturation-filter", "{x}");
        assert!(row("10.0.0.1:8000")["reason"].as_str().unwrap().contains("50 waiting"), "{x}");
        assert_eq!(row("10.0.0.2:8000")["filter"], "model-filter", "{x}");
        assert_eq!(row("10.0.0.3:8000")["filter"], "decode-filter", "{x}");
        assert_eq!(x["passed_filters"], 1);
        // Capped, with the rest counted.
        let capped: Value = serde_json::from_str(&explain(&scheduler, &pool, "m", &decision, 2)).unwrap();
        assert_eq!((capped["candidates"].as_array().unwrap().len(), capped["omitted"].as_u64()), (2, Some(2)));
    }
}
