//! Where a decision's time goes: clock readings between the stages of the body callback,
//! summed per worker. With the plugin option `stage_timings` on, each worker adds its sums to
//! Envoy counters at every tick (`attache.stage.<stage>.ns`, `attache.stage.decisions`, and the
//! same under `attache.stage.slow.` for decisions slower than [`SLOW_NS`]), so the mean of a
//! stage is the rate of its counter over the rate of decisions. Every [`REPORT_EVERY`]
//! decisions it also logs the means at info level
//! (`attache stages: n=4000 read_body=3.41 parse=8.84 ...`).
//!
//! Off by default: each reading is a host call, about 0.35 µs in Envoy's V8, which every
//! stage's figure then includes. Off, each function here is one check of a thread-local flag.
//! The stages follow the direct path (flow control off, the default); with flow control on, a
//! queued request is routed from another request's callbacks and its stages land there.

use std::cell::{Cell, RefCell};

/// A stage of the body callback, in the order the callback runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Copying the buffered body into the VM.
    ReadBody,
    /// `policies::request::parse`.
    Parse,
    /// Checking shared data for a newer snapshot (and decoding it, when there is one).
    SnapshotCheck,
    /// Resolving the session's or conversation's endpoint.
    Sticky,
    /// Engine token ids (tokenizing, in precise mode).
    PromptTokens,
    /// `policies::plan`: prefix hashes, the affinity probe, precise scores, the profiles.
    Plan,
    /// Setting the destination (and prefiller) headers.
    Headers,
    /// Scoring context for custom scorers, session binding.
    Handoff,
    /// Recording the decision in the prefix index, the affinity table and the pending log batch.
    Learn,
    /// Metrics and in-flight accounting.
    Accounting,
    /// Returning from the pipeline (dropping the parsed request and the plan).
    Return,
    /// Recording `attache_decision_us`.
    DecisionMetric,
}

impl Stage {
    pub const ALL: [Stage; 12] = [
        Stage::ReadBody,
        Stage::Parse,
        Stage::SnapshotCheck,
        Stage::Sticky,
        Stage::PromptTokens,
        Stage::Plan,
        Stage::Headers,
        Stage::Handoff,
        Stage::Learn,
        Stage::Accounting,
        Stage::Return,
        Stage::DecisionMetric,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Stage::ReadBody => "read_body",
            Stage::Parse => "parse",
            Stage::SnapshotCheck => "snapshot_check",
            Stage::Sticky => "sticky",
            Stage::PromptTokens => "prompt_tokens",
            Stage::Plan => "plan",
            Stage::Headers => "headers",
            Stage::Handoff => "handoff",
            Stage::Learn => "learn",
            Stage::Accounting => "accounting",
            Stage::Return => "return",
            Stage::DecisionMetric => "decision_metric",
        }
    }
}

/// Decisions between two reports.
pub const REPORT_EVERY: u64 = 4000;

/// A decision slower than this also counts in the slow sums: what the tail is made of.
pub const SLOW_NS: u64 = 80_000;

/// Stage times summed over some decisions.
#[derive(Debug, Default, Clone)]
struct Sums {
    ns: [u64; Stage::ALL.len()],
    /// Named probes inside a stage (`policies::probe`, within `plan`), in first-seen order.
    probes: Vec<(&'static str, u64)>,
    decisions: u64,
}

impl Sums {
    fn add(&mut self, other: &Sums) {
        for (a, b) in self.ns.iter_mut().zip(other.ns) {
            *a += b;
        }
        for &(name, ns) in &other.probes {
            match self.probes.iter_mut().find(|(n, _)| *n == name) {
                Some((_, t)) => *t += ns,
                None => self.probes.push((name, ns)),
            }
        }
        self.decisions += other.decisions;
    }

    fn total_ns(&self) -> u64 {
        self.ns.iter().sum::<u64>() + self.probes.iter().map(|(_, ns)| ns).sum::<u64>()
    }

    /// ` n=.. stage=µs ..`: the mean of each stage that took any time.
    fn means(&self) -> String {
        let n = self.decisions.max(1) as f64;
        let mut out = format!(" n={}", self.decisions);
        for (stage, ns) in Stage::ALL.iter().zip(self.ns) {
            if ns > 0 {
                out.push_str(&format!(" {}={:.2}", stage.name(), ns as f64 / n / 1000.0));
            }
        }
        for (name, ns) in &self.probes {
            out.push_str(&format!(" {name}={:.2}", *ns as f64 / n / 1000.0));
        }
        out
    }
}

/// Running sums of one worker's stage times: over every decision, and over the slow ones.
#[derive(Debug, Default)]
pub struct Totals {
    all: Sums,
    slow: Sums,
    /// The decision under way.
    current: Sums,
    /// The previous reading of the decision under way.
    last: Option<u64>,
    /// Every decision, and the slow ones, since the last [`Totals::take_pending`].
    pending: (Sums, Sums),
}

impl Totals {
    /// A decision starts at `now_ns`.
    pub fn begin(&mut self, now_ns: u64) {
        self.last = Some(now_ns);
        self.current.ns = [0; Stage::ALL.len()];
        self.current.probes.iter_mut().for_each(|(_, t)| *t = 0);
    }

    /// `stage` ended at `now_ns`: it took the time since the previous reading. Ignored outside
    /// a decision (a queued request routed from the tick).
    pub fn mark(&mut self, stage: Stage, now_ns: u64) {
        if let Some(last) = self.last {
            if let Some(t) = self.current.ns.get_mut(stage as usize) {
                *t += now_ns.saturating_sub(last);
            }
            self.last = Some(now_ns);
        }
    }

    /// The probe `name` inside the current stage ended at `now_ns`; the stage keeps the time
    /// after its last probe.
    pub fn probe(&mut self, name: &'static str, now_ns: u64) {
        if let Some(last) = self.last {
            let took = now_ns.saturating_sub(last);
            match self.current.probes.iter_mut().find(|(n, _)| *n == name) {
                Some((_, t)) => *t += took,
                None => self.current.probes.push((name, took)),
            }
            self.last = Some(now_ns);
        }
    }

    /// The decision ended; every [`REPORT_EVERY`] decisions, the report to log.
    pub fn finish(&mut self) -> Option<String> {
        self.last.take()?;
        self.current.decisions = 1;
        self.all.add(&self.current);
        self.pending.0.add(&self.current);
        if self.current.total_ns() > SLOW_NS {
            self.slow.add(&self.current);
            self.pending.1.add(&self.current);
        }
        self.all.decisions.is_multiple_of(REPORT_EVERY).then(|| self.report())
    }

    /// The sums since the previous call: over every decision, and over the slow ones.
    fn take_pending(&mut self) -> (Sums, Sums) {
        std::mem::take(&mut self.pending)
    }

    /// Mean µs per decision of each stage that took any time, over every decision so far, then
    /// over the decisions slower than [`SLOW_NS`].
    pub fn report(&self) -> String {
        let mut out = format!("attache stages:{}", self.all.means());
        if self.slow.decisions > 0 {
            out.push_str(&format!(" | over {} us:{}", SLOW_NS / 1000, self.slow.means()));
        }
        out
    }
}

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    static TOTALS: RefCell<Totals> = RefCell::new(Totals::default());
    static COUNTERS: RefCell<Counters> = RefCell::new(Counters::default());
}

/// Turn the timer on or off for this worker (the `stage_timings` option). On, the probes inside
/// `policies::plan` report here too.
pub fn enable(on: bool) {
    ON.with(|f| f.set(on));
    if on {
        attache_policies::probe::set(probe);
    }
}

fn on() -> bool {
    ON.with(Cell::get)
}

fn now_ns() -> u64 {
    proxy_wasm::hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn with_totals(f: impl FnOnce(&mut Totals)) {
    TOTALS.with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            f(&mut s);
        }
    });
}

fn probe(name: &'static str) {
    if on() {
        let t = now_ns();
        with_totals(|s| s.probe(name, t));
    }
}

/// A decision starts.
#[inline]
pub fn begin() {
    if on() {
        let t = now_ns();
        with_totals(|s| s.begin(t));
    }
}

/// `stage` ended.
#[inline]
pub fn mark(stage: Stage) {
    if on() {
        let t = now_ns();
        with_totals(|s| s.mark(stage, t));
    }
}

/// The decision ended.
#[inline]
pub fn finish() {
    if !on() {
        return;
    }
    let mut report = None;
    with_totals(|s| report = s.finish());
    if let Some(r) = report {
        crate::hostcalls::log(proxy_wasm::types::LogLevel::Info, &r);
    }
}

/// Add the sums since the last flush to Envoy's counters (from the tick).
pub fn flush() {
    if !on() {
        return;
    }
    let mut pending = None;
    with_totals(|s| pending = Some(s.take_pending()));
    let Some((all, slow)) = pending else { return };
    COUNTERS.with(|c| {
        if let Ok(mut c) = c.try_borrow_mut() {
            c.add("attache.stage.", &all);
            c.add("attache.stage.slow.", &slow);
        }
    });
}

/// The timer's counters, defined the first time each name has something to add.
#[derive(Default)]
struct Counters {
    ids: Vec<(String, Option<u32>)>,
}

impl Counters {
    fn add(&mut self, prefix: &str, sums: &Sums) {
        if sums.decisions == 0 {
            return;
        }
        self.inc(prefix, "decisions", sums.decisions);
        for (stage, ns) in Stage::ALL.iter().zip(sums.ns) {
            if ns > 0 {
                self.inc(prefix, &format!("{}.ns", stage.name()), ns);
            }
        }
        for (name, ns) in &sums.probes {
            if *ns > 0 {
                self.inc(prefix, &format!("{name}.ns"), *ns);
            }
        }
    }

    fn inc(&mut self, prefix: &str, name: &str, by: u64) {
        let full = format!("{prefix}{name}");
        let id = match self.ids.iter().find(|(n, _)| *n == full) {
            Some((_, id)) => *id,
            None => {
                let id = proxy_wasm::hostcalls::define_metric(proxy_wasm::types::MetricType::Counter, &full).ok();
                self.ids.push((full, id));
                id
            }
        };
        if let Some(id) = id {
            let _ = proxy_wasm::hostcalls::increment_metric(id, i64::try_from(by).unwrap_or(i64::MAX));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_the_time_between_readings_per_stage() {
        let mut t = Totals::default();
        t.mark(Stage::Parse, 5_000); // outside a decision: ignored
        for i in 0..REPORT_EVERY {
            let base = i * 100_000;
            t.begin(base);
            t.mark(Stage::ReadBody, base + 3_000);
            t.mark(Stage::Parse, base + 12_000);
            // A clock that steps back counts as nothing, not as a wrapped huge value.
            t.mark(Stage::Plan, base + 11_000);
            let report = t.finish();
            assert_eq!(report.is_some(), i + 1 == REPORT_EVERY, "a report every {REPORT_EVERY} decisions");
        }
        assert_eq!(t.report(), "attache stages: n=4000 read_body=3.00 parse=9.00");
        assert_eq!(t.finish(), None, "finish without begin is not a decision");
    }

    #[test]
    fn probes_split_the_stage_they_run_in() {
        let mut t = Totals::default();
        t.probe("plan.hashes", 1_000); // outside a decision: ignored
        t.begin(0);
        t.mark(Stage::Parse, 2_000);
        t.probe("plan.hashes", 3_000);
        t.probe("plan.schedule", 7_000);
        t.mark(Stage::Plan, 8_000);
        t.finish();
        assert_eq!(t.report(), "attache stages: n=1 parse=2.00 plan=1.00 plan.hashes=1.00 plan.schedule=4.00");
    }

    #[test]
    fn slow_decisions_are_summed_apart() {
        let mut t = Totals::default();
        t.begin(0);
        t.mark(Stage::Parse, 10_000);
        t.finish();
        t.begin(100_000);
        t.mark(Stage::Parse, 110_000);
        t.probe("plan.schedule", 200_000);
        t.mark(Stage::Plan, 201_000);
        t.finish();
        assert_eq!(
            t.report(),
            "attache stages: n=2 parse=10.00 plan=0.50 plan.schedule=45.00 | over 80 us: n=1 parse=10.00 plan=1.00 plan.schedule=90.00"
        );
    }

    #[test]
    fn pending_sums_are_taken_once() {
        let mut t = Totals::default();
        t.begin(0);
        t.mark(Stage::Parse, 10_000);
        t.finish();
        t.begin(100_000);
        t.mark(Stage::Plan, 200_000);
        t.finish();
        let (all, slow) = t.take_pending();
        assert_eq!((all.decisions, slow.decisions), (2, 1));
        assert_eq!(all.ns[Stage::Plan as usize], 100_000);
        let (all, slow) = t.take_pending();
        assert_eq!((all.decisions, slow.decisions), (0, 0), "taken already");
        assert!(t.report().contains("n=2"), "the log's running sums are kept: {}", t.report());
    }

    /// Through the filter: off by default, nothing is defined; on, every stage's time reaches
    /// Envoy's counters at the next tick.
    #[test]
    fn the_option_puts_each_stage_in_envoy_counters() {
        use crate::testing::harness::{prompt, publish, snapshot, Filter, Request};
        use crate::testing::{metric, with};

        publish(&snapshot(2));
        with(|h| h.clock_step_ns = 1_000);
        let mut off = Filter::configure("");
        off.send(Request::completion(&prompt("one"))).primary().expect("routed");
        off.tick();
        assert_eq!(metric("attache.stage.decisions"), None, "off by default");

        let (mut on, ok) = Filter::try_configure_as(2, r#"{"stage_timings":true}"#);
        assert!(ok);
        for p in ["one", "two", "three"] {
            on.send(Request::completion(&prompt(p))).primary().expect("routed");
        }
        assert_eq!(metric("attache.stage.decisions"), None, "added at the tick, not per request");
        on.tick();
        assert_eq!(metric("attache.stage.decisions"), Some(3));
        for stage in ["read_body", "parse", "plan", "headers", "decision_metric"] {
            let ns = metric(&format!("attache.stage.{stage}.ns")).unwrap_or(0);
            assert!(ns >= 3_000, "{stage}: {ns} ns over 3 decisions, at least one 1 µs reading each");
        }
        let hashes = metric("attache.stage.plan.hashes.ns").unwrap_or(0);
        assert!(hashes >= 3_000, "the probes inside policies::plan report too: {hashes}");
        on.tick();
        assert_eq!(metric("attache.stage.decisions"), Some(3), "each decision is added once");
    }

    #[test]
    fn every_stage_is_listed_once_in_order() {
        for (i, s) in Stage::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i, "{}", s.name());
        }
    }
}
