//! The admin HTTP API: health and the current snapshot as JSON.

use std::sync::Arc;

use attache_proto::v1;
use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::watch;

#[derive(Clone)]
pub struct AdminState {
    pub snapshots: watch::Receiver<Arc<v1::Snapshot>>,
}

pub fn router(state: AdminState) -> Router {
    Router::new().route("/healthz", get(|| async { "ok\n" })).route("/v1/snapshot", get(snapshot)).with_state(state)
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
        "endpoints": s.endpoints.iter().map(|e| json!({
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
        })).collect::<Vec<_>>(),
    })
}
