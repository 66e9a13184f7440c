//! The scheduler's HTTP context: buffer and parse the request, resolve its session, then route
//! it now or let it wait in the flow-control queue; on the response, name the session's endpoint,
//! learn Responses ids and grade the rollout arm that scored it.

use std::cell::RefCell;
use std::rc::Rc;

use attache_policies::flow::{self, Refusal};
use attache_policies::intake;
use attache_policies::model_list;
use attache_policies::plan::{self, Plan, ROUTING_HEADERS};
use attache_policies::plugin_config::FilterConfig;
use attache_policies::request::{self, Api, InferenceRequest};
use attache_policies::responses::{self as gateway, Mode};
use attache_policies::scoring::{self, ScoreSheet};
use attache_policies::session;
use attache_policies::{ErrorResponse, RequestError};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, LogLevel};

use crate::dispatch::{answer, refuse, route, shape_of};
use crate::hostcalls as host;
use crate::lookup;
use crate::queue::{pump, Pumped};
use crate::request::{Lookup, Parked, RequestState, Resolving, SharedRequest};
use crate::responses::{self, Capture, Resolution};
use crate::shared::entry_log::PENDING_MAX;
use crate::shared::sessions::SharedSticky;
use crate::stages::{self, Stage};
use crate::worker::Worker;

/// Set on a Responses request whose answer a scheduler filter captures, so that a later
/// scheduler filter in the chain (a rollout arm) does not capture it too.
const CAPTURED_PROPERTY: &str = "attache.responses.captured";

pub struct SchedulerHttp {
    id: u32,
    worker: Rc<RefCell<Worker>>,
    st: SharedRequest,
}

/// `served` served a request planned for another primary (a custom scorer re-picked, or a
/// fallback served it): move what the plan taught the worker (its prefix index, affinity
/// table and session binding), its in-flight count and its session token to `served`.
fn follow_served(w: &mut Worker, st: &mut RequestState, plan: &Plan, served: &str) {
    let room = PENDING_MAX.saturating_sub(w.affinity_pending.len());
    let sharing = w.affinity.capacity() > 0;
    let Some((corrected, publish)) =
        plan::relearn(plan, served, &mut w.state, sharing.then_some(&mut w.affinity), room)
    else {
        return;
    };
    w.affinity_pending.extend(publish);
    let now = host::now_ms();
    if let Some(b) = &corrected.session {
        plan::bind(&mut SharedSticky, b, now);
        w.bound(b.key, &b.endpoint, now.saturating_add(b.ttl_ms), true);
    }
    if st.session_token.is_some() {
        st.session_token.clone_from(&corrected.session_token);
    }
    if let Some(old) = st.dispatched.take() {
        w.released(&old, st.dispatched_tokens);
        w.dispatched(&corrected);
        st.dispatched = Some(corrected.dispatch.endpoint.clone());
        st.dispatched_tokens = corrected.dispatch.uncached_tokens;
    }
    w.metrics.repicked();
}

/// Count a request this filter's rollout arm scheduled, and name the arm on the response.
fn grade_arm(w: &mut Worker, outcome: &crate::metrics::ArmOutcome) {
    let config = std::rc::Rc::clone(&w.config);
    let Some(arm) = &config.rollout else { return };
    w.metrics.rollout(attache_policies::arm::SCHEDULER_SLOT, &arm.arm, outcome);
    if config.scoring.response_header {
        host::set_response_header(attache_policies::arm::RESPONSE_HEADER, &arm.mark());
    }
}

impl SchedulerHttp {
    pub fn new(id: u32, worker: Rc<RefCell<Worker>>) -> Self {
        Self { id, worker, st: Rc::new(RefCell::new(RequestState::new(id))) }
    }

    /// Take the debug header off the request (it never goes upstream, whatever its token);
    /// whether it authorizes an explanation of the decision. A wrong token is counted.
    fn debug_header(&self, cfg: &FilterConfig, headers: &host::HeaderMap) -> bool {
        let d = &cfg.debug;
        let Some(token) = headers.get(&d.header) else {
            return false;
        };
        host::remove_request_header(&d.header);
        if d.authorized(&token) {
            return true;
        }
        if d.enabled() {
            if let Ok(mut w) = self.worker.try_borrow_mut() {
                w.metrics.debug_refused();
            }
        }
        false
    }

    fn mark_answered(&self) {
        if let Ok(mut st) = self.st.try_borrow_mut() {
            st.answered = true;
        }
    }

    fn shape(&self) -> attache_policies::error::ErrorShape {
        shape_of(self.st.try_borrow().ok().and_then(|st| st.api))
    }

    /// Answer with `err` (already in the API's shape when it comes from the headers' checks).
    fn reject(&mut self, err: ErrorResponse) -> Action {
        let shape = self.shape();
        match self.worker.try_borrow_mut() {
            Ok(mut w) => answer(&mut w, self.id, shape, &err),
            Err(_) => {
                let err = err.shaped(shape);
                host::send_json(err.status, err.reason, &err.body, &[]);
            }
        }
        self.mark_answered();
        Action::Pause
    }

    fn refuse(&mut self, w: &mut Worker, refusal: &Refusal) -> Action {
        refuse(w, self.id, self.shape(), refusal);
        self.mark_answered();
        Action::Pause
    }

    /// `now`: the body callback's clock reading (ms), one per decision.
    fn schedule(&mut self, api: Api, body: &[u8], now: u64) -> Action {
        let req = match request::parse(api, body) {
            Ok(r) => r,
            Err(e) => return self.reject(ErrorResponse::from(&e)),
        };
        stages::mark(Stage::Parse);
        if api == Api::Responses && self.keeps_responses() {
            if req.background {
                if let Some(err) = gateway::background_refusal(&req) {
                    return self.reject(err);
                }
            }
            if let Some(prev) = req.previous_response_id.clone() {
                return self.continuation(api, body, prev, now);
            }
            if req.background {
                return self.submit(body, None);
            }
            if req.store {
                self.capture(&req, body, None);
            }
        }
        self.route_parsed(req, body.len(), now)
    }

    /// Whether this filter keeps Responses state in the gateway (a shadow arm acts on nothing).
    fn keeps_responses(&self) -> bool {
        self.worker.try_borrow().is_ok_and(|w| {
            w.config.responses.mode == Mode::Gateway && !w.config.rollout.as_ref().is_some_and(|a| a.shadow())
        })
    }

    /// A continuation: resolve its `previous_response_id` from this worker's conversations, or
    /// pause and ask the host.
    fn continuation(&mut self, api: Api, body: &[u8], prev: String, now: u64) -> Action {
        let started_us = host::now_us();
        let tenant = self.st.try_borrow().ok().and_then(|st| st.tenant.clone()).unwrap_or_default();
        let local =
            self.worker.try_borrow_mut().ok().and_then(|mut w| w.conversations.get(&tenant, &prev).map(str::to_owned));
        if let Some(history) = local {
            self.count_response("resolved.local");
            return self.rewrite(api, body, &prev, &history, started_us, now);
        }
        let cfg = match self.worker.try_borrow() {
            Ok(w) => w.config.responses.clone(),
            Err(_) => return Action::Continue,
        };
        match responses::resolve(&cfg, &tenant, &prev) {
            Some(token) => {
                if let Ok(mut st) = self.st.try_borrow_mut() {
                    st.resolving = Some(Resolving { token, api, body: body.to_vec(), previous_id: prev, started_us });
                }
                Action::Pause
            }
            None => {
                self.count_response("resolved.failed");
                self.answer_store_unavailable()
            }
        }
    }

    /// Rewrite a continuation into its whole conversation and route it.
    fn rewrite(&mut self, api: Api, body: &[u8], prev: &str, history: &str, started_us: u64, now: u64) -> Action {
        let c = match gateway::continuation_body(body, history) {
            Ok(c) => c,
            Err(e) => {
                let err = ErrorResponse::from(&RequestError::InvalidField { field: "input", detail: e.to_string() });
                return self.reject(err);
            }
        };
        if !host::set_request_body(body.len(), &c.body) {
            host::log(LogLevel::Error, "attache: could not replace a continuation's body");
            return self.answer_store_unavailable();
        }
        host::set_request_header("content-length", &c.body.len().to_string());
        let req = match request::parse(api, &c.body) {
            Ok(r) => r,
            Err(e) => return self.reject(ErrorResponse::from(&e)),
        };
        if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.metrics.responses("rewrites");
            w.metrics.responses_resolve_us(host::now_us().saturating_sub(started_us));
        }
        if req.background {
            return self.submit(&c.body, Some((prev, c.turn)));
        }
        if req.store {
            self.capture(&req, &c.body, Some((prev, c.turn, c.conversation)));
        }
        self.route_parsed(req, c.body.len(), now)
    }

    /// A background request (its conversation resolved): the host queues it for the async
    /// worker and answers the queued response, which this request returns.
    fn submit(&mut self, body: &[u8], continued: Option<(&str, String)>) -> Action {
        let (previous_id, turn) = match continued {
            Some((p, t)) => (p.to_owned(), t),
            None => {
                let Some(turn) = gateway::body_turn_items(body) else {
                    let detail = "not a string or a list of items".to_owned();
                    return self.reject(ErrorResponse::from(&RequestError::InvalidField { field: "input", detail }));
                };
                (String::new(), turn)
            }
        };
        let (cfg, tenant) = match (self.worker.try_borrow(), self.st.try_borrow()) {
            (Ok(w), Ok(st)) => (w.config.responses.clone(), st.tenant.clone().unwrap_or_default()),
            _ => return Action::Continue,
        };
        let msg = attache_proto::v1::SubmitRequest {
            tenant,
            previous_id,
            input_items: turn,
            request: String::from_utf8_lossy(body).into_owned(),
        };
        let call = responses::submit(&cfg, &msg);
        if call.is_some() {
            self.count_response("background");
        }
        self.await_served(call)
    }

    /// Pause for the host's answer to a store route or a background submission (`call`, its
    /// token), which becomes the response; 503 if the call could not be made.
    fn await_served(&mut self, call: Option<u32>) -> Action {
        match call {
            Some(token) => {
                if let Ok(mut st) = self.st.try_borrow_mut() {
                    st.serving = Some(token);
                }
                Action::Pause
            }
            None => {
                self.count_response("serve_failed");
                self.answer_store_unavailable()
            }
        }
    }

    /// Capture the response to `req` for the store: this turn's items (from `body`, or from
    /// the continuation's rewrite) and, once it arrives, the answer.
    fn capture(&mut self, req: &InferenceRequest, body: &[u8], continued: Option<(&str, String, String)>) {
        if host::property(CAPTURED_PROPERTY).is_some() {
            return; // an earlier scheduler filter in the chain captures it
        }
        let (previous_id, turn, conversation) = match continued {
            Some((p, t, c)) => (p.to_owned(), t, c),
            None => {
                let Some(turn) = gateway::body_turn_items(body) else { return };
                (String::new(), turn.clone(), turn)
            }
        };
        host::set_property(CAPTURED_PROPERTY, b"1");
        let sessions = self.worker.try_borrow().is_ok_and(|w| w.config.sessions.enabled);
        if let Ok(mut st) = self.st.try_borrow_mut() {
            let tenant = st.tenant.clone().unwrap_or_default();
            // A chain with no session header of its own is a session: its first item names it.
            if sessions && st.session_key.is_none() {
                st.session_key = gateway::conversation_key(&tenant, &conversation);
            }
            st.capture =
                Some(Capture { tenant, previous_id, turn, conversation, streamed: req.stream, body: Vec::new() });
        }
    }

    /// Copy a chunk of the answer being captured (the stream is not held back); finish at its
    /// end. Past `responses.capture_max_bytes` the capture is dropped, and counted.
    fn capture_chunk(&mut self, size: usize, end_of_stream: bool) {
        let max = self.worker.try_borrow().map(|w| w.config.responses.capture_max_bytes).unwrap_or(0);
        let dropped = {
            let Ok(mut st) = self.st.try_borrow_mut() else { return };
            let Some(c) = st.capture.as_mut() else { return };
            if size > 0 && c.body.len() + size <= max {
                if let Some(chunk) = host::response_body(size) {
                    c.body.extend_from_slice(&chunk);
                }
                false
            } else if size > 0 {
                st.capture = None;
                true
            } else {
                false
            }
        };
        if dropped {
            self.count_response("capture_dropped");
        } else if end_of_stream {
            self.finish_capture();
        }
    }

    fn count_response(&self, event: &str) {
        if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.metrics.responses(event);
        }
    }

    /// 503: the host's store could not be reached.
    fn answer_store_unavailable(&mut self) -> Action {
        let body = serde_json::json!({"error": {
            "message": "The gateway's Responses store cannot be reached; retry shortly.",
            "type": "service_unavailable", "param": null, "code": 503}});
        host::send_json(503, "responses_store_unavailable", &body.to_string(), &[]);
        self.mark_answered();
        Action::Pause
    }

    /// 404 for a `previous_response_id` the store does not hold.
    fn answer_unknown_previous(&mut self, prev: &str, evicted: bool) -> Action {
        let why = if evicted {
            "it expired or was evicted from the gateway's Responses store"
        } else {
            "the gateway's Responses store holds no such response for this tenant"
        };
        let body = serde_json::json!({"error": {
            "message": format!("previous_response_id '{prev}' not found: {why}."),
            "type": "invalid_request_error", "param": "previous_response_id", "code": 404}});
        host::send_json(404, "previous_response_not_found", &body.to_string(), &[]);
        self.mark_answered();
        Action::Pause
    }

    /// 400 for a `previous_response_id` naming a background response that has not ended.
    fn answer_pending_previous(&mut self, prev: &str) -> Action {
        let body = serde_json::json!({"error": {
            "message": format!("previous_response_id '{prev}' is a background response still queued or in progress; \
                                continue from it once GET shows it completed."),
            "type": "invalid_request_error", "param": "previous_response_id", "code": 400}});
        host::send_json(400, "previous_response_pending", &body.to_string(), &[]);
        self.mark_answered();
        Action::Pause
    }

    /// Finish capturing the answer: store the response at the host, and keep its conversation
    /// for the next turn through this worker.
    fn finish_capture(&mut self) {
        let Some(c) = self.st.try_borrow_mut().ok().and_then(|mut st| st.capture.take()) else { return };
        let Ok(mut w) = self.worker.try_borrow_mut() else { return };
        let Some(gateway::Captured { response, id, output }) = gateway::captured_response(&c.body, c.streamed) else {
            w.metrics.responses("capture_dropped");
            return;
        };
        let msg = attache_proto::v1::StoreRequest {
            tenant: c.tenant.clone(),
            id: id.clone(),
            previous_id: c.previous_id,
            input_items: c.turn,
            response,
        };
        let root = w.root_context;
        let sent = responses::store(&w.config.responses, root, self.id, &msg);
        w.metrics.responses(if sent { "captured" } else { "store_failed" });
        if let Some(conversation) = gateway::join_arrays(&c.conversation, &output) {
            w.conversations.put(&c.tenant, &id, conversation);
        }
    }

    /// Route a parsed request (after any rewrite).
    fn route_parsed(&mut self, req: InferenceRequest, body_len: usize, now: u64) -> Action {
        if !self.arm_takes(&req, body_len) {
            return Action::Continue;
        }
        let worker = self.worker.clone();
        let Ok(mut guard) = worker.try_borrow_mut() else {
            host::log(LogLevel::Error, "attache: worker state busy; passing request through");
            return Action::Continue;
        };
        let w = &mut *guard;
        w.cache.refresh_for_request(now);
        stages::mark(Stage::SnapshotCheck);
        let Ok(mut st) = self.st.try_borrow_mut() else {
            return Action::Continue;
        };
        let token = st.token_endpoint.take();
        resolve_session(&mut st, &w.config, &req, token, now);
        if intake::learns_response(&w.config, req.api) {
            st.learn_response = Some(String::new());
        }
        stages::mark(Stage::Sticky);
        w.metrics.api(req.api);
        // A continuation bound nowhere here may be on its way from another replica: ask the host.
        if let Some(key) = self.read_through(w, &st, &req, now) {
            if let Some(token) = lookup::dispatch(&w.config.fleet, key) {
                st.lookup = Some(Lookup { token, key, req, body_len });
                return Action::Pause;
            }
            w.metrics.fleet_lookup("failed");
        }
        drop(st);
        self.proceed(w, req, body_len, now)
    }

    /// Whether this filter schedules `req`: always, unless it is a rollout arm whose buckets
    /// leave the request's session to the next scheduler filter. An arm that takes it marks it
    /// (policies::arm).
    fn arm_takes(&self, req: &InferenceRequest, body_len: usize) -> bool {
        let Ok(config) = self.worker.try_borrow().map(|w| std::rc::Rc::clone(&w.config)) else { return true };
        let Some(arm) = &config.rollout else { return true };
        let Ok(mut st) = self.st.try_borrow_mut() else { return true };
        if arm.shadow() {
            // Plan as this configuration would, on the same session binding, change nothing,
            // and let the scheduler after it act.
            let now = host::now_ms();
            let token = st.token_endpoint.clone();
            resolve_session(&mut st, &config, req, token, now);
            if let Ok(mut w) = self.worker.try_borrow_mut() {
                w.cache.refresh_for_request(now);
                crate::dispatch::shadow(&mut w, &st, req, body_len, now);
            }
            return false;
        }
        let seed = host::now_us() ^ (u64::from(self.id) << 40);
        if !arm.acts_on(st.session.as_deref().or(req.user.as_deref()), seed) {
            return false;
        }
        host::set_property(attache_policies::arm::SCHEDULED_PROPERTY, arm.mark().as_bytes());
        st.arm_hit = Some(0.0);
        true
    }

    /// The sticky key to look up at the host before routing `req`, if any: a Responses
    /// continuation whose `previous_response_id` no worker here has bound, while the host is
    /// heard from.
    fn read_through(&self, w: &mut Worker, st: &RequestState, req: &InferenceRequest, now: u64) -> Option<u64> {
        let cfg = &w.config;
        let prev = req.previous_response_id.as_deref()?;
        let wanted = st.sticky.is_none() && cfg.fleet.enabled && cfg.fleet.lookup_wait_ms > 0 && cfg.sessions.enabled;
        let stale = cfg.scheduler.host_stale_ms;
        (wanted && w.host_silent_ms(now, stale) <= stale).then(|| session::response_key(prev))
    }

    /// Route a parsed request whose session is resolved: now, or through flow control. The
    /// request's state must not be borrowed (the queue may route it).
    fn proceed(&mut self, w: &mut Worker, req: InferenceRequest, body_len: usize, now: u64) -> Action {
        // Utility routes are cheap and generate nothing: routed by load alone, never queued.
        if intake::flow_controlled(&w.config, req.api) {
            return self.admit(w, req, body_len, now);
        }
        let st_rc = self.st.clone();
        let Ok(mut st) = st_rc.try_borrow_mut() else {
            return Action::Continue;
        };
        match route(w, &mut st, &req, body_len, now) {
            Ok(()) => Action::Continue,
            Err(e) => {
                st.answered = true;
                answer(w, self.id, shape_of(st.api), &e);
                Action::Pause
            }
        }
    }

    /// Flow control: classify, refuse what cannot wait (policies::flow::admit), queue the rest,
    /// and dispatch whatever may go now (this request included, if it is next and the pool has
    /// room).
    fn admit(&mut self, w: &mut Worker, req: InferenceRequest, body_len: usize, now: u64) -> Action {
        let (class, continuing) = {
            let Ok(st) = self.st.try_borrow() else {
                return Action::Continue;
            };
            let class =
                flow::classify(&w.config.flow, Some(&w.cache.pool.objectives), |n| st.flow_header(n), req.priority);
            // Turn priority: a later turn of a session already bound goes ahead of new sessions'
            // first turns within its tenant.
            (class, w.config.sessions.turn_priority && (st.sticky.is_some() || req.previous_response_id.is_some()))
        };
        let saturation = w.flow.estimate(&w.cache.pool);
        let class = match flow::admit(class, continuing, &w.cache.pool, &req.model, saturation) {
            Ok(c) => c,
            Err(refusal) => return self.refuse(w, &refusal),
        };
        w.metrics.flow_saturation(saturation);
        let tokens = w.config.flow.cost((body_len / 4) as u64, req.max_tokens);
        let (priority, tenant) = (class.priority, class.tenant.clone());
        if let Ok(mut st) = self.st.try_borrow_mut() {
            st.parked = Some(Parked { req, body_len, class: class.clone() });
            st.priority = Some(priority);
        }
        let config = Rc::clone(&w.config);
        if let Err(shed) =
            w.flow.queue.enqueue(&config.flow, u64::from(self.id), &class, body_len, tokens, now, self.st.clone())
        {
            if let Ok(mut st) = self.st.try_borrow_mut() {
                st.parked = None;
            }
            return self.refuse(w, &Refusal::not_queued(shed, priority));
        }
        w.metrics.flow_enqueued(priority, &tenant);
        match pump(w, Some(self.id)) {
            Pumped::Dispatched => Action::Continue,
            Pumped::Waiting | Pumped::Answered => Action::Pause,
        }
    }
}

impl Context for SchedulerHttp {
    /// The host's read-through answer for a paused continuation: bind what it found and route.
    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        let worker = self.worker.clone();
        let Ok(mut guard) = worker.try_borrow_mut() else { return };
        let w = &mut *guard;
        let st_rc = self.st.clone();
        let Ok(mut st) = st_rc.try_borrow_mut() else { return };
        if st.serving.take_if(|t| *t == token_id).is_some() {
            drop(st);
            let answer = responses::served(status_code, response_size);
            w.metrics.responses(if answer.is_some() { "served" } else { "serve_failed" });
            drop(guard);
            match answer {
                Some((status, body)) => {
                    let reason = if status < 400 { "responses_store" } else { "responses_store_refused" };
                    host::send_json(status, reason, &body, &[]);
                    self.mark_answered();
                }
                None => {
                    self.answer_store_unavailable();
                }
            }
            return;
        }
        if let Some(r) = st.resolving.take_if(|r| r.token == token_id) {
            drop(st);
            let outcome = responses::resolved(status_code, response_size);
            let event = match &outcome {
                Resolution::Found(_) => "resolved.host",
                Resolution::NotFound => "resolved.not_found",
                Resolution::Evicted => "resolved.evicted",
                Resolution::Pending => "resolved.pending",
                Resolution::Failed => "resolved.failed",
            };
            w.metrics.responses(event);
            drop(guard);
            let action = match outcome {
                Resolution::Found(history) => {
                    self.rewrite(r.api, &r.body, &r.previous_id, &history, r.started_us, host::now_ms())
                }
                Resolution::NotFound => self.answer_unknown_previous(&r.previous_id, false),
                Resolution::Evicted => self.answer_unknown_previous(&r.previous_id, true),
                Resolution::Pending => self.answer_pending_previous(&r.previous_id),
                Resolution::Failed => self.answer_store_unavailable(),
            };
            if action == Action::Continue {
                host::resume_request();
            }
            return;
        }
        let Some(pending) = st.lookup.take_if(|l| l.token == token_id) else { return };
        let now = host::now_ms();
        match lookup::answer(pending.key, status_code, response_size, w.config.sessions.slots) {
            Some(endpoint) => {
                st.sticky = Some(endpoint);
                w.metrics.fleet_lookup("found");
            }
            None => w.metrics.fleet_lookup(if status_code == 0 { "missed" } else { "failed" }),
        }
        drop(st);
        w.cache.refresh(now);
        let action = self.proceed(w, pending.req, pending.body_len, now);
        if action == Action::Continue {
            host::resume_request();
        }
    }
}

impl HttpContext for SchedulerHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let cfg = self.worker.try_borrow().map(|w| std::rc::Rc::clone(&w.config));
        let Ok(cfg) = cfg else {
            return Action::Continue;
        };
        // A scheduler arm lets pass what an earlier arm scheduled, and an idle canary everything.
        if let Some(arm) = &cfg.rollout {
            if arm.idle() || host::property(attache_policies::arm::SCHEDULED_PROPERTY).is_some() {
                return Action::Continue;
            }
        }
        let headers = host::HeaderMap::request();
        // Never trust a client's routing headers. (Removing clears Envoy's route cache: only
        // when there is something to remove.)
        for name in ROUTING_HEADERS {
            if headers.contains(name) {
                host::remove_request_header(name);
            }
        }
        let explain = self.debug_header(&cfg, &headers);
        // The pool-wide model list, from the snapshot: no engine is asked.
        if model_list::is_model_list(headers.get(":method").as_deref(), headers.get(":path").as_deref()) {
            if let Ok(mut w) = self.worker.try_borrow_mut() {
                let now_us = host::now_us();
                w.cache.refresh(now_us / 1_000);
                if let Some(body) = model_list::body(&w.cache.pool, now_us / 1_000_000) {
                    w.metrics.model_list();
                    host::send_ok_json(&body);
                    drop(w);
                    self.mark_answered();
                    return Action::Pause;
                }
            }
        }
        // Engine mode: a response's own routes go to the engine that produced it.
        if let Some(id) = intake::engine_route(&cfg, |n| headers.get(n)) {
            let now = host::now_ms();
            let key = session::response_key(&id);
            let bound = session::lookup(&mut SharedSticky, cfg.sessions.slots, key, now);
            let routed = bound.is_some_and(|endpoint| host::set_request_header(plan::DESTINATION_HEADER, &endpoint));
            self.count_response(if routed { "engine.routed" } else { "engine.unbound" });
            return Action::Continue;
        }
        // The Responses API's own routes, answered from the gateway's store.
        if let Some(route) = intake::store_route(&cfg, |n| headers.get(n)) {
            return self.await_served(responses::serve(&cfg.responses, &route));
        }
        let head = match intake::head(&cfg, |n| headers.get(n), end_of_stream) {
            Ok(h) => h,
            Err(e) => return self.reject(e),
        };
        let Some(api) = head.api else {
            if let Ok(mut w) = self.worker.try_borrow_mut() {
                w.metrics.passthrough();
            }
            return Action::Continue;
        };
        if let Ok(mut st) = self.st.try_borrow_mut() {
            st.api = Some(api);
            st.explain = explain;
            st.token_endpoint = head.token_endpoint;
            st.session_key = head.session_key;
            st.flow_headers = head.flow_headers;
            st.tenant = head.tenant;
            if cfg.scoring.context || cfg.rollout.is_some() {
                st.started_us = host::now_us();
                st.session = head.rollout_session;
            }
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
        if let Err(e) = intake::check_size(body_size, limit) {
            return self.reject(e);
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
        if let Some(x) = st.explanation.take() {
            let name = self.worker.try_borrow().map(|w| w.config.debug.response_header.clone()).unwrap_or_default();
            if !name.is_empty() {
                host::set_response_header(&name, &x);
            }
        }
        if let Some(hit) = st.arm_hit.take() {
            let outcome = crate::metrics::ArmOutcome {
                error: host::response_header(":status").and_then(|s| s.parse::<u16>().ok()).unwrap_or(0) >= 500,
                trap: false,
                ttfb_us: host::now_us().saturating_sub(st.started_us),
                prefix_hit: hit,
            };
            if let Ok(mut w) = self.worker.try_borrow_mut() {
                grade_arm(&mut w, &outcome);
            }
        }
        if let Some(plan) = st.planned.take() {
            // The endpoint that served it: where the custom scorers' picker sent it, or the
            // fallback Envoy moved it to.
            let served = host::property_path(&["upstream", "address"])
                .or_else(|| host::property(scoring::PICKED_PROPERTY))
                .and_then(|b| String::from_utf8(b).ok());
            if let (Some(served), Ok(mut w)) = (served, self.worker.try_borrow_mut()) {
                follow_served(&mut w, &mut st, &plan, &served);
            }
        }
        if let Some(ep) = st.session_token.take() {
            let name = self.worker.try_borrow().map(|w| w.config.sessions.token_header.clone()).unwrap_or_default();
            if !name.is_empty() {
                host::set_response_header(&name, &session::token_for(&ep));
            }
        }
        if st.capture.is_some() && host::response_header(":status").is_none_or(|s| s != "200") {
            st.capture = None;
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
        let picked = host::property(scoring::PICKED_PROPERTY).and_then(|b| String::from_utf8(b).ok());
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
        // A shadow acted on nothing: the picker counts its comparison.
        for e in sheet.entries.iter().filter(|e| e.arm.acts()) {
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

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.capture_chunk(body_size, end_of_stream);
        let Ok(mut st) = self.st.try_borrow_mut() else {
            return Action::Continue;
        };
        // The first bytes of the answer: the engine has prefilled the prompt.
        if let Some((endpoint, tokens)) = st.prefilled() {
            if let Ok(mut w) = self.worker.try_borrow_mut() {
                w.prefilled(endpoint, tokens);
            }
        }
        // Learn `previous_response_id` → endpoint from the first bytes of a Responses body.
        let Some(served) = st.learn_response.take() else {
            return Action::Continue;
        };
        let id = host::response_body(body_size.min(4096)).and_then(|b| session::response_id(&b));
        if let (Some(id), Ok(mut w)) = (id, self.worker.try_borrow_mut()) {
            let sc = &w.config.sessions;
            let (slots, ttl, now) = (sc.slots, sc.ttl_ms, host::now_ms());
            let key = session::response_key(&id);
            session::bind(&mut SharedSticky, slots, key, &served, now, ttl);
            w.bound(key, &served, now.saturating_add(ttl), true);
            w.metrics.response_learned();
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.finish_capture();
        let (parked, released, api) = match self.st.try_borrow_mut() {
            Ok(mut st) => (st.parked.take().is_some(), st.release(), st.api),
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
        if let Some((endpoint, tokens)) = released {
            w.released(&endpoint, tokens);
            // Only a request flow control gated gives the gate something back.
            if api.is_some_and(|a| intake::flow_controlled(&w.config, a)) {
                // A request ended: the pool may have room for a waiting one.
                w.flow.gate.completed(host::now_ms());
                if !w.flow.queue.is_empty() {
                    pump(&mut w, None);
                }
            }
        }
    }
}

/// Resolve `req`'s session: its table key (the session header's, or the body's), then the
/// endpoint it is bound to, from the session token's endpoint (`token`), the key's binding or
/// the Responses chain (policies::session). The scheduling path and a shadow arm both use it,
/// so a shadow plans on the binding the acting scheduler will see.
fn resolve_session(
    st: &mut RequestState,
    config: &FilterConfig,
    req: &InferenceRequest,
    token: Option<String>,
    now: u64,
) {
    st.session_key = intake::body_session_key(config, st.session_key, req);
    let prev = req.previous_response_id.as_deref();
    st.sticky = session::resolve(&config.sessions, &mut SharedSticky, token, st.session_key, prev, now);
}

#[cfg(test)]
mod tests {
    use attache_policies::plan::DESTINATION_HEADER;
    use attache_policies::profiles::pd::PREFILLER_HEADER;
    use attache_policies::session::token_for;
    use attache_proto::v1;
    use proxy_wasm::types::Action;

    use crate::testing::harness::{address, endpoint, prompt, publish, snapshot, Filter, Request, ENGINE_MODE, MODEL};
    use crate::testing::{metric, with};

    #[test]
    fn a_request_is_routed_to_a_snapshot_endpoint_and_client_routing_headers_are_dropped() {
        publish(&snapshot(3));
        let mut filter = Filter::configure("");
        let forged = Request::completion(&prompt("hello"))
            .header(DESTINATION_HEADER, "6.6.6.6:1")
            .header(PREFILLER_HEADER, "6.6.6.6:2");
        let ex = filter.send(forged);
        assert_eq!(ex.on_headers, Action::Pause, "the filter waits for the body");
        assert!(ex.request_header(PREFILLER_HEADER).is_none(), "no P/D here: the client's prefiller is gone");
        assert_eq!(ex.on_body, Some(Action::Continue));
        assert!(ex.local_response().is_none());
        let all: Vec<String> = (0..3).map(address).collect();
        let dest = ex.destinations();
        assert_eq!(dest.len(), 3, "the primary and two fallbacks (max_endpoints)");
        assert!(dest.iter().all(|d| all.contains(d)), "{dest:?}: the client's destination is gone");
        filter.tick();
        assert_eq!(metric("attache.requests.scheduled"), Some(1), "counted from the tick");
    }

    #[test]
    fn requests_that_are_not_inference_pass_through_untouched() {
        publish(&snapshot(2));
        let filter = Filter::configure("");
        for req in [Request::get("/health"), Request::post("/v1/embeddings", "{}")] {
            let ex = filter.send(req.header(DESTINATION_HEADER, "6.6.6.6:1"));
            assert_eq!((ex.on_headers, ex.on_body.unwrap_or(Action::Continue)), (Action::Continue, Action::Continue));
            assert!(ex.request_header(DESTINATION_HEADER).is_none(), "still never trusted");
        }
        assert_eq!(metric("attache.requests.passthrough"), Some(2));
    }

    #[test]
    fn the_model_list_is_answered_from_the_snapshot() {
        publish(&snapshot(2));
        let filter = Filter::configure("");
        let ex = filter.send(Request::get("/v1/models"));
        let r = ex.local_response().expect("the filter answers it");
        assert_eq!((r.status, r.header("content-type")), (200, Some("application/json")));
        let list = r.json();
        assert_eq!(list["object"], "list");
        let ids: Vec<&str> = list["data"].as_array().unwrap().iter().filter_map(|m| m["id"].as_str()).collect();
        assert_eq!(ids.len(), 1, "one model, listed once for both endpoints: {list}");
        assert_eq!(metric("attache.requests.model_list"), Some(1));
        assert_eq!(metric("attache.requests.passthrough"), Some(0), "not passed through");
    }

    /// Send `req`; the filter must answer it itself with `status` and `reason`.
    fn refused(filter: &Filter, req: Request, status: u32, reason: &str) -> serde_json::Value {
        let ex = filter.send(req);
        let r = ex.refused();
        assert_eq!((r.status, r.header("x-attache-error")), (status, Some(reason)));
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert!(ex.on_body.unwrap_or(ex.on_headers) == Action::Pause, "the request goes no further");
        assert!(ex.request_header(DESTINATION_HEADER).is_none());
        let body = r.json();
        assert_eq!(body["error"]["code"], status, "{body}");
        assert_eq!(metric(&format!("attache.errors.{reason}")), Some(1));
        body
    }

    #[test]
    fn malformed_bodies_are_400_with_a_json_error() {
        publish(&snapshot(2));
        let filter = Filter::configure("");
        refused(&filter, Request::completion("{not json"), 400, "malformed_body");
        refused(&filter, Request::completion(r#"{"prompt":"hi"}"#), 400, "missing_model");
    }

    #[test]
    fn a_request_without_a_body_is_400() {
        publish(&snapshot(2));
        let filter = Filter::configure("");
        let ex = filter.send(Request::completion(""));
        assert_eq!((ex.refused().status, ex.on_headers, ex.on_body), (400, Action::Pause, None));
    }

    #[test]
    fn an_unknown_model_is_404() {
        publish(&snapshot(2));
        let filter = Filter::configure("");
        let body = refused(&filter, Request::completion(r#"{"model":"nope","prompt":"hi"}"#), 404, "unknown_model");
        assert_eq!(body["error"]["param"], "model");
    }

    #[test]
    fn no_snapshot_or_no_ready_endpoint_is_503() {
        let filter = Filter::configure("");
        refused(&filter, Request::completion(&prompt("hi")), 503, "no_endpoints");
        let mut s = snapshot(2);
        s.endpoints.iter_mut().for_each(|e| e.ready = false);
        publish(&s);
        let ex = filter.send(Request::completion(&prompt("hi")));
        assert_eq!(ex.refused().status, 503);
    }

    #[test]
    fn a_body_over_max_body_bytes_is_413_from_its_length_or_its_size() {
        publish(&snapshot(2));
        let filter = Filter::configure(r#"{"scheduler":{"max_body_bytes":64}}"#);
        let big = prompt(&"x".repeat(100));
        let ex = filter.send(Request::completion(&big));
        assert_eq!((ex.refused().status, ex.on_body), (413, None), "refused at the headers");
        assert_eq!(ex.refused().header("x-attache-error"), Some("body_too_large"));
        let ex = filter.send(Request::completion(&big).chunked());
        assert_eq!((ex.on_headers, ex.refused().status), (Action::Pause, 413), "refused at the body");
        let ex = filter.send(Request::completion(&prompt("small")));
        assert!(ex.primary().is_some(), "a body within the limit is routed");
    }

    #[test]
    fn a_session_sticks_to_its_endpoint_and_the_response_names_it() {
        publish(&snapshot(3));
        let filter = Filter::configure("");
        let mut first = filter.send(Request::completion(&prompt("turn one")).header("x-session-id", "s-1"));
        let bound = first.primary().expect("routed");
        assert_eq!(first.respond(200, &[]), Action::Continue);
        assert_eq!(first.response_header("x-session-token"), Some(token_for(&bound)));
        first.finish();

        // The session's endpoint is now the busiest: a request without the session goes
        // elsewhere, the session's next turn does not.
        let mut busy = snapshot(3);
        busy.version = 2;
        busy.endpoints.iter_mut().filter(|e| e.address == bound).for_each(|e| e.waiting = 4.0);
        publish(&busy);
        let other = filter.send(Request::completion(&prompt("another user")));
        assert_ne!(other.primary(), Some(bound.clone()), "load alone avoids the busy endpoint");
        let second = filter.send(Request::completion(&prompt("turn two")).header("x-session-id", "s-1"));
        assert_eq!(second.primary(), Some(bound));
        assert!(metric("attache.session.sticky_hits").unwrap_or(0) >= 1);
    }

    #[test]
    fn a_session_token_from_the_client_names_the_endpoint() {
        publish(&snapshot(3));
        let filter = Filter::configure("");
        let req = Request::completion(&prompt("hi")).header("x-session-token", &token_for(&address(2)));
        assert_eq!(filter.send(req).primary(), Some(address(2)));
        let forged = Request::completion(&prompt("hi")).header("x-session-token", &token_for("not an address!"));
        assert!(filter.send(forged).primary().is_some(), "a token that names no address is ignored");
    }

    #[test]
    fn in_flight_requests_are_counted_until_their_stream_ends() {
        publish(&snapshot(2));
        let filter = Filter::configure("");
        let a = filter.send(Request::completion(&prompt("one")));
        let b = filter.send(Request::completion(&prompt("two")));
        let in_flight = || (0..2).map(|i| filter.inflight(&address(i))).sum::<u32>();
        assert_eq!(in_flight(), 2);
        assert!(filter.inflight(&a.primary().expect("routed")) >= 1);
        a.finish();
        assert_eq!(in_flight(), 1);
        b.finish();
        assert_eq!(in_flight(), 0);
        let w = filter.worker();
        assert!(w.borrow().inflight_tokens.is_empty(), "tokens released too");
        assert!(w.borrow().inflight.is_empty(), "an endpoint with nothing in flight leaves the table");
    }

    #[test]
    fn a_hot_prefix_spreads_while_its_holder_prefills_and_returns_once_it_answers() {
        publish(&snapshot(3));
        let filter = Filter::configure("");
        // About 4,000 tokens: 251 ms at the default 15,928 tokens/s, over the 250 ms target.
        let preamble = "You are a coding agent with these tools. ".repeat(400);
        let turn = |n: usize| filter.send(Request::completion(&prompt(&format!("{preamble} task {n}"))));
        let mut first = turn(1);
        let holder = first.primary().expect("routed");
        // The holder is still prefilling it: the next request would wait behind ~4,000 tokens
        // there, and an idle endpoint computes the whole prompt sooner.
        let second = turn(2);
        assert_ne!(second.primary().as_deref(), Some(holder.as_str()), "spread");
        assert_eq!(metric("attache.prefix.spread"), Some(1));
        assert!(second.destinations().contains(&holder), "the holder remains a fallback");
        // Both answer: nothing queues, and the prefix stays with its holders.
        first.respond(200, &[]);
        first.respond_body("data: {}");
        let mut second = second;
        second.respond(200, &[]);
        second.respond_body("data: {}");
        let holders = [holder, second.primary().expect("routed")];
        let third = turn(3);
        assert!(holders.contains(&third.primary().expect("routed")), "{:?} not {holders:?}", third.primary());
        assert_eq!(metric("attache.prefix.spread"), Some(1), "nothing hot, nothing spread");
    }

    #[test]
    fn a_prompt_stops_queueing_once_its_answer_starts() {
        publish(&snapshot(2));
        let filter = Filter::configure("");
        let mut a = filter.send(Request::completion(&prompt("a long prompt that the engine prefills")));
        let endpoint = a.primary().expect("routed");
        let tokens = |f: &Filter| f.worker().borrow().inflight_tokens.get(endpoint.as_str()).copied().unwrap_or(0);
        assert!(tokens(&filter) > 0, "its uncached tokens queue ahead of the next request's");
        a.respond(200, &[]);
        assert!(tokens(&filter) > 0, "headers alone say nothing of the prefill");
        a.respond_body("data: {}");
        assert_eq!(tokens(&filter), 0, "the first bytes of the answer: prefilled");
        assert_eq!(filter.inflight(&endpoint), 1, "the request itself is in flight until it ends");
        a.finish();
        assert_eq!(filter.inflight(&endpoint), 0);
    }

    #[test]
    fn a_responses_api_answer_binds_its_id_to_the_endpoint_that_served_it() {
        publish(&snapshot(3));
        // Engine mode: the engines keep Responses state.
        let filter = Filter::configure(ENGINE_MODE);
        let body = serde_json::json!({ "model": MODEL, "input": "hi" }).to_string();
        let mut first = filter.send(Request::post("/v1/responses", &body));
        // A fallback served it: the primary failed.
        let served = first.destinations().last().cloned().expect("routed");
        assert_ne!(first.primary(), Some(served.clone()));
        with(|h| {
            let path = vec!["upstream".to_owned(), "address".to_owned()];
            h.streams.entry(first.id).or_default().properties.insert(path, served.clone().into_bytes());
        });
        first.respond(200, &[]);
        first.respond_body(r#"{"id":"resp_1","object":"response"}"#);
        first.finish();
        assert_eq!(metric("attache.session.responses_learned"), Some(1));
        let next = serde_json::json!({ "model": MODEL, "input": "more", "previous_response_id": "resp_1" });
        let ex = filter.send(Request::post("/v1/responses", &next.to_string()));
        assert_eq!(ex.primary(), Some(served));
    }

    #[test]
    fn an_endpoint_that_is_not_ready_is_never_picked() {
        let mut s = snapshot(3);
        s.endpoints[0].ready = false;
        s.endpoints.push(v1::Endpoint { models: vec!["other".into()], ..endpoint(9) });
        publish(&s);
        let filter = Filter::configure("");
        for i in 0..6 {
            let ex = filter.send(Request::completion(&prompt(&format!("request {i}"))));
            assert!(!ex.destinations().contains(&address(0)), "{:?}", ex.destinations());
            assert!(!ex.destinations().contains(&address(9)), "serves another model");
        }
    }
}
