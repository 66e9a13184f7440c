//! `lora-affinity-scorer` (llm-d's tiers): for a request naming an adapter, 1.0 where the
//! adapter is loaded and running, 0.8 where a slot is free to load it, 0.6 where requests wait
//! for it, else 0 (`vllm:lora_requests_info`). A request for an endpoint's base model scores 0
//! everywhere (no preference).

use super::{ScoreContext, Scorer};
use crate::endpoint::Endpoint;

pub struct LoraAffinity;

pub const NAME: &str = "lora-affinity-scorer";

impl Scorer for LoraAffinity {
    fn name(&self) -> &'static str {
        NAME
    }

    fn doc(&self) -> &'static str {
        "for a LoRA adapter: 1 where it runs, 0.8 where a slot is free, 0.6 where requests wait for it"
    }

    fn score(&self, ctx: &ScoreContext<'_>, out: &mut [f64]) {
        for (slot, e) in out.iter_mut().zip(ctx.candidates()) {
            *slot = tier(e, ctx.model);
        }
    }
}

/// The endpoint's tier for `model`.
pub fn tier(e: &Endpoint, model: &str) -> f64 {
    match &e.lora {
        _ if e.base_model() == Some(model) => 0.0,
        None => 0.0,
        Some(l) if l.running.iter().any(|a| a == model) => 1.0,
        Some(l) if (l.running.len() + l.waiting.len()) < l.max_lora as usize => 0.8,
        Some(l) if l.waiting.iter().any(|a| a == model) => 0.6,
        Some(_) => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::LoraState;
    use crate::scorers::testing::score;

    #[test]
    fn tiers() {
        let with = |running: &[&str], waiting: &[&str], max_lora: u32| Endpoint {
            models: vec!["base".into(), "sql".into(), "tweet".into()],
            lora: Some(LoraState {
                running: running.iter().map(|s| s.to_string()).collect(),
                waiting: waiting.iter().map(|s| s.to_string()).collect(),
                max_lora,
            }),
            ..Default::default()
        };
        let (active, free, waiting, full, none) = (
            with(&["sql"], &[], 2),
            with(&["tweet"], &[], 2),
            with(&["tweet"], &["sql"], 2),
            with(&["tweet", "x"], &[], 2),
            Endpoint { models: vec!["base".into(), "sql".into()], ..Default::default() },
        );
        let eps = [&active, &free, &waiting, &full, &none];
        assert_eq!(score(&LoraAffinity, &eps, |c| c.model = "sql"), vec![1.0, 0.8, 0.6, 0.0, 0.0]);
        assert_eq!(score(&LoraAffinity, &eps, |c| c.model = "base"), vec![0.0; 5], "the base model: no preference");
    }
}
