//! Route one parsed request: run the policies pipeline on the worker's snapshot, set the
//! destination header, hand the scoring context to custom scorers, and account the pick.
//! Called from the request's own body callback, or from the flow-control queue (with the
//! request made the effective context first).

use attache_policies::index;
use attache_policies::pd::PREFILLER_HEADER;
use attache_policies::precise;
use attache_policies::request::{InferenceRequest, Prompt};
use attache_policies::scoring::{self, ScoringContext};
use attache_policies::session;
use attache_policies::{prefix, Decision, ErrorResponse, PoolState, SchedulingInput};

use crate::host;
use crate::http::{RequestState, DESTINATION_HEADER};
use crate::kv_table;
use crate::root::Worker;
use crate::stages::{self, Stage};
use crate::sticky::SharedSticky;

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

/// Token ids as the engine computes them (policies::prompt_tokens): token-id prompts as
/// given, text completions with BOS, conversations rendered with the model's chat template.
fn prompt_ids(w: &mut Worker, req: &InferenceRequest, id: u32) -> Option<Vec<u32>> {
    let pc = &w.config.scheduler.precise;
    match (pc.enabled, &req.prompt, w.tokenizer.as_mut()) {
        (false, _, _) => None,
        (true, Prompt::Tokens(ids), _) if req.messages.is_empty() => {
            Some(attache_policies::prompt_tokens::given_ids(ids, pc.max_tokens))
        }
        (true, _, Some(t)) => match t.request(req, pc.max_tokens) {
            Ok(ids) => Some(ids),
            Err(e) => {
                host::debug(|| format!("attache[{id}]: no precise scores: {e}"));
                w.metrics.prompt_untokenized();
                None
            }
        },
        (true, _, None) => {
            w.metrics.prompt_untokenized();
            None
        }
    }
}

/// Pick the endpoints for `req` and set the destination header on the effective context.
/// `now_ms` is the caller's clock reading: one per decision, not one per use.
pub fn route(
    w: &mut Worker,
    st: &mut RequestState,
    req: &InferenceRequest,
    body_len: usize,
    now_ms: u64,
) -> Result<(), ErrorResponse> {
    let id = st.id;
    let hashes = prefix::block_hashes(&w.config.scheduler.prefix, &req.model, req.cache_salt.as_deref(), &req.prompt);
    let anchors = prefix::anchor_blocks(&w.config.scheduler.prefix, &req.message_ends);
    stages::mark(Stage::BlockHashes);
    let seed = hashes.first().copied().unwrap_or(u64::from(id));
    let sharing = w.affinity.capacity() > 0;
    let shared = sharing.then(|| w.affinity.matches(&hashes, &anchors));
    stages::mark(Stage::AffinityProbe);
    let ids = prompt_ids(w, req, id);
    let ids_len = ids.as_ref().map(Vec::len);
    let pc = &w.config.scheduler.precise;
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
    let stale_after = w.config.scheduler.host_stale_ms;
    let silent_ms = w.host_silent_ms(now_ms, stale_after);
    let load_only = stale_after > 0 && silent_ms > stale_after;
    if load_only {
        w.metrics.load_only_decision();
        host::debug(|| format!("attache[{id}]: host silent for {silent_ms} ms; load-only scoring"));
    }
    let input = SchedulingInput {
        model: &req.model,
        block_hashes: &hashes,
        anchors: &anchors,
        inflight: &w.inflight,
        inflight_tokens: Some(&w.inflight_tokens),
        seed,
        extra_matches: shared.as_ref(),
        precise: precise_scores.as_ref(),
        prompt_tokens: ids_len.unwrap_or_else(|| req.prompt.approx_tokens()),
        sticky: st.sticky.as_deref(),
        load_only,
    };
    let input_tokens = input.prompt_tokens;
    stages::mark(Stage::PromptTokens);
    let decision = w.scheduler.schedule(&input, &w.cache.pool, &mut w.state).map_err(|e| ErrorResponse::from(&e))?;
    stages::mark(Stage::Pipeline);
    if !host::set_request_header(DESTINATION_HEADER, &decision.header_value()) {
        return Err(ErrorResponse::new(
            500,
            "header_write_failed",
            "InternalServerError",
            None,
            "could not set the destination header",
        ));
    }
    stages::mark(Stage::DestinationHeader);
    if let Some(prefiller) = decision.prefiller() {
        // P/D: the decode endpoint's sidecar runs the prefill there first (llm-d's contract).
        if !host::set_request_header(PREFILLER_HEADER, prefiller) {
            return Err(ErrorResponse::new(
                500,
                "header_write_failed",
                "InternalServerError",
                None,
                "could not set the prefiller header",
            ));
        }
        w.metrics.disaggregated(prefiller);
    }
    if w.config.scoring.context {
        let session = st.session.as_deref().or(req.user.as_deref());
        let bucket = session.map_or_else(|| scoring::bucket_of_seed(seed), |s| scoring::bucket_of(s.as_bytes()));
        let prompt_tokens = ids_len.unwrap_or(body_len / 4).min(u32::MAX as usize) as u32;
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
        if decision.tiers.iter().any(|&t| t != attache_policies::picker::tier::NONE) {
            let _ = host::set_property(scoring::TIERS_PROPERTY, &decision.tiers);
        }
        if host::set_property(scoring::CONTEXT_PROPERTY, &ctx.encode()) {
            st.handed_off = Some(ctx.candidates.into_iter().map(|c| (c.address, c.prefix_hit)).collect());
        }
    }
    // Session affinity: bind the session to its primary (refreshing the TTL), and name the
    // primary in the response's session token.
    let sc = &w.config.sessions;
    if sc.enabled {
        if let Some(primary) = decision.endpoints.first() {
            if let Some(k) = st.session_key {
                session::bind(&mut SharedSticky, sc.slots, k, primary, now_ms, sc.ttl_ms);
            }
            st.session_token = Some(primary.clone());
        }
        if decision.sticky {
            w.metrics.sticky_hit();
        }
    }
    stages::mark(Stage::Handoff);
    w.scheduler.commit(&decision, &hashes, &anchors, &mut w.state);
    stages::mark(Stage::IndexRecord);
    if let (true, Some(primary)) = (sharing, decision.endpoints.first()) {
        // Only what the table does not already prove for this endpoint: into this worker's
        // table now, and into its affinity log from the tick (root.rs), off the request path.
        let known = shared.as_ref().and_then(|m| m.get(primary)).copied().unwrap_or(0);
        let room = crate::affinity::PENDING_MAX.saturating_sub(w.affinity_pending.len());
        for (i, h) in index::shared_entries(&hashes, &anchors, known).into_iter().enumerate() {
            w.affinity.store(h, primary);
            if i < room {
                w.affinity_pending.push((h, primary.clone()));
            }
        }
    }
    stages::mark(Stage::AffinityStore);
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
        let uncached = input_tokens.saturating_sub(best.cached_tokens) as u64;
        *w.inflight_tokens.entry(best.address.clone()).or_insert(0) += uncached;
        st.dispatched = Some(best.address.clone());
        st.dispatched_tokens = uncached;
        host::debug(|| {
            format!(
                "attache[{id}]: model={} -> {} (prefix={:.3} queue={:.3} kv={:.3} total={:.3} matched={}/{} candidates={} snapshot={})",
                req.model,
                decision.header_value(),
                best.prefix,
                best.queue,
                best.kv_cache,
                best.total,
                best.matched_blocks,
                decision.total_blocks,
                decision.candidates,
                w.cache.pool.version
            )
        });
    }
    stages::mark(Stage::Accounting);
    Ok(())
}
