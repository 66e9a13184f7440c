//! The gateway's Responses API state (`docs/responses.md`): the store the scheduler filters
//! capture responses into and resolve `previous_response_id` from, served over gRPC
//! (`attache.v1.ResponsesService`), with its metrics.
//!
//! - [`store`]: the bounded in-memory store.
//! - [`api`]: `GET`, `DELETE` and `input_items` in OpenAI's shapes.
//! - [`redis`]: Redis behind it, written through and read back on a miss.
//! - [`background`]: `background: true` on the async worker.
//! - [`service`]: the gRPC service.

pub mod api;
pub mod background;
pub mod redis;
pub mod service;
pub mod store;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

pub use store::{Limits, ResponseStore};

/// `responses:` in the host configuration.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ResponsesConfig {
    /// Most responses kept (all tenants).
    pub max_responses: usize,
    /// Most bytes kept (all tenants): the items' and response objects' text, and per-record
    /// overhead. Past either bound, the tenant holding the most bytes loses its least
    /// recently used response.
    pub max_bytes: usize,
    /// A response older than this is gone (its continuation gets 404, "expired or evicted").
    pub ttl_ms: u64,
    /// The longest a resolution waits for a response not stored yet (the previous turn may
    /// have ended on another replica a moment before); the filter's `responses.resolve_wait_ms`
    /// asks for at most this.
    pub max_resolve_wait_ms: u64,
    /// Redis (`host:port`) behind the store: every response is written through, and a chain
    /// this host does not hold (after a restart, or stored by another host replica) is read
    /// back from it. Keys expire with `ttl_ms`. Absent: memory only.
    pub redis: Option<String>,
    /// Background responses (`background: true`), run on the async worker through `redis`.
    pub background: background::BackgroundConfig,
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        Self {
            max_responses: 100_000,
            max_bytes: 256 << 20,
            ttl_ms: 24 * 3_600_000,
            max_resolve_wait_ms: 1_000,
            redis: None,
            background: background::BackgroundConfig::default(),
        }
    }
}

impl ResponsesConfig {
    pub fn limits(&self) -> Limits {
        Limits { max_responses: self.max_responses, max_bytes: self.max_bytes, ttl: Duration::from_millis(self.ttl_ms) }
    }
}

/// Counters of the store's traffic.
#[derive(Default, Debug)]
pub struct Counters {
    pub stored: AtomicU64,
    pub store_refused: AtomicU64,
    pub resolved_found: AtomicU64,
    pub resolved_not_found: AtomicU64,
    pub resolved_evicted: AtomicU64,
    pub resolve_waits: AtomicU64,
    pub served: AtomicU64,
    pub deleted: AtomicU64,
    pub resolved_unavailable: AtomicU64,
    pub resolved_pending: AtomicU64,
    pub redis_loads: AtomicU64,
    pub redis_errors: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// The store, shared by the gRPC service and the metrics page.
#[derive(Clone)]
pub struct Responses {
    store: Arc<Mutex<ResponseStore>>,
    stored: Arc<Notify>,
    pub counters: Arc<Counters>,
    pub config: ResponsesConfig,
    redis: Option<Arc<redis::RedisStore>>,
    background: Option<Arc<background::Background>>,
}

impl Responses {
    pub fn new(config: ResponsesConfig) -> Self {
        Self {
            store: Arc::new(Mutex::new(ResponseStore::new(config.limits()))),
            stored: Arc::default(),
            counters: Arc::default(),
            redis: None,
            background: None,
            config,
        }
    }

    /// The store as configured (with its Redis, resolved now), expiring responses every second.
    pub async fn start(config: ResponsesConfig) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        let mut me = Self::new(config);
        if let Some(r) = me.config.redis.clone() {
            let addr = tokio::net::lookup_host(r.as_str())
                .await
                .with_context(|| format!("resolving responses.redis {r}"))?
                .next()
                .with_context(|| format!("responses.redis {r} resolves to no address"))?;
            me = me.with_redis(addr);
            if me.config.background.enabled {
                me = me.with_background(addr);
            }
        } else if me.config.background.enabled {
            anyhow::bail!("responses.background.enabled needs responses.redis: the async worker's queue is there");
        }
        me.spawn_expiry();
        Ok(me)
    }

    /// Background responses on the async queue in the Redis at `addr`, watched every `poll_ms`.
    pub fn with_background(mut self, addr: std::net::SocketAddr) -> Self {
        let bg = Arc::new(background::Background::new(addr, self.config.background.clone()));
        self.background = Some(bg.clone());
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(bg.config.poll_ms.max(10)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                me.watch(&bg).await;
            }
        });
        self
    }

    /// One pass over the background responses this host submitted: mark the running ones,
    /// write the ended ones' results into them.
    async fn watch(&self, bg: &background::Background) {
        let watched = bg.watched(512);
        if watched.is_empty() {
            return;
        }
        let ids: Vec<&str> = watched.iter().map(|(i, _)| i.as_str()).collect();
        match bg.states(&ids).await {
            Ok(states) => {
                for ((id, tenant), state) in watched.iter().zip(states) {
                    self.apply(bg, tenant, id, state).await;
                }
            }
            Err(e) => self.redis_failed(&e),
        }
    }

    /// Bring a background response up to what its job's state says.
    async fn apply(&self, bg: &background::Background, tenant: &str, id: &str, state: background::JobState) {
        let now = Instant::now();
        let Some(meta) = self.lock().meta(tenant, id, now) else {
            bg.untrack(id); // deleted or evicted meanwhile
            return;
        };
        let (meta, output) = match state {
            background::JobState::Queued => return,
            background::JobState::Running => {
                if self.lock().state(tenant, id, now).is_some_and(|s| s.status == "in_progress") {
                    return;
                }
                (background::running_object(&meta), String::new())
            }
            background::JobState::Ended(result) => background::ended_object(&meta, &result),
        };
        self.write_back(bg, tenant, id, &meta, &output).await;
    }

    /// Replace a background response's object and output, here and in Redis.
    async fn write_back(&self, bg: &background::Background, tenant: &str, id: &str, meta: &str, output: &str) {
        let parts = self.lock().update(tenant, id, meta, output, Instant::now());
        let Some(parts) = parts else {
            bg.untrack(id);
            return;
        };
        let status = serde_json::from_str::<serde_json::Value>(meta)
            .ok()
            .and_then(|m| m["status"].as_str().map(str::to_owned))
            .unwrap_or_default();
        // Counted by whichever pass stops watching it, once (a poll and a GET may both see it end).
        if !matches!(status.as_str(), "queued" | "in_progress") && bg.untrack(id) {
            bg.count_end(&status);
        }
        self.stored.notify_waiters();
        if let Some(redis) = &self.redis {
            if let Err(e) = redis.update(tenant, id, &parts).await {
                self.redis_failed(&e);
            }
        }
    }

    /// A background response this host may not be watching (another replica's, or from before
    /// a restart): read its job's state now.
    async fn refresh(&self, tenant: &str, id: &str) {
        let Some(bg) = self.background.clone() else { return };
        if !self.lock().state(tenant, id, Instant::now()).is_some_and(|s| s.pending()) {
            return;
        }
        match bg.states(&[id]).await {
            Ok(mut states) => {
                if let Some(state) = states.pop() {
                    self.apply(&bg, tenant, id, state).await;
                }
            }
            Err(e) => self.redis_failed(&e),
        }
    }

    /// A `background: true` request: keep it queued and hand it to the async worker. Answers
    /// the queued response object, or why not.
    pub async fn submit(
        &self,
        tenant: &str,
        previous_id: Option<&str>,
        input_items: &str,
        request: &str,
    ) -> api::Answer {
        let Some(bg) = self.background.clone() else {
            return api::error(
                400,
                "invalid_request_error",
                Some("background"),
                "Background responses are not enabled in this gateway (responses.background.enabled).",
            );
        };
        let req: serde_json::Map<String, serde_json::Value> = match serde_json::from_str(request) {
            Ok(r) => r,
            Err(e) => {
                return api::error(
                    400,
                    "invalid_request_error",
                    None,
                    &format!("The request is not a JSON object: {e}"),
                )
            }
        };
        let id = match background::new_id() {
            Ok(id) => id,
            Err(e) => {
                tracing::error!(error = %e, "responses: no randomness for a background id");
                return api::error(500, "server_error", None, "The gateway could not issue a response id.");
            }
        };
        let created = background::unix_now() as u64;
        let queued = background::queued_object(&id, &req, previous_id, created).to_string();
        let new = store::NewResponse { tenant, id: &id, previous_id, input_items, response: &queued };
        if let Err(e) = self.store(&new).await {
            bg.counters.submit_failed.fetch_add(1, Ordering::Relaxed);
            return match e {
                store::StoreError::PreviousGone(p) => api::error(
                    404,
                    "invalid_request_error",
                    Some("previous_response_id"),
                    &format!("previous_response_id '{p}' not found: it expired or was evicted."),
                ),
                e => api::error(400, "invalid_request_error", None, &e.to_string()),
            };
        }
        let job = background::job(&id, tenant, req, &bg.config).to_string();
        if let Err(e) = bg.submit(job.as_bytes()).await {
            self.redis_failed(&e);
            bg.counters.submit_failed.fetch_add(1, Ordering::Relaxed);
            self.lock().delete(tenant, &id);
            if let Some(redis) = &self.redis {
                let _ = redis.delete(tenant, &id).await;
            }
            return api::error(
                503,
                "service_unavailable",
                None,
                "The gateway's background queue cannot be reached; retry shortly.",
            );
        }
        bg.track(&id, tenant);
        bg.counters.submitted.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%id, "responses: background response queued");
        let body = self.lock().response(tenant, &id, Instant::now()).unwrap_or(queued);
        (200, body)
    }

    /// Cancel a background response: `None` when `id` is not one (the store's own answer
    /// applies).
    async fn cancel(&self, tenant: &str, id: &str) -> Option<api::Answer> {
        let bg = self.background.clone()?;
        let state = self.lock().state(tenant, id, Instant::now())?;
        if !state.background {
            return None;
        }
        if state.pending() {
            match bg.cancel(id).await {
                Ok(crate::async_worker::queue::CancelVerdict::Finished) => self.refresh(tenant, id).await,
                Ok(_) => {
                    let meta = self.lock().meta(tenant, id, Instant::now())?;
                    let output = String::new();
                    self.write_back(&bg, tenant, id, &background::cancelled_object(&meta), &output).await;
                }
                Err(e) => {
                    self.redis_failed(&e);
                    return Some(api::error(
                        503,
                        "service_unavailable",
                        None,
                        "The gateway's background queue cannot be reached; retry shortly.",
                    ));
                }
            }
        }
        let body = self.lock().response(tenant, id, Instant::now())?;
        Some((200, body))
    }

    /// The store with Redis at `addr` behind it.
    pub fn with_redis(mut self, addr: std::net::SocketAddr) -> Self {
        self.redis = Some(Arc::new(redis::RedisStore::new(addr, Duration::from_millis(self.config.ttl_ms))));
        self
    }

    fn redis_failed(&self, e: &crate::async_worker::resp::RedisError) {
        bump(&self.counters.redis_errors);
        tracing::warn!(error = %e, "responses: redis");
    }

    /// Read `id`'s chain back from Redis into memory, if this host does not hold it. False: not
    /// there either (or broken by an expired turn).
    async fn load(&self, tenant: &str, id: &str) -> Result<bool, crate::async_worker::resp::RedisError> {
        let Some(r) = &self.redis else { return Ok(false) };
        if self.lock().contains(tenant, id) {
            return Ok(true);
        }
        let redis::Chain::Found(turns) = r.chain(tenant, id).await? else { return Ok(false) };
        bump(&self.counters.redis_loads);
        let now = Instant::now();
        let mut s = self.lock();
        for t in &turns {
            if !s.contains(tenant, &t.id) {
                if let Err(e) = s.insert(tenant, &t.id, t.prev.as_deref(), &t.parts, now) {
                    tracing::warn!(id = %t.id, reason = %e, "responses: a turn read back from redis was not kept");
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    fn lock(&self) -> MutexGuard<'_, ResponseStore> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drop expired responses every second, for as long as the host runs.
    pub fn spawn_expiry(&self) {
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                me.lock().expire(Instant::now());
            }
        });
    }

    pub async fn store(&self, r: &store::NewResponse<'_>) -> Result<(), store::StoreError> {
        if let Some(prev) = r.previous_id {
            if let Err(e) = self.load(r.tenant, prev).await {
                self.redis_failed(&e);
            }
        }
        let res = self.lock().store(r, Instant::now());
        let parts = match res {
            Ok(p) => p,
            Err(e) => {
                bump(&self.counters.store_refused);
                tracing::warn!(id = r.id, reason = %e, "responses: not stored");
                return Err(e);
            }
        };
        bump(&self.counters.stored);
        self.stored.notify_waiters();
        if let Some(redis) = &self.redis {
            if let Err(e) = redis.put(r.tenant, r.id, r.previous_id, &parts).await {
                self.redis_failed(&e);
            }
        }
        Ok(())
    }

    /// Answer an API route (`api::serve`), reading the response back from Redis first if this
    /// host does not hold it.
    pub async fn serve(&self, tenant: &str, method: &str, path: &str) -> api::Answer {
        let id = api::id_of(path);
        if let Some(id) = id {
            if let Err(e) = self.load(tenant, id).await {
                self.redis_failed(&e);
            }
            self.refresh(tenant, id).await;
            if method == "POST" && path.split('?').next().is_some_and(|p| p.ends_with("/cancel")) {
                if let Some(answer) = self.cancel(tenant, id).await {
                    bump(&self.counters.served);
                    return answer;
                }
            }
            if method == "DELETE" {
                // A background response deleted before it ends stops its job too.
                if let Some(bg) = self.background.clone() {
                    if self.lock().state(tenant, id, Instant::now()).is_some_and(|s| s.pending()) {
                        if let Err(e) = bg.cancel(id).await {
                            self.redis_failed(&e);
                        }
                        if bg.untrack(id) {
                            bg.count_end("cancelled");
                        }
                    }
                }
            }
        }
        let answer = api::serve(&mut self.lock(), tenant, method, path, Instant::now());
        bump(&self.counters.served);
        if method == "DELETE" {
            if let (Some(redis), Some(id)) = (&self.redis, id) {
                if let Err(e) = redis.delete(tenant, id).await {
                    self.redis_failed(&e);
                }
            }
            if answer.0 == 200 {
                bump(&self.counters.deleted);
            }
        }
        answer
    }

    /// Resolve `id`, waiting up to `wait` for it to be stored.
    pub async fn resolve(&self, tenant: &str, id: &str, wait: Duration) -> store::Resolved {
        let wait = wait.min(Duration::from_millis(self.config.max_resolve_wait_ms));
        let deadline = tokio::time::Instant::now() + wait;
        let mut waited = false;
        loop {
            let notified = self.stored.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let mut r = self.lock().resolve(tenant, id, Instant::now());
            // Redis is asked on the first pass and at the deadline only: a wake-up is a store on
            // this host, which memory already shows, and asking on every one would cost a round
            // trip per unrelated store for each waiting continuation.
            let last = tokio::time::Instant::now() >= deadline;
            if !matches!(r, store::Resolved::Found(_)) && self.redis.is_some() && (!waited || last) {
                match self.load(tenant, id).await {
                    Ok(true) => r = self.lock().resolve(tenant, id, Instant::now()),
                    Ok(false) => {}
                    Err(e) => {
                        self.redis_failed(&e);
                        r = store::Resolved::Unavailable;
                    }
                }
            }
            if matches!(r, store::Resolved::Found(_)) && self.background.is_some() {
                self.refresh(tenant, id).await;
                if self.lock().state(tenant, id, Instant::now()).is_some_and(|s| s.pending()) {
                    r = store::Resolved::Pending;
                }
            }
            let done = !matches!(r, store::Resolved::NotFound) || last;
            if done {
                let c = match r {
                    store::Resolved::Found(_) => &self.counters.resolved_found,
                    store::Resolved::NotFound => &self.counters.resolved_not_found,
                    store::Resolved::Evicted => &self.counters.resolved_evicted,
                    store::Resolved::Unavailable => &self.counters.resolved_unavailable,
                    store::Resolved::Pending => &self.counters.resolved_pending,
                };
                bump(c);
                if waited {
                    bump(&self.counters.resolve_waits);
                }
                return r;
            }
            waited = true;
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
    }

    /// `attache_responses_*` in the host's exposition.
    pub fn render(&self, out: &mut String) {
        let (len, bytes, tenants, ev) = {
            let s = self.lock();
            (s.len(), s.bytes(), s.tenants(), s.evictions)
        };
        let c = &self.counters;
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let _ = write!(
            out,
            "# HELP attache_responses_stored Responses held in the gateway's store.\n\
             # TYPE attache_responses_stored gauge\nattache_responses_stored {len}\n\
             # HELP attache_responses_bytes Bytes the store holds (items, response objects, overhead).\n\
             # TYPE attache_responses_bytes gauge\nattache_responses_bytes {bytes}\n\
             # HELP attache_responses_tenants Tenants holding responses.\n\
             # TYPE attache_responses_tenants gauge\nattache_responses_tenants {tenants}\n\
             # HELP attache_responses_evictions_total Responses dropped, by reason.\n\
             # TYPE attache_responses_evictions_total counter\n\
             attache_responses_evictions_total{{reason=\"bytes\"}} {}\n\
             attache_responses_evictions_total{{reason=\"count\"}} {}\n\
             attache_responses_evictions_total{{reason=\"expired\"}} {}\n\
             # HELP attache_responses_stores_total Responses the filters sent to keep, by outcome.\n\
             # TYPE attache_responses_stores_total counter\n\
             attache_responses_stores_total{{outcome=\"stored\"}} {}\n\
             attache_responses_stores_total{{outcome=\"refused\"}} {}\n\
             # HELP attache_responses_resolutions_total previous_response_id resolutions asked of the host, by outcome.\n\
             # TYPE attache_responses_resolutions_total counter\n\
             attache_responses_resolutions_total{{outcome=\"found\"}} {}\n\
             attache_responses_resolutions_total{{outcome=\"not_found\"}} {}\n\
             attache_responses_resolutions_total{{outcome=\"evicted\"}} {}\n\
             attache_responses_resolutions_total{{outcome=\"unavailable\"}} {}\n\
             attache_responses_resolutions_total{{outcome=\"pending\"}} {}\n\
             # HELP attache_responses_redis_loads_total Chains read back from Redis (not held by this host).\n\
             # TYPE attache_responses_redis_loads_total counter\nattache_responses_redis_loads_total {}\n\
             # HELP attache_responses_redis_errors_total Redis calls that failed (the store answers from memory).\n\
             # TYPE attache_responses_redis_errors_total counter\nattache_responses_redis_errors_total {}\n\
             # HELP attache_responses_resolve_waits_total Resolutions that waited for the response to be stored.\n\
             # TYPE attache_responses_resolve_waits_total counter\nattache_responses_resolve_waits_total {}\n\
             # HELP attache_responses_api_requests_total GET, DELETE and input_items requests answered.\n\
             # TYPE attache_responses_api_requests_total counter\nattache_responses_api_requests_total {}\n",
            ev.bytes,
            ev.count,
            ev.expired,
            g(&c.stored),
            g(&c.store_refused),
            g(&c.resolved_found),
            g(&c.resolved_not_found),
            g(&c.resolved_evicted),
            g(&c.resolved_unavailable),
            g(&c.resolved_pending),
            g(&c.redis_loads),
            g(&c.redis_errors),
            g(&c.resolve_waits),
            g(&c.served),
        );
        if let Some(bg) = &self.background {
            let b = &bg.counters;
            let _ = write!(
                out,
                "# HELP attache_responses_background_total Background responses, by event.\n\
                 # TYPE attache_responses_background_total counter\n\
                 attache_responses_background_total{{event=\"submitted\"}} {}\n\
                 attache_responses_background_total{{event=\"submit_failed\"}} {}\n\
                 attache_responses_background_total{{event=\"completed\"}} {}\n\
                 attache_responses_background_total{{event=\"failed\"}} {}\n\
                 attache_responses_background_total{{event=\"cancelled\"}} {}\n\
                 # HELP attache_responses_background_watched Background responses this host submitted that have not ended.\n\
                 # TYPE attache_responses_background_watched gauge\nattache_responses_background_watched {}\n",
                g(&b.submitted),
                g(&b.submit_failed),
                g(&b.completed),
                g(&b.failed),
                g(&b.cancelled),
                bg.watching(),
            );
        }
    }
}
