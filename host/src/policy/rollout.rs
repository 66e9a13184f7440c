//! Rollout state: which module version each scorer slot runs, the canary in flight, and every
//! transition. The ECDS server turns this state into Envoy filter configurations; the admin API
//! and the controller change it.
//!
//! Each slot `<s>` has two filters in Envoy's chain, both ECDS resources: `attache.scorer.<s>`
//! (stable) and `attache.scorer.<s>.canary`. A canary at `p`% gets rollout buckets `[0, p%)`,
//! the stable version the rest; the scheduler buckets requests by session, so a session stays
//! on one version. Promoting gives the canary's module all buckets in the stable filter;
//! rolling back empties the canary's range.
//!
//! The state is persisted (`rollout.json`, written then renamed) and every transition is
//! appended to `transitions.jsonl`, so a restarted host serves the same versions.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use attache_policies::arm::SCHEDULER_SLOT;
use attache_policies::scoring::BucketRange;
use serde::{Deserialize, Serialize};

/// A module version deployed in a slot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Deployed {
    pub sha256: String,
    /// The operator's version label.
    pub version: String,
    /// Weight the picker gives this scorer's 0..1 scores.
    pub weight: f64,
    pub params: serde_json::Value,
}

/// A canary in flight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Canary {
    pub deployed: Deployed,
    pub percent: f64,
    pub started_unix_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SlotState {
    pub stable: Option<Deployed>,
    pub canary: Option<Canary>,
    /// A candidate scoring every request in shadow (in the canary's filter, acting on none),
    /// until a canary replaces it or it is rolled back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<Canary>,
    /// Stable versions replaced by promotions, newest last (rollback without a canary goes
    /// back one).
    #[serde(default)]
    pub previous: Vec<Deployed>,
}

/// One change of a slot, as shown by `status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    pub at_unix_ms: u64,
    pub slot: String,
    /// `rollout`, `promote`, `rollback`.
    pub action: String,
    /// `operator` or `controller`.
    pub by: String,
    pub from: Option<String>,
    pub to: Option<String>,
    pub reason: String,
    /// The host replica that made it (policy state in Kubernetes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

impl Transition {
    /// A transition of `slot` made now, by this replica (the Kubernetes store stamps `host`).
    fn new(slot: &str, action: &str, by: &str, from: Option<String>, to: Option<String>, reason: String) -> Self {
        Self {
            at_unix_ms: now_ms(),
            slot: slot.into(),
            action: action.into(),
            by: by.into(),
            from,
            to,
            reason,
            host: None,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RolloutState {
    pub slots: BTreeMap<String, SlotState>,
    /// Bumped on every change; ECDS resource versions derive from it and the content.
    pub revision: u64,
}

/// Why a rollout operation is refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RolloutError {
    #[error("slot {0:?} is not valid: use 1-32 characters of [a-z0-9_]")]
    BadSlot(String),
    #[error("canary percent {0} must be in (0, 100]")]
    BadPercent(f64),
    #[error("weight {0} must be a finite number >= 0")]
    BadWeight(f64),
    #[error("slot {0:?} has no canary to {1}")]
    NoCanary(String, &'static str),
    #[error("slot {0:?} has nothing to roll back to")]
    NothingToRollBack(String),
    #[error("slot {0:?} already has a canary ({1}); promote or roll it back first")]
    CanaryInFlight(String, String),
}

pub fn valid_slot(s: &str) -> bool {
    !s.is_empty() && s.len() <= 32 && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn label(d: &Deployed) -> String {
    format!("{}@{}", d.version, d.sha256.get(..12).unwrap_or(&d.sha256))
}

/// The stable and canary filter of a slot, as ECDS resource names: `attache.scorer.<slot>`, or
/// for the scheduler slot the scheduler itself.
pub fn resource_names(slot: &str) -> (String, String) {
    if slot == SCHEDULER_SLOT {
        return ("attache.scheduler".into(), "attache.scheduler.canary".into());
    }
    (format!("attache.scorer.{slot}"), format!("attache.scorer.{slot}.canary"))
}

/// What one ECDS resource should run.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterSpec {
    pub resource: String,
    pub slot: String,
    pub arm: &'static str,
    pub deployed: Deployed,
    pub buckets: BucketRange,
}

impl FilterSpec {
    /// Whether it is a scheduler filter (the `scheduler` slot) rather than a scorer's.
    pub fn is_scheduler(&self) -> bool {
        self.slot == SCHEDULER_SLOT
    }

    /// The plugin configuration: for a scheduler, its configuration (`params`) with its
    /// rollout arm; for a scorer, what the scorer SDK reads.
    pub fn plugin_config(&self) -> String {
        if self.is_scheduler() {
            let mut config = match &self.deployed.params {
                serde_json::Value::Object(m) => serde_json::Value::Object(m.clone()),
                _ => serde_json::json!({}),
            };
            config["rollout"] = serde_json::json!({
                "arm": self.arm,
                "version": self.deployed.sha256,
                "buckets": [self.buckets.from, self.buckets.to],
            });
            return config.to_string();
        }
        serde_json::json!({
            "slot": self.slot,
            "arm": self.arm,
            "version": self.deployed.sha256,
            "weight": self.deployed.weight,
            "buckets": [self.buckets.from, self.buckets.to],
            "params": self.deployed.params,
        })
        .to_string()
    }
}

impl RolloutState {
    /// Every ECDS resource the state defines. A slot without a stable version leaves its
    /// stable filter on Envoy's default (passthrough); a slot without a canary runs the stable
    /// module in its canary filter with an empty range (same code, so Envoy shares the VM).
    pub fn filters(&self) -> Vec<FilterSpec> {
        let mut out = Vec::new();
        for (slot, s) in &self.slots {
            let (stable_name, canary_name) = resource_names(slot);
            let (canary_range, stable_range) = match &s.canary {
                Some(c) => BucketRange::split(c.percent),
                None => (BucketRange::NONE, BucketRange::ALL),
            };
            if let Some(d) = &s.stable {
                out.push(FilterSpec {
                    resource: stable_name,
                    slot: slot.clone(),
                    arm: "stable",
                    deployed: d.clone(),
                    buckets: stable_range,
                });
            }
            // An idle scheduler canary stays on Envoy's default (a passthrough): a scheduler
            // module there would cost a VM per worker for nothing.
            let idle = if slot == SCHEDULER_SLOT { None } else { s.stable.as_ref() };
            // A shadow runs in the canary's filter while there is no canary, on every bucket.
            let (arm, buckets, canary) = match (&s.canary, &s.shadow) {
                (None, Some(sh)) => ("shadow", BucketRange::ALL, Some(&sh.deployed)),
                (c, _) => ("canary", canary_range, c.as_ref().map(|c| &c.deployed).or(idle)),
            };
            if let Some(d) = canary {
                out.push(FilterSpec { resource: canary_name, slot: slot.clone(), arm, deployed: d.clone(), buckets });
            }
        }
        out
    }

    /// Start a canary of `module` at `percent` in `slot`.
    pub fn rollout(&mut self, slot: &str, module: Deployed, percent: f64) -> Result<Transition, RolloutError> {
        if !valid_slot(slot) {
            return Err(RolloutError::BadSlot(slot.into()));
        }
        if !(percent.is_finite() && percent > 0.0 && percent <= 100.0) {
            return Err(RolloutError::BadPercent(percent));
        }
        if !(module.weight.is_finite() && module.weight >= 0.0) {
            return Err(RolloutError::BadWeight(module.weight));
        }
        let s = self.slots.entry(slot.into()).or_default();
        if let Some(c) = &s.canary {
            return Err(RolloutError::CanaryInFlight(slot.into(), label(&c.deployed)));
        }
        let t = Transition::new(
            slot,
            "rollout",
            "operator",
            s.stable.as_ref().map(label),
            Some(label(&module)),
            format!("canary at {percent}%"),
        );
        s.canary = Some(Canary { deployed: module, percent, started_unix_ms: now_ms() });
        // The canary's filter was the shadow's.
        s.shadow = None;
        self.revision += 1;
        Ok(t)
    }

    /// Run `module` in shadow in `slot`: it scores every request beside the live version and
    /// acts on none.
    pub fn shadow(&mut self, slot: &str, module: Deployed) -> Result<Transition, RolloutError> {
        if !valid_slot(slot) {
            return Err(RolloutError::BadSlot(slot.into()));
        }
        let s = self.slots.entry(slot.into()).or_default();
        if let Some(c) = &s.canary {
            return Err(RolloutError::CanaryInFlight(slot.into(), label(&c.deployed)));
        }
        let t = Transition::new(
            slot,
            "shadow",
            "operator",
            s.shadow.as_ref().map(|c| label(&c.deployed)),
            Some(label(&module)),
            "shadow on every request, acting on none".into(),
        );
        s.shadow = Some(Canary { deployed: module, percent: 0.0, started_unix_ms: now_ms() });
        self.revision += 1;
        Ok(t)
    }

    /// Make the canary the stable version.
    pub fn promote(&mut self, slot: &str, by: &str, reason: &str) -> Result<Transition, RolloutError> {
        let s = self.slots.get_mut(slot).ok_or_else(|| RolloutError::NoCanary(slot.into(), "promote"))?;
        let c = s.canary.take().ok_or_else(|| RolloutError::NoCanary(slot.into(), "promote"))?;
        let from = s.stable.as_ref().map(label);
        if let Some(old) = s.stable.take() {
            s.previous.push(old);
            let excess = s.previous.len().saturating_sub(16);
            s.previous.drain(..excess);
        }
        let t = Transition::new(slot, "promote", by, from, Some(label(&c.deployed)), reason.to_owned());
        s.stable = Some(c.deployed);
        self.revision += 1;
        Ok(t)
    }

    /// Drop the canary; without one, return the stable filter to the previous version.
    pub fn rollback(&mut self, slot: &str, by: &str, reason: &str) -> Result<Transition, RolloutError> {
        let s = self.slots.get_mut(slot).ok_or_else(|| RolloutError::NothingToRollBack(slot.into()))?;
        let t = if let Some(sh) = s.shadow.take().filter(|_| s.canary.is_none()) {
            Transition::new(
                slot,
                "rollback",
                by,
                Some(label(&sh.deployed)),
                s.stable.as_ref().map(label),
                format!("shadow ended: {reason}"),
            )
        } else if let Some(c) = s.canary.take() {
            Transition::new(
                slot,
                "rollback",
                by,
                Some(label(&c.deployed)),
                s.stable.as_ref().map(label),
                reason.to_owned(),
            )
        } else {
            // The stable version before the oldest one deployed is the bootstrap's own filter.
            if s.stable.is_none() {
                return Err(RolloutError::NothingToRollBack(slot.into()));
            }
            let prev = s.previous.pop();
            let from = s.stable.as_ref().map(label);
            let t = Transition::new(slot, "rollback", by, from, prev.as_ref().map(label), reason.to_owned());
            s.stable = prev;
            t
        };
        self.revision += 1;
        Ok(t)
    }
}

/// Where the state and the transition log live.
#[derive(Debug, Clone)]
pub struct RolloutFiles {
    dir: PathBuf,
}

impl RolloutFiles {
    pub fn new(dir: &Path) -> Self {
        Self { dir: dir.to_path_buf() }
    }

    pub fn load(&self) -> std::io::Result<RolloutState> {
        match std::fs::read_to_string(self.dir.join("rollout.json")) {
            Ok(t) => serde_json::from_str(&t).map_err(std::io::Error::other),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(RolloutState::default()),
            Err(e) => Err(e),
        }
    }

    /// Persist `state` and append `t` to the log.
    pub fn save(&self, state: &RolloutState, t: &Transition) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let path = self.dir.join("rollout.json");
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(state).map_err(std::io::Error::other)?)?;
        std::fs::rename(&tmp, &path)?;
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("transitions.jsonl"))?;
        writeln!(f, "{}", serde_json::to_string(t).map_err(std::io::Error::other)?)
    }

    /// Replace the state and the transition log with the shared ones (a replica's cache of
    /// the policy state in Kubernetes).
    pub fn mirror(&self, state: &RolloutState, transitions: &[Transition]) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let write = |name: &str, bytes: &[u8]| {
            let path = self.dir.join(name);
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, bytes)?;
            std::fs::rename(&tmp, &path)
        };
        write("rollout.json", &serde_json::to_vec_pretty(state).map_err(std::io::Error::other)?)?;
        let mut log = Vec::new();
        for t in transitions {
            writeln!(log, "{}", serde_json::to_string(t).map_err(std::io::Error::other)?)?;
        }
        write("transitions.jsonl", &log)
    }

    /// The newest `n` transitions, oldest first.
    pub fn transitions(&self, n: usize) -> Vec<Transition> {
        let text = std::fs::read_to_string(self.dir.join("transitions.jsonl")).unwrap_or_default();
        let all: Vec<Transition> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        let skip = all.len().saturating_sub(n);
        all.into_iter().skip(skip).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(v: &str) -> Deployed {
        Deployed { sha256: format!("{v:0>64}"), version: v.into(), weight: 1.0, params: serde_json::Value::Null }
    }

    fn ranges(s: &RolloutState) -> Vec<(String, &'static str, String, u16, u16)> {
        s.filters().into_iter().map(|f| (f.resource, f.arm, f.deployed.version, f.buckets.from, f.buckets.to)).collect()
    }

    #[test]
    fn canary_promote_and_rollback_move_buckets() {
        let mut s = RolloutState::default();
        s.rollout("slo", module("v1"), 5.0).unwrap();
        // First version: only the canary filter runs it, on 5% of buckets.
        assert_eq!(ranges(&s), vec![("attache.scorer.slo.canary".into(), "canary", "v1".into(), 0, 500)]);
        let t = s.promote("slo", "operator", "looks good").unwrap();
        assert_eq!((t.from, t.to.as_deref()), (None, Some("v1@000000000000")));
        assert_eq!(
            ranges(&s),
            vec![
                ("attache.scorer.slo".into(), "stable", "v1".into(), 0, 10_000),
                ("attache.scorer.slo.canary".into(), "canary", "v1".into(), 0, 0),
            ]
        );
        s.rollout("slo", module("v2"), 20.0).unwrap();
        assert!(matches!(s.rollout("slo", module("v3"), 20.0), Err(RolloutError::CanaryInFlight(..))));
        assert_eq!(
            ranges(&s),
            vec![
                ("attache.scorer.slo".into(), "stable", "v1".into(), 2_000, 10_000),
                ("attache.scorer.slo.canary".into(), "canary", "v2".into(), 0, 2_000),
            ]
        );
        s.rollback("slo", "controller", "trap").unwrap();
        assert_eq!(ranges(&s)[0].3, 0, "stable takes all buckets back");
        assert_eq!(ranges(&s)[1].4, 0, "canary acts on nothing");
        // Promote v2 after a new canary, then roll back the stable to v1.
        s.rollout("slo", module("v2"), 50.0).unwrap();
        s.promote("slo", "controller", "healthy").unwrap();
        assert_eq!(ranges(&s)[0].2, "v2");
        s.rollback("slo", "operator", "regression").unwrap();
        assert_eq!(ranges(&s)[0].2, "v1");
        // Before v1 was the bootstrap's own filter: no resource, so Envoy's default runs.
        let t = s.rollback("slo", "operator", "again").unwrap();
        assert_eq!((t.from.as_deref(), t.to), (Some("v1@000000000000"), None));
        assert!(ranges(&s).is_empty());
        assert!(matches!(s.rollback("slo", "operator", "again"), Err(RolloutError::NothingToRollBack(_))));
        assert!(s.revision >= 8);
    }

    #[test]
    fn a_shadow_runs_in_the_canary_filter_on_every_bucket_until_a_canary_replaces_it() {
        let mut s = RolloutState::default();
        s.rollout("slo", module("v1"), 100.0).unwrap();
        s.promote("slo", "operator", "ok").unwrap();
        s.shadow("slo", module("v2")).unwrap();
        assert_eq!(
            ranges(&s),
            vec![
                ("attache.scorer.slo".into(), "stable", "v1".into(), 0, 10_000),
                ("attache.scorer.slo.canary".into(), "shadow", "v2".into(), 0, 10_000),
            ]
        );
        // A canary takes the filter over; no shadow beside a canary.
        s.rollout("slo", module("v2"), 10.0).unwrap();
        assert!(s.slots["slo"].shadow.is_none());
        assert!(matches!(s.shadow("slo", module("v3")), Err(RolloutError::CanaryInFlight(..))));
        s.rollback("slo", "operator", "x").unwrap();
        // Rolling back a shadow ends it and leaves the stable version.
        s.shadow("slo", module("v3")).unwrap();
        let t = s.rollback("slo", "operator", "enough").unwrap();
        assert_eq!((t.from.as_deref(), t.to.as_deref()), (Some("v3@000000000000"), Some("v1@000000000000")));
        assert_eq!(ranges(&s)[0].2, "v1");
        assert_eq!(ranges(&s)[1].1, "canary");
        // A scheduler in shadow: the canary scheduler filter, planning every request as a shadow.
        s.shadow(SCHEDULER_SLOT, module("w")).unwrap();
        let spec = s.filters().into_iter().find(|f| f.is_scheduler()).unwrap();
        assert_eq!((spec.resource.as_str(), spec.arm), ("attache.scheduler.canary", "shadow"));
        let config: serde_json::Value = serde_json::from_str(&spec.plugin_config()).unwrap();
        assert_eq!(config["rollout"]["arm"], "shadow");
        assert_eq!(config["rollout"]["buckets"], serde_json::json!([0, 10_000]));
    }

    #[test]
    fn the_scheduler_slot_is_the_scheduler_filter_and_carries_its_arm_in_its_configuration() {
        let mut s = RolloutState::default();
        let mut v2 = module("v2");
        v2.params = serde_json::json!({"scheduler": {"max_endpoints": 2}});
        s.rollout(SCHEDULER_SLOT, v2, 20.0).unwrap();
        // The bootstrap's scheduler stays the stable arm: only the canary is served.
        let f = s.filters();
        assert_eq!(ranges(&s), vec![("attache.scheduler.canary".into(), "canary", "v2".into(), 0, 2_000)]);
        let config: serde_json::Value = serde_json::from_str(&f[0].plugin_config()).unwrap();
        assert_eq!(config["scheduler"]["max_endpoints"], 2);
        assert_eq!(
            config["rollout"],
            serde_json::json!({"arm": "canary", "version": format!("{:0>64}", "v2"), "buckets": [0, 2000]})
        );
        attache_policies::plugin_config::FilterConfig::parse(f[0].plugin_config().as_bytes()).unwrap();
        // Promoted, it is the scheduler, and the idle canary goes back to Envoy's default.
        s.promote(SCHEDULER_SLOT, "operator", "ok").unwrap();
        assert_eq!(ranges(&s), vec![("attache.scheduler".into(), "stable", "v2".into(), 0, 10_000)]);
        s.rollback(SCHEDULER_SLOT, "operator", "back").unwrap();
        assert!(s.filters().is_empty(), "back to the bootstrap's scheduler");
    }

    #[test]
    fn bad_requests_change_nothing() {
        let mut s = RolloutState::default();
        assert_eq!(s.rollout("Bad-Slot", module("v1"), 5.0), Err(RolloutError::BadSlot("Bad-Slot".into())));
        assert!(matches!(s.rollout("slo", module("v1"), 0.0), Err(RolloutError::BadPercent(_))));
        assert!(matches!(s.rollout("slo", module("v1"), 101.0), Err(RolloutError::BadPercent(_))));
        let mut m = module("v1");
        m.weight = f64::NAN;
        assert!(matches!(s.rollout("slo", m, 5.0), Err(RolloutError::BadWeight(_))));
        assert!(matches!(s.promote("slo", "operator", ""), Err(RolloutError::NoCanary(..))));
        assert!(s.filters().is_empty());
        assert_eq!(s.revision, 0);
    }

    #[test]
    fn state_and_transitions_survive_a_restart() {
        let dir = std::env::temp_dir().join(format!("attache-rollout-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let files = RolloutFiles::new(&dir);
        let mut s = files.load().unwrap();
        let t = s.rollout("cost", module("v1"), 10.0).unwrap();
        files.save(&s, &t).unwrap();
        let t = s.promote("cost", "controller", "healthy").unwrap();
        files.save(&s, &t).unwrap();
        let back = files.load().unwrap();
        assert_eq!(back.slots, s.slots);
        let log = files.transitions(10);
        assert_eq!(log.iter().map(|t| t.action.as_str()).collect::<Vec<_>>(), vec!["rollout", "promote"]);
        assert_eq!(log[1].by, "controller");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
