//! `attache async`: the batch worker, until Ctrl-C or SIGTERM, then a graceful drain.

use std::net::SocketAddr;
use std::time::Duration;

use attache_host::async_worker::{self, WorkerConfig};

fn millis(s: &str) -> Result<Duration, String> {
    s.parse::<u64>().map(Duration::from_millis).map_err(|e| format!("{s:?}: {e}"))
}

#[derive(clap::Args)]
pub struct AsyncArgs {
    /// Redis address (`host:port`).
    #[arg(long, env = "ATTACHE_ASYNC_REDIS", default_value = "127.0.0.1:6379")]
    redis: SocketAddr,
    /// Key prefix for the job store (a hash tag such as `{attache:async}` under Redis Cluster).
    #[arg(long, default_value = "attache:async")]
    prefix: String,
    /// The gateway's base URL.
    #[arg(long, env = "ATTACHE_ASYNC_GATEWAY", default_value = "http://127.0.0.1:8080")]
    gateway: String,
    /// The host's admin base URL, read for the pool's saturation.
    #[arg(long, env = "ATTACHE_ASYNC_HOST", default_value = "http://127.0.0.1:9000")]
    host_admin: String,
    /// Bearer token for the host's admin API, if it requires one.
    #[arg(long, env = "ATTACHE_ADMIN_TOKEN")]
    host_token: Option<String>,
    /// Dispatch only while the pool's saturation is below this (the host's figure, 0-1+).
    #[arg(long, default_value_t = 0.8)]
    ceiling: f64,
    /// Jobs running at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Visibility timeout in ms: a job whose worker stops renewing goes back to pending.
    #[arg(long, default_value = "30000", value_parser = millis)]
    lease_ms: Duration,
    /// Attempts (failures, not sheds) before a job is dead-lettered.
    #[arg(long, default_value_t = 5)]
    max_attempts: u32,
    /// First retry delay in ms; it doubles up to `--backoff-max-ms`, with jitter.
    #[arg(long, default_value = "2000", value_parser = millis)]
    backoff_base_ms: Duration,
    #[arg(long, default_value = "60000", value_parser = millis)]
    backoff_max_ms: Duration,
    /// Longest wait for one answer (the job's deadline also bounds it).
    #[arg(long, default_value = "600000", value_parser = millis)]
    request_timeout_ms: Duration,
    /// Objective for jobs whose metadata names none; give it a negative priority.
    #[arg(long, default_value = "batch")]
    objective: String,
    /// Tenant for jobs whose metadata names none.
    #[arg(long, default_value = "batch")]
    tenant: String,
    /// How often to read the pool's saturation, in ms.
    #[arg(long, default_value = "200", value_parser = millis)]
    gate_interval_ms: Duration,
    /// A saturation reading older than this shuts the gate, in ms.
    #[arg(long, default_value = "2000", value_parser = millis)]
    gate_max_age_ms: Duration,
    /// Pause when nothing is pending, in ms.
    #[arg(long, default_value = "100", value_parser = millis)]
    poll_interval_ms: Duration,
    /// How long a graceful stop waits for running jobs, in ms, before handing them back.
    #[arg(long, default_value = "30000", value_parser = millis)]
    drain_ms: Duration,
    /// Metrics listener (`/metrics`, `/healthz`).
    #[arg(long, default_value = "127.0.0.1:9400")]
    admin_listen: Option<SocketAddr>,
}

pub async fn run(a: AsyncArgs) -> anyhow::Result<()> {
    let sane = a.ceiling > 0.0 && a.ceiling.is_finite() && (1..=4096).contains(&a.concurrency) && a.max_attempts > 0;
    if !sane {
        anyhow::bail!("--ceiling must be positive, --concurrency 1 to 4096, --max-attempts at least 1");
    }
    let floor = Duration::from_millis(10);
    if a.gate_interval_ms < floor || a.poll_interval_ms < floor || a.lease_ms < Duration::from_millis(300) {
        anyhow::bail!("--gate-interval-ms and --poll-interval-ms must be at least 10, --lease-ms at least 300");
    }
    let cfg = WorkerConfig {
        redis: a.redis,
        prefix: a.prefix,
        gateway: a.gateway,
        host_admin: a.host_admin,
        host_token: a.host_token,
        ceiling: a.ceiling,
        concurrency: a.concurrency,
        lease: a.lease_ms,
        max_attempts: a.max_attempts,
        backoff_base: a.backoff_base_ms,
        backoff_max: a.backoff_max_ms,
        request_timeout: a.request_timeout_ms,
        objective: a.objective,
        tenant: a.tenant,
        gate_interval: a.gate_interval_ms,
        gate_max_age: a.gate_max_age_ms,
        poll_interval: a.poll_interval_ms,
        drain: a.drain_ms,
        admin_listen: a.admin_listen,
    };
    let stop = super::shutdown_signal()?;
    async_worker::run(cfg, stop).await
}
