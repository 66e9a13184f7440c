//! Flow control: request classes, pool saturation, and the queue that orders waiting requests
//! by strict priority band, then fairly between tenants (deficit round-robin by estimated
//! tokens), then first-come-first-served within a tenant. Pure logic: the filter, the host and
//! the simulator's router share it (`reference/llmd.md` §2 for llm-d's semantics).

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::Deserialize;

use crate::endpoint::Endpoint;

/// What to do with a request naming an objective the table does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum UnknownObjective {
    /// 400 with a clear message.
    #[default]
    Reject,
    /// Treat it as priority 0.
    Default,
}

/// Limits of one priority band.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BandLimits {
    pub max_requests: usize,
    pub max_bytes: usize,
}

impl Default for BandLimits {
    fn default() -> Self {
        // llm-d's band defaults: 5000 requests, 1 GB.
        Self { max_requests: 5000, max_bytes: 1 << 30 }
    }
}

/// Flow-control settings (the scheduler filter's `flow` section).
#[derive(Debug, Clone, PartialEq, Deserialize)]
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
    /// Deficit round-robin quantum, in estimated tokens.
    pub quantum_tokens: u64,
    /// How often queued requests are re-checked, ms.
    pub tick_ms: u64,
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
    let tenant = match header(&cfg.tenant_header).map(str::trim).filter(|s| !s.is_empty()) {
        Some(t) => t.chars().take(128).collect(),
        None => match header(&cfg.api_key_header).map(str::trim).filter(|s| !s.is_empty()) {
            Some(key) => format!("key-{:016x}", xxhash_rust::xxh64::xxh64(key.as_bytes(), 0xa77a_c4e5)),
            None => DEFAULT_TENANT.into(),
        },
    };
    Ok(RequestClass { priority, tenant })
}

/// Saturation settings of llm-d's utilization detector.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SaturationConfig {
    pub queue_threshold: f64,
    pub kv_threshold: f64,
    /// Metrics older than this count as fully saturated.
    pub stale_ms: u64,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        Self { queue_threshold: 5.0, kv_threshold: 0.8, stale_ms: 200 }
    }
}

/// Pool saturation: the mean over endpoints of `max(waiting/queue_threshold,
/// kv_usage/kv_threshold)`; an endpoint without fresh metrics counts as 1.0. `None` when the
/// pool has no endpoint.
pub fn pool_saturation<'a>(endpoints: impl IntoIterator<Item = &'a Endpoint>, cfg: &SaturationConfig) -> Option<f64> {
    let (mut sum, mut n) = (0.0, 0usize);
    for e in endpoints {
        n += 1;
        sum += match e.fresh_metrics(cfg.stale_ms) {
            Some(m) if e.ready => {
                let q = if cfg.queue_threshold > 0.0 { m.waiting / cfg.queue_threshold } else { 0.0 };
                let kv = if cfg.kv_threshold > 0.0 { m.kv_usage / cfg.kv_threshold } else { 0.0 };
                q.max(kv)
            }
            _ => 1.0,
        };
    }
    (n > 0).then(|| sum / n as f64)
}

/// Why a request left the queue without being served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// Sheddable (priority < 0) while saturated.
    Sheddable,
    /// The band's request or byte limit.
    BandFull,
    /// The global request or byte limit.
    QueueFull,
    /// Waited longer than its TTL.
    Expired,
}

impl Shed {
    /// `x-attache-dropped-reason`.
    pub fn reason(self) -> &'static str {
        match self {
            Shed::Sheddable => "sheddable",
            Shed::BandFull => "band_full",
            Shed::QueueFull => "queue_full",
            Shed::Expired => "ttl_expired",
        }
    }
}

#[derive(Debug)]
struct Item<T> {
    id: u64,
    bytes: usize,
    tokens: u64,
    deadline_ms: u64,
    value: T,
}

/// A tenant's place in its band's deficit round-robin.
#[derive(Debug)]
struct Turn {
    tenant: String,
    deficit: u64,
    /// Its turn has started (the quantum was added).
    in_turn: bool,
}

#[derive(Debug)]
struct Band<T> {
    /// Per tenant, FCFS.
    flows: HashMap<String, VecDeque<Item<T>>>,
    /// Tenants with queued items, in service order.
    active: VecDeque<Turn>,
    requests: usize,
    bytes: usize,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Self { flows: HashMap::new(), active: VecDeque::new(), requests: 0, bytes: 0 }
    }
}

/// The waiting requests of one scheduler instance.
#[derive(Debug)]
pub struct FlowQueue<T> {
    bands: BTreeMap<i32, Band<T>>,
    /// id → (priority, tenant), to find an item on removal.
    index: HashMap<u64, (i32, String)>,
    requests: usize,
    bytes: usize,
}

impl<T> Default for FlowQueue<T> {
    fn default() -> Self {
        Self { bands: BTreeMap::new(), index: HashMap::new(), requests: 0, bytes: 0 }
    }
}

impl<T> FlowQueue<T> {
    pub fn len(&self) -> usize {
        self.requests
    }

    pub fn is_empty(&self) -> bool {
        self.requests == 0
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Queued requests per (priority, tenant).
    pub fn depths(&self) -> Vec<(i32, String, usize)> {
        let mut out = Vec::new();
        for (p, b) in self.bands.iter().rev() {
            for (t, q) in &b.flows {
                if !q.is_empty() {
                    out.push((*p, t.clone(), q.len()));
                }
            }
        }
        out
    }

    /// Queue a request, or say why it cannot wait.
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue(
        &mut self,
        cfg: &FlowConfig,
        id: u64,
        class: &RequestClass,
        bytes: usize,
        tokens: u64,
        now_ms: u64,
        value: T,
    ) -> Result<(), Shed> {
        let limits = cfg.bands.get(&class.priority).copied().unwrap_or(cfg.default_band);
        if self.requests + 1 > cfg.max_requests || self.bytes + bytes > cfg.max_bytes {
            return Err(Shed::QueueFull);
        }
        let band = self.bands.entry(class.priority).or_default();
        if band.requests + 1 > limits.max_requests || band.bytes + bytes > limits.max_bytes {
            return Err(Shed::BandFull);
        }
        let flow = band.flows.entry(class.tenant.clone()).or_default();
        if flow.is_empty() {
            band.active.push_back(Turn { tenant: class.tenant.clone(), deficit: 0, in_turn: false });
        }
        flow.push_back(Item {
            id,
            bytes,
            tokens: tokens.max(1),
            deadline_ms: now_ms.saturating_add(cfg.ttl_ms),
            value,
        });
        band.requests += 1;
        band.bytes += bytes;
        self.requests += 1;
        self.bytes += bytes;
        self.index.insert(id, (class.priority, class.tenant.clone()));
        Ok(())
    }

    fn take(&mut self, priority: i32, tenant: &str, pos: usize) -> Option<(u64, T)> {
        let band = self.bands.get_mut(&priority)?;
        let flow = band.flows.get_mut(tenant)?;
        let item = flow.remove(pos)?;
        if flow.is_empty() {
            band.flows.remove(tenant);
            band.active.retain(|t| t.tenant != tenant);
        }
        band.requests -= 1;
        band.bytes -= item.bytes;
        self.requests -= 1;
        self.bytes -= item.bytes;
        self.index.remove(&item.id);
        if band.requests == 0 {
            self.bands.remove(&priority);
        }
        Some((item.id, item.value))
    }

    /// The next request to dispatch: the highest band with work; in it, deficit round-robin
    /// over tenants by estimated tokens (a tenant's turn adds `quantum` to its deficit and
    /// serves its requests while the deficit covers them); FCFS within the tenant.
    pub fn pop(&mut self, quantum: u64) -> Option<(u64, T)> {
        let quantum = quantum.max(1);
        let (&priority, band) = self.bands.iter_mut().next_back()?;
        // Bounded: every turn that cannot serve adds a quantum to some tenant's deficit.
        loop {
            let turn = band.active.front_mut()?;
            let head = band.flows.get(turn.tenant.as_str()).and_then(|f| f.front()).map(|i| i.tokens)?;
            if !turn.in_turn {
                turn.deficit += quantum;
                turn.in_turn = true;
            }
            if turn.deficit >= head {
                turn.deficit -= head;
                let tenant = turn.tenant.clone();
                return self.take(priority, &tenant, 0);
            }
            turn.in_turn = false;
            if let Some(t) = band.active.pop_front() {
                band.active.push_back(t);
            }
        }
    }

    /// Remove a request (its client went away). Returns whether it was queued.
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let (priority, tenant) = self.index.get(&id).cloned()?;
        let pos = self.bands.get(&priority)?.flows.get(&tenant)?.iter().position(|i| i.id == id)?;
        self.take(priority, &tenant, pos).map(|(_, v)| v)
    }

    /// Remove and return every request whose TTL has passed.
    pub fn expire(&mut self, now_ms: u64) -> Vec<(u64, T)> {
        let mut dead = Vec::new();
        for (p, b) in &self.bands {
            for (t, f) in &b.flows {
                for i in f {
                    if i.deadline_ms <= now_ms {
                        dead.push((*p, t.clone(), i.id));
                    }
                }
            }
        }
        let mut out = Vec::with_capacity(dead.len());
        for (p, t, id) in dead {
            if let Some(pos) =
                self.bands.get(&p).and_then(|b| b.flows.get(&t)).and_then(|f| f.iter().position(|i| i.id == id))
            {
                if let Some(x) = self.take(p, &t, pos) {
                    out.push(x);
                }
            }
        }
        out
    }
}

/// Jain's fairness index of per-tenant allocations: 1.0 is perfectly fair, 1/n is one tenant
/// taking everything.
pub fn jain_index(x: &[f64]) -> f64 {
    let n = x.len() as f64;
    let sum: f64 = x.iter().sum();
    let sq: f64 = x.iter().map(|v| v * v).sum();
    if n == 0.0 || sq == 0.0 {
        return 1.0;
    }
    sum * sum / (n * sq)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointMetrics;

    fn class(p: i32, t: &str) -> RequestClass {
        RequestClass { priority: p, tenant: t.into() }
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

    #[test]
    fn saturation_is_the_mean_of_per_endpoint_pressure_and_stale_counts_as_full() {
        let ep = |waiting: f64, kv: f64, age_ms: u64| Endpoint {
            ready: true,
            metrics: Some(EndpointMetrics { waiting, kv_usage: kv, age_ms, ..Default::default() }),
            ..Default::default()
        };
        let cfg = SaturationConfig::default();
        let s = pool_saturation(&[ep(0.0, 0.4, 0), ep(10.0, 0.0, 0)], &cfg).unwrap();
        assert!((s - (0.5 + 2.0) / 2.0).abs() < 1e-9, "{s}");
        let s = pool_saturation(&[ep(0.0, 0.0, 0), ep(0.0, 0.0, 500)], &cfg).unwrap();
        assert!((s - 0.5).abs() < 1e-9, "stale counts as 1.0: {s}");
        assert_eq!(pool_saturation(&[], &cfg), None);
    }

    #[test]
    fn strict_bands_then_fair_tenants_then_fcfs() {
        let cfg = FlowConfig::default();
        let mut q = FlowQueue::default();
        let mut id = 0;
        let mut push = |q: &mut FlowQueue<u64>, p: i32, t: &str| {
            id += 1;
            q.enqueue(&cfg, id, &class(p, t), 10, 100, 0, id).unwrap();
            id
        };
        // Tenant a floods band 0 first, b arrives later, then one high-priority request.
        let a: Vec<u64> = (0..4).map(|_| push(&mut q, 0, "a")).collect();
        let b: Vec<u64> = (0..2).map(|_| push(&mut q, 0, "b")).collect();
        let hi = push(&mut q, 5, "c");
        let order: Vec<u64> = std::iter::from_fn(|| q.pop(100).map(|(id, _)| id)).collect();
        assert_eq!(order[0], hi, "strict priority first");
        assert_eq!(&order[1..], &[a[0], b[0], a[1], b[1], a[2], a[3]], "tenants alternate, each FCFS");
        assert!(q.is_empty() && q.bytes() == 0);
    }

    #[test]
    fn drr_shares_tokens_not_requests() {
        let cfg = FlowConfig::default();
        let mut q = FlowQueue::default();
        // Tenant big sends 1000-token requests, small sends 100-token ones.
        for i in 0..20u64 {
            q.enqueue(&cfg, i, &class(0, "big"), 1, 1000, 0, ()).unwrap();
            q.enqueue(&cfg, 100 + i, &class(0, "small"), 1, 100, 0, ()).unwrap();
        }
        let mut tokens = HashMap::new();
        for _ in 0..20 {
            let (id, _) = q.pop(500).unwrap();
            *tokens.entry(id < 100).or_insert(0u64) += if id < 100 { 1000 } else { 100 };
        }
        let (big, small) = (tokens[&true] as f64, tokens[&false] as f64);
        assert!(jain_index(&[big, small]) > 0.9, "tokens served big {big} small {small}");
    }

    #[test]
    fn bounds_ttl_and_removal_leave_no_state() {
        let mut cfg = FlowConfig { max_requests: 5, ttl_ms: 1000, ..FlowConfig::default() };
        cfg.bands.insert(-1, BandLimits { max_requests: 2, max_bytes: 1 << 20 });
        let mut q = FlowQueue::default();
        q.enqueue(&cfg, 1, &class(-1, "a"), 10, 1, 0, ()).unwrap();
        q.enqueue(&cfg, 2, &class(-1, "a"), 10, 1, 0, ()).unwrap();
        assert_eq!(q.enqueue(&cfg, 3, &class(-1, "a"), 10, 1, 0, ()), Err(Shed::BandFull));
        q.enqueue(&cfg, 4, &class(0, "a"), 10, 1, 500, ()).unwrap();
        q.enqueue(&cfg, 5, &class(0, "b"), 10, 1, 500, ()).unwrap();
        q.enqueue(&cfg, 6, &class(0, "b"), 10, 1, 500, ()).unwrap();
        assert_eq!(q.enqueue(&cfg, 7, &class(0, "c"), 10, 1, 500, ()), Err(Shed::QueueFull));
        let bytes_cfg = FlowConfig { max_bytes: 55, ..cfg.clone() };
        assert_eq!(q.enqueue(&bytes_cfg, 8, &class(0, "c"), 10, 1, 500, ()), Err(Shed::QueueFull));
        assert!(q.remove(5).is_some());
        assert!(q.remove(5).is_none(), "removed once");
        let expired: Vec<u64> = q.expire(1000).into_iter().map(|(id, _)| id).collect();
        assert_eq!(expired, vec![1, 2]);
        assert_eq!(q.len(), 2);
        q.expire(2000);
        assert!(q.is_empty() && q.bytes() == 0 && q.depths().is_empty() && q.index.is_empty() && q.bands.is_empty());
    }

    #[test]
    fn jain_index_bounds() {
        assert!((jain_index(&[1.0, 1.0, 1.0, 1.0]) - 1.0).abs() < 1e-12);
        assert!((jain_index(&[1.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
    }
}
