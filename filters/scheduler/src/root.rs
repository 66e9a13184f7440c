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
use crate::hostcalls as host;
use crate::http::SchedulerHttp;
use crate::picker;
use crate::shared::{kv_table, snapshot};
use crate::worker::{Worker, HOUSEKEEPING_TICK_MS};

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
        let worker = match Worker::new(config) {
            Ok(w) => w,
            Err(e) => {
                host::log(LogLevel::Critical, &format!("attache: invalid plugin configuration: {e}"));
                return false;
            }
        };
        self.worker = Some(Rc::new(RefCell::new(worker)));
        let mut tick_ms =
            [flow_tick, affinity_tick, scheduler.then_some(HOUSEKEEPING_TICK_MS)].into_iter().flatten().min();
        if let Some(cfg) = sub_cfg {
            let mut sub = Subscriber::new(cfg);
            tick_ms = Some(tick_ms.map_or(sub.tick_ms(), |t| t.min(sub.tick_ms())));
            sub.ensure_open(&self.node(), host::now_ms());
            self.subscriber = Some(sub);
        }
        if let Some(ms) = tick_ms {
            let _ = proxy_wasm::hostcalls::set_tick_period(Duration::from_millis(ms));
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
                        crate::queue::tick(&mut w);
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
