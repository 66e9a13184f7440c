//! The filter's own metrics, defined through the proxy-wasm ABI. Envoy shows them in
//! `/stats/prometheus` without the `envoy_` prefix; per-endpoint names carry the endpoint as a
//! name segment that the bootstrap's `stats_tags` turns into an `attache_endpoint` label.

use attache_policies::request::Api;
use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// Metric handles of one VM.
#[derive(Default)]
pub struct Metrics {
    scheduled: Option<u32>,
    passthrough: Option<u32>,
    model_list: Option<u32>,
    /// Requests parsed, per API (`Api::ALL` order).
    apis: [Option<u32>; Api::ALL.len()],
    errors: HashMap<&'static str, u32>,
    picks: HashMap<String, u32>,
    /// `attache.endpoint.other.<what>`, once `picks` is full (no key to build per request).
    other_picks: HashMap<&'static str, u32>,
    /// One histogram per scorer of the decode profile that names one: (metric, id).
    scores: Vec<(&'static str, Option<u32>)>,
    prefix_blocks_matched: Option<u32>,
    prefix_blocks_total: Option<u32>,
    /// `attache.prefix.{prompt,believed,expected}_tokens` (policies::calibration).
    prefix_tokens: [Option<u32>; 3],
    snapshot_version: Option<u32>,
    snapshot_epoch: Option<u32>,
    snapshot_updates: Option<u32>,
    snapshot_deltas: Option<u32>,
    snapshot_gaps: Option<u32>,
    host_silent_ms: Option<u32>,
    load_only: Option<u32>,
    index_entries: Option<u32>,
    tokenizer_mismatch: Option<u32>,
    prompt_untokenized: Option<u32>,
    debug_refused: Option<u32>,
    repicked: Option<u32>,
    /// The tokenization prefix store: hits, misses, bytes skipped, evictions (counters) and
    /// bytes held (a gauge every worker moves by its own change, so Envoy's one stat sums them).
    prefix_store: [Option<u32>; 5],
    /// The store's figures at the last tick.
    prefix_store_seen: attache_policies::token_prefix::StoreStats,
    index_seq: Option<u32>,
    propagation_us: Option<u32>,
    wire_us: Option<u32>,
    decision_us: Option<u32>,
    /// Per rollout arm (`<slot>.<arm>`): requests, 5xx, traps, latency sum, hit sum.
    rollout: HashMap<String, [Option<u32>; 5]>,
    flow: FlowMetrics,
    disaggregated: Option<u32>,
    sticky_hits: Option<u32>,
    rebound: Option<u32>,
    spread: Option<u32>,
    responses_learned: Option<u32>,
    /// Gateway Responses state: [`RESPONSES_EVENTS`] counters, and the time a resolution
    /// added to a continuation (µs).
    responses: [Option<u32>; RESPONSES_EVENTS.len()],
    responses_resolve_us: Option<u32>,
    affinity_learned: Option<u32>,
    shared_corrupt: Option<u32>,
    fleet: FleetMetrics,
    /// Histogram samples taken on the request path, recorded from the worker's tick. Envoy
    /// merges histograms only at its stats flush (5 s), so this delays nothing a reader sees.
    samples: Vec<(u32, u64)>,
    /// Prefix blocks matched and total since the last tick (`attache.prefix.blocks_*`, added
    /// from the tick: the counters lag the requests by at most one tick).
    blocks: (i64, i64),
    /// Prompt, believed-cached and expected-cached tokens since the last tick, the same way.
    tokens: [i64; 3],
    /// Counter increments taken on the request path (`attache.requests.scheduled`, the
    /// per-endpoint picks), added from the tick: one host call per counter per tick instead
    /// of one per request.
    counts: Vec<(u32, i64)>,
}

/// Endpoints given their own pick and prefill counters, per VM. Each is an Envoy stat (about
/// 1 KB, and a define call of tens of µs on the request that first picks the endpoint); past
/// this, picks count in `attache.endpoint.other.picks` (and `.prefills`), so a pool of 10,000
/// does not define 10,000 stats per worker.
pub const MAX_ENDPOINT_STATS: usize = 512;

/// Histogram samples held between ticks; past this, new samples are dropped (counted nowhere:
/// a histogram is a distribution, and a tick falls due long before a worker decides this many).
pub const MAX_PENDING_SAMPLES: usize = 8_192;

/// Flow-control metrics. Queue depths are gauges every worker moves up and down, so Envoy's
/// one stat per name sums them over workers.
#[derive(Default)]
struct FlowMetrics {
    enqueued: Option<u32>,
    dispatched: Option<u32>,
    disconnected: Option<u32>,
    queued: Option<u32>,
    wait_ms: Option<u32>,
    saturation: Option<u32>,
    shed: HashMap<&'static str, Option<u32>>,
    bands: HashMap<i32, Option<u32>>,
    tenants: HashMap<String, Option<u32>>,
}

/// Fleet-state metrics (`attache.fleet.*`), recorded by the subscriber that exchanges with the
/// host.
#[derive(Default)]
struct FleetMetrics {
    reported: Option<u32>,
    applied_bindings: Option<u32>,
    applied_affinity: Option<u32>,
    dropped: Option<u32>,
    resyncs: Option<u32>,
    binding_lag_ms: Option<u32>,
    propagation_us: Option<u32>,
    /// Read-through lookups by outcome: found, missed, failed.
    lookups: [Option<u32>; 3],
    shared: Option<u32>,
}

/// Outcomes of a read-through lookup (`attache.fleet.lookups.<outcome>`).
const LOOKUP_OUTCOMES: [&str; 3] = ["found", "missed", "failed"];

/// What the gateway's Responses state counts (`attache.responses.<event>`).
pub const RESPONSES_EVENTS: [&str; 15] = [
    "resolved.local",
    "resolved.host",
    "resolved.not_found",
    "resolved.evicted",
    "resolved.pending",
    "resolved.failed",
    "rewrites",
    "captured",
    "capture_dropped",
    "store_failed",
    "served",
    "serve_failed",
    "background",
    "engine.routed",
    "engine.unbound",
];

/// Tenants with their own queue-depth gauge per worker; the rest share `other`.
const MAX_TENANT_GAUGES: usize = 64;

fn band_name(priority: i32) -> String {
    if priority < 0 {
        format!("minus{}", priority.unsigned_abs())
    } else {
        priority.to_string()
    }
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

/// A 0..1 score in thousandths, for the score histograms.
fn milli(v: f64) -> u64 {
    (v * 1000.0).round().clamp(0.0, 1000.0) as u64
}

fn sanitize(address: &str) -> String {
    address.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' }).collect()
}

impl Metrics {
    /// Define the metrics, with a score histogram per scorer of `profile` that has one.
    pub fn define(profile: &attache_policies::profiles::Profile) -> Self {
        let scores = profile
            .scorers
            .iter()
            .filter_map(|(s, _)| s.metric())
            .map(|m| (m, define(MetricType::Histogram, &format!("attache.scorer.{m}.score_milli"))))
            .collect();
        Self {
            scores,
            scheduled: define(MetricType::Counter, "attache.requests.scheduled"),
            passthrough: define(MetricType::Counter, "attache.requests.passthrough"),
            model_list: define(MetricType::Counter, "attache.requests.model_list"),
            apis: Api::ALL.map(|a| define(MetricType::Counter, &format!("attache.requests.api.{}", a.as_str()))),
            prefix_blocks_matched: define(MetricType::Counter, "attache.prefix.blocks_matched"),
            prefix_blocks_total: define(MetricType::Counter, "attache.prefix.blocks_total"),
            prefix_tokens: [
                define(MetricType::Counter, "attache.prefix.prompt_tokens"),
                define(MetricType::Counter, "attache.prefix.believed_tokens"),
                define(MetricType::Counter, "attache.prefix.expected_tokens"),
            ],
            snapshot_version: define(MetricType::Gauge, "attache.snapshot.version"),
            snapshot_epoch: define(MetricType::Gauge, "attache.snapshot.host_epoch"),
            snapshot_updates: define(MetricType::Counter, "attache.snapshot.updates"),
            snapshot_deltas: define(MetricType::Counter, "attache.snapshot.deltas"),
            snapshot_gaps: define(MetricType::Counter, "attache.snapshot.delta_gaps"),
            host_silent_ms: define(MetricType::Gauge, "attache.host.silent_ms"),
            load_only: define(MetricType::Counter, "attache.host.load_only_decisions"),
            affinity_learned: define(MetricType::Counter, "attache.affinity.learned"),
            shared_corrupt: define(MetricType::Counter, "attache.shared.corrupt_tables"),
            propagation_us: define(MetricType::Histogram, "attache.precise.propagation_us"),
            wire_us: define(MetricType::Histogram, "attache.precise.wire_us"),
            decision_us: define(MetricType::Histogram, "attache.decision_us"),
            index_entries: define(MetricType::Counter, "attache.precise.index_entries_applied"),
            tokenizer_mismatch: define(MetricType::Counter, "attache.precise.tokenizer_unusable"),
            prompt_untokenized: define(MetricType::Counter, "attache.precise.prompt_untokenized"),
            debug_refused: define(MetricType::Counter, "attache.debug.refused"),
            repicked: define(MetricType::Counter, "attache.scoring.repicked"),
            prefix_store: [
                define(MetricType::Counter, "attache.precise.prefix_store.hits"),
                define(MetricType::Counter, "attache.precise.prefix_store.misses"),
                define(MetricType::Counter, "attache.precise.prefix_store.bytes_skipped"),
                define(MetricType::Counter, "attache.precise.prefix_store.evicted"),
                define(MetricType::Gauge, "attache.precise.prefix_store.bytes"),
            ],
            index_seq: define(MetricType::Gauge, "attache.precise.index_seq"),
            disaggregated: define(MetricType::Counter, "attache.pd.disaggregated"),
            sticky_hits: define(MetricType::Counter, "attache.session.sticky_hits"),
            rebound: define(MetricType::Counter, "attache.session.rebound"),
            spread: define(MetricType::Counter, "attache.prefix.spread"),
            responses_learned: define(MetricType::Counter, "attache.session.responses_learned"),
            responses: RESPONSES_EVENTS.map(|e| define(MetricType::Counter, &format!("attache.responses.{e}"))),
            responses_resolve_us: define(MetricType::Histogram, "attache.responses.resolve_us"),
            fleet: FleetMetrics {
                reported: define(MetricType::Counter, "attache.fleet.reported"),
                applied_bindings: define(MetricType::Counter, "attache.fleet.applied.bindings"),
                applied_affinity: define(MetricType::Counter, "attache.fleet.applied.affinity"),
                dropped: define(MetricType::Counter, "attache.fleet.dropped"),
                resyncs: define(MetricType::Counter, "attache.fleet.resyncs"),
                binding_lag_ms: define(MetricType::Histogram, "attache.fleet.binding_lag_ms"),
                propagation_us: define(MetricType::Histogram, "attache.fleet.propagation_us"),
                shared: define(MetricType::Counter, "attache.fleet.shared"),
                lookups: LOOKUP_OUTCOMES.map(|o| define(MetricType::Counter, &format!("attache.fleet.lookups.{o}"))),
            },
            flow: FlowMetrics {
                enqueued: define(MetricType::Counter, "attache.flow.enqueued"),
                dispatched: define(MetricType::Counter, "attache.flow.dispatched"),
                disconnected: define(MetricType::Counter, "attache.flow.disconnected"),
                queued: define(MetricType::Gauge, "attache.flow.queued"),
                wait_ms: define(MetricType::Histogram, "attache.flow.wait_ms"),
                saturation: define(MetricType::Gauge, "attache.flow.saturation_permille"),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn flow_gauges(&mut self, priority: i32, tenant: &str) -> [Option<u32>; 3] {
        let f = &mut self.flow;
        let band = *f
            .bands
            .entry(priority)
            .or_insert_with(|| define(MetricType::Gauge, &format!("attache.flow.band.{}.queued", band_name(priority))));
        let tenant_key = if f.tenants.contains_key(tenant) || f.tenants.len() < MAX_TENANT_GAUGES {
            tenant.to_owned()
        } else {
            "other".to_owned()
        };
        let t = *f.tenants.entry(tenant_key.clone()).or_insert_with(|| {
            define(MetricType::Gauge, &format!("attache.flow.tenant.{}.queued", sanitize(&tenant_key)))
        });
        [f.queued, band, t]
    }

    /// A request entered the flow-control queue.
    pub fn flow_enqueued(&mut self, priority: i32, tenant: &str) {
        inc(self.flow.enqueued, 1);
        for g in self.flow_gauges(priority, tenant) {
            inc(g, 1);
        }
    }

    /// A request left the queue (dispatched, expired or gone).
    pub fn flow_left(&mut self, priority: i32, tenant: &str) {
        for g in self.flow_gauges(priority, tenant) {
            inc(g, -1);
        }
    }

    pub fn flow_dispatched(&mut self, waited_ms: u64) {
        inc(self.flow.dispatched, 1);
        if let Some(id) = self.flow.wait_ms {
            let _ = hostcalls::record_metric(id, waited_ms);
        }
    }

    pub fn flow_disconnected(&mut self) {
        inc(self.flow.disconnected, 1);
    }

    /// A request flow control answered itself: `attache.flow.shed.<reason>`.
    pub fn flow_shed(&mut self, shed: attache_policies::flow::Shed) {
        let reason = shed.reason();
        let id = *self
            .flow
            .shed
            .entry(reason)
            .or_insert_with(|| define(MetricType::Counter, &format!("attache.flow.shed.{reason}")));
        inc(id, 1);
    }

    /// The worker's latest saturation estimate (all workers write the one gauge).
    pub fn flow_saturation(&mut self, s: Option<f64>) {
        if let (Some(id), Some(s)) = (self.flow.saturation, s) {
            let _ = hostcalls::record_metric(id, (s * 1000.0).round().clamp(0.0, 1e9) as u64);
        }
    }

    /// Take a histogram sample now, record it at the next [`Metrics::flush_samples`].
    fn sample(&mut self, id: Option<u32>, v: u64) {
        if let Some(id) = id {
            if self.samples.len() < MAX_PENDING_SAMPLES {
                self.samples.push((id, v));
            }
        }
    }

    /// Record the histogram samples and block counts taken since the last tick (from the tick).
    pub fn flush_samples(&mut self) {
        for (id, v) in self.samples.drain(..) {
            let _ = hostcalls::record_metric(id, v);
        }
        for (id, by) in self.counts.drain(..) {
            inc(Some(id), by);
        }
        let (matched, total) = std::mem::take(&mut self.blocks);
        if total > 0 {
            inc(self.prefix_blocks_matched, matched);
            inc(self.prefix_blocks_total, total);
        }
        let tokens = std::mem::take(&mut self.tokens);
        if tokens[0] > 0 {
            for (&id, by) in self.prefix_tokens.iter().zip(tokens) {
                inc(id, by);
            }
        }
    }

    /// Add `by` to counter `id` at the next tick.
    fn count(&mut self, id: Option<u32>, by: i64) {
        let Some(id) = id else { return };
        match self.counts.iter_mut().find(|(k, _)| *k == id) {
            Some((_, n)) => *n += by,
            None => self.counts.push((id, by)),
        }
    }

    /// A planned request (policies::plan's metric deltas), routed to `endpoint`.
    pub fn planned(&mut self, m: &attache_policies::plan::MetricsDelta, endpoint: &str) {
        self.count(self.scheduled, 1);
        let id = self.endpoint_counter(endpoint, "picks");
        self.count(id, 1);
        for (metric, v) in m.scores.iter() {
            if let Some(&(_, h)) = self.scores.iter().find(|(n, _)| n == metric) {
                self.sample(h, milli(*v));
            }
        }
        // Summed here and added from the tick: two host calls fewer per request.
        self.blocks.0 += m.matched_blocks as i64;
        self.blocks.1 += m.total_blocks as i64;
        for (sum, by) in self.tokens.iter_mut().zip([m.prompt_tokens, m.believed_tokens, m.expected_tokens]) {
            *sum += by as i64;
        }
        if m.load_only {
            inc(self.load_only, 1);
        }
        if m.sticky_hit {
            inc(self.sticky_hits, 1);
        }
        if m.rebound {
            inc(self.rebound, 1);
        }
        if m.spread {
            inc(self.spread, 1);
        }
        if let Some(prefill) = &m.disaggregated {
            self.disaggregated(prefill);
        }
    }

    /// How long the host has been silent (the gauge, set from the worker's tick).
    pub fn host_silence(&mut self, silent_ms: u64) {
        if let Some(id) = self.host_silent_ms {
            let _ = hostcalls::record_metric(id, silent_ms);
        }
    }

    /// A decision made on load alone because the host was silent.
    /// Entries learned from the other workers' affinity logs (`attache.affinity.learned`).
    /// A table in shared data did not decode and was replaced (`attache.shared.corrupt_tables`).
    pub fn shared_table_corrupt(&mut self) {
        inc(self.shared_corrupt, 1);
    }

    pub fn affinity_learned(&mut self, entries: usize) {
        if entries > 0 {
            inc(self.affinity_learned, entries as i64);
        }
    }

    /// A request was split: its prefill goes to `prefill` (`attache.pd.disaggregated`, and
    /// `attache.endpoint.<ip_port>.prefills`).
    fn disaggregated(&mut self, prefill: &str) {
        inc(self.disaggregated, 1);
        let id = self.endpoint_counter(&format!("prefill:{prefill}"), "prefills");
        inc(id, 1);
    }

    /// The counter `attache.endpoint.<ip_port>.<what>` for `key` (an address, or
    /// `prefill:<address>`), defined on first use; `attache.endpoint.other.<what>` once
    /// [`MAX_ENDPOINT_STATS`] are defined.
    fn endpoint_counter(&mut self, key: &str, what: &'static str) -> Option<u32> {
        if let Some(id) = self.picks.get(key) {
            return Some(*id);
        }
        if self.picks.len() >= MAX_ENDPOINT_STATS {
            if let Some(id) = self.other_picks.get(what) {
                return Some(*id);
            }
            let id = define(MetricType::Counter, &format!("attache.endpoint.other.{what}"))?;
            self.other_picks.insert(what, id);
            return Some(id);
        }
        let endpoint = key.strip_prefix("prefill:").unwrap_or(key);
        let id = define(MetricType::Counter, &format!("attache.endpoint.{}.{what}", sanitize(endpoint)))?;
        self.picks.insert(key.to_owned(), id);
        Some(id)
    }

    /// A request went to its session's (or conversation's) sticky endpoint.
    /// A Responses API response id was bound to the endpoint that served it.
    pub fn response_learned(&mut self) {
        inc(self.responses_learned, 1);
    }

    /// A gateway Responses event ([`RESPONSES_EVENTS`]).
    pub fn responses(&mut self, event: &str) {
        if let Some(i) = RESPONSES_EVENTS.iter().position(|e| *e == event) {
            inc(self.responses[i], 1);
        }
    }

    /// The time resolving a continuation's `previous_response_id` added, µs.
    pub fn responses_resolve_us(&mut self, us: u64) {
        self.sample(self.responses_resolve_us, us);
    }

    /// An index delta from the host was applied.
    /// Time the filter spent on one request's body: parsing, hashing, scoring and writing the
    /// decision (`attache.decision_us`).
    pub fn decision(&mut self, us: u64) {
        self.sample(self.decision_us, us);
    }

    /// `propagation_us`: engine event time to this delta being applied here; `wire_us`: the
    /// host sending it to the same moment (both `None` = unknown).
    pub fn index_delta(&mut self, entries: usize, seq: u64, propagation_us: Option<u64>, wire_us: Option<u64>) {
        inc(self.index_entries, entries as i64);
        for (id, us) in [(self.propagation_us, propagation_us), (self.wire_us, wire_us)] {
            if let (Some(id), Some(us)) = (id, us) {
                let _ = hostcalls::record_metric(id, us);
            }
        }
        if let Some(id) = self.index_seq {
            let _ = hostcalls::record_metric(id, seq);
        }
    }

    /// Entries reported to the host.
    pub fn fleet_reported(&mut self, entries: usize) {
        inc(self.fleet.reported, entries as i64);
    }

    /// Entries the host sent from other Envoys, applied here: bindings, affinity entries;
    /// `lags_ms`: for each binding, its age (learned elsewhere to usable here);
    /// `propagation_us`: the oldest report's arrival at the host to now.
    pub fn fleet_applied(&mut self, bindings: usize, affinity: usize, lags_ms: &[u64], propagation_us: Option<u64>) {
        inc(self.fleet.applied_bindings, bindings as i64);
        inc(self.fleet.applied_affinity, affinity as i64);
        if let Some(id) = self.fleet.binding_lag_ms {
            for lag in lags_ms {
                let _ = hostcalls::record_metric(id, *lag);
            }
        }
        if let (Some(id), Some(us)) = (self.fleet.propagation_us, propagation_us) {
            let _ = hostcalls::record_metric(id, us);
        }
    }

    /// Fleet entries dropped: a full report batch or apply backlog.
    pub fn fleet_dropped(&mut self, entries: usize) {
        inc(self.fleet.dropped, entries as i64);
    }

    /// A read-through lookup ended: `found`, `missed` (the host had nothing within the wait) or
    /// `failed` (no answer).
    pub fn fleet_lookup(&mut self, outcome: &str) {
        if let Some(i) = LOOKUP_OUTCOMES.iter().position(|o| *o == outcome) {
            inc(self.fleet.lookups[i], 1);
        }
    }

    /// A new binding was sent to the host at once (`attache.fleet.shared`), or could not be
    /// (`attache.fleet.dropped`; the stream's next report still carries it).
    pub fn fleet_shared(&mut self, sent: bool) {
        inc(if sent { self.fleet.shared } else { self.fleet.dropped }, 1);
    }

    /// The stream reopened and this Envoy resent what it learned.
    pub fn fleet_resync(&mut self) {
        inc(self.fleet.resyncs, 1);
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

    /// A request custom scorers moved off the scheduler's primary (or a fallback served): what
    /// was learned was moved to the endpoint that served it.
    pub fn repicked(&mut self) {
        inc(self.repicked, 1);
    }

    /// A debug header whose token is not the configured one: no explanation was given.
    pub fn debug_refused(&mut self) {
        inc(self.debug_refused, 1);
    }

    /// Add what the tokenization prefix store did since the last call (from the tick).
    pub fn prefix_store(&mut self, now: attache_policies::token_prefix::StoreStats) {
        let was = std::mem::replace(&mut self.prefix_store_seen, now);
        let delta = |a: u64, b: u64| i64::try_from(a).unwrap_or(i64::MAX) - i64::try_from(b).unwrap_or(i64::MAX);
        let changes = [
            delta(now.hits, was.hits),
            delta(now.misses, was.misses),
            delta(now.bytes_skipped, was.bytes_skipped),
            delta(now.evicted, was.evicted),
            delta(now.bytes, was.bytes),
        ];
        for (id, by) in self.prefix_store.iter().zip(changes) {
            if by != 0 {
                inc(*id, by);
            }
        }
    }

    pub fn passthrough(&mut self) {
        inc(self.passthrough, 1);
    }

    /// A request of `api` parsed (then routed, queued or refused).
    pub fn api(&mut self, api: Api) {
        if let Some(i) = Api::ALL.iter().position(|a| *a == api) {
            inc(self.apis.get(i).copied().flatten(), 1);
        }
    }

    /// `GET /v1/models` answered from the snapshot.
    pub fn model_list(&mut self) {
        inc(self.model_list, 1);
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

    /// A shadow arm's pick graded against the live one on the same request, as the counters
    /// the controller reads (`attache.rollout.<slot>.{shadow,live}.{requests,agree,hit_permille,
    /// load_milli}`); `(hit, load)` of each pick.
    pub fn shadow_compared(&mut self, slot: &str, agree: bool, shadow: (f32, f32), live: (f32, f32)) {
        let milli = |v: f32| (f64::from(v) * 1000.0).round().max(0.0).min(i64::MAX as f64) as i64;
        for (arm, (hit, load)) in [("shadow", shadow), ("live", live)] {
            let key = format!("{}.{arm}.compared", sanitize(slot));
            let ids = match self.rollout.get(&key) {
                Some(ids) => *ids,
                None => {
                    let base = format!("attache.rollout.{}.{arm}", sanitize(slot));
                    let d = |what: &str| define(MetricType::Counter, &format!("{base}.{what}"));
                    let ids = [d("requests"), d("agree"), d("hit_permille"), d("load_milli"), None];
                    self.rollout.insert(key, ids);
                    ids
                }
            };
            let [requests, agreed, hit_id, load_id, _] = ids;
            inc(requests, 1);
            if arm == "shadow" {
                inc(agreed, i64::from(agree));
            }
            inc(hit_id, milli(hit.clamp(0.0, 1.0)));
            inc(load_id, milli(load));
        }
    }

    /// A shadow scheduler arm could not plan a request (`reason`: the refusal it would have
    /// answered): `attache.rollout.<slot>.shadow.unplanned.<reason>`. Its pick is then missing
    /// from the comparison, never silently.
    pub fn shadow_unplanned(&mut self, slot: &str, reason: &str) {
        let key = format!("{}.shadow.unplanned.{}", sanitize(slot), sanitize(reason));
        let id = match self.rollout.get(&key) {
            Some(ids) => ids[0],
            None => {
                let id = define(MetricType::Counter, &format!("attache.rollout.{key}"));
                self.rollout.insert(key, [id, None, None, None, None]);
                id
            }
        };
        inc(id, 1);
    }

    /// A new snapshot arrived (agent) or was loaded (worker).
    /// A snapshot version arrived, whole or (`delta`) as the changes from the one before.
    pub fn snapshot(&mut self, epoch: u64, version: u64, delta: bool) {
        for (id, v) in [(self.snapshot_version, version), (self.snapshot_epoch, epoch)] {
            if let Some(id) = id {
                let _ = hostcalls::record_metric(id, v);
            }
        }
        inc(self.snapshot_updates, 1);
        if delta {
            inc(self.snapshot_deltas, 1);
        }
    }

    /// A delta that did not follow the snapshot held (the stream restarts).
    pub fn snapshot_gap(&mut self) {
        inc(self.snapshot_gaps, 1);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_large_pool_gets_bounded_per_endpoint_counters() {
        use crate::testing::{metric, with};
        use attache_policies::plan::MetricsDelta;
        let profile =
            attache_policies::Scheduler::new(attache_policies::SchedulerConfig::default()).expect("scheduler");
        let mut m = super::Metrics::define(profile.decode_profile());
        let ep = |i: usize| format!("10.0.{}.{}:8000", i / 256, i % 256);
        let n = super::MAX_ENDPOINT_STATS + 100;
        for i in 0..n {
            m.planned(&MetricsDelta::default(), &ep(i));
        }
        m.planned(&MetricsDelta::default(), &ep(0));
        m.planned(&MetricsDelta { disaggregated: Some(ep(n + 1)), ..Default::default() }, &ep(n));
        m.flush_samples();
        assert_eq!(metric("attache.endpoint.10.0.0.0_8000.picks"), Some(2));
        let last = super::MAX_ENDPOINT_STATS - 1;
        assert_eq!(metric(&format!("attache.endpoint.{}.picks", super::sanitize(&ep(last)))), Some(1));
        assert_eq!(metric(&format!("attache.endpoint.{}.picks", super::sanitize(&ep(last + 1)))), None);
        assert_eq!(metric("attache.endpoint.other.picks"), Some(101), "picks past the bound");
        assert_eq!(metric("attache.endpoint.other.prefills"), Some(1));
        let defined = with(|h| h.metric_names().filter(|n| n.starts_with("attache.endpoint.")).count());
        assert_eq!(defined, super::MAX_ENDPOINT_STATS + 2);
    }

    #[test]
    fn endpoint_names_are_stat_safe() {
        assert_eq!(super::sanitize("10.0.0.1:8000"), "10.0.0.1_8000");
        assert_eq!(super::sanitize("[::1]:80"), "___1__80");
    }
}
