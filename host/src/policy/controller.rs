//! The rollout controller's memory and its pass over the canaries: each canary is judged
//! ([`attache_policies::canary::judge`]) on what its arm did since it started, against the stable
//! version's over the same window. The policy service reads the counters from Envoy and acts.
//!
//! Envoys come and go (gateway pods restart, scale, or miss a read), so the window is not the
//! difference of two sums: the controller keeps each Envoy's last reading and adds up, per
//! Envoy, what changed since.
//! - An Envoy seen for the first time only sets its baseline (its counters hold earlier
//!   canaries).
//! - An Envoy that restarted (its uptime or a counter went back) lost what it counted since the
//!   last read, and its fresh VMs start with cold tables: it is excluded from the window for
//!   `restart_grace_ms`, then counted again from a new baseline.
//! - An Envoy that was not read this pass is missing: nothing of it is lost (its next reading
//!   covers the gap), but the verdict says it was not read. One unread for
//!   [`FORGET_AFTER_MS`] is forgotten.
//!
//! Each verdict names the Envoys it left out and why.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;
use serde_json::{json, Value};

use attache_policies::canary::{self, ArmCounters, AutoPolicy, ShadowReport, Verdict};

use super::rollout::RolloutState;

/// `(slot, arm)` → counters.
pub type Counters = BTreeMap<(String, String), ArmCounters>;

/// One Envoy's reading: its rollout counters, and how long it has been up (`server.uptime`,
/// seconds), which tells a restart even when the counters have grown past their old values.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reading {
    pub counters: Counters,
    pub uptime_s: Option<u64>,
}

/// One reading of every Envoy that answered, by its name.
pub type PerEnvoy = BTreeMap<String, Reading>;

/// An Envoy not read for this long is forgotten (a gateway pod scaled away).
pub const FORGET_AFTER_MS: u64 = 60_000;

fn arm(counters: &Counters, slot: &str, arm: &str) -> ArmCounters {
    counters.get(&(slot.to_owned(), arm.to_owned())).copied().unwrap_or_default()
}

fn add(into: &mut ArmCounters, d: &ArmCounters) {
    into.add(d);
}

/// Every Envoy's counters summed (what the status shows).
pub fn sum(per: &PerEnvoy) -> Counters {
    let mut out = Counters::new();
    for reading in per.values() {
        for (k, v) in &reading.counters {
            add(out.entry(k.clone()).or_default(), v);
        }
    }
    out
}

/// Whether `now` is a restarted Envoy's reading, `prev` its last: its uptime or any counter
/// went back.
fn restarted(now: &Reading, prev: &Reading) -> bool {
    if let (Some(n), Some(p)) = (now.uptime_s, prev.uptime_s) {
        if n < p {
            return true;
        }
    }
    prev.counters.iter().any(|(k, p)| {
        let n = now.counters.get(k).copied().unwrap_or_default();
        n.requests < p.requests || n.errors < p.errors || n.traps < p.traps || n.ttfb_us < p.ttfb_us
    })
}

/// Why an Envoy is left out of a canary's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "reason")]
pub enum Excluded {
    /// It restarted at `at_ms`; counted again from `until_ms`.
    Restarted { at_ms: u64, until_ms: u64 },
    /// It was not read on the last pass.
    NotRead,
}

/// A canary's window: when it started, what each arm did since, and the Envoys left out.
#[derive(Debug, Clone, Default)]
struct Window {
    started_ms: u64,
    canary: ArmCounters,
    stable: ArmCounters,
    /// A shadow run: the candidate's picks, and the live picks of the same requests.
    shadow: ArmCounters,
    live: ArmCounters,
    excluded: BTreeMap<String, Excluded>,
}

impl Window {
    fn new(started_ms: u64) -> Self {
        Self { started_ms, ..Self::default() }
    }

    /// Add what each Envoy did since the last pass, leaving out those that restarted (for
    /// `restart_grace_ms`) or were not read (`known` but absent from this reading).
    fn advance(
        &mut self,
        changes: &BTreeMap<String, Change>,
        known: &[String],
        slot: &str,
        policy: &AutoPolicy,
        now_ms: u64,
    ) {
        let w = self;
        // Who is left out this pass. A restarted Envoy whose grace ends now rejoins from
        // this reading: what it did before it is still inside the grace.
        let mut rejoined = Vec::new();
        w.excluded.retain(|envoy, why| match why {
            Excluded::Restarted { until_ms, .. } if now_ms >= *until_ms => {
                rejoined.push(envoy.clone());
                false
            }
            Excluded::Restarted { .. } => true,
            Excluded::NotRead => false,
        });
        for envoy in known {
            w.excluded.entry(envoy.clone()).or_insert(Excluded::NotRead);
        }
        for (envoy, change) in changes {
            match change {
                Change::Restarted => {
                    let until_ms = now_ms.saturating_add(policy.restart_grace_ms);
                    w.excluded.insert(envoy.clone(), Excluded::Restarted { at_ms: now_ms, until_ms });
                }
                Change::Delta(_) if w.excluded.contains_key(envoy) || rejoined.contains(envoy) => {}
                Change::Delta(d) => {
                    add(&mut w.canary, &arm(d, slot, "canary"));
                    add(&mut w.stable, &arm(d, slot, "stable"));
                    add(&mut w.shadow, &arm(d, slot, "shadow"));
                    add(&mut w.live, &arm(d, slot, "live"));
                }
            }
        }
    }

    /// The Envoys left out, for a verdict: `; left out: a (restarted, excluded for 30 s), b (not read)`.
    fn note(&self, now_ms: u64) -> String {
        if self.excluded.is_empty() {
            return String::new();
        }
        let parts: Vec<String> = self
            .excluded
            .iter()
            .map(|(envoy, why)| match why {
                Excluded::Restarted { until_ms, .. } => format!(
                    "{envoy} (restarted; its counts excluded for {} s more)",
                    until_ms.saturating_sub(now_ms).div_ceil(1000)
                ),
                Excluded::NotRead => format!("{envoy} (not read this pass)"),
            })
            .collect();
        format!("; left out: {}", parts.join(", "))
    }
}

/// One Envoy's change since the last pass.
enum Change {
    /// Counted.
    Delta(Counters),
    /// Restarted since the last pass: nothing of it is counted this pass.
    Restarted,
}

/// What the controller remembers between passes.
#[derive(Debug, Default)]
pub struct Controller {
    /// Each Envoy's last reading and when it was taken.
    last: HashMap<String, (Reading, u64)>,
    /// By slot: the canary's window.
    windows: HashMap<String, Window>,
    /// The last verdict per slot, as shown by the status API.
    verdicts: BTreeMap<String, String>,
}

impl Controller {
    /// Take a reading at `now_ms`: each Envoy's change since its last one (an Envoy seen for
    /// the first time sets its baseline only). Envoys unread for [`FORGET_AFTER_MS`] are
    /// forgotten.
    fn observe(&mut self, per: &PerEnvoy, now_ms: u64) -> BTreeMap<String, Change> {
        let mut out = BTreeMap::new();
        for (envoy, now) in per {
            if let Some((prev, _)) = self.last.get(envoy) {
                let change = if restarted(now, prev) {
                    Change::Restarted
                } else {
                    let mut d = Counters::new();
                    for (k, v) in &now.counters {
                        let base = prev.counters.get(k).copied().unwrap_or_default();
                        d.insert(k.clone(), v.since(&base));
                    }
                    Change::Delta(d)
                };
                out.insert(envoy.clone(), change);
            }
            self.last.insert(envoy.clone(), (now.clone(), now_ms));
        }
        self.last.retain(|_, (_, at)| now_ms.saturating_sub(*at) < FORGET_AFTER_MS);
        out
    }

    /// A canary of `slot` started at `started_ms`: judge it on what happens after `per`.
    pub fn start(&mut self, slot: &str, started_ms: u64, per: &PerEnvoy) {
        self.observe(per, started_ms);
        self.windows.insert(slot.to_owned(), Window::new(started_ms));
    }

    /// Judge every canary in `state` at `now_ms` on its window, after adding what `per` shows
    /// happened since the last reading, remembering each verdict. A canary not seen starting is
    /// judged from this pass on.
    pub fn judge(
        &mut self,
        state: &RolloutState,
        per: &PerEnvoy,
        policy: &AutoPolicy,
        now_ms: u64,
    ) -> Vec<(String, Verdict)> {
        let changes = self.observe(per, now_ms);
        let known: Vec<String> = self.last.keys().filter(|e| !per.contains_key(*e)).cloned().collect();
        // Canaries, and shadow runs (judged by the gate when a canary is asked for, not here).
        let experiments = state.slots.iter().filter_map(|(slot, s)| {
            let canary = s.canary.as_ref().map(|c| (c.started_unix_ms, true));
            canary.or_else(|| s.shadow.as_ref().map(|c| (c.started_unix_ms, false))).map(|(t, c)| (slot, t, c))
        });
        let mut out = Vec::new();
        for (slot, started, is_canary) in experiments {
            let w = self.windows.entry(slot.clone()).or_insert_with(|| Window::new(started));
            if w.started_ms != started {
                *w = Window::new(started);
            }
            w.advance(&changes, &known, slot, policy, now_ms);
            if !is_canary {
                let r = ShadowReport::new(&w.shadow, &w.live);
                let note = w.note(now_ms);
                self.verdicts.insert(
                    slot.clone(),
                    format!(
                        "Shadow(\"{} requests: agreement {:.3}, hit-rate delta {:+.3}, load delta {:+.2}{note}\")",
                        r.requests, r.agreement, r.hit_delta, r.load_delta
                    ),
                );
                continue;
            }
            let verdict = canary::judge(policy, &w.canary, &w.stable, now_ms.saturating_sub(started));
            let note = w.note(now_ms);
            let verdict = match verdict {
                Verdict::Wait(r) => Verdict::Wait(r + &note),
                Verdict::Promote(r) => Verdict::Promote(r + &note),
                Verdict::Rollback(r) => Verdict::Rollback(r + &note),
            };
            self.verdicts.insert(slot.clone(), format!("{verdict:?}"));
            out.push((slot.clone(), verdict));
        }
        out
    }

    /// The shadow run of `slot` over its window, if one is being observed.
    pub fn shadow_report(&self, slot: &str) -> Option<ShadowReport> {
        self.windows.get(slot).map(|w| ShadowReport::new(&w.shadow, &w.live))
    }

    /// The last verdict per slot.
    pub fn verdicts(&self) -> &BTreeMap<String, String> {
        &self.verdicts
    }

    /// A slot's window as the status shows it: each arm's counts since the canary started, and
    /// the Envoys left out.
    pub fn window(&self, slot: &str) -> Option<Value> {
        let w = self.windows.get(slot)?;
        Some(json!({
            "started_unix_ms": w.started_ms,
            "canary": w.canary.json(),
            "stable": w.stable.json(),
            "shadow": (w.shadow.requests > 0).then(|| ShadowReport::new(&w.shadow, &w.live)),
            "excluded": w.excluded,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::super::rollout::{Canary, Deployed, SlotState};
    use super::*;

    fn counters(canary: u64, stable: u64) -> Counters {
        let c = |requests| ArmCounters { requests, ..ArmCounters::default() };
        [(("s".into(), "canary".into()), c(canary)), (("s".into(), "stable".into()), c(stable))].into()
    }

    fn envoys(readings: &[(&str, u64, u64)]) -> PerEnvoy {
        readings
            .iter()
            .map(|(e, c, s)| ((*e).to_owned(), Reading { counters: counters(*c, *s), uptime_s: None }))
            .collect()
    }

    fn state(started: u64) -> RolloutState {
        let deployed = Deployed { sha256: "a".into(), version: "v".into(), weight: 1.0, params: Default::default() };
        let mut state = RolloutState::default();
        let slot = SlotState {
            canary: Some(Canary { deployed, percent: 5.0, started_unix_ms: started }),
            ..SlotState::default()
        };
        state.slots.insert("s".into(), slot);
        state
    }

    #[test]
    fn canaries_are_judged_on_their_window_only() {
        let mut state = state(1_000);
        let p = AutoPolicy { min_requests: 10, min_duration_ms: 0, ..AutoPolicy::default() };
        let mut ctl = Controller::default();
        ctl.start("s", 1_000, &envoys(&[("a", 500, 500)]));
        let v = ctl.judge(&state, &envoys(&[("a", 505, 600)]), &p, 2_000);
        assert!(matches!(&v[..], [(s, Verdict::Wait(r))] if s == "s" && r.starts_with("5 of 10")), "{v:?}");
        assert!(ctl.verdicts()["s"].starts_with("Wait"));
        let v = ctl.judge(&state, &envoys(&[("a", 520, 700)]), &p, 2_000);
        assert!(matches!(&v[..], [(_, Verdict::Promote(_))]), "{v:?}");
        // A new canary in the slot restarts the window from the counters of the first pass.
        if let Some(c) = state.slots.get_mut("s").and_then(|s| s.canary.as_mut()) {
            c.started_unix_ms = 3_000;
        }
        let v = ctl.judge(&state, &envoys(&[("a", 520, 700)]), &p, 4_000);
        assert!(matches!(&v[..], [(_, Verdict::Wait(_))]), "{v:?}");
    }

    #[test]
    fn a_shadow_run_is_observed_over_its_window_and_never_acted_on() {
        let deployed = Deployed { sha256: "b".into(), version: "w".into(), weight: 1.0, params: Default::default() };
        let mut state = RolloutState::default();
        let slot = SlotState {
            shadow: Some(Canary { deployed, percent: 0.0, started_unix_ms: 1_000 }),
            ..SlotState::default()
        };
        state.slots.insert("s".into(), slot);
        let reading = |requests: u64, agree: u64| -> PerEnvoy {
            let mut c = Counters::new();
            c.insert(
                ("s".into(), "shadow".into()),
                ArmCounters { requests, agree, hit_permille: requests * 200, ..Default::default() },
            );
            c.insert(
                ("s".into(), "live".into()),
                ArmCounters { requests, hit_permille: requests * 900, ..Default::default() },
            );
            [("a".to_owned(), Reading { counters: c, uptime_s: None })].into_iter().collect()
        };
        let mut ctl = Controller::default();
        // Earlier comparisons (another shadow's) are the baseline, not the window.
        ctl.start("s", 1_000, &reading(1_000, 1_000));
        let v = ctl.judge(&state, &reading(1_100, 1_025), &AutoPolicy::default(), 2_000);
        assert!(v.is_empty(), "a shadow is never promoted or rolled back: {v:?}");
        let r = ctl.shadow_report("s").unwrap();
        assert_eq!(r.requests, 100);
        assert!((r.agreement - 0.25).abs() < 1e-9 && (r.hit_delta + 0.7).abs() < 1e-9, "{r:?}");
        assert!(ctl.verdicts()["s"].starts_with("Shadow(\"100 requests: agreement 0.250"), "{:?}", ctl.verdicts());
    }

    #[test]
    fn envoys_that_come_go_or_restart_count_only_what_they_did_in_the_window() {
        let state = state(1_000);
        let p = AutoPolicy {
            min_requests: 1_000_000,
            min_duration_ms: 0,
            restart_grace_ms: 10_000,
            ..AutoPolicy::default()
        };
        let mut ctl = Controller::default();
        ctl.start("s", 1_000, &envoys(&[("a", 100, 100), ("b", 50, 50)]));
        // b misses a read: a's progress counts, b's is not lost, and the verdict says b was not read.
        let v = ctl.judge(&state, &envoys(&[("a", 110, 120)]), &p, 2_000);
        assert!(
            matches!(&v[..], [(_, Verdict::Wait(r))] if r.ends_with("; left out: b (not read this pass)")),
            "{v:?}"
        );
        // b is back (+5), c appears with lifetime counters from earlier canaries (a baseline only).
        let v = ctl.judge(&state, &envoys(&[("a", 110, 120), ("b", 55, 60), ("c", 9_000, 9_000)]), &p, 3_000);
        assert!(matches!(&v[..], [(_, Verdict::Wait(r))] if !r.contains("left out")), "{v:?}");
        // a restarted: what it counted since the last read is lost, and it is left out for the grace.
        let v = ctl.judge(&state, &envoys(&[("a", 3, 4), ("b", 55, 60), ("c", 9_001, 9_002)]), &p, 4_000);
        assert!(
            matches!(&v[..], [(_, Verdict::Wait(r))] if r.ends_with("left out: a (restarted; its counts excluded for 10 s more)")),
            "{v:?}"
        );
        ctl.judge(&state, &envoys(&[("a", 50, 50), ("b", 55, 60), ("c", 9_001, 9_002)]), &p, 8_000);
        let w = &ctl.windows["s"];
        assert_eq!((w.canary.requests, w.stable.requests), (10 + 5 + 1, 20 + 10 + 2));
        // After the grace, a counts again from the reading it had then.
        ctl.judge(&state, &envoys(&[("a", 60, 70), ("b", 55, 60), ("c", 9_001, 9_002)]), &p, 14_000);
        ctl.judge(&state, &envoys(&[("a", 61, 72), ("b", 55, 60), ("c", 9_001, 9_002)]), &p, 15_000);
        let w = &ctl.windows["s"];
        assert!(w.excluded.is_empty(), "{:?}", w.excluded);
        assert_eq!((w.canary.requests, w.stable.requests), (10 + 5 + 1 + 1, 20 + 10 + 2 + 2));
        assert_eq!(sum(&envoys(&[("a", 1, 2), ("b", 3, 4)]))[&("s".into(), "canary".into())].requests, 4);
    }

    #[test]
    fn a_restart_is_told_by_uptime_even_when_the_counters_have_grown_past_their_old_values() {
        let state = state(1_000);
        let p = AutoPolicy { min_requests: 1_000_000, min_duration_ms: 0, ..AutoPolicy::default() };
        let up = |c: u64, s: u64, uptime: u64| -> PerEnvoy {
            [("a".to_owned(), Reading { counters: counters(c, s), uptime_s: Some(uptime) })].into()
        };
        let mut ctl = Controller::default();
        ctl.start("s", 1_000, &up(10, 10, 100));
        ctl.judge(&state, &up(20, 20, 101), &p, 2_000);
        // Restarted and busy: more requests than before, but up for 1 s instead of 102.
        ctl.judge(&state, &up(40, 40, 1), &p, 3_000);
        let w = &ctl.windows["s"];
        assert_eq!(w.canary.requests, 10, "the restarted reading is not a delta");
        assert!(matches!(w.excluded.get("a"), Some(Excluded::Restarted { at_ms: 3_000, .. })), "{:?}", w.excluded);
        assert_eq!(ctl.window("s").unwrap()["excluded"]["a"]["reason"], "restarted");
    }

    #[test]
    fn an_envoy_unread_for_a_minute_is_forgotten() {
        let state = state(1_000);
        let p = AutoPolicy { min_requests: 1_000_000, min_duration_ms: 0, ..AutoPolicy::default() };
        let mut ctl = Controller::default();
        ctl.start("s", 1_000, &envoys(&[("a", 1, 1), ("b", 1, 1)]));
        let v = ctl.judge(&state, &envoys(&[("a", 2, 2)]), &p, 30_000);
        assert!(matches!(&v[..], [(_, Verdict::Wait(r))] if r.contains("b (not read")), "{v:?}");
        let v = ctl.judge(&state, &envoys(&[("a", 3, 3)]), &p, 1_000 + FORGET_AFTER_MS);
        assert!(matches!(&v[..], [(_, Verdict::Wait(r))] if !r.contains("left out")), "{v:?}");
    }
}
