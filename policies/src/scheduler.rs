//! The scheduling pipeline: filters → weighted scorers → picker.

use hashbrown::HashMap;

use crate::config::SchedulerConfig;
use crate::endpoint::PoolState;
use crate::error::ScheduleError;
use crate::index::ApproxPrefixIndex;
use crate::{filter, picker, scorer};

/// What the scheduler needs to know about one request.
pub struct SchedulingInput<'a> {
    pub model: &'a str,
    /// Approximate prefix block hashes of the prompt (see [`crate::prefix`]).
    pub block_hashes: &'a [u64],
    /// Requests this scheduler instance has in flight per endpoint address.
    pub inflight: &'a HashMap<String, u32>,
    /// Seed for the picker's tie-break.
    pub seed: u64,
}

/// One scored candidate, for the decision log and metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredEndpoint {
    pub address: String,
    pub prefix: f64,
    pub queue: f64,
    pub kv_cache: f64,
    pub total: f64,
    pub matched_blocks: usize,
}

/// The scheduler's verdict.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Primary endpoint first, then fallbacks.
    pub endpoints: Vec<String>,
    /// Scores of the chosen endpoints, in the same order.
    pub scores: Vec<ScoredEndpoint>,
    /// Candidates left after filtering.
    pub candidates: usize,
    /// Blocks the request hashed to.
    pub total_blocks: usize,
}

impl Decision {
    /// `x-gateway-destination-endpoint` value: `ip:port[,fallback…]`.
    pub fn header_value(&self) -> String {
        self.endpoints.join(",")
    }
}

/// The configured pipeline.
#[derive(Debug, Clone, Default)]
pub struct Scheduler {
    pub config: SchedulerConfig,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        Self { config }
    }

    /// Choose endpoints for a request.
    pub fn schedule(
        &self,
        input: &SchedulingInput<'_>,
        pool: &PoolState,
        index: &mut ApproxPrefixIndex,
    ) -> Result<Decision, ScheduleError> {
        let eps = &pool.endpoints;
        if eps.is_empty() {
            return Err(ScheduleError::NoEndpoints);
        }
        let mut cands: Vec<usize> = (0..eps.len()).collect();
        filter::by_model(eps, &mut cands, input.model);
        if cands.is_empty() {
            return Err(ScheduleError::UnknownModel(input.model.to_owned()));
        }
        filter::by_health(eps, &mut cands);
        if cands.is_empty() {
            return Err(ScheduleError::NoEndpoints);
        }
        filter::by_saturation(eps, &mut cands, &self.config.saturation);

        let chosen: Vec<&crate::Endpoint> = cands.iter().filter_map(|&i| eps.get(i)).collect();
        let matches = if input.block_hashes.is_empty() {
            HashMap::new()
        } else {
            index.match_lengths(input.block_hashes)
        };
        let matched: Vec<usize> = chosen
            .iter()
            .map(|e| matches.get(&e.address).copied().unwrap_or(0))
            .collect();
        let inflight: Vec<u32> = chosen
            .iter()
            .map(|e| input.inflight.get(&e.address).copied().unwrap_or(0))
            .collect();
        let sat = &self.config.saturation;
        let w = &self.config.weights;
        let s_prefix = scorer::prefix(&matched, input.block_hashes.len());
        let s_queue = scorer::queue(&chosen, &inflight, sat);
        let s_kv = scorer::kv_cache(&chosen, sat);
        let totals: Vec<f64> = (0..chosen.len())
            .map(|i| {
                w.prefix * s_prefix.get(i).copied().unwrap_or(0.0)
                    + w.queue * s_queue.get(i).copied().unwrap_or(0.0)
                    + w.kv_cache * s_kv.get(i).copied().unwrap_or(0.0)
            })
            .collect();
        let order = picker::max_score(&totals, self.config.max_endpoints, input.seed);
        let scores: Vec<ScoredEndpoint> = order
            .iter()
            .filter_map(|&i| {
                Some(ScoredEndpoint {
                    address: chosen.get(i)?.address.clone(),
                    prefix: *s_prefix.get(i)?,
                    queue: *s_queue.get(i)?,
                    kv_cache: *s_kv.get(i)?,
                    total: *totals.get(i)?,
                    matched_blocks: *matched.get(i)?,
                })
            })
            .collect();
        if scores.is_empty() {
            return Err(ScheduleError::NoEndpoints);
        }
        Ok(Decision {
            endpoints: scores.iter().map(|s| s.address.clone()).collect(),
            scores,
            candidates: chosen.len(),
            total_blocks: input.block_hashes.len(),
        })
    }

    /// Record a decision in the approximate index (llm-d's `PreRequest` step).
    pub fn commit(&self, decision: &Decision, block_hashes: &[u64], index: &mut ApproxPrefixIndex) {
        if let Some(primary) = decision.endpoints.first() {
            index.record(block_hashes, primary);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::{Endpoint, EndpointMetrics, Role};
    use crate::prefix::block_hashes;
    use crate::request::Prompt;

    fn pool(n: usize) -> PoolState {
        PoolState {
            version: 1,
            endpoints: (0..n)
                .map(|i| Endpoint {
                    address: format!("10.0.0.{i}:8000"),
                    models: vec!["m".into()],
                    role: Role::Both,
                    ready: true,
                    metrics: Some(EndpointMetrics::default()),
                })
                .collect(),
        }
    }

    fn run(
        s: &Scheduler,
        pool: &PoolState,
        ix: &mut ApproxPrefixIndex,
        prompt: &str,
        seed: u64,
    ) -> Decision {
        let hashes = block_hashes(&s.config.prefix, "m", None, &Prompt::Text(prompt.into()));
        let inflight = HashMap::new();
        let d = s
            .schedule(
                &SchedulingInput {
                    model: "m",
                    block_hashes: &hashes,
                    inflight: &inflight,
                    seed,
                },
                pool,
                ix,
            )
            .unwrap();
        s.commit(&d, &hashes, ix);
        d
    }

    #[test]
    fn shared_prefix_sticks_and_unrelated_spread() {
        let s = Scheduler::default();
        let p = pool(4);
        let mut ix = ApproxPrefixIndex::new(10_000);
        let prefix = "You are a helpful assistant. ".repeat(100);
        let first = run(&s, &p, &mut ix, &format!("{prefix} question 0"), 1);
        for q in 1..10 {
            let d = run(&s, &p, &mut ix, &format!("{prefix} question {q}"), q);
            assert_eq!(d.endpoints[0], first.endpoints[0]);
            assert!(d.scores[0].prefix > 0.9);
        }
        let mut seen = std::collections::HashSet::new();
        for g in 0..40 {
            seen.insert(
                run(
                    &s,
                    &p,
                    &mut ix,
                    &format!("{g} unrelated group {g} ").repeat(50),
                    1000 + g,
                )
                .endpoints[0]
                    .clone(),
            );
        }
        assert_eq!(
            seen.len(),
            4,
            "unrelated prefixes should use the whole pool"
        );
    }

    #[test]
    fn saturated_endpoint_is_avoided_even_with_prefix() {
        let s = Scheduler::default();
        let mut p = pool(3);
        let mut ix = ApproxPrefixIndex::new(10_000);
        let prompt = "shared ".repeat(300);
        let first = run(&s, &p, &mut ix, &prompt, 3);
        let hot = p
            .endpoints
            .iter_mut()
            .find(|e| e.address == first.endpoints[0])
            .unwrap();
        hot.metrics = Some(EndpointMetrics {
            waiting: 20.0,
            running: 8.0,
            kv_usage: 0.5,
            age_ms: 0,
        });
        for seed in 0..10 {
            let d = run(&s, &p, &mut ix, &prompt, seed);
            assert_ne!(d.endpoints[0], first.endpoints[0]);
        }
    }

    #[test]
    fn errors_and_fallbacks() {
        let s = Scheduler::default();
        let mut ix = ApproxPrefixIndex::new(10);
        let inflight = HashMap::new();
        let input = SchedulingInput {
            model: "m",
            block_hashes: &[],
            inflight: &inflight,
            seed: 0,
        };
        assert_eq!(
            s.schedule(&input, &PoolState::default(), &mut ix),
            Err(ScheduleError::NoEndpoints)
        );
        let bad = SchedulingInput {
            model: "zzz",
            ..input
        };
        assert_eq!(
            s.schedule(&bad, &pool(2), &mut ix),
            Err(ScheduleError::UnknownModel("zzz".into()))
        );
        let mut p = pool(2);
        p.endpoints.iter_mut().for_each(|e| e.ready = false);
        let input = SchedulingInput {
            model: "m",
            block_hashes: &[],
            inflight: &inflight,
            seed: 0,
        };
        assert_eq!(
            s.schedule(&input, &p, &mut ix),
            Err(ScheduleError::NoEndpoints)
        );
        let d = s.schedule(&input, &pool(5), &mut ix).unwrap();
        assert_eq!(d.endpoints.len(), 3);
        assert_eq!(d.header_value().split(',').count(), 3);
    }
}
