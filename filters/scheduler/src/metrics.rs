//! The filter's own metrics, defined through the proxy-wasm ABI. Envoy shows them in
//! `/stats/prometheus` without the `envoy_` prefix; per-endpoint names carry the endpoint as a
//! name segment that the bootstrap's `stats_tags` turns into an `attache_endpoint` label.

use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// Metric handles of one VM.
#[derive(Default)]
pub struct Metrics {
    scheduled: Option<u32>,
    passthrough: Option<u32>,
    errors: HashMap<&'static str, u32>,
    picks: HashMap<String, u32>,
    score_prefix: Option<u32>,
    score_queue: Option<u32>,
    score_kv: Option<u32>,
    prefix_blocks_matched: Option<u32>,
    prefix_blocks_total: Option<u32>,
    snapshot_version: Option<u32>,
    snapshot_epoch: Option<u32>,
    snapshot_updates: Option<u32>,
    index_entries: Option<u32>,
    tokenizer_mismatch: Option<u32>,
    prompt_untokenized: Option<u32>,
    index_seq: Option<u32>,
    propagation_us: Option<u32>,
    score_precise: Option<u32>,
    /// Per rollout arm (`<slot>.<arm>`): requests, 5xx, traps, latency sum, hit sum.
    rollout: HashMap<String, [Option<u32>; 5]>,
}

/// What one request tells about the scorer arm that acted on it.
pub struct ArmOutcome {
    pub error: bool,
    pub trap: bool,
    /// Request start to response headers, µs.
    pub ttfb_us: u64,
    /// Expected prefix-cache hit of the endpoint picked, 0..1.
    pub prefix_hit: f32,
}

fn define(t: MetricType, name: &str) -> Option<u32> {
    hostcalls::define_metric(t, name).ok()
}

fn inc(id: Option<u32>, by: i64) {
    if let Some(id) = id {
        let _ = hostcalls::increment_metric(id, by);
    }
}

fn sanitize(address: &str) -> String {
    address.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' }).collect()
}

impl Metrics {
    pub fn define() -> Self {
        Self {
            scheduled: define(MetricType::Counter, "attache.requests.scheduled"),
            passthrough: define(MetricType::Counter, "attache.requests.passthrough"),
            score_prefix: define(MetricType::Histogram, "attache.scorer.prefix.score_milli"),
            score_queue: define(MetricType::Histogram, "attache.scorer.queue.score_milli"),
            score_kv: define(MetricType::Histogram, "attache.scorer.kv_cache.score_milli"),
            prefix_blocks_matched: define(MetricType::Counter, "attache.prefix.blocks_matched"),
            prefix_blocks_total: define(MetricType::Counter, "attache.prefix.blocks_total"),
            snapshot_version: define(MetricType::Gauge, "attache.snapshot.version"),
            snapshot_epoch: define(MetricType::Gauge, "attache.snapshot.host_epoch"),
            snapshot_updates: define(MetricType::Counter, "attache.snapshot.updates"),
            propagation_us: define(MetricType::Histogram, "attache.precise.propagation_us"),
            index_entries: define(MetricType::Counter, "attache.precise.index_entries_applied"),
            tokenizer_mismatch: define(MetricType::Counter, "attache.precise.tokenizer_unusable"),
            prompt_untokenized: define(MetricType::Counter, "attache.precise.prompt_untokenized"),
            index_seq: define(MetricType::Gauge, "attache.precise.index_seq"),
            score_precise: define(MetricType::Histogram, "attache.scorer.precise.score_milli"),
            ..Default::default()
        }
    }

    pub fn scheduled(&mut self, endpoint: &str, prefix: f64, queue: f64, kv: f64, matched: usize, total: usize) {
        inc(self.scheduled, 1);
        let id = match self.picks.get(endpoint) {
            Some(id) => Some(*id),
            None => {
                let id = define(MetricType::Counter, &format!("attache.endpoint.{}.picks", sanitize(endpoint)));
                if let Some(id) = id {
                    self.picks.insert(endpoint.to_owned(), id);
                }
                id
            }
        };
        inc(id, 1);
        for (m, v) in [(self.score_prefix, prefix), (self.score_queue, queue), (self.score_kv, kv)] {
            if let Some(m) = m {
                let _ = hostcalls::record_metric(m, (v * 1000.0).round().clamp(0.0, 1000.0) as u64);
            }
        }
        inc(self.prefix_blocks_matched, matched as i64);
        inc(self.prefix_blocks_total, total as i64);
    }

    /// An index delta from the host was applied.
    /// `propagation_us`: engine event time to this delta being applied here (0 = unknown).
    pub fn index_delta(&mut self, entries: usize, seq: u64, propagation_us: Option<u64>) {
        inc(self.index_entries, entries as i64);
        if let (Some(id), Some(us)) = (self.propagation_us, propagation_us) {
            let _ = hostcalls::record_metric(id, us);
        }
        if let Some(id) = self.index_seq {
            let _ = hostcalls::record_metric(id, seq);
        }
    }

    /// The configured tokenizer failed to load or gave other ids than the engine.
    pub fn tokenizer_mismatch(&mut self) {
        inc(self.tokenizer_mismatch, 1);
    }

    /// A prompt precise routing could not tokenize (no tokenizer or template, or the template
    /// failed); the request was routed without precise scores.
    pub fn prompt_untokenized(&mut self) {
        inc(self.prompt_untokenized, 1);
    }

    pub fn precise_score(&mut self, v: f64) {
        if let Some(m) = self.score_precise {
            let _ = hostcalls::record_metric(m, (v * 1000.0).round().clamp(0.0, 1000.0) as u64);
        }
    }

    pub fn passthrough(&mut self) {
        inc(self.passthrough, 1);
    }

    /// Count an error response by reason (`attache.errors.<reason>`), e.g. `malformed_body`.
    pub fn error(&mut self, reason: &'static str) {
        let id = match self.errors.get(reason) {
            Some(id) => Some(*id),
            None => {
                let id = define(MetricType::Counter, &format!("attache.errors.{reason}"));
                if let Some(id) = id {
                    self.errors.insert(reason, id);
                }
                id
            }
        };
        inc(id, 1);
    }

    /// Record a request a rollout arm acted on, as counters the host's rollout controller
    /// reads from Envoy: `attache.rollout.<slot>.<arm>.{requests,errors,traps,ttfb_us,hit_permille}`.
    pub fn rollout(&mut self, slot: &str, arm: &str, o: &ArmOutcome) {
        let key = format!("{}.{arm}", sanitize(slot));
        let ids = match self.rollout.get(&key) {
            Some(ids) => *ids,
            None => {
                let d = |what: &str| define(MetricType::Counter, &format!("attache.rollout.{key}.{what}"));
                let ids = [d("requests"), d("errors"), d("traps"), d("ttfb_us"), d("hit_permille")];
                self.rollout.insert(key, ids);
                ids
            }
        };
        let [requests, errors, traps, ttfb, hit] = ids;
        inc(requests, 1);
        inc(errors, i64::from(o.error));
        inc(traps, i64::from(o.trap));
        inc(ttfb, o.ttfb_us.min(i64::MAX as u64) as i64);
        inc(hit, (f64::from(o.prefix_hit) * 1000.0).round().clamp(0.0, 1000.0) as i64);
    }

    /// A new snapshot arrived (agent) or was loaded (worker).
    pub fn snapshot(&mut self, epoch: u64, version: u64) {
        for (id, v) in [(self.snapshot_version, version), (self.snapshot_epoch, epoch)] {
            if let Some(id) = id {
                let _ = hostcalls::record_metric(id, v);
            }
        }
        inc(self.snapshot_updates, 1);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn endpoint_names_are_stat_safe() {
        assert_eq!(super::sanitize("10.0.0.1:8000"), "10.0.0.1_8000");
        assert_eq!(super::sanitize("[::1]:80"), "___1__80");
    }
}
