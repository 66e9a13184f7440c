//! The scheduler's HTTP context: buffer and parse the request, resolve its session, then route
//! it now or let it wait in the flow-control queue; on the response, name the session's endpoint,
//! learn Responses ids and grade the rollout arm that scored it.

use std::borrow::Cow;
use std::cell::RefCell;
use std::rc::Rc;

use attache_policies::flow::{self, Refusal};
use attache_policies::plan::ROUTING_HEADERS;
use attache_policies::request::{self, Api, InferenceRequest};
use attache_policies::scoring::{self, ScoreSheet};
use attache_policies::session;
use attache_policies::{ErrorResponse, RequestError};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, LogLevel};

use crate::dispatch::{answer, refuse, route};
use crate::hostcalls as host;
use crate::queue::{pump, Pumped};
use crate::request::{Parked, RequestState, SharedRequest};
use crate::shared::sessions::SharedSticky;
use crate::stages::{self, Stage};
use crate::worker::Worker;

pub struct SchedulerHttp {
    id: u32,
    worker: Rc<RefCell<Worker>>,
    st: SharedRequest,
}

impl SchedulerHttp {
    pub fn new(id: u32, worker: Rc<RefCell<Worker>>) -> Self {
        Self { id, worker, st: Rc::new(RefCell::new(RequestState::new(id))) }
    }

    fn mark_answered(&self) {
        if let Ok(mut st) = self.st.try_borrow_mut() {
            st.answered = true;
        }
    }

    fn reject(&mut self, err: ErrorResponse) -> Action {
        match self.worker.try_borrow_mut() {
            Ok(mut w) => answer(&mut w, self.id, &err),
            Err(_) => host::send_json(err.status, err.reason, &err.body, &[]),
        }
        self.mark_answered();
        Action::Pause
    }

    fn refuse(&mut self, w: &mut Worker, refusal: &Refusal) -> Action {
        refuse(w, self.id, refusal);
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
        let worker = self.worker.clone();
        let Ok(mut guard) = worker.try_borrow_mut() else {
            host::log(LogLevel::Error, "attache: worker state busy; passing request through");
            return Action::Continue;
        };
        let w = &mut *guard;
        w.cache.refresh(now);
        stages::mark(Stage::SnapshotCheck);
        let Ok(mut st) = self.st.try_borrow_mut() else {
            return Action::Continue;
        };
        let sc = &w.config.sessions;
        let token = st.token_endpoint.take();
        st.sticky =
            session::resolve(sc, &mut SharedSticky, token, st.session_key, req.previous_response_id.as_deref(), now);
        if sc.enabled && req.api == Api::Responses {
            st.learn_response = Some(String::new());
        }
        stages::mark(Stage::Sticky);
        if w.config.flow.enabled {
            drop(st);
            return self.admit(w, req, body.len(), now);
        }
        match route(w, &mut st, &req, body.len(), now) {
            Ok(()) => Action::Continue,
            Err(e) => {
                st.answered = true;
                answer(w, self.id, &e);
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

impl Context for SchedulerHttp {}

impl HttpContext for SchedulerHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let headers = host::HeaderMap::request();
        // Never trust a client's routing headers. (Removing clears Envoy's route cache: only
        // when there is something to remove.)
        for name in ROUTING_HEADERS {
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
                st.token_endpoint = headers.get(&sc.token_header).and_then(|t| session::endpoint_of_token(&t));
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
        let id = host::response_body(body_size.min(4096)).and_then(|b| session::response_id(&b));
        if let (Some(id), Ok(mut w)) = (id, self.worker.try_borrow_mut()) {
            let sc = &w.config.sessions;
            let (slots, ttl) = (sc.slots, sc.ttl_ms);
            session::bind(&mut SharedSticky, slots, session::response_key(&id), &served, host::now_ms(), ttl);
            w.metrics.response_learned();
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        let (parked, released) = match self.st.try_borrow_mut() {
            Ok(mut st) => (st.parked.take().is_some(), st.release()),
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
            if w.config.flow.enabled {
                // A request ended: the pool may have room for a waiting one.
                w.flow.gate.completed(host::now_ms());
                if !w.flow.queue.is_empty() {
                    pump(&mut w, None);
                }
            }
        }
    }
}
