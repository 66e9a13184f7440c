//! `prefix-cache-scorer` (llm-d's estimate mode): the share of the prompt's blocks this
//! scheduler has routed to the endpoint before, `matched blocks / total blocks`.

use super::{Kind, ScoreContext, Scorer};

pub struct PrefixCache;

pub const NAME: &str = "prefix-cache-scorer";

impl Scorer for PrefixCache {
    fn name(&self) -> &'static str {
        NAME
    }

    fn doc(&self) -> &'static str {
        "share of the prompt's blocks routed to the endpoint before (approximate index and the other workers' decisions)"
    }

    fn metric(&self) -> Option<&'static str> {
        Some("prefix")
    }

    fn kind(&self) -> Kind {
        Kind::Affinity
    }

    fn score(&self, ctx: &ScoreContext<'_>, out: &mut [f64]) {
        let total = ctx.total_blocks;
        out.fill(0.0);
        for (slot, &m) in out.iter_mut().zip(ctx.matched_blocks) {
            *slot = if total == 0 { 0.0 } else { (m as f64 / total as f64).clamp(0.0, 1.0) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorers::testing::{ep, score};

    #[test]
    fn matched_over_total() {
        let (a, b, c) = (ep("a", 0.0, 0.0, 0), ep("b", 0.0, 0.0, 0), ep("c", 0.0, 0.0, 0));
        let s = score(&PrefixCache, &[&a, &b, &c], |c| {
            c.matched_blocks = &[0, 2, 4];
            c.total_blocks = 4;
        });
        assert_eq!(s, vec![0.0, 0.5, 1.0]);
        assert_eq!(score(&PrefixCache, &[&a], |c| c.matched_blocks = &[3]), vec![0.0], "no blocks, no score");
    }
}
