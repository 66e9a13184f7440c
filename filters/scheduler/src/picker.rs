//! The picker filter: runs after the custom scorer filters, combines their weighted scores
//! with the scheduler's built-in totals (policies::scoring::pick), keeps the scheduler's tiers
//! (a sticky session, the affinity filter's holders lead) and rewrites the destination header.
//! Candidates a filter module removed are dropped, across tiers (unless every candidate would
//! go). Without any scorer output it changes nothing: the scheduler's pick stands.

use std::rc::Rc;

use attache_policies::scoring::{self, ScoreSheet, ScoringContext};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, LogLevel, MetricType};

use crate::config::ScoringConfig;
use crate::hostcalls as host;
use attache_policies::plan::DESTINATION_HEADER;
use attache_policies::scoring::PICKED_PROPERTY;

/// Metric handles shared by one worker's picker contexts.
pub struct PickerMetrics {
    combined: Option<u32>,
    changed: Option<u32>,
    decode_errors: Option<u32>,
    ignored_entries: Option<u32>,
    removed: Option<u32>,
}

impl PickerMetrics {
    pub fn define() -> Self {
        let d = |n: &str| hostcalls::define_metric(MetricType::Counter, n).ok();
        Self {
            combined: d("attache.picker.combined"),
            changed: d("attache.picker.changed"),
            decode_errors: d("attache.picker.decode_errors"),
            ignored_entries: d("attache.picker.ignored_entries"),
            removed: d("attache.picker.removed"),
        }
    }
}

fn inc(id: Option<u32>, by: usize) {
    if let (Some(id), true) = (id, by > 0) {
        let _ = hostcalls::increment_metric(id, by as i64);
    }
}

pub struct Shared {
    pub config: ScoringConfig,
    pub metrics: PickerMetrics,
}

pub struct PickerHttp {
    shared: Rc<Shared>,
    /// `slot=arm@version,...` of the scorers that acted, for the response header.
    acted: String,
}

impl PickerHttp {
    pub fn new(shared: Rc<Shared>) -> Self {
        Self { shared, acted: String::new() }
    }
}

impl Context for PickerHttp {}

impl HttpContext for PickerHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(sheet) = host::property(scoring::SCORES_PROPERTY).filter(|b| !b.is_empty()) else {
            return Action::Continue;
        };
        let Some(ctx) = host::property(scoring::CONTEXT_PROPERTY) else {
            return Action::Continue;
        };
        let m = &self.shared.metrics;
        let (ctx, sheet) = match (ScoringContext::decode(&ctx), ScoreSheet::decode(&sheet)) {
            (Ok(c), Ok(s)) => (c, s),
            (Err(e), _) | (_, Err(e)) => {
                host::log(
                    LogLevel::Warn,
                    &format!("attache picker: undecodable scoring state ({e}); keeping the scheduler's pick"),
                );
                inc(m.decode_errors, 1);
                return Action::Continue;
            }
        };
        if sheet.entries.is_empty() {
            return Action::Continue;
        }
        // The scheduler's filters' verdict (sticky session, affinity filter): scores order the
        // candidates within a tier, never across.
        let tiers = host::property(scoring::TIERS_PROPERTY).unwrap_or_default();
        let (picked, ignored, removed) = scoring::pick(&ctx, &sheet, &tiers);
        inc(m.ignored_entries, ignored);
        // Candidates filter modules removed (none are when they would remove all).
        inc(m.removed, removed);
        let Some(primary) = picked.first() else {
            return Action::Continue;
        };
        let before = host::request_header(DESTINATION_HEADER).unwrap_or_default();
        let value = picked.join(",");
        let rewritten = before != value && host::set_request_header(DESTINATION_HEADER, &value);
        if rewritten && before.split(',').next() != Some(*primary) {
            inc(m.changed, 1);
        }
        let _ = host::set_property(PICKED_PROPERTY, primary.as_bytes());
        inc(m.combined, 1);
        if self.shared.config.response_header {
            self.acted = sheet
                .entries
                .iter()
                .map(|e| format!("{}={}@{}", e.slot, e.arm.as_str(), e.version))
                .collect::<Vec<_>>()
                .join(",");
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if !self.acted.is_empty() {
            host::set_response_header("x-attache-scorers", &self.acted);
        }
        Action::Continue
    }
}

/// The safe default of an empty scorer slot: does nothing.
pub struct PassthroughHttp;

impl Context for PassthroughHttp {}
impl HttpContext for PassthroughHttp {}
