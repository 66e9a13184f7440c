//! The scheduler's rollout arm: how two scheduler filters in one chain split the traffic.
//!
//! With the policy chain, the HTTP chain holds two scheduler filters, both ECDS resources:
//! `attache.scheduler.canary` first, then `attache.scheduler`. Each runs with an [`ArmConfig`].
//! The canary acts only on requests whose rollout bucket (from the session, as for scorer
//! slots: [`crate::scoring::bucket_of`]) falls in its range, and marks each request it
//! schedules in filter state ([`SCHEDULED_PROPERTY`]). The stable filter after it acts on every
//! request not marked. So the stable version needs to know nothing of the canary's range: the
//! bootstrap's own scheduler is a valid stable arm, and a session stays on one arm.
//!
//! The mark is filter state, which a client cannot set: a request that claims to be scheduled
//! is scheduled again.

use serde::{Deserialize, Serialize};

use crate::scoring::{bucket_of, bucket_of_seed, BucketRange, BUCKETS};

/// Filter-state key (`wasm.attache_scheduled`) a scheduler arm sets to its [`ArmConfig::mark`]
/// when it schedules a request. A later scheduler filter that finds it lets the request pass.
pub const SCHEDULED_PROPERTY: &str = "attache_scheduled";
/// The policy slot of the scheduler module and its configuration.
pub const SCHEDULER_SLOT: &str = "scheduler";
/// Filter-state key (`wasm.attache_shadow_pick`) where a shadow scheduler arm leaves the pick
/// it would have made (`ip:port|hit|load`), for the scheduler that acts to grade.
pub const SHADOW_PROPERTY: &str = "attache_shadow_pick";
/// The response header naming the arm that scheduled a request (`canary@<sha256 prefix>`), with
/// `scoring.response_header` on.
pub const RESPONSE_HEADER: &str = "x-attache-scheduler";

/// One scheduler filter's side of a rollout (`rollout` in the scheduler's configuration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ArmConfig {
    /// `stable`, `canary`, or `shadow` (plans every request as it would, acts on none): the
    /// name its Envoy counters carry (`attache.rollout.scheduler.<arm>.*`).
    pub arm: String,
    /// The module version it runs: the host puts the module's sha256 here; `bootstrap` is the
    /// module the bootstrap names.
    pub version: String,
    /// The rollout buckets `[from, to)` it acts on, of `0..10000`.
    pub buckets: [u16; 2],
}

impl Default for ArmConfig {
    fn default() -> Self {
        Self { arm: "stable".into(), version: "bootstrap".into(), buckets: [0, BUCKETS] }
    }
}

impl ArmConfig {
    pub fn range(&self) -> BucketRange {
        BucketRange { from: self.buckets[0], to: self.buckets[1] }
    }

    /// Whether it acts on no request at all (an idle canary filter).
    pub fn idle(&self) -> bool {
        self.buckets[0] >= self.buckets[1]
    }

    /// Whether it is a shadow: it plans, the scheduler after it acts.
    pub fn shadow(&self) -> bool {
        self.arm == "shadow"
    }

    /// Whether it acts on a request with this session key (`None`: the request's own `seed`
    /// spreads it).
    pub fn acts_on(&self, session: Option<&str>, seed: u64) -> bool {
        let range = self.range();
        if range == BucketRange::ALL || (range.from == 0 && range.to >= BUCKETS) {
            return true;
        }
        let bucket = session.map_or_else(|| bucket_of_seed(seed), |s| bucket_of(s.as_bytes()));
        range.contains(bucket)
    }

    /// The arm and a short version (`canary@3f2a9c01b2e4`): the filter-state mark, and the
    /// response header's value.
    pub fn mark(&self) -> String {
        format!("{}@{}", self.arm, self.version.get(..12).unwrap_or(&self.version))
    }

    pub fn check(&self) -> Result<(), String> {
        if !matches!(self.arm.as_str(), "stable" | "canary" | "shadow") {
            return Err(format!("rollout.arm {:?} must be \"stable\", \"canary\" or \"shadow\"", self.arm));
        }
        if self.buckets[1] > BUCKETS || self.buckets[0] > self.buckets[1] {
            return Err(format!("rollout.buckets {:?} must be [from, to] with from <= to <= {BUCKETS}", self.buckets));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arm(from: u16, to: u16) -> ArmConfig {
        ArmConfig { arm: "canary".into(), version: "0123456789abcdef".into(), buckets: [from, to] }
    }

    #[test]
    fn a_session_stays_on_one_arm_and_the_share_follows_the_range() {
        let (canary, _) = BucketRange::split(20.0);
        let a = arm(canary.from, canary.to);
        let n = 5_000;
        let on: Vec<bool> = (0..n).map(|i| a.acts_on(Some(&format!("s{i}")), i)).collect();
        // The same session lands on the same side whatever the seed.
        assert!((0..n).all(|i| a.acts_on(Some(&format!("s{i}")), i + 77) == on[i as usize]));
        let share = on.iter().filter(|&&x| x).count() as f64 / n as f64;
        assert!((share - 0.2).abs() < 0.03, "share {share}");
        assert!(ArmConfig::default().acts_on(None, 3) && ArmConfig::default().acts_on(Some("x"), 3));
        assert!(arm(0, 0).idle() && !arm(0, 0).acts_on(Some("x"), 1));
        assert_eq!(a.mark(), "canary@0123456789ab");
    }

    #[test]
    fn bad_arms_are_refused_with_a_reason() {
        assert!(arm(0, 2000).check().is_ok());
        assert!(arm(10, 5).check().unwrap_err().contains("from <= to"));
        assert!(arm(0, 10_001).check().is_err());
        let blue = ArmConfig { arm: "blue".into(), ..ArmConfig::default() };
        assert!(blue.check().unwrap_err().contains("stable"));
        let shadow = ArmConfig { arm: "shadow".into(), ..ArmConfig::default() };
        assert!(shadow.check().is_ok() && shadow.shadow() && !shadow.idle());
    }
}
