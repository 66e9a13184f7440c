//! Scorers: each scores every candidate 0..=1; a profile sums them by weight
//! ([`crate::profiles`]). One file per scorer, named after its llm-d plugin type, and one line
//! in [`REGISTRY`]. Formulas follow llm-d's scorers (`docs/architecture.md`).

use crate::endpoint::Endpoint;
use crate::filters::saturation::SaturationConfig;

/// Score given to an endpoint whose metrics are unknown or stale.
pub const UNKNOWN_LOAD_SCORE: f64 = 0.5;

/// How a scorer's weighted score enters the total.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Added to the total.
    Additive,
    /// Prefix affinity: the scorers of this kind measure one thing, what the endpoint holds,
    /// from different sources. The strongest weighted one counts, once, and only where the
    /// endpoint holds at least `prefix.affinity_threshold` of the prompt.
    Affinity,
}

/// What a scorer sees: the candidates (in pool order) with what the profile learned about them.
pub struct ScoreContext<'a> {
    /// The request's model (a base model or a LoRA adapter).
    pub model: &'a str,
    /// The pool's endpoints: the candidates are [`Self::positions`] of it.
    pub endpoints: &'a [Endpoint],
    /// The candidates' positions in `endpoints`, in pool order (each a valid position).
    pub positions: &'a [usize],
    /// Requests this scheduler has in flight, per candidate.
    pub inflight: &'a [u32],
    /// Leading prompt blocks each candidate is proven to hold by the approximate index or the
    /// cross-worker affinity table.
    pub matched_blocks: &'a [usize],
    /// Blocks the prompt hashed to.
    pub total_blocks: usize,
    /// Precise scores from the engines' KV events, per candidate: (score, matched blocks).
    /// `None`: the request has no precise scores (not tokenized, or precise routing off).
    pub precise: Option<&'a [(f64, usize)]>,
    /// No candidate holds enough of the prompt to count (see [`Kind::Affinity`]).
    pub cold: bool,
    /// The host is silent: only what this scheduler knows itself may be trusted.
    pub load_only: bool,
    pub saturation: &'a SaturationConfig,
    /// The `no-hit-lru-scorer`'s memory of cold requests.
    pub last_cold: &'a no_hit_lru::LastCold,
    /// The `session-load-scorer`'s active sessions, and the request's own session key.
    pub sessions: &'a session_load::ActiveSessions,
    pub session_key: Option<u64>,
}

impl<'a> ScoreContext<'a> {
    /// The candidates, in order.
    pub fn candidates(&self) -> impl Iterator<Item = &'a Endpoint> + Clone + 'a {
        let endpoints = self.endpoints;
        self.positions.iter().filter_map(move |&p| endpoints.get(p))
    }

    /// How many candidates there are.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }
}

/// One scoring plugin.
pub trait Scorer: Sync {
    /// The plugin type, in llm-d's vocabulary (`queue-scorer`): what a profile names it by.
    fn name(&self) -> &'static str;
    /// One line for the generated configuration reference.
    fn doc(&self) -> &'static str;
    /// Its histogram, `attache.scorer.<metric>.score_milli`, recorded for the primary; `None`
    /// records none.
    fn metric(&self) -> Option<&'static str> {
        None
    }
    fn kind(&self) -> Kind {
        Kind::Additive
    }
    /// Whether it had anything to go on for this request (its metric is recorded only then).
    fn active(&self, _ctx: &ScoreContext<'_>) -> bool {
        true
    }
    /// Its weight while the host is silent (see `host_stale_ms`): 0 unless it scores from this
    /// scheduler's own knowledge.
    fn load_only_weight(&self, _weight: f64) -> f64 {
        0.0
    }
    /// One score in 0..=1 per candidate, in order, written to `out` (as long as the
    /// candidates): each scorer fills its column of one buffer, with no list of its own.
    fn score(&self, ctx: &ScoreContext<'_>, out: &mut [f64]);
}

/// Declares each scorer's module and lists its plugin in [`REGISTRY`], in one line.
macro_rules! registry {
    ($($module:ident :: $plugin:ident),* $(,)?) => {
        $(pub mod $module;)*
        /// Every built-in scorer, in the order the configuration reference lists them.
        pub static REGISTRY: &[&dyn Scorer] = &[$(&$module::$plugin),*];
    };
}

// Adding a scorer: a file in this folder, and its line here.
registry! {
    prefix_cache::PrefixCache,
    precise_prefix_cache::PrecisePrefixCache,
    queue::Queue,
    kv_cache_utilization::KvCacheUtilization,
    no_hit_lru::NoHitLru,
    lora_affinity::LoraAffinity,
    session_load::SessionLoad,
}

/// The scorer registered under `name`.
pub fn find(name: &str) -> Option<&'static dyn Scorer> {
    REGISTRY.iter().copied().find(|s| s.name() == name)
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::endpoint::{EndpointMetrics, Role};

    /// An endpoint with these metrics (`age` ms old).
    pub fn ep(address: &str, waiting: f64, kv: f64, age: u64) -> Endpoint {
        Endpoint {
            address: address.into(),
            models: vec!["m".into()],
            role: Role::Both,
            ready: true,
            metrics: Some(EndpointMetrics { waiting, kv_usage: kv, age_ms: age, ..Default::default() }),
            ..Default::default()
        }
    }

    /// Score `eps` with `scorer`, nothing else known.
    pub fn score(scorer: &dyn Scorer, eps: &[&Endpoint], tweak: impl FnOnce(&mut ScoreContext<'_>)) -> Vec<f64> {
        let endpoints: Vec<Endpoint> = eps.iter().map(|&e| e.clone()).collect();
        let positions: Vec<usize> = (0..eps.len()).collect();
        let sat = SaturationConfig::default();
        let last_cold = no_hit_lru::LastCold::default();
        let sessions = session_load::ActiveSessions::default();
        let zeros = vec![0u32; eps.len()];
        let blocks = vec![0usize; eps.len()];
        let mut ctx = ScoreContext {
            model: "m",
            endpoints: &endpoints,
            positions: &positions,
            inflight: &zeros,
            matched_blocks: &blocks,
            total_blocks: 0,
            precise: None,
            cold: false,
            load_only: false,
            saturation: &sat,
            last_cold: &last_cold,
            sessions: &sessions,
            session_key: None,
        };
        tweak(&mut ctx);
        let mut out = vec![f64::NAN; ctx.len()];
        scorer.score(&ctx, &mut out);
        assert!(
            out.iter().all(|v| (0.0..=1.0).contains(v)),
            "{}: every candidate scored in 0..=1: {out:?}",
            scorer.name()
        );
        out
    }

    #[test]
    fn names_are_unique_and_found() {
        for s in REGISTRY {
            assert_eq!(REGISTRY.iter().filter(|o| o.name() == s.name()).count(), 1, "{}", s.name());
            assert!(find(s.name()).is_some());
            assert!(!s.doc().is_empty());
        }
        assert!(find("nope").is_none());
    }
}
