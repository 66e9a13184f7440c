//! The gateway's Responses API state (`docs/responses.md`): the store the scheduler filters
//! capture responses into and resolve `previous_response_id` from, served over gRPC
//! (`attache.v1.ResponsesService`), with its metrics.
//!
//! - [`store`]: the bounded in-memory store.
//! - [`api`]: `GET`, `DELETE` and `input_items` in OpenAI's shapes.
//! - [`service`]: the gRPC service.

pub mod api;
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
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        Self { max_responses: 100_000, max_bytes: 256 << 20, ttl_ms: 24 * 3_600_000, max_resolve_wait_ms: 1_000 }
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
}

impl Responses {
    pub fn new(config: ResponsesConfig) -> Self {
        Self {
            store: Arc::new(Mutex::new(ResponseStore::new(config.limits()))),
            stored: Arc::default(),
            counters: Arc::default(),
            config,
        }
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

    pub fn store(&self, r: &store::NewResponse<'_>) -> Result<(), store::StoreError> {
        let res = self.lock().store(r, Instant::now());
        match &res {
            Ok(()) => {
                bump(&self.counters.stored);
                self.stored.notify_waiters();
            }
            Err(e) => {
                bump(&self.counters.store_refused);
                tracing::warn!(id = r.id, reason = %e, "responses: not stored");
            }
        }
        res
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
            let r = self.lock().resolve(tenant, id, Instant::now());
            let done = !matches!(r, store::Resolved::NotFound) || tokio::time::Instant::now() >= deadline;
            if done {
                let c = match r {
                    store::Resolved::Found(_) => &self.counters.resolved_found,
                    store::Resolved::NotFound => &self.counters.resolved_not_found,
                    store::Resolved::Evicted => &self.counters.resolved_evicted,
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
            g(&c.resolve_waits),
            g(&c.served),
        );
    }
}
