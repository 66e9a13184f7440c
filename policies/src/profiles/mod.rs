//! Scheduling profiles: a profile lists its plugins in order, in llm-d's vocabulary (filters,
//! weighted scorers, one picker), and runs them: filter → score → pick. [`crate::scheduler`]
//! runs the `decode` profile, then, when the P/D decider splits the request, the `prefill` one.

use serde::{Deserialize, Serialize};

use crate::error::ScheduleError;
use crate::filters::{self, Filter};
use crate::pickers::{self, Picker};
use crate::scorers::{self, Kind, Scorer};

pub mod pd;
mod run;

pub use run::{ProfileRun, SchedulingInput, ScoreList, Scored, ScoredEndpoint, MAX_SCORERS};

/// One plugin of a profile, as configured: `{"type": "queue-scorer", "weight": 2}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PluginRef {
    /// The plugin type (see the generated plugin list in `docs/configuration.md`).
    #[serde(rename = "type")]
    pub kind: String,
    /// A scorer's weight (llm-d's default: 1). Filters and pickers take none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

impl PluginRef {
    fn new(kind: &str, weight: Option<f64>) -> Self {
        Self { kind: kind.to_owned(), weight }
    }
}

/// A profile's configuration: its plugins, in the order they run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProfileConfig {
    pub plugins: Vec<PluginRef>,
}

/// The two profiles of a (possibly disaggregated) pool.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ProfilesConfig {
    /// Picks the primary endpoint and the fallbacks: llm-d's default profile (prefix 3, queue
    /// 2, kv-cache 2) plus `no-hit-lru-scorer` 1, the precise scorer (weighed against the
    /// approximate one, not added to it) and LoRA affinity 5.
    pub decode: ProfileConfig,
    /// Picks the prefill endpoint of a disaggregated request: llm-d's sample P/D profile
    /// (prefix 2, queue 1).
    pub prefill: ProfileConfig,
}

impl Default for ProfilesConfig {
    fn default() -> Self {
        let p = |k: &str| PluginRef::new(k, None);
        let w = |k: &str, w: f64| PluginRef::new(k, Some(w));
        let filters = |role: &str| vec![p("model-filter"), p(role), p("saturation-filter")];
        let decode = [
            filters("decode-filter"),
            vec![
                w(scorers::prefix_cache::NAME, 3.0),
                w(scorers::precise_prefix_cache::NAME, 3.0),
                w(scorers::queue::NAME, 2.0),
                w(scorers::kv_cache_utilization::NAME, 2.0),
                w(scorers::no_hit_lru::NAME, 1.0),
                w(scorers::lora_affinity::NAME, 5.0),
                w(scorers::session_load::NAME, 2.0),
                p("max-score-picker"),
            ],
        ]
        .concat();
        let prefill = [
            filters("prefill-filter"),
            vec![
                w(scorers::prefix_cache::NAME, 2.0),
                w(scorers::precise_prefix_cache::NAME, 2.0),
                w(scorers::queue::NAME, 1.0),
                p("max-score-picker"),
            ],
        ]
        .concat();
        Self { decode: ProfileConfig { plugins: decode }, prefill: ProfileConfig { plugins: prefill } }
    }
}

/// A profile that cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ProfileError {
    #[error("profile `{profile}`: unknown plugin type `{kind}`")]
    UnknownPlugin { profile: &'static str, kind: String },
    #[error("profile `{profile}`: `{kind}` is not a scorer and takes no weight")]
    WeightOnNonScorer { profile: &'static str, kind: String },
    #[error("profile `{profile}`: scorer `{kind}` has weight {weight}; weights are finite and >= 0")]
    BadWeight { profile: &'static str, kind: String, weight: f64 },
    #[error("profile `{profile}`: needs exactly one picker, has {count}")]
    Pickers { profile: &'static str, count: usize },
    #[error("profile `{profile}`: `{kind}` is listed twice")]
    Duplicate { profile: &'static str, kind: String },
}

/// A profile with its plugins resolved.
#[derive(Clone)]
pub struct Profile {
    pub name: &'static str,
    pub filters: Vec<&'static dyn Filter>,
    /// Scorers with their weights, in configured order.
    pub scorers: Vec<(&'static dyn Scorer, f64)>,
    pub picker: &'static dyn Picker,
}

impl std::fmt::Debug for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let filters: Vec<&str> = self.filters.iter().map(|x| x.name()).collect();
        let scorers: Vec<(&str, f64)> = self.scorers.iter().map(|(s, w)| (s.name(), *w)).collect();
        f.debug_struct("Profile")
            .field("name", &self.name)
            .field("filters", &filters)
            .field("scorers", &scorers)
            .field("picker", &self.picker.name())
            .finish()
    }
}

impl Profile {
    /// Resolve a configured profile against the plugin registries.
    pub fn resolve(name: &'static str, config: &ProfileConfig) -> Result<Self, ProfileError> {
        let (mut filters, mut scorers, mut pickers) = (Vec::new(), Vec::new(), Vec::new());
        for (i, p) in config.plugins.iter().enumerate() {
            let kind = || p.kind.clone();
            if config.plugins.iter().take(i).any(|q| q.kind == p.kind) {
                return Err(ProfileError::Duplicate { profile: name, kind: kind() });
            }
            if let Some(s) = scorers::find(&p.kind) {
                let weight = p.weight.unwrap_or(1.0);
                if !weight.is_finite() || weight < 0.0 {
                    return Err(ProfileError::BadWeight { profile: name, kind: kind(), weight });
                }
                scorers.push((s, weight));
                continue;
            }
            if p.weight.is_some() && (filters::find(&p.kind).is_some() || pickers::find(&p.kind).is_some()) {
                return Err(ProfileError::WeightOnNonScorer { profile: name, kind: kind() });
            }
            match (filters::find(&p.kind), pickers::find(&p.kind)) {
                (Some(f), _) => filters.push(f),
                (_, Some(pk)) => pickers.push(pk),
                _ => return Err(ProfileError::UnknownPlugin { profile: name, kind: kind() }),
            }
        }
        match pickers.as_slice() {
            [picker] => Ok(Self { name, filters, scorers, picker: *picker }),
            _ => Err(ProfileError::Pickers { profile: name, count: pickers.len() }),
        }
    }

    /// The candidates of a pool of `endpoints` that pass every filter, in pool order.
    pub fn filter(&self, ctx: &filters::FilterContext<'_>) -> Result<Vec<usize>, ScheduleError> {
        self.filter_among(ctx, (0..ctx.endpoints.len()).collect())
    }

    /// Run the filters over `candidates` (positions in `ctx.endpoints`) only.
    pub fn filter_among(
        &self,
        ctx: &filters::FilterContext<'_>,
        mut candidates: Vec<usize>,
    ) -> Result<Vec<usize>, ScheduleError> {
        for f in &self.filters {
            f.filter(ctx, &mut candidates)?;
        }
        Ok(candidates)
    }

    /// The weighted total of one candidate's scores (in `self.scorers` order), and its raw
    /// prefix hit (the best affinity score). Affinity scorers count once, the strongest, and
    /// only when `affine`; `load_only` weighs each scorer by what it is worth without the host.
    pub fn total(&self, scores: &[f64], affine: bool, load_only: bool) -> (f64, f64) {
        self.weighting(load_only).total(scores, affine)
    }

    /// Each scorer's kind and effective weight, read once per decision rather than once per
    /// candidate.
    pub fn weighting(&self, load_only: bool) -> Weighting {
        let mut w = Weighting { len: 0, items: [(Kind::Additive, 0.0); MAX_SCORERS] };
        for ((s, weight), slot) in self.scorers.iter().zip(w.items.iter_mut()) {
            *slot = (s.kind(), if load_only { s.load_only_weight(*weight) } else { *weight });
            w.len += 1;
        }
        w
    }
}

/// A profile's scorers as the total weighs them ([`Profile::weighting`]).
#[derive(Debug, Clone, Copy)]
pub struct Weighting {
    len: usize,
    items: [(Kind, f64); MAX_SCORERS],
}

impl Weighting {
    /// See [`Profile::total`].
    pub fn total(&self, scores: &[f64], affine: bool) -> (f64, f64) {
        let (mut additive, mut affinity, mut hit) = (0.0f64, 0.0f64, 0.0f64);
        for (&(kind, w), &v) in self.items.iter().take(self.len).zip(scores) {
            match kind {
                Kind::Additive => additive += w * v,
                Kind::Affinity => {
                    hit = hit.max(v);
                    if affine {
                        affinity = affinity.max(w * v);
                    }
                }
            }
        }
        (affinity + additive, hit)
    }
}

/// Every built-in plugin as a Markdown table, for the configuration reference
/// (`docs/configuration.md`, checked by a unit test).
pub fn plugin_reference() -> String {
    let mut out =
        String::from("| plugin type | kind | histogram of the primary's score | what it does |\n|---|---|---|---|\n");
    let kind = |s: &dyn Scorer| match s.kind() {
        Kind::Affinity => "scorer (prefix affinity: the strongest counts, once)",
        Kind::Additive => "scorer",
    };
    let metric = |s: &dyn Scorer| s.metric().map(|m| format!("`attache_scorer_{m}_score_milli`")).unwrap_or_default();
    let rows = filters::REGISTRY
        .iter()
        .map(|f| (f.name(), "filter", String::new(), f.doc()))
        .chain(scorers::REGISTRY.iter().map(|s| (s.name(), kind(*s), metric(*s), s.doc())))
        .chain(pickers::REGISTRY.iter().map(|p| (p.name(), "picker", String::new(), p.doc())));
    for (name, kind, metric, doc) in rows {
        out.push_str(&format!("| `{name}` | {kind} | {metric} | {doc} |\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scorer_fits_a_candidates_score_list() {
        // A profile lists each scorer at most once, so its scores fit inline.
        assert!(scorers::REGISTRY.len() <= MAX_SCORERS);
        let list: ScoreList = scorers::REGISTRY.iter().map(|s| (s.name(), 0.5)).collect();
        assert_eq!(list.len(), scorers::REGISTRY.len());
        assert_eq!(list.first().map(|s| s.0), Some(scorers::REGISTRY[0].name()));
    }

    #[test]
    fn the_defaults_resolve_and_mistakes_are_named() {
        let d = ProfilesConfig::default();
        let decode = Profile::resolve("decode", &d.decode).unwrap();
        assert_eq!(decode.filters.len(), 3);
        assert_eq!(decode.scorers.len(), 7);
        assert_eq!(decode.picker.name(), "max-score-picker");
        Profile::resolve("prefill", &d.prefill).unwrap();
        let bad = |plugins: Vec<PluginRef>| Profile::resolve("t", &ProfileConfig { plugins }).unwrap_err().to_string();
        let pick = PluginRef::new("max-score-picker", None);
        assert!(bad(vec![PluginRef::new("nope", None), pick.clone()]).contains("unknown plugin type `nope`"));
        assert!(bad(vec![PluginRef::new("model-filter", Some(1.0)), pick.clone()]).contains("takes no weight"));
        assert!(bad(vec![PluginRef::new("queue-scorer", Some(-1.0)), pick.clone()]).contains("weight -1"));
        assert!(bad(vec![PluginRef::new("queue-scorer", None)]).contains("exactly one picker, has 0"));
        assert!(bad(vec![pick.clone(), pick.clone()]).contains("listed twice"));
    }

    /// `docs/configuration.md` lists exactly the registered plugins.
    #[test]
    fn the_configuration_doc_lists_the_plugins() {
        attache_fixtures::check_generated_block("docs/configuration.md", "scheduler-plugins", "", &plugin_reference())
            .unwrap();
    }

    #[test]
    fn affinity_counts_once_and_only_when_affine() {
        let p = Profile::resolve("decode", &ProfilesConfig::default().decode).unwrap();
        // prefix, precise, queue, kv, lru, lora
        let scores = [1.0, 0.5, 0.5, 0.5, 0.0, 0.0];
        assert_eq!(p.total(&scores, true, false), (3.0 + 1.0 + 1.0, 1.0));
        assert_eq!(p.total(&scores, false, false), (2.0, 1.0), "not affine: no affinity");
        assert_eq!(p.total(&scores, true, true), (1.0, 1.0), "load-only: the queue alone");
    }
}
