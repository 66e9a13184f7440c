//! The per-request HTTP context: buffer, parse, classify, then route now or wait in the
//! flow-control queue.

use std::borrow::Cow;
use std::cell::RefCell;
use std::rc::Rc;

use attache_policies::flow::{self, RequestClass, Shed};
use attache_policies::pd::PREFILLER_HEADER;
use attache_policies::request::{self, Api, InferenceRequest};
use attache_policies::scoring::{self, ScoreSheet};
use attache_policies::session;
use attache_policies::{ErrorResponse, RequestError};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, LogLevel};

use crate::flow::Pumped;
use crate::host;
use crate::root::Worker;
use crate::route::route;
use crate::stages::{self, Stage};
use crate::sticky::SharedSticky;

/// The header Envoy's override_host LB policy (or an ORIGINAL_DST cluster) routes on.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Filter-state key the picker sets to the primary endpoint it chose.
pub const PICKED_PROPERTY: &str = "attache_picked";
/// Why flow control answered a request itself.
pub const DROPPED_REASON_HEADER: &str = "x-attache-dropped-reason";

/// A request parsed and classified, waiting in the flow-control queue.
pub struct Parked {
    pub req: InferenceRequest,
    pub body_len: usize,
    pub class: RequestClass,
}

/// One request's state. The HTTP context owns it; while the request waits, the worker's queue
/// holds it too, so the tick can route it.
pub struct RequestState {
    /// Envoy's context id of the stream.
    pub id: u32,
    pub api: Option<Api>,
    /// Set once the filter answered the request itself.
    pub answered: bool,
    /// Endpoint counted in `inflight`, released when the request ends.
    pub dispatched: Option<String>,
    /// Uncached prompt tokens counted in `inflight_tokens` for `dispatched`.
    pub dispatched_tokens: u64,
    /// Session key from the configured headers (rollout bucket).
    pub session: Option<String>,
    /// When the request headers arrived, µs.
    pub started_us: u64,
    /// Set when a scoring context went to scorer filters: each candidate's expected prefix hit,
    /// to grade the arm that acted once the response starts.
    pub handed_off: Option<Vec<(String, f32)>>,
    /// The request headers flow control classifies on (objective, tenant, API key).
    pub flow_headers: Vec<(String, String)>,
    /// Waiting in the flow-control queue.
    pub parked: Option<Parked>,
    /// Session affinity: the session's table key (from the session header), and the endpoint
    /// the session, its token or the previous response is bound to.
    pub session_key: Option<u64>,
    pub sticky: Option<String>,
    /// The endpoint to name in the response's session token.
    pub session_token: Option<String>,
    /// A Responses API response: bind its id to the endpoint that served it.
    pub learn_response: Option<String>,
}

pub type SharedRequest = Rc<RefCell<RequestState>>;

pub struct SchedulerHttp {
    id: u32,
    worker: Rc<RefCell<Worker>>,
    st: SharedRequest,
}

/// Answer the effective context's request with an error, counting it.
pub fn answer(w: Option<&mut Worker>, id: u32, err: &ErrorResponse, extra: &[(&str, &str)]) {
    if let Some(w) = w {
        w.metrics.error(err.reason);
    }
    host::debug(|| format!("attache[{id}]: {} {}", err.status, err.reason));
    host::send_json(err.status, err.reason, &err.body, extra);
}

/// The answer flow control gives a request it sheds, with `Retry-After` and the reason.
pub fn shed_response(shed: Shed, detail: &str) -> (ErrorResponse, [(&'static str, &'static str); 2]) {
    let kind = if shed.status() == 503 { "ServiceUnavailableError" } else { "rate_limit_error" };
    let err = ErrorResponse::new(shed.status(), shed.reason(), kind, None, detail);
    (err, [("retry-after", "1"), (DROPPED_REASON_HEADER, shed.reason())])
}

/// Find the endpoint this request's session or conversation is bound to (the session token
/// wins, then the session header's binding, then `previous_response_id`'s).
fn resolve_sticky(w: &Worker, st: &mut RequestState, req: &InferenceRequest, now: u64) {
    let sc = &w.config.sessions;
    if !sc.enabled {
        return;
    }
    if st.sticky.is_none() {
        if let Some(k) = st.session_key {
            st.sticky = session::lookup(&mut SharedSticky, sc.slots, k, now);
        }
    }
    if st.sticky.is_none() {
        if let Some(id) = &req.previous_response_id {
            st.sticky = session::lookup(&mut SharedSticky, sc.slots, session::response_key(id), now);
        }
    }
    if req.api == Api::Responses {
        st.learn_response = Some(String::new());
    }
}

impl SchedulerHttp {
    pub fn new(id: u32, worker: Rc<RefCell<Worker>>) -> Self {
        let st = RequestState {
            id,
            api: None,
            answered: false,
            dispatched: None,
            dispatched_tokens: 0,
            session: None,
            started_us: 0,
            handed_off: None,
            flow_headers: Vec::new(),
            parked: None,
            session_key: None,
            sticky: None,
            session_token: None,
            learn_response: None,
        };
        Self { id, worker, st: Rc::new(RefCell::new(st)) }
    }

    fn reject(&mut self, err: ErrorResponse) -> Action {
        self.reject_with(err, &[])
    }

    fn reject_with(&mut self, err: ErrorResponse, extra: &[(&str, &str)]) -> Action {
        answer(self.worker.try_borrow_mut().ok().as_deref_mut(), self.id, &err, extra);
        if let Ok(mut st) = self.st.try_borrow_mut() {
            st.answered = true;
        }
        Action::Pause
    }

    fn shed(&mut self, shed: Shed, detail: &str) -> Action {
        if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.metrics.flow_shed(shed);
        }
        let (err, extra) = shed_response(shed, detail);
        host::debug(|| format!("attache[{}]: {} {}", self.id, err.status, err.reason));
        host::send_json(err.status, err.reason, &err.body, &extra);
        if let Ok(mut st) = self.st.try_borrow_mut() {
            st.answered = true;
        }
        Action::Pause
    }

    /// `now`: the body callback's clock reading (ms), one per decision.
    fn schedule(&mut self, api: Api, body: &[u8], now: u64) -> Action {
        let req = match request::parse(api, body) {
            Ok(r) => r,
            Err(e) => return self.reject(ErrorResponse::from(&e)),
        };
        stages::mark(Stage::Parse);
        let worker = self.worker.clone();
        let Ok(mut guard) = worker.try_borrow_mut() else {
            host::log(LogLevel::Error, "attache: worker state busy; passing request through");
            return Action::Continue;
        };
        let w = &mut *guard;
        w.cache.refresh(now);
        stages::mark(Stage::SnapshotCheck);
        if let Ok(mut st) = self.st.try_borrow_mut() {
            resolve_sticky(w, &mut st, &req, now);
        }
        stages::mark(Stage::Sticky);
        if !w.config.flow.enabled {
            let Ok(mut st) = self.st.try_borrow_mut() else {
                return Action::Continue;
            };
            return match route(w, &mut st, &req, body.len(), now) {
                Ok(()) => Action::Continue,
                Err(e) => {
                    drop(st);
                    drop(guard);
                    self.reject(e)
                }
            };
        }
        self.admit(guard, req, body.len(), now)
    }

    /// Flow control: classify, shed what cannot wait, queue the rest, and dispatch whatever
    /// may go now (this request included, if it is next and the pool has room).
    fn admit(
        &mut self,
        mut guard: std::cell::RefMut<'_, Worker>,
        req: InferenceRequest,
        body_len: usize,
        now: u64,
    ) -> Action {
        let w = &mut *guard;
        let class = {
            let Ok(st) = self.st.try_borrow() else {
                return Action::Continue;
            };
            let headers = &st.flow_headers;
            let header = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
            flow::classify(&w.config.flow, Some(&w.cache.pool.objectives), header, req.priority)
        };
        let class = match class {
            // Turn priority: a later turn of a session already bound goes ahead of new sessions'
            // first turns within its tenant.
            Ok(mut c) => {
                c.continuing = w.config.sessions.turn_priority
                    && self.st.try_borrow().is_ok_and(|st| st.sticky.is_some() || req.previous_response_id.is_some());
                c
            }
            Err(e) => {
                drop(guard);
                let msg =
                    format!("{e}; objectives come from InferenceObjective resources or the host's flow.objectives");
                return self.reject_with(
                    ErrorResponse::new(400, "unknown_objective", "invalid_request_error", None, &msg),
                    &[(DROPPED_REASON_HEADER, "unknown_objective")],
                );
            }
        };
        if !w.cache.pool.has_ready() {
            drop(guard);
            return self.shed(Shed::NoEndpoints, "no ready endpoint in the inference pool; retry later");
        }
        if !w.cache.pool.knows_model(&req.model) {
            drop(guard);
            let e = attache_policies::ScheduleError::UnknownModel(req.model.clone());
            return self.reject(ErrorResponse::from(&e));
        }
        let saturation = w.flow.estimate(&w.cache.pool);
        w.metrics.flow_saturation(saturation);
        if class.sheddable() && saturation.is_some_and(|s| s >= 1.0) {
            drop(guard);
            let msg =
                format!("the pool is saturated and priority {} requests are sheddable; retry later", class.priority);
            return self.shed(Shed::Sheddable, &msg);
        }
        let tokens = w.config.flow.cost((body_len / 4) as u64, req.max_tokens);
        let (priority, tenant) = (class.priority, class.tenant.clone());
        if let Ok(mut st) = self.st.try_borrow_mut() {
            st.parked = Some(Parked { req, body_len, class: class.clone() });
        }
        if let Err(shed) =
            w.flow.queue.enqueue(&w.config.flow, u64::from(self.id), &class, body_len, tokens, now, self.st.clone())
        {
            if let Ok(mut st) = self.st.try_borrow_mut() {
                st.parked = None;
            }
            drop(guard);
            let msg = match shed {
                Shed::BandFull => format!("the queue of priority {priority} is full; retry later"),
                _ => "the flow-control queue is full; retry later".to_owned(),
            };
            return self.shed(shed, &msg);
        }
        w.metrics.flow_enqueued(priority, &tenant);
        match crate::flow::pump(w, Some(self.id)) {
            Pumped::Dispatched => Action::Continue,
            Pumped::Waiting | Pumped::Answered => Action::Pause,
        }
    }
}

impl Context for SchedulerHttp {}

impl HttpContext for SchedulerHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let headers = host::HeaderMap::request();
        // Never trust a client's routing headers. (Removing clears Envoy's route cache: only
        // when there is something to remove.)
        for name in [DESTINATION_HEADER, PREFILLER_HEADER] {
            if headers.contains(name) {
                host::remove_request_header(name);
            }
        }
        let method = headers.get(":method").unwrap_or_default();
        let path = headers.get(":path").unwrap_or_default();
        let api = if method == "POST" { Api::from_path(&path) } else { None };
        if let (Ok(w), Ok(mut st)) = (self.worker.try_borrow(), self.st.try_borrow_mut()) {
            st.api = api;
            let sc = &w.config.sessions;
            if sc.enabled && api.is_some() {
                st.sticky = headers.get(&sc.token_header).and_then(|t| session::endpoint_of_token(&t));
                st.session_key = sc.headers.iter().find_map(|h| headers.get(h)).map(|v| session::session_key(&v));
            }
            let f = &w.config.flow;
            if f.enabled {
                for h in [&f.objective_header, &f.tenant_header, &f.api_key_header] {
                    if let Some(v) = headers.get(h) {
                        st.flow_headers.push((h.clone(), v.into_owned()));
                    }
                }
            }
            if w.config.scoring.context {
                st.started_us = host::now_us();
                st.session = w.config.scoring.session_headers.iter().find_map(|h| headers.get(h)).map(Cow::into_owned);
            }
        }
        let Some(_) = api else {
            if let Ok(mut w) = self.worker.try_borrow_mut() {
                w.metrics.passthrough();
            }
            return Action::Continue;
        };
        let limit = self.worker.try_borrow().map(|w| w.config.scheduler.max_body_bytes).unwrap_or(usize::MAX);
        if let Some(len) = headers.get("content-length").and_then(|v| v.trim().parse::<usize>().ok()) {
            if len > limit {
                return self.reject(ErrorResponse::from(&RequestError::BodyTooLarge { size: len, limit }));
            }
        }
        if end_of_stream {
            return self.reject(ErrorResponse::from(&RequestError::EmptyBody));
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let (api, answered) = match self.st.try_borrow() {
            Ok(st) => (st.api, st.answered || st.parked.is_some()),
            Err(_) => return Action::Continue,
        };
        let Some(api) = api else {
            return Action::Continue;
        };
        if answered {
            return Action::Pause;
        }
        let limit = self.worker.try_borrow().map(|w| w.config.scheduler.max_body_bytes).unwrap_or(usize::MAX);
        if body_size > limit {
            return self.reject(ErrorResponse::from(&RequestError::BodyTooLarge { size: body_size, limit }));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let started = host::now_us();
        stages::begin();
        let Some(body) = host::request_body(body_size) else {
            return self.reject(ErrorResponse::from(&RequestError::EmptyBody));
        };
        stages::mark(Stage::ReadBody);
        let action = self.schedule(api, &body, started / 1000);
        drop(body);
        stages::mark(Stage::Return);
        if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.metrics.decision(host::now_us().saturating_sub(started));
        }
        stages::mark(Stage::DecisionMetric);
        stages::finish();
        action
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Ok(mut st) = self.st.try_borrow_mut() else {
            return Action::Continue;
        };
        if let Some(ep) = st.session_token.take() {
            let name = self.worker.try_borrow().map(|w| w.config.sessions.token_header.clone()).unwrap_or_default();
            if !name.is_empty() {
                host::set_response_header(&name, &session::token_for(&ep));
            }
        }
        if st.learn_response.is_some() {
            // The endpoint that actually served it (a fallback, if the primary failed).
            let served = host::property_path(&["upstream", "address"]).and_then(|b| String::from_utf8(b).ok());
            let ok = host::response_header(":status").is_some_and(|s| s == "200");
            st.learn_response = served.or_else(|| st.dispatched.clone()).filter(|_| ok);
        }
        let Some(hits) = st.handed_off.take() else {
            return Action::Continue;
        };
        // A scorer still marked as scoring when the response starts trapped on this request
        // (scorer slots fail open: the scheduler's pick served it).
        let scoring = host::property(scoring::SCORING_PROPERTY).unwrap_or_default();
        let trapped = std::str::from_utf8(&scoring).ok().filter(|s| !s.is_empty()).map(str::to_owned);
        let status = host::response_header(":status").and_then(|s| s.parse::<u16>().ok()).unwrap_or(0);
        let picked = host::property(PICKED_PROPERTY).and_then(|b| String::from_utf8(b).ok());
        let prefix_hit = picked
            .as_deref()
            .or(st.dispatched.as_deref())
            .and_then(|a| hits.iter().find(|(addr, _)| addr == a))
            .map(|(_, h)| *h)
            .unwrap_or(0.0);
        let ttfb_us = host::now_us().saturating_sub(st.started_us);
        drop(st);
        let sheet =
            host::property(scoring::SCORES_PROPERTY).and_then(|b| ScoreSheet::decode(&b).ok()).unwrap_or_default();
        let Ok(mut w) = self.worker.try_borrow_mut() else {
            return Action::Continue;
        };
        let outcome = |trap: bool| crate::metrics::ArmOutcome { error: status >= 500, trap, ttfb_us, prefix_hit };
        for e in &sheet.entries {
            w.metrics.rollout(&e.slot, e.arm.as_str(), &outcome(false));
        }
        if let Some(t) = trapped {
            // `slot/arm/version`
            let mut parts = t.split('/');
            if let (Some(slot), Some(arm)) = (parts.next(), parts.next()) {
                w.metrics.rollout(slot, arm, &outcome(true));
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        let Ok(mut st) = self.st.try_borrow_mut() else {
            return Action::Continue;
        };
        // Learn `previous_response_id` → endpoint from the first bytes of a Responses body.
        let Some(served) = st.learn_response.take() else {
            return Action::Continue;
        };
        let id = host::response_body(body_size.min(4096)).and_then(|b| crate::sticky::response_id(&b));
        if let (Some(id), Ok(mut w)) = (id, self.worker.try_borrow_mut()) {
            let sc = &w.config.sessions;
            let (slots, ttl) = (sc.slots, sc.ttl_ms);
            session::bind(&mut SharedSticky, slots, session::response_key(&id), &served, host::now_ms(), ttl);
            w.metrics.response_learned();
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        let (parked, dispatched, tokens) = match self.st.try_borrow_mut() {
            Ok(mut st) => (st.parked.take().is_some(), st.dispatched.take(), std::mem::take(&mut st.dispatched_tokens)),
            Err(_) => return,
        };
        let Ok(mut w) = self.worker.try_borrow_mut() else {
            return;
        };
        if parked {
            // The client went away while its request waited: drop it from the queue.
            if let Some(p) = w.flow.queue.remove(u64::from(self.id)) {
                w.metrics.flow_left(p.priority, &p.tenant);
                w.metrics.flow_disconnected();
            }
        }
        if let Some(addr) = dispatched {
            if let Some(n) = w.inflight.get_mut(&addr) {
                *n = n.saturating_sub(1);
            }
            if let Some(t) = w.inflight_tokens.get_mut(&addr) {
                *t = t.saturating_sub(tokens);
            }
            if w.config.flow.enabled {
                // A request ended: the pool may have room for a waiting one.
                w.flow.gate.completed(host::now_ms());
                if !w.flow.queue.is_empty() {
                    crate::flow::pump(&mut w, None);
                }
            }
        }
    }
}
