//! The rollout controller's memory and its pass over the canaries: each canary is judged
//! ([`attache_policies::canary::judge`]) on what its arm did since it started, against the stable
//! version's over the same window. The policy service reads the counters from Envoy and acts.
//!
//! Envoys come and go (gateway pods restart, scale, or miss a read), so the window is not the
//! difference of two sums: the controller keeps each Envoy's last reading and adds up, per
//! Envoy, what changed since. An Envoy seen for the first time only sets its baseline (its
//! counters hold earlier canaries); one whose counters went back was restarted, and what it
//! counts now is all new.

use std::collections::{BTreeMap, HashMap};

use attache_policies::canary::{self, ArmCounters, AutoPolicy, Verdict};

use super::rollout::RolloutState;

/// `(slot, arm)` → counters.
pub type Counters = BTreeMap<(String, String), ArmCounters>;

/// One reading: each Envoy's counters, by its name.
pub type PerEnvoy = BTreeMap<String, Counters>;

fn arm(counters: &Counters, slot: &str, arm: &str) -> ArmCounters {
    counters.get(&(slot.to_owned(), arm.to_owned())).copied().unwrap_or_default()
}

fn add(into: &mut ArmCounters, d: &ArmCounters) {
    into.requests += d.requests;
    into.errors += d.errors;
    into.traps += d.traps;
    into.ttfb_us += d.ttfb_us;
    into.hit_permille += d.hit_permille;
}

/// Every Envoy's counters summed (what the status shows).
pub fn sum(per: &PerEnvoy) -> Counters {
    let mut out = Counters::new();
    for counters in per.values() {
        for (k, v) in counters {
            add(out.entry(k.clone()).or_default(), v);
        }
    }
    out
}

/// What one arm of one Envoy did between two readings: a counter that went back means the
/// Envoy restarted, so its whole reading is new.
fn delta(now: &ArmCounters, prev: &ArmCounters) -> ArmCounters {
    if now.requests < prev.requests || now.errors < prev.errors || now.traps < prev.traps {
        *now
    } else {
        now.since(prev)
    }
}

/// A canary's window: when it started, and what each arm did since.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    started_ms: u64,
    canary: ArmCounters,
    stable: ArmCounters,
}

/// What the controller remembers between passes.
#[derive(Debug, Default)]
pub struct Controller {
    /// Each Envoy's last reading.
    last: HashMap<String, Counters>,
    /// By slot: the canary's window.
    windows: HashMap<String, Window>,
    /// The last verdict per slot, as shown by the status API.
    verdicts: BTreeMap<String, String>,
}

impl Controller {
    /// Take a reading: what changed since the last one, summed over the Envoys read both times
    /// (or restarted in between).
    fn observe(&mut self, per: &PerEnvoy) -> Counters {
        let mut out = Counters::new();
        for (envoy, now) in per {
            if let Some(prev) = self.last.get(envoy) {
                for (k, v) in now {
                    let d = delta(v, &prev.get(k).copied().unwrap_or_default());
                    add(out.entry(k.clone()).or_default(), &d);
                }
            }
            self.last.insert(envoy.clone(), now.clone());
        }
        out
    }

    /// A canary of `slot` started at `started_ms`: judge it on what happens after `per`.
    pub fn start(&mut self, slot: &str, started_ms: u64, per: &PerEnvoy) {
        self.observe(per);
        self.windows.insert(slot.to_owned(), Window { started_ms, ..Window::default() });
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
        let d = self.observe(per);
        let canaries = state.slots.iter().filter_map(|(slot, s)| s.canary.as_ref().map(|c| (slot, c.started_unix_ms)));
        let mut out = Vec::new();
        for (slot, started) in canaries {
            let w = self.windows.entry(slot.clone()).or_insert(Window { started_ms: started, ..Window::default() });
            if w.started_ms != started {
                *w = Window { started_ms: started, ..Window::default() };
            }
            add(&mut w.canary, &arm(&d, slot, "canary"));
            add(&mut w.stable, &arm(&d, slot, "stable"));
            let verdict = canary::judge(policy, &w.canary, &w.stable, now_ms.saturating_sub(started));
            self.verdicts.insert(slot.clone(), format!("{verdict:?}"));
            out.push((slot.clone(), verdict));
        }
        out
    }

    /// The last verdict per slot.
    pub fn verdicts(&self) -> &BTreeMap<String, String> {
        &self.verdicts
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
        readings.iter().map(|(e, c, s)| ((*e).to_owned(), counters(*c, *s))).collect()
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
    fn envoys_that_come_go_or_restart_count_only_what_they_did_in_the_window() {
        let state = state(1_000);
        let p = AutoPolicy { min_requests: 1_000_000, min_duration_ms: 0, ..AutoPolicy::default() };
        let mut ctl = Controller::default();
        ctl.start("s", 1_000, &envoys(&[("a", 100, 100), ("b", 50, 50)]));
        // b misses a read: a's progress counts, b's is not lost.
        ctl.judge(&state, &envoys(&[("a", 110, 120)]), &p, 2_000);
        // b is back (+5), c appears with lifetime counters from earlier canaries (a baseline only).
        ctl.judge(&state, &envoys(&[("a", 110, 120), ("b", 55, 60), ("c", 9_000, 9_000)]), &p, 3_000);
        // a restarted: its counters start again from 0, and the 3 it counts now are new.
        ctl.judge(&state, &envoys(&[("a", 3, 4), ("b", 55, 60), ("c", 9_001, 9_002)]), &p, 4_000);
        let w = ctl.windows["s"];
        assert_eq!((w.canary.requests, w.stable.requests), (10 + 5 + 3 + 1, 20 + 10 + 4 + 2));
        assert_eq!(sum(&envoys(&[("a", 1, 2), ("b", 3, 4)]))[&("s".into(), "canary".into())].requests, 4);
    }
}
