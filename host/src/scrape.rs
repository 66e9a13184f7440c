//! Metrics scraping: one task per endpoint, with a timeout. The interval adapts to how fast
//! the engine's metrics change: `scrape_interval` while they change, doubling on each scrape
//! that finds them unchanged up to `scrape_max_interval`, and back to `scrape_interval` on a
//! change, a failure, or a KV event from the engine (which says it is working). An idle pool
//! costs a sixteenth of a busy one at the defaults (50 ms to 800 ms); HTTP connections to the
//! engines are kept alive between scrapes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use attache_kv::engine::Engine;
use attache_kv::prom;
use tokio::sync::RwLock;
use tokio::task::JoinHandle;
use tracing::{debug, warn, Instrument};

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
    let (client, state, base, max, timeout, gone) = (
        scrapers.client.clone(),
        scrapers.state.clone(),
        scrapers.interval,
        scrapers.max_interval,
        scrapers.timeout,
        scrapers.gone.clone(),
    );
    let woken = scrapers.activity.register(&address);
    let span = tracing::info_span!("scrape", endpoint = %address);
    tokio::spawn(
        async move {
            let url = format!("http://{address}{metrics_path}");
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
                let res = scrape_once(&client, &url, engine, timeout).await;
                telemetry.scrape_done(&address, started.elapsed(), res.as_ref().map(|_| ()).map_err(|(_, kind)| *kind));
                let refused = matches!(res, Err((_, ScrapeError::Refused)));
                let res = res.map_err(|(e, _)| e);
                match (&res, was_ok) {
                    (Err(e), true) => warn!(error = %e, "scrape failed"),
                    (Ok(_), false) => debug!("scrape recovered"),
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
                telemetry.scrape_interval(&address, every);
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

/// Why a transport error happened, for the error counter's `reason`.
fn transport_error(e: &reqwest::Error) -> ScrapeError {
    if e.is_timeout() {
        ScrapeError::Timeout
    } else if e.is_connect() {
        ScrapeError::Refused
    } else {
        ScrapeError::Transport
    }
}

async fn scrape_once(
    client: &reqwest::Client,
    url: &str,
    engine: Engine,
    timeout: Duration,
) -> Result<prom::EngineMetrics, (String, ScrapeError)> {
    let resp = client.get(url).timeout(timeout).send().await.map_err(|e| (e.to_string(), transport_error(&e)))?;
    if !resp.status().is_success() {
        return Err((format!("HTTP {}", resp.status()), ScrapeError::Status));
    }
    let body = resp.bytes().await.map_err(|e| (e.to_string(), transport_error(&e)))?;
    // The exposition format is UTF-8: no charset sniffing, and no copy unless it is invalid
    // (checked first with the fast validator: the lossy one walks the page byte by byte).
    let text = match std::str::from_utf8(&body) {
        Ok(t) => std::borrow::Cow::Borrowed(t),
        Err(_) => String::from_utf8_lossy(&body),
    };
    prom::engine_metrics(&text, engine).map_err(|e| (e.to_string(), ScrapeError::Parse))
}

/// The set of running scrapers, kept in step with discovery.
pub struct Scrapers {
    client: reqwest::Client,
    state: Arc<RwLock<PoolState>>,
    interval: Duration,
    max_interval: Duration,
    activity: Activity,
    timeout: Duration,
    gone: Option<EngineGone>,
    /// How often `/v1/models` is read; None: never.
    models_interval: Option<Duration>,
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
            gone: None,
            models_interval: None,
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
