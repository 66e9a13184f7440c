//! Route one parsed request: read the engine token ids (parse), plan it on the worker's newest
//! state (`policies::plan`), then apply the plan: headers, scorer hand-off, session binding,
//! what the worker learns, metrics and in-flight accounting. Called from the request's own
//! body callback, or from the flow-control queue (with the request made the effective context
//! first).

use attache_policies::arm;
use attache_policies::error::ErrorShape;
use attache_policies::flow::Refusal;
use attache_policies::plan::{self, Plan, PlanConfig, PlanRequest, StateView};
use attache_policies::prompt_tokens;
use attache_policies::request::{Api, InferenceRequest};
use attache_policies::scoring;
use attache_policies::ErrorResponse;

use crate::hostcalls as host;
use crate::request::RequestState;
use crate::shared::entry_log::PENDING_MAX;
use crate::shared::kv_table;
use crate::shared::sessions::SharedSticky;
use crate::stages::{self, Stage};
use crate::worker::Worker;

/// The error body the request's API expects (Anthropic's on the Messages routes).
pub fn shape_of(api: Option<Api>) -> ErrorShape {
    api.map_or(ErrorShape::OpenAi, Api::error_shape)
}

/// Answer the effective context's request with an error in `shape`, counting it.
pub fn answer(w: &mut Worker, id: u32, shape: ErrorShape, err: &ErrorResponse) {
    w.metrics.error(err.reason);
    host::debug(|| format!("attache[{id}]: {} {}", err.status, err.reason));
    let err = err.clone().shaped(shape);
    host::send_json(err.status, err.reason, &err.body, &[]);
}

/// Answer the effective context's request with flow control's refusal in `shape`, counting it.
pub fn refuse(w: &mut Worker, id: u32, shape: ErrorShape, refusal: &Refusal) {
    match refusal.shed {
        Some(shed) => w.metrics.flow_shed(shed),
        None => w.metrics.error(refusal.response.reason),
    }
    let r = refusal.response.clone().shaped(shape);
    host::debug(|| format!("attache[{id}]: {} {}", r.status, r.reason));
    host::send_json(r.status, r.reason, &r.body, &refusal.headers);
}

/// The request's token ids as the engine computes them, counting a prompt precise routing
/// could not tokenize.
fn prompt_ids(w: &mut Worker, req: &InferenceRequest, id: u32) -> Option<Vec<u32>> {
    let pc = &w.config.scheduler.precise;
    match prompt_tokens::engine_ids(pc, req, w.tokenizer.as_mut()) {
        Ok(ids) => ids,
        Err(e) => {
            host::debug(|| format!("attache[{id}]: no precise scores: {e}"));
            w.metrics.prompt_untokenized();
            None
        }
    }
}

/// Plan `req` on the worker's newest state, changing nothing (`policies::plan`).
fn plan_for(
    w: &mut Worker,
    st: &RequestState,
    req: &InferenceRequest,
    body_len: usize,
    now_ms: u64,
) -> Result<Plan, ErrorResponse> {
    let ids = prompt_ids(w, req, st.id);
    stages::mark(Stage::PromptTokens);
    let host_silent_ms = w.host_silent_ms(now_ms, w.config.scheduler.host_stale_ms);
    w.state.advance(now_ms);
    let config = std::rc::Rc::clone(&w.config);
    // The reader reads the index's epoch from shared data: only a request with engine token ids
    // gets precise scores, so only such a request pays for that host call.
    let kv = ids.as_ref().map(|_| kv_table::Reader::new(config.scheduler.precise.slots));
    let request = PlanRequest {
        id: st.id,
        req,
        body_len,
        prompt_ids: ids.as_deref(),
        sticky: st.sticky.as_deref(),
        session_key: st.session_key,
        rollout_session: st.session.as_deref(),
        subset: None,
        now_ms,
        sheddable: st.priority.is_some_and(|p| p < 0),
    };
    let view = StateView {
        pool: &w.cache.pool,
        state: &w.state,
        affinity: Some(&w.affinity),
        kv: kv.as_ref().map(|r| r as &dyn plan::KvIndexView),
        inflight: &w.inflight,
        inflight_tokens: &w.inflight_tokens,
        host_silent_ms,
    };
    let settings = PlanConfig { scheduler: &w.scheduler, sessions: &config.sessions, scoring: &config.scoring };
    plan::plan(&request, &view, &settings)
}

/// A shadow scheduler arm: plan `req` as this configuration would, change nothing, and leave
/// its pick in filter state for the scheduler that acts ([`compare_shadow`]).
pub fn shadow(w: &mut Worker, st: &RequestState, req: &InferenceRequest, body_len: usize, now_ms: u64) {
    let plan = match plan_for(w, st, req, body_len, now_ms) {
        Ok(plan) => plan,
        Err(e) => return w.metrics.shadow_unplanned(arm::SCHEDULER_SLOT, e.reason),
    };
    let pick = ShadowPick::of(w, &plan);
    let _ = host::set_property(arm::SHADOW_PROPERTY, &pick.encode());
}

/// What a scheduler picked, as its shadow counters grade it: the primary, its expected prefix
/// hit and its load (waiting + running).
struct ShadowPick {
    primary: String,
    hit: f32,
    load: f32,
}

impl ShadowPick {
    fn of(w: &Worker, plan: &Plan) -> Self {
        let primary = plan.dispatch.endpoint.clone();
        let load = w
            .cache
            .pool
            .endpoints
            .iter()
            .find(|e| e.address == primary)
            .and_then(|e| e.metrics)
            .map_or(0.0, |m| (m.waiting + m.running) as f32);
        Self { primary, hit: plan.decision.primary_hit(), load }
    }

    fn encode(&self) -> Vec<u8> {
        format!("{}|{}|{}", self.primary, self.hit, self.load).into_bytes()
    }

    fn decode(b: &[u8]) -> Option<Self> {
        let s = std::str::from_utf8(b).ok()?;
        let mut parts = s.split('|');
        let primary = parts.next()?.to_owned();
        Some(Self { primary, hit: parts.next()?.parse().ok()?, load: parts.next()?.parse().ok()? })
    }
}

/// The acting scheduler: grade a shadow arm's pick of this request against its own, in the
/// shadow counters the controller reads (`attache.rollout.scheduler.{shadow,live}.*`).
fn compare_shadow(w: &mut Worker, plan: &Plan) {
    let Some(mut shadow) = host::property(arm::SHADOW_PROPERTY).and_then(|b| ShadowPick::decode(&b)) else {
        return;
    };
    let live = ShadowPick::of(w, plan);
    // Both picks' expected hits by this scheduler's prefix knowledge: a shadow configuration
    // without a prefix scorer scores none, yet its pick may well hold the prefix.
    if let Some(hit) = plan.decision.hit_of(&w.cache.pool, &shadow.primary) {
        shadow.hit = hit;
    }
    w.metrics.shadow_compared(
        arm::SCHEDULER_SLOT,
        shadow.primary == live.primary,
        (shadow.hit, shadow.load),
        (live.hit, live.load),
    );
}

/// Pick the endpoints for `req` and apply the decision to the effective context. `now_ms` is
/// the caller's clock reading: one per decision, not one per use.
pub fn route(
    w: &mut Worker,
    st: &mut RequestState,
    req: &InferenceRequest,
    body_len: usize,
    now_ms: u64,
) -> Result<(), ErrorResponse> {
    let plan = plan_for(w, st, req, body_len, now_ms)?;
    stages::mark(Stage::Plan);
    let config = std::rc::Rc::clone(&w.config);
    if st.explain {
        let max = config.debug.max_candidates;
        st.explanation =
            Some(attache_policies::explain::explain(&w.scheduler, &w.cache.pool, &req.model, &plan.decision, max));
    }
    apply(w, st, &plan, now_ms)?;
    if st.arm_hit.is_some() {
        st.arm_hit = Some(plan.decision.primary_hit());
        compare_shadow(w, &plan);
    }
    host::debug(|| format!("attache[{}]: {}", st.id, plan.log_line(&req.model, w.cache.pool.version)));
    if plan.handed_off.is_some() {
        // Custom scorer slots may move the request off the primary: keep the plan to correct
        // what was learned once the response says where it went.
        st.planned = Some(Box::new(plan));
    }
    Ok(())
}

/// Apply a plan to the effective context and the worker.
fn apply(w: &mut Worker, st: &mut RequestState, plan: &Plan, now_ms: u64) -> Result<(), ErrorResponse> {
    for (name, value) in &plan.headers {
        if !host::set_request_header(name, value) {
            let msg = format!("could not set the {name} header");
            return Err(ErrorResponse::new(500, "header_write_failed", "InternalServerError", None, &msg));
        }
    }
    stages::mark(Stage::Headers);
    for (key, value) in &plan.properties {
        if host::set_property(key, value) && *key == scoring::CONTEXT_PROPERTY {
            st.handed_off.clone_from(&plan.handed_off);
        }
    }
    if let Some(binding) = &plan.session {
        plan::bind(&mut SharedSticky, binding, now_ms);
        let new = st.sticky.as_deref() != Some(binding.endpoint.as_str());
        w.bound(binding.key, &binding.endpoint, now_ms.saturating_add(binding.ttl_ms), new);
    }
    st.session_token.clone_from(&plan.session_token);
    stages::mark(Stage::Handoff);
    let room = PENDING_MAX.saturating_sub(w.affinity_pending.len());
    let sharing = w.affinity.capacity() > 0;
    let publish = plan::learn(plan, &mut w.state, sharing.then_some(&mut w.affinity), room);
    w.affinity_pending.extend(publish);
    stages::mark(Stage::Learn);
    w.metrics.planned(&plan.metrics, &plan.dispatch.endpoint);
    w.dispatched(plan);
    st.dispatched = Some(plan.dispatch.endpoint.clone());
    st.dispatched_tokens = plan.dispatch.uncached_tokens;
    stages::mark(Stage::Accounting);
    Ok(())
}
