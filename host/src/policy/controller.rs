//! The rollout controller's memory and its pass over the canaries: each canary is judged
//! ([`attache_policies::canary::judge`]) on the counters since it started, against the stable
//! version's over the same window. The policy service reads the counters from Envoy and acts.

use std::collections::{BTreeMap, HashMap};

use attache_policies::canary::{self, ArmCounters, AutoPolicy, Verdict};

use super::rollout::RolloutState;

/// `(slot, arm)` → counters.
pub type Counters = BTreeMap<(String, String), ArmCounters>;

fn arm(counters: &Counters, slot: &str, arm: &str) -> ArmCounters {
    counters.get(&(slot.to_owned(), arm.to_owned())).copied().unwrap_or_default()
}

/// What the controller remembers between passes.
#[derive(Debug, Default)]
pub struct Controller {
    /// By slot: the canary's start time and the (canary, stable) counters then.
    baselines: HashMap<String, (u64, ArmCounters, ArmCounters)>,
    /// The last verdict per slot, as shown by the status API.
    verdicts: BTreeMap<String, String>,
}

impl Controller {
    /// A canary of `slot` started at `started_ms`: judge it on what happens after `counters`.
    pub fn start(&mut self, slot: &str, started_ms: u64, counters: &Counters) {
        let base = (started_ms, arm(counters, slot, "canary"), arm(counters, slot, "stable"));
        self.baselines.insert(slot.to_owned(), base);
    }

    /// Judge every canary in `state` at `now_ms` on its window of `counters`, remembering each
    /// verdict. A canary not seen starting is judged from this pass on.
    pub fn judge(
        &mut self,
        state: &RolloutState,
        counters: &Counters,
        policy: &AutoPolicy,
        now_ms: u64,
    ) -> Vec<(String, Verdict)> {
        let canaries = state.slots.iter().filter_map(|(slot, s)| s.canary.as_ref().map(|c| (slot, c.started_unix_ms)));
        let mut out = Vec::new();
        for (slot, started) in canaries {
            let (now_c, now_s) = (arm(counters, slot, "canary"), arm(counters, slot, "stable"));
            let base = self.baselines.entry(slot.clone()).or_insert((started, now_c, now_s));
            if base.0 != started {
                *base = (started, now_c, now_s);
            }
            let (c, s) = (now_c.since(&base.1), now_s.since(&base.2));
            let verdict = canary::judge(policy, &c, &s, now_ms.saturating_sub(started));
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

    #[test]
    fn canaries_are_judged_on_their_window_only() {
        let deployed = Deployed { sha256: "a".into(), version: "v".into(), weight: 1.0, params: Default::default() };
        let mut state = RolloutState::default();
        let slot = SlotState {
            canary: Some(Canary { deployed, percent: 5.0, started_unix_ms: 1_000 }),
            ..SlotState::default()
        };
        state.slots.insert("s".into(), slot);
        let p = AutoPolicy { min_requests: 10, min_duration_ms: 0, ..AutoPolicy::default() };
        let mut ctl = Controller::default();
        ctl.start("s", 1_000, &counters(500, 500));
        let v = ctl.judge(&state, &counters(505, 600), &p, 2_000);
        assert!(matches!(&v[..], [(s, Verdict::Wait(r))] if s == "s" && r.starts_with("5 of 10")), "{v:?}");
        assert!(ctl.verdicts()["s"].starts_with("Wait"));
        let v = ctl.judge(&state, &counters(520, 700), &p, 2_000);
        assert!(matches!(&v[..], [(_, Verdict::Promote(_))]), "{v:?}");
        // A new canary in the slot restarts the window from the counters of the first pass.
        if let Some(c) = state.slots.get_mut("s").and_then(|s| s.canary.as_mut()) {
            c.started_unix_ms = 3_000;
        }
        let v = ctl.judge(&state, &counters(520, 700), &p, 4_000);
        assert!(matches!(&v[..], [(_, Verdict::Wait(_))]), "{v:?}");
    }
}
