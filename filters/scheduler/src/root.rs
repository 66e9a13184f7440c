//! The root context: owns the configuration and the worker's state, and (as the agent, or in
//! per-worker mode) the snapshot stream.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use attache_policies::index::AffinityTable;
use attache_policies::prompt_tokens::PromptTokenizer;
use attache_policies::{Scheduler, SchedulerState};
use attache_proto::v1;
use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use crate::affinity::AffinityLog;
use crate::config::{FilterConfig, Role, SubscribeConfig};
use crate::flow::FlowState;
use crate::host;
use crate::http::SchedulerHttp;
use crate::kv_table;
use crate::metrics::Metrics;
use crate::picker;
use crate::snapshot::{self, SnapshotCache, Subscriber};

/// State shared by one worker's HTTP contexts.
pub struct Worker {
    /// Shared so per-request code can hold it while borrowing the worker mutably.
    pub config: std::rc::Rc<FilterConfig>,
    pub scheduler: Scheduler,
    pub state: SchedulerState,
    pub cache: SnapshotCache,
    /// Requests this worker has dispatched and not yet finished, per endpoint.
    pub inflight: HashMap<String, u32>,
    /// Uncached prompt tokens of those requests per endpoint (the affinity filter's TTFT gate).
    pub inflight_tokens: HashMap<String, u64>,
    pub metrics: Metrics,
    /// The model's tokenizer and chat template, for precise routing of text and chat prompts
    /// (None if not configured or if it failed its start-up check).
    pub tokenizer: Option<PromptTokenizer>,
    /// Flow control: this worker's queue, saturation gate and fairness board.
    pub flow: FlowState,
    /// What this worker knows of every worker's decisions (its own at once, the others' from
    /// the affinity log at each tick), probed on the request path without a host call.
    pub affinity: AffinityTable,
    /// This worker's side of the affinity log in shared data ([`crate::affinity`]).
    pub affinity_log: AffinityLog,
    /// This worker's decisions not yet appended to its log: `(block hash, endpoint)`, written
    /// from the tick, off the request path.
    pub affinity_pending: Vec<(u64, String)>,
    /// When the host was last heard from, as of this worker's last tick (see [`Worker::housekeep`]).
    pub heard_ms: Option<u64>,
}

/// The scheduler's tick period when neither flow control nor the affinity table asks for a
/// shorter one: it records histogram samples and re-reads the host's heartbeat and the log level.
pub const HOUSEKEEPING_TICK_MS: u64 = 100;

impl Worker {
    /// Milliseconds since the host was last heard from (0 if it never was). Reads the heartbeat
    /// from the tick's copy, off the request path; only when that copy says the host has been
    /// silent longer than `stale_after_ms` is the shared heartbeat read again, so a host heard
    /// since the last tick never gets a load-only decision.
    pub fn host_silent_ms(&mut self, now_ms: u64, stale_after_ms: u64) -> u64 {
        let silent = |heard: Option<u64>| heard.map_or(0, |h| now_ms.saturating_sub(h));
        if self.heard_ms.is_none() || silent(self.heard_ms) > stale_after_ms {
            if let Some(h) = snapshot::heard_ms() {
                self.heard_ms = Some(h);
            }
        }
        silent(self.heard_ms)
    }

    /// The tick's bookkeeping, kept off the request path: histogram samples, the host's
    /// heartbeat and its silence gauge, Envoy's log level.
    pub fn housekeep(&mut self, now_ms: u64) {
        self.metrics.flush_samples();
        if let Some(h) = snapshot::heard_ms() {
            self.heard_ms = Some(h);
            self.metrics.host_silence(now_ms.saturating_sub(h));
        }
        host::refresh_log_level();
    }

    /// Append this worker's pending decisions to its affinity log, and learn the other
    /// workers' new ones from theirs.
    pub fn flush_affinity(&mut self) {
        if self.affinity.capacity() == 0 {
            return;
        }
        if !self.affinity_pending.is_empty() {
            let batch = std::mem::take(&mut self.affinity_pending);
            self.affinity_log.write(&batch);
        }
        let learned = self.affinity_log.read_into(&mut self.affinity);
        self.metrics.affinity_learned(learned);
    }
}

impl Worker {
    fn new(config: FilterConfig) -> Self {
        let mut metrics = Metrics::define();
        let pc = &config.scheduler.precise;
        let tokenizer = match (&pc.tokenizer_json, pc.enabled) {
            (Some(_), true) => {
                match PromptTokenizer::load_checked(pc) {
                    Ok((t, 0)) => Some(t),
                    Ok((_, failed)) => {
                        host::log(
                        LogLevel::Error,
                        &format!("attache: tokenizer gives other ids than the engine on {failed} check(s); text and chat prompts will not be routed precisely"),
                    );
                        metrics.tokenizer_mismatch();
                        None
                    }
                    Err(e) => {
                        host::log(
                        LogLevel::Error,
                        &format!("attache: tokenizer not usable ({e}); text and chat prompts will not be routed precisely"),
                    );
                        metrics.tokenizer_mismatch();
                        None
                    }
                }
            }
            _ => None,
        };
        Self {
            tokenizer,
            flow: FlowState::new(config.flow.enabled),
            affinity: AffinityTable::new(config.scheduler.prefix.shared_slots),
            affinity_log: AffinityLog::default(),
            affinity_pending: Vec::new(),
            heard_ms: None,
            scheduler: Scheduler::new(config.scheduler.clone()),
            state: SchedulerState::new(&config.scheduler),
            cache: SnapshotCache::default(),
            inflight: HashMap::new(),
            inflight_tokens: HashMap::new(),
            metrics,
            config: std::rc::Rc::new(config),
        }
    }
}

pub struct AttacheRoot {
    context_id: u32,
    role: Role,
    worker: Option<Rc<RefCell<Worker>>>,
    picker: Option<Rc<picker::Shared>>,
    subscriber: Option<Subscriber>,
}

impl AttacheRoot {
    pub fn new(context_id: u32) -> Self {
        Self { context_id, role: Role::Scheduler, worker: None, picker: None, subscriber: None }
    }

    fn node(&self) -> String {
        let name = hostcalls::get_property(vec!["plugin_name"])
            .ok()
            .flatten()
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default();
        format!("{name}/{}", self.context_id)
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
                if !snapshot::publish(&s) {
                    host::log(LogLevel::Error, "attache: could not write snapshot to shared data");
                }
                if let Some(w) = &self.worker {
                    if let Ok(mut w) = w.try_borrow_mut() {
                        w.metrics.snapshot(s.host_epoch, s.version);
                    }
                }
            }
            Some(v1::update::Kind::Index(d)) => {
                let slots = self
                    .worker
                    .as_ref()
                    .and_then(|w| w.try_borrow().ok().map(|w| w.config.scheduler.precise.slots))
                    .unwrap_or(262_144);
                kv_table::apply(&d, slots);
                let propagation_us =
                    (d.oldest_event_unix_us > 0).then(|| host::now_us().saturating_sub(d.oldest_event_unix_us));
                if let Some(w) = &self.worker {
                    if let Ok(mut w) = w.try_borrow_mut() {
                        w.metrics.index_delta(d.keys.len(), d.seq, propagation_us);
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
                self.picker = Some(Rc::new(picker::Shared {
                    config: config.scoring.clone(),
                    metrics: picker::PickerMetrics::define(),
                }));
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
        self.worker = Some(Rc::new(RefCell::new(Worker::new(config))));
        let mut tick_ms =
            [flow_tick, affinity_tick, scheduler.then_some(HOUSEKEEPING_TICK_MS)].into_iter().flatten().min();
        if let Some(cfg) = sub_cfg {
            let mut sub = Subscriber::new(cfg);
            tick_ms = Some(tick_ms.map_or(sub.tick_ms(), |t| t.min(sub.tick_ms())));
            sub.ensure_open(&self.node(), host::now_ms());
            self.subscriber = Some(sub);
        }
        if let Some(ms) = tick_ms {
            let _ = hostcalls::set_tick_period(Duration::from_millis(ms));
        }
        true
    }

    fn on_tick(&mut self) {
        if self.subscriber.is_some() {
            let node = self.node();
            if let Some(sub) = self.subscriber.as_mut() {
                sub.ensure_open(&node, host::now_ms());
            }
        }
        if self.role == Role::Scheduler {
            if let Some(w) = &self.worker {
                if let Ok(mut w) = w.try_borrow_mut() {
                    w.housekeep(host::now_ms());
                    w.flush_affinity();
                    if w.config.flow.enabled {
                        crate::flow::tick(&mut w);
                    }
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
