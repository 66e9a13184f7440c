//! The gateway's Responses API state (`docs/responses.md`): the store the scheduler filters
//! capture responses into and resolve `previous_response_id` from, served over gRPC
//! (`attache.v1.ResponsesService`), with its metrics.
//!
//! - [`store`]: the bounded in-memory store.
//! - [`api`]: `GET`, `DELETE` and `input_items` in OpenAI's shapes.
//! - [`redis`]: Redis behind it, written through and read back on a miss.
//! - [`service`]: the gRPC service.

pub mod api;
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
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        Self {
            max_responses: 100_000,
            max_bytes: 256 << 20,
            ttl_ms: 24 * 3_600_000,
            max_resolve_wait_ms: 1_000,
            redis: None,
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
}

impl Responses {
    pub fn new(config: ResponsesConfig) -> Self {
        Self {
            store: Arc::new(Mutex::new(ResponseStore::new(config.limits()))),
            stored: Arc::default(),
            counters: Arc::default(),
            redis: None,
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
        }
        me.spawn_expiry();
        Ok(me)
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
            let done = !matches!(r, store::Resolved::NotFound) || last;
            if done {
                let c = match r {
                    store::Resolved::Found(_) => &self.counters.resolved_found,
                    store::Resolved::NotFound => &self.counters.resolved_not_found,
                    store::Resolved::Evicted => &self.counters.resolved_evicted,
                    store::Resolved::Unavailable => &self.counters.resolved_unavailable,
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
            g(&c.redis_loads),
            g(&c.redis_errors),
            g(&c.resolve_waits),
            g(&c.served),
        );
    }
}
