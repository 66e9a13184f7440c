//! The Attaché scorer SDK.
//!
//! A custom scorer is a small crate that implements [`Scorer`] and calls [`scorer!`]:
//!
//! ```ignore
//! use attache_scorer_sdk::{scorer, Candidate, Params, Request, Scorer};
//!
//! struct FewestWaiting;
//!
//! impl Scorer for FewestWaiting {
//!     fn configure(_params: &Params) -> Result<Self, String> {
//!         Ok(Self)
//!     }
//!     fn score(&self, _request: &Request, endpoint: &Candidate) -> f32 {
//!         1.0 / (1.0 + endpoint.waiting)
//!     }
//! }
//!
//! scorer!(FewestWaiting);
//! ```
//!
//! Built with `cargo build --target wasm32-wasip1 --profile wasm`, it is a proxy-wasm module
//! that runs in Envoy's filter chain between the Attaché scheduler and the picker. Per request
//! it reads the scheduling context the scheduler left in filter state
//! ([`attache_policies::scoring`]), scores every candidate endpoint 0..1, and appends its scores
//! to the score sheet; the picker adds them, times the slot's configured weight, to the
//! scheduler's built-in totals.
//!
//! The host writes the plugin configuration when it rolls the module out:
//! `{"slot": "slo", "arm": "stable"|"canary"|"shadow", "version": "<sha256>", "weight": 1.0,
//! "buckets": [from, to], "params": {...}}`. The scorer acts only on requests whose rollout
//! bucket is in `[from, to)`, which is how a canary and a stable version share the traffic.
//! `params` is the scorer's own configuration, handed to [`Scorer::configure`].
//!
//! A scorer must not panic: a panic is a Wasm trap, Envoy answers that request with 503 and,
//! with the rollout's `fail_open` policy, skips the scorer afterwards until the host rolls it
//! back. Return a neutral score (0.5) for what you cannot judge.

use std::rc::Rc;

use attache_policies::scoring::{self, Arm, BucketRange, ScoreEntry, ScoreSheet};
pub use attache_policies::scoring::{Candidate, ScoringContext as Request};
pub use proxy_wasm;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType};
use serde::Deserialize;

/// The scorer's own configuration (`params` in the plugin configuration).
pub type Params = serde_json::Value;

/// One custom scorer.
pub trait Scorer: Sized + 'static {
    /// Build the scorer from its `params`; an error refuses the configuration (Envoy keeps the
    /// previous version, admission reports `ConfigureRejected`).
    fn configure(params: &Params) -> Result<Self, String>;

    /// Score `endpoint` for `request`, 0 (worst) to 1 (best). Values outside are clamped and
    /// NaN counts as 0. `request.candidates` holds every candidate, for relative scores.
    fn score(&self, request: &Request, endpoint: &Candidate) -> f32;

    /// Remove `endpoint` from the request's candidates, saying why: a filter module. The
    /// picker drops what any filter module removed, even a sticky session's endpoint or a
    /// prefix holder (unless every candidate would go), and what the scheduler learns follows
    /// the endpoint that serves. Keeps every candidate unless overridden; roll a filter-only
    /// module out with weight 0 so that its scores do not count.
    fn remove(&self, _request: &Request, _endpoint: &Candidate) -> Option<String> {
        None
    }

    /// A picker module sets this, and the SDK calls [`Scorer::choose`].
    const CHOOSES: bool = false;

    /// Choose the primary from the scored candidates: a picker module. `totals[i]` is
    /// candidate `i`'s combined score so far (the scheduler's total plus every earlier slot's
    /// weighted scores); the picker puts the chosen candidate first if it is in the leading
    /// tier (a sticky session's endpoint, the prefix holders) and not removed, the rest in
    /// combined order. Called only when [`Scorer::CHOOSES`] is set.
    fn choose(&self, _request: &Request, _totals: &[f64]) -> Option<usize> {
        None
    }
}

/// The plugin configuration the host writes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotConfig {
    pub slot: String,
    #[serde(default = "stable")]
    pub arm: String,
    #[serde(default)]
    pub version: String,
    #[serde(default = "one")]
    pub weight: f64,
    #[serde(default = "all")]
    pub buckets: [u16; 2],
    #[serde(default)]
    pub params: Params,
}

fn stable() -> String {
    "stable".into()
}
fn one() -> f64 {
    1.0
}
fn all() -> [u16; 2] {
    [0, scoring::BUCKETS]
}

struct Shared<S> {
    scorer: S,
    slot: String,
    arm: Arm,
    version: String,
    weight: f64,
    range: BucketRange,
    marker: String,
    scored: Option<u32>,
    skipped: Option<u32>,
    errors: Option<u32>,
}

fn inc(id: Option<u32>) {
    if let Some(id) = id {
        let _ = hostcalls::increment_metric(id, 1);
    }
}

fn log(level: LogLevel, msg: &str) {
    let _ = hostcalls::log(level, msg);
}

fn property(name: &str) -> Option<Vec<u8>> {
    hostcalls::get_property(vec![name]).ok().flatten()
}

fn set_property(name: &str, value: &[u8]) -> bool {
    hostcalls::set_property(vec![name], Some(value)).is_ok()
}

/// Parse the plugin configuration into the slot settings and the scorer.
pub fn configure<S: Scorer>(raw: &[u8]) -> Result<(SlotConfig, S), String> {
    let cfg: SlotConfig = serde_json::from_slice(raw).map_err(|e| format!("plugin configuration: {e}"))?;
    if !(cfg.weight.is_finite() && cfg.weight >= 0.0) {
        return Err(format!("weight {} must be a finite number >= 0", cfg.weight));
    }
    if cfg.buckets[0] > cfg.buckets[1] || cfg.buckets[1] > scoring::BUCKETS {
        return Err(format!("buckets {:?} must be [from, to] with from <= to <= {}", cfg.buckets, scoring::BUCKETS));
    }
    Arm::parse(&cfg.arm).ok_or_else(|| format!("arm {:?} must be stable, canary or shadow", cfg.arm))?;
    let scorer = S::configure(&cfg.params)?;
    Ok((cfg, scorer))
}

/// The root context of a scorer module.
pub struct ScorerRoot<S: Scorer> {
    shared: Option<Rc<Shared<S>>>,
}

impl<S: Scorer> Default for ScorerRoot<S> {
    fn default() -> Self {
        Self { shared: None }
    }
}

impl<S: Scorer> Context for ScorerRoot<S> {}

impl<S: Scorer> RootContext for ScorerRoot<S> {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = hostcalls::get_buffer(proxy_wasm::types::BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let (cfg, scorer) = match configure::<S>(&raw) {
            Ok(v) => v,
            Err(e) => {
                log(LogLevel::Critical, &format!("attache scorer: {e}"));
                return false;
            }
        };
        let arm = Arm::parse(&cfg.arm).unwrap_or(Arm::Stable);
        let name = |what: &str| format!("attache.scorer.{}.{}.{what}", cfg.slot, arm.as_str());
        let define = |what: &str| hostcalls::define_metric(MetricType::Counter, &name(what)).ok();
        let short: String = cfg.version.chars().take(12).collect();
        self.shared = Some(Rc::new(Shared {
            scorer,
            marker: format!("{}/{}/{short}", cfg.slot, arm.as_str()),
            arm,
            version: short,
            weight: cfg.weight,
            range: BucketRange { from: cfg.buckets[0], to: cfg.buckets[1] },
            scored: define("scored"),
            skipped: define("skipped"),
            errors: define("errors"),
            slot: cfg.slot,
        }));
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(ScorerHttp { shared: self.shared.clone() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct ScorerHttp<S: Scorer> {
    shared: Option<Rc<Shared<S>>>,
}

impl<S: Scorer> Context for ScorerHttp<S> {}

impl<S: Scorer> HttpContext for ScorerHttp<S> {
    fn on_http_request_headers(&mut self, _n: usize, _eos: bool) -> Action {
        let Some(sh) = self.shared.as_deref() else {
            return Action::Continue;
        };
        // No context: the scheduler passed this request through (not an inference request).
        let Some(raw) = property(scoring::CONTEXT_PROPERTY) else {
            return Action::Continue;
        };
        let ctx = match Request::decode(&raw) {
            Ok(c) => c,
            Err(e) => {
                log(LogLevel::Warn, &format!("attache scorer {}: undecodable context: {e}", sh.slot));
                inc(sh.errors);
                return Action::Continue;
            }
        };
        if !sh.range.contains(ctx.bucket) {
            inc(sh.skipped);
            return Action::Continue;
        }
        // Marked while scoring: if the scorer traps, the scheduler sees the mark on the 503.
        let _ = set_property(scoring::SCORING_PROPERTY, sh.marker.as_bytes());
        let scores: Vec<f32> = ctx.candidates.iter().map(|c| sh.scorer.score(&ctx, c)).collect();
        let removed: Vec<(u16, String)> = ctx
            .candidates
            .iter()
            .enumerate()
            .filter_map(|(i, c)| Some((u16::try_from(i).ok()?, sh.scorer.remove(&ctx, c)?)))
            .collect();
        let mut sheet =
            property(scoring::SCORES_PROPERTY).and_then(|b| ScoreSheet::decode(&b).ok()).unwrap_or_default();
        let chosen = if S::CHOOSES {
            let (totals, _) = scoring::combine(&ctx, &sheet);
            sh.scorer.choose(&ctx, &totals).filter(|&i| i < ctx.candidates.len()).and_then(|i| u16::try_from(i).ok())
        } else {
            None
        };
        sheet.put(ScoreEntry {
            slot: sh.slot.clone(),
            arm: sh.arm,
            version: sh.version.clone(),
            weight: sh.weight,
            scores,
            removed,
            chosen,
        });
        if set_property(scoring::SCORES_PROPERTY, &sheet.encode()) {
            inc(sh.scored);
        } else {
            inc(sh.errors);
        }
        let _ = set_property(scoring::SCORING_PROPERTY, b"");
        Action::Continue
    }
}

/// Register `S` as this module's scorer. Called by [`scorer!`].
pub fn register<S: Scorer>() {
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(ScorerRoot::<S>::default()) });
}

/// Make this crate a scorer module: `scorer!(MyScorer);`.
#[macro_export]
macro_rules! scorer {
    ($t:ty) => {
        #[cfg(target_arch = "wasm32")]
        $crate::proxy_wasm::main! {{
            $crate::register::<$t>();
        }}
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(f32);
    impl Scorer for Fixed {
        fn configure(params: &Params) -> Result<Self, String> {
            params.get("v").and_then(|v| v.as_f64()).map(|v| Fixed(v as f32)).ok_or_else(|| "need v".into())
        }
        fn score(&self, _: &Request, _: &Candidate) -> f32 {
            self.0
        }
    }

    #[test]
    fn configuration_is_checked_before_the_scorer_sees_it() {
        let (cfg, s) =
            configure::<Fixed>(br#"{"slot":"x","arm":"canary","weight":2,"buckets":[0,500],"params":{"v":0.5}}"#)
                .unwrap();
        assert_eq!((cfg.slot.as_str(), cfg.buckets, s.0), ("x", [0, 500], 0.5));
        for bad in [
            &br#"{"slot":"x","params":{}}"#[..],
            br#"{"slot":"x","weight":-1,"params":{"v":1}}"#,
            br#"{"slot":"x","buckets":[600,500],"params":{"v":1}}"#,
            br#"{"slot":"x","buckets":[0,20000],"params":{"v":1}}"#,
            br#"{"slot":"x","arm":"blue","params":{"v":1}}"#,
            br#"{"slot":"x","typo":1,"params":{"v":1}}"#,
            b"{",
        ] {
            assert!(configure::<Fixed>(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
