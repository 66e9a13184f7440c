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

/// The stable and canary filter of a slot, as ECDS resource names.
pub fn resource_names(slot: &str) -> (String, String) {
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
    /// The plugin configuration the scorer SDK reads.
    pub fn plugin_config(&self) -> String {
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
            let canary = s.canary.as_ref().map(|c| &c.deployed).or(s.stable.as_ref());
            if let Some(d) = canary {
                out.push(FilterSpec {
                    resource: canary_name,
                    slot: slot.clone(),
                    arm: "canary",
                    deployed: d.clone(),
                    buckets: canary_range,
                });
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
        let t = Transition {
            at_unix_ms: now_ms(),
            slot: slot.into(),
            action: "rollout".into(),
            by: "operator".into(),
            from: s.stable.as_ref().map(label),
            to: Some(label(&module)),
            reason: format!("canary at {percent}%"),
            host: None,
        };
        s.canary = Some(Canary { deployed: module, percent, started_unix_ms: now_ms() });
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
        let t = Transition {
            at_unix_ms: now_ms(),
            slot: slot.into(),
            action: "promote".into(),
            by: by.into(),
            from,
            to: Some(label(&c.deployed)),
            reason: reason.into(),
            host: None,
        };
        s.stable = Some(c.deployed);
        self.revision += 1;
        Ok(t)
    }

    /// Drop the canary; without one, return the stable filter to the previous version.
    pub fn rollback(&mut self, slot: &str, by: &str, reason: &str) -> Result<Transition, RolloutError> {
        let s = self.slots.get_mut(slot).ok_or_else(|| RolloutError::NothingToRollBack(slot.into()))?;
        let t = if let Some(c) = s.canary.take() {
            Transition {
                at_unix_ms: now_ms(),
                slot: slot.into(),
                action: "rollback".into(),
                by: by.into(),
                from: Some(label(&c.deployed)),
                to: s.stable.as_ref().map(label),
                reason: reason.into(),
                host: None,
            }
        } else {
            let prev = s.previous.pop().ok_or_else(|| RolloutError::NothingToRollBack(slot.into()))?;
            let from = s.stable.as_ref().map(label);
            let t = Transition {
                at_unix_ms: now_ms(),
                slot: slot.into(),
                action: "rollback".into(),
                by: by.into(),
                from,
                to: Some(label(&prev)),
                reason: reason.into(),
                host: None,
            };
            s.stable = Some(prev);
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
        assert!(matches!(s.rollback("slo", "operator", "again"), Err(RolloutError::NothingToRollBack(_))));
        assert!(s.revision >= 7);
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
