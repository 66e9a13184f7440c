//! The endpoint picker's metrics, in the host's Prometheus output: streams, decisions, answers
//! by reason, and decision latency as a histogram with the buckets Envoy gives the filter's
//! `attache.decision_us` (Envoy's default histogram buckets), so the two compare directly.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

/// Envoy's default histogram bucket bounds, here in µs.
pub const DECISION_BUCKETS_US: [f64; 19] = [
    0.5,
    1.0,
    5.0,
    10.0,
    25.0,
    50.0,
    100.0,
    250.0,
    500.0,
    1_000.0,
    2_500.0,
    5_000.0,
    10_000.0,
    30_000.0,
    60_000.0,
    300_000.0,
    600_000.0,
    1_800_000.0,
    3_600_000.0,
];

/// What happened to one request the picker saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// Planned by the scheduler: a destination was sent.
    Scheduled,
    /// Not an inference call: sent to a ready endpoint round robin.
    Passthrough,
    /// Answered by the picker (an error or a refusal).
    Answered,
    /// `GET /v1/models`, answered by the picker from the snapshot.
    ModelList,
    /// The stream ended before a destination or an answer was sent.
    Abandoned,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Self::Scheduled => "scheduled",
            Self::Passthrough => "passthrough",
            Self::Answered => "answered",
            Self::ModelList => "model_list",
            Self::Abandoned => "abandoned",
        }
    }
}

#[derive(Debug, Default)]
struct Histogram {
    buckets: [u64; DECISION_BUCKETS_US.len()],
    count: u64,
    sum: f64,
}

/// The picker's registry.
#[derive(Debug, Default)]
pub struct EppMetrics {
    streams: AtomicU64,
    active: AtomicI64,
    outcomes: Mutex<BTreeMap<Outcome, u64>>,
    apis: Mutex<BTreeMap<&'static str, u64>>,
    answers: Mutex<BTreeMap<(u16, &'static str), u64>>,
    shed: Mutex<BTreeMap<&'static str, u64>>,
    protocol_errors: Mutex<BTreeMap<&'static str, u64>>,
    decision_us: Mutex<Histogram>,
    served_elsewhere: AtomicU64,
    debug_refused: AtomicU64,
    untokenized: AtomicU64,
    tokenizer_refused: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl EppMetrics {
    pub fn stream_opened(&self) {
        self.streams.fetch_add(1, Ordering::Relaxed);
        self.active.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stream_closed(&self, outcome: Option<Outcome>) {
        self.active.fetch_sub(1, Ordering::Relaxed);
        if let Some(o) = outcome {
            *lock(&self.outcomes).entry(o).or_default() += 1;
        }
    }

    /// A request of an inference or utility API parsed (then routed, queued or refused).
    pub fn api(&self, api: attache_policies::Api) {
        *lock(&self.apis).entry(api.as_str()).or_default() += 1;
    }

    /// The picker answered a request itself.
    pub fn answered(&self, status: u16, reason: &'static str) {
        *lock(&self.answers).entry((status, reason)).or_default() += 1;
    }

    pub fn shed(&self, reason: &'static str) {
        *lock(&self.shed).entry(reason).or_default() += 1;
    }

    /// A message the picker could not act on (an unexpected order, a missing field).
    pub fn protocol_error(&self, what: &'static str) {
        *lock(&self.protocol_errors).entry(what).or_default() += 1;
    }

    /// One decision took `us` microseconds (from the body's last byte to the destination).
    pub fn decision(&self, us: f64) {
        let mut h = lock(&self.decision_us);
        for (b, le) in h.buckets.iter_mut().zip(DECISION_BUCKETS_US) {
            if us <= le {
                *b += 1;
            }
        }
        h.count += 1;
        h.sum += us;
    }

    pub fn served_elsewhere(&self) {
        self.served_elsewhere.fetch_add(1, Ordering::Relaxed);
    }

    /// A debug header whose token is not the configured one: no explanation was given.
    pub fn debug_refused(&self) {
        self.debug_refused.fetch_add(1, Ordering::Relaxed);
    }

    pub fn untokenized(&self) {
        self.untokenized.fetch_add(1, Ordering::Relaxed);
    }

    pub fn tokenizer_refused(&self) {
        self.tokenizer_refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Decisions so far (scheduled requests).
    pub fn decisions(&self) -> u64 {
        lock(&self.decision_us).count
    }

    /// The exposition of the picker's families. `inflight` and `waiting`: its load now.
    pub fn render(&self, out: &mut String, inflight: &BTreeMap<String, u32>, waiting: usize) {
        let family = |out: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        family(out, "attache_epp_streams_total", "counter", "ext_proc streams opened by gateways.");
        let _ = writeln!(out, "attache_epp_streams_total {}", self.streams.load(Ordering::Relaxed));
        family(out, "attache_epp_streams_active", "gauge", "ext_proc streams open now.");
        let _ = writeln!(out, "attache_epp_streams_active {}", self.active.load(Ordering::Relaxed).max(0));
        family(out, "attache_epp_requests_total", "counter", "Requests by outcome.");
        for (o, n) in lock(&self.outcomes).iter() {
            let _ = writeln!(out, "attache_epp_requests_total{{outcome=\"{}\"}} {n}", o.label());
        }
        family(out, "attache_epp_requests_by_api_total", "counter", "Requests parsed, by API (route).");
        for (api, n) in lock(&self.apis).iter() {
            let _ = writeln!(out, "attache_epp_requests_by_api_total{{api=\"{api}\"}} {n}");
        }
        family(
            out,
            "attache_epp_errors_total",
            "counter",
            "Requests the picker answered itself, by status and reason.",
        );
        for ((status, reason), n) in lock(&self.answers).iter() {
            let _ = writeln!(out, "attache_epp_errors_total{{status=\"{status}\",reason=\"{reason}\"}} {n}");
        }
        family(out, "attache_epp_flow_shed_total", "counter", "Requests flow control shed, by reason.");
        for (reason, n) in lock(&self.shed).iter() {
            let _ = writeln!(out, "attache_epp_flow_shed_total{{reason=\"{reason}\"}} {n}");
        }
        family(out, "attache_epp_protocol_errors_total", "counter", "ext_proc messages the picker could not act on.");
        for (what, n) in lock(&self.protocol_errors).iter() {
            let _ = writeln!(out, "attache_epp_protocol_errors_total{{what=\"{what}\"}} {n}");
        }
        self.render_decisions(out, &family);
        family(out, "attache_epp_inflight", "gauge", "Requests the picker routed that have not ended, per endpoint.");
        for (ep, n) in inflight {
            let _ = writeln!(out, "attache_epp_inflight{{endpoint=\"{ep}\"}} {n}");
        }
        family(out, "attache_epp_flow_waiting", "gauge", "Requests waiting in the picker's flow-control queue.");
        let _ = writeln!(out, "attache_epp_flow_waiting {waiting}");
    }

    fn render_decisions(&self, out: &mut String, family: &dyn Fn(&mut String, &str, &str, &str)) {
        family(
            out,
            "attache_epp_decision_us",
            "histogram",
            "Decision latency (µs), from the request body's end to the destination; buckets as attache_decision_us.",
        );
        {
            let h = lock(&self.decision_us);
            for (le, n) in DECISION_BUCKETS_US.iter().zip(h.buckets) {
                let _ = writeln!(out, "attache_epp_decision_us_bucket{{le=\"{le}\"}} {n}");
            }
            let _ = writeln!(out, "attache_epp_decision_us_bucket{{le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(out, "attache_epp_decision_us_sum {}", h.sum);
            let _ = writeln!(out, "attache_epp_decision_us_count {}", h.count);
        }
        let counters = [
            (
                "attache_epp_served_elsewhere_total",
                "Requests a fallback served: the index learned it.",
                &self.served_elsewhere,
            ),
            ("attache_epp_prompt_untokenized_total", "Prompts precise routing could not tokenize.", &self.untokenized),
            (
                "attache_epp_debug_refused_total",
                "Debug headers with a wrong token: no explanation given.",
                &self.debug_refused,
            ),
            (
                "attache_epp_tokenizer_refused_total",
                "Tokenizers refused at start (failed checks).",
                &self.tokenizer_refused,
            ),
        ];
        for (name, help, v) in counters {
            family(out, name, "counter", help);
            let _ = writeln!(out, "{name} {}", v.load(Ordering::Relaxed));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_histogram_is_cumulative_and_families_are_typed() {
        let m = EppMetrics::default();
        m.decision(3.0);
        m.decision(40.0);
        m.decision(5_000_000.0);
        m.answered(429, "sheddable");
        m.api(attache_policies::Api::Messages);
        m.stream_opened();
        m.stream_closed(Some(Outcome::Answered));
        let mut out = String::new();
        m.render(&mut out, &BTreeMap::from([("10.0.0.1:8000".to_owned(), 2)]), 1);
        assert!(out.contains("attache_epp_decision_us_bucket{le=\"1\"} 0\n"), "{out}");
        assert!(out.contains("attache_epp_decision_us_bucket{le=\"5\"} 1\n"));
        assert!(out.contains("attache_epp_decision_us_bucket{le=\"50\"} 2\n"));
        assert!(out.contains("attache_epp_decision_us_bucket{le=\"3600000\"} 2\n"));
        assert!(out.contains("attache_epp_decision_us_bucket{le=\"+Inf\"} 3\n"));
        assert!(out.contains("attache_epp_decision_us_count 3\n"));
        assert!(out.contains("attache_epp_errors_total{status=\"429\",reason=\"sheddable\"} 1\n"));
        assert!(out.contains("attache_epp_requests_total{outcome=\"answered\"} 1\n"));
        assert!(out.contains("attache_epp_streams_active 0\n"));
        assert!(out.contains("attache_epp_requests_by_api_total{api=\"messages\"} 1\n"), "{out}");
        assert!(out.contains("attache_epp_inflight{endpoint=\"10.0.0.1:8000\"} 2\n"));
        assert!(out.contains("attache_epp_flow_waiting 1\n"));
        assert_eq!(m.decisions(), 3);
        for line in out.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            let base = name.trim_end_matches("_bucket").trim_end_matches("_sum").trim_end_matches("_count");
            assert!(out.contains(&format!("# TYPE {base} ")), "{name} has no TYPE line");
        }
    }
}
