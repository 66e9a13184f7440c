//! The endpoint picker's scheduling state: the newest snapshot as a pool, this picker's prefix
//! index, its sessions, in-flight load and flow-control queue, behind one lock. Every rule is
//! `attache_policies`'s, called in the order the Envoy filter calls it (intake, session,
//! admission, engine token ids, plan, learn); this module only holds the state they read and
//! write.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use attache_kv::KvIndex;
use attache_policies::filters::subset::Subset;
use attache_policies::flow::{self, FlowQueue, Gate, Refusal, Rivals};
use attache_policies::intake::{self, Head};
use attache_policies::plan::{self, KvIndexView, Plan, PlanConfig, PlanRequest, StateView};
use attache_policies::plugin_config::FilterConfig;
use attache_policies::prompt_tokens::{self, PromptTokenizer};
use attache_policies::request::{Api, InferenceRequest};
use attache_policies::session::{self, Sticky, StickyStore};
use attache_policies::{ErrorResponse, PoolState, ScheduleError, Scheduler, SchedulerState};
use hashbrown::HashMap;
use tokio::sync::oneshot;
use tracing::{debug, warn};

use super::metrics::EppMetrics;

/// An answer the picker sends instead of a destination: status, reason, JSON body, headers.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub status: u16,
    pub reason: &'static str,
    pub body: String,
    pub headers: Vec<(&'static str, &'static str)>,
    /// The message the body carries (to rewrite it in another API's shape).
    pub message: String,
}

impl Answer {
    /// The same answer in the error shape `shape` (Anthropic's on the Messages routes).
    #[must_use]
    pub fn shaped(self, shape: attache_policies::error::ErrorShape) -> Self {
        let e = ErrorResponse { status: self.status, reason: self.reason, body: self.body, message: self.message }
            .shaped(shape);
        Self { body: e.body, message: e.message, ..self }
    }
}

impl From<ErrorResponse> for Answer {
    fn from(e: ErrorResponse) -> Self {
        Self { status: e.status, reason: e.reason, body: e.body, headers: Vec::new(), message: e.message }
    }
}

impl From<Refusal> for Answer {
    fn from(r: Refusal) -> Self {
        let e = r.response;
        Self { status: e.status, reason: e.reason, body: e.body, headers: r.headers, message: e.message }
    }
}

/// A waiting request's wake-up: `Ok` when flow control dispatches it.
type Waiter = oneshot::Sender<Result<(), Refusal>>;

/// Sessions and Responses ids, bound to endpoints (the filter keeps them in shared data).
#[derive(Default)]
struct Sessions(HashMap<u64, Sticky>);

impl StickyStore for Sessions {
    fn load(&mut self, slot: u64) -> Option<Sticky> {
        self.0.get(&slot).cloned()
    }

    fn store(&mut self, slot: u64, entry: &Sticky) {
        self.0.insert(slot, entry.clone());
    }
}

/// Everything a decision reads and writes.
struct State {
    pool: PoolState,
    /// (host epoch, version) of the snapshot `pool` came from.
    pool_key: (u64, u64),
    sched: SchedulerState,
    sessions: Sessions,
    inflight: HashMap<String, u32>,
    inflight_tokens: HashMap<String, u64>,
    gate: Gate,
    queue: FlowQueue<Waiter>,
    /// Round-robin position for requests that are not inference calls.
    next: usize,
}

/// The picker: configuration, the host's live state, and its own.
pub struct Picker {
    config: Arc<FilterConfig>,
    scheduler: Scheduler,
    snapshots: crate::push::SnapshotRx,
    kv: Option<Arc<Mutex<KvIndex>>>,
    tokenizer: Option<Mutex<PromptTokenizer>>,
    state: Mutex<State>,
    next_id: AtomicU32,
    pub metrics: Arc<EppMetrics>,
}

/// The precise index under its lock, as `policies::plan` reads it.
struct KvView<'a>(MutexGuard<'a, KvIndex>);

impl KvIndexView for KvView<'_> {
    fn holders(&self, key: u64) -> Vec<(u16, u8)> {
        self.0.holders(key)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl Picker {
    /// A picker on the host's snapshots and precise index. Fails on a scheduler configuration
    /// the filter would refuse too.
    pub fn new(
        config: FilterConfig,
        snapshots: crate::push::SnapshotRx,
        kv: Arc<Mutex<KvIndex>>,
        metrics: Arc<EppMetrics>,
    ) -> anyhow::Result<Self> {
        let scheduler = Scheduler::new(config.scheduler.clone())?;
        let tokenizer = load_tokenizer(&config, &metrics).map(Mutex::new);
        let kv = config.scheduler.precise.enabled.then_some(kv);
        let state = State {
            pool: PoolState::default(),
            pool_key: (0, 0),
            sched: scheduler.new_state(),
            sessions: Sessions::default(),
            inflight: HashMap::new(),
            inflight_tokens: HashMap::new(),
            gate: Gate::default(),
            queue: FlowQueue::default(),
            next: 0,
        };
        let config = Arc::new(config);
        Ok(Self { config, scheduler, snapshots, kv, tokenizer, state: Mutex::new(state), next_id: 1.into(), metrics })
    }

    pub fn config(&self) -> &FilterConfig {
        &self.config
    }

    /// A new stream's id (the tie-break seed of a request with no prefix, as Envoy's context
    /// id is in the filter).
    pub fn next_id(&self) -> u32 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether the picker has a snapshot to plan on (readiness).
    pub fn synced(&self) -> bool {
        self.snapshots.borrow().version > 0
    }

    /// Take the newest snapshot, if it changed.
    fn refresh(&self, st: &mut State) {
        let snap = self.snapshots.borrow();
        let key = (snap.host_epoch, snap.version);
        if key != st.pool_key {
            st.pool = attache_proto::pool::to_pool(&snap);
            st.pool_key = key;
        }
    }

    /// The request headers (lower-case names): what they say, or the answer they get.
    pub fn intake(&self, headers: &[(String, String)], end_of_stream: bool) -> Result<Head, Answer> {
        let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| std::borrow::Cow::from(v.as_str()));
        intake::head(&self.config, get, end_of_stream).map_err(Answer::from)
    }

    /// The pool-wide model list (`policies::model_list`), None when no endpoint is ready.
    pub fn model_list(&self) -> Option<String> {
        let mut st = lock(&self.state);
        self.refresh(&mut st);
        let now_s = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        attache_policies::model_list::body(&st.pool, now_s)
    }

    /// A destination for a request that is not an inference call (a health check, a route
    /// the scheduler does not know): the next ready endpoint, round robin. Gateways that route
    /// with an `ORIGINAL_DST` cluster have no other way to reach the pool.
    pub fn anywhere(&self, subset: Option<&Subset>) -> Result<String, Answer> {
        let mut st = lock(&self.state);
        self.refresh(&mut st);
        let ready: Vec<&str> = st
            .pool
            .endpoints
            .iter()
            .filter(|e| e.ready && subset.is_none_or(|s| s.allows(&e.address)))
            .map(|e| e.address.as_str())
            .collect();
        let err = if subset.is_some() { ScheduleError::NoneInSubset } else { ScheduleError::NoEndpoints };
        let pick = ready.get(st.next % ready.len().max(1)).map(|a| (*a).to_owned());
        st.next = st.next.wrapping_add(1);
        pick.ok_or_else(|| Answer::from(ErrorResponse::from(&err)))
    }

    /// The endpoint the request's session or conversation is bound to (policies::session).
    pub fn sticky(&self, head: &Head, req: &InferenceRequest) -> Option<String> {
        let mut st = lock(&self.state);
        let token = head.token_endpoint.clone();
        let previous = req.previous_response_id.as_deref();
        let key = intake::body_session_key(&self.config, head.session_key, req);
        session::resolve(&self.config.sessions, &mut st.sessions, token, key, previous, now_ms())
    }

    /// Flow control: refuse what cannot wait, and wait until the request may go (at once when
    /// the pool has room). `Ok(Some(priority))`: admitted in that band; `Ok(None)`: flow control
    /// is off.
    pub async fn admit(
        &self,
        id: u32,
        head: &Head,
        req: &InferenceRequest,
        body_len: usize,
        continuing: bool,
    ) -> Result<Option<i32>, Answer> {
        let cfg = &self.config.flow;
        if !intake::flow_controlled(&self.config, req.api) {
            return Ok(None);
        }
        let (rx, priority) = {
            let mut guard = lock(&self.state);
            let st = &mut *guard;
            self.refresh(st);
            let class = flow::classify(cfg, Some(&st.pool.objectives), |n| head.flow_header(n), req.priority);
            let continuing = self.config.sessions.turn_priority && continuing;
            let saturation = st.gate.estimate_pool(&st.pool);
            let class = flow::admit(class, continuing, &st.pool, &req.model, saturation).map_err(|r| self.shed(r))?;
            let tokens = cfg.cost((body_len / 4) as u64, req.max_tokens);
            let (tx, rx) = oneshot::channel();
            if let Err(shed) = st.queue.enqueue(cfg, u64::from(id), &class, body_len, tokens, now_ms(), tx) {
                return Err(self.shed(Refusal::not_queued(shed, class.priority)));
            }
            self.pump(st);
            (rx, class.priority)
        };
        match rx.await {
            Ok(Ok(())) => Ok(Some(priority)),
            Ok(Err(refusal)) => Err(self.shed(refusal)),
            Err(_) => Err(Answer::from(ErrorResponse::new(
                503,
                "picker_stopped",
                "ServiceUnavailableError",
                None,
                "the endpoint picker stopped while the request waited",
            ))),
        }
    }

    /// Count a flow-control refusal.
    fn shed(&self, r: Refusal) -> Answer {
        if let Some(s) = r.shed {
            self.metrics.shed(s.reason());
        }
        Answer::from(r)
    }

    /// Wake the waiting requests the pool has room for, in flow-control order.
    fn pump(&self, st: &mut State) {
        let cfg = &self.config.flow;
        if !st.pool.has_ready() {
            return; // they wait for endpoints until their TTL
        }
        for _ in 0..cfg.dispatch_per_tick.max(1) {
            let Some(saturation) = st.gate.estimate_pool(&st.pool) else { break };
            // One picker: no other instance's usage or rivals to weigh.
            let Some(p) = st.queue.dispatch(cfg, saturation, |_| 0.0, &Rivals::default()) else { break };
            if p.value.send(Ok(())).is_ok() {
                st.gate.dispatched(now_ms());
            }
        }
    }

    /// Flow control's clock: shed what waited its whole TTL, and dispatch what may go.
    pub fn tick(&self) {
        let mut st = lock(&self.state);
        self.refresh(&mut st);
        let has_ready = st.pool.has_ready();
        for p in st.queue.expire(now_ms()) {
            let _ = p.value.send(Err(Refusal::expired(has_ready, self.config.flow.ttl_ms)));
        }
        if !st.queue.is_empty() {
            self.pump(&mut st);
        }
    }

    /// A waiting request's client went away.
    pub fn abandon(&self, id: u32) {
        lock(&self.state).queue.remove(u64::from(id));
    }

    /// The engine's token ids for `req` (precise routing), counting a prompt it could not
    /// tokenize.
    fn prompt_ids(&self, req: &InferenceRequest) -> Option<Vec<u32>> {
        let pc = &self.config.scheduler.precise;
        let mut tok = self.tokenizer.as_ref().map(lock);
        match prompt_tokens::engine_ids(pc, req, tok.as_deref_mut()) {
            Ok(ids) => ids,
            Err(e) => {
                debug!(error = %e, "no precise scores");
                self.metrics.untokenized();
                None
            }
        }
    }

    /// The explanation of `plan`'s decision for a request for `model`
    /// (`attache_policies::explain`), on the picker's pool.
    pub fn explain(&self, plan: &Plan, model: &str) -> String {
        let st = lock(&self.state);
        let max = self.config.debug.max_candidates;
        attache_policies::explain::explain(&self.scheduler, &st.pool, model, &plan.decision, max)
    }

    /// Plan the request on the newest state and apply what the plan teaches this picker: its
    /// index, the session binding, the in-flight load.
    pub fn plan(&self, request: &PlanRequest<'_>) -> Result<Plan, Answer> {
        let ids = self.prompt_ids(request.req);
        let request = PlanRequest { prompt_ids: ids.as_deref(), ..*request };
        let kv = match (&self.kv, &ids) {
            (Some(kv), Some(_)) => Some(KvView(lock(kv))),
            _ => None,
        };
        let mut st = lock(&self.state);
        self.refresh(&mut st);
        st.sched.advance(request.now_ms);
        let view = StateView {
            pool: &st.pool,
            state: &st.sched,
            affinity: None,
            kv: kv.as_ref().map(|k| k as &dyn KvIndexView),
            inflight: &st.inflight,
            inflight_tokens: &st.inflight_tokens,
            host_silent_ms: 0,
        };
        let settings =
            PlanConfig { scheduler: &self.scheduler, sessions: &self.config.sessions, scoring: &self.config.scoring };
        let planned = plan::plan(&request, &view, &settings);
        drop(kv);
        let p = planned.map_err(Answer::from)?;
        plan::learn(&p, &mut st.sched, None, 0);
        if let Some(b) = &p.session {
            plan::bind(&mut st.sessions, b, now_ms());
        }
        *st.inflight.entry(p.dispatch.endpoint.clone()).or_default() += 1;
        *st.inflight_tokens.entry(p.dispatch.endpoint.clone()).or_default() += p.dispatch.uncached_tokens;
        debug!(id = request.id, "{}", p.log_line(&request.req.model, st.pool.version));
        Ok(p)
    }

    /// The gateway reports `served` served the planned request: if a fallback did, learn that
    /// instead of the primary, and move the request's in-flight count there. Returns the plan
    /// as served (its session token names the endpoint that served).
    pub fn served(&self, p: &Plan, served: &str) -> Option<Plan> {
        let mut st = lock(&self.state);
        let corrected = plan::learn_served(p, served, &mut st.sched, None)?;
        release(&mut st, &p.dispatch.endpoint, p.dispatch.uncached_tokens);
        *st.inflight.entry(served.to_owned()).or_default() += 1;
        *st.inflight_tokens.entry(served.to_owned()).or_default() += p.dispatch.uncached_tokens;
        if let Some(b) = &corrected.session {
            plan::bind(&mut st.sessions, b, now_ms());
        }
        self.metrics.served_elsewhere();
        Some(corrected)
    }

    /// The engine at `endpoint` prefilled a request's `tokens` uncached prompt tokens (its
    /// answer started): they no longer queue ahead of the next request's.
    pub fn prefilled(&self, endpoint: &str, tokens: u64) {
        unqueue(&mut lock(&self.state), endpoint, tokens);
    }

    /// A request of `api` ended: release its in-flight count, and, if flow control gated it,
    /// let a waiting one go.
    pub fn release(&self, api: Option<Api>, endpoint: &str, tokens: u64) {
        let mut st = lock(&self.state);
        release(&mut st, endpoint, tokens);
        if api.is_some_and(|a| intake::flow_controlled(&self.config, a)) {
            st.gate.completed(now_ms());
            if !st.queue.is_empty() {
                self.pump(&mut st);
            }
        }
    }

    /// Uncached prompt tokens routed to `endpoint` and not yet prefilled.
    #[cfg(test)]
    pub fn queued_tokens(&self, endpoint: &str) -> u64 {
        lock(&self.state).inflight_tokens.get(endpoint).copied().unwrap_or(0)
    }

    /// Bind a Responses API response id to the endpoint that produced it.
    pub fn learn_response(&self, id: &str, endpoint: &str) {
        let sc = &self.config.sessions;
        let mut st = lock(&self.state);
        session::bind(&mut st.sessions, sc.slots, session::response_key(id), endpoint, now_ms(), sc.ttl_ms);
    }

    /// Requests in flight per endpoint, and waiting, for the metrics page.
    pub fn load(&self) -> (BTreeMap<String, u32>, usize) {
        let st = lock(&self.state);
        (st.inflight.iter().filter(|(_, n)| **n > 0).map(|(a, n)| (a.clone(), *n)).collect(), st.queue.len())
    }
}

fn release(st: &mut State, endpoint: &str, tokens: u64) {
    if let Some(n) = st.inflight.get_mut(endpoint) {
        *n = n.saturating_sub(1);
    }
    unqueue(st, endpoint, tokens);
}

/// `tokens` of a request's uncached prompt no longer queue at `endpoint`.
fn unqueue(st: &mut State, endpoint: &str, tokens: u64) {
    if let Some(t) = st.inflight_tokens.get_mut(endpoint) {
        *t = t.saturating_sub(tokens);
    }
}

/// The tokenizer for precise routing, if configured and if it gives the engine's ids on the
/// configured checks; otherwise none, logged and counted.
fn load_tokenizer(config: &FilterConfig, metrics: &EppMetrics) -> Option<PromptTokenizer> {
    PromptTokenizer::for_routing(&config.scheduler.precise).unwrap_or_else(|why| {
        warn!("endpoint picker: {why}; text and chat prompts will not be routed precisely");
        metrics.tokenizer_refused();
        None
    })
}
