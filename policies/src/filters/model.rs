//! `model-filter`: endpoints that serve the request's model (a base model or a loaded LoRA
//! adapter). None: the model does not exist in this pool (404).

use super::{retain, Filter, FilterContext};
use crate::error::ScheduleError;

pub struct Model;

impl Filter for Model {
    fn name(&self) -> &'static str {
        "model-filter"
    }

    fn doc(&self) -> &'static str {
        "endpoints that serve the request's model; none is `404 unknown_model`"
    }

    fn filter(&self, ctx: &FilterContext<'_>, candidates: &mut Vec<usize>) -> Result<(), ScheduleError> {
        // A request that names no model (vLLM's utility routes and `generate` allow that): every
        // endpoint serves its own.
        if ctx.model.is_empty() {
            return Ok(());
        }
        retain(ctx, candidates, |e| e.serves(ctx.model));
        if candidates.is_empty() {
            return Err(ScheduleError::UnknownModel(ctx.model.to_owned()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filters::testing::run;
    use crate::scorers::testing::ep;

    #[test]
    fn keeps_servers_of_the_model() {
        let mut eps = vec![ep("a", 0.0, 0.0, 0), ep("b", 0.0, 0.0, 0)];
        eps[1].models = vec!["other".into()];
        assert_eq!(run(&Model, &eps, "m"), Ok(vec![0]));
        assert_eq!(run(&Model, &eps, "zzz"), Err(ScheduleError::UnknownModel("zzz".into())));
        assert_eq!(run(&Model, &eps, ""), Ok(vec![0, 1]), "no model named: any endpoint");
    }
}
