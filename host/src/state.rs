//! The host's pool state and the snapshots built from it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use attache_kv::prom::EngineMetrics;
use attache_proto::v1;

use crate::endpoints::StaticEndpoint;

/// `flow:` in the host configuration.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowInputs {
    /// llm-d's utilization detector settings (queue 5, KV 0.8, metrics older than 200 ms
    /// count as saturated).
    pub saturation: attache_policies::flow::DetectorConfig,
    /// InferenceObjective name → priority (higher first; negative is sheddable).
    pub objectives: std::collections::BTreeMap<String, i32>,
}

/// The saturation detector over the snapshot's endpoints (policies::flow::pool_saturation).
fn saturation(endpoints: &[v1::Endpoint], cfg: &attache_policies::flow::DetectorConfig) -> Option<f64> {
    let eps: Vec<attache_policies::Endpoint> = endpoints
        .iter()
        .map(|e| attache_policies::Endpoint {
            ready: e.ready,
            metrics: e.has_metrics.then_some(attache_policies::EndpointMetrics {
                waiting: e.waiting,
                running: e.running,
                kv_usage: e.kv_usage,
                age_ms: e.metrics_age_ms,
                ttft_ms: e.ttft_ms,
                prefill_tokens_per_s: e.prefill_tokens_per_s,
            }),
            ..Default::default()
        })
        .collect();
    attache_policies::flow::pool_saturation(&eps, cfg)
}

/// Weight of the newest TTFT sample in the endpoint's running mean.
const TTFT_EWMA: f64 = 0.3;

/// How far an engine's metrics are behind it (`metrics_age_ms` on the wire): 0 while its
/// scrapes are on schedule (the last good one within two of its intervals), else the age of the
/// last good scrape in whole 100 ms steps, so an endpoint's record changes (and goes out in a
/// snapshot delta) only when its metrics or its lateness do.
fn behind_ms(age: Duration, every: Option<Duration>) -> u64 {
    match every {
        Some(every) if age <= every.saturating_mul(2) => 0,
        _ => (age.as_millis() as u64).div_ceil(100).saturating_mul(100),
    }
}

/// What a scrape changed: the load gauges, readiness (a first or failed scrape) or a sixteenth
/// of the KV cache written, only counters (a request finished, the TTFT mean moved), or
/// nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Load,
    Counters,
    Nothing,
}

/// What the host knows about one endpoint.
#[derive(Debug, Clone)]
pub struct EndpointState {
    pub spec: StaticEndpoint,
    pub metrics: Option<EngineMetrics>,
    pub last_ok: Option<Instant>,
    pub consecutive_failures: u32,
    pub last_error: Option<String>,
    /// Recent mean TTFT (ms): an EWMA over the TTFT histogram's growth between scrapes.
    pub ttft_ms: Option<f64>,
    /// The engine's learned prefill rate ([`prefill_rate_sample`]), an EWMA.
    pub prefill_tokens_per_s: Option<f64>,
    /// Recent time per output token (ms): an EWMA over the inter-token latency histogram.
    pub tpot_ms: Option<f64>,
    /// The last scrape found nothing listening (connection refused): unready until a scrape
    /// succeeds, without waiting for `unready_after`.
    pub down: bool,
    /// What the engine's `GET /v1/models` listed last (base models, then LoRA adapters).
    pub listed_models: Vec<String>,
    /// Its scraper's current interval (adaptive); `None` until it reports one.
    pub scrape_every: Option<Duration>,
}

/// The whole pool, keyed by address.
#[derive(Debug, Default)]
pub struct PoolState {
    pub endpoints: BTreeMap<String, EndpointState>,
    /// Bumped on every change; the publisher compares it to decide whether to publish.
    pub generation: u64,
    /// Stable small ids per address, used by the precise index and its deltas.
    ids: BTreeMap<String, u16>,
    next_id: u16,
    /// Saturation detector settings and the objective table, pushed with each snapshot.
    pub flow: FlowInputs,
}

impl PoolState {
    /// The stable id of `address`, assigned on first sight.
    pub fn id_of(&mut self, address: &str) -> u16 {
        if let Some(id) = self.ids.get(address) {
            return *id;
        }
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        self.ids.insert(address.to_owned(), id);
        id
    }

    /// Replace the endpoint set, keeping metrics of endpoints that stay.
    pub fn set_endpoints(&mut self, specs: Vec<StaticEndpoint>) {
        for s in &specs {
            self.id_of(&s.address);
        }
        let mut next = BTreeMap::new();
        for spec in specs {
            let prev = self.endpoints.remove(&spec.address);
            let st = match prev {
                Some(mut p) => {
                    p.spec = spec.clone();
                    p
                }
                None => EndpointState {
                    spec: spec.clone(),
                    metrics: None,
                    last_ok: None,
                    consecutive_failures: 0,
                    last_error: None,
                    ttft_ms: None,
                    prefill_tokens_per_s: None,
                    tpot_ms: None,
                    down: false,
                    listed_models: Vec::new(),
                    scrape_every: None,
                },
            };
            next.insert(spec.address, st);
        }
        self.endpoints = next;
        self.generation += 1;
    }

    /// Record one scrape of `address`. Returns what changed, for the scraper's interval: a
    /// load gauge, or a sixteenth of the KV cache written ([`kv_turnover`]), is load.
    pub fn record_scrape(&mut self, address: &str, result: Result<EngineMetrics, String>, now: Instant) -> Change {
        let Some(e) = self.endpoints.get_mut(address) else {
            return Change::Nothing;
        };
        let load = match (&result, &e.metrics) {
            (Ok(m), Some(p)) => {
                m.waiting != p.waiting
                    || m.running != p.running
                    || m.kv_usage != p.kv_usage
                    || m.running_loras != p.running_loras
                    || m.waiting_loras != p.waiting_loras
                    || m.models != p.models
                    || kv_turnover(p, m)
            }
            _ => true,
        };
        // Only a change of what the filters see bumps the generation; readiness that changes
        // with time alone (metrics ageing out) is caught by the publisher.
        let changed = match result {
            Ok(m) => {
                if let Some(prev) = &e.metrics {
                    e.ttft_ms = mean_ms(e.ttft_ms, m.ttft_sum - prev.ttft_sum, m.ttft_count - prev.ttft_count);
                    e.tpot_ms = mean_ms(e.tpot_ms, m.itl_sum - prev.itl_sum, m.itl_count - prev.itl_count);
                    if let Some(sample) = prefill_rate_sample(prev, &m) {
                        e.prefill_tokens_per_s = Some(match e.prefill_tokens_per_s {
                            Some(old) => TTFT_EWMA * sample + (1.0 - TTFT_EWMA) * old,
                            None => sample,
                        });
                    }
                }
                let changed = e.metrics.as_ref() != Some(&m) || e.consecutive_failures > 0;
                e.metrics = Some(m);
                e.last_ok = Some(now);
                e.consecutive_failures = 0;
                e.last_error = None;
                let changed = changed || e.down;
                e.down = false;
                changed
            }
            Err(err) => {
                e.consecutive_failures += 1;
                e.last_error = Some(err);
                e.consecutive_failures == 1
            }
        };
        if changed {
            self.generation += 1;
        }
        match (load, changed) {
            (true, _) => Change::Load,
            (false, true) => Change::Counters,
            (false, false) => Change::Nothing,
        }
    }

    /// `address`'s scraper now scrapes it every `every`.
    pub fn set_scrape_interval(&mut self, address: &str, every: Duration) {
        if let Some(e) = self.endpoints.get_mut(address) {
            e.scrape_every = Some(every);
        }
    }

    /// What the engine's `GET /v1/models` listed; a change reaches the next snapshot.
    pub fn record_models(&mut self, address: &str, listed: Vec<String>) {
        if let Some(e) = self.endpoints.get_mut(address) {
            if e.listed_models != listed {
                e.listed_models = listed;
                self.generation += 1;
            }
        }
    }

    /// The endpoint refused a connection: it is down until a scrape succeeds again. Returns
    /// true when it was up until now.
    pub fn mark_down(&mut self, address: &str) -> bool {
        match self.endpoints.get_mut(address) {
            Some(e) if !e.down => {
                e.down = true;
                self.generation += 1;
                true
            }
            _ => false,
        }
    }

    /// Build the wire snapshot. An endpoint whose last good scrape is older than
    /// `unready_after` (or that never answered) is marked not ready.
    pub fn snapshot(&self, version: u64, epoch: u64, now: Instant, unready_after: Duration) -> v1::Snapshot {
        let endpoints: Vec<v1::Endpoint> = self
            .endpoints
            .values()
            .map(|e| {
                let age = e.last_ok.map(|t| now.saturating_duration_since(t));
                let fresh = age.is_some_and(|a| a <= unready_after) && !e.down;
                let m = e.metrics.clone().unwrap_or_default();
                v1::Endpoint {
                    id: u32::from(self.ids.get(&e.spec.address).copied().unwrap_or(u16::MAX)),
                    address: e.spec.address.clone(),
                    // Declared models first, then what the engine's metrics and model list name.
                    models: crate::model_list::merge(&e.spec.models, &m.models, &e.listed_models),
                    role: e.spec.role.clone(),
                    ready: fresh,
                    has_metrics: e.metrics.is_some(),
                    waiting: m.waiting,
                    running: m.running,
                    kv_usage: m.kv_usage,
                    metrics_age_ms: age.map_or(u64::MAX, |a| behind_ms(a, e.scrape_every)),
                    block_size: m.block_size.unwrap_or(0),
                    num_gpu_blocks: m.num_gpu_blocks.unwrap_or(0),
                    engine: e.spec.engine.clone(),
                    ttft_ms: e.ttft_ms.unwrap_or(0.0),
                    prefill_tokens_per_s: e.prefill_tokens_per_s.unwrap_or(0.0),
                    tpot_ms: e.tpot_ms.unwrap_or(0.0),
                    labels: e.spec.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                    lora_running: m.running_loras.clone(),
                    lora_waiting: m.waiting_loras.clone(),
                    max_lora: m.max_lora.unwrap_or(0),
                    kv_written_tokens: m
                        .prefix_cache_reported
                        .then(|| (m.prefix_cache_queries - m.prefix_cache_hits).max(0.0) as u64),
                    prefix_cache_hit_tokens: m.prefix_cache_reported.then(|| m.prefix_cache_hits.max(0.0) as u64),
                }
            })
            .collect();
        let saturation = saturation(&endpoints, &self.flow.saturation);
        let generated_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        let oldest_fresh = endpoints
            .iter()
            .filter(|e| e.has_metrics && e.metrics_age_ms < self.flow.saturation.stale_ms)
            .map(|e| e.metrics_age_ms)
            .max()
            .unwrap_or(0);
        v1::Snapshot {
            version,
            host_epoch: epoch,
            generated_unix_ms,
            dispatch_cost: attache_policies::flow::dispatch_cost(endpoints.len(), &self.flow.saturation),
            observed_unix_ms: generated_unix_ms.saturating_sub(oldest_fresh),
            endpoints,
            saturation,
            objectives: self.flow.objectives.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        }
    }
}

/// Fewest prompt tokens computed between two scrapes for a prefill-rate sample: below this, a
/// request's fixed costs dominate the time.
const PREFILL_SAMPLE_TOKENS: f64 = 1024.0;

/// A histogram's mean over one scrape interval (`sum` and `count` grown by `ds` and `dn`), in
/// ms, folded into the EWMA `old`. No new samples (or a reset counter): `old` unchanged.
fn mean_ms(old: Option<f64>, ds: f64, dn: f64) -> Option<f64> {
    if !(dn > 0.0 && ds >= 0.0) {
        return old;
    }
    let sample = 1000.0 * ds / dn;
    Some(match old {
        Some(old) => TTFT_EWMA * sample + (1.0 - TTFT_EWMA) * old,
        None => sample,
    })
}

/// One sample of the engine's prefill rate between two scrapes: the prompt tokens it computed
/// (its KV write clock, prefix-cache queries − hits) over the time its requests spent before
/// their first token, less the time they queued (TTFT − queue time, both histogram sums). This
/// is the rate the affinity gate and session binding need: uncached tokens ahead of a first
/// token, in seconds. Prefills that share a batch overlap in time, so under concurrency the
/// sample understates the engine's batch throughput; it states what one request sees.
fn prefill_rate_sample(prev: &EngineMetrics, next: &EngineMetrics) -> Option<f64> {
    if !next.prefix_cache_reported {
        return None;
    }
    let written = |m: &EngineMetrics| m.prefix_cache_queries - m.prefix_cache_hits;
    let tokens = written(next) - written(prev);
    let seconds = (next.ttft_sum - prev.ttft_sum) - (next.queue_time_sum - prev.queue_time_sum);
    (tokens >= PREFILL_SAMPLE_TOKENS && seconds > 0.0 && next.ttft_count > prev.ttft_count).then(|| tokens / seconds)
}

/// The engine wrote at least a sixteenth of its KV cache since `prev`: the approximate index's
/// eviction clock (the snapshot's `kv_written_tokens`) moved enough that the next scrape should
/// come soon, as after a load change, rather than after an idle engine's longer interval.
fn kv_turnover(prev: &EngineMetrics, next: &EngineMetrics) -> bool {
    let written = |m: &EngineMetrics| m.prefix_cache_queries - m.prefix_cache_hits;
    let cache = next.num_gpu_blocks.unwrap_or(0) as f64 * f64::from(next.block_size.unwrap_or(0));
    cache > 0.0 && written(next) - written(prev) >= cache / 16.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_rate_is_tokens_computed_over_time_to_first_token_less_queueing() {
        let mut p = PoolState::default();
        p.set_endpoints(vec![spec("1.1.1.1:1")]);
        let t0 = Instant::now();
        let m = |written: f64, ttft: f64, queued: f64, count: f64| EngineMetrics {
            prefix_cache_queries: written + 500.0,
            prefix_cache_hits: 500.0,
            prefix_cache_reported: true,
            ttft_sum: ttft,
            ttft_count: count,
            queue_time_sum: queued,
            ..Default::default()
        };
        let rate = |p: &PoolState| p.snapshot(1, 1, t0, Duration::from_secs(5)).endpoints[0].prefill_tokens_per_s;
        p.record_scrape("1.1.1.1:1", Ok(m(0.0, 0.0, 0.0, 0.0)), t0);
        assert_eq!(rate(&p), 0.0, "unknown until a sample");
        // 16,000 tokens computed; 1.5 s to first tokens of which 0.5 s queued: 16,000/s.
        p.record_scrape("1.1.1.1:1", Ok(m(16_000.0, 1.5, 0.5, 4.0)), t0);
        assert!((rate(&p) - 16_000.0).abs() < 1e-6, "{}", rate(&p));
        // Too few tokens for a sample: the rate stands.
        p.record_scrape("1.1.1.1:1", Ok(m(16_100.0, 2.5, 0.5, 5.0)), t0);
        assert!((rate(&p) - 16_000.0).abs() < 1e-6);
        // A slower interval moves the average by its weight: 8,000/s.
        p.record_scrape("1.1.1.1:1", Ok(m(24_100.0, 3.5, 0.5, 6.0)), t0);
        let want = TTFT_EWMA * 8_000.0 + (1.0 - TTFT_EWMA) * 16_000.0;
        assert!((rate(&p) - want).abs() < 1e-6, "{} vs {want}", rate(&p));
        // No prefix-cache counters (an engine without them): no sample.
        let before = rate(&p);
        let bare = EngineMetrics { prefix_cache_reported: false, ..m(90_000.0, 4.5, 0.5, 7.0) };
        p.record_scrape("1.1.1.1:1", Ok(bare), t0);
        assert!((rate(&p) - before).abs() < 1e-9);
    }

    #[test]
    fn a_sixteenth_of_the_cache_written_counts_as_a_load_change() {
        let mut p = PoolState::default();
        p.set_endpoints(vec![spec("1.1.1.1:1")]);
        let t0 = Instant::now();
        // 64 blocks of 16 tokens: 1,024 tokens, a sixteenth is 64.
        let m = |queries: f64, hits: f64| EngineMetrics {
            block_size: Some(16),
            num_gpu_blocks: Some(64),
            prefix_cache_queries: queries,
            prefix_cache_hits: hits,
            prefix_cache_reported: true,
            ..Default::default()
        };
        assert_eq!(p.record_scrape("1.1.1.1:1", Ok(m(100.0, 0.0)), t0), Change::Load, "the first scrape");
        assert_eq!(p.record_scrape("1.1.1.1:1", Ok(m(200.0, 60.0)), t0), Change::Counters, "40 tokens written");
        assert_eq!(p.record_scrape("1.1.1.1:1", Ok(m(300.0, 60.0)), t0), Change::Load, "100 tokens written");
        let snap = p.snapshot(1, 1, t0, Duration::from_secs(5));
        assert_eq!(snap.endpoints[0].kv_written_tokens, Some(240), "the clock: queries - hits");
        assert_eq!(snap.endpoints[0].prefix_cache_hit_tokens, Some(60), "the hits, for calibration");
        p.record_scrape("1.1.1.1:1", Ok(EngineMetrics { prefix_cache_reported: false, ..m(0.0, 0.0) }), t0);
        let snap = p.snapshot(2, 1, t0, Duration::from_secs(5));
        assert_eq!(snap.endpoints[0].kv_written_tokens, None, "no counters, no clock");
        assert_eq!(snap.endpoints[0].prefix_cache_hit_tokens, None);
    }

    fn spec(a: &str) -> StaticEndpoint {
        StaticEndpoint {
            address: a.into(),
            models: vec!["m".into()],
            role: "both".into(),
            engine: "vllm".into(),
            metrics_path: "/metrics".into(),
            kv_events: None,
            labels: Default::default(),
        }
    }

    #[test]
    fn readiness_follows_scrapes() {
        let mut p = PoolState::default();
        p.set_endpoints(vec![spec("1.1.1.1:1"), spec("1.1.1.2:1")]);
        let t0 = Instant::now();
        p.record_scrape("1.1.1.1:1", Ok(EngineMetrics { waiting: 3.0, ..Default::default() }), t0);
        p.record_scrape("1.1.1.2:1", Err("refused".into()), t0);
        let s = p.snapshot(1, 9, t0, Duration::from_secs(1));
        assert!(s.endpoints[0].ready && s.endpoints[0].has_metrics);
        assert_eq!(s.endpoints[0].waiting, 3.0);
        assert!(!s.endpoints[1].ready && !s.endpoints[1].has_metrics);
        let later = t0 + Duration::from_secs(5);
        assert!(!p.snapshot(2, 9, later, Duration::from_secs(1)).endpoints[0].ready);
        let g = p.generation;
        p.set_endpoints(vec![spec("1.1.1.1:1")]);
        assert!(p.generation > g);
        assert_eq!(p.endpoints.len(), 1);
        assert!(p.endpoints["1.1.1.1:1"].metrics.is_some(), "metrics survive rediscovery");
    }

    #[test]
    fn a_refused_engine_is_unready_at_once_and_back_on_its_next_good_scrape() {
        let mut p = PoolState::default();
        p.set_endpoints(vec![spec("1.1.1.1:1")]);
        let t0 = Instant::now();
        p.record_scrape("1.1.1.1:1", Ok(EngineMetrics::default()), t0);
        let t1 = t0 + Duration::from_millis(50);
        p.record_scrape("1.1.1.1:1", Err("connection refused".into()), t1);
        assert!(p.snapshot(1, 1, t1, Duration::from_secs(2)).endpoints[0].ready, "a failure alone waits");
        let g = p.generation;
        assert!(p.mark_down("1.1.1.1:1"));
        assert!(!p.mark_down("1.1.1.1:1"), "already down");
        assert!(p.generation > g, "the publisher must send the change");
        assert!(!p.snapshot(2, 1, t1, Duration::from_secs(2)).endpoints[0].ready);
        p.record_scrape("1.1.1.1:1", Ok(EngineMetrics::default()), t1 + Duration::from_millis(50));
        assert!(p.snapshot(3, 1, t1, Duration::from_secs(2)).endpoints[0].ready);
    }

    #[test]
    fn snapshots_carry_saturation_and_objectives() {
        let mut p = PoolState::default();
        assert_eq!(p.snapshot(1, 1, Instant::now(), Duration::from_secs(1)).saturation, None, "no endpoints");
        p.flow.objectives.insert("chat".into(), 10);
        p.set_endpoints(vec![spec("1.1.1.1:1"), spec("1.1.1.2:1")]);
        let t = Instant::now();
        p.record_scrape("1.1.1.1:1", Ok(EngineMetrics { waiting: 10.0, kv_usage: 0.4, ..Default::default() }), t);
        p.record_scrape("1.1.1.2:1", Ok(EngineMetrics { waiting: 0.0, kv_usage: 0.4, ..Default::default() }), t);
        let s = p.snapshot(2, 1, t, Duration::from_secs(1));
        // (max(10/5, 0.4/0.8) + max(0, 0.5)) / 2
        assert!((s.saturation.unwrap() - 1.25).abs() < 1e-9, "{:?}", s.saturation);
        assert_eq!(s.objectives.get("chat"), Some(&10));
        // Metrics older than 200 ms count as fully saturated.
        let later = t + Duration::from_millis(500);
        p.record_scrape("1.1.1.2:1", Ok(EngineMetrics::default()), later);
        let s = p.snapshot(3, 1, later, Duration::from_secs(1));
        assert!((s.saturation.unwrap() - 0.5).abs() < 1e-9, "(1.0 stale + 0.0) / 2: {:?}", s.saturation);
    }

    #[test]
    fn ttft_is_a_running_mean_of_histogram_growth() {
        let mut p = PoolState::default();
        p.set_endpoints(vec![spec("1.1.1.1:1")]);
        let t = Instant::now();
        let m = |sum: f64, count: f64| Ok(EngineMetrics { ttft_sum: sum, ttft_count: count, ..Default::default() });
        p.record_scrape("1.1.1.1:1", m(10.0, 100.0), t);
        assert_eq!(p.snapshot(1, 1, t, Duration::from_secs(1)).endpoints[0].ttft_ms, 0.0, "no interval yet");
        p.record_scrape("1.1.1.1:1", m(10.2, 102.0), t);
        assert!((p.endpoints["1.1.1.1:1"].ttft_ms.unwrap() - 100.0).abs() < 1e-9);
        p.record_scrape("1.1.1.1:1", m(10.2, 102.0), t); // idle: unchanged
        p.record_scrape("1.1.1.1:1", m(11.2, 103.0), t); // one request at 1000 ms
        let ttft = p.snapshot(2, 1, t, Duration::from_secs(1)).endpoints[0].ttft_ms;
        assert!((ttft - (0.3 * 1000.0 + 0.7 * 100.0)).abs() < 1e-6, "{ttft}");
    }
}
