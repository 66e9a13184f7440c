//! The canary verdict: from a canary's window of counters and the stable version's over the
//! same time, whether to wait, promote or roll back. A pure rule; the host's rollout controller
//! reads the counters from Envoy and acts on the verdict.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// When the controller promotes or rolls back a canary on its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AutoPolicy {
    pub enabled: bool,
    /// Promote a healthy canary (else only roll back bad ones).
    pub promote: bool,
    pub interval_ms: u64,
    /// Canary requests needed before judging error rate, latency and hit rate, and before
    /// promoting.
    pub min_requests: u64,
    /// A canary is promoted no sooner than this after it started.
    pub min_duration_ms: u64,
    /// Roll back when the canary trapped more often than this.
    pub max_traps: u64,
    /// Roll back when the canary's 5xx rate exceeds the stable's by more than this (0..1).
    pub max_error_rate_increase: f64,
    /// Roll back when the canary's mean time to response headers exceeds the stable's by more.
    pub max_added_latency_ms: f64,
    /// Roll back when the canary's expected prefix-cache hit rate is lower by more (0..1).
    pub max_hit_rate_drop: f64,
    /// An Envoy that restarted during a canary is left out of its window for this long: what it
    /// counted since the last read is gone, and its new VMs start with cold tables.
    pub restart_grace_ms: u64,
    /// A canary may start only after the same version ran in shadow ([`shadow_gate`]).
    pub require_shadow: bool,
    /// Shadowed requests the gate needs.
    pub shadow_min_requests: u64,
    /// The gate's floor on the shadow's expected prefix-hit rate minus the live one's (e.g.
    /// -0.05: at most 5 points lower).
    pub min_shadow_hit_delta: f64,
}

impl Default for AutoPolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            promote: true,
            interval_ms: 1_000,
            min_requests: 100,
            min_duration_ms: 60_000,
            max_traps: 0,
            max_error_rate_increase: 0.01,
            max_added_latency_ms: 100.0,
            max_hit_rate_drop: 0.10,
            restart_grace_ms: 30_000,
            require_shadow: false,
            shadow_min_requests: 200,
            min_shadow_hit_delta: -0.05,
        }
    }
}

/// One arm's counters: cumulative as read from Envoy (summed over every Envoy), or a window
/// of them ([`ArmCounters::since`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ArmCounters {
    pub requests: u64,
    pub errors: u64,
    pub traps: u64,
    pub ttfb_us: u64,
    pub hit_permille: u64,
    /// Shadow arm: requests on which the shadow's pick was the live one.
    pub agree: u64,
    /// Shadow and live arms: the picked endpoint's load (waiting + running) × 1000, summed.
    pub load_milli: u64,
}

impl ArmCounters {
    /// What happened since `base` was read.
    pub fn since(&self, base: &ArmCounters) -> ArmCounters {
        ArmCounters {
            requests: self.requests.saturating_sub(base.requests),
            errors: self.errors.saturating_sub(base.errors),
            traps: self.traps.saturating_sub(base.traps),
            ttfb_us: self.ttfb_us.saturating_sub(base.ttfb_us),
            hit_permille: self.hit_permille.saturating_sub(base.hit_permille),
            agree: self.agree.saturating_sub(base.agree),
            load_milli: self.load_milli.saturating_sub(base.load_milli),
        }
    }

    /// Add `d` (another Envoy's counts, or a later window).
    pub fn add(&mut self, d: &ArmCounters) {
        self.requests += d.requests;
        self.errors += d.errors;
        self.traps += d.traps;
        self.ttfb_us += d.ttfb_us;
        self.hit_permille += d.hit_permille;
        self.agree += d.agree;
        self.load_milli += d.load_milli;
    }

    /// Mean load at the pick.
    pub fn mean_load(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.load_milli as f64 / self.requests as f64 / 1000.0
        }
    }
    pub fn error_rate(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.errors as f64 / self.requests as f64
        }
    }
    pub fn mean_ttfb_ms(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.ttfb_us as f64 / self.requests as f64 / 1000.0
        }
    }
    pub fn hit_rate(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.hit_permille as f64 / self.requests as f64 / 1000.0
        }
    }
    pub fn json(&self) -> Value {
        json!({
            "requests": self.requests, "errors": self.errors, "traps": self.traps,
            "error_rate": self.error_rate(), "mean_ttfb_ms": self.mean_ttfb_ms(), "hit_rate": self.hit_rate(),
        })
    }
}

/// The controller's verdict on one canary.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Wait(String),
    Promote(String),
    Rollback(String),
}

/// A shadow candidate against the live decisions on the same requests.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ShadowReport {
    pub requests: u64,
    /// Share of requests on which the shadow would have picked the live primary.
    pub agreement: f64,
    /// The shadow's expected prefix-hit rate minus the live one's.
    pub hit_delta: f64,
    /// The mean load (waiting + running) of the endpoint the shadow would pick, minus the
    /// live pick's: above 0, it would pile onto busier endpoints.
    pub load_delta: f64,
}

impl ShadowReport {
    pub fn new(shadow: &ArmCounters, live: &ArmCounters) -> Self {
        let agreement = if shadow.requests == 0 { 0.0 } else { shadow.agree as f64 / shadow.requests as f64 };
        Self {
            requests: shadow.requests,
            agreement,
            hit_delta: shadow.hit_rate() - live.hit_rate(),
            load_delta: shadow.mean_load() - live.mean_load(),
        }
    }
}

/// Whether a canary may start, given the shadow run of the same version (`None`: it ran in
/// no shadow). Without `require_shadow`, always.
pub fn shadow_gate(p: &AutoPolicy, report: Option<&ShadowReport>) -> Result<(), String> {
    if !p.require_shadow {
        return Ok(());
    }
    let Some(r) = report else {
        return Err("this version has not run in shadow (policy.auto.require_shadow)".into());
    };
    if r.requests < p.shadow_min_requests {
        return Err(format!("{} of {} shadowed requests (shadow_min_requests)", r.requests, p.shadow_min_requests));
    }
    if r.hit_delta < p.min_shadow_hit_delta {
        return Err(format!(
            "shadow hit-rate delta {:+.3} is below the floor {:+.3} (min_shadow_hit_delta); agreement {:.3}",
            r.hit_delta, p.min_shadow_hit_delta, r.agreement
        ));
    }
    Ok(())
}

/// Judge a canary from its window and the stable's over the same time.
pub fn judge(p: &AutoPolicy, canary: &ArmCounters, stable: &ArmCounters, age_ms: u64) -> Verdict {
    if canary.traps > p.max_traps {
        return Verdict::Rollback(format!("canary trapped {} time(s) (max {})", canary.traps, p.max_traps));
    }
    if canary.requests < p.min_requests {
        return Verdict::Wait(format!("{} of {} canary requests", canary.requests, p.min_requests));
    }
    let compare = stable.requests > 0;
    let base_err = if compare { stable.error_rate() } else { 0.0 };
    if canary.error_rate() - base_err > p.max_error_rate_increase {
        return Verdict::Rollback(format!(
            "canary error rate {:.4} vs stable {:.4} (max increase {})",
            canary.error_rate(),
            base_err,
            p.max_error_rate_increase
        ));
    }
    if compare {
        let added = canary.mean_ttfb_ms() - stable.mean_ttfb_ms();
        if added > p.max_added_latency_ms {
            return Verdict::Rollback(format!(
                "canary adds {added:.1} ms to time-to-headers (max {})",
                p.max_added_latency_ms
            ));
        }
        let drop = stable.hit_rate() - canary.hit_rate();
        if drop > p.max_hit_rate_drop {
            return Verdict::Rollback(format!(
                "canary cache-hit rate {:.3} vs stable {:.3} (max drop {})",
                canary.hit_rate(),
                stable.hit_rate(),
                p.max_hit_rate_drop
            ));
        }
    }
    if age_ms < p.min_duration_ms {
        return Verdict::Wait(format!("healthy; {} of {} ms observed", age_ms, p.min_duration_ms));
    }
    Verdict::Promote(format!(
        "healthy over {} requests: error rate {:.4}, mean time-to-headers {:.1} ms, hit rate {:.3}",
        canary.requests,
        canary.error_rate(),
        canary.mean_ttfb_ms(),
        canary.hit_rate()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shadow_gate_needs_enough_requests_and_a_hit_rate_above_the_floor() {
        let shadow = ArmCounters {
            requests: 300,
            agree: 75,
            hit_permille: 300 * 200,
            load_milli: 300 * 4000,
            ..Default::default()
        };
        let live = ArmCounters { requests: 300, hit_permille: 300 * 900, load_milli: 300 * 1000, ..Default::default() };
        let r = ShadowReport::new(&shadow, &live);
        assert!(
            (r.agreement - 0.25).abs() < 1e-9 && (r.hit_delta + 0.7).abs() < 1e-9 && (r.load_delta - 3.0).abs() < 1e-9
        );
        let off = AutoPolicy::default();
        assert!(shadow_gate(&off, Some(&r)).is_ok(), "no gate unless required");
        let on = AutoPolicy { require_shadow: true, ..AutoPolicy::default() };
        assert!(shadow_gate(&on, None).unwrap_err().contains("not run in shadow"));
        assert!(shadow_gate(&on, Some(&r)).unwrap_err().contains("below the floor"));
        let few = ShadowReport { requests: 10, ..r };
        assert!(shadow_gate(&on, Some(&few)).unwrap_err().contains("10 of 200"));
        let good = ShadowReport { hit_delta: -0.01, ..r };
        assert!(shadow_gate(&on, Some(&good)).is_ok());
    }

    #[test]
    fn verdicts_follow_the_policy() {
        let p = AutoPolicy { min_requests: 10, min_duration_ms: 1000, ..AutoPolicy::default() };
        let arm = |requests, errors, traps, ttfb_ms: u64, hit: u64| ArmCounters {
            requests,
            errors,
            traps,
            ttfb_us: ttfb_ms * 1000 * requests,
            hit_permille: hit * requests,
            ..ArmCounters::default()
        };
        let stable = arm(100, 0, 0, 50, 800);
        assert!(matches!(judge(&p, &arm(1, 0, 1, 50, 800), &stable, 0), Verdict::Rollback(r) if r.contains("trapped")));
        assert!(matches!(judge(&p, &arm(5, 0, 0, 50, 800), &stable, 5000), Verdict::Wait(_)));
        assert!(
            matches!(judge(&p, &arm(20, 2, 0, 50, 800), &stable, 5000), Verdict::Rollback(r) if r.contains("error rate"))
        );
        assert!(
            matches!(judge(&p, &arm(20, 0, 0, 400, 800), &stable, 5000), Verdict::Rollback(r) if r.contains("adds"))
        );
        assert!(
            matches!(judge(&p, &arm(20, 0, 0, 50, 300), &stable, 5000), Verdict::Rollback(r) if r.contains("hit rate"))
        );
        assert!(matches!(judge(&p, &arm(20, 0, 0, 60, 790), &stable, 500), Verdict::Wait(_)));
        assert!(matches!(judge(&p, &arm(20, 0, 0, 60, 790), &stable, 5000), Verdict::Promote(_)));
        // No stable traffic to compare with (first version): only absolute error rate counts.
        assert!(matches!(judge(&p, &arm(20, 0, 0, 900, 0), &ArmCounters::default(), 5000), Verdict::Promote(_)));
    }
}
