//! The per-request HTTP context: buffer, parse, schedule, set the destination header.

use std::cell::RefCell;
use std::rc::Rc;

use attache_policies::flow;
use attache_policies::index;
use attache_policies::precise;
use attache_policies::request::Prompt;
use attache_policies::request::{self, Api};
use attache_policies::scoring::{self, ScoreSheet, ScoringContext};
use attache_policies::{prefix, Decision, ErrorResponse, PoolState, RequestError, SchedulingInput};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, LogLevel};

use crate::host;
use crate::kv_table;
use crate::root::Worker;
use crate::snapshot::SharedAffinity;

/// The header Envoy's override_host LB policy (or an ORIGINAL_DST cluster) routes on.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Filter-state key the picker sets to the primary endpoint it chose.
pub const PICKED_PROPERTY: &str = "attache_picked";
/// llm-d's P/D header; only the scheduler may set it.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";

pub struct SchedulerHttp {
    id: u32,
    worker: Rc<RefCell<Worker>>,
    api: Option<Api>,
    /// Set once the filter answered the request itself.
    answered: bool,
    /// Endpoint counted in `inflight`, released when the request ends.
    dispatched: Option<String>,
    /// Session key from the configured headers (rollout bucket).
    session: Option<String>,
    /// When the request headers arrived, µs.
    started_us: u64,
    /// Set when a scoring context went to scorer filters: each candidate's expected prefix hit,
    /// to grade the arm that acted once the response starts.
    handed_off: Option<Vec<(String, f32)>>,
    /// The request headers flow control classifies on (objective, tenant, API key).
    flow_headers: Vec<(String, String)>,
}

/// The candidates as custom scorer filters see them (policies::scoring).
fn scoring_candidates(decision: &Decision, pool: &PoolState) -> Vec<scoring::Candidate> {
    decision
        .all
        .iter()
        .map(|s| {
            let ep = pool.endpoints.iter().find(|e| e.address == s.address);
            let m = ep.and_then(|e| e.metrics.as_ref());
            scoring::Candidate {
                address: s.address.clone(),
                labels: ep.map(|e| e.labels.clone()).unwrap_or_default(),
                waiting: m.map(|m| m.waiting as f32).unwrap_or(0.0),
                running: m.map(|m| m.running as f32).unwrap_or(0.0),
                kv_usage: m.map(|m| m.kv_usage as f32).unwrap_or(0.0),
                ttft_ms: m.map(|m| m.ttft_ms as f32).unwrap_or(0.0),
                prefix_hit: s.prefix.max(s.precise) as f32,
                score: s.total,
            }
        })
        .collect()
}

impl SchedulerHttp {
    pub fn new(id: u32, worker: Rc<RefCell<Worker>>) -> Self {
        Self {
            id,
            worker,
            api: None,
            answered: false,
            dispatched: None,
            session: None,
            started_us: 0,
            handed_off: None,
            flow_headers: Vec::new(),
        }
    }

    fn reject(&mut self, err: ErrorResponse) -> Action {
        self.reject_with(err, &[])
    }

    fn reject_with(&mut self, err: ErrorResponse, extra: &[(&str, &str)]) -> Action {
        if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.metrics.error(err.reason);
        }
        host::log(LogLevel::Debug, &format!("attache[{}]: {} {}", self.id, err.status, err.reason));
        host::send_json(err.status, err.reason, &err.body, extra);
        self.answered = true;
        Action::Pause
    }

    fn schedule(&mut self, api: Api, body: &[u8]) -> Action {
        let req = match request::parse(api, body) {
            Ok(r) => r,
            Err(e) => return self.reject(ErrorResponse::from(&e)),
        };
        let Ok(mut guard) = self.worker.try_borrow_mut() else {
            host::log(LogLevel::Error, "attache: worker state busy; passing request through");
            return Action::Continue;
        };
        let w = &mut *guard;
        w.cache.refresh(host::now_ms());
        if w.config.flow.enabled {
            // Classify (objective header or body priority; tenant header or API-key hash) and
            // shed sheddable requests while the host says the pool is saturated.
            let headers = &self.flow_headers;
            let header = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
            match flow::classify(&w.config.flow, Some(&w.cache.pool.objectives), header, req.priority) {
                Err(e) => {
                    drop(guard);
                    let msg =
                        format!("{e}; objectives come from InferenceObjective resources or the host's flow.objectives");
                    return self.reject_with(
                        ErrorResponse::new(400, "unknown_objective", "invalid_request_error", None, &msg),
                        &[("x-attache-dropped-reason", "unknown_objective")],
                    );
                }
                Ok(class) if class.sheddable() && w.cache.pool.saturation.is_some_and(|s| s >= 1.0) => {
                    drop(guard);
                    let msg = format!(
                        "the pool is saturated and priority {} requests are sheddable; retry later",
                        class.priority
                    );
                    return self.reject_with(
                        ErrorResponse::new(429, "sheddable", "rate_limit_error", None, &msg),
                        &[("retry-after", "1"), ("x-attache-dropped-reason", flow::Shed::Sheddable.reason())],
                    );
                }
                Ok(_) => {}
            }
        }
        let hashes =
            prefix::block_hashes(&w.config.scheduler.prefix, &req.model, req.cache_salt.as_deref(), &req.prompt);
        let seed = hashes.first().copied().unwrap_or(u64::from(self.id));
        let slots = w.config.scheduler.prefix.shared_slots;
        let shared = (slots > 0).then(|| index::shared_matches(&mut SharedAffinity, slots, &hashes));
        let pc = &w.config.scheduler.precise;
        // Token ids as the engine computes them (policies::prompt_tokens): token-id prompts as
        // given, text completions with BOS, conversations rendered with the model's chat template.
        let ids: Option<Vec<u32>> = match (pc.enabled, &req.prompt, w.tokenizer.as_mut()) {
            (false, _, _) => None,
            (true, Prompt::Tokens(ids), _) if req.messages.is_empty() => {
                Some(attache_policies::prompt_tokens::given_ids(ids, pc.max_tokens))
            }
            (true, _, Some(t)) => match t.request(&req, pc.max_tokens) {
                Ok(ids) => Some(ids),
                Err(e) => {
                    host::log(LogLevel::Debug, &format!("attache[{}]: no precise scores: {e}", self.id));
                    w.metrics.prompt_untokenized();
                    None
                }
            },
            (true, _, None) => {
                w.metrics.prompt_untokenized();
                None
            }
        };
        let ids_len = ids.as_ref().map(Vec::len);
        let precise_scores = ids.map(|ids| {
            let seed = prefix::chain_seed(&req.model, None);
            let reader = kv_table::Reader::new(pc.slots);
            precise::scores(
                &w.cache.pool.endpoints,
                &pc.tier_weights,
                |bs| prefix::token_block_keys(seed, &ids, bs),
                |k| reader.holders(k),
            )
        });
        let input = SchedulingInput {
            model: &req.model,
            block_hashes: &hashes,
            inflight: &w.inflight,
            seed,
            extra_matches: shared.as_ref(),
            precise: precise_scores.as_ref(),
        };
        let decision = match w.scheduler.schedule(&input, &w.cache.pool, &mut w.state) {
            Ok(d) => d,
            Err(e) => {
                drop(guard);
                return self.reject(ErrorResponse::from(&e));
            }
        };
        if !host::set_request_header(DESTINATION_HEADER, &decision.header_value()) {
            drop(guard);
            return self.reject(ErrorResponse::new(
                500,
                "header_write_failed",
                "InternalServerError",
                None,
                "could not set the destination header",
            ));
        }
        if w.config.scoring.context {
            let session = self.session.as_deref().or(req.user.as_deref());
            let bucket = session.map_or_else(|| scoring::bucket_of_seed(seed), |s| scoring::bucket_of(s.as_bytes()));
            let prompt_tokens = ids_len.unwrap_or(body.len() / 4).min(u32::MAX as usize) as u32;
            let ctx = ScoringContext {
                bucket,
                seed,
                max_endpoints: w.config.scheduler.max_endpoints.min(255) as u8,
                model: req.model.clone(),
                prompt_tokens,
                max_tokens: req.max_tokens.unwrap_or(0).min(u64::from(u32::MAX)) as u32,
                stream: req.stream,
                candidates: scoring_candidates(&decision, &w.cache.pool),
            };
            if host::set_property(scoring::CONTEXT_PROPERTY, &ctx.encode()) {
                self.handed_off = Some(ctx.candidates.into_iter().map(|c| (c.address, c.prefix_hit)).collect());
            }
        }
        w.scheduler.commit(&decision, &hashes, &mut w.state);
        if let (true, Some(primary)) = (slots > 0, decision.endpoints.first()) {
            index::shared_record(&mut SharedAffinity, slots, &hashes, primary);
        }
        if let Some(best) = decision.scores.first() {
            if precise_scores.is_some() {
                w.metrics.precise_score(best.precise);
            }
            w.metrics.scheduled(
                &best.address,
                best.prefix,
                best.queue,
                best.kv_cache,
                best.matched_blocks,
                decision.total_blocks,
            );
            *w.inflight.entry(best.address.clone()).or_insert(0) += 1;
            self.dispatched = Some(best.address.clone());
            host::log(
                LogLevel::Debug,
                &format!(
                    "attache[{}]: model={} api={} -> {} (prefix={:.3} queue={:.3} kv={:.3} total={:.3} matched={}/{} candidates={} snapshot={})",
                    self.id,
                    req.model,
                    api.as_str(),
                    decision.header_value(),
                    best.prefix,
                    best.queue,
                    best.kv_cache,
                    best.total,
                    best.matched_blocks,
                    decision.total_blocks,
                    decision.candidates,
                    w.cache.pool.version
                ),
            );
        }
        Action::Continue
    }
}

impl Context for SchedulerHttp {}

impl HttpContext for SchedulerHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // Never trust a client's routing headers.
        host::remove_request_header(DESTINATION_HEADER);
        host::remove_request_header(PREFILLER_HEADER);
        let method = host::request_header(":method").unwrap_or_default();
        let path = host::request_header(":path").unwrap_or_default();
        self.api = if method == "POST" { Api::from_path(&path) } else { None };
        if let Ok(w) = self.worker.try_borrow() {
            let f = &w.config.flow;
            if f.enabled {
                for h in [&f.objective_header, &f.tenant_header, &f.api_key_header] {
                    if let Some(v) = host::request_header(h) {
                        self.flow_headers.push((h.clone(), v));
                    }
                }
            }
            if w.config.scoring.context {
                self.started_us = host::now_us();
                self.session = w.config.scoring.session_headers.iter().find_map(|h| host::request_header(h));
            }
        }
        let Some(_) = self.api else {
            if let Ok(mut w) = self.worker.try_borrow_mut() {
                w.metrics.passthrough();
            }
            return Action::Continue;
        };
        let limit = self.worker.try_borrow().map(|w| w.config.scheduler.max_body_bytes).unwrap_or(usize::MAX);
        if let Some(len) = host::request_header("content-length").and_then(|v| v.trim().parse::<usize>().ok()) {
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
        let Some(api) = self.api else {
            return Action::Continue;
        };
        if self.answered {
            return Action::Pause;
        }
        let limit = self.worker.try_borrow().map(|w| w.config.scheduler.max_body_bytes).unwrap_or(usize::MAX);
        if body_size > limit {
            return self.reject(ErrorResponse::from(&RequestError::BodyTooLarge { size: body_size, limit }));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let Some(body) = host::request_body(body_size) else {
            return self.reject(ErrorResponse::from(&RequestError::EmptyBody));
        };
        self.schedule(api, &body)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(hits) = self.handed_off.take() else {
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
            .or(self.dispatched.as_deref())
            .and_then(|a| hits.iter().find(|(addr, _)| addr == a))
            .map(|(_, h)| *h)
            .unwrap_or(0.0);
        let ttfb_us = host::now_us().saturating_sub(self.started_us);
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

    fn on_log(&mut self) {
        if let Some(addr) = self.dispatched.take() {
            if let Ok(mut w) = self.worker.try_borrow_mut() {
                if let Some(n) = w.inflight.get_mut(&addr) {
                    *n = n.saturating_sub(1);
                }
            }
        }
    }
}
