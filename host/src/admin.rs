//! The admin HTTP API: health, the current snapshot, and the precise KV index.

use std::sync::{Arc, Mutex};

use attache_kv::block_key;
use attache_policies::precise;
use attache_proto::v1;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::telemetry::KvCounters;
use attache_kv::index::KvIndex;

#[derive(Clone)]
pub struct AdminState {
    pub snapshots: crate::push::SnapshotRx,
    pub kv_index: Arc<Mutex<KvIndex>>,
    pub kv_counters: Arc<KvCounters>,
    /// The endpoint picker, when it is on: its families join the exposition.
    pub picker: Option<Arc<crate::epp::Picker>>,
    /// The fleet state merged from the Envoys' reports.
    pub fleet: Option<crate::fleet::FleetFeed>,
    /// The pool label and objectives of the `attache_pool_*` signals.
    pub autoscaling: crate::autoscaling::AutoscalingConfig,
    /// The gateway's Responses store, for its `attache_responses_*` families.
    pub responses: Option<crate::responses::Responses>,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(prometheus))
        .route("/v1/snapshot", get(snapshot))
        .route("/v1/kv", get(kv_stats))
        .route("/v1/kv/match", post(kv_match))
        .with_state(state)
}

/// The host's own metrics in Prometheus text format (`crate::telemetry`).
async fn prometheus(State(st): State<AdminState>) -> impl axum::response::IntoResponse {
    let snap = st.snapshots.borrow().clone();
    let ready = snap.endpoints.iter().filter(|e| e.ready).count();
    let blocks = st.kv_index.lock().unwrap_or_else(|p| p.into_inner()).len();
    let gauges = crate::telemetry::Gauges {
        ready_endpoints: ready,
        unready_endpoints: snap.endpoints.len() - ready,
        kv_index_blocks: blocks,
        kv: Some(&st.kv_counters),
    };
    let mut text = crate::telemetry::render(crate::telemetry::metrics(), &gauges);
    if let Some(f) = &st.fleet {
        f.render(&mut text);
    }
    let queued = st.fleet.as_ref().map(|f| f.lock().queued(crate::fleet::now_ms()));
    crate::autoscaling::PoolSignals::compute(&snap, queued).render(&st.autoscaling, &mut text);
    if let Some(r) = &st.responses {
        r.render(&mut text);
    }
    if let Some(p) = &st.picker {
        let (inflight, waiting) = p.load();
        p.metrics.render(&mut text, &inflight, waiting);
    }
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
}

async fn kv_stats(State(st): State<AdminState>) -> Json<Value> {
    let ix = st.kv_index.lock().unwrap_or_else(|p| p.into_inner());
    let entries = ix.entries();
    Json(json!({
        "blocks": ix.len(),
        "entries": entries,
        "heap_bytes": ix.heap_bytes(),
        "index": {
            "stored_blocks": ix.stats.stored_blocks, "removed_blocks": ix.stats.removed_blocks,
            "evicted_blocks": ix.stats.evicted_blocks, "orphan_events": ix.stats.orphan_events,
            "malformed_events": ix.stats.malformed_events,
        },
        "subscribers": st.kv_counters.json(),
    }))
}

#[derive(Deserialize)]
struct MatchRequest {
    model: String,
    token_ids: Vec<u32>,
    block_size: usize,
}

/// Which endpoints hold how much of a token sequence, by tier: what the precise scorer sees.
async fn kv_match(
    State(st): State<AdminState>,
    Json(req): Json<MatchRequest>,
) -> Result<Json<Value>, (StatusCode, String)> {
    if req.block_size == 0 {
        return Err((StatusCode::BAD_REQUEST, "block_size must be positive".into()));
    }
    let keys = block_key::token_block_keys(block_key::chain_seed(&req.model, None), &req.token_ids, req.block_size);
    let ix = st.kv_index.lock().unwrap_or_else(|p| p.into_inner());
    let m = precise::match_prefix(keys.iter().copied(), &precise::TierWeights::default(), |k| ix.holders(k));
    let snap = st.snapshots.borrow().clone();
    let address = |id: u16| snap.endpoints.iter().find(|e| e.id == u32::from(id)).map(|e| e.address.clone());
    let mut eps: Vec<Value> = m
        .iter()
        .map(|(id, pm)| {
            let tiers: Vec<u8> = keys
                .iter()
                .take(pm.blocks)
                .map(|k| ix.holders(*k).iter().find(|h| h.0 == *id).map(|h| h.1).unwrap_or(0))
                .collect();
            json!({"id": id, "address": address(*id), "matched_blocks": pm.blocks, "weighted": pm.weighted, "tiers": tiers})
        })
        .collect();
    eps.sort_by_key(|v| v["id"].as_u64());
    Ok(Json(json!({"blocks": keys.len(), "endpoints": eps})))
}

async fn snapshot(State(st): State<AdminState>) -> Json<Value> {
    let s = st.snapshots.borrow().clone();
    Json(snapshot_json(&s))
}

pub fn snapshot_json(s: &v1::Snapshot) -> Value {
    json!({
        "version": s.version,
        "host_epoch": s.host_epoch,
        "generated_unix_ms": s.generated_unix_ms,
        "saturation": s.saturation,
        "dispatch_cost": s.dispatch_cost,
        "observed_unix_ms": s.observed_unix_ms,
        "objectives": s.objectives,
        "endpoints": s.endpoints.iter().map(|e| json!({
            "id": e.id,
            "address": e.address,
            "models": e.models,
            "role": e.role,
            "engine": e.engine,
            "ready": e.ready,
            "has_metrics": e.has_metrics,
            "waiting": e.waiting,
            "running": e.running,
            "kv_usage": e.kv_usage,
            "metrics_age_ms": e.metrics_age_ms,
            "block_size": e.block_size,
            "num_gpu_blocks": e.num_gpu_blocks,
            "kv_written_tokens": e.kv_written_tokens,
            "prefix_cache_hit_tokens": e.prefix_cache_hit_tokens,
            "ttft_ms": e.ttft_ms,
            "tpot_ms": e.tpot_ms,
            "prefill_tokens_per_s": e.prefill_tokens_per_s,
            "labels": e.labels,
            "lora_running": e.lora_running,
            "lora_waiting": e.lora_waiting,
            "max_lora": e.max_lora,
        })).collect::<Vec<_>>(),
    })
}
