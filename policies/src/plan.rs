//! One pure call per request: [`plan`] takes the parsed request, a view of the newest state and
//! the configuration, and returns everything the host must do with it: the endpoints, headers,
//! properties for custom scorers, the session binding, the prefiller, the index updates and the
//! metric deltas. The Envoy filter applies a plan; the endpoint picker and the simulator call the
//! same function, so scheduling is written once.

use hashbrown::HashMap;

use crate::calibration::CacheCounters;
use crate::endpoint::PoolState;
use crate::error::{ErrorResponse, ScheduleError};
use crate::filters::subset::Subset;
use crate::index::{self, AffinityTable};
use crate::pickers::tier;
use crate::plugin_config::ScoringConfig;
use crate::profiles::pd::PREFILLER_HEADER;
use crate::profiles::{SchedulingInput, ScoreList};
use crate::request::InferenceRequest;
use crate::scheduler::{Decision, Scheduler, SchedulerState};
use crate::scoring::{self, ScoringContext};
use crate::session::SessionConfig;
use crate::{precise, session};
use crate::{prefix, probe};

/// The header Envoy's `override_host` LB policy (or an ORIGINAL_DST cluster) routes on: the
/// primary endpoint, then the fallbacks.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Routing headers a client may not set: removed from every request before it is scheduled.
pub const ROUTING_HEADERS: [&str; 2] = [DESTINATION_HEADER, PREFILLER_HEADER];

/// The precise index, as the host sees it: (endpoint id, tier mask) per block key.
pub trait KvIndexView {
    fn holders(&self, key: u64) -> Vec<(u16, u8)>;
}

/// The newest state a decision reads.
pub struct StateView<'a> {
    pub pool: &'a PoolState,
    /// What this scheduler learned from its own decisions.
    pub state: &'a SchedulerState,
    /// What it learned from the other scheduler instances' (`None`: sharing is off).
    pub affinity: Option<&'a AffinityTable>,
    /// The precise index (`None`: precise routing is off).
    pub kv: Option<&'a dyn KvIndexView>,
    /// Requests this scheduler has in flight, and their uncached prompt tokens, per endpoint.
    pub inflight: &'a HashMap<String, u32>,
    pub inflight_tokens: &'a HashMap<String, u64>,
    /// Milliseconds since the host was last heard from (0: never, or just now).
    pub host_silent_ms: u64,
}

/// The configuration a decision reads.
pub struct PlanConfig<'a> {
    pub scheduler: &'a Scheduler,
    pub sessions: &'a SessionConfig,
    pub scoring: &'a ScoringConfig,
}

/// One request, parsed.
pub struct PlanRequest<'a> {
    /// The host's id of the stream (the tie-break seed of a request with no prefix).
    pub id: u32,
    pub req: &'a InferenceRequest,
    pub body_len: usize,
    /// Token ids as the engine computes them ([`crate::prompt_tokens::engine_ids`]).
    pub prompt_ids: Option<&'a [u32]>,
    /// The endpoint its session or conversation is bound to ([`session::resolve`]).
    pub sticky: Option<&'a str>,
    /// The session header's table key, to bind the session to its new primary.
    pub session_key: Option<u64>,
    /// The value of the first configured rollout session header (custom scorers' bucket).
    pub rollout_session: Option<&'a str>,
    /// The gateway's subset hint (the endpoint picker's; the filter passes `None`).
    pub subset: Option<&'a Subset>,
    /// The caller's clock in milliseconds, read once per request: active sessions age by it.
    pub now_ms: u64,
    /// Its flow-control band is sheddable (a negative priority): it goes to spare capacity
    /// ([`crate::spare`]).
    pub sheddable: bool,
}

/// A filter-state property: key and value.
pub type Property = (&'static str, Vec<u8>);

/// Bind a session's key to its endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionBinding {
    pub key: u64,
    pub endpoint: String,
    pub ttl_ms: u64,
    pub slots: u64,
    /// The request's prompt tokens: the context the session will send again, longer.
    pub tokens: u64,
}

/// What this scheduler learns from the decision.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct IndexUpdate {
    /// The prompt's block hashes and message anchors, recorded for the primary (and the
    /// prefill endpoint) by [`SchedulerState::commit`].
    pub hashes: Vec<u64>,
    pub anchors: Vec<usize>,
    /// Block hashes the cross-worker table does not yet prove for the primary: stored in this
    /// worker's table and published to the others.
    pub shared: Vec<u64>,
}

/// Metric deltas of one decision.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MetricsDelta {
    /// Scored on this scheduler's own load alone: the host was silent.
    pub load_only: bool,
    /// The primary's score by each scorer that has a histogram and had something to go on
    /// (held inline: at most one per scorer).
    pub scores: ScoreList,
    pub matched_blocks: usize,
    pub total_blocks: usize,
    /// The request's prompt tokens, those the primary was believed to hold (either index),
    /// and those expected cached once that belief is calibrated against the engine's own
    /// prefix-cache counters ([`crate::calibration`]).
    pub prompt_tokens: usize,
    pub believed_tokens: usize,
    pub expected_tokens: usize,
    /// The primary is the session's sticky endpoint.
    pub sticky_hit: bool,
    /// The request's session or conversation was bound to an endpoint that is no longer its
    /// primary: gone, saturated, or holding it no longer paid (the affinity gate's estimate).
    pub rebound: bool,
    /// The request's hot prefix spread to an endpoint that did not hold it.
    pub spread: bool,
    /// The request was split; the prefill endpoint.
    pub disaggregated: Option<String>,
}

/// Where the request goes, for in-flight accounting.
#[derive(Debug, Clone, PartialEq)]
pub struct Dispatch {
    pub endpoint: String,
    /// Prompt tokens the endpoint is not expected to hold.
    pub uncached_tokens: u64,
}

/// Everything the host does with one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub decision: Decision,
    /// Request headers to set, in order.
    pub headers: Vec<(&'static str, String)>,
    /// Filter-state properties for custom scorers and the picker, in order.
    pub properties: Vec<Property>,
    /// When the scoring context is among `properties`: each candidate's expected prefix hit,
    /// to grade the rollout arm that acted once the response starts.
    pub handed_off: Option<Vec<(String, f32)>>,
    pub session: Option<SessionBinding>,
    /// The endpoint the response's session token names.
    pub session_token: Option<String>,
    pub index: IndexUpdate,
    pub dispatch: Dispatch,
    pub metrics: MetricsDelta,
    /// When it was planned ([`PlanRequest::now_ms`]).
    pub now_ms: u64,
    /// [`PlanRequest::sheddable`].
    pub sheddable: bool,
}

impl Plan {
    /// The decision log line (without the host's request prefix).
    pub fn log_line(&self, model: &str, snapshot_version: u64) -> String {
        let d = &self.decision;
        let Some(best) = d.scores.first() else {
            return format!("model={model} -> (none)");
        };
        let scores: Vec<String> = best.scores.iter().map(|(n, v)| format!("{n}={v:.3}")).collect();
        format!(
            "model={model} -> {} ({} total={:.3} matched={}/{} candidates={} snapshot={snapshot_version})",
            d.header_value(),
            scores.join(" "),
            best.total,
            best.matched_blocks,
            d.total_blocks,
            d.candidates,
        )
    }
}

/// Plan one request. Pure: everything it reads comes in through `view`, and every change it
/// implies is in the returned [`Plan`].
pub fn plan(request: &PlanRequest<'_>, view: &StateView<'_>, config: &PlanConfig<'_>) -> Result<Plan, ErrorResponse> {
    let cfg = &config.scheduler.config;
    let req = request.req;
    let hashes = prefix::block_hashes(&cfg.prefix, &req.model, req.cache_salt.as_deref(), &req.prompt);
    let anchors = prefix::anchor_blocks(&cfg.prefix, &req.message_ends);
    probe::mark("plan.hashes");
    let seed = hashes.first().copied().unwrap_or(u64::from(request.id));
    let share = cfg.prefix.cache_share;
    let clock = |a: &str| view.pool.kv_clock(a, share);
    let shared = view.affinity.filter(|t| t.capacity() > 0).map(|t| t.matches_at(&hashes, &anchors, clock));
    probe::mark("plan.affinity");
    let precise_scores = precise_scores(request, view, config.scheduler);
    probe::mark("plan.precise");
    let load_only = cfg.host_stale_ms > 0 && view.host_silent_ms > cfg.host_stale_ms;
    let input = SchedulingInput {
        model: &req.model,
        block_hashes: &hashes,
        anchors: &anchors,
        inflight: view.inflight,
        inflight_tokens: Some(view.inflight_tokens),
        seed,
        extra_matches: shared.as_ref(),
        precise: precise_scores.as_ref(),
        prompt_tokens: request.prompt_ids.map_or_else(|| req.prompt.approx_tokens(), <[u32]>::len),
        sticky: request.sticky,
        load_only,
        subset: request.subset,
        session_key: request.session_key,
        sheddable: request.sheddable,
        now_ms: request.now_ms,
    };
    let decision = config.scheduler.schedule(&input, view.pool, view.state).map_err(|e| ErrorResponse::from(&e))?;
    let prompt_tokens = input.prompt_tokens;
    probe::mark("plan.schedule");
    let best = decision.scores.first().ok_or_else(|| ErrorResponse::from(&ScheduleError::NoEndpoints))?;
    let dispatch = Dispatch {
        endpoint: best.address.clone(),
        uncached_tokens: input.prompt_tokens.saturating_sub(best.cached_tokens) as u64,
    };
    let bound = config.sessions.enabled && request.sticky.is_some();
    let believed = best.cached_tokens.min(prompt_tokens);
    let expected = view.state.calibration.expected_tokens(&best.address, believed, prompt_tokens);
    let metrics = metrics(config.scheduler, &decision, load_only, bound, [prompt_tokens, believed, expected]);
    let known = shared.as_ref().and_then(|m| m.get(best.address.as_str())).copied().unwrap_or(0);
    let index = IndexUpdate {
        shared: if shared.is_some() { index::shared_entries(&hashes, &anchors, known) } else { Vec::new() },
        hashes,
        anchors,
    };
    probe::mark("plan.metrics");
    let mut headers = vec![(DESTINATION_HEADER, decision.header_value())];
    headers.extend(decision.prefiller().map(|p| (PREFILLER_HEADER, p.to_owned())));
    let (properties, handed_off) = if config.scoring.context {
        handoff(request, &decision, view.pool, config.scheduler, seed)
    } else {
        (Vec::new(), None)
    };
    probe::mark("plan.handoff");
    let (session, session_token) = bind_session(request, &decision, config.sessions, prompt_tokens);
    Ok(Plan {
        decision,
        headers,
        properties,
        handed_off,
        session,
        session_token,
        index,
        dispatch,
        metrics,
        now_ms: request.now_ms,
        sheddable: request.sheddable,
    })
}

/// Precise scores from the engines' KV events, when the request has engine token ids and the
/// host has an index.
fn precise_scores(
    request: &PlanRequest<'_>,
    view: &StateView<'_>,
    scheduler: &Scheduler,
) -> Option<HashMap<u32, (f64, usize)>> {
    let (ids, kv) = (request.prompt_ids?, view.kv?);
    let pc = &scheduler.config.precise;
    // The engines seed their block keys with their model; a request that names none (vLLM's
    // `generate` allows it) is keyed with the pool's base model.
    let model = match request.req.model.as_str() {
        "" => view.pool.endpoints.iter().find_map(crate::Endpoint::base_model).unwrap_or(""),
        m => m,
    };
    let seed = prefix::chain_seed(model, None);
    let keys_for = |bs: usize| (ids.len() / bs.max(1), prefix::token_block_key_iter(seed, ids, bs));
    Some(precise::scores(view.pool, &pc.tier_weights, keys_for, |k| kv.holders(k)))
}

/// `bound`: the request's session or conversation was bound to an endpoint; `tokens`: the
/// prompt's, those believed cached and those expected cached.
fn metrics(
    scheduler: &Scheduler,
    decision: &Decision,
    load_only: bool,
    bound: bool,
    tokens: [usize; 3],
) -> MetricsDelta {
    let best = decision.scores.first();
    // The profile's scorers name their histograms; a scorer left out of the scores (nothing to
    // go on) records none.
    let scores = match best {
        Some(b) => scheduler
            .decode_profile()
            .scorers
            .iter()
            .filter_map(|(s, _)| Some((s.metric()?, b.scores.iter().find(|(n, _)| *n == s.name())?.1)))
            .collect(),
        None => ScoreList::default(),
    };
    MetricsDelta {
        load_only,
        scores,
        matched_blocks: best.map_or(0, |b| b.matched_blocks),
        total_blocks: decision.total_blocks,
        prompt_tokens: tokens[0],
        believed_tokens: tokens[1],
        expected_tokens: tokens[2],
        sticky_hit: bound && decision.sticky,
        rebound: bound && !decision.sticky,
        spread: decision.spread,
        disaggregated: decision.prefiller().map(str::to_owned),
    }
}

/// The scoring context for custom scorer filters, and the tiers their picker must keep.
fn handoff(
    request: &PlanRequest<'_>,
    decision: &Decision,
    pool: &PoolState,
    scheduler: &Scheduler,
    seed: u64,
) -> (Vec<Property>, Option<Vec<(String, f32)>>) {
    let req = request.req;
    let session = request.rollout_session.or(req.user.as_deref());
    let bucket = session.map_or_else(|| scoring::bucket_of_seed(seed), |s| scoring::bucket_of(s.as_bytes()));
    let prompt_tokens = request.prompt_ids.map_or(request.body_len / 4, <[u32]>::len);
    let ctx = ScoringContext {
        bucket,
        seed,
        max_endpoints: scheduler.config.max_endpoints.min(255) as u8,
        model: req.model.clone(),
        prompt_tokens: prompt_tokens.min(u32::MAX as usize) as u32,
        max_tokens: req.max_tokens.unwrap_or(0).min(u64::from(u32::MAX)) as u32,
        stream: req.stream,
        candidates: scoring_candidates(decision, pool),
    };
    let mut properties = Vec::with_capacity(2);
    if decision.tiers.iter().any(|&t| t != tier::NONE) {
        properties.push((scoring::TIERS_PROPERTY, decision.tiers.clone()));
    }
    properties.push((scoring::CONTEXT_PROPERTY, ctx.encode()));
    let handed = ctx.candidates.into_iter().map(|c| (c.address, c.prefix_hit)).collect();
    (properties, Some(handed))
}

/// The candidates as custom scorer filters see them.
fn scoring_candidates(decision: &Decision, pool: &PoolState) -> Vec<scoring::Candidate> {
    decision
        .all
        .iter()
        .map(|s| {
            let ep = pool.endpoints.get(s.position);
            let m = ep.and_then(|e| e.metrics.as_ref());
            scoring::Candidate {
                address: ep.map(|e| e.address.clone()).unwrap_or_default(),
                labels: ep.map(|e| e.labels.clone()).unwrap_or_default(),
                waiting: m.map_or(0.0, |m| m.waiting as f32),
                running: m.map_or(0.0, |m| m.running as f32),
                kv_usage: m.map_or(0.0, |m| m.kv_usage as f32),
                ttft_ms: m.map_or(0.0, |m| m.ttft_ms as f32),
                prefix_hit: s.prefix_hit as f32,
                score: s.total,
            }
        })
        .collect()
}

/// Session affinity: bind the session to its primary (refreshing the TTL), and name the primary
/// in the response's session token.
fn bind_session(
    request: &PlanRequest<'_>,
    decision: &Decision,
    cfg: &SessionConfig,
    prompt_tokens: usize,
) -> (Option<SessionBinding>, Option<String>) {
    // Utility routes (tokenize, count_tokens, ...) are routed by load alone: they bind no
    // session and name no endpoint for the next turn.
    let Some(primary) = decision.endpoints.first().filter(|_| cfg.enabled && !request.req.api.is_utility()) else {
        return (None, None);
    };
    let binding = request.session_key.map(|key| SessionBinding {
        key,
        endpoint: primary.clone(),
        ttl_ms: cfg.ttl_ms,
        slots: cfg.slots,
        tokens: prompt_tokens as u64,
    });
    (binding, Some(primary.clone()))
}

/// Apply what a plan teaches this scheduler: its index, LRU and active sessions, and its
/// cross-worker table. Returns the `(hash, endpoint)` entries to publish to the other
/// workers, at most `room`.
pub fn learn(
    plan: &Plan,
    state: &mut SchedulerState,
    affinity: Option<&mut AffinityTable>,
    room: usize,
) -> Vec<(u64, String)> {
    if let Some(primary) = plan.decision.scores.first() {
        let counters = CacheCounters::from_written(primary.kv_written, primary.kv_hits);
        let m = &plan.metrics;
        state.calibration.record(&primary.address, m.believed_tokens as u64, m.prompt_tokens as u64, counters);
    }
    learn_with(plan, state, affinity, room, true)
}

/// [`learn`], moving the plan's session in the active sessions only when `session`.
fn learn_with(
    plan: &Plan,
    state: &mut SchedulerState,
    affinity: Option<&mut AffinityTable>,
    room: usize,
    session: bool,
) -> Vec<(u64, String)> {
    state.commit(&plan.decision, &plan.index.hashes, &plan.index.anchors);
    state.sessions.expire(plan.now_ms);
    if let Some(primary) = plan.decision.endpoints.first().filter(|_| !plan.sheddable) {
        state.interactive.record(primary, plan.now_ms);
    }
    if let Some(b) = plan.session.as_ref().filter(|_| session) {
        state.sessions.touch(b.key, &b.endpoint, b.tokens, plan.now_ms);
    }
    let (Some(table), Some(primary)) = (affinity, plan.decision.endpoints.first()) else {
        return Vec::new();
    };
    let written = plan.decision.primary_kv_written();
    let mut publish = Vec::with_capacity(plan.index.shared.len().min(room));
    for (i, &h) in plan.index.shared.iter().enumerate() {
        table.store_at(h, primary, written);
        if i < room {
            publish.push((h, primary.clone()));
        }
    }
    publish
}

/// The plan as if `served` had been its primary: what the gateway reports actually served the
/// request (a fallback, when the primary refused it). Learning it teaches the prefix index and
/// the session the endpoint that holds the prompt now. `None` when the primary served it.
pub fn served_by(plan: &Plan, served: &str) -> Option<Plan> {
    if plan.decision.endpoints.first().is_some_and(|p| p == served) || served.is_empty() {
        return None;
    }
    let mut p = plan.clone();
    let d = &mut p.decision;
    d.endpoints.retain(|e| e != served);
    d.endpoints.insert(0, served.to_owned());
    if let Some(i) = d.scores.iter().position(|s| s.address == served) {
        let s = d.scores.remove(i);
        d.scores.insert(0, s);
    }
    d.sticky = false;
    p.dispatch.endpoint = served.to_owned();
    if let Some(b) = p.session.as_mut() {
        served.clone_into(&mut b.endpoint);
    }
    if p.session_token.is_some() {
        p.session_token = Some(served.to_owned());
    }
    Some(p)
}

/// The gateway reports that `served` served a planned request: if that is not the primary,
/// unlearn the blocks the primary was credited with by this decision alone, learn the plan as
/// served instead ([`served_by`], [`learn`]) and return it (its session binding and dispatch
/// name the endpoint that served).
pub fn learn_served(
    plan: &Plan,
    served: &str,
    state: &mut SchedulerState,
    affinity: Option<&mut AffinityTable>,
) -> Option<Plan> {
    relearn(plan, served, state, affinity, 0).map(|(p, _)| p)
}

/// [`learn_served`], also returning the `(hash, endpoint)` entries to publish to the other
/// workers (at most `room`), so that their affinity tables name the endpoint that served
/// rather than the primary the plan published.
pub fn relearn(
    plan: &Plan,
    served: &str,
    state: &mut SchedulerState,
    affinity: Option<&mut AffinityTable>,
    room: usize,
) -> Option<(Plan, Vec<(u64, String)>)> {
    let corrected = served_by(plan, served)?;
    let primary = plan.decision.endpoints.first();
    if let Some(primary) = primary {
        state.index.unrecord(&plan.index.hashes, &plan.index.anchors, plan.metrics.matched_blocks, primary);
    }
    // The session moves with this turn only if no later turn has been planned since (a later
    // one is bound where it went, with its own context).
    let latest = plan.session.as_ref().is_some_and(|b| {
        state
            .sessions
            .bound(b.key)
            .is_none_or(|(at, tokens)| Some(at) == primary.map(String::as_str) && tokens == b.tokens)
    });
    let publish = learn_with(&corrected, state, affinity, room, latest);
    Some((corrected, publish))
}

/// Bind a plan's session in a sticky store.
pub fn bind(store: &mut dyn session::StickyStore, binding: &SessionBinding, now_ms: u64) {
    session::bind(store, binding.slots, binding.key, &binding.endpoint, now_ms, binding.ttl_ms);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::endpoint::{Endpoint, Role};
    use crate::request::{parse, Api};
    use crate::session::StickyStore;
    use crate::SchedulerConfig;

    fn pool(n: usize) -> PoolState {
        let endpoints = (0..n)
            .map(|i| Endpoint { id: i as u32, block_size: 16, ..Endpoint::idle(format!("10.0.0.{i}:8000"), "m") })
            .collect();
        PoolState { version: 1, endpoints, ..Default::default() }
    }

    /// Everything a plan reads, owned, with nothing learned yet.
    struct World {
        scheduler: Scheduler,
        state: SchedulerState,
        pool: PoolState,
        affinity: AffinityTable,
        inflight: HashMap<String, u32>,
        tokens: HashMap<String, u64>,
        sessions: SessionConfig,
        scoring: ScoringConfig,
        silent_ms: u64,
    }

    impl World {
        fn new(pool: PoolState) -> Self {
            let scheduler = Scheduler::new(SchedulerConfig::default()).unwrap();
            Self {
                state: scheduler.new_state(),
                scheduler,
                pool,
                affinity: AffinityTable::new(1024),
                inflight: HashMap::new(),
                tokens: HashMap::new(),
                sessions: SessionConfig::default(),
                scoring: ScoringConfig::default(),
                silent_ms: 0,
            }
        }

        fn plan(&self, req: &PlanRequest<'_>, kv: Option<&dyn KvIndexView>) -> Result<Plan, ErrorResponse> {
            let view = StateView {
                pool: &self.pool,
                state: &self.state,
                affinity: Some(&self.affinity),
                kv,
                inflight: &self.inflight,
                inflight_tokens: &self.tokens,
                host_silent_ms: self.silent_ms,
            };
            let config = PlanConfig { scheduler: &self.scheduler, sessions: &self.sessions, scoring: &self.scoring };
            plan(req, &view, &config)
        }

        /// Plan and learn, as a host applies a plan.
        fn route(&mut self, req: &PlanRequest<'_>) -> Plan {
            let p = self.plan(req, None).unwrap();
            let publish = learn(&p, &mut self.state, Some(&mut self.affinity), usize::MAX);
            assert_eq!(publish.len(), p.index.shared.len());
            p
        }
    }

    fn request(body: &str) -> InferenceRequest {
        parse(Api::Completions, body.as_bytes()).unwrap()
    }

    /// A plan request for `r` with nothing else set.
    pub(crate) fn req<'a>(r: &'a InferenceRequest) -> PlanRequest<'a> {
        PlanRequest {
            sheddable: false,
            id: 1,
            req: r,
            body_len: 0,
            prompt_ids: None,
            sticky: None,
            session_key: None,
            rollout_session: None,
            subset: None,
            now_ms: 0,
        }
    }

    #[test]
    fn sheddable_requests_go_where_interactive_ones_do_not() {
        let mut w = World::new(pool(3));
        let chat = request(r#"{"model":"m","prompt":"the support assistant's long shared system prompt"}"#);
        let home = w.route(&PlanRequest { now_ms: 1_000, ..req(&chat) }).decision.endpoints[0].clone();
        for i in 0..12u32 {
            let batch = request(&format!(r#"{{"model":"m","prompt":"summarise document {i}"}}"#));
            let p = w.route(&PlanRequest { id: i, sheddable: true, now_ms: 1_100 + u64::from(i), ..req(&batch) });
            assert_ne!(p.decision.endpoints[0], home, "batch job {i} avoids the interactive endpoint");
            assert!(p.sheddable);
        }
        // Sheddable requests do not make an endpoint an interactive one; past the window every
        // endpoint is open to them again.
        let late = (0..30u32)
            .map(|i| {
                let batch = request(&format!(r#"{{"model":"m","prompt":"another document {i}"}}"#));
                w.route(&PlanRequest { id: i, sheddable: true, now_ms: 10_000, ..req(&batch) }).decision.endpoints[0]
                    .clone()
            })
            .filter(|e| *e == home)
            .count();
        assert!(late > 0, "the old interactive endpoint takes batch work once interactive traffic left it");
    }

    #[test]
    fn a_plan_carries_the_headers_the_dispatch_and_what_to_learn() {
        let mut w = World::new(pool(3));
        let r = request(&format!(r#"{{"model":"m","prompt":"{}"}}"#, "a long shared prompt ".repeat(60)));
        let first = w.route(&PlanRequest { session_key: Some(42), ..req(&r) });
        let primary = first.decision.endpoints[0].clone();
        assert_eq!(first.headers[0], (DESTINATION_HEADER, first.decision.header_value()));
        assert_eq!(first.headers.len(), 1, "no P/D in this pool");
        assert_eq!(first.dispatch.endpoint, primary);
        assert!(first.properties.is_empty() && first.handed_off.is_none(), "no custom scorers configured");
        let binding = first.session.clone().unwrap();
        assert_eq!((binding.key, binding.endpoint.as_str()), (42, primary.as_str()));
        assert_eq!(first.session_token.as_deref(), Some(primary.as_str()));
        assert!(!first.index.hashes.is_empty() && !first.index.shared.is_empty());
        let names: Vec<&str> = first.metrics.scores.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["prefix", "queue", "kv_cache"], "no token ids: the precise scorer is not listed");
        // The same prompt again: the index and the affinity table learned it.
        let again = w.route(&req(&r));
        assert_eq!(again.dispatch.endpoint, primary);
        assert!(again.index.shared.is_empty(), "the table proves it already");
        assert_eq!(again.metrics.matched_blocks, again.metrics.total_blocks);
        assert!(again.log_line("m", 1).contains(&primary));
    }

    #[test]
    fn a_new_session_goes_where_active_sessions_leave_the_most_cache() {
        // Engines of 2,048 blocks of 16 tokens (32,768). Sessions 1-3 are bound to engines 0-2
        // with contexts of about 30k, 20k and 10k tokens; engine 3 got the last cold request
        // without a session, so the no-hit LRU alone would send a cold request to engine 0.
        let mut p = pool(4);
        for e in &mut p.endpoints {
            e.kv_blocks = 2_048;
        }
        let mut w = World::new(p);
        let addr = |i: usize| format!("10.0.0.{i}:8000");
        let body = |tag: &str, words: usize| format!(r#"{{"model":"m","prompt":"{tag} {}"}}"#, "word ".repeat(words));
        for (i, words) in [(0, 24_000), (1, 16_000), (2, 8_000), (3, 10)] {
            let r = request(&body(&format!("session {i}"), words));
            let key = (i < 3).then_some(i as u64 + 1);
            let a = addr(i);
            let p = w.route(&PlanRequest { sticky: Some(&a), session_key: key, now_ms: 1_000, ..req(&r) });
            assert_eq!(p.dispatch.endpoint, a);
        }
        assert!(w.state.sessions.tokens(&addr(0)) > 25_000 && w.state.sessions.tokens(&addr(3)) == 0);
        let new = request(&body("a new session", 50));
        let placed = w.plan(&PlanRequest { session_key: Some(9), now_ms: 2_000, ..req(&new) }, None).unwrap();
        assert_eq!(placed.dispatch.endpoint, addr(3), "{:?}", placed.decision.scores);
        // Sessions lapse 30 s after their last turn, as this scheduler routes requests.
        w.route(&PlanRequest { now_ms: 31_000, ..req(&request(&body("x", 1))) });
        assert!(w.state.sessions.is_empty() && w.state.sessions.tokens(&addr(0)) == 0);
    }

    #[test]
    fn a_bound_request_counts_as_a_sticky_hit_or_a_rebound() {
        let mut w = World::new(pool(3));
        let r = request(r#"{"model":"m","prompt":"hello"}"#);
        let primary = w.route(&req(&r)).decision.endpoints[0].clone();
        let kept = w.route(&PlanRequest { sticky: Some(&primary), ..req(&r) });
        assert!(kept.metrics.sticky_hit && !kept.metrics.rebound);
        // Bound to an endpoint that left the pool: routed afresh, and counted.
        let moved = w.route(&PlanRequest { sticky: Some("10.9.9.9:1"), ..req(&r) });
        assert!(!moved.metrics.sticky_hit && moved.metrics.rebound);
        let free = w.route(&req(&r));
        assert!(!free.metrics.sticky_hit && !free.metrics.rebound, "no binding, nothing to count");
    }

    #[test]
    fn neither_the_index_nor_the_affinity_table_claims_a_prefix_its_engine_evicted() {
        let mut p = pool(2);
        for e in &mut p.endpoints {
            (e.block_size, e.kv_blocks, e.kv_written) = (16, 256, Some(0));
        }
        let mut w = World::new(p);
        let r = request(&format!(r#"{{"model":"m","prompt":"{}"}}"#, "a prompt that gets evicted ".repeat(60)));
        let first = w.route(&req(&r));
        let holder = w.pool.position(&first.dispatch.endpoint).unwrap();
        let again = w.route(&req(&r));
        assert_eq!(again.metrics.matched_blocks, again.metrics.total_blocks, "held");
        // The holder writes 4,000 tokens of other prompts: more than 90% of its 4,096.
        w.pool.endpoints[holder].kv_written = Some(4_000);
        let after = w.plan(&req(&r), None).unwrap();
        assert_eq!(after.metrics.matched_blocks, 0, "evicted: {}", after.log_line("m", 1));
        assert!(after.decision.cold);
    }

    #[test]
    fn the_expected_hit_follows_the_engines_own_counters() {
        // One engine, so every request lands where the index believes the prompt is held;
        // the engine, though, reports finding only a fifth of what it is sent.
        let mut p = pool(1);
        (p.endpoints[0].kv_written, p.endpoints[0].kv_hits) = (Some(0), Some(0));
        let mut w = World::new(p);
        let r = request(&format!(r#"{{"model":"m","prompt":"{}"}}"#, "a prompt the engine keeps losing ".repeat(80)));
        let first = w.route(&req(&r));
        let prompt = first.metrics.prompt_tokens as u64;
        assert!(prompt > 0 && first.metrics.believed_tokens == 0, "cold: {:?}", first.metrics);
        let (mut written, mut hits) = (0u64, 0u64);
        let mut last = first;
        for _ in 0..40 {
            written += prompt - prompt / 5;
            hits += prompt / 5;
            (w.pool.endpoints[0].kv_written, w.pool.endpoints[0].kv_hits) = (Some(written), Some(hits));
            last = w.route(&req(&r));
        }
        let m = &last.metrics;
        assert_eq!(m.believed_tokens, m.prompt_tokens, "the index believes it all held");
        let share = m.expected_tokens as f64 / m.prompt_tokens as f64;
        assert!((share - 0.2).abs() < 0.05, "calibrated to the engine's fifth: {share} {m:?}");
        let rates = w.state.calibration.rates(&last.dispatch.endpoint).expect("calibrated");
        assert!(rates.belief > 0.9 && (rates.engine - 0.2).abs() < 0.01, "{rates:?}");
    }

    #[test]
    fn the_served_endpoint_is_learned_in_place_of_a_failed_primary() {
        let mut w = World::new(pool(4));
        let r = request(&format!(r#"{{"model":"m","prompt":"{}"}}"#, "served elsewhere ".repeat(60)));
        let first = w.plan(&PlanRequest { session_key: Some(7), ..req(&r) }, None).unwrap();
        let primary = first.decision.endpoints[0].clone();
        assert!(served_by(&first, &primary).is_none(), "the primary served it: nothing to correct");
        let other = w.pool.endpoints.iter().map(|e| e.address.clone()).find(|a| *a != primary).unwrap();
        let served = served_by(&first, &other).unwrap();
        assert_eq!(served.decision.endpoints[0], other);
        assert!(!served.decision.endpoints[1..].contains(&other), "listed once");
        assert_eq!(served.dispatch.endpoint, other);
        assert_eq!(served.session.as_ref().map(|b| b.endpoint.as_str()), Some(other.as_str()));
        assert_eq!(served.session_token.as_deref(), Some(other.as_str()));
        // As a host applies it: the decision is learned first, the served report later.
        learn(&first, &mut w.state, Some(&mut w.affinity), usize::MAX);
        let learned = learn_served(&first, &other, &mut w.state, Some(&mut w.affinity)).unwrap();
        assert_eq!(learned, served);
        let tokens = first.session.as_ref().map(|b| b.tokens).unwrap();
        assert_eq!(w.state.sessions.bound(7), Some((other.as_str(), tokens)), "the session moved with it");
        // The next request with that prompt goes where it was served, not to the primary.
        let next = w.plan(&req(&r), None).unwrap();
        assert_eq!(next.dispatch.endpoint, other);
        assert_eq!(next.metrics.matched_blocks, next.metrics.total_blocks);
        assert!(learn_served(&next, &other, &mut w.state, None).is_none());
        // A report about an older turn, once a later one is planned: the later one stands.
        let third = w.pool.endpoints.iter().map(|e| e.address.clone()).find(|a| *a != primary && *a != other).unwrap();
        w.state.sessions.touch(7, &primary, tokens + 100, 10);
        assert!(learn_served(&first, &third, &mut w.state, None).is_some());
        assert_eq!(w.state.sessions.bound(7), Some((primary.as_str(), tokens + 100)));
    }

    #[test]
    fn a_subset_hint_restricts_the_choice_and_an_ineligible_one_is_503() {
        let w = World::new(pool(4));
        let r = request(r#"{"model":"m","prompt":"hello"}"#);
        let only = Subset::new(["10.0.0.2:8000", "10.0.0.3"]);
        for id in 0..20 {
            let p = w.plan(&PlanRequest { id, subset: Some(&only), ..req(&r) }, None).unwrap();
            assert!(p.decision.endpoints.iter().all(|e| only.allows(e)), "{:?}", p.decision.endpoints);
        }
        let none = Subset::new(["10.0.0.9:8000"]);
        let e = w.plan(&PlanRequest { subset: Some(&none), ..req(&r) }, None).unwrap_err();
        assert_eq!((e.status, e.reason), (503, "no_endpoint_in_subset"));
        // An unknown model is still 404, whatever the hint.
        let e = w.plan(&PlanRequest { subset: Some(&none), ..req(&request(r#"{"model":"x","prompt":"a"}"#)) }, None);
        assert_eq!(e.unwrap_err().status, 404);
    }

    #[test]
    fn a_silent_host_makes_the_plan_load_only_and_says_so() {
        let mut w = World::new(pool(2));
        let r = request(r#"{"model":"m","prompt":"hello"}"#);
        w.silent_ms = w.scheduler.config.host_stale_ms + 1;
        assert!(w.plan(&req(&r), None).unwrap().metrics.load_only);
        w.silent_ms = w.scheduler.config.host_stale_ms;
        assert!(!w.plan(&req(&r), None).unwrap().metrics.load_only);
    }

    #[test]
    fn refusals_are_responses_with_a_status() {
        let w = World::new(pool(2));
        let r = request(r#"{"model":"nope","prompt":"hi"}"#);
        let e = w.plan(&req(&r), None).unwrap_err();
        assert_eq!((e.status, e.reason), (404, "unknown_model"));
        let empty = World::new(PoolState::default());
        assert_eq!(empty.plan(&req(&request(r#"{"model":"m","prompt":"hi"}"#)), None).unwrap_err().status, 503);
    }

    #[test]
    fn custom_scorers_get_the_context_and_a_split_gets_its_prefiller() {
        let mut p = pool(3);
        p.endpoints[0].role = Role::Prefill;
        let mut w = World::new(p);
        w.scoring.context = true;
        let r = request(&format!(r#"{{"model":"m","prompt":"{}"}}"#, "x".repeat(8192)));
        let plan = w.plan(&PlanRequest { rollout_session: Some("s"), ..req(&r) }, None).unwrap();
        assert_eq!(plan.headers[1], (PREFILLER_HEADER, "10.0.0.0:8000".to_owned()));
        assert_eq!(plan.metrics.disaggregated.as_deref(), Some("10.0.0.0:8000"));
        let ctx = plan.properties.iter().find(|(k, _)| *k == scoring::CONTEXT_PROPERTY).unwrap();
        let decoded = ScoringContext::decode(&ctx.1).unwrap();
        assert_eq!(decoded.bucket, scoring::bucket_of(b"s"));
        assert_eq!(decoded.candidates.len(), 2, "the two decode candidates");
        assert_eq!(plan.handed_off.as_ref().map(Vec::len), Some(2));
    }

    struct OneHolder(u16);

    impl KvIndexView for OneHolder {
        fn holders(&self, _key: u64) -> Vec<(u16, u8)> {
            vec![(self.0, precise::GPU)]
        }
    }

    #[test]
    fn engine_token_ids_route_precisely_to_what_the_kv_index_holds() {
        let w = World::new(pool(4));
        let r = request(
            r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32]}"#,
        );
        let ids: Vec<u32> = (1..=32).collect();
        let plan = w.plan(&PlanRequest { prompt_ids: Some(&ids), ..req(&r) }, Some(&OneHolder(2))).unwrap();
        assert_eq!(plan.dispatch.endpoint, "10.0.0.2:8000");
        assert_eq!(plan.dispatch.uncached_tokens, 0, "it holds both blocks");
        assert!(plan.metrics.scores.iter().any(|(n, v)| *n == "precise" && *v > 0.99));
    }

    #[test]
    fn binding_a_plan_session_is_found_again() {
        #[derive(Default)]
        struct Mem(std::collections::HashMap<u64, session::Sticky>);
        impl StickyStore for Mem {
            fn load(&mut self, slot: u64) -> Option<session::Sticky> {
                self.0.get(&slot).cloned()
            }
            fn store(&mut self, slot: u64, entry: &session::Sticky) {
                self.0.insert(slot, entry.clone());
            }
        }
        let mut m = Mem::default();
        let b = SessionBinding { key: 9, endpoint: "10.0.0.1:8000".into(), ttl_ms: 100, slots: 64, tokens: 0 };
        bind(&mut m, &b, 1_000);
        assert_eq!(session::lookup(&mut m, 64, 9, 1_050).as_deref(), Some("10.0.0.1:8000"));
        assert_eq!(session::lookup(&mut m, 64, 9, 1_100), None, "expired");
    }
}
