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
use crate::decision_log::DecisionLog;
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
    decisions_sent: Option<u32>,
    decisions_dropped: Option<u32>,
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
            decisions_sent: d("attache.picker.decisions_sent"),
            decisions_dropped: d("attache.picker.decisions_dropped"),
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
    /// Shadow comparison counters, by name (`attache.rollout.<slot>.<shadow|live>.<what>`).
    pub shadow: std::cell::RefCell<std::collections::HashMap<String, Option<u32>>>,
    /// Sampled decisions waiting to go to the host, and the cluster they go through.
    pub decisions: std::cell::RefCell<DecisionLog>,
    pub host_cluster: String,
}

impl Shared {
    pub fn new(config: ScoringConfig, host_cluster: String) -> Self {
        Self {
            config,
            metrics: PickerMetrics::define(),
            shadow: Default::default(),
            decisions: Default::default(),
            host_cluster,
        }
    }

    /// Whether to record this request's decision (`scoring.decision_log_rate`).
    fn sample(&self) -> bool {
        self.decisions.try_borrow_mut().is_ok_and(|mut d| d.sample(self.config.decision_log_rate))
    }

    /// Record a decision; a full batch goes to the host now.
    fn log(&self, ctx: &[u8], tiers: &[u8], sheet: &[u8], picked: usize) {
        let Ok(mut d) = self.decisions.try_borrow_mut() else { return };
        if !d.record(ctx, tiers, sheet, picked) {
            inc(self.metrics.decisions_dropped, 1);
        }
        if d.due() {
            self.send(&mut d);
        }
    }

    /// Send the waiting records (from the tick, or when a batch is full).
    pub fn flush(&self) {
        if let Ok(mut d) = self.decisions.try_borrow_mut() {
            self.send(&mut d);
        }
    }

    fn send(&self, d: &mut DecisionLog) {
        match d.flush(&self.host_cluster) {
            Ok(n) => inc(self.metrics.decisions_sent, n),
            Err(n) => inc(self.metrics.decisions_dropped, n),
        }
    }

    /// Add `by` to the shadow counter `attache.rollout.<slot>.<arm>.<what>`.
    fn count(&self, slot: &str, arm: &str, what: &str, by: u64) {
        let name = format!("attache.rollout.{slot}.{arm}.{what}");
        let Ok(mut ids) = self.shadow.try_borrow_mut() else { return };
        let id = *ids.entry(name).or_insert_with_key(|n| hostcalls::define_metric(MetricType::Counter, n).ok());
        if let Some(id) = id {
            let _ = hostcalls::increment_metric(id, i64::try_from(by).unwrap_or(i64::MAX));
        }
    }

    /// Compare each shadow candidate's pick with the live one (`live`: a position in the
    /// context): agreement, and each pick's expected prefix hit and load, as counters the host
    /// reads like a rollout arm's. The shadow acts on nothing.
    fn compare_shadows(&self, ctx: &ScoringContext, sheet: &ScoreSheet, tiers: &[u8], live: Option<usize>) {
        let at = |i: Option<usize>| i.and_then(|i| ctx.candidates.get(i));
        let hit = |c: Option<&scoring::Candidate>| c.map_or(0, |c| (f64::from(c.prefix_hit) * 1000.0).round() as u64);
        let load = |c: Option<&scoring::Candidate>| {
            c.map_or(0, |c| (f64::from(c.waiting + c.running) * 1000.0).round().max(0.0) as u64)
        };
        for sp in scoring::shadow_picks(ctx, sheet, tiers) {
            let slot = sp.slot.as_str();
            self.count(slot, "shadow", "requests", 1);
            self.count(slot, "shadow", "agree", u64::from(sp.primary == live));
            self.count(slot, "shadow", "hit_permille", hit(at(sp.primary)));
            self.count(slot, "shadow", "load_milli", load(at(sp.primary)));
            self.count(slot, "live", "requests", 1);
            self.count(slot, "live", "hit_permille", hit(at(live)));
            self.count(slot, "live", "load_milli", load(at(live)));
        }
    }
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

    /// Combine the live entries with the built-in totals, rewrite the destination and return
    /// the primary (by position in the context).
    fn repick(&mut self, ctx: &ScoringContext, sheet: &ScoreSheet, tiers: &[u8]) -> Option<usize> {
        let m = &self.shared.metrics;
        let (picked, ignored, removed) = scoring::pick(ctx, sheet, tiers);
        inc(m.ignored_entries, ignored);
        // Candidates filter modules removed (none are when they would remove all).
        inc(m.removed, removed);
        let primary = *picked.first()?;
        let before = host::request_header(DESTINATION_HEADER).unwrap_or_default();
        let value = picked.join(",");
        let rewritten = before != value && host::set_request_header(DESTINATION_HEADER, &value);
        if rewritten && before.split(',').next() != Some(primary) {
            inc(m.changed, 1);
        }
        let _ = host::set_property(PICKED_PROPERTY, primary.as_bytes());
        inc(m.combined, 1);
        if self.shared.config.response_header {
            self.acted = sheet
                .entries
                .iter()
                .filter(|e| e.arm.acts())
                .map(|e| format!("{}={}@{}", e.slot, e.arm.as_str(), e.version))
                .collect::<Vec<_>>()
                .join(",");
        }
        ctx.candidates.iter().position(|c| c.address == primary)
    }
}

impl Context for PickerHttp {}

impl HttpContext for PickerHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let sheet_bytes = host::property(scoring::SCORES_PROPERTY).unwrap_or_default();
        let log = self.shared.sample();
        if sheet_bytes.is_empty() && !log {
            return Action::Continue;
        }
        let Some(ctx_bytes) = host::property(scoring::CONTEXT_PROPERTY) else {
            return Action::Continue;
        };
        let m = &self.shared.metrics;
        let sheet = if sheet_bytes.is_empty() { Ok(ScoreSheet::default()) } else { ScoreSheet::decode(&sheet_bytes) };
        let (ctx, sheet) = match (ScoringContext::decode(&ctx_bytes), sheet) {
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
        // The scheduler's filters' verdict (sticky session, affinity filter): scores order the
        // candidates within a tier, never across.
        let tiers = host::property(scoring::TIERS_PROPERTY).unwrap_or_default();
        let live = sheet.entries.iter().any(|e| e.arm.acts());
        let primary = if live { self.repick(&ctx, &sheet, &tiers) } else { None };
        let primary = primary.or_else(|| {
            let header = host::request_header(DESTINATION_HEADER)?;
            let first = header.split(',').next()?;
            ctx.candidates.iter().position(|c| c.address == first)
        });
        if sheet.has_shadow() {
            self.shared.compare_shadows(&ctx, &sheet, &tiers, primary);
        }
        if let (true, Some(p)) = (log, primary) {
            self.shared.log(&ctx_bytes, &tiers, &sheet_bytes, p);
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
