//! This Envoy as a member of the fleet: it reports what it learns to the host and applies what
//! the other Envoys learned, on the `Exchange` form of the snapshot stream. Off the request
//! path: everything here runs from a root context's tick or stream callbacks.
//!
//! Two shapes, as the snapshot stream has:
//! - **agent** (one per Envoy): reads every worker's decisions from the shared entry logs
//!   (prefix affinity, session bindings) and the fairness board, and reports them. What comes
//!   back is written where every worker reads it: bindings into the sticky table, affinity
//!   entries into the agent's own affinity log (paced, so workers keep up), usage into shared
//!   data.
//! - **per worker** (Istio's WasmPlugin): each worker reports its own decisions, and applies
//!   what comes back to its own affinity table (its siblings get the same deltas).
//!
//! Local state is never cleared by the host: an Envoy that cannot reach it keeps routing on
//! what it knows (fail-static), and a reconnect resends what this Envoy learned recently
//! (`resync`), so a restarted host relearns the fleet from its Envoys.

use std::collections::VecDeque;
use std::num::NonZeroUsize;

use attache_policies::index::AffinityTable;
use attache_policies::plugin_config::FleetConfig;
use attache_policies::session::{self, StickyStore};
use attache_proto::v1;
use lru::LruCache;

use crate::flow_state::BOARD_KEY;
use crate::hostcalls as host;
use crate::metrics::Metrics;
use crate::shared::entry_log::{self, Entry, EntryLog, PAGES_PER_FLUSH, PAGE_ENTRIES};
use crate::shared::fleet as shared;
use crate::shared::sessions::SharedSticky;

/// Most entries one report carries; a larger resync is split over several.
pub const REPORT_ENTRIES: usize = 8_192;
/// Most entries waiting for the next report; past it new ones are dropped and counted.
pub const OUT_MAX: usize = 4 * REPORT_ENTRIES;
/// Usage is re-reported at least this often while it is non-zero, so the host does not forget
/// an Envoy that is merely steady.
const USAGE_REPORT_MS: u64 = 1_000;

fn cap(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n.max(1)).unwrap_or(NonZeroUsize::MIN)
}

/// One subscriber's side of the fleet exchange.
pub struct FleetMember {
    pub cfg: FleetConfig,
    pub envoy: String,
    agent: bool,
    affinity_log: EntryLog,
    bindings_log: EntryLog,
    out: v1::Report,
    recent_bindings: LruCache<u64, (String, u64)>,
    recent_affinity: LruCache<u64, String>,
    /// Received affinity entries not yet written to the affinity log (agent).
    backlog: VecDeque<Entry>,
    board_cas: Option<u32>,
    last_usage_ms: u64,
    /// The queue depth last reported: a change is reported at once.
    last_queued: u32,
    /// The stream (re)opened: resend what was learned recently.
    resync: bool,
}

impl FleetMember {
    pub fn new(cfg: FleetConfig, agent: bool) -> Self {
        Self {
            envoy: shared::envoy_id(),
            agent,
            affinity_log: EntryLog::new(entry_log::AFFINITY),
            bindings_log: EntryLog::new(entry_log::BINDINGS),
            out: v1::Report::default(),
            recent_bindings: LruCache::new(cap(cfg.resync_entries)),
            recent_affinity: LruCache::new(cap(cfg.resync_entries)),
            backlog: VecDeque::new(),
            board_cas: None,
            last_usage_ms: 0,
            last_queued: 0,
            resync: false,
            cfg,
        }
    }

    /// The first message of a new `Exchange` stream: who this is. What it learned before
    /// follows with the next reports.
    pub fn hello(&mut self, node: &str) -> v1::Report {
        self.resync = true;
        self.board_cas = None;
        v1::Report { node: node.to_owned(), envoy: self.envoy.clone(), resync: true, ..Default::default() }
    }

    fn room(&self) -> bool {
        self.out.bindings.len() + self.out.affinity_keys.len() < OUT_MAX
    }

    fn push_binding(&mut self, key: u64, expires_ms: u64, endpoint: &str) -> bool {
        self.recent_bindings.put(key, (endpoint.to_owned(), expires_ms));
        if !self.room() {
            return false;
        }
        self.out.bindings.push(v1::Binding { key, endpoint: endpoint.to_owned(), expires_unix_ms: expires_ms });
        true
    }

    fn push_affinity(&mut self, key: u64, endpoint: &str) -> bool {
        if self.recent_affinity.peek(&key).is_some_and(|e| e == endpoint) {
            // Already reported; the host has it (or gets it on the next resync).
            self.recent_affinity.promote(&key);
            return true;
        }
        self.recent_affinity.put(key, endpoint.to_owned());
        if !self.room() {
            return false;
        }
        self.out.affinity_keys.push(key);
        self.out.affinity_endpoints.push(endpoint.to_owned());
        true
    }

    /// Agent: collect every worker's new decisions from the entry logs.
    pub fn collect_logs(&mut self, metrics: &mut Metrics) {
        let mut bindings = Vec::new();
        self.bindings_log.read_new(|k, expires, e| bindings.push((k, expires, e.to_owned())));
        let mut affinity = Vec::new();
        self.affinity_log.read_new(|k, _, e| affinity.push((k, e.to_owned())));
        self.collect(&affinity, &bindings, metrics);
    }

    /// Collect decisions: `(block hash, endpoint)` and `(sticky key, expiry, endpoint)`.
    pub fn collect(&mut self, affinity: &[(u64, String)], bindings: &[Entry], metrics: &mut Metrics) {
        let mut dropped = 0;
        for (k, expires, e) in bindings {
            dropped += usize::from(!self.push_binding(*k, *expires, e));
        }
        for (k, e) in affinity {
            dropped += usize::from(!self.push_affinity(*k, e));
        }
        if dropped > 0 {
            metrics.fleet_dropped(dropped);
        }
    }

    /// Put this Envoy's usage on the next report if the board changed (or is due again).
    fn collect_usage(&mut self, now_ms: u64) {
        let (bytes, cas) = host::shared_data_cas(BOARD_KEY);
        let due = now_ms.saturating_sub(self.last_usage_ms) >= USAGE_REPORT_MS;
        if cas == self.board_cas && !due {
            return;
        }
        // No board yet (nothing queued or dispatched under flow control, or flow control off):
        // an empty one, so the host still hears that nothing waits here.
        let board = bytes.as_deref().and_then(attache_policies::flow::Board::decode).unwrap_or_default();
        self.board_cas = cas;
        let queued = board.queued();
        if board.usage.is_empty() && queued == self.last_queued && !due {
            return;
        }
        self.out.usage = board.usage.into_iter().collect();
        self.out.usage_unix_ms = board.at_ms.max(1);
        self.out.queued = queued;
        self.last_queued = queued;
        self.last_usage_ms = now_ms;
    }

    /// The reports due now: after a (re)open, what was learned recently; then what is new.
    pub fn take_reports(&mut self, now_ms: u64, metrics: &mut Metrics) -> Vec<v1::Report> {
        self.collect_usage(now_ms);
        let mut reports = Vec::new();
        if std::mem::take(&mut self.resync) {
            metrics.fleet_resync();
            let mut r = v1::Report { resync: true, ..Default::default() };
            let full = |r: &v1::Report| r.bindings.len() + r.affinity_keys.len() >= REPORT_ENTRIES;
            for (k, (e, expires)) in self.recent_bindings.iter().rev() {
                if *expires <= now_ms {
                    continue;
                }
                r.bindings.push(v1::Binding { key: *k, endpoint: e.clone(), expires_unix_ms: *expires });
                if full(&r) {
                    reports.push(std::mem::replace(&mut r, v1::Report { resync: true, ..Default::default() }));
                }
            }
            for (k, e) in self.recent_affinity.iter().rev() {
                r.affinity_keys.push(*k);
                r.affinity_endpoints.push(e.clone());
                if full(&r) {
                    reports.push(std::mem::replace(&mut r, v1::Report { resync: true, ..Default::default() }));
                }
            }
            reports.push(r);
            // What was collected since is in the recent tables, so it went with the resync.
            self.out.bindings.clear();
            self.out.affinity_keys.clear();
            self.out.affinity_endpoints.clear();
        }
        let out = std::mem::take(&mut self.out);
        if !out.bindings.is_empty() || !out.affinity_keys.is_empty() || out.usage_unix_ms > 0 {
            reports.push(out);
        } else if let Some(first) = reports.first_mut() {
            first.usage = out.usage;
        }
        reports.retain(|r| !r.bindings.is_empty() || !r.affinity_keys.is_empty() || r.usage_unix_ms > 0);
        metrics.fleet_reported(reports.iter().map(|r| r.bindings.len() + r.affinity_keys.len()).sum());
        reports
    }

    /// Apply what the host sent: bindings into the sticky table (the later expiry wins),
    /// affinity entries into `table` (per worker) or the backlog for the workers (agent), and
    /// the other Envoys' usage.
    pub fn apply(
        &mut self,
        d: &v1::FleetDelta,
        slots: u64,
        ttl_ms: u64,
        table: Option<&mut AffinityTable>,
        metrics: &mut Metrics,
        now_ms: u64,
    ) {
        let mut lags = Vec::with_capacity(d.bindings.len().min(1024));
        let mut bound = 0;
        for b in &d.bindings {
            if b.expires_unix_ms <= now_ms || b.endpoint.is_empty() {
                continue;
            }
            let slot = b.key % slots.max(1);
            let held = SharedSticky.load(slot).filter(|s| s.key == b.key);
            if held.as_ref().is_some_and(|s| s.expires_ms >= b.expires_unix_ms) {
                continue;
            }
            let entry = session::Sticky { key: b.key, endpoint: b.endpoint.clone(), expires_ms: b.expires_unix_ms };
            SharedSticky.store(slot, &entry);
            bound += 1;
            if !d.reset && lags.len() < 1024 {
                lags.push(now_ms.saturating_sub(b.expires_unix_ms.saturating_sub(ttl_ms)));
            }
        }
        let n = d.affinity_keys.len().min(d.affinity_endpoints.len());
        match table {
            Some(t) => {
                for (k, e) in d.affinity_keys.iter().zip(&d.affinity_endpoints) {
                    t.store(*k, e);
                }
            }
            None if self.agent => {
                let stamp = now_ms;
                for (k, e) in d.affinity_keys.iter().zip(&d.affinity_endpoints) {
                    self.backlog.push_back((*k, stamp, e.clone()));
                }
                let over = self.backlog.len().saturating_sub(self.cfg.apply_backlog);
                if over > 0 {
                    self.backlog.drain(..over);
                    metrics.fleet_dropped(over);
                }
            }
            None => {}
        }
        if d.usage_unix_ms > 0 {
            let usage = d.remote_usage.iter().map(|(t, u)| (t.clone(), *u)).collect();
            let _ = shared::publish_usage(d.usage_unix_ms, &usage);
        }
        let propagation = (d.oldest_report_unix_us > 0).then(|| host::now_us().saturating_sub(d.oldest_report_unix_us));
        metrics.fleet_applied(bound, n, &lags, propagation);
    }

    /// Agent: write received affinity entries to its affinity log for the workers, at most
    /// what a worker reads in one tick.
    pub fn drain_backlog(&mut self) {
        if self.backlog.is_empty() {
            return;
        }
        let n = self.backlog.len().min(PAGES_PER_FLUSH * PAGE_ENTRIES);
        let batch: Vec<Entry> = self.backlog.drain(..n).collect();
        self.affinity_log.write(&batch);
    }

    /// Whether this member reads the Envoy's logs (the agent) or reports its own worker's.
    pub fn is_agent(&self) -> bool {
        self.agent
    }
}

#[cfg(test)]
mod tests {
    use attache_policies::session::session_key;
    use prost::Message;
    use proxy_wasm::traits::Context;

    use super::*;
    use crate::testing::harness::{address, deliver, open_stream, prompt, publish, snapshot, Filter, Request};
    use crate::testing::{advance_ms, metric, now_ms, with};

    /// The reports sent on the open stream after its first (the hello).
    fn reports() -> Vec<v1::Report> {
        open_stream().sent.iter().skip(1).map(|(m, _)| v1::Report::decode(m.as_slice()).expect("a report")).collect()
    }

    fn long_prompt(i: usize) -> String {
        prompt(&format!("{i} {}", "a long shared system prompt ".repeat(40)))
    }

    fn fleet(d: v1::FleetDelta) -> v1::update::Kind {
        v1::update::Kind::Fleet(d)
    }

    #[test]
    fn an_agent_reports_its_workers_decisions_and_applies_the_other_envoys() {
        publish(&snapshot(4));
        let mut agent = Filter::configure(r#"{"role":"agent"}"#);
        // The test's turns are unrelated prompts whose requests never end, so the session's
        // endpoint only gathers queue: sessions must not yield here, the subject is which
        // binding wins.
        let (mut worker, ok) = Filter::try_configure_as(
            2,
            r#"{"scheduler":{"prefix":{"affinity_filter":{"max_session_penalty_ms":1e9}}}}"#,
        );
        assert!(ok);
        let primary = worker.send(Request::completion(&long_prompt(1)).header("x-session-id", "s1")).primary();
        let primary = primary.expect("routed");
        worker.tick();
        agent.tick();
        let sent = reports();
        let bindings: Vec<_> = sent.iter().flat_map(|r| r.bindings.clone()).collect();
        assert_eq!(bindings.len(), 1, "{sent:?}");
        assert_eq!((bindings[0].key, bindings[0].endpoint.as_str()), (session_key("s1"), primary.as_str()));
        assert_eq!(bindings[0].expires_unix_ms, now_ms() + 600_000);
        let affinity: Vec<_> = sent.iter().flat_map(|r| r.affinity_endpoints.clone()).collect();
        assert!(!affinity.is_empty() && affinity.iter().all(|e| *e == primary), "{affinity:?}");
        assert!(metric("attache.fleet.reported") >= Some(2));
        // Nothing new: nothing more is sent.
        agent.tick();
        assert_eq!(reports().len(), sent.len());

        // Another Envoy bound session s2 to endpoint 3, and routed a prefix there.
        let elsewhere = address(3);
        let expires = now_ms() + 599_990;
        let hashes: Vec<u64> = (0..5).collect();
        deliver(
            &mut agent,
            fleet(v1::FleetDelta {
                seq: 1,
                bindings: vec![v1::Binding {
                    key: session_key("s2"),
                    endpoint: elsewhere.clone(),
                    expires_unix_ms: expires,
                }],
                affinity_keys: hashes.clone(),
                affinity_endpoints: vec![elsewhere.clone(); 5],
                oldest_report_unix_us: crate::testing::now_ms() * 1000,
                ..Default::default()
            }),
        );
        assert_eq!(metric("attache.fleet.applied.bindings"), Some(1));
        assert_eq!(metric("attache.fleet.applied.affinity"), Some(5));
        let ex = worker.send(Request::completion(&long_prompt(2)).header("x-session-id", "s2"));
        assert_eq!(ex.primary(), Some(elsewhere.clone()), "the session learned on another Envoy");
        // The affinity entries reach the workers through the agent's log.
        agent.tick();
        let before = metric("attache.affinity.learned").unwrap_or(0);
        worker.tick();
        assert_eq!(metric("attache.affinity.learned"), Some(before + 5));
        // And are not reported back.
        agent.tick();
        let echoed: Vec<u64> = reports().iter().flat_map(|r| r.affinity_keys.clone()).filter(|k| *k < 5).collect();
        assert!(echoed.is_empty(), "{echoed:?}");

        // A binding older than the one held here does not replace it.
        let held = worker.send(Request::completion(&long_prompt(3)).header("x-session-id", "s1")).primary();
        deliver(
            &mut agent,
            fleet(v1::FleetDelta {
                seq: 2,
                bindings: vec![v1::Binding {
                    key: session_key("s1"),
                    endpoint: elsewhere.clone(),
                    expires_unix_ms: expires,
                }],
                ..Default::default()
            }),
        );
        let again = worker.send(Request::completion(&long_prompt(4)).header("x-session-id", "s1")).primary();
        assert_eq!(again, held, "the newer local use wins");
    }

    #[test]
    fn the_other_envoys_usage_reaches_fairness_decayed() {
        let mut agent = Filter::configure(r#"{"role":"agent"}"#);
        let usage = [("a".to_owned(), 800.0), ("b".to_owned(), 100.0)].into_iter().collect();
        deliver(
            &mut agent,
            fleet(v1::FleetDelta { seq: 1, remote_usage: usage, usage_unix_ms: now_ms(), ..Default::default() }),
        );
        let half_life = attache_policies::flow::FlowConfig::default().usage_half_life_ms;
        let got = shared::remote_usage(now_ms(), half_life);
        assert_eq!(got.get("a"), Some(&800.0));
        advance_ms(half_life);
        let got = shared::remote_usage(now_ms(), half_life);
        assert!((got["a"] - 400.0).abs() < 1e-6, "{got:?}");
    }

    #[test]
    fn a_worker_in_per_worker_mode_reports_its_own_decisions_and_learns_directly() {
        publish(&snapshot(4));
        let mut w = Filter::configure(r#"{"subscribe":{}}"#);
        let primary = w.send(Request::completion(&long_prompt(1)).header("x-session-id", "s1")).primary();
        w.tick();
        let sent = reports();
        assert_eq!(
            sent.iter().flat_map(|r| r.bindings.iter().map(|b| b.endpoint.clone())).collect::<Vec<_>>(),
            vec![primary.expect("routed")]
        );
        assert!(sent.iter().any(|r| !r.affinity_keys.is_empty()));
        let before = w.worker().borrow().affinity.len();
        deliver(
            &mut w,
            fleet(v1::FleetDelta {
                seq: 1,
                affinity_keys: vec![11, 12],
                affinity_endpoints: vec![address(2), address(2)],
                ..Default::default()
            }),
        );
        assert_eq!(w.worker().borrow().affinity.len(), before + 2, "straight into its own table");
    }

    #[test]
    fn a_reopened_stream_resends_what_this_envoy_learned() {
        publish(&snapshot(4));
        let mut agent = Filter::configure(r#"{"role":"agent","subscribe":{"idle_timeout_ms":1000}}"#);
        let (mut worker, _) = Filter::try_configure_as(2, "");
        let primary = worker.send(Request::completion(&long_prompt(1)).header("x-session-id", "s1")).primary();
        worker.tick();
        agent.tick();
        let first = open_stream().token;
        // The host goes away; the stream closes and reopens at the next tick.
        with(|h| h.grpc_streams.iter_mut().for_each(|s| s.closed = true));
        agent.root.on_grpc_stream_close(first, 14);
        agent.tick();
        assert_ne!(open_stream().token, first);
        let resent = reports();
        assert!(resent.iter().all(|r| r.resync), "{resent:?}");
        let bindings: Vec<_> =
            resent.iter().flat_map(|r| r.bindings.iter().map(|b| (b.key, b.endpoint.clone()))).collect();
        assert_eq!(bindings, vec![(session_key("s1"), primary.expect("routed"))]);
        assert!(resent.iter().any(|r| !r.affinity_keys.is_empty()));
        assert_eq!(metric("attache.fleet.resyncs"), Some(2), "the first open counts too");
    }
}
