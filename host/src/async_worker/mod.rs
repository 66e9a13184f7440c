//! `attache async`: batch inference into the pool's spare capacity.
//!
//! Jobs wait in Redis ([`queue`]) and go out through the gateway as a sheddable objective
//! only while the host's pool saturation is below a ceiling ([`gate`]), so interactive
//! traffic keeps the headroom and the accelerators' idle time does the batch work. Delivery is
//! at least once by a visibility timeout, results are written once per id, retries back off
//! exponentially, and a job past its deadline is expired, never sent. See `docs/async.md`.

pub mod gate;
pub mod job;
pub mod metrics;
pub mod queue;
pub mod resp;
mod worker;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::routing::get;
use tracing::info;

pub use metrics::Metrics;
pub use worker::Worker;

/// The worker's settings (`attache async --help` documents each flag).
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub redis: SocketAddr,
    /// Key prefix; under Redis Cluster make it a hash tag (`{attache:async}`).
    pub prefix: String,
    /// The gateway's base URL (Envoy with Attaché).
    pub gateway: String,
    /// The host's admin base URL, for `GET /v1/snapshot`.
    pub host_admin: String,
    pub host_token: Option<String>,
    /// Dispatch only while the pool's saturation is below this.
    pub ceiling: f64,
    /// Jobs running at once.
    pub concurrency: usize,
    /// The visibility timeout: a job whose worker stops renewing goes back to pending.
    pub lease: Duration,
    pub max_attempts: u32,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    pub request_timeout: Duration,
    /// `x-llm-d-inference-objective` for jobs whose metadata names none: an objective with a
    /// negative priority, so the gateway sheds it first.
    pub objective: String,
    pub tenant: String,
    pub gate_interval: Duration,
    pub gate_max_age: Duration,
    pub poll_interval: Duration,
    /// How long a graceful stop waits for running jobs before handing them back.
    pub drain: Duration,
    pub admin_listen: Option<SocketAddr>,
}

/// Run the worker (and its metrics listener) until `stop` resolves, then drain.
pub async fn run(cfg: WorkerConfig, stop: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::default());
    if let Some(addr) = cfg.admin_listen {
        let m = metrics.clone();
        let app =
            axum::Router::new().route("/healthz", get(|| async { "ok\n" })).route(
                "/metrics",
                get(move || {
                    let m = m.clone();
                    async move {
                        ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], m.render())
                    }
                }),
            );
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        info!(%addr, "async worker metrics listening");
        tokio::spawn(async move { axum::serve(listener, app).await });
    }
    Worker::new(cfg, metrics)?.run(stop).await
}
