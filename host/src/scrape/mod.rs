//! Metrics scraping: one task per endpoint, with a timeout. The interval adapts to how fast
//! the engine's metrics change: `scrape_interval` while they change, doubling on each scrape
//! that finds them unchanged up to `scrape_max_interval`, and back to `scrape_interval` on a
//! change, a failure, or a KV event from the engine (which says it is working). An idle pool
//! costs a sixteenth of a busy one at the defaults (50 ms to 800 ms).
//!
//! Each scraper owns its engine's keep-alive connection ([`conn`]) and asks vLLM for only the
//! samples the scheduler reads (`Engine::filtered_metrics_path`), so following a busy engine
//! costs a few microseconds of host CPU per scrape.

use std::sync::Arc;
use std::time::{Duration, Instant};

use attache_kv::engine::Engine;
use attache_kv::prom;
use tokio::sync::RwLock;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn, Instrument};

mod conn;

use conn::{FetchError, MetricsConn};

use crate::activity::Activity;
use crate::kv_subscribe::EngineGone;
use crate::state::{Change, PoolState};
use crate::telemetry::ScrapeError;

/// The next interval after a scrape: back to `base` when the load gauges changed or the scrape
/// failed; kept when only counters moved (a request finished); else doubled up to `max`.
fn next_interval(now: Duration, base: Duration, max: Duration, change: Change) -> Duration {
    match change {
        Change::Load => base,
        Change::Counters => now,
        Change::Nothing => now.saturating_mul(2).clamp(base, max.max(base)),
    }
}

/// Scrape `address` forever, writing results into `state`.
fn spawn(scrapers: &Scrapers, address: String, metrics_path: String, engine: Engine) -> JoinHandle<()> {
    let (state, base, max, timeout, gone) =
        (scrapers.state.clone(), scrapers.interval, scrapers.max_interval, scrapers.timeout, scrapers.gone.clone());
    let mut target = Target::new(&address, &metrics_path, engine, scrapers.metric_filter);
    let woken = scrapers.activity.register(&address);
    // Debug level: an enabled span costs every poll of every scraper; the events carry the
    // endpoint themselves.
    let span = tracing::debug_span!("scrape", endpoint = %address);
    scrapers.runtime.spawn(
        async move {
            let mut every = base;
            let mut was_ok = true;
            let telemetry = crate::telemetry::metrics();
            // Spread the first scrapes of a large pool over one interval (at most 100 ms, so
            // a long interval does not delay the first).
            let jitter =
                base.min(Duration::from_millis(100)).mul_f64(f64::from(spread(&address)) / f64::from(u16::MAX));
            tokio::time::sleep(jitter).await;
            loop {
                let started = Instant::now();
                let res = target.scrape(timeout).await;
                let took = started.elapsed();
                let outcome = res.as_ref().map(|_| ()).map_err(|(_, kind)| *kind);
                let refused = matches!(res, Err((_, ScrapeError::Refused)));
                let res = res.map_err(|(e, _)| e);
                match (&res, was_ok) {
                    (Err(e), true) => warn!(endpoint = %address, error = %e, "scrape failed"),
                    (Ok(_), false) => debug!(endpoint = %address, "scrape recovered"),
                    _ => {}
                }
                was_ok = res.is_ok();
                let failed = res.is_err();
                let mut st = state.write().await;
                let change = st.record_scrape(&address, res, Instant::now());
                every = next_interval(every, base, max, if failed { Change::Load } else { change });
                st.set_scrape_interval(&address, every);
                if refused {
                    // Nothing listens: the engine is gone, not slow. Unready at once, so new
                    // requests avoid it from the next snapshot (one scrape interval), and what
                    // its KV cache held is forgotten.
                    if st.mark_down(&address) {
                        if let Some(g) = &gone {
                            g.clear(st.id_of(&address));
                        }
                    }
                }
                drop(st);
                telemetry.scrape_done(&address, took, outcome, every);
                let next = (started + every).saturating_duration_since(Instant::now());
                tokio::select! {
                    () = tokio::time::sleep(next) => {}
                    () = woken.notified(), if every > base => { every = base; }
                }
            }
        }
        .instrument(span),
    )
}

/// One engine's metrics page as its scraper reads it: the keep-alive connection, the requests
/// built once, and what the engine's filtered page leaves out once known.
struct Target {
    address: String,
    engine: Engine,
    conn: MetricsConn,
    /// `GET metrics_path`: the whole page.
    whole: Vec<u8>,
    /// The `name[]`-filtered requests, with and without the cache geometry; None once the
    /// engine has shown it cannot filter (or for engines that never can).
    filtered: Option<(Vec<u8>, Vec<u8>)>,
    /// The cache geometry (block size, GPU blocks) and the connection it was read on: it
    /// cannot change while the engine process lives, and a restarted engine is a new
    /// connection, so later scrapes on that connection do not ask for it.
    geometry: Option<(u64, Option<u32>, Option<u64>)>,
}

impl Target {
    fn new(address: &str, metrics_path: &str, engine: Engine, filter: bool) -> Self {
        let filtered = |geometry| engine.filtered_metrics_path(metrics_path, geometry).filter(|_| filter);
        let filtered = filtered(true).zip(filtered(false));
        Self {
            address: address.to_owned(),
            engine,
            conn: MetricsConn::new(address),
            whole: conn::request(address, metrics_path),
            filtered: filtered.map(|(full, lean)| (conn::request(address, &full), conn::request(address, &lean))),
            geometry: None,
        }
    }

    /// One scrape: the filtered page where the engine filters (without the geometry when the
    /// open connection already gave it), else the whole page.
    async fn scrape(&mut self, timeout: Duration) -> Result<prom::EngineMetrics, (String, ScrapeError)> {
        let Some((full, lean)) = &self.filtered else {
            return scrape_once(&mut self.conn, &self.whole, self.engine, timeout).await;
        };
        let open = self.conn.connection();
        let known = self.geometry.filter(|(on, ..)| open == Some(*on));
        let res = scrape_once(&mut self.conn, if known.is_some() { lean } else { full }, self.engine, timeout).await;
        match (res, known) {
            // Read on the connection the geometry came from: the same engine process.
            (Ok(mut m), Some((on, block_size, blocks))) if self.conn.connection() == Some(on) => {
                (m.block_size, m.num_gpu_blocks) = (block_size, blocks);
                Ok(m)
            }
            // Redialed in between: perhaps a restarted engine, so ask again with the geometry.
            (Ok(_), Some(_)) => {
                self.geometry = None;
                Box::pin(self.scrape(timeout)).await
            }
            (Ok(m), None) => {
                self.geometry = self.conn.connection().map(|on| (on, m.block_size, m.num_gpu_blocks));
                Ok(m)
            }
            (Err((e, why @ (ScrapeError::Rejected | ScrapeError::Parse))), _) => {
                // The engine does not filter (multi-process vLLM answers an empty page, a
                // server without the route a 4xx): its whole page from now on, read at once.
                // A 5xx or a transport error is the engine's trouble, not the filter's: it
                // fails this scrape and the next one asks for the filtered page again.
                info!(endpoint = %self.address, error = %e, "metric-name filter not honoured; scraping the whole page");
                crate::telemetry::metrics().scrape_filter_fallback(why);
                self.filtered = None;
                scrape_once(&mut self.conn, &self.whole, self.engine, timeout).await
            }
            (Err(e), _) => Err(e),
        }
    }
}

/// Read `address`'s `GET /v1/models` every `every`, in its own task so a slow answer never
/// delays the metrics scrape, writing the list into `state`. A failure keeps the last list,
/// and is counted, and logged when it starts.
fn spawn_models(scrapers: &Scrapers, address: String, every: Duration) -> JoinHandle<()> {
    let (client, state, timeout) = (scrapers.client.clone(), scrapers.state.clone(), scrapers.timeout);
    let span = tracing::info_span!("models", endpoint = %address);
    tokio::spawn(
        async move {
            let url = format!("http://{address}/v1/models");
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut was_ok = true;
            let telemetry = crate::telemetry::metrics();
            loop {
                tick.tick().await;
                let body = async {
                    let resp = client.get(&url).timeout(timeout).send().await.map_err(|e| e.to_string())?;
                    if !resp.status().is_success() {
                        return Err(format!("HTTP {}", resp.status()));
                    }
                    resp.text().await.map_err(|e| e.to_string())
                };
                match body.await.and_then(|b| crate::model_list::parse(&b).map_err(|e| e.to_string())) {
                    Ok(listed) => {
                        telemetry.model_list_read("ok");
                        if !was_ok {
                            debug!("model list readable again");
                        }
                        was_ok = true;
                        state.write().await.record_models(&address, listed);
                    }
                    Err(e) => {
                        telemetry.model_list_read("error");
                        if was_ok {
                            warn!(error = %e, "cannot read GET /v1/models; LoRA adapters it loads stay unknown");
                        }
                        was_ok = false;
                    }
                }
            }
        }
        .instrument(span),
    )
}

/// A stable 16-bit spread of `address`, for start-up jitter.
fn spread(address: &str) -> u16 {
    let h = address.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
    (h >> 16) as u16
}

/// The error counter's `reason` for a failed `GET`.
fn fetch_error(e: &FetchError) -> ScrapeError {
    match e {
        FetchError::Timeout(_) => ScrapeError::Timeout,
        FetchError::Connect(c) if c.kind() == std::io::ErrorKind::ConnectionRefused => ScrapeError::Refused,
        FetchError::Status(code) if (400..500).contains(code) => ScrapeError::Rejected,
        FetchError::Status(_) => ScrapeError::Status,
        FetchError::Connect(_) | FetchError::Io(_) | FetchError::Protocol(_) => ScrapeError::Transport,
    }
}

async fn scrape_once(
    conn: &mut MetricsConn,
    request: &[u8],
    engine: Engine,
    timeout: Duration,
) -> Result<prom::EngineMetrics, (String, ScrapeError)> {
    let body = conn.get(request, timeout).await.map_err(|e| (e.to_string(), fetch_error(&e)))?;
    // The exposition format is UTF-8: no charset sniffing, and no copy unless it is invalid
    // (checked first with the fast validator: the lossy one walks the page byte by byte).
    let text = match std::str::from_utf8(body) {
        Ok(t) => std::borrow::Cow::Borrowed(t),
        Err(_) => String::from_utf8_lossy(body),
    };
    prom::engine_metrics(&text, engine).map_err(|e| (e.to_string(), ScrapeError::Parse))
}

/// The scrapers' runtime: one thread, its own event loop and timers, started on first use.
///
/// A scrape is a timer, a write and a read, a few microseconds of work each; on the shared
/// multi-thread runtime a thousand of them a second kept waking idle workers and moving tasks
/// between threads, which cost more than the scrapes (futex wakes and context switches were a
/// fifth of the host's CPU following 1,000 busy engines). One thread does 40,000 scrapes a
/// second. Falls back to the caller's runtime if the thread cannot start.
fn scrape_runtime() -> tokio::runtime::Handle {
    static RUNTIME: std::sync::OnceLock<Option<tokio::runtime::Handle>> = std::sync::OnceLock::new();
    let started = RUNTIME.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
        let handle = rt.handle().clone();
        std::thread::Builder::new()
            .name("attache-scrape".into())
            .spawn(move || rt.block_on(std::future::pending::<()>()))
            .ok()?;
        Some(handle)
    });
    started.clone().unwrap_or_else(tokio::runtime::Handle::current)
}

/// The set of running scrapers, kept in step with discovery.
pub struct Scrapers {
    client: reqwest::Client,
    state: Arc<RwLock<PoolState>>,
    interval: Duration,
    max_interval: Duration,
    activity: Activity,
    timeout: Duration,
    /// Ask engines that can filter for only the samples the scheduler reads.
    metric_filter: bool,
    gone: Option<EngineGone>,
    /// How often `/v1/models` is read; None: never.
    models_interval: Option<Duration>,
    /// Where the scrapers run: one thread of their own (see [`scrape_runtime`]).
    runtime: tokio::runtime::Handle,
    /// Per endpoint: its scraper and its model-list reader.
    handles: std::collections::HashMap<String, (JoinHandle<()>, Option<JoinHandle<()>>)>,
}

impl Scrapers {
    /// Scrapers every `interval` (fixed; see [`Scrapers::adaptive`]).
    pub fn new(client: reqwest::Client, state: Arc<RwLock<PoolState>>, interval: Duration, timeout: Duration) -> Self {
        Self {
            client,
            state,
            interval,
            max_interval: interval,
            activity: Activity::default(),
            timeout,
            metric_filter: false,
            gone: None,
            models_interval: None,
            runtime: scrape_runtime(),
            handles: Default::default(),
        }
    }

    /// Let an engine's interval grow up to `max` while its metrics stay the same, and shrink
    /// back when `activity` (the KV-event subscribers) says the engine is working.
    pub fn adaptive(mut self, max: Duration, activity: Activity) -> Self {
        self.max_interval = max.max(self.interval);
        self.activity = activity;
        self
    }

    /// Ask each engine that can filter its `/metrics` for only the samples the scheduler
    /// reads (`Engine::filtered_metrics_path`), falling back to the whole page for good when
    /// an engine refuses it or answers without them.
    pub fn with_metric_filter(mut self, on: bool) -> Self {
        self.metric_filter = on;
        self
    }

    /// Read each engine's `GET /v1/models` this often (LoRA adapters loaded at run time).
    pub fn with_model_lists(mut self, every: Option<Duration>) -> Self {
        self.models_interval = every;
        self
    }

    /// Report engines that refuse connections to the KV-event side, which drops their blocks.
    pub fn with_engine_gone(mut self, gone: EngineGone) -> Self {
        self.gone = Some(gone);
        self
    }

    /// Start scrapers for new endpoints, stop those of endpoints that left, then update the
    /// pool state's endpoint set.
    pub async fn apply(&mut self, endpoints: Vec<crate::endpoints::StaticEndpoint>) {
        let wanted: std::collections::HashSet<&str> = endpoints.iter().map(|e| e.address.as_str()).collect();
        let activity = self.activity.clone();
        self.handles.retain(|addr, (scrape, models)| {
            let keep = wanted.contains(addr.as_str());
            if !keep {
                activity.forget(addr);
                scrape.abort();
                if let Some(m) = models {
                    m.abort();
                }
            }
            keep
        });
        for e in &endpoints {
            if !self.handles.contains_key(&e.address) {
                let h = spawn(self, e.address.clone(), e.metrics_path.clone(), Engine::from_name(&e.engine));
                let m = self.models_interval.map(|every| spawn_models(self, e.address.clone(), every));
                self.handles.insert(e.address.clone(), (h, m));
            }
        }
        self.state.write().await.set_endpoints(endpoints);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::atomic::{AtomicU32, Ordering};

    const PAGE: &str = "# HELP vllm:num_requests_running r\n# TYPE vllm:num_requests_running gauge\n\
        vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
        vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0\n\
        vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n\
        vllm:time_to_first_token_seconds_bucket{le=\"0.1\"} 2.0\n\
        vllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"64\"} 1.0\n";

    /// A vLLM-like `/metrics`: whole at `/metrics`; at `/metrics/` restricted to the query's
    /// `name[]` (one process) or empty (`multiprocess`, as vLLM with several API servers).
    /// Counts the hits on each.
    async fn engine(multiprocess: bool) -> (String, Arc<[AtomicU32; 3]>) {
        use axum::extract::RawQuery;
        let hits: Arc<[AtomicU32; 3]> = Arc::new([AtomicU32::new(0), AtomicU32::new(0), AtomicU32::new(0)]);
        let (whole, filtered) = (hits.clone(), hits.clone());
        let app = axum::Router::new()
            .route(
                "/metrics",
                axum::routing::get(move || async move {
                    whole[0].fetch_add(1, Ordering::Relaxed);
                    PAGE
                }),
            )
            .route(
                "/metrics/",
                axum::routing::get(move |RawQuery(q): RawQuery| async move {
                    let q = q.unwrap_or_default();
                    filtered[if q.contains("cache_config_info") { 1 } else { 2 }].fetch_add(1, Ordering::Relaxed);
                    let names: Vec<&str> = PAGE
                        .lines()
                        .filter_map(|l| l.split(['{', ' ']).next())
                        .filter(|n| q.contains(&n.replace(':', "%3A")))
                        .collect();
                    if multiprocess {
                        String::new()
                    } else {
                        prom::restrict(PAGE, &names)
                    }
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (addr, hits)
    }

    fn page() -> String {
        let g = crate::telemetry::Gauges { ready_endpoints: 0, unready_endpoints: 0, kv_index_blocks: 0, kv: None };
        crate::telemetry::render(crate::telemetry::metrics(), &g)
    }

    async fn scraped(multiprocess: bool) -> (PoolState, [u32; 3]) {
        let (address, hits) = engine(multiprocess).await;
        let st = scrape_for(&address, 300).await;
        (st, [0, 1, 2].map(|i| hits[i].load(Ordering::Relaxed)))
    }

    #[tokio::test]
    async fn vllm_is_scraped_for_the_samples_it_reads_and_whole_when_it_cannot_filter() {
        let before = page();
        let (st, [whole, geometry, lean]) = scraped(false).await;
        assert!(
            whole == 0 && geometry == 1 && lean >= 3,
            "one process filters: {whole} whole, {geometry}+{lean} filtered"
        );
        let snap = st.snapshot(1, 1, Instant::now(), Duration::from_secs(5));
        let e = &snap.endpoints[0];
        assert_eq!((e.running, e.waiting), (3.0, 1.0), "{snap:?}");
        assert_eq!((e.block_size, e.num_gpu_blocks), (32, 64), "the geometry, read once, is kept: {snap:?}");

        let (st, [whole, geometry, lean]) = scraped(true).await;
        assert_eq!((geometry, lean), (1, 0), "an empty filtered page is asked once");
        assert!(whole >= 3, "then the whole page: {whole}");
        let snap = st.snapshot(1, 1, Instant::now(), Duration::from_secs(5));
        assert!(
            snap.endpoints[0].ready && snap.endpoints[0].running == 3.0,
            "no scrape was lost to the fallback: {snap:?}"
        );
        let after = page();
        let count = |page: &str| {
            page.lines()
                .find_map(|l| l.strip_prefix("attache_host_scrape_filter_fallbacks_total{reason=\"incomplete\"} "))
                .map_or(0, |n| n.parse::<u64>().unwrap())
        };
        assert_eq!(count(&after), count(&before) + 1, "{after}");
    }

    /// An engine whose filtered route answers `status` to its first `failures` hits (then
    /// filters), or has no filtered route at all (`None`); counts (whole, filtered) hits.
    async fn refusing_engine(status: Option<(u16, u32)>) -> (String, Arc<[AtomicU32; 2]>) {
        use axum::http::StatusCode;
        let hits: Arc<[AtomicU32; 2]> = Arc::new([AtomicU32::new(0), AtomicU32::new(0)]);
        let (whole, filtered) = (hits.clone(), hits.clone());
        let mut app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || async move {
                whole[0].fetch_add(1, Ordering::Relaxed);
                PAGE
            }),
        );
        if let Some((code, failures)) = status {
            app = app.route(
                "/metrics/",
                axum::routing::get(move || async move {
                    let n = filtered[1].fetch_add(1, Ordering::Relaxed);
                    let code = if n < failures { StatusCode::from_u16(code).unwrap() } else { StatusCode::OK };
                    (code, PAGE)
                }),
            );
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (addr, hits)
    }

    /// Scrape the engine at `address` for `ms` with the metric filter on; the pool it built.
    async fn scrape_for(address: &str, ms: u64) -> PoolState {
        let state = Arc::new(RwLock::new(PoolState::default()));
        let mut s =
            Scrapers::new(reqwest::Client::new(), state.clone(), Duration::from_millis(20), Duration::from_secs(1))
                .with_metric_filter(true);
        let spec: crate::endpoints::StaticEndpoints =
            serde_yaml::from_str(&format!("endpoints: [{{address: '{address}', models: [m]}}]")).unwrap();
        s.apply(spec.endpoints).await;
        tokio::time::sleep(Duration::from_millis(ms)).await;
        let st = std::mem::take(&mut *state.write().await);
        st
    }

    #[tokio::test]
    async fn a_5xx_on_the_filtered_page_fails_the_scrape_and_a_4xx_switches_to_the_whole_page() {
        let fallbacks = |page: &str| {
            page.lines()
                .find_map(|l| l.strip_prefix("attache_host_scrape_filter_fallbacks_total{reason=\"status\"} "))
                .map_or(0, |n| n.parse::<u64>().unwrap())
        };
        // Two 503s (an engine busy restarting): those scrapes fail, then it is filtered again.
        let before = fallbacks(&page());
        let (address, hits) = refusing_engine(Some((503, 2))).await;
        let st = scrape_for(&address, 300).await;
        let (whole, filtered) = (hits[0].load(Ordering::Relaxed), hits[1].load(Ordering::Relaxed));
        assert_eq!(whole, 0, "a transient 5xx does not give up on the filter");
        assert!(filtered >= 4, "two refused, then filtered: {filtered}");
        let snap = st.snapshot(1, 1, Instant::now(), Duration::from_secs(5));
        assert_eq!(snap.endpoints[0].running, 3.0, "{snap:?}");
        // No `/metrics/` route (404): the whole page from then on, counted.
        let (address, hits) = refusing_engine(None).await;
        let st = scrape_for(&address, 300).await;
        assert!(hits[0].load(Ordering::Relaxed) >= 3, "the whole page after the 404");
        let snap = st.snapshot(1, 1, Instant::now(), Duration::from_secs(5));
        assert_eq!(snap.endpoints[0].running, 3.0, "no scrape lost to the fallback: {snap:?}");
        assert!(fallbacks(&page()) > before, "the 404 is counted as a fallback");
    }

    #[test]
    fn the_interval_doubles_while_nothing_changes_and_resets_when_the_load_does() {
        let (base, max) = (Duration::from_millis(50), Duration::from_millis(800));
        let mut every = base;
        let mut seen = Vec::new();
        for _ in 0..6 {
            every = next_interval(every, base, max, Change::Nothing);
            seen.push(every.as_millis());
        }
        assert_eq!(seen, vec![100, 200, 400, 800, 800, 800]);
        assert_eq!(next_interval(every, base, max, Change::Counters), every, "a finished request keeps it");
        assert_eq!(next_interval(every, base, max, Change::Load), base);
        assert_eq!(next_interval(base, base, base, Change::Nothing), base, "max = base is a fixed interval");
    }
}
