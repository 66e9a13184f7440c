//! `prefill-filter`: ready endpoints of the prefill role, other than the decode endpoint the
//! decode profile chose (the P/D prefill profile).

use super::{require, Filter, FilterContext};
use crate::endpoint::Role;
use crate::error::ScheduleError;

pub struct Prefill;

pub const NAME: &str = "prefill-filter";

impl Filter for Prefill {
    fn name(&self) -> &'static str {
        NAME
    }

    fn doc(&self) -> &'static str {
        "ready endpoints of role `prefill`, other than the chosen decode endpoint"
    }

    fn filter(&self, ctx: &FilterContext<'_>, candidates: &mut Vec<usize>) -> Result<(), ScheduleError> {
        require(ctx, candidates, |e| e.ready && e.role == Role::Prefill && Some(e.address.as_str()) != ctx.exclude)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filters::saturation::SaturationConfig;
    use crate::filters::testing::run;
    use crate::scorers::testing::ep;

    #[test]
    fn ready_prefill_endpoints_but_the_decode_one() {
        let mut eps = vec![ep("a", 0.0, 0.0, 0), ep("b", 0.0, 0.0, 0), ep("c", 0.0, 0.0, 0)];
        eps[0].role = Role::Prefill;
        eps[1].role = Role::Prefill;
        assert_eq!(run(&Prefill, &eps, "m"), Ok(vec![0, 1]));
        let sat = SaturationConfig::default();
        let ctx = FilterContext { endpoints: &eps, model: "m", saturation: &sat, exclude: Some("a") };
        let mut c = vec![0, 1, 2];
        assert_eq!(Prefill.filter(&ctx, &mut c).map(|()| c), Ok(vec![1]));
    }
}
