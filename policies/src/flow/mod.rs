//! Flow control: request classes ([`classify`]), pool saturation ([`saturation`]), the queue
//! that orders waiting requests by strict priority band, then fairly between tenants, then
//! first-come-first-served within a tenant ([`queue`]), and the fairness state shared between
//! scheduler instances ([`fairness`]). Pure logic: the filter, the host and the simulator's
//! router share it (`reference/llmd.md` §2 for llm-d's semantics).

pub mod admission;
pub mod fairness;
pub mod queue;
pub mod saturation;

use std::collections::BTreeMap;

use serde::Deserialize;

pub use admission::{admit, Refusal, DROPPED_REASON_HEADER};
pub use fairness::{jain_index, Board, Demand, Rivals};
pub use queue::{FlowQueue, Popped, Shed};
pub use saturation::{dispatch_cost, pool_saturation, DetectorConfig, Gate};

/// What to do with a request naming an objective the table does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum UnknownObjective {
    /// 400 with a clear message.
    #[default]
    Reject,
    /// Treat it as priority 0.
    Default,
}

/// Limits of one priority band.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BandLimits {
    pub max_requests: usize,
    pub max_bytes: usize,
    /// The band dispatches only while the estimated pool saturation is below this (1.0 = until
    /// the pool is saturated). A lower ceiling for a low band keeps headroom for higher bands:
    /// llm-d's priority hold-back usage limit.
    pub ceiling: f64,
}

impl Default for BandLimits {
    fn default() -> Self {
        // llm-d's band defaults: 5000 requests, 1 GB.
        Self { max_requests: 5000, max_bytes: 1 << 30, ceiling: 1.0 }
    }
}

/// Flow-control settings (the scheduler filter's `flow` section).
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowConfig {
    pub enabled: bool,
    /// Header naming the request's InferenceObjective.
    pub objective_header: String,
    /// Objective → priority (static; the snapshot's table, from InferenceObjective resources,
    /// takes precedence).
    pub objectives: BTreeMap<String, i32>,
    pub unknown_objective: UnknownObjective,
    /// Header carrying the tenant (fairness id).
    pub tenant_header: String,
    /// Without a tenant header, the tenant is a hash of this header's value (the API key);
    /// the key itself is never kept or logged.
    pub api_key_header: String,
    /// Queue-wait budget per request.
    pub ttl_ms: u64,
    /// Limits over all bands.
    pub max_requests: usize,
    pub max_bytes: usize,
    /// Limits per band (by priority); bands not listed get `default_band`.
    pub bands: BTreeMap<i32, BandLimits>,
    pub default_band: BandLimits,
    /// How much more service (estimated tokens) a tenant may have had than the least-served
    /// tenant waiting on another worker of the same Envoy before this worker holds it back.
    pub quantum_tokens: u64,
    /// How often queued requests are re-checked (TTL, dispatch, the cross-worker board), ms.
    pub tick_ms: u64,
    /// Half-life of the per-tenant usage that fairness compares, ms.
    pub usage_half_life_ms: u64,
    /// Tenants tracked for fairness; beyond this the least-served are forgotten.
    pub max_tenants: usize,
    /// Requests dispatched from one tick at most.
    pub dispatch_per_tick: usize,
    /// Output tokens assumed for a request without `max_tokens` (its cost estimate is prompt
    /// plus output tokens).
    pub default_output_tokens: u64,
    /// A worker's entry on the cross-worker board counts only this long after its last update.
    pub board_stale_ms: u64,
}

impl Default for FlowConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            objective_header: "x-llm-d-inference-objective".into(),
            objectives: BTreeMap::new(),
            unknown_objective: UnknownObjective::Reject,
            tenant_header: "x-attache-tenant".into(),
            api_key_header: "authorization".into(),
            ttl_ms: 60_000,
            max_requests: 10_000,
            max_bytes: 2 << 30,
            bands: BTreeMap::new(),
            default_band: BandLimits::default(),
            quantum_tokens: 2048,
            tick_ms: 20,
            usage_half_life_ms: 60_000,
            max_tenants: 1024,
            dispatch_per_tick: 64,
            default_output_tokens: 256,
            board_stale_ms: 500,
        }
    }
}

/// The tenant of requests that name none.
pub const DEFAULT_TENANT: &str = "default";

/// Who a request belongs to and how much it matters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestClass {
    /// Higher is more important; negative is sheddable.
    pub priority: i32,
    pub tenant: String,
    /// A later turn of a session already under way: it goes ahead of its tenant's requests
    /// that start new sessions (turn priority), in arrival order among such turns.
    pub continuing: bool,
}

impl RequestClass {
    pub fn sheddable(&self) -> bool {
        self.priority < 0
    }
}

/// A request that cannot be classified.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClassError {
    #[error("unknown inference objective {0:?}")]
    UnknownObjective(String),
}

/// Classify a request from its headers (`header(name)`), its body `priority`, and the
/// objective table (`objectives`, the snapshot's; `cfg.objectives` as fallback).
pub fn classify<'a>(
    cfg: &FlowConfig,
    objectives: Option<&BTreeMap<String, i32>>,
    header: impl Fn(&str) -> Option<&'a str>,
    body_priority: Option<i64>,
) -> Result<RequestClass, ClassError> {
    let priority = match header(&cfg.objective_header).map(str::trim).filter(|s| !s.is_empty()) {
        Some(name) => match objectives.and_then(|t| t.get(name)).or_else(|| cfg.objectives.get(name)) {
            Some(p) => *p,
            None if cfg.unknown_objective == UnknownObjective::Default => 0,
            None => return Err(ClassError::UnknownObjective(name.chars().take(128).collect())),
        },
        None => body_priority.map(|p| p.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32).unwrap_or(0),
    };
    let tenant = match principal(header(&cfg.tenant_header), header(&cfg.api_key_header)) {
        Principal::Tenant(t) => t.chars().take(128).collect(),
        Principal::ApiKey(key) => format!("key-{:016x}", xxhash_rust::xxh64::xxh64(key.as_bytes(), 0xa77a_c4e5)),
        Principal::Anonymous => DEFAULT_TENANT.into(),
    };
    Ok(RequestClass { priority, tenant, continuing: false })
}

/// Whom a request is for: the tenant header's value, else the API key (both trimmed, empty
/// as absent). Flow control's fairness and the Responses store's ownership both read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Principal<'a> {
    Tenant(&'a str),
    ApiKey(&'a str),
    Anonymous,
}

pub fn principal<'a>(tenant_header: Option<&'a str>, api_key: Option<&'a str>) -> Principal<'a> {
    let given = |v: Option<&'a str>| v.map(str::trim).filter(|s| !s.is_empty());
    match (given(tenant_header), given(api_key)) {
        (Some(t), _) => Principal::Tenant(t),
        (None, Some(k)) => Principal::ApiKey(k),
        (None, None) => Principal::Anonymous,
    }
}

impl FlowConfig {
    /// The limits of `priority`'s band.
    pub fn band(&self, priority: i32) -> BandLimits {
        self.bands.get(&priority).copied().unwrap_or(self.default_band)
    }

    /// A request's cost for fairness: prompt plus (expected) output tokens.
    pub fn cost(&self, prompt_tokens: u64, max_tokens: Option<u64>) -> u64 {
        prompt_tokens.saturating_add(max_tokens.unwrap_or(self.default_output_tokens).min(1 << 20)).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(p: i32, t: &str) -> RequestClass {
        RequestClass { priority: p, tenant: t.into(), continuing: false }
    }

    #[test]
    fn classes_come_from_objective_header_body_tenant_and_key() {
        let mut cfg = FlowConfig::default();
        cfg.objectives.insert("static".into(), 3);
        let table: BTreeMap<String, i32> = [("interactive".to_owned(), 10), ("batch".to_owned(), -1)].into();
        let h = |pairs: &'static [(&'static str, &'static str)]| {
            move |n: &str| pairs.iter().find(|(k, _)| *k == n).map(|(_, v)| *v)
        };
        let c = classify(
            &cfg,
            Some(&table),
            h(&[("x-llm-d-inference-objective", "interactive"), ("x-attache-tenant", "acme")]),
            Some(-5),
        )
        .unwrap();
        assert_eq!(c, class(10, "acme"), "the objective wins over the body's priority");
        assert!(classify(&cfg, Some(&table), h(&[("x-llm-d-inference-objective", "batch")]), None)
            .unwrap()
            .sheddable());
        assert_eq!(classify(&cfg, None, h(&[("x-llm-d-inference-objective", "static")]), None).unwrap().priority, 3);
        assert_eq!(classify(&cfg, None, h(&[]), Some(7)).unwrap(), class(7, DEFAULT_TENANT));
        assert_eq!(classify(&cfg, None, h(&[]), None).unwrap(), class(0, DEFAULT_TENANT));
        assert_eq!(
            classify(&cfg, None, h(&[("x-llm-d-inference-objective", "nope")]), None),
            Err(ClassError::UnknownObjective("nope".into()))
        );
        cfg.unknown_objective = UnknownObjective::Default;
        assert_eq!(classify(&cfg, None, h(&[("x-llm-d-inference-objective", "nope")]), None).unwrap().priority, 0);
        // The API key is hashed, never kept.
        let k = classify(&cfg, None, h(&[("authorization", "Bearer sk-secret-1")]), None).unwrap();
        assert!(k.tenant.starts_with("key-") && !k.tenant.contains("secret"), "{}", k.tenant);
        let k2 = classify(&cfg, None, h(&[("authorization", "Bearer sk-secret-2")]), None).unwrap();
        assert_ne!(k.tenant, k2.tenant);
    }
}
