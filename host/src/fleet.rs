//! Fleet state: what each Envoy of the fleet learns, merged by the host and sent to the others.
//!
//! Envoys report on their `Exchange` stream, off the request path: new session and
//! Responses-id bindings, new prefix-affinity entries, and their decayed per-tenant usage.
//! [`Fleet::report`] merges a report (bounded, least recently used out), and
//! [`FleetFeed`] broadcasts what changed every `flush_ms`, grouped by the Envoy it came from so
//! nobody is sent its own entries back. A new subscriber first gets [`Fleet::dump`]: the whole
//! merged state, which is how a restarted Envoy recovers the fleet's. A restarted host recovers
//! from its Envoys, which resend what they learned on every new stream (`Report.resync`).
//!
//! Conflicts: of two bindings of one key, the later expiry (the later use) wins. Affinity
//! entries are hints: the newest report wins. Usage reports are whole figures per Envoy, so
//! the host keeps the newest per Envoy and sums the others' for each subscriber.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use attache_proto::v1;
use lru::LruCache;
use tokio::sync::broadcast;

/// `fleet:` in the host configuration.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// Merge and redistribute what Envoys report. Off: reports are read and dropped.
    pub enabled: bool,
    /// Most session and Responses-id bindings kept (least recently reported out).
    pub max_bindings: usize,
    /// Most prefix-affinity entries kept (least recently reported out).
    pub max_affinity: usize,
    /// Most Envoys whose usage is kept; one silent past `envoy_stale_ms` is forgotten first.
    pub max_envoys: usize,
    /// Most tenants per Envoy usage report (the rest are ignored and counted).
    pub max_tenants: usize,
    /// How often merged changes go out to the subscribers.
    pub flush_ms: u64,
    /// An Envoy's usage is forgotten this long after its last report.
    pub envoy_stale_ms: u64,
    /// Half-life of reported usage (keep it equal to the filters' `flow.usage_half_life_ms`).
    pub usage_half_life_ms: u64,
    /// Most changes one flush carries; past it a flush is split over several messages.
    pub max_delta_entries: usize,
    /// The other host replicas' gRPC addresses (`ip:port`): this host follows each, so Envoys
    /// on any replica see the whole fleet.
    pub peers: Vec<String>,
    /// A name resolving to every host replica (`<headless service>:<port>`), re-resolved every
    /// `peers_refresh_ms`; this host's own addresses are left out.
    pub peers_dns: Option<String>,
    pub peers_refresh_ms: u64,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_bindings: 262_144,
            max_affinity: 262_144,
            max_envoys: 1_024,
            max_tenants: 1_024,
            flush_ms: 10,
            envoy_stale_ms: 30_000,
            usage_half_life_ms: attache_policies::flow::FlowConfig::default().usage_half_life_ms,
            max_delta_entries: 16_384,
            peers: Vec::new(),
            peers_dns: None,
            peers_refresh_ms: 5_000,
        }
    }
}

/// The member-name prefix of a peer host's stream (crate::peers), and the origin of what it sent.
pub const PEER_PREFIX: &str = "host:";

/// Whether a member or origin name is a peer host's.
pub fn is_peer(name: &str) -> bool {
    name.starts_with(PEER_PREFIX)
}

/// Longest endpoint address accepted in a report.
const MAX_ADDRESS: usize = 64;

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

/// What the fleet did, for the host's `/metrics`.
#[derive(Debug, Default)]
pub struct FleetCounters {
    pub reports: AtomicU64,
    pub bindings_merged: AtomicU64,
    /// Bindings older than the one already held for their key.
    pub bindings_superseded: AtomicU64,
    pub affinity_merged: AtomicU64,
    /// Entries refused: an empty or over-long address, mismatched arrays, too many tenants.
    pub refused: AtomicU64,
    /// Entries pushed out by the memory limits.
    pub evicted: AtomicU64,
    pub deltas_sent: AtomicU64,
    pub delta_bytes: AtomicU64,
    pub lookups_found: AtomicU64,
    pub lookups_missed: AtomicU64,
}

impl FleetCounters {
    /// A read-through lookup ended, having found what it asked for or not.
    pub fn lookups(&self, found: bool) {
        let c = if found { &self.lookups_found } else { &self.lookups_missed };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// One fleet message of `bytes` went to a subscriber.
    pub fn sent(&self, bytes: usize) {
        self.deltas_sent.fetch_add(1, Ordering::Relaxed);
        self.delta_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// One Envoy's newest usage report.
#[derive(Debug, Clone)]
struct EnvoyUsage {
    at_ms: u64,
    usage: HashMap<String, f64>,
    /// Requests waiting in the Envoy's flow-control queues.
    queued: u32,
    /// Host clock at the report, for staleness.
    heard_ms: u64,
}

/// Changes from one Envoy since the last flush.
#[derive(Debug, Default)]
struct Pending {
    bindings: Vec<v1::Binding>,
    keys: Vec<u64>,
    endpoints: Vec<String>,
    oldest_us: u64,
}

/// What one flush sends: each Envoy's changes (a subscriber skips its own Envoy's), and the
/// usage table when it changed.
#[derive(Debug, Default)]
pub struct Batch {
    pub seq: u64,
    parts: Vec<(String, Pending)>,
    usage: Option<Arc<HashMap<String, EnvoyUsage>>>,
}

/// The merged fleet state.
pub struct Fleet {
    cfg: FleetConfig,
    bindings: LruCache<u64, (String, u64)>,
    affinity: LruCache<u64, String>,
    usage: HashMap<String, EnvoyUsage>,
    usage_changed: bool,
    pending: HashMap<String, Pending>,
    pending_entries: usize,
    seq: u64,
    pub counters: Arc<FleetCounters>,
}

fn cap(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n.max(1)).unwrap_or(NonZeroUsize::MIN)
}

fn valid_address(a: &str) -> bool {
    !a.is_empty() && a.len() <= MAX_ADDRESS
}

/// Usage decayed from `at_ms` to `now_ms`.
fn decayed(u: f64, at_ms: u64, now_ms: u64, half_life_ms: u64) -> f64 {
    if half_life_ms == 0 || now_ms <= at_ms {
        return u;
    }
    u * 0.5f64.powf((now_ms - at_ms) as f64 / half_life_ms as f64)
}

impl Fleet {
    pub fn new(cfg: FleetConfig) -> Self {
        Self {
            bindings: LruCache::new(cap(cfg.max_bindings)),
            affinity: LruCache::new(cap(cfg.max_affinity)),
            usage: HashMap::new(),
            usage_changed: false,
            pending: HashMap::new(),
            pending_entries: 0,
            seq: 0,
            counters: Arc::default(),
            cfg,
        }
    }

    pub fn config(&self) -> &FleetConfig {
        &self.cfg
    }

    /// The unexpired bindings held for `keys`.
    pub fn lookup(&self, keys: &[u64], now_ms: u64) -> Vec<v1::Binding> {
        keys.iter()
            .filter_map(|k| {
                let (e, expires) = self.bindings.peek(k)?;
                (*expires > now_ms).then(|| v1::Binding { key: *k, endpoint: e.clone(), expires_unix_ms: *expires })
            })
            .collect()
    }

    /// Bindings and affinity entries held now.
    pub fn sizes(&self) -> (usize, usize, usize) {
        (self.bindings.len(), self.affinity.len(), self.usage.len())
    }

    /// Merge one report from a subscriber of Envoy `envoy`, received at `now_ms`.
    pub fn report(&mut self, envoy: &str, r: &v1::Report, now_ms: u64) {
        let c = self.counters.clone();
        c.reports.fetch_add(1, Ordering::Relaxed);
        if !self.cfg.enabled {
            return;
        }
        let mut part = self.pending.remove(envoy).unwrap_or_default();
        let room = |n: usize| n < self.cfg.max_delta_entries.saturating_mul(8);
        for b in &r.bindings {
            if !valid_address(&b.endpoint) {
                c.refused.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if let Some((held, expires)) = self.bindings.peek(&b.key) {
                if *expires > b.expires_unix_ms || (*expires == b.expires_unix_ms && *held == b.endpoint) {
                    c.bindings_superseded.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
            if self.bindings.push(b.key, (b.endpoint.clone(), b.expires_unix_ms)).is_some_and(|(k, _)| k != b.key) {
                c.evicted.fetch_add(1, Ordering::Relaxed);
            }
            c.bindings_merged.fetch_add(1, Ordering::Relaxed);
            if room(self.pending_entries) {
                part.bindings.push(b.clone());
                self.pending_entries += 1;
            }
        }
        if r.affinity_keys.len() != r.affinity_endpoints.len() {
            c.refused.fetch_add(r.affinity_keys.len().max(r.affinity_endpoints.len()) as u64, Ordering::Relaxed);
        } else {
            for (k, e) in r.affinity_keys.iter().zip(&r.affinity_endpoints) {
                if !valid_address(e) {
                    c.refused.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                if self.affinity.peek(k).is_some_and(|held| held == e) {
                    self.affinity.promote(k);
                    continue;
                }
                if self.affinity.push(*k, e.clone()).is_some_and(|(old, _)| old != *k) {
                    c.evicted.fetch_add(1, Ordering::Relaxed);
                }
                c.affinity_merged.fetch_add(1, Ordering::Relaxed);
                if room(self.pending_entries) {
                    part.keys.push(*k);
                    part.endpoints.push(e.clone());
                    self.pending_entries += 1;
                }
            }
        }
        if !part.bindings.is_empty() || !part.keys.is_empty() {
            if part.oldest_us == 0 {
                part.oldest_us = now_us();
            }
            self.pending.insert(envoy.to_owned(), part);
        }
        if r.usage_unix_ms > 0 {
            self.merge_usage(envoy, r, now_ms);
        }
    }

    fn merge_usage(&mut self, envoy: &str, r: &v1::Report, now_ms: u64) {
        let mut usage: HashMap<String, f64> = HashMap::with_capacity(r.usage.len().min(self.cfg.max_tenants));
        for (t, u) in &r.usage {
            if usage.len() >= self.cfg.max_tenants || !u.is_finite() || *u < 0.0 {
                self.counters.refused.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            usage.insert(t.clone(), *u);
        }
        if !self.usage.contains_key(envoy) && self.usage.len() >= self.cfg.max_envoys {
            // Forget the Envoy heard from least recently.
            if let Some(k) = self.usage.iter().min_by_key(|(_, u)| u.heard_ms).map(|(k, _)| k.clone()) {
                self.usage.remove(&k);
                self.counters.evicted.fetch_add(1, Ordering::Relaxed);
            }
        }
        let u = EnvoyUsage { at_ms: r.usage_unix_ms, usage, queued: r.queued, heard_ms: now_ms };
        self.usage.insert(envoy.to_owned(), u);
        self.usage_changed = true;
    }

    /// Requests waiting in the flow-control queues of the Envoys reporting to this host (not
    /// its peers': each host replica counts its own Envoys, so a sum over replicas counts each
    /// once), and how many Envoys that is. Envoys silent past `envoy_stale_ms` are left out.
    pub fn queued(&self, now_ms: u64) -> (u64, usize) {
        let live = self
            .usage
            .iter()
            .filter(|(envoy, u)| !is_peer(envoy) && now_ms.saturating_sub(u.heard_ms) <= self.cfg.envoy_stale_ms);
        live.fold((0, 0), |(q, n), (_, u)| (q + u64::from(u.queued), n + 1))
    }

    /// Take what changed since the last call, if anything did.
    pub fn take_batch(&mut self, now_ms: u64) -> Option<Batch> {
        let stale = self.cfg.envoy_stale_ms;
        let before = self.usage.len();
        self.usage.retain(|_, u| now_ms.saturating_sub(u.heard_ms) <= stale);
        if self.usage.len() != before {
            self.usage_changed = true;
        }
        if self.pending.is_empty() && !self.usage_changed {
            return None;
        }
        self.seq += 1;
        self.pending_entries = 0;
        let parts = std::mem::take(&mut self.pending).into_iter().collect();
        let usage = std::mem::take(&mut self.usage_changed).then(|| Arc::new(self.usage.clone()));
        Some(Batch { seq: self.seq, parts, usage })
    }

    /// The whole merged state for a new subscriber of Envoy `envoy`, in messages of at most
    /// `max_delta_entries` entries (the first with `reset`), and the seq it brings them to.
    pub fn dump(&self, envoy: &str, now_ms: u64) -> (Vec<v1::FleetDelta>, u64) {
        let max = self.cfg.max_delta_entries.max(1);
        let mut out = vec![v1::FleetDelta { reset: true, seq: self.seq, ..Default::default() }];
        let fresh = |m: &v1::FleetDelta| m.bindings.len() + m.affinity_keys.len() < max;
        // Oldest first, so the newest entries are applied last (and win a shared slot).
        for (k, (e, expires)) in self.bindings.iter().rev() {
            if *expires <= now_ms {
                continue;
            }
            if !out.last().is_some_and(fresh) {
                out.push(v1::FleetDelta { seq: self.seq, ..Default::default() });
            }
            if let Some(m) = out.last_mut() {
                m.bindings.push(v1::Binding { key: *k, endpoint: e.clone(), expires_unix_ms: *expires });
            }
        }
        for (k, e) in self.affinity.iter().rev() {
            if !out.last().is_some_and(fresh) {
                out.push(v1::FleetDelta { seq: self.seq, ..Default::default() });
            }
            if let Some(m) = out.last_mut() {
                m.affinity_keys.push(*k);
                m.affinity_endpoints.push(e.clone());
            }
        }
        if let Some(first) = out.first_mut() {
            let (usage, at) = remote_usage(&self.usage, envoy, now_ms, self.cfg.usage_half_life_ms);
            first.remote_usage = usage;
            first.usage_unix_ms = at;
        }
        (out, self.seq)
    }
}

/// Every other Envoy's usage, decayed to `now_ms` and summed per tenant.
/// A peer host hears only this host's own Envoys' usage (it hears the other peers' from them).
fn remote_usage(
    all: &HashMap<String, EnvoyUsage>,
    me: &str,
    now_ms: u64,
    half_life_ms: u64,
) -> (HashMap<String, f64>, u64) {
    let mut sum: HashMap<String, f64> = HashMap::new();
    let peer = is_peer(me);
    for (envoy, u) in all {
        if envoy == me || (peer && is_peer(envoy)) {
            continue;
        }
        for (t, v) in &u.usage {
            *sum.entry(t.clone()).or_default() += decayed(*v, u.at_ms, now_ms, half_life_ms);
        }
    }
    (sum, now_ms)
}

impl Batch {
    /// The messages for a subscriber of Envoy `envoy`: every other Envoy's changes, split at
    /// `max` entries, and the others' usage when it changed. Empty: nothing for it. A peer host
    /// gets only what this host's own Envoys reported.
    pub fn for_envoy(&self, envoy: &str, max: usize, half_life_ms: u64) -> Vec<v1::FleetDelta> {
        let max = max.max(1);
        let mut out: Vec<v1::FleetDelta> = Vec::new();
        let new = |oldest: u64| v1::FleetDelta { seq: self.seq, oldest_report_unix_us: oldest, ..Default::default() };
        let peer = is_peer(envoy);
        for (from, p) in &self.parts {
            if from == envoy || (peer && is_peer(from)) {
                continue;
            }
            let full = |m: &v1::FleetDelta| m.bindings.len() + m.affinity_keys.len() >= max;
            for b in &p.bindings {
                if out.last().is_none_or(full) {
                    out.push(new(p.oldest_us));
                }
                if let Some(m) = out.last_mut() {
                    m.bindings.push(b.clone());
                    m.oldest_report_unix_us = m.oldest_report_unix_us.min(p.oldest_us).max(1);
                }
            }
            for (k, e) in p.keys.iter().zip(&p.endpoints) {
                if out.last().is_none_or(full) {
                    out.push(new(p.oldest_us));
                }
                if let Some(m) = out.last_mut() {
                    m.affinity_keys.push(*k);
                    m.affinity_endpoints.push(e.clone());
                    m.oldest_report_unix_us = m.oldest_report_unix_us.min(p.oldest_us).max(1);
                }
            }
        }
        if let Some(all) = &self.usage {
            let (usage, at) = remote_usage(all, envoy, now_ms(), half_life_ms);
            if out.is_empty() {
                out.push(new(0));
            }
            if let Some(m) = out.first_mut() {
                m.remote_usage = usage;
                m.usage_unix_ms = at;
            }
        }
        out
    }
}

/// The fleet state shared by the host's services, and its broadcast of merged changes.
#[derive(Clone)]
pub struct FleetFeed {
    pub fleet: Arc<Mutex<Fleet>>,
    pub tx: broadcast::Sender<Arc<Batch>>,
    pub counters: Arc<FleetCounters>,
    /// Notified whenever a report brought bindings (read-through lookups wait on it).
    bound: Arc<tokio::sync::Notify>,
}

impl FleetFeed {
    /// Start the flush task: every `flush_ms`, broadcast what changed.
    pub fn spawn(cfg: FleetConfig) -> Self {
        let (tx, _) = broadcast::channel(256);
        let every = Duration::from_millis(cfg.flush_ms.max(1));
        let fleet = Fleet::new(cfg);
        let counters = fleet.counters.clone();
        let feed = Self { fleet: Arc::new(Mutex::new(fleet)), tx, counters, bound: Arc::default() };
        let f = feed.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let batch = f.lock().take_batch(now_ms());
                if let Some(b) = batch {
                    // No subscriber is fine: each new one starts from a dump.
                    let _ = f.tx.send(Arc::new(b));
                }
            }
        });
        feed
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, Fleet> {
        self.fleet.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Merge a report now.
    pub fn report(&self, envoy: &str, r: &v1::Report) {
        self.lock().report(envoy, r, now_ms());
        if !r.bindings.is_empty() {
            self.bound.notify_waiters();
        }
    }

    /// The bindings held for `keys`, waiting up to `wait` for any not held yet.
    pub async fn lookup(&self, keys: &[u64], wait: Duration) -> Vec<v1::Binding> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Register before looking, so a report merged in between still wakes us.
            let notified = self.bound.notified();
            let found = self.lookup_now(keys);
            if found.len() == keys.len() {
                self.counters.lookups(true);
                return found;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                self.counters.lookups(!found.is_empty());
                return found;
            }
        }
    }

    fn lookup_now(&self, keys: &[u64]) -> Vec<v1::Binding> {
        self.lock().lookup(keys, now_ms())
    }

    /// The fleet's families for the host's `/metrics`.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        let (bindings, affinity, envoys) = self.lock().sizes();
        let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let k = &self.counters;
        let mut family = |name: &str, kind: &str, help: &str, samples: &[(&str, u64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(out, "{name}{labels} {v}");
            }
        };
        family(
            "attache_host_fleet_entries",
            "gauge",
            "Fleet state held: bindings, prefix-affinity entries, Envoys reporting usage.",
            &[
                ("{kind=\"binding\"}", bindings as u64),
                ("{kind=\"affinity\"}", affinity as u64),
                ("{kind=\"envoy\"}", envoys as u64),
            ],
        );
        family(
            "attache_host_fleet_reports_total",
            "counter",
            "Reports received from fleet members.",
            &[("", c(&k.reports))],
        );
        family(
            "attache_host_fleet_merged_total",
            "counter",
            "Reported entries merged into the fleet state, by kind.",
            &[("{kind=\"binding\"}", c(&k.bindings_merged)), ("{kind=\"affinity\"}", c(&k.affinity_merged))],
        );
        family(
            "attache_host_fleet_dropped_total",
            "counter",
            "Reported entries not kept, by reason: superseded (an older binding), refused (malformed), evicted (memory limit).",
            &[
                ("{reason=\"superseded\"}", c(&k.bindings_superseded)),
                ("{reason=\"refused\"}", c(&k.refused)),
                ("{reason=\"evicted\"}", c(&k.evicted)),
            ],
        );
        family(
            "attache_host_fleet_lookups_total",
            "counter",
            "Read-through lookups of bindings by Envoys, by outcome (found, missed after waiting).",
            &[("{outcome=\"found\"}", c(&k.lookups_found)), ("{outcome=\"missed\"}", c(&k.lookups_missed))],
        );
        family(
            "attache_host_fleet_deltas_sent_total",
            "counter",
            "Fleet messages sent to subscribers.",
            &[("", c(&k.deltas_sent))],
        );
        family(
            "attache_host_fleet_delta_bytes_total",
            "counter",
            "Encoded fleet bytes sent to subscribers.",
            &[("", c(&k.delta_bytes))],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding(key: u64, endpoint: &str, expires: u64) -> v1::Binding {
        v1::Binding { key, endpoint: endpoint.into(), expires_unix_ms: expires }
    }

    fn report(bindings: Vec<v1::Binding>, affinity: &[(u64, &str)]) -> v1::Report {
        v1::Report {
            bindings,
            affinity_keys: affinity.iter().map(|a| a.0).collect(),
            affinity_endpoints: affinity.iter().map(|a| a.1.to_owned()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_report_reaches_every_other_envoy_and_not_its_own() {
        let mut f = Fleet::new(FleetConfig::default());
        f.report("a", &report(vec![binding(1, "10.0.0.1:8000", 5_000)], &[(7, "10.0.0.2:8000")]), 1_000);
        let b = f.take_batch(1_000).expect("changes");
        let to_b = b.for_envoy("b", 100, 0);
        assert_eq!(to_b.len(), 1);
        assert_eq!(to_b[0].bindings, vec![binding(1, "10.0.0.1:8000", 5_000)]);
        assert_eq!(
            (to_b[0].affinity_keys.clone(), to_b[0].affinity_endpoints.clone()),
            (vec![7], vec!["10.0.0.2:8000".into()])
        );
        assert!(to_b[0].oldest_report_unix_us > 0);
        assert!(b.for_envoy("a", 100, 0).is_empty(), "nothing of its own comes back");
        assert!(f.take_batch(1_001).is_none(), "nothing new");
    }

    #[test]
    fn the_later_use_of_a_key_wins_whatever_order_reports_arrive_in() {
        let mut f = Fleet::new(FleetConfig::default());
        f.report("a", &report(vec![binding(1, "new:1", 9_000)], &[]), 1_000);
        f.report("b", &report(vec![binding(1, "old:1", 8_000)], &[]), 1_001);
        let (dump, _) = f.dump("c", 1_002);
        assert_eq!(dump[0].bindings, vec![binding(1, "new:1", 9_000)]);
        assert_eq!(f.counters.bindings_superseded.load(Ordering::Relaxed), 1);
        let b = f.take_batch(1_002).expect("a's binding");
        let all: Vec<_> = b.for_envoy("c", 100, 0).into_iter().flat_map(|m| m.bindings).collect();
        assert_eq!(all, vec![binding(1, "new:1", 9_000)], "b's older binding is not sent");
        // An expired binding is not resent to a new subscriber.
        assert!(f.dump("c", 9_000).0[0].bindings.is_empty());
    }

    #[test]
    fn memory_is_bounded_and_bad_entries_are_refused_and_counted() {
        let cfg = FleetConfig { max_bindings: 4, max_affinity: 3, ..Default::default() };
        let mut f = Fleet::new(cfg);
        let bindings = (0..10).map(|k| binding(k, "10.0.0.1:1", 10_000)).collect();
        let affinity: Vec<(u64, &str)> = (0..10).map(|k| (k, "10.0.0.1:1")).collect();
        f.report("a", &report(bindings, &affinity), 0);
        assert_eq!(f.sizes(), (4, 3, 0));
        assert_eq!(f.counters.evicted.load(Ordering::Relaxed), 6 + 7);
        let long = "x".repeat(65);
        f.report("a", &report(vec![binding(99, "", 1), binding(98, &long, 1)], &[(5, "")]), 0);
        let mut mismatched = report(vec![], &[(1, "a:1")]);
        mismatched.affinity_endpoints.clear();
        f.report("a", &mismatched, 0);
        assert_eq!(f.counters.refused.load(Ordering::Relaxed), 4);
        // The newest survive.
        let (dump, _) = f.dump("b", 0);
        let keys: Vec<u64> = dump.iter().flat_map(|m| m.bindings.iter().map(|b| b.key)).collect();
        assert_eq!(keys, vec![6, 7, 8, 9]);
    }

    #[test]
    fn a_dump_is_split_and_marks_only_its_first_message_reset() {
        let cfg = FleetConfig { max_delta_entries: 3, ..Default::default() };
        let mut f = Fleet::new(cfg);
        let affinity: Vec<(u64, &str)> = (0..7).map(|k| (k, "10.0.0.1:1")).collect();
        f.report("a", &report(vec![binding(1, "e:1", 10)], &affinity), 0);
        let (dump, _) = f.dump("b", 0);
        assert_eq!(dump.iter().map(|m| m.reset).collect::<Vec<_>>(), vec![true, false, false]);
        assert_eq!(dump.iter().map(|m| m.bindings.len() + m.affinity_keys.len()).sum::<usize>(), 8);
        assert!(dump.iter().all(|m| m.bindings.len() + m.affinity_keys.len() <= 3));
        let b = f.take_batch(0).expect("changes");
        assert_eq!(b.for_envoy("b", 3, 0).len(), 3);
    }

    #[test]
    fn each_envoy_hears_the_others_usage_decayed_and_a_silent_one_is_forgotten() {
        let cfg = FleetConfig { usage_half_life_ms: 1_000, envoy_stale_ms: 5_000, ..Default::default() };
        let mut f = Fleet::new(cfg);
        let usage = |pairs: &[(&str, f64)], at: u64| v1::Report {
            usage: pairs.iter().map(|(t, u)| ((*t).to_owned(), *u)).collect(),
            usage_unix_ms: at,
            ..Default::default()
        };
        f.report("a", &usage(&[("t1", 100.0), ("t2", 10.0)], 1_000), 1_000);
        f.report("b", &usage(&[("t1", 50.0)], 1_000), 1_000);
        f.report("b", &usage(&[("t1", 60.0)], 1_000), 1_000);
        let all = f.usage.clone();
        let (to_a, _) = remote_usage(&all, "a", 1_000, 1_000);
        assert_eq!(to_a.get("t1"), Some(&60.0), "b's newest report replaces its older one");
        let (to_c, _) = remote_usage(&all, "c", 2_000, 1_000);
        assert!((to_c["t1"] - 80.0).abs() < 1e-9, "a and b, one half-life later: {to_c:?}");
        assert!(f.take_batch(1_000).is_some_and(|b| b.usage.is_some()));
        assert!(f.take_batch(1_000).is_none(), "unchanged usage is not resent");
        f.report("b", &usage(&[("t1", 1.0)], 7_000), 7_000);
        let b = f.take_batch(7_000).expect("a was forgotten");
        assert_eq!(b.usage.as_ref().map(|u| u.len()), Some(1));
        // Bad figures are refused.
        f.report("b", &usage(&[("t1", f64::NAN), ("t2", -1.0)], 7_001), 7_001);
        assert_eq!(f.counters.refused.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn queue_depth_sums_this_hosts_live_envoys() {
        let cfg = FleetConfig { envoy_stale_ms: 5_000, ..Default::default() };
        let mut f = Fleet::new(cfg);
        let queued = |n: u32, at: u64| v1::Report { queued: n, usage_unix_ms: at, ..Default::default() };
        assert_eq!(f.queued(0), (0, 0));
        f.report("a", &queued(5, 1_000), 1_000);
        f.report("b", &queued(3, 1_000), 1_000);
        f.report("b", &queued(2, 2_000), 2_000);
        // A peer host's stream carries its own Envoys' figures: counted there, not here.
        f.report(&format!("{PEER_PREFIX}10.0.0.2:50051"), &queued(40, 2_000), 2_000);
        assert_eq!(f.queued(2_000), (7, 2), "b's newest report replaces its older one");
        assert_eq!(f.queued(6_500), (2, 1), "a is silent past envoy_stale_ms");
        // A report without usage (bindings only) does not touch the queue figure.
        f.report("b", &v1::Report { queued: 99, ..Default::default() }, 6_500);
        assert_eq!(f.queued(6_500), (2, 1));
    }
}
