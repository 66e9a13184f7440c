//! Filters narrow a profile's candidate endpoints before scoring. One file per filter, named
//! after its llm-d plugin type, and one line in [`REGISTRY`]. A filter that would drop every
//! candidate for a soft reason (saturation) keeps them all, so the pool degrades to load-only
//! scheduling instead of failing; a hard one (no endpoint serves the model) is an error.

use crate::endpoint::Endpoint;
use crate::error::ScheduleError;
use crate::filters::saturation::SaturationConfig;

pub mod decode;
pub mod model;
pub mod prefill;
pub mod prefix_affinity;
pub mod saturation;
pub mod subset;

/// What a filter sees.
pub struct FilterContext<'a> {
    pub endpoints: &'a [Endpoint],
    pub model: &'a str,
    pub saturation: &'a SaturationConfig,
    /// An endpoint already chosen by an earlier profile (the prefill profile must not pick the
    /// decode endpoint).
    pub exclude: Option<&'a str>,
}

/// One filtering plugin.
pub trait Filter: Sync {
    /// The plugin type, in llm-d's vocabulary.
    fn name(&self) -> &'static str;
    /// One line for the generated configuration reference.
    fn doc(&self) -> &'static str;
    /// Keep the candidates (positions in `ctx.endpoints`) that pass.
    fn filter(&self, ctx: &FilterContext<'_>, candidates: &mut Vec<usize>) -> Result<(), ScheduleError>;
}

/// Every built-in filter.
pub static REGISTRY: &[&dyn Filter] = &[&model::Model, &decode::Decode, &prefill::Prefill, &saturation::Saturation];

/// The filter registered under `name`.
pub fn find(name: &str) -> Option<&'static dyn Filter> {
    REGISTRY.iter().copied().find(|f| f.name() == name)
}

/// Keep the candidates whose endpoint passes `keep`; none left is "no ready endpoint".
fn require(
    ctx: &FilterContext<'_>,
    candidates: &mut Vec<usize>,
    keep: impl Fn(&Endpoint) -> bool,
) -> Result<(), ScheduleError> {
    retain(ctx, candidates, keep);
    if candidates.is_empty() {
        return Err(ScheduleError::NoEndpoints);
    }
    Ok(())
}

/// Keep the candidates whose endpoint passes `keep`.
fn retain(ctx: &FilterContext<'_>, candidates: &mut Vec<usize>, keep: impl Fn(&Endpoint) -> bool) {
    candidates.retain(|&i| ctx.endpoints.get(i).is_some_and(&keep));
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Run `f` over every endpoint of `eps`.
    pub fn run(f: &dyn Filter, eps: &[Endpoint], model: &str) -> Result<Vec<usize>, ScheduleError> {
        let sat = SaturationConfig::default();
        let ctx = FilterContext { endpoints: eps, model, saturation: &sat, exclude: None };
        let mut c: Vec<usize> = (0..eps.len()).collect();
        f.filter(&ctx, &mut c).map(|()| c)
    }

    #[test]
    fn names_are_unique_and_found() {
        for f in REGISTRY {
            assert_eq!(REGISTRY.iter().filter(|o| o.name() == f.name()).count(), 1, "{}", f.name());
            assert!(find(f.name()).is_some() && !f.doc().is_empty());
        }
    }
}
