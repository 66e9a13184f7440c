//! `precise-prefix-cache-scorer`: what the endpoint holds of the prompt by its engine's KV
//! events, each leading block weighted by its tier ([`crate::precise`]).

use super::{Kind, ScoreContext, Scorer};

pub struct PrecisePrefixCache;

pub const NAME: &str = "precise-prefix-cache-scorer";

impl Scorer for PrecisePrefixCache {
    fn name(&self) -> &'static str {
        NAME
    }

    fn doc(&self) -> &'static str {
        "tier-weighted share of the prompt the engine's KV events say the endpoint holds (with `precise.enabled`)"
    }

    fn metric(&self) -> Option<&'static str> {
        Some("precise")
    }

    fn kind(&self) -> Kind {
        Kind::Affinity
    }

    fn active(&self, ctx: &ScoreContext<'_>) -> bool {
        ctx.precise.is_some()
    }

    fn score(&self, ctx: &ScoreContext<'_>, out: &mut [f64]) {
        out.fill(0.0);
        for (slot, &(s, _)) in out.iter_mut().zip(ctx.precise.unwrap_or_default()) {
            *slot = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorers::testing::{ep, score};

    #[test]
    fn the_precise_score_or_nothing() {
        let (a, b) = (ep("a", 0.0, 0.0, 0), ep("b", 0.0, 0.0, 0));
        assert_eq!(score(&PrecisePrefixCache, &[&a, &b], |c| c.precise = Some(&[(0.9, 3), (0.0, 0)])), vec![0.9, 0.0]);
        assert_eq!(score(&PrecisePrefixCache, &[&a, &b], |_| {}), vec![0.0, 0.0]);
    }
}
