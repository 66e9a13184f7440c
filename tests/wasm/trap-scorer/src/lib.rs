//! Test fixture: a scorer with a bug, chosen by its params.
//! - `{"trap_after": N}`: a latent bug. It panics (traps) once it has scored N candidates in one
//!   VM. Admission's samples score 37 candidates, so a larger N passes admission and fails
//!   later, in Envoy.
//! - `{"misbehave": "grow"}`: it reserves another MiB, forever, as soon as it scores, so its
//!   memory grows without bound.
//! - `{"misbehave": "spin"}`: it never returns from scoring.
//! - `{"misbehave": "slow", "slow_ms": N}`: it busy-waits N ms once per request (on the first
//!   candidate), a scorer that adds latency.
//! - `{"misbehave": "evict_holders"}`: a filter that removes every candidate holding some of the
//!   request's prefix, a policy that lowers the cache-hit rate.

use std::cell::{Cell, RefCell};

use attache_scorer_sdk::{scorer, Candidate, Params, Request, Scorer};

pub enum Fault {
    TrapAfter(Cell<u64>),
    Grow(RefCell<Vec<Vec<u8>>>),
    Spin,
    Slow(std::time::Duration),
    EvictHolders,
}

pub struct Faulty {
    fault: Fault,
}

impl Scorer for Faulty {
    fn configure(params: &Params) -> Result<Self, String> {
        let fault = match params.get("misbehave").and_then(|v| v.as_str()) {
            Some("grow") => Fault::Grow(RefCell::new(Vec::new())),
            Some("spin") => Fault::Spin,
            Some("slow") => Fault::Slow(std::time::Duration::from_millis(
                params.get("slow_ms").and_then(|v| v.as_u64()).ok_or("slow_ms is required with slow")?,
            )),
            Some("evict_holders") => Fault::EvictHolders,
            Some(other) => return Err(format!("misbehave: unknown fault {other:?} (grow, spin, slow, evict_holders)")),
            None => Fault::TrapAfter(Cell::new(
                params.get("trap_after").and_then(|v| v.as_u64()).ok_or("trap_after (scores) is required")?,
            )),
        };
        Ok(Self { fault })
    }

    // The faults are this fixture's whole point: the tests check that admission and Envoy
    // survive them.
    #[allow(clippy::panic)]
    fn score(&self, request: &Request, endpoint: &Candidate) -> f32 {
        match &self.fault {
            Fault::TrapAfter(left) => {
                let n = left.get();
                if n == 0 {
                    panic!("latent bug in the test scorer");
                }
                if endpoint.address.is_empty() {
                    return 0.0;
                }
                left.set(n - 1);
                0.5
            }
            Fault::Grow(hoard) => {
                let mut hoard = hoard.borrow_mut();
                loop {
                    // Reserved, not written: the memory grows as fast as the allocator can ask,
                    // so the memory limit, not the wall clock, is what stops it.
                    hoard.push(std::hint::black_box(Vec::with_capacity(1 << 20)));
                }
            }
            Fault::Slow(wait) => {
                // Wall-clock time (WASI's realtime clock, which Envoy provides).
                let first = request.candidates.first().is_some_and(|c| c.address == endpoint.address);
                let start = std::time::SystemTime::now();
                while first && start.elapsed().unwrap_or(*wait) < *wait {
                    std::hint::spin_loop();
                }
                0.5
            }
            Fault::EvictHolders => 0.5,
            Fault::Spin => {
                let mut x = 0u64;
                loop {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            }
        }
    }

    fn remove(&self, _request: &Request, endpoint: &Candidate) -> Option<String> {
        match self.fault {
            Fault::EvictHolders if endpoint.prefix_hit > 0.0 => Some("holds the prefix".into()),
            _ => None,
        }
    }
}

scorer!(Faulty);
