//! Metrics scraping: one task per endpoint, every `scrape_interval`, with a timeout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use attache_kv::engine::Engine;
use attache_kv::prom;
use tokio::sync::RwLock;
use tokio::task::JoinHandle;
use tracing::{debug, warn, Instrument};

use crate::kv_subscribe::EngineGone;
use crate::state::PoolState;
use crate::telemetry::ScrapeError;

/// Scrape `address` forever, writing results into `state`.
fn spawn(scrapers: &Scrapers, address: String, metrics_path: String, engine: Engine) -> JoinHandle<()> {
    let (client, state, interval, timeout, gone) =
        (scrapers.client.clone(), scrapers.state.clone(), scrapers.interval, scrapers.timeout, scrapers.gone.clone());
    let models_every = scrapers.models_interval;
    let span = tracing::info_span!("scrape", endpoint = %address);
    tokio::spawn(
        async move {
            let url = format!("http://{address}{metrics_path}");
            let models_url = format!("http://{address}/v1/models");
            let mut models_read: Option<Instant> = None;
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut was_ok = true;
            let telemetry = crate::telemetry::metrics();
            loop {
                tick.tick().await;
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
                // The model list, less often: only a live engine is asked.
                let listed = match models_every {
                    Some(every) if res.is_ok() && models_read.is_none_or(|t| t.elapsed() >= every) => {
                        models_read = Some(Instant::now());
                        read_models(&client, &models_url, timeout).await
                    }
                    _ => None,
                };
                let mut st = state.write().await;
                if let Some(listed) = listed {
                    st.record_models(&address, listed);
                }
                st.record_scrape(&address, res, Instant::now());
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
            }
        }
        .instrument(span),
    )
}

/// The engine's served models from `GET /v1/models`; None (logged and counted) when it cannot
/// be read, so the last list stands.
async fn read_models(client: &reqwest::Client, url: &str, timeout: Duration) -> Option<Vec<String>> {
    let body = async {
        let resp = client.get(url).timeout(timeout).send().await.map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("HTTP {}", resp.status()));
        }
        resp.text().await.map_err(|e| e.to_string())
    };
    let listed = body.await.and_then(|b| crate::model_list::parse(&b).map_err(|e| e.to_string()));
    let telemetry = crate::telemetry::metrics();
    match listed {
        Ok(l) => {
            telemetry.model_list_read("ok");
            Some(l)
        }
        Err(e) => {
            telemetry.model_list_read("error");
            debug!(error = %e, "reading /v1/models");
            None
        }
    }
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
    let text = resp.text().await.map_err(|e| (e.to_string(), transport_error(&e)))?;
    prom::engine_metrics(&text, engine).map_err(|e| (e.to_string(), ScrapeError::Parse))
}

/// The set of running scrapers, kept in step with discovery.
pub struct Scrapers {
    client: reqwest::Client,
    state: Arc<RwLock<PoolState>>,
    interval: Duration,
    timeout: Duration,
    gone: Option<EngineGone>,
    /// How often `/v1/models` is read; None: never.
    models_interval: Option<Duration>,
    handles: std::collections::HashMap<String, JoinHandle<()>>,
}

impl Scrapers {
    pub fn new(client: reqwest::Client, state: Arc<RwLock<PoolState>>, interval: Duration, timeout: Duration) -> Self {
        Self { client, state, interval, timeout, gone: None, models_interval: None, handles: Default::default() }
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
        self.handles.retain(|addr, h| {
            let keep = wanted.contains(addr.as_str());
            if !keep {
                h.abort();
            }
            keep
        });
        for e in &endpoints {
            if !self.handles.contains_key(&e.address) {
                let h = spawn(self, e.address.clone(), e.metrics_path.clone(), Engine::from_name(&e.engine));
                self.handles.insert(e.address.clone(), h);
            }
        }
        self.state.write().await.set_endpoints(endpoints);
    }
}
