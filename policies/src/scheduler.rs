//! The scheduling pipeline: filters → weighted scorers → picker.

use hashbrown::HashMap;

use crate::config::{SchedulerConfig, ScorerWeights};
use crate::endpoint::PoolState;
use crate::error::ScheduleError;
use crate::index::ApproxPrefixIndex;
use crate::{filter, pd, picker, scorer};

/// What the scheduler needs to know about one request.
pub struct SchedulingInput<'a> {
    pub model: &'a str,
    /// Approximate prefix block hashes of the prompt (see [`crate::prefix`]).
    pub block_hashes: &'a [u64],
    /// Blocks of `block_hashes` that end a message ([`crate::prefix::anchor_blocks`]): the
    /// approximate index records and probes them, so matches are exact where prompts diverge.
    pub anchors: &'a [usize],
    /// Requests this scheduler instance has in flight per endpoint address.
    pub inflight: &'a HashMap<String, u32>,
    /// Uncached prompt tokens of those requests per endpoint address (llm-d's
    /// `inflight-load-producer`), for the affinity filter's TTFT gate; `None` counts none.
    pub inflight_tokens: Option<&'a HashMap<String, u64>>,
    /// Seed for the picker's tie-break.
    pub seed: u64,
    /// Prefix matches learned elsewhere (other Envoy workers, see
    /// [`crate::index::AffinityTable::matches`]): endpoint → leading blocks held.
    pub extra_matches: Option<&'a HashMap<String, usize>>,
    /// Precise prefix scores from the engines' KV events ([`crate::precise::scores`]):
    /// endpoint id → (score, matched blocks).
    pub precise: Option<&'a HashMap<u32, (f64, usize)>>,
    /// Prompt length in tokens (exact when tokenized, else estimated), for the P/D decision.
    pub prompt_tokens: usize,
    /// The endpoint this request's session or conversation is bound to
    /// ([`crate::session`]): it becomes the primary while it is a candidate.
    pub sticky: Option<&'a str>,
    /// The host has gone silent (see `host_stale_ms`): its metrics and KV index may be out of
    /// date, so scoring falls back to this scheduler's own in-flight load alone.
    pub load_only: bool,
}

/// One scored candidate, for the decision log and metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredEndpoint {
    pub address: String,
    pub prefix: f64,
    pub queue: f64,
    pub kv_cache: f64,
    pub no_hit_lru: f64,
    pub precise: f64,
    pub lora: f64,
    pub total: f64,
    pub matched_blocks: usize,
    /// Prompt tokens this endpoint is expected to hold (approximate or precise, the larger).
    pub cached_tokens: usize,
    /// It holds at least `prefix.affinity_threshold` of the prompt.
    pub affine: bool,
}

/// The scheduler's verdict.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Primary endpoint first, then fallbacks.
    pub endpoints: Vec<String>,
    /// Scores of the chosen endpoints, in the same order.
    pub scores: Vec<ScoredEndpoint>,
    /// Every candidate that passed the filters, scored, in pool order (custom scorers and the
    /// picker see these).
    pub all: Vec<ScoredEndpoint>,
    /// Candidates left after filtering.
    pub candidates: usize,
    /// Blocks the request hashed to.
    pub total_blocks: usize,
    /// No candidate held any of the request's prefix.
    pub cold: bool,
    /// The prefill endpoint, when the P/D decider split the request (`x-prefiller-host-port`).
    pub prefill: Option<ScoredEndpoint>,
    /// The primary is the request's sticky endpoint.
    pub sticky: bool,
    /// Per candidate of `all`, the tier it leads in ([`picker::tier`]): what the custom-scorer
    /// picker must keep when it re-picks (`scoring::TIERS_PROPERTY`).
    pub tiers: Vec<u8>,
}

impl Decision {
    /// `x-gateway-destination-endpoint` value: `ip:port[,fallback…]`.
    pub fn header_value(&self) -> String {
        self.endpoints.join(",")
    }

    /// `x-prefiller-host-port` value, when the request is disaggregated.
    pub fn prefiller(&self) -> Option<&str> {
        self.prefill.as_ref().map(|p| p.address.as_str())
    }
}

/// The scheduler's mutable state: what one scheduler instance (an Envoy worker, the
/// simulator's router) has learned from its own decisions.
pub struct SchedulerState {
    pub index: ApproxPrefixIndex,
    pub no_hit_lru: scorer::NoHitLru,
}

impl SchedulerState {
    pub fn new(config: &SchedulerConfig) -> Self {
        Self { index: ApproxPrefixIndex::new(config.prefix.index_capacity), no_hit_lru: scorer::NoHitLru::default() }
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

    pub fn new_state(&self) -> SchedulerState {
        SchedulerState::new(&self.config)
    }

    /// Score `cands` with one profile's weights; returns every candidate scored, in pool
    /// order, and whether none of them holds any of the prompt.
    fn score(
        &self,
        eps: &[crate::Endpoint],
        cands: &[usize],
        input: &SchedulingInput<'_>,
        matches: &HashMap<String, usize>,
        state: &SchedulerState,
        w: &ScorerWeights,
    ) -> (Vec<ScoredEndpoint>, bool) {
        let chosen: Vec<&crate::Endpoint> = cands.iter().filter_map(|&i| eps.get(i)).collect();
        // Leading blocks each endpoint is proven to hold, by this worker's index and by what the
        // other workers learned (the affinity table).
        let proven: Vec<(usize, usize)> = chosen
            .iter()
            .map(|e| {
                let local = matches.get(&e.address).copied().unwrap_or(0);
                let extra = input.extra_matches.and_then(|m| m.get(&e.address)).copied().unwrap_or(0);
                (local, extra)
            })
            .collect();
        let matched: Vec<usize> = proven.iter().map(|&(local, extra)| local.max(extra)).collect();
        let precise: Vec<(f64, usize)> =
            chosen.iter().map(|e| input.precise.and_then(|p| p.get(&e.id)).copied().unwrap_or((0.0, 0))).collect();
        // The share of the prompt each endpoint holds, by either index; affinity counts only at
        // or above the threshold.
        let threshold = self.config.prefix.affinity_threshold;
        let total_blocks = input.block_hashes.len();
        let held: Vec<f64> = chosen
            .iter()
            .zip(proven.iter().zip(&precise))
            .map(|(e, (&(local, extra), &(ps, pb)))| {
                // For the gate, what it may hold: a match is known only to the last block either
                // index records before the prompts diverge (index::match_upper_bound,
                // index::table_match_upper_bound).
                let bound = crate::index::match_upper_bound(total_blocks, input.anchors, local)
                    .max(crate::index::table_match_upper_bound(total_blocks, input.anchors, extra));
                let approx = if total_blocks == 0 { 0.0 } else { bound as f64 / total_blocks as f64 };
                // Blocks held over the prompt's full blocks; the tier-weighted score where the
                // block count is unknown.
                let keys = if e.block_size == 0 { 0 } else { input.prompt_tokens / e.block_size as usize };
                let exact = if keys == 0 { ps } else { pb as f64 / keys as f64 };
                approx.max(exact).min(1.0)
            })
            .collect();
        let gated = |i: usize| held.get(i).is_some_and(|&h| h > 0.0 && h >= threshold);
        let cold = (0..chosen.len()).all(|i| !gated(i));
        let inflight: Vec<u32> = chosen.iter().map(|e| input.inflight.get(&e.address).copied().unwrap_or(0)).collect();
        let sat = &self.config.saturation;
        let load_only_weights;
        let w = if input.load_only {
            load_only_weights = ScorerWeights {
                queue: w.queue.max(1.0),
                prefix: 0.0,
                kv_cache: 0.0,
                no_hit_lru: 0.0,
                precise_prefix: 0.0,
                lora: 0.0,
            };
            &load_only_weights
        } else {
            w
        };
        let s_prefix = scorer::prefix(&matched, input.block_hashes.len());
        let s_queue =
            if input.load_only { scorer::inflight(&inflight) } else { scorer::queue(&chosen, &inflight, sat) };
        let s_kv = scorer::kv_cache(&chosen, sat);
        let s_lora = scorer::lora(&chosen, input.model);
        // A request for an adapter has its affinity already: where the adapter runs. Spreading
        // it as a cold prefix would weigh as much as a tier step and load the adapter elsewhere.
        let spread = cold && s_lora.iter().all(|&l| l <= 0.0);
        let s_lru = scorer::no_hit_lru(&chosen, spread, &state.no_hit_lru);
        let block_tokens = self.config.prefix.block_size_tokens;
        let scored = chosen
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let (prefix, queue, kv_cache) = (*s_prefix.get(i)?, *s_queue.get(i)?, *s_kv.get(i)?);
                let (no_hit_lru, lora, (precise, precise_blocks)) = (*s_lru.get(i)?, *s_lora.get(i)?, *precise.get(i)?);
                let matched_blocks = *matched.get(i)?;
                // The approximate and precise prefix scores measure one thing, what the endpoint
                // holds (from routing decisions, from the engine's KV events): the stronger one
                // counts, once, so precise mode does not double prefix affinity against load.
                let affinity = if gated(i) { (w.prefix * prefix).max(w.precise_prefix * precise) } else { 0.0 };
                let total =
                    affinity + w.queue * queue + w.kv_cache * kv_cache + w.no_hit_lru * no_hit_lru + w.lora * lora;
                let cached_tokens = (matched_blocks * block_tokens).max(precise_blocks * e.block_size as usize);
                Some(ScoredEndpoint {
                    address: e.address.clone(),
                    prefix,
                    queue,
                    kv_cache,
                    no_hit_lru,
                    precise,
                    lora,
                    total,
                    matched_blocks,
                    cached_tokens: cached_tokens.min(input.prompt_tokens),
                    affine: gated(i),
                })
            })
            .collect();
        (scored, cold)
    }

    /// Choose endpoints for a request: the decode profile (every endpoint that serves whole
    /// requests or decodes) picks the primary and fallbacks; if the prompt's uncached tokens
    /// there reach the P/D threshold and the pool has prefill endpoints, the prefill profile
    /// picks one (`reference/llmd.md` §1.4).
    pub fn schedule(
        &self,
        input: &SchedulingInput<'_>,
        pool: &PoolState,
        state: &mut SchedulerState,
    ) -> Result<Decision, ScheduleError> {
        let eps = &pool.endpoints;
        if eps.is_empty() {
            return Err(ScheduleError::NoEndpoints);
        }
        let mut serving: Vec<usize> = (0..eps.len()).collect();
        filter::by_model(eps, &mut serving, input.model);
        if serving.is_empty() {
            return Err(ScheduleError::UnknownModel(input.model.to_owned()));
        }
        let mut cands = serving.clone();
        filter::by_health(eps, &mut cands);
        if cands.is_empty() {
            return Err(ScheduleError::NoEndpoints);
        }
        filter::by_saturation(eps, &mut cands, &self.config.saturation);
        let matches = if input.block_hashes.is_empty() {
            HashMap::new()
        } else {
            state.index.match_lengths(input.block_hashes, input.anchors)
        };
        let (all, cold) = self.score(eps, &cands, input, &matches, state, &self.config.weights);
        let totals: Vec<f64> = all.iter().map(|s| s.total).collect();
        let mut order = picker::max_score(&totals, totals.len(), input.seed);
        // Affine candidates lead when the filter holds (the primary keeps the cache, the others
        // remain fallbacks); a session's sticky endpoint leads while it is a candidate (ready,
        // serving the model, not saturated). Within each tier the score order stands.
        let affinity_held = !input.load_only && self.affinity_holds(&all, input);
        let sticky = input.sticky.and_then(|a| all.iter().position(|s| s.address == a));
        let tiers: Vec<u8> = (0..all.len())
            .map(|i| match all.get(i) {
                _ if sticky == Some(i) => picker::tier::STICKY,
                Some(s) if affinity_held && s.affine => picker::tier::AFFINE,
                _ => picker::tier::NONE,
            })
            .collect();
        picker::by_tier(&mut order, |i| tiers.get(i).copied().unwrap_or(picker::tier::NONE));
        order.truncate(if sticky.is_some() { self.config.max_endpoints.max(1) } else { self.config.max_endpoints });
        let scores: Vec<ScoredEndpoint> = order.iter().filter_map(|&i| all.get(i).cloned()).collect();
        let Some(primary) = scores.first() else {
            return Err(ScheduleError::NoEndpoints);
        };
        let prefill = if pd::should_disaggregate(&self.config.pd, input.prompt_tokens, primary.cached_tokens) {
            let mut p = serving;
            filter::prefill_role(eps, &mut p);
            p.retain(|&i| eps.get(i).is_some_and(|e| e.address != primary.address));
            filter::by_saturation(eps, &mut p, &self.config.saturation);
            let (ps, _) = self.score(eps, &p, input, &matches, state, &self.config.pd.prefill_weights);
            let totals: Vec<f64> = ps.iter().map(|s| s.total).collect();
            picker::max_score(&totals, 1, input.seed).first().and_then(|&i| ps.get(i).cloned())
        } else {
            None
        };
        Ok(Decision {
            endpoints: scores.iter().map(|s| s.address.clone()).collect(),
            scores,
            candidates: all.len(),
            all,
            total_blocks: input.block_hashes.len(),
            cold,
            prefill,
            sticky: sticky.is_some(),
            tiers,
        })
    }

    /// Whether the affinity filter applies (llm-d's `prefix-cache-affinity-filter` with its
    /// TTFT load gate, see [`crate::config::AffinityGate`]): some candidate is affine, and the
    /// best affine one's estimated TTFT is within the penalty of the best other's.
    fn affinity_holds(&self, all: &[ScoredEndpoint], input: &SchedulingInput<'_>) -> bool {
        let gate = &self.config.prefix.affinity_filter;
        if !gate.enabled || all.iter().all(|s| !s.affine) || all.iter().all(|s| s.affine) {
            return false;
        }
        let est = |s: &ScoredEndpoint| {
            let queued = input.inflight_tokens.and_then(|m| m.get(&s.address)).copied().unwrap_or(0);
            let own = input.prompt_tokens.saturating_sub(s.cached_tokens) as u64;
            gate.ttft_ms(queued.saturating_add(own))
        };
        let best = |affine: bool| all.iter().filter(|s| s.affine == affine).map(est).fold(f64::INFINITY, f64::min);
        best(true) - best(false) <= gate.max_ttft_penalty_ms
    }

    /// Record a decision (llm-d's `PreRequest` step): the approximate index learns where the
    /// prefix went, and a cold request moves its endpoint to the back of the no-hit LRU.
    pub fn commit(&self, decision: &Decision, block_hashes: &[u64], anchors: &[usize], state: &mut SchedulerState) {
        if let Some(primary) = decision.endpoints.first() {
            state.index.record(block_hashes, anchors, primary);
            if decision.cold {
                state.no_hit_lru.record(primary);
            }
        }
        // The prefill endpoint computed the prompt and keeps it in its prefix cache too.
        if let Some(p) = &decision.prefill {
            state.index.record(block_hashes, anchors, &p.address);
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
        let endpoints = (0..n).map(|i| Endpoint::idle(format!("10.0.0.{i}:8000"), "m")).collect();
        PoolState { version: 1, endpoints, ..Default::default() }
    }

    /// A request for model `m` with these block hashes and nothing else known.
    fn bare<'a>(hashes: &'a [u64], inflight: &'a HashMap<String, u32>) -> SchedulingInput<'a> {
        SchedulingInput {
            model: "m",
            block_hashes: hashes,
            anchors: &[],
            inflight,
            inflight_tokens: None,
            seed: 3,
            extra_matches: None,
            precise: None,
            prompt_tokens: hashes.len() * 64,
            sticky: None,
            load_only: false,
        }
    }

    fn run(s: &Scheduler, pool: &PoolState, ix: &mut SchedulerState, prompt: &str, seed: u64) -> Decision {
        let hashes = block_hashes(&s.config.prefix, "m", None, &Prompt::Text(prompt.into()));
        let inflight = HashMap::new();
        let d = s
            .schedule(
                &SchedulingInput {
                    model: "m",
                    block_hashes: &hashes,
                    anchors: &[],
                    inflight: &inflight,
                    inflight_tokens: None,
                    seed,
                    extra_matches: None,
                    precise: None,
                    prompt_tokens: prompt.len() / 4,
                    sticky: None,
                    load_only: false,
                },
                pool,
                ix,
            )
            .unwrap();
        s.commit(&d, &hashes, &[], ix);
        d
    }

    #[test]
    fn shared_prefix_sticks_and_unrelated_spread() {
        let s = Scheduler::default();
        let p = pool(4);
        let mut ix = s.new_state();
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
                run(&s, &p, &mut ix, &format!("{g} unrelated group {g} ").repeat(50), 1000 + g).endpoints[0].clone(),
            );
        }
        assert_eq!(seen.len(), 4, "unrelated prefixes should use the whole pool");
    }

    #[test]
    fn a_short_shared_preamble_does_not_pull_new_sessions_but_a_long_match_does() {
        // 10 blocks of preamble every session shares, then 7 blocks of its own: 59% held.
        let preamble = "Tools: read_file, write_file, run_tests, search. ".repeat(52);
        let own = |k: usize| format!("Repository {k}: ").repeat(110);
        let sessions = |s: &Scheduler| {
            let p = pool(4);
            let mut ix = s.new_state();
            let first = run(s, &p, &mut ix, &format!("{preamble}{}", own(0)), 1);
            let d = (1..4).map(|k| run(s, &p, &mut ix, &format!("{preamble}{}", own(k)), k as u64)).collect::<Vec<_>>();
            (first, d)
        };
        let (first, later) = sessions(&Scheduler::default());
        let held = later[0].all.iter().find(|e| e.address == first.endpoints[0]).map(|e| e.prefix).unwrap_or(0.0);
        assert!(held > 0.5 && held < 0.8, "the preamble is a partial match: {held}");
        let mut used: std::collections::HashSet<_> = later.iter().map(|d| d.endpoints[0].clone()).collect();
        used.insert(first.endpoints[0].clone());
        assert_eq!(used.len(), 4, "below the threshold, new sessions spread over the pool");
        assert!(later.iter().all(|d| d.cold), "spread like cold requests");
        // The same sessions with the gate off: the preamble's holder takes every one.
        let mut off = Scheduler::default();
        off.config.prefix.affinity_threshold = 0.0;
        let (first, later) = sessions(&off);
        assert!(later.iter().all(|d| d.endpoints[0] == first.endpoints[0]), "affinity to a 59% match");
        // A long match (a turn's own history, 90%+) still sticks with the gate on.
        let s = Scheduler::default();
        let p = pool(4);
        let mut ix = s.new_state();
        let history = format!("{preamble}{}", own(9));
        let a = run(&s, &p, &mut ix, &history, 1);
        let b = run(&s, &p, &mut ix, &format!("{history} and one more question"), 2);
        assert_eq!(b.endpoints[0], a.endpoints[0]);
        assert!(b.scores[0].prefix >= 0.8 && !b.cold);
    }

    #[test]
    fn a_running_adapter_outranks_a_free_slot_that_cold_spreading_favours() {
        // The CI failure this guards: engine 1 runs `tweet` and has some KV in use, engine 2 has
        // a free slot and has never received a cold request. With no-hit-lru spreading the
        // adapter request as a cold prefix, engine 2 won by the LRU point.
        let s = Scheduler::default();
        let mut p = pool(3);
        let lora = |running: &[&str]| {
            Some(crate::endpoint::LoraState {
                running: running.iter().map(|a| a.to_string()).collect(),
                waiting: vec![],
                max_lora: 1,
            })
        };
        p.endpoints[0].lora = lora(&["sql"]);
        p.endpoints[1].lora = lora(&["tweet"]);
        p.endpoints[2].lora = lora(&[]);
        for e in &mut p.endpoints {
            e.models.extend(["sql".to_string(), "tweet".to_string()]);
        }
        for e in &mut p.endpoints[..2] {
            e.metrics = Some(EndpointMetrics { kv_usage: 0.2, ..Default::default() });
        }
        let mut ix = s.new_state();
        // Engine 1 received the last cold request, so it ranks last in the no-hit LRU.
        ix.no_hit_lru.record(&p.endpoints[0].address);
        ix.no_hit_lru.record(&p.endpoints[1].address);
        for k in 0..4 {
            let hashes = block_hashes(&s.config.prefix, "tweet", None, &Prompt::Text(format!("tweet {k}")));
            let inflight = HashMap::new();
            let input = SchedulingInput {
                model: "tweet",
                block_hashes: &hashes,
                anchors: &[],
                inflight: &inflight,
                inflight_tokens: None,
                seed: k,
                extra_matches: None,
                precise: None,
                prompt_tokens: 2,
                sticky: None,
                load_only: false,
            };
            let d = s.schedule(&input, &p, &mut ix).unwrap();
            assert_eq!(d.endpoints[0], p.endpoints[1].address, "tweet goes where tweet runs: {:?}", d.scores);
            s.commit(&d, &hashes, &[], &mut ix);
        }
        // A base-model cold request still spreads: it goes to the least recently used engine.
        let d = run(&s, &p, &mut ix, "hello", 9);
        assert_eq!(d.endpoints[0], p.endpoints[2].address);
    }

    #[test]
    fn a_silent_host_leaves_only_the_schedulers_own_load() {
        let s = Scheduler::default();
        let mut p = pool(3);
        let mut ix = s.new_state();
        let prompt = "the same long system prompt ".repeat(40);
        let home = run(&s, &p, &mut ix, &prompt, 1).endpoints[0].clone();
        // The host's (possibly stale) metrics call the home endpoint idle and the others busy.
        for e in &mut p.endpoints {
            let waiting = if e.address == home { 0.0 } else { 4.0 };
            e.metrics = Some(EndpointMetrics { waiting, ..Default::default() });
        }
        let hashes = block_hashes(&s.config.prefix, "m", None, &Prompt::Text(prompt.clone()));
        // This scheduler itself has two requests in flight to home, none elsewhere.
        let inflight: HashMap<String, u32> = [(home.clone(), 2)].into();
        let input = |load_only| SchedulingInput {
            model: "m",
            block_hashes: &hashes,
            anchors: &[],
            inflight: &inflight,
            inflight_tokens: None,
            seed: 3,
            extra_matches: None,
            precise: None,
            prompt_tokens: 300,
            sticky: None,
            load_only,
        };
        let fresh = s.schedule(&input(false), &p, &mut ix).unwrap();
        assert_eq!(fresh.endpoints[0], home, "prefix and host metrics favour home");
        let stale = s.schedule(&input(true), &p, &mut ix).unwrap();
        assert_ne!(stale.endpoints[0], home, "load-only: home has this scheduler's in-flight requests");
        for sc in &stale.scores {
            let expected = if sc.address == home { 0.0 } else { 1.0 };
            assert_eq!((sc.queue, sc.total), (expected, 2.0 * expected), "{sc:?}");
        }
    }

    #[test]
    fn saturated_endpoint_is_avoided_even_with_prefix() {
        let s = Scheduler::default();
        let mut p = pool(3);
        let mut ix = s.new_state();
        let prompt = "shared ".repeat(300);
        let first = run(&s, &p, &mut ix, &prompt, 3);
        let hot = p.endpoints.iter_mut().find(|e| e.address == first.endpoints[0]).unwrap();
        hot.metrics = Some(EndpointMetrics { waiting: 20.0, running: 8.0, kv_usage: 0.5, age_ms: 0, ttft_ms: 0.0 });
        for seed in 0..10 {
            let d = run(&s, &p, &mut ix, &prompt, seed);
            assert_ne!(d.endpoints[0], first.endpoints[0]);
        }
    }

    #[test]
    fn cold_prefixes_spread_evenly_on_an_idle_pool() {
        let s = Scheduler::default();
        let p = pool(4);
        let mut st = s.new_state();
        let mut per: std::collections::HashMap<String, usize> = Default::default();
        for g in 0..8 {
            let d = run(&s, &p, &mut st, &format!("group {g} ").repeat(80), 7);
            assert!(d.cold);
            *per.entry(d.endpoints[0].clone()).or_default() += 1;
        }
        assert!(per.values().all(|&n| n == 2), "{per:?}");
    }

    #[test]
    fn matches_learned_by_another_worker_are_used() {
        let s = Scheduler::default();
        let p = pool(4);
        let prompt = "a long shared system prompt ".repeat(40);
        let hashes = block_hashes(&s.config.prefix, "m", None, &Prompt::Text(prompt));
        let target = p.endpoints[2].address.clone();
        let extra: HashMap<String, usize> = [(target.clone(), hashes.len())].into_iter().collect();
        let inflight = HashMap::new();
        let mut fresh = s.new_state();
        for seed in 0..8 {
            let input = SchedulingInput {
                model: "m",
                block_hashes: &hashes,
                anchors: &[],
                inflight: &inflight,
                inflight_tokens: None,
                seed,
                extra_matches: Some(&extra),
                precise: None,
                prompt_tokens: 0,
                sticky: None,
                load_only: false,
            };
            let d = s.schedule(&input, &p, &mut fresh).unwrap();
            assert_eq!(d.endpoints[0], target);
            assert!(!d.cold);
        }
    }

    #[test]
    fn precise_matches_route_to_the_holder_even_with_no_routing_history() {
        let s = Scheduler::default();
        let mut p = pool(4);
        for (i, e) in p.endpoints.iter_mut().enumerate() {
            e.id = i as u32 + 10;
        }
        let precise: HashMap<u32, (f64, usize)> = [(12, (0.9, 30))].into_iter().collect();
        let inflight = HashMap::new();
        let mut st = s.new_state();
        let input = SchedulingInput {
            model: "m",
            block_hashes: &[1, 2, 3],
            anchors: &[],
            inflight: &inflight,
            inflight_tokens: None,
            seed: 5,
            extra_matches: None,
            precise: Some(&precise),
            prompt_tokens: 0,
            sticky: None,
            load_only: false,
        };
        let d = s.schedule(&input, &p, &mut st).unwrap();
        assert_eq!(d.endpoints[0], p.endpoints[2].address);
        assert!(!d.cold);
        assert!((d.scores[0].precise - 0.9).abs() < 1e-9);
    }

    #[test]
    fn approximate_and_precise_affinity_count_once_against_load() {
        // Endpoint 0 holds the prompt by both measures but has a queue; endpoint 1 holds
        // nothing and is idle. Affinity (3) must not count twice (6) against load (2 + 2).
        // (Scores alone: the affinity filter, which would keep the holder, is off.)
        let mut s = Scheduler::default();
        s.config.prefix.affinity_filter.enabled = false;
        let mut p = pool(2);
        for (i, e) in p.endpoints.iter_mut().enumerate() {
            e.id = i as u32;
        }
        p.endpoints[0].metrics = Some(EndpointMetrics { waiting: 4.0, kv_usage: 0.6, ..Default::default() });
        let hashes = [7u64, 8, 9];
        let shared: HashMap<String, usize> = [(p.endpoints[0].address.clone(), 3)].into_iter().collect();
        let precise: HashMap<u32, (f64, usize)> = [(0, (1.0, 3))].into_iter().collect();
        let inflight = HashMap::new();
        let mut st = s.new_state();
        let input = SchedulingInput {
            model: "m",
            block_hashes: &hashes,
            anchors: &[],
            inflight: &inflight,
            inflight_tokens: None,
            seed: 1,
            extra_matches: Some(&shared),
            precise: Some(&precise),
            prompt_tokens: 48,
            sticky: None,
            load_only: false,
        };
        let d = s.schedule(&input, &p, &mut st).unwrap();
        let holder = d.scores.iter().find(|x| x.address == p.endpoints[0].address).unwrap();
        assert!((holder.prefix - 1.0).abs() < 1e-9 && (holder.precise - 1.0).abs() < 1e-9);
        // 3 (affinity, once) + 0 (worst queue) + 2 * 0.4 (KV) + LRU; the idle one: 2 + 2 + LRU.
        assert!((holder.total - (3.8 + holder.no_hit_lru)).abs() < 1e-9, "{}", holder.total);
        assert_eq!(d.endpoints[0], p.endpoints[1].address, "the idle endpoint wins");
    }

    #[test]
    fn a_match_learned_from_another_worker_is_gated_by_what_it_may_hold() {
        // A 200-block token prompt whose first 161 blocks (80.5%) another worker sent to
        // endpoint 0: the affinity table proves 144 (0.72, under the 0.8 gate) and bounds it
        // at 161. The gate must judge the bound, as it does for this worker's own index.
        let s = Scheduler::default();
        let p = pool(3);
        let hashes: Vec<u64> = (1..=200).collect();
        let shared: HashMap<String, usize> = [(p.endpoints[0].address.clone(), 144)].into_iter().collect();
        let inflight = HashMap::new();
        let mut st = s.new_state();
        let input = SchedulingInput { extra_matches: Some(&shared), ..bare(&hashes, &inflight) };
        let d = s.schedule(&input, &p, &mut st).unwrap();
        assert!(!d.cold, "the holder passes the gate");
        assert_eq!(d.endpoints[0], p.endpoints[0].address);
        assert!((d.scores[0].prefix - 0.72).abs() < 1e-9, "the score counts proven blocks: {}", d.scores[0].prefix);
        // Proven 128 (bounded at 143, 0.715): under the gate, spread cold.
        let weak: HashMap<String, usize> = [(p.endpoints[0].address.clone(), 128)].into_iter().collect();
        let d = s.schedule(&SchedulingInput { extra_matches: Some(&weak), ..input }, &p, &mut st).unwrap();
        assert!(d.cold);
    }

    #[test]
    fn the_affinity_filter_keeps_a_warm_request_on_its_cache_until_the_ttft_gate() {
        // Endpoint 0 holds 90% of a 6,400-token prompt but is the busiest (its queue and KV
        // below saturation); endpoints 1 and 2 are idle and hold nothing.
        let mut s = Scheduler::default();
        let mut p = pool(3);
        for (i, e) in p.endpoints.iter_mut().enumerate() {
            e.id = i as u32;
            e.block_size = 16;
        }
        p.endpoints[0].metrics = Some(EndpointMetrics { waiting: 4.0, kv_usage: 0.9, ..Default::default() });
        let precise: HashMap<u32, (f64, usize)> = [(0, (0.9, 360))].into_iter().collect();
        let holder = p.endpoints[0].address.clone();
        let inflight: HashMap<String, u32> = [(holder.clone(), 6)].into_iter().collect();
        let mut tokens: HashMap<String, u64> = [(holder.clone(), 1_000)].into_iter().collect();
        let mut st = s.new_state();
        let mut pick = |s: &Scheduler, tokens: &HashMap<String, u64>| {
            let input = SchedulingInput {
                model: "m",
                block_hashes: &[1, 2, 3],
                anchors: &[],
                inflight: &inflight,
                inflight_tokens: Some(tokens),
                seed: 2,
                extra_matches: None,
                precise: Some(&precise),
                prompt_tokens: 6_400,
                sticky: None,
                load_only: false,
            };
            s.schedule(&input, &p, &mut st).unwrap()
        };
        let d = pick(&s, &tokens);
        assert_eq!(d.endpoints[0], holder, "the affine endpoint leads: {:?}", d.scores);
        assert!(d.scores[0].affine && !d.scores[1].affine);
        assert_eq!(d.tiers, vec![picker::tier::AFFINE, picker::tier::NONE, picker::tier::NONE], "the picker keeps it");
        assert_eq!(d.endpoints.len(), 3, "the others stay as fallbacks");
        let idle_total = d.scores[1].total;
        assert!(idle_total > d.scores[0].total, "by score alone the idle endpoint would win");
        // Scores alone (filter off) pick an idle endpoint.
        s.config.prefix.affinity_filter.enabled = false;
        let d = pick(&s, &tokens);
        assert_ne!(d.endpoints[0], holder);
        assert!(d.tiers.iter().all(|&t| t == picker::tier::NONE), "no filter, no tier: {:?}", d.tiers);
        s.config.prefix.affinity_filter.enabled = true;
        // The TTFT gate: 300,000 queued uncached tokens at 15,928 tokens/s is 18.8 s behind an
        // idle endpoint's 6,400 / 15,928 = 0.4 s, more than the 18 s penalty.
        tokens.insert(holder.clone(), 300_000);
        assert_ne!(pick(&s, &tokens).endpoints[0], holder, "the gate yields to load");
        tokens.insert(holder.clone(), 280_000);
        assert_eq!(pick(&s, &tokens).endpoints[0], holder, "17.6 s + 0.04 s behind 0.4 s is within 18 s");
    }

    #[test]
    fn errors_and_fallbacks() {
        let s = Scheduler::default();
        let mut ix = s.new_state();
        let inflight = HashMap::new();
        let input = SchedulingInput {
            model: "m",
            block_hashes: &[],
            anchors: &[],
            inflight: &inflight,
            inflight_tokens: None,
            seed: 0,
            extra_matches: None,
            precise: None,
            prompt_tokens: 0,
            sticky: None,
            load_only: false,
        };
        assert_eq!(s.schedule(&input, &PoolState::default(), &mut ix), Err(ScheduleError::NoEndpoints));
        let bad = SchedulingInput { model: "zzz", ..input };
        assert_eq!(s.schedule(&bad, &pool(2), &mut ix), Err(ScheduleError::UnknownModel("zzz".into())));
        let mut p = pool(2);
        p.endpoints.iter_mut().for_each(|e| e.ready = false);
        assert_eq!(s.schedule(&input, &p, &mut ix), Err(ScheduleError::NoEndpoints));
        let d = s.schedule(&input, &pool(5), &mut ix).unwrap();
        assert_eq!(d.endpoints.len(), 3);
        assert_eq!(d.header_value().split(',').count(), 3);
    }

    #[test]
    fn long_uncached_prompts_get_a_prefill_endpoint_and_short_or_cached_ones_do_not() {
        let s = Scheduler::default();
        let mut p = pool(4);
        p.endpoints[0].role = Role::Prefill;
        p.endpoints[1].role = Role::Prefill;
        p.endpoints[2].role = Role::Decode;
        let mut st = s.new_state();
        // 64 blocks of 64 tokens: every block full, so a repeat is fully cached.
        let long = "abcd".repeat(64 * 64);
        let d = run(&s, &p, &mut st, &long, 1);
        let decode = p.endpoints.iter().find(|e| e.address == d.endpoints[0]).unwrap();
        assert_ne!(decode.role, Role::Prefill, "the primary decodes");
        let pre = d.prefill.as_ref().expect("split");
        let pre_ep = p.endpoints.iter().find(|e| e.address == pre.address).unwrap();
        assert_eq!(pre_ep.role, Role::Prefill);
        assert_eq!(d.prefiller(), Some(pre.address.as_str()));
        // The same prompt again: the decode endpoint holds it now.
        let again = run(&s, &p, &mut st, &long, 2);
        assert_eq!(again.endpoints[0], d.endpoints[0]);
        assert!(again.prefill.is_none(), "fully cached: no split ({} cached)", again.scores[0].cached_tokens);
        // Short prompts are prefilled where they decode.
        assert!(run(&s, &p, &mut st, "hi there", 3).prefill.is_none());
        // P/D off, or no prefill endpoint: never split.
        let off = Scheduler::new(SchedulerConfig {
            pd: pd::PdConfig { threshold_tokens: 0, ..Default::default() },
            ..Default::default()
        });
        assert!(run(&off, &p, &mut off.new_state(), &long, 1).prefill.is_none());
        assert!(run(&s, &pool(4), &mut s.new_state(), &long, 1).prefill.is_none());
    }

    #[test]
    fn a_sticky_endpoint_leads_while_it_is_healthy_and_not_saturated() {
        let s = Scheduler::default();
        let mut p = pool(4);
        let mut st = s.new_state();
        let inflight = HashMap::new();
        let target = p.endpoints[3].address.clone();
        let input = |sticky: Option<&'static str>| SchedulingInput {
            model: "m",
            block_hashes: &[],
            anchors: &[],
            inflight: &inflight,
            inflight_tokens: None,
            seed: 9,
            extra_matches: None,
            precise: None,
            prompt_tokens: 10,
            sticky,
            load_only: false,
        };
        let t: &'static str = Box::leak(target.clone().into_boxed_str());
        for _ in 0..5 {
            let d = s.schedule(&input(Some(t)), &p, &mut st).unwrap();
            assert_eq!(d.endpoints[0], target);
            assert!(d.sticky && d.endpoints.len() == 3 && !d.endpoints[1..].contains(&target));
        }
        // Saturated or gone: routed elsewhere, not sticky.
        p.endpoints[3].metrics = Some(EndpointMetrics { waiting: 50.0, ..Default::default() });
        let d = s.schedule(&input(Some(t)), &p, &mut st).unwrap();
        assert!(d.endpoints[0] != target && !d.sticky);
        p.endpoints[3].ready = false;
        assert_ne!(s.schedule(&input(Some(t)), &p, &mut st).unwrap().endpoints[0], target);
        assert!(!s.schedule(&input(Some("10.9.9.9:1")), &p, &mut st).unwrap().sticky, "unknown endpoint");
    }
}
