//! The worker loop: take jobs from intake, claim the earliest deadline while the gate is
//! open, dispatch each through the gateway as sheddable work, and record how it ended.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use tokio::sync::{watch, Semaphore};
use tracing::{debug, info, info_span, warn, Instrument};

use super::gate::Gate;
use super::job::{self, Job, JobResult, Outcome, Status};
use super::metrics::Metrics;
use super::queue::{Claimed, Queue, RetryVerdict};
use super::WorkerConfig;

/// How often a running job checks whether it was cancelled.
const CANCEL_POLL: Duration = Duration::from_millis(250);

pub(crate) fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// A number in [0, 1) for jitter: the low bits of the clock, mixed.
fn noise() -> f64 {
    let mut x = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0) as u64;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    (x % 1_000_000) as f64 / 1_000_000.0
}

/// Everything a job task needs, shared.
struct Ctx {
    cfg: WorkerConfig,
    queue: Queue,
    http: reqwest::Client,
    metrics: Arc<Metrics>,
    /// Flips to true when a graceful stop's drain time is up: running jobs go back to pending.
    abandon: watch::Receiver<bool>,
}

pub struct Worker {
    ctx: Arc<Ctx>,
    abandon_tx: watch::Sender<bool>,
    gate: Gate,
    id: String,
    /// Jobs dispatched since the gate's last good reading: they add to its figure.
    since_reading: u32,
    last_reading: Option<Instant>,
    last_upkeep: Option<Instant>,
}

impl Worker {
    pub fn new(cfg: WorkerConfig, metrics: Arc<Metrics>) -> anyhow::Result<Self> {
        let queue = Queue::new(cfg.redis, &cfg.prefix, Duration::from_secs(5));
        let gate = Gate::new(&cfg.host_admin, cfg.host_token.clone(), cfg.ceiling, cfg.gate_max_age);
        let http = reqwest::Client::builder().pool_idle_timeout(Duration::from_secs(30)).build()?;
        let (abandon_tx, abandon) = watch::channel(false);
        let id = format!("{}-{}", std::process::id(), now_ms());
        Ok(Self {
            ctx: Arc::new(Ctx { cfg, queue, http, metrics, abandon }),
            abandon_tx,
            gate,
            id,
            since_reading: 0,
            last_reading: None,
            last_upkeep: None,
        })
    }

    /// Run until `stop` resolves, then drain: stop claiming, let running jobs finish for up to
    /// `drain`, and hand the rest back to pending.
    pub async fn run(mut self, stop: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
        let slots = Arc::new(Semaphore::new(self.ctx.cfg.concurrency));
        let seq = AtomicU32::new(0);
        tokio::pin!(stop);
        info!(worker = %self.id, gateway = %self.ctx.cfg.gateway, ceiling = self.ctx.cfg.ceiling, "async worker started");
        loop {
            self.upkeep().await;
            // Wait for a free slot, keeping up the gate, intake, expiry and metrics meanwhile.
            let permit = loop {
                tokio::select! {
                    biased;
                    _ = &mut stop => break None,
                    p = slots.clone().acquire_owned() => break Some(p?),
                    _ = tokio::time::sleep(self.ctx.cfg.gate_interval) => self.upkeep().await,
                }
            };
            let Some(permit) = permit else { break };
            if let Err(shut) = self.gate.check(self.since_reading) {
                drop(permit);
                self.ctx.metrics.gate_closed(shut.label());
                self.ctx.metrics.gate_open.store(0, Ordering::Relaxed);
                tokio::select! { biased; _ = &mut stop => break, _ = tokio::time::sleep(self.ctx.cfg.gate_interval) => {} }
                continue;
            }
            self.ctx.metrics.gate_open.store(1, Ordering::Relaxed);
            let token = format!("{}:{}", self.id, seq.fetch_add(1, Ordering::Relaxed));
            match self.ctx.queue.claim(self.ctx.cfg.lease, &token).await {
                Ok(report) => {
                    Metrics::count(&self.ctx.metrics.expired, report.expired);
                    Metrics::count(&self.ctx.metrics.lapsed, report.lapsed);
                    if let Some(claimed) = report.job {
                        self.since_reading += 1;
                        let ctx = self.ctx.clone();
                        let span = info_span!("async_job", id = %claimed.id);
                        tokio::spawn(
                            async move {
                                run_job(&ctx, claimed, &token).await;
                                drop(permit);
                            }
                            .instrument(span),
                        );
                        continue;
                    }
                    drop(permit);
                }
                Err(e) => {
                    drop(permit);
                    Metrics::count(&self.ctx.metrics.redis_errors, 1);
                    warn!(error = %e, "claiming a job");
                }
            }
            tokio::select! { biased; _ = &mut stop => break, _ = tokio::time::sleep(self.ctx.cfg.poll_interval) => {} }
        }
        self.drain(&slots).await;
        Ok(())
    }

    /// What is due: a gate reading every `gate_interval`, housekeeping every second.
    async fn upkeep(&mut self) {
        if self.last_reading.is_none_or(|t| t.elapsed() >= self.ctx.cfg.gate_interval) {
            if self.read_gate().await {
                self.since_reading = 0;
            }
            self.last_reading = Some(Instant::now());
        }
        if self.last_upkeep.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            self.housekeeping().await;
            self.last_upkeep = Some(Instant::now());
        }
    }

    async fn drain(&self, slots: &Arc<Semaphore>) {
        let total = u32::try_from(self.ctx.cfg.concurrency).unwrap_or(u32::MAX);
        info!(running = self.ctx.metrics.inflight.load(Ordering::Relaxed), "draining");
        let all = slots.clone().acquire_many_owned(total);
        if tokio::time::timeout(self.ctx.cfg.drain, all).await.is_err() {
            info!("drain time is up: handing running jobs back to pending");
            let _ = self.abandon_tx.send(true);
            // Each abandoned job releases its lease; wait for them to say so.
            let _ = tokio::time::timeout(Duration::from_secs(10), slots.clone().acquire_many_owned(total)).await;
        }
        info!("async worker stopped");
    }

    /// Read the host's saturation; false when the read failed (the old reading ages out).
    async fn read_gate(&mut self) -> bool {
        let m = &self.ctx.metrics;
        match self.gate.refresh().await {
            Ok(s) => {
                m.saturation_permille.store((s * 1000.0) as i64, Ordering::Relaxed);
                true
            }
            Err(e) => {
                Metrics::count(&m.gate_errors, 1);
                if self.gate.saturation().is_none() {
                    m.saturation_permille.store(-1, Ordering::Relaxed);
                    m.gate_open.store(0, Ordering::Relaxed);
                }
                debug!(error = %e, "reading the pool's saturation");
                false
            }
        }
    }

    /// Move submitted bodies into the store; expire, reclaim and promote whatever the gate
    /// says; refresh the depth gauges.
    async fn housekeeping(&self) {
        let m = &self.ctx.metrics;
        loop {
            match self.ctx.queue.intake(500).await {
                Ok(r) => {
                    Metrics::count(&m.dead_lettered, r.dead);
                    Metrics::count(&m.duplicate_submissions, r.duplicates);
                    if r.moved + r.dead + r.duplicates < 500 {
                        break;
                    }
                }
                Err(e) => {
                    Metrics::count(&m.redis_errors, 1);
                    warn!(error = %e, "moving submitted jobs into the store");
                    return;
                }
            }
        }
        match self.ctx.queue.maintain().await {
            Ok((expired, lapsed)) => {
                Metrics::count(&m.expired, expired);
                Metrics::count(&m.lapsed, lapsed);
            }
            Err(_) => Metrics::count(&m.redis_errors, 1),
        }
        match self.ctx.queue.depths().await {
            Ok(d) => m.set_depths(d),
            Err(_) => Metrics::count(&m.redis_errors, 1),
        }
    }
}

fn ended(id: &str, status: Status, code: u16, body: Value, error: Option<String>, attempts: u32) -> JobResult {
    JobResult {
        id: id.to_string(),
        status,
        status_code: code,
        body,
        error,
        attempts,
        finished: now_ms() as f64 / 1000.0,
    }
}

/// How a dispatch ended.
enum Ran {
    /// (status, body, transport error).
    Answered((Option<u16>, Vec<u8>, Option<String>)),
    /// The job was cancelled while it ran.
    Cancelled,
    /// A graceful stop's drain time ran out.
    Abandoned,
}

/// One claimed job, from parse to result or retry.
async fn run_job(ctx: &Ctx, claimed: Claimed, token: &str) {
    ctx.metrics.inflight.fetch_add(1, Ordering::Relaxed);
    run_claimed(ctx, claimed, token).await;
    ctx.metrics.inflight.fetch_sub(1, Ordering::Relaxed);
}

async fn run_claimed(ctx: &Ctx, claimed: Claimed, token: &str) {
    let attempts = claimed.attempts;
    let job = match Job::parse(&claimed.body) {
        Ok(job) => job,
        Err(reason) => {
            warn!(%reason, "dead-lettering a malformed job");
            let r = ended(&claimed.id, Status::DeadLettered, 0, Value::Null, Some(reason), attempts);
            return finish(ctx, &r, None).await;
        }
    };
    let left = job.deadline_ms() - now_ms();
    if left <= 0 {
        let why = Some("deadline passed before dispatch".to_string());
        let r = ended(&job.id, Status::Expired, 0, Value::Null, why, attempts);
        return finish(ctx, &r, job.created).await;
    }
    let timeout = ctx.cfg.request_timeout.min(Duration::from_millis(left.unsigned_abs()));
    let mut abandon = ctx.abandon.clone();
    let answer = tokio::select! {
        a = dispatch(ctx, &job, timeout) => Ran::Answered(a),
        () = renew_lease(ctx, &job.id, token) => {
            // The lease lapsed and the job went back to pending: whoever claims it runs it.
            Metrics::count(&ctx.metrics.leases_lost, 1);
            return info!("lease lost: dispatch cancelled");
        }
        () = watch_cancel(ctx, &job.id) => Ran::Cancelled,
        _ = abandon.wait_for(|a| *a) => Ran::Abandoned,
    };
    let answer = match answer {
        Ran::Answered(a) => Some(a),
        Ran::Cancelled => {
            // Dropping the dispatch closed its connection: the gateway and the engine stop too.
            info!("cancelled while running");
            let why = Some("cancelled while running".to_string());
            return finish(ctx, &ended(&job.id, Status::Cancelled, 0, Value::Null, why, attempts), job.created).await;
        }
        Ran::Abandoned => None,
    };
    match answer {
        Some((code, body, err)) => {
            let backoff_exp = attempts.saturating_add(claimed.sheds);
            settle(ctx, &job, token, (attempts, backoff_exp), code, body, err).await;
        }
        None => match ctx.queue.release(&job.id, token).await {
            Ok(released) => {
                Metrics::count(&ctx.metrics.released, u64::from(released));
                info!(released, "handed back to pending");
            }
            Err(e) => warn!(error = %e, "handing back a job (its lease will lapse instead)"),
        },
    }
}

/// Extend the lease every third of its length, for as long as the job runs (a graceful stop's
/// drain included). Returns only when the lease is lost: it lapsed (Redis was away longer
/// than a lease) and the job went back to pending.
async fn renew_lease(ctx: &Ctx, id: &str, token: &str) {
    let every = ctx.cfg.lease / 3;
    loop {
        tokio::time::sleep(every).await;
        match ctx.queue.renew(id, token, ctx.cfg.lease).await {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                Metrics::count(&ctx.metrics.redis_errors, 1);
                warn!(error = %e, "renewing a lease");
            }
        }
    }
}

/// Returns once the job is asked to stop (`Queue::cancel`).
async fn watch_cancel(ctx: &Ctx, id: &str) {
    loop {
        tokio::time::sleep(CANCEL_POLL).await;
        match ctx.queue.cancel_requested(id).await {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => {
                Metrics::count(&ctx.metrics.redis_errors, 1);
                debug!(error = %e, "checking for a cancel");
            }
        }
    }
}

/// POST the payload through the gateway: (status, body, transport error).
async fn dispatch(ctx: &Ctx, job: &Job, timeout: Duration) -> (Option<u16>, Vec<u8>, Option<String>) {
    Metrics::count(&ctx.metrics.dispatched, 1);
    let url = format!("{}{}", ctx.cfg.gateway.trim_end_matches('/'), job.endpoint());
    let objective = job.metadata.get("objective").unwrap_or(&ctx.cfg.objective);
    let tenant = job.metadata.get("tenant").unwrap_or(&ctx.cfg.tenant);
    let mut req = ctx
        .http
        .post(&url)
        .timeout(timeout)
        .header("content-type", "application/json")
        .header("x-llm-d-inference-objective", objective)
        .header("x-attache-tenant", tenant)
        .header("x-attache-async-job", &job.id);
    for (k, v) in &job.headers {
        req = req.header(k, v);
    }
    let body = match serde_json::to_vec(&job.payload) {
        Ok(b) => b,
        Err(e) => return (None, Vec::new(), Some(e.to_string())),
    };
    match req.body(body).send().await {
        Ok(resp) => {
            let code = resp.status().as_u16();
            match resp.bytes().await {
                Ok(b) => (Some(code), b.to_vec(), None),
                Err(e) => (None, Vec::new(), Some(format!("reading the answer: {e}"))),
            }
        }
        Err(e) if e.is_timeout() => (None, Vec::new(), Some(format!("no answer within {timeout:?}"))),
        Err(e) => (None, Vec::new(), Some(format!("sending: {e}"))),
    }
}

/// Record what one dispatch did: a result, a dead letter, or a retry. `attempts`: the counted
/// attempts before this one, and the backoff exponent so far (attempts and sheds).
async fn settle(
    ctx: &Ctx,
    job: &Job,
    token: &str,
    (attempts, backoff_exp): (u32, u32),
    code: Option<u16>,
    body: Vec<u8>,
    err: Option<String>,
) {
    let status = code.unwrap_or(0);
    match job::classify(code, err.as_deref()) {
        Outcome::Done => {
            let r = ended(&job.id, Status::Completed, status, job::body_value(&body), None, attempts + 1);
            finish(ctx, &r, job.created).await;
        }
        Outcome::Refused(reason) => {
            warn!(%reason, "dead-lettering a job the gateway refused");
            let r = ended(&job.id, Status::DeadLettered, status, job::body_value(&body), Some(reason), attempts + 1);
            finish(ctx, &r, job.created).await;
        }
        Outcome::Shed => {
            let why = format!("gateway shed the request with {status}");
            retry(ctx, job, token, backoff_exp, false, &why).await;
        }
        Outcome::Failed(reason) => retry(ctx, job, token, backoff_exp, true, &reason).await,
    }
}

/// Back the job off: the delay grows with every earlier retry, shed or failed.
async fn retry(ctx: &Ctx, job: &Job, token: &str, backoff_exp: u32, counted: bool, reason: &str) {
    let wait = job::backoff(backoff_exp.saturating_add(1), ctx.cfg.backoff_base, ctx.cfg.backoff_max, noise());
    ctx.metrics.retried(if counted { "failed" } else { "shed" });
    let mut pause = Duration::from_millis(100);
    loop {
        match ctx.queue.retry(&job.id, token, wait, counted, ctx.cfg.max_attempts, reason).await {
            Ok(RetryVerdict::Delayed) => return debug!(%reason, ?wait, "retrying later"),
            Ok(RetryVerdict::DeadLettered) => {
                Metrics::count(&ctx.metrics.dead_lettered, 1);
                return warn!(%reason, "dead-lettered after the last attempt");
            }
            Ok(RetryVerdict::Expired) => return Metrics::count(&ctx.metrics.expired, 1),
            Ok(RetryVerdict::Cancelled) => return debug!("cancelled: not retried"),
            Ok(RetryVerdict::Stale) => {
                Metrics::count(&ctx.metrics.leases_lost, 1);
                return debug!("lease lost: the job is another worker's");
            }
            Err(e) => {
                Metrics::count(&ctx.metrics.redis_errors, 1);
                warn!(error = %e, "scheduling a retry");
                if *ctx.abandon.borrow() {
                    return; // the lease will lapse and the job go back to pending
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Write a result, retrying while Redis is away: a result lost here would make the job run
/// again when its lease lapses, never vanish.
async fn finish(ctx: &Ctx, r: &JobResult, created: Option<f64>) {
    let mut pause = Duration::from_millis(100);
    loop {
        match ctx.queue.finish(r).await {
            Ok(true) => {
                let m = &ctx.metrics;
                Metrics::count(
                    match r.status {
                        Status::Completed => &m.completed,
                        Status::Expired => &m.expired,
                        Status::DeadLettered => &m.dead_lettered,
                        Status::Cancelled => &m.cancelled,
                    },
                    1,
                );
                if let Some(c) = created {
                    m.residence(r.finished - c);
                }
                return;
            }
            Ok(false) => return Metrics::count(&ctx.metrics.duplicates, 1),
            Err(e) => {
                Metrics::count(&ctx.metrics.redis_errors, 1);
                warn!(error = %e, "writing a result");
                if *ctx.abandon.borrow() {
                    return;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
}
