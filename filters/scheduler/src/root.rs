//! The root context: the role root. It parses the configuration once, owns the worker's state
//! (scheduler) or the snapshot stream (agent, or a scheduler in per-worker mode), and creates
//! each request's HTTP context for its role.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use attache_proto::v1;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use crate::agent::Subscriber;
use crate::config::{FilterConfig, Role, SubscribeConfig};
use crate::fleet::FleetMember;
use crate::hostcalls as host;
use crate::http::SchedulerHttp;
use crate::picker;
use crate::shared::{kv_table, snapshot};
use crate::worker::{Worker, HOUSEKEEPING_TICK_MS};

/// A scheduler worker takes new snapshot versions from its tick at least this often.
const SNAPSHOT_TICK_MS: u64 = 20;

pub struct AttacheRoot {
    context_id: u32,
    role: Role,
    worker: Option<Rc<RefCell<Worker>>>,
    picker: Option<Rc<picker::Shared>>,
    subscriber: Option<Subscriber>,
    /// This Envoy's side of the fleet exchange, on the subscriber's stream.
    fleet: Option<FleetMember>,
    /// The newest snapshot as the stream built it, and the deltas published after its base.
    snapshots: snapshot::Publisher,
}

impl AttacheRoot {
    pub fn new(context_id: u32) -> Self {
        Self {
            context_id,
            role: Role::Scheduler,
            worker: None,
            picker: None,
            subscriber: None,
            fleet: None,
            snapshots: snapshot::Publisher::default(),
        }
    }

    /// The worker's state (a scheduler's or an agent's), for tests.
    #[cfg(test)]
    pub(crate) fn worker(&self) -> Option<Rc<RefCell<Worker>>> {
        self.worker.clone()
    }

    fn node(&self) -> String {
        let name = proxy_wasm::hostcalls::get_property(vec!["plugin_name"])
            .ok()
            .flatten()
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default();
        format!("{name}/{}", self.context_id)
    }
}

impl AttacheRoot {
    fn with_metrics(&self, f: impl FnOnce(&mut crate::metrics::Metrics)) {
        if let Some(w) = &self.worker {
            if let Ok(mut w) = w.try_borrow_mut() {
                f(&mut w.metrics);
            }
        }
    }

    /// Open the host stream if it is not open: `Exchange` for a fleet member, else `Subscribe`.
    fn open_stream(&mut self) {
        let node = self.node();
        let Some(sub) = self.subscriber.as_mut() else { return };
        match self.fleet.as_mut() {
            Some(f) => {
                let mut hello = || f.hello(&node);
                sub.ensure_open(&node, host::now_ms(), Some(&mut hello));
            }
            None => {
                sub.ensure_open(&node, host::now_ms(), None);
            }
        }
    }
}

impl Context for AttacheRoot {
    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        let now = host::now_ms();
        let Some(sub) = self.subscriber.as_mut() else {
            return;
        };
        match sub.on_message(token_id, message_size, now) {
            Some(v1::update::Kind::Full(s)) => {
                let at = (s.host_epoch, s.version);
                if !self.snapshots.full(s) {
                    host::log(LogLevel::Error, "attache: could not write snapshot to shared data");
                }
                self.with_metrics(|m| m.snapshot(at.0, at.1, false));
            }
            Some(v1::update::Kind::Delta(d)) => match self.snapshots.delta(&d) {
                Ok((epoch, version)) => self.with_metrics(|m| m.snapshot(epoch, version, true)),
                Err(snapshot::Refused::Gap) => {
                    // Out of step with the host: restart the stream, which opens with a full
                    // snapshot.
                    host::log(
                        LogLevel::Warn,
                        &format!("attache: snapshot delta to {} does not follow; resubscribing", d.version),
                    );
                    if let Some(sub) = self.subscriber.as_mut() {
                        sub.restart();
                    }
                    self.with_metrics(|m| m.snapshot_gap());
                }
                Err(snapshot::Refused::Write) => {
                    host::log(LogLevel::Error, "attache: could not write snapshot delta to shared data");
                }
            },
            Some(v1::update::Kind::Fleet(d)) => {
                let (Some(fleet), Some(w)) = (self.fleet.as_mut(), &self.worker) else { return };
                let Ok(mut w) = w.try_borrow_mut() else { return };
                let w = &mut *w;
                let (slots, ttl) = (w.config.sessions.slots, w.config.sessions.ttl_ms);
                // Per worker: straight into this worker's table; agent: via its affinity log.
                let table = (!fleet.is_agent() && w.affinity.capacity() > 0).then_some(&mut w.affinity);
                fleet.apply(&d, slots, ttl, table, &mut w.metrics, now);
            }
            Some(v1::update::Kind::Index(d)) => {
                let slots = self
                    .worker
                    .as_ref()
                    .and_then(|w| w.try_borrow().ok().map(|w| w.config.scheduler.precise.slots))
                    .unwrap_or(262_144);
                kv_table::apply(&d, slots);
                let now_us = host::now_us();
                let propagation_us =
                    (d.oldest_event_unix_us > 0).then(|| now_us.saturating_sub(d.oldest_event_unix_us));
                // The part after the host sent it: the gRPC stream, Envoy's main thread, the apply.
                let sent_ns = self.subscriber.as_ref().map_or(0, |s| s.last_sent_unix_ns);
                let wire_us = (propagation_us.is_some() && sent_ns > 0).then(|| now_us.saturating_sub(sent_ns / 1000));
                if let Some(w) = &self.worker {
                    if let Ok(mut w) = w.try_borrow_mut() {
                        w.metrics.index_delta(d.keys.len(), d.seq, propagation_us, wire_us);
                    }
                }
            }
            _ => {}
        }
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, _status_code: u32) {
        if let Some(sub) = self.subscriber.as_mut() {
            sub.on_close(token_id);
        }
    }
}

impl RootContext for AttacheRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let raw = host::plugin_configuration();
        let config = match FilterConfig::parse(&raw) {
            Ok(c) => c,
            Err(e) => {
                host::log(LogLevel::Critical, &format!("attache: invalid plugin configuration: {e}"));
                return false;
            }
        };
        self.role = config.role;
        match config.role {
            Role::Picker => {
                let shared = picker::Shared::new(config.scoring.clone(), config.fleet.lookup_cluster.clone());
                self.picker = Some(Rc::new(shared));
                if config.scoring.decision_log_rate > 0.0 {
                    let every = Duration::from_millis(crate::decision_log::FLUSH_MS);
                    let _ = proxy_wasm::hostcalls::set_tick_period(every);
                }
                return true;
            }
            Role::Passthrough => return true,
            Role::Scheduler | Role::Agent => {}
        }
        let sub_cfg = match (config.role, &config.subscribe) {
            (_, Some(s)) => Some(s.clone()),
            (Role::Agent, None) => Some(SubscribeConfig::default()),
            (_, None) => None,
        };
        // Flow control re-checks its queue each tick; the snapshot stream checks its health.
        let flow_tick = (config.role == Role::Scheduler && config.flow.enabled).then_some(config.flow.tick_ms.max(1));
        // The cross-worker affinity table is written in batches from the tick.
        let prefix = &config.scheduler.prefix;
        let affinity_tick =
            (config.role == Role::Scheduler && prefix.shared_slots > 0).then_some(prefix.shared_flush_ms.max(1));
        let scheduler = config.role == Role::Scheduler;
        crate::stages::enable(scheduler && config.stage_timings);
        let fleet_cfg = config.fleet.clone();
        let worker = match Worker::new(config) {
            Ok(mut w) => {
                w.root_context = self.context_id;
                w
            }
            Err(e) => {
                host::log(LogLevel::Critical, &format!("attache: invalid plugin configuration: {e}"));
                return false;
            }
        };
        self.worker = Some(Rc::new(RefCell::new(worker)));
        let snapshot_tick = scheduler.then_some(SNAPSHOT_TICK_MS);
        let mut tick_ms = [flow_tick, affinity_tick, snapshot_tick, scheduler.then_some(HOUSEKEEPING_TICK_MS)]
            .into_iter()
            .flatten()
            .min();
        if let Some(cfg) = sub_cfg {
            let sub = Subscriber::new(cfg);
            tick_ms = Some(tick_ms.map_or(sub.tick_ms(), |t| t.min(sub.tick_ms())));
            if fleet_cfg.enabled {
                tick_ms = tick_ms.map(|t| t.min(fleet_cfg.report_ms.max(1)));
                self.fleet = Some(FleetMember::new(fleet_cfg, !scheduler));
            }
            self.subscriber = Some(sub);
            self.open_stream();
        }
        if let Some(ms) = tick_ms {
            let _ = proxy_wasm::hostcalls::set_tick_period(Duration::from_millis(ms));
        }
        true
    }

    fn on_tick(&mut self) {
        if let Some(p) = &self.picker {
            p.flush();
            return;
        }
        let now = host::now_ms();
        self.open_stream();
        let Some(w) = &self.worker else { return };
        let Ok(mut w) = w.try_borrow_mut() else { return };
        if self.role == Role::Scheduler {
            // Take new snapshot versions here, between requests, so a request rarely pays for
            // applying one (it still checks, and applies what arrived since this tick).
            w.cache.refresh_on_tick(now);
            w.housekeep(now);
            let reports_itself = self.fleet.is_some();
            let affinity = w.flush_affinity(now);
            w.share_cold_lru();
            let bindings = w.flush_bindings(!reports_itself);
            if let Some(f) = self.fleet.as_mut() {
                f.collect(&affinity, &bindings, &mut w.metrics);
            }
            if w.config.flow.enabled {
                crate::queue::tick(&mut w);
            }
        } else if let Some(f) = self.fleet.as_mut() {
            f.collect_logs(&mut w.metrics);
            f.drain_backlog();
        }
        if let (Some(f), Some(sub)) = (self.fleet.as_mut(), self.subscriber.as_mut()) {
            for r in f.take_reports(now, &mut w.metrics) {
                if !sub.send(&r) {
                    break;
                }
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        match self.role {
            Role::Picker => Some(Box::new(picker::PickerHttp::new(self.picker.clone()?))),
            Role::Passthrough => Some(Box::new(picker::PassthroughHttp)),
            Role::Scheduler | Role::Agent => {
                let worker = self.worker.clone()?;
                Some(Box::new(SchedulerHttp::new(context_id, worker)))
            }
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        match self.role {
            Role::Scheduler | Role::Picker | Role::Passthrough => Some(ContextType::HttpContext),
            Role::Agent => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use attache_policies::plan::DESTINATION_HEADER;
    use attache_policies::scoring;
    use prost::Message;
    use proxy_wasm::traits::{Context, RootContext};
    use proxy_wasm::types::{Action, ContextType, LogLevel};

    use super::*;
    use crate::testing::harness::{address, deliver, open_stream, prompt, snapshot, Filter, Request, ROOT_ID};
    use crate::testing::{advance_ms, metric, with};

    #[test]
    fn a_scheduler_configuration_is_accepted_and_sets_up_the_worker() {
        let f = Filter::configure(r#"{"scheduler":{"max_body_bytes":1000}}"#);
        assert_eq!((f.root.role, f.root.get_type()), (Role::Scheduler, Some(ContextType::HttpContext)));
        assert_eq!(f.worker().borrow().config.scheduler.max_body_bytes, 1000);
        assert!(f.root.subscriber.is_none(), "no snapshot stream of its own");
        let period = with(|h| h.tick_period_ms);
        assert_eq!(period, Some(20), "the affinity table's flush period, below housekeeping's 100 ms");
        assert_eq!(metric("attache.requests.scheduled"), Some(0), "metrics defined");
        let (_, ok) = Filter::try_configure_as(2, r#"{"scheduler":{"prefix":{"shared_slots":0}}}"#);
        assert!(ok);
        assert_eq!(with(|h| h.tick_period_ms), Some(SNAPSHOT_TICK_MS as u32), "taking snapshots, below housekeeping");
        const { assert!(SNAPSHOT_TICK_MS < HOUSEKEEPING_TICK_MS) };
    }

    #[test]
    fn invalid_configurations_are_refused_and_logged_at_critical() {
        let cases = [
            ("{", "EOF"),
            (r#"{"rol":"agent"}"#, "unknown field `rol`"),
            (r#"{"scheduler":{"profiles":{"decode":{"plugins":[{"type":"no-such-scorer"}]}}}}"#, "no-such-scorer"),
            (r#"{"scheduler":{"prefix":{"index_capacity":10000000000}}}"#, "index_capacity 10000000000 exceeds"),
            (r#"{"scheduler":{"prefix":{"shared_slots":99999999}}}"#, "shared_slots 99999999 exceeds"),
        ];
        for (config, why) in cases {
            let (f, ok) = Filter::try_configure_as(ROOT_ID, config);
            assert!(!ok, "{config} accepted");
            let last = with(|h| h.logs.last().cloned()).expect("logged");
            assert_eq!(last.0, LogLevel::Critical, "{config}");
            assert!(last.1.contains("invalid plugin configuration") && last.1.contains(why), "{config}: {}", last.1);
            assert!(f.root.create_http_context(7).is_none(), "no worker, no request contexts");
        }
    }

    #[test]
    fn a_picker_makes_picker_contexts() {
        let f = Filter::configure(r#"{"role":"picker"}"#);
        assert_eq!((f.root.role, f.root.get_type()), (Role::Picker, Some(ContextType::HttpContext)));
        assert!(f.root.worker.is_none() && with(|h| h.tick_period_ms).is_none(), "no worker, no tick");
        // Without scorer output the picker changes nothing, not even a client's header.
        let ex = f.send(Request::completion(&prompt("hi")).header(DESTINATION_HEADER, "10.0.0.9:1"));
        assert_eq!(
            (ex.on_headers, ex.request_header(DESTINATION_HEADER)),
            (Action::Continue, Some("10.0.0.9:1".into()))
        );
        // With undecodable scorer output it keeps the scheduler's pick and counts the error.
        with(|h| {
            h.properties.insert(vec![scoring::SCORES_PROPERTY.into()], b"garbage".to_vec());
            h.properties.insert(vec![scoring::CONTEXT_PROPERTY.into()], b"garbage".to_vec());
        });
        let ex = f.send(Request::completion(&prompt("hi")));
        assert_eq!(ex.on_headers, Action::Continue);
        assert!(with(|h| h.logged(LogLevel::Warn, "undecodable scoring state")));
        assert_eq!(metric("attache.picker.decode_errors"), Some(1));
    }

    #[test]
    fn a_passthrough_does_nothing() {
        let f = Filter::configure(r#"{"role":"passthrough"}"#);
        assert_eq!(f.root.get_type(), Some(ContextType::HttpContext));
        let ex = f.send(Request::completion("{not json").header(DESTINATION_HEADER, "10.0.0.9:1"));
        assert_eq!((ex.on_headers, ex.on_body), (Action::Continue, Some(Action::Continue)));
        assert!(ex.local_response().is_none());
        assert_eq!(ex.request_header(DESTINATION_HEADER).as_deref(), Some("10.0.0.9:1"));
    }

    #[test]
    fn an_agent_subscribes_and_publishes_snapshots_for_the_schedulers() {
        with(|h| {
            h.properties.insert(vec!["plugin_name".into()], b"attache-agent".to_vec());
        });
        let mut agent = Filter::configure(r#"{"role":"agent"}"#);
        assert_eq!((agent.root.role, agent.root.get_type()), (Role::Agent, None));
        let s = open_stream();
        assert_eq!(
            (s.cluster.as_str(), s.service.as_str(), s.method.as_str()),
            ("attache_host", "attache.v1.SnapshotService", "Exchange")
        );
        let (msg, end) = s.sent.first().cloned().expect("a first report");
        assert!(!end, "the stream stays open both ways");
        let hello = v1::Report::decode(msg.as_slice()).expect("a report");
        assert_eq!(hello.node, format!("attache-agent/{ROOT_ID}"));
        assert!(hello.envoy.starts_with("envoy-") && hello.resync, "{hello:?}");
        assert_eq!(with(|h| h.tick_period_ms), Some(20), "the fleet's report period");

        deliver(&mut agent, v1::update::Kind::Full(snapshot(2)));
        assert!(with(|h| h.shared.contains_key(snapshot::SNAPSHOT_KEY)));
        assert_eq!(snapshot::heard_ms(), Some(crate::testing::now_ms()), "the host was heard");
        // A scheduler of the same Envoy routes on it.
        let (scheduler, ok) = Filter::try_configure_as(2, "");
        assert!(ok);
        let ex = scheduler.send(Request::completion(&prompt("hi")));
        assert!([address(0), address(1)].contains(&ex.primary().expect("routed")));
    }

    /// An agent holding version 1 of a two-endpoint pool, and a scheduler that has read it.
    fn deltas_setup() -> (Filter, crate::testing::GrpcStream, Filter, Rc<RefCell<Worker>>, v1::Snapshot) {
        let mut agent = Filter::configure(r#"{"role":"agent"}"#);
        let first = open_stream();
        let base = snapshot(2);
        deliver(&mut agent, v1::update::Kind::Full(base.clone()));
        let (scheduler, ok) = Filter::try_configure_as(2, "");
        assert!(ok);
        assert!(scheduler.send(Request::completion(&prompt("hi"))).primary().is_some());
        let w = scheduler.root.worker().expect("a worker");
        (agent, first, scheduler, w, base)
    }

    /// The next version from `prev`, changed by `change`, delivered to `agent` as a delta.
    fn step(agent: &mut Filter, prev: &mut v1::Snapshot, v: u64, change: &dyn Fn(&mut v1::Snapshot)) -> v1::Snapshot {
        let mut s = prev.clone();
        s.version = v;
        change(&mut s);
        deliver(agent, v1::update::Kind::Delta(attache_proto::delta::diff(prev, &s).expect("same epoch")));
        *prev = s;
        prev.clone()
    }

    fn churn(s: &mut v1::Snapshot) {
        s.endpoints[1].waiting = s.version as f64;
        s.endpoints[0].ready = s.version % 2 == 1;
    }

    fn big_label(s: &mut v1::Snapshot, c: char) {
        s.endpoints[1].labels.insert("attache.io/note".into(), c.to_string().repeat(3_000));
    }

    #[test]
    fn schedulers_follow_snapshot_deltas_without_rereading_the_pool() {
        let (mut agent, _, mut scheduler, w, base) = deltas_setup();
        // Version 2: endpoint 0 goes unready; only its record travels.
        let mut next = base.clone();
        next.version = 2;
        next.endpoints[0].ready = false;
        let d = attache_proto::delta::diff(&base, &next).expect("same epoch");
        assert_eq!(d.upserts.len(), 1);
        deliver(&mut agent, v1::update::Kind::Delta(d));
        scheduler.tick();
        assert_eq!(w.borrow().cache.pool.version, 2, "taken on the scheduler's tick, before any request");
        for i in 0..20 {
            let ex = scheduler.send(Request::completion(&prompt(&format!("q{i}"))));
            assert_eq!(ex.primary(), Some(address(1)), "the unready endpoint is avoided");
        }
        let counts = {
            let w = w.borrow();
            (w.cache.deltas_applied, w.cache.full_reads)
        };
        assert_eq!(counts, (1, 1), "one whole read, then the delta alone");
        assert_eq!(metric("attache.snapshot.deltas"), Some(1));
        // While the tick runs, a request leaves every delta, small or large, to the tick.
        let mut prev = next;
        step(&mut agent, &mut prev, 3, &churn);
        let v4 = step(&mut agent, &mut prev, 4, &churn);
        let _ = scheduler.send(Request::completion(&prompt("small changes")));
        assert_eq!(w.borrow().cache.pool.version, 2, "the request left two small deltas to the tick");
        scheduler.tick();
        assert_eq!(w.borrow().cache.pool, attache_proto::pool::to_pool(&v4), "the tick took both");
        let big = step(&mut agent, &mut prev, 5, &|s| big_label(s, 'x'));
        let _ = scheduler.send(Request::completion(&prompt("large change")));
        assert_eq!(w.borrow().cache.pool.version, 4, "the request left the large delta to the tick");
        scheduler.tick();
        assert_eq!(w.borrow().cache.pool, attache_proto::pool::to_pool(&big));
        // A tick that stalls past REQUEST_REFRESH_AFTER_MS: the request takes even a large one.
        let big2 = step(&mut agent, &mut prev, 6, &|s| big_label(s, 'y'));
        advance_ms(snapshot::REQUEST_REFRESH_AFTER_MS + 1);
        let _ = scheduler.send(Request::completion(&prompt("no tick lately")));
        assert_eq!(w.borrow().cache.pool, attache_proto::pool::to_pool(&big2));
    }

    #[test]
    fn a_folded_delta_log_keeps_workers_that_keep_up_and_a_stray_delta_restarts_the_stream() {
        let (mut agent, first, mut scheduler, w, base) = deltas_setup();
        // Hundreds of deltas fold the log into a new base; a scheduler that keeps up (a few
        // versions behind at most) never reads the base, and one far behind does.
        let mut prev = base;
        let mut last = prev.clone();
        for v in 2..=(snapshot::LOG_MAX_ENTRIES as u64 + 10) {
            last = step(&mut agent, &mut prev, v, &churn);
            if v % 3 == 0 {
                scheduler.tick();
            }
        }
        scheduler.tick();
        assert_eq!(w.borrow().cache.pool, attache_proto::pool::to_pool(&last));
        assert_eq!(w.borrow().cache.full_reads, 1, "the fold kept the deltas it needed");
        let far = snapshot::LOG_MAX_ENTRIES as u64 + 11;
        for v in far..far + 2 * snapshot::LOG_MAX_ENTRIES as u64 {
            last = step(&mut agent, &mut prev, v, &churn);
        }
        scheduler.tick();
        assert_eq!(w.borrow().cache.pool, attache_proto::pool::to_pool(&last));
        assert_eq!(w.borrow().cache.full_reads, 2, "too far behind: the base");
        // A delta that does not follow: counted, and the stream restarts for a full snapshot.
        let stray = v1::SnapshotDelta { version: 9_000, base_version: 8_000, host_epoch: 1, ..Default::default() };
        deliver(&mut agent, v1::update::Kind::Delta(stray));
        assert_eq!(metric("attache.snapshot.delta_gaps"), Some(1));
        assert!(with(|h| h.grpc_streams.iter().any(|s| s.token == first.token && s.closed)));
        agent.tick();
        assert_ne!(open_stream().token, first.token);
        assert_eq!(w.borrow().cache.pool.version, last.version, "the stray delta changed nothing");
    }

    #[test]
    fn without_the_fleet_an_agent_only_subscribes() {
        let _agent = Filter::configure(r#"{"role":"agent","fleet":{"enabled":false}}"#);
        let s = open_stream();
        assert_eq!(s.method, "Subscribe");
        let (msg, end) = s.sent.first().cloned().expect("a subscribe request");
        assert!(end, "the client half-closes");
        assert!(v1::SubscribeRequest::decode(msg.as_slice()).is_ok());
        assert_eq!(with(|h| h.tick_period_ms), Some(500));
    }

    #[test]
    fn an_agent_reopens_a_stream_that_failed_closed_or_went_silent() {
        with(|h| h.grpc_unavailable = true);
        let mut agent = Filter::configure(r#"{"role":"agent","subscribe":{"cluster":"h","idle_timeout_ms":1000}}"#);
        assert!(with(|h| h.grpc_streams.is_empty() && h.logged(LogLevel::Warn, "open_grpc_stream(h) failed")));
        with(|h| h.grpc_unavailable = false);
        agent.tick();
        let first = open_stream();
        // Closed by the host: reopened at the next tick.
        with(|h| {
            h.grpc_status = (14, Some("unavailable".into()));
            h.grpc_streams.iter_mut().for_each(|s| s.closed = true);
        });
        agent.root.on_grpc_stream_close(first.token, 14);
        assert!(with(|h| h.logged(LogLevel::Info, "snapshot stream closed (grpc 14: unavailable)")));
        agent.tick();
        let second = open_stream();
        assert_ne!(second.token, first.token);
        // Heartbeats keep it open; silence past the idle timeout reopens it.
        advance_ms(800);
        deliver(&mut agent, v1::update::Kind::Heartbeat(v1::Heartbeat { version: 1 }));
        advance_ms(800);
        agent.tick();
        assert_eq!(open_stream().token, second.token, "heard 800 ms ago");
        advance_ms(300);
        agent.tick();
        assert!(with(|h| h.grpc_streams.iter().any(|s| s.token == second.token && s.closed)));
        assert_ne!(open_stream().token, second.token);
    }

    #[test]
    fn a_scheduler_in_per_worker_mode_subscribes_itself() {
        let mut f = Filter::configure(r#"{"subscribe":{}}"#);
        assert_eq!(f.root.get_type(), Some(ContextType::HttpContext));
        assert_eq!(open_stream().cluster, "attache_host");
        assert_eq!(with(|h| h.tick_period_ms), Some(20), "its own tick is shorter than the stream's");
        assert_eq!(open_stream().method, "Exchange");
        let mut s = snapshot(3);
        s.version = 9;
        deliver(&mut f, v1::update::Kind::Full(s));
        assert_eq!(metric("attache.snapshot.version"), Some(9));
        let ex = f.send(Request::completion(&prompt("hi")));
        assert!(ex.primary().is_some());
    }
}
