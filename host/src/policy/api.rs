//! The policy admin API (HTTP + JSON, bearer token), mounted on the host's admin listener:
//!
//! | method | path | does |
//! |---|---|---|
//! | POST | `/v1/policy/modules?slot=S&version=V[&params=JSON]` | upload a signed module (body: the bytes) |
//! | GET | `/v1/policy/modules[?slot=S]` | upload history |
//! | POST | `/v1/policy/slots/{slot}/configs` `{"version": V, "from": sha256-or-version, "params": {...}}` | a configuration-only version of a stored module |
//! | POST | `/v1/policy/slots/{slot}/rollout` `{"module": sha256-or-version, "canary_percent": 5, "weight": 1}` | start a canary |
//! | POST | `/v1/policy/slots/{slot}/shadow` `{"module": sha256-or-version, "weight": 1}` | run a candidate in shadow (`rollback` ends it) |
//! | POST | `/v1/policy/slots/{slot}/promote` `{"reason": "..."}` | canary → stable |
//! | POST | `/v1/policy/slots/{slot}/rollback` `{"reason": "..."}` | drop the canary, or the stable back one version |
//! | GET | `/v1/policy/decisions` | the decision log (length-delimited `attache.v1.Decision`s, oldest first) |
//! | GET | `/v1/policy/status` | versions, counters, controller verdicts, Envoy ACK/NACK, transitions |
//!
//! Errors are `{"error": code, "message": text}` with codes `unauthorized`, `bad_request`,
//! `unsigned`, `tampered`, `untrusted_key`, `malformed_module`, `admission_refused`,
//! `not_found`, `conflict`, `shadow_gate` (409: a canary the shadow gate refused).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use super::service::{ApiError, PolicyService};

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(json!({"error": self.code, "message": self.message}))).into_response()
    }
}

async fn auth(State(svc): State<Arc<PolicyService>>, req: Request, next: Next) -> Response {
    let header = req.headers().get("authorization").and_then(|v| v.to_str().ok());
    if !svc.authorized(header) {
        return crate::admin_auth::unauthorized();
    }
    next.run(req).await
}

pub fn router(svc: Arc<PolicyService>) -> Router {
    Router::new()
        .route("/v1/policy/modules", post(upload).get(modules))
        .route("/v1/policy/slots/{slot}/configs", post(configure))
        .route("/v1/policy/slots/{slot}/rollout", post(rollout))
        .route("/v1/policy/slots/{slot}/shadow", post(shadow))
        .route("/v1/policy/slots/{slot}/promote", post(promote))
        .route("/v1/policy/slots/{slot}/rollback", post(rollback))
        .route("/v1/policy/status", get(status))
        .route("/v1/policy/decisions", get(decisions))
        .layer(DefaultBodyLimit::max(32 << 20))
        .route_layer(axum::middleware::from_fn_with_state(svc.clone(), auth))
        .with_state(svc)
}

#[derive(Deserialize)]
struct UploadQuery {
    slot: String,
    version: String,
    #[serde(default)]
    params: Option<String>,
}

async fn upload(
    State(svc): State<Arc<PolicyService>>,
    Query(q): Query<UploadQuery>,
    body: Bytes,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let params: Value = match q.params.as_deref() {
        None | Some("") => Value::Null,
        Some(p) => serde_json::from_str(p).map_err(|e| ApiError {
            status: 400,
            code: "bad_request",
            message: format!("params is not JSON: {e}"),
        })?,
    };
    // Verification and admission are CPU work (wasmtime compiles the module).
    let blocking = svc.clone();
    let record = tokio::task::spawn_blocking(move || blocking.upload(&q.slot, &q.version, &params, &body))
        .await
        .map_err(|e| ApiError { status: 500, code: "internal", message: e.to_string() })??;
    svc.share_module(&record).await?;
    Ok((StatusCode::CREATED, Json(json!(record))))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigureBody {
    version: String,
    from: String,
    params: Value,
}

async fn configure(
    State(svc): State<Arc<PolicyService>>,
    Path(slot): Path<String>,
    body: Bytes,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let b: ConfigureBody = serde_json::from_slice(&body).map_err(|e| ApiError {
        status: 400,
        code: "bad_request",
        message: e.to_string(),
    })?;
    // Admission runs the module again, under the new configuration.
    let blocking = svc.clone();
    let record = tokio::task::spawn_blocking(move || blocking.configure(&slot, &b.version, &b.from, &b.params))
        .await
        .map_err(|e| ApiError { status: 500, code: "internal", message: e.to_string() })??;
    svc.share_module(&record).await?;
    Ok((StatusCode::CREATED, Json(json!(record))))
}

#[derive(Deserialize)]
struct ModulesQuery {
    slot: Option<String>,
}

async fn modules(
    State(svc): State<Arc<PolicyService>>,
    Query(q): Query<ModulesQuery>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!({"modules": svc.modules(q.slot.as_deref())?})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RolloutBody {
    module: String,
    canary_percent: f64,
    #[serde(default = "one")]
    weight: f64,
}

fn one() -> f64 {
    1.0
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ReasonBody {
    #[serde(default)]
    reason: String,
}

fn json_body<T: serde::de::DeserializeOwned + Default>(body: &Bytes) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| ApiError { status: 400, code: "bad_request", message: e.to_string() })
}

async fn rollout(
    State(svc): State<Arc<PolicyService>>,
    Path(slot): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let b: RolloutBody = serde_json::from_slice(&body).map_err(|e| ApiError {
        status: 400,
        code: "bad_request",
        message: e.to_string(),
    })?;
    let t = svc.rollout(&slot, &b.module, b.canary_percent, b.weight).await?;
    Ok(Json(json!({"transition": t})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ShadowBody {
    module: String,
    #[serde(default = "one")]
    weight: f64,
}

async fn shadow(
    State(svc): State<Arc<PolicyService>>,
    Path(slot): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let b: ShadowBody = serde_json::from_slice(&body).map_err(|e| ApiError {
        status: 400,
        code: "bad_request",
        message: e.to_string(),
    })?;
    let t = svc.shadow(&slot, &b.module, b.weight).await?;
    Ok(Json(json!({"transition": t})))
}

/// The reason an operator gave, or a default.
fn reason(body: &Bytes) -> Result<String, ApiError> {
    let b: ReasonBody = json_body(body)?;
    Ok(if b.reason.is_empty() { "operator request".to_owned() } else { b.reason })
}

async fn promote(
    State(svc): State<Arc<PolicyService>>,
    Path(slot): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let t = svc.promote(&slot, "operator", &reason(&body)?).await?;
    Ok(Json(json!({"transition": t})))
}

async fn rollback(
    State(svc): State<Arc<PolicyService>>,
    Path(slot): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let t = svc.rollback(&slot, "operator", &reason(&body)?).await?;
    Ok(Json(json!({"transition": t})))
}

async fn decisions(State(svc): State<Arc<PolicyService>>) -> Result<Response, ApiError> {
    let log = svc.decisions.clone();
    let bytes = tokio::task::spawn_blocking(move || log.bytes())
        .await
        .map_err(|e| ApiError { status: 500, code: "internal", message: e.to_string() })?
        .map_err(|e| ApiError { status: 500, code: "store_error", message: e.to_string() })?;
    Ok(([(axum::http::header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
}

async fn status(State(svc): State<Arc<PolicyService>>) -> Json<Value> {
    Json(svc.status().await)
}
