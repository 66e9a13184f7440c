//! Test fixture: a scorer with a latent bug: it panics (traps) once it has scored `trap_after`
//! candidates in one VM. Admission's samples score 37 candidates, so a larger `trap_after`
//! passes admission and fails later, in Envoy.

use std::cell::Cell;

use attache_scorer_sdk::{scorer, Candidate, Params, Request, Scorer};

pub struct TrapAfter {
    left: Cell<u64>,
}

impl Scorer for TrapAfter {
    fn configure(params: &Params) -> Result<Self, String> {
        let n = params.get("trap_after").and_then(|v| v.as_u64()).ok_or("trap_after (scores) is required")?;
        Ok(Self { left: Cell::new(n) })
    }

    // The trap is this fixture's whole point: the tests check that Envoy survives it.
    #[allow(clippy::panic)]
    fn score(&self, _request: &Request, endpoint: &Candidate) -> f32 {
        let left = self.left.get();
        if left == 0 {
            panic!("latent bug in the test scorer");
        }
        if endpoint.address.is_empty() {
            return 0.0;
        }
        self.left.set(left - 1);
        0.5
    }
}

scorer!(TrapAfter);
