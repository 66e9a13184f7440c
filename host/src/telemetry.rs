//! The host's own Prometheus metrics, served as text at `GET /metrics` on the admin listener.
//!
//! One process-wide registry ([`metrics`]): the scrapers, the KV-event subscribers, the
//! snapshot stream and the policy service record into it where the event happens, and
//! [`render`] writes the exposition with the gauges that are read at scrape time (index size,
//! endpoint readiness). Hand-written: the text format is small, and a metrics crate would pull
//! a second registry model into a service that already counts with atomics.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Upper bounds (seconds) of the scrape-duration histogram's buckets.
const SCRAPE_BUCKETS: [f64; 10] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

/// Why a scrape failed, as the `reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ScrapeError {
    /// Nothing listens (connection refused).
    Refused,
    /// No answer within `scrape_timeout_ms`.
    Timeout,
    /// Any other transport error.
    Transport,
    /// A non-2xx HTTP status other than a 4xx.
    Status,
    /// A 4xx: the engine refused the request itself (for a filtered page: no such route).
    Rejected,
    /// The page lacks the metrics the scheduler needs, or does not parse.
    Parse,
}

impl ScrapeError {
    fn label(self) -> &'static str {
        match self {
            Self::Refused => "refused",
            Self::Timeout => "timeout",
            Self::Transport => "transport",
            Self::Status => "status",
            Self::Rejected => "rejected",
            Self::Parse => "parse",
        }
    }
}

#[derive(Debug, Default)]
struct ScrapeStats {
    buckets: [u64; SCRAPE_BUCKETS.len()],
    count: u64,
    sum_s: f64,
    errors: BTreeMap<ScrapeError, u64>,
    last_ok: Option<Instant>,
    /// The engine's current (adaptive) scrape interval.
    interval_s: f64,
    /// When scraping started, for the age of an engine never scraped successfully.
    since: Option<Instant>,
}

/// The registry. Counters only go up; per-endpoint series go when the endpoint leaves
/// discovery.
#[derive(Debug, Default)]
pub struct HostMetrics {
    scrapes: Mutex<BTreeMap<String, ScrapeStats>>,
    kv_ingested: Mutex<BTreeMap<String, u64>>,
    snapshot_version: AtomicU64,
    snapshots_published: AtomicU64,
    /// Snapshot messages and bytes sent, by kind (`full`, `delta`).
    snapshot_sent: Mutex<BTreeMap<&'static str, (u64, u64)>>,
    subscribers: AtomicI64,
    policy_transitions: Mutex<BTreeMap<String, u64>>,
    /// The rollout controller's reads of Envoy stats, by outcome (`ok`, `error`).
    policy_stats_reads: Mutex<BTreeMap<&'static str, u64>>,
    /// Decisions the pickers sent, by outcome (`logged`, `refused`: no policy service, the log
    /// off or unwritable).
    policy_decisions: Mutex<BTreeMap<&'static str, u64>>,
    /// The last shadow comparison per slot: (requests, agreement, hit-rate delta, load delta).
    policy_shadows: Mutex<BTreeMap<String, (u64, f64, f64, f64)>>,
    /// Whether this replica acts as the rollout controller (policy state in Kubernetes), and
    /// writes of the shared policy state refused because another replica wrote first.
    policy_leader: AtomicI64,
    policy_conflicts: AtomicU64,
    /// Reads of engines' `/v1/models`, by outcome (`ok`, `error`).
    model_list_reads: Mutex<BTreeMap<&'static str, u64>>,
    /// Engines that did not honour the scrape's metric-name filter, by why (`status`,
    /// `incomplete`): they are scraped for their whole page from then on.
    scrape_filter_fallbacks: Mutex<BTreeMap<&'static str, u64>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The process's registry.
pub fn metrics() -> &'static HostMetrics {
    static M: OnceLock<HostMetrics> = OnceLock::new();
    M.get_or_init(HostMetrics::default)
}

impl HostMetrics {
    /// Discovery's endpoints are now `endpoints`: series start for new ones and go for those
    /// that left. Only tracked endpoints are recorded, so a scraper or KV subscriber that
    /// reports after its endpoint left cannot bring the series back.
    pub fn track<'a>(&self, endpoints: impl IntoIterator<Item = &'a str>) {
        let wanted: std::collections::BTreeSet<&str> = endpoints.into_iter().collect();
        let mut scrapes = lock(&self.scrapes);
        scrapes.retain(|e, _| wanted.contains(e.as_str()));
        let mut kv = lock(&self.kv_ingested);
        kv.retain(|e, _| wanted.contains(e.as_str()));
        for e in wanted {
            scrapes
                .entry(e.to_owned())
                .or_insert_with(|| ScrapeStats { since: Some(Instant::now()), ..Default::default() });
            kv.entry(e.to_owned()).or_default();
        }
    }

    /// One scrape of `endpoint` took `took` and ended with `result`; the next is `every` after.
    pub fn scrape_done(&self, endpoint: &str, took: Duration, result: Result<(), ScrapeError>, every: Duration) {
        let mut all = lock(&self.scrapes);
        let Some(s) = all.get_mut(endpoint) else { return };
        s.interval_s = every.as_secs_f64();
        let secs = took.as_secs_f64();
        s.count += 1;
        s.sum_s += secs;
        for (i, le) in SCRAPE_BUCKETS.iter().enumerate() {
            if secs <= *le {
                s.buckets[i] += 1;
            }
        }
        match result {
            Ok(()) => s.last_ok = Some(Instant::now()),
            Err(e) => *s.errors.entry(e).or_default() += 1,
        }
    }

    /// `n` KV-cache events from `endpoint` were applied to the precise index.
    pub fn kv_ingested(&self, endpoint: &str, n: u64) {
        if let Some(c) = lock(&self.kv_ingested).get_mut(endpoint) {
            *c += n;
        }
    }

    /// Snapshot `version` was published.
    pub fn snapshot_published(&self, version: u64) {
        self.snapshot_version.store(version, Ordering::Relaxed);
        self.snapshots_published.fetch_add(1, Ordering::Relaxed);
    }

    /// `bytes` of snapshot went to one subscriber, as a `full` snapshot or a `delta`.
    pub fn snapshot_sent(&self, kind: &'static str, bytes: usize) {
        let mut m = lock(&self.snapshot_sent);
        let e = m.entry(kind).or_default();
        e.0 += 1;
        e.1 += bytes as u64;
    }

    /// A snapshot subscriber connected (`+1`) or left (`-1`).
    pub fn subscribers_add(&self, delta: i64) {
        self.subscribers.fetch_add(delta, Ordering::Relaxed);
    }

    /// A policy slot changed state (`rollout`, `promote`, `rollback`, …).
    pub fn policy_transition(&self, action: &str) {
        *lock(&self.policy_transitions).entry(action.to_owned()).or_default() += 1;
    }

    /// An engine's `/v1/models` was read (`ok`) or could not be (`error`).
    pub fn model_list_read(&self, outcome: &'static str) {
        *lock(&self.model_list_reads).entry(outcome).or_default() += 1;
    }

    /// An engine's filtered `/metrics` page was refused or lacked what the scheduler reads
    /// (`ScrapeError::Rejected` or `ScrapeError::Parse`); it is scraped whole from now on.
    pub fn scrape_filter_fallback(&self, why: ScrapeError) {
        let why = if why == ScrapeError::Rejected { "status" } else { "incomplete" };
        *lock(&self.scrape_filter_fallbacks).entry(why).or_default() += 1;
    }

    /// The rollout controller read one Envoy's stats (`ok`) or could not (`error`).
    /// This replica started (`true`) or stopped acting as the rollout controller.
    pub fn policy_leader(&self, leader: bool) {
        self.policy_leader.store(i64::from(leader), Ordering::Relaxed);
    }

    /// A write of the shared policy state lost a race with another replica.
    pub fn policy_conflict(&self) {
        self.policy_conflicts.fetch_add(1, Ordering::Relaxed);
    }

    /// `n` decisions from the pickers were logged or refused.
    pub fn policy_decisions(&self, outcome: &'static str, n: usize) {
        if n > 0 {
            *lock(&self.policy_decisions).entry(outcome).or_default() += n as u64;
        }
    }

    /// A slot's shadow run as the controller last saw it; `None` ends it.
    pub fn policy_shadow(&self, slot: &str, report: Option<(u64, f64, f64, f64)>) {
        let mut g = lock(&self.policy_shadows);
        match report {
            Some(r) => {
                g.insert(slot.to_owned(), r);
            }
            None => {
                g.remove(slot);
            }
        }
    }

    pub fn policy_stats_read(&self, outcome: &'static str) {
        *lock(&self.policy_stats_reads).entry(outcome).or_default() += 1;
    }
}

/// What is read at scrape time rather than counted.
#[derive(Debug, Default)]
pub struct Gauges<'a> {
    pub ready_endpoints: usize,
    pub unready_endpoints: usize,
    pub kv_index_blocks: usize,
    pub kv: Option<&'a KvCounters>,
}

/// A metric family's `# HELP` and `# TYPE` lines.
fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Escape a label value for the text format.
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// The exposition, in Prometheus text format 0.0.4.
pub fn render(m: &HostMetrics, g: &Gauges<'_>) -> String {
    let mut out = String::with_capacity(4096);
    render_scrapes(&mut out, m, Instant::now());
    render_pool_and_kv(&mut out, m, g);
    render_snapshots_and_policy(&mut out, m);
    out
}

/// Scrape latency, errors and age, per endpoint.
fn render_scrapes(out: &mut String, m: &HostMetrics, now: Instant) {
    let scrapes = lock(&m.scrapes);
    family(out, "attache_host_scrape_duration_seconds", "histogram", "Time to scrape an engine's /metrics.");
    for (ep, s) in scrapes.iter() {
        let ep = esc(ep);
        for (le, n) in SCRAPE_BUCKETS.iter().zip(s.buckets) {
            let _ = writeln!(out, "attache_host_scrape_duration_seconds_bucket{{endpoint=\"{ep}\",le=\"{le}\"}} {n}");
        }
        let _ =
            writeln!(out, "attache_host_scrape_duration_seconds_bucket{{endpoint=\"{ep}\",le=\"+Inf\"}} {}", s.count);
        let _ = writeln!(out, "attache_host_scrape_duration_seconds_sum{{endpoint=\"{ep}\"}} {}", s.sum_s);
        let _ = writeln!(out, "attache_host_scrape_duration_seconds_count{{endpoint=\"{ep}\"}} {}", s.count);
    }
    family(out, "attache_host_scrape_errors_total", "counter", "Failed scrapes, by reason.");
    for (ep, s) in scrapes.iter() {
        for (reason, n) in &s.errors {
            let _ = writeln!(
                out,
                "attache_host_scrape_errors_total{{endpoint=\"{}\",reason=\"{}\"}} {n}",
                esc(ep),
                reason.label()
            );
        }
    }
    family(
        out,
        "attache_host_scrape_age_seconds",
        "gauge",
        "Time since the engine's last good scrape (since its scraper started, if none was good).",
    );
    for (ep, s) in scrapes.iter() {
        let age = s.last_ok.or(s.since).map(|t| now.saturating_duration_since(t).as_secs_f64()).unwrap_or(0.0);
        let _ = writeln!(out, "attache_host_scrape_age_seconds{{endpoint=\"{}\"}} {age:.3}", esc(ep));
    }
    family(
        out,
        "attache_host_scrape_interval_seconds",
        "gauge",
        "The engine's current scrape interval: the base while its metrics change, up to the maximum while they do not.",
    );
    for (ep, s) in scrapes.iter() {
        let _ = writeln!(out, "attache_host_scrape_interval_seconds{{endpoint=\"{}\"}} {:.3}", esc(ep), s.interval_s);
    }
}

/// Endpoints by readiness, and the KV-event and precise-index families.
fn render_pool_and_kv(out: &mut String, m: &HostMetrics, g: &Gauges<'_>) {
    family(out, "attache_host_endpoints", "gauge", "Endpoints in the newest snapshot, by readiness.");
    let _ = writeln!(out, "attache_host_endpoints{{state=\"ready\"}} {}", g.ready_endpoints);
    let _ = writeln!(out, "attache_host_endpoints{{state=\"unready\"}} {}", g.unready_endpoints);

    family(out, "attache_host_kv_events_ingested_total", "counter", "KV-cache events applied to the precise index.");
    for (ep, n) in lock(&m.kv_ingested).iter() {
        let _ = writeln!(out, "attache_host_kv_events_ingested_total{{endpoint=\"{}\"}} {n}", esc(ep));
    }
    family(
        out,
        "attache_host_kv_events_dropped_total",
        "counter",
        "KV-event messages or events not applied, by reason.",
    );
    if let Some(kv) = g.kv {
        let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
        for (reason, n) in [
            ("decode_error", c(&kv.decode_errors)),
            ("unknown_topic", c(&kv.unknown_topics)),
            ("unsupported_event", c(&kv.skipped_events)),
        ] {
            let _ = writeln!(out, "attache_host_kv_events_dropped_total{{reason=\"{reason}\"}} {n}");
        }
        family(
            out,
            "attache_host_kv_events_unknown_medium_total",
            "counter",
            "KV events naming a tier the host does not know (indexed, weighted as the cheapest tier).",
        );
        let _ = writeln!(out, "attache_host_kv_events_unknown_medium_total {}", c(&kv.unknown_media));
        family(out, "attache_host_kv_sequence_gaps_total", "counter", "KV-event sequence gaps (refilled from replay).");
        let _ = writeln!(out, "attache_host_kv_sequence_gaps_total {}", c(&kv.gaps));
        family(out, "attache_host_kv_engine_restarts_total", "counter", "Engine restarts seen on the KV-event stream.");
        let _ = writeln!(out, "attache_host_kv_engine_restarts_total {}", c(&kv.restarts));
    }
    family(out, "attache_host_kv_index_blocks", "gauge", "Blocks held in the precise prefix index.");
    let _ = writeln!(out, "attache_host_kv_index_blocks {}", g.kv_index_blocks);
}

/// Snapshot publishing, subscribers and policy transitions.
fn render_snapshots_and_policy(out: &mut String, m: &HostMetrics) {
    family(out, "attache_host_snapshot_version", "gauge", "Version of the newest published snapshot.");
    let _ = writeln!(out, "attache_host_snapshot_version {}", m.snapshot_version.load(Ordering::Relaxed));
    family(out, "attache_host_snapshots_published_total", "counter", "Snapshot versions published.");
    let _ = writeln!(out, "attache_host_snapshots_published_total {}", m.snapshots_published.load(Ordering::Relaxed));
    let sent = lock(&m.snapshot_sent).clone();
    family(
        out,
        "attache_host_snapshot_messages_total",
        "counter",
        "Snapshot messages sent to subscribers, by kind (full, delta).",
    );
    for (kind, (n, _)) in &sent {
        let _ = writeln!(out, "attache_host_snapshot_messages_total{{kind=\"{kind}\"}} {n}");
    }
    family(
        out,
        "attache_host_snapshot_bytes_total",
        "counter",
        "Encoded snapshot bytes sent to subscribers, by kind (full, delta).",
    );
    for (kind, (_, b)) in &sent {
        let _ = writeln!(out, "attache_host_snapshot_bytes_total{{kind=\"{kind}\"}} {b}");
    }
    family(out, "attache_host_subscribers", "gauge", "Open snapshot streams (Envoy agents or workers).");
    let _ = writeln!(out, "attache_host_subscribers {}", m.subscribers.load(Ordering::Relaxed).max(0));

    family(
        out,
        "attache_host_policy_controller_leader",
        "gauge",
        "1 while this replica holds the rollout controller Lease (policy state in Kubernetes), else 0.",
    );
    let _ = writeln!(out, "attache_host_policy_controller_leader {}", m.policy_leader.load(Ordering::Relaxed));
    family(
        out,
        "attache_host_policy_state_conflicts_total",
        "counter",
        "Writes of the shared policy state refused because another replica wrote first (retried or answered 409).",
    );
    let _ = writeln!(out, "attache_host_policy_state_conflicts_total {}", m.policy_conflicts.load(Ordering::Relaxed));
    family(out, "attache_host_policy_transitions_total", "counter", "Policy slot transitions, by action.");
    for (action, n) in lock(&m.policy_transitions).iter() {
        let _ = writeln!(out, "attache_host_policy_transitions_total{{action=\"{}\"}} {n}", esc(action));
    }
    family(
        out,
        "attache_host_policy_stats_reads_total",
        "counter",
        "The rollout controller's reads of Envoy stats, by outcome (ok, error).",
    );
    for (outcome, n) in lock(&m.policy_stats_reads).iter() {
        let _ = writeln!(out, "attache_host_policy_stats_reads_total{{outcome=\"{outcome}\"}} {n}");
    }
    render_decisions_and_shadows(out, m);
    family(
        out,
        "attache_host_model_list_reads_total",
        "counter",
        "Reads of the engines' GET /v1/models (LoRA adapters loaded), by outcome (ok, error).",
    );
    for (outcome, n) in lock(&m.model_list_reads).iter() {
        let _ = writeln!(out, "attache_host_model_list_reads_total{{outcome=\"{outcome}\"}} {n}");
    }
    family(
        out,
        "attache_host_scrape_filter_fallbacks_total",
        "counter",
        "Engines whose metric-name-filtered /metrics page was refused (status) or lacked the load metrics (incomplete, e.g. multi-process vLLM): scraped whole from then on.",
    );
    for (why, n) in lock(&m.scrape_filter_fallbacks).iter() {
        let _ = writeln!(out, "attache_host_scrape_filter_fallbacks_total{{reason=\"{why}\"}} {n}");
    }
}

/// The decision log's intake and each slot's shadow comparison.
fn render_decisions_and_shadows(out: &mut String, m: &HostMetrics) {
    family(
        out,
        "attache_host_policy_decisions_total",
        "counter",
        "Decisions the pickers sent for the decision log, by outcome (logged, refused).",
    );
    for (outcome, n) in lock(&m.policy_decisions).iter() {
        let _ = writeln!(out, "attache_host_policy_decisions_total{{outcome=\"{outcome}\"}} {n}");
    }
    let shadows = lock(&m.policy_shadows).clone();
    let families = [
        ("attache_host_policy_shadow_requests", "Requests a slot's shadow candidate was compared on."),
        ("attache_host_policy_shadow_agreement", "Share of them on which it picked the live primary."),
        ("attache_host_policy_shadow_hit_delta", "Its expected prefix-hit rate minus the live one's."),
        ("attache_host_policy_shadow_load_delta", "Mean load at its pick minus the live pick's."),
    ];
    for (k, (name, help)) in families.into_iter().enumerate() {
        family(out, name, "gauge", help);
        for (slot, &(requests, agreement, hit_delta, load_delta)) in &shadows {
            let value = [requests as f64, agreement, hit_delta, load_delta][k];
            let _ = writeln!(out, "{name}{{slot=\"{}\"}} {value}", esc(slot));
        }
    }
}

/// Counters, exported on the admin API.
#[derive(Debug, Default)]
pub struct KvCounters {
    pub messages: AtomicU64,
    pub events: AtomicU64,
    pub decode_errors: AtomicU64,
    pub skipped_events: AtomicU64,
    /// Events naming a tier the host does not know (indexed at the lowest tier weight).
    pub unknown_media: AtomicU64,
    pub gaps: AtomicU64,
    pub replayed_batches: AtomicU64,
    pub restarts: AtomicU64,
    pub unknown_topics: AtomicU64,
}

impl KvCounters {
    pub fn json(&self) -> serde_json::Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        serde_json::json!({
            "messages": g(&self.messages), "events": g(&self.events), "decode_errors": g(&self.decode_errors),
            "skipped_events": g(&self.skipped_events), "unknown_media": g(&self.unknown_media), "gaps": g(&self.gaps), "replayed_batches": g(&self.replayed_batches),
            "restarts": g(&self.restarts), "unknown_topics": g(&self.unknown_topics),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family_with_its_samples() {
        let m = HostMetrics::default();
        m.track(["10.0.0.1:8000"]);
        m.scrape_done("10.0.0.1:8000", Duration::from_millis(3), Ok(()), Duration::from_millis(50));
        m.scrape_done(
            "10.0.0.1:8000",
            Duration::from_millis(600),
            Err(ScrapeError::Timeout),
            Duration::from_millis(50),
        );
        m.kv_ingested("10.0.0.1:8000", 7);
        m.snapshot_published(4);
        m.snapshot_sent("full", 120);
        m.snapshot_sent("delta", 30);
        m.snapshot_sent("delta", 20);
        m.subscribers_add(1);
        m.policy_transition("rollback");
        let kv = KvCounters::default();
        kv.decode_errors.fetch_add(2, Ordering::Relaxed);
        let text = render(&m, &Gauges { ready_endpoints: 1, unready_endpoints: 0, kv_index_blocks: 9, kv: Some(&kv) });
        for line in [
            "attache_host_scrape_duration_seconds_bucket{endpoint=\"10.0.0.1:8000\",le=\"0.005\"} 1",
            "attache_host_scrape_duration_seconds_bucket{endpoint=\"10.0.0.1:8000\",le=\"+Inf\"} 2",
            "attache_host_scrape_duration_seconds_count{endpoint=\"10.0.0.1:8000\"} 2",
            "attache_host_scrape_errors_total{endpoint=\"10.0.0.1:8000\",reason=\"timeout\"} 1",
            "attache_host_endpoints{state=\"ready\"} 1",
            "attache_host_kv_events_ingested_total{endpoint=\"10.0.0.1:8000\"} 7",
            "attache_host_kv_events_dropped_total{reason=\"decode_error\"} 2",
            "attache_host_kv_index_blocks 9",
            "attache_host_snapshot_version 4",
            "attache_host_snapshot_bytes_total{kind=\"full\"} 120",
            "attache_host_snapshot_bytes_total{kind=\"delta\"} 50",
            "attache_host_snapshot_messages_total{kind=\"delta\"} 2",
            "attache_host_subscribers 1",
            "attache_host_policy_transitions_total{action=\"rollback\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        // Every sample line parses with the host's own Prometheus parser.
        assert_eq!(attache_kv::prom::parse(&text).bad_lines, 0, "{text}");
        // The endpoint leaves; a scraper or subscriber reporting late does not bring it back.
        m.track(["10.0.0.2:8000"]);
        m.scrape_done("10.0.0.1:8000", Duration::from_millis(3), Ok(()), Duration::from_millis(50));
        m.kv_ingested("10.0.0.1:8000", 1);
        let text = render(&m, &Gauges::default());
        assert!(!text.contains("10.0.0.1:8000"), "{text}");
        assert!(text.contains("attache_host_kv_events_ingested_total{endpoint=\"10.0.0.2:8000\"} 0"), "{text}");
    }
}
