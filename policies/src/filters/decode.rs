//! `decode-filter`: ready endpoints that take whole requests (role `both` or `decode`). None:
//! no ready endpoint (503).

use super::{require, Filter, FilterContext};
use crate::endpoint::Role;
use crate::error::ScheduleError;

pub struct Decode;

impl Filter for Decode {
    fn name(&self) -> &'static str {
        "decode-filter"
    }

    fn doc(&self) -> &'static str {
        "ready endpoints of role `both` or `decode`; none is `503 no_endpoints`"
    }

    fn filter(&self, ctx: &FilterContext<'_>, candidates: &mut Vec<usize>) -> Result<(), ScheduleError> {
        require(ctx, candidates, |e| e.ready && e.role != Role::Prefill)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filters::testing::run;
    use crate::scorers::testing::ep;

    #[test]
    fn ready_whole_request_endpoints() {
        let mut eps = vec![ep("a", 0.0, 0.0, 0), ep("b", 0.0, 0.0, 0), ep("c", 0.0, 0.0, 0)];
        eps[1].ready = false;
        eps[2].role = Role::Prefill;
        assert_eq!(run(&Decode, &eps, "m"), Ok(vec![0]));
        eps[0].ready = false;
        assert_eq!(run(&Decode, &eps, "m"), Err(ScheduleError::NoEndpoints));
    }
}
