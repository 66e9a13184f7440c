//! The profile handler: runs the `decode` profile for the primary endpoint and the fallbacks,
//! then, when llm-d's P/D decider splits the request, the `prefill` profile
//! ([`crate::profiles`]).

use hashbrown::HashMap;

use crate::calibration::HitCalibration;
use crate::config::SchedulerConfig;
use crate::endpoint::{Endpoint, PoolState};
use crate::error::ScheduleError;
use crate::filters::{prefix_affinity, FilterContext};
use crate::index::ApproxPrefixIndex;
use crate::pickers::tier;
use crate::probe;
use crate::profiles::pd;
use crate::profiles::{Profile, ProfileError, ProfileRun, SchedulingInput, Scored, ScoredEndpoint};
use crate::scorers::no_hit_lru::LastCold;
use crate::scorers::session_load::ActiveSessions;
use crate::scratch::Buf;

/// The scheduler's verdict.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Primary endpoint first, then fallbacks.
    pub endpoints: Vec<String>,
    /// Scores of the chosen endpoints, in the same order.
    pub scores: Vec<ScoredEndpoint>,
    /// Every candidate that passed the filters, scored, in pool order (custom scorers and the
    /// picker see these), by position in the pool.
    pub all: Vec<Scored>,
    /// Candidates left after filtering.
    pub candidates: usize,
    /// Blocks the request hashed to.
    pub total_blocks: usize,
    /// No candidate held enough of the request's prefix to count.
    pub cold: bool,
    /// The prefill endpoint, when the P/D decider split the request (`x-prefiller-host-port`).
    pub prefill: Option<ScoredEndpoint>,
    /// The primary is the request's sticky endpoint.
    pub sticky: bool,
    /// The request's prefix was hot on its holders and spread to another endpoint
    /// ([`prefix_affinity::spread_to`]).
    pub spread: bool,
    /// Per candidate of `all`, the tier it leads in ([`tier`]): what the custom-scorer picker
    /// must keep when it re-picks (`scoring::TIERS_PROPERTY`).
    pub tiers: Vec<u8>,
}

impl Decision {
    /// `x-gateway-destination-endpoint` value: `ip:port[,fallback…]`.
    pub fn header_value(&self) -> String {
        self.endpoints.join(",")
    }

    /// The primary's KV write clock when the decision was made: what its blocks are stamped
    /// with in the prefix index and the affinity table.
    pub fn primary_kv_written(&self) -> Option<u64> {
        let primary = self.endpoints.first()?;
        self.scores.first().filter(|s| s.address == *primary).and_then(|s| s.kv_written)
    }

    /// The primary's expected prefix hit, 0..1 (0 without a primary).
    pub fn primary_hit(&self) -> f32 {
        self.scores.first().map_or(0.0, |s| s.scored.prefix_hit as f32)
    }

    /// The expected prefix hit (0..1) of the candidate at `address`, as this decision scored it:
    /// how a shadow's pick is graded by the same yardstick as the live one. `None` if `address`
    /// was not a candidate here.
    pub fn hit_of(&self, pool: &PoolState, address: &str) -> Option<f32> {
        self.all
            .iter()
            .find(|s| pool.endpoints.get(s.position).is_some_and(|e| e.address == address))
            .map(|s| s.prefix_hit as f32)
    }

    /// `x-prefiller-host-port` value, when the request is disaggregated.
    pub fn prefiller(&self) -> Option<&str> {
        self.prefill.as_ref().map(|p| p.address.as_str())
    }
}

/// What one scheduler instance (an Envoy worker, the endpoint picker, the simulator's router)
/// has learned from its own decisions.
pub struct SchedulerState {
    pub index: ApproxPrefixIndex,
    pub no_hit_lru: LastCold,
    pub sessions: ActiveSessions,
    /// The expected prefix hit against the engines' own counters.
    pub calibration: HitCalibration,
    /// Where interactive requests went lately ([`crate::spare`]).
    pub interactive: crate::spare::InteractiveHomes,
}

impl SchedulerState {
    pub fn new(config: &SchedulerConfig) -> Self {
        Self {
            index: ApproxPrefixIndex::new(config.prefix.index_capacity),
            no_hit_lru: LastCold::default(),
            sessions: ActiveSessions::default(),
            calibration: HitCalibration::default(),
            interactive: crate::spare::InteractiveHomes::default(),
        }
    }

    /// Age what ages with time to `now_ms` (active sessions lapse): a host calls it before
    /// planning, so a request after a quiet spell is not scored on sessions long gone.
    pub fn advance(&mut self, now_ms: u64) {
        self.sessions.expire(now_ms);
    }

    /// Record a decision (llm-d's `PreRequest` step): the approximate index learns where the
    /// prefix went, and a cold request moves its endpoint to the back of the no-hit LRU.
    pub fn commit(&mut self, decision: &Decision, block_hashes: &[u64], anchors: &[usize]) {
        if let Some(primary) = decision.endpoints.first() {
            self.index.record_at(block_hashes, anchors, primary, decision.primary_kv_written());
            if decision.cold {
                self.no_hit_lru.record(primary);
            }
        }
        // The prefill endpoint computed the prompt and keeps it in its prefix cache too.
        if let Some(p) = &decision.prefill {
            self.index.record_at(block_hashes, anchors, &p.address, p.kv_written);
        }
    }
}

/// Per candidate, the tier it leads in; whether the sticky endpoint leads; whether a hot
/// prefix spread.
struct Tiers {
    tiers: Vec<u8>,
    sticky: bool,
    spread: bool,
}

/// The configured profiles.
#[derive(Debug, Clone)]
pub struct Scheduler {
    pub config: SchedulerConfig,
    decode: Profile,
    prefill: Profile,
}

impl Scheduler {
    /// Resolve the configured profiles.
    pub fn new(config: SchedulerConfig) -> Result<Self, ProfileError> {
        let decode = Profile::resolve("decode", &config.profiles.decode)?;
        let prefill = Profile::resolve("prefill", &config.profiles.prefill)?;
        Ok(Self { config, decode, prefill })
    }

    pub fn new_state(&self) -> SchedulerState {
        SchedulerState::new(&self.config)
    }

    /// The decode profile (its scorers name the metrics recorded for a decision).
    pub fn decode_profile(&self) -> &Profile {
        &self.decode
    }

    fn run<'a>(
        &'a self,
        profile: &'a Profile,
        pool: &'a PoolState,
        input: &'a SchedulingInput<'a>,
        matches: &'a HashMap<&'a str, usize>,
        state: &'a SchedulerState,
    ) -> ProfileRun<'a> {
        ProfileRun {
            profile,
            endpoints: &pool.endpoints,
            input,
            matches,
            last_cold: &state.no_hit_lru,
            sessions: &state.sessions,
            saturation: &self.config.saturation,
            affinity_threshold: self.config.prefix.affinity_threshold,
            block_tokens: self.config.prefix.block_size_tokens,
        }
    }

    /// Choose endpoints for a request: the decode profile picks the primary and fallbacks; if
    /// the prompt's uncached tokens there reach the P/D threshold and the pool has prefill
    /// endpoints, the prefill profile picks one (`reference/llmd.md` §1.4).
    pub fn schedule(
        &self,
        input: &SchedulingInput<'_>,
        pool: &PoolState,
        state: &SchedulerState,
    ) -> Result<Decision, ScheduleError> {
        if pool.endpoints.is_empty() {
            return Err(ScheduleError::NoEndpoints);
        }
        let filter_ctx = |exclude| FilterContext {
            endpoints: &pool.endpoints,
            model: input.model,
            saturation: &self.config.saturation,
            exclude,
        };
        let matches = if input.block_hashes.is_empty() {
            HashMap::new()
        } else {
            let share = self.config.prefix.cache_share;
            let clock = |a: &str| pool.kv_clock(a, share);
            state.index.match_lengths_at(input.block_hashes, input.anchors, clock)
        };
        probe::mark("schedule.match");
        // Large pools: filter and score the endpoints that hold something the request needs
        // and the least loaded others, not every one; the whole pool when that leaves none.
        let shortlisted = crate::preselect::shortlist(&self.config.preselect, pool, input, &matches)
            .and_then(|c| self.decode.filter_among(&filter_ctx(None), c).ok())
            .filter(|c| !c.is_empty());
        let mut candidates = match shortlisted {
            Some(c) => c,
            None => self.decode.filter(&filter_ctx(None))?,
        };
        if let Some(subset) = input.subset {
            subset.restrict(&pool.endpoints, &mut candidates)?;
        }
        if input.sheddable {
            state.interactive.keep_spare(&self.config.spare, &pool.endpoints, &mut candidates, input.now_ms);
        }
        probe::mark("schedule.shortlist");
        let (all, cold) = self.run(&self.decode, pool, input, &matches, state).score(&candidates);
        probe::mark("schedule.score");
        let Tiers { tiers, sticky, spread } = self.tiers(&all, &pool.endpoints, input);
        let mut totals = Buf::<f64>::take();
        totals.extend(all.iter().map(|s| s.total));
        let mut order = self.decode.picker.pick(&totals, &tiers, input.seed);
        order.truncate(if sticky { self.config.max_endpoints.max(1) } else { self.config.max_endpoints });
        let scores: Vec<ScoredEndpoint> =
            order.iter().filter_map(|&i| Some(all.get(i)?.named(&pool.endpoints))).collect();
        let Some(primary) = scores.first() else {
            return Err(ScheduleError::NoEndpoints);
        };
        probe::mark("schedule.pick");
        let split = pd::should_disaggregate(&self.config.pd, input.prompt_tokens, primary.cached_tokens);
        let prefill = if split && !crate::preselect::no_prefiller(pool, &self.prefill) {
            let run = self.run(&self.prefill, pool, input, &matches, state);
            let allowed = |mut c: Vec<usize>| match input.subset {
                Some(s) => s.restrict(&pool.endpoints, &mut c).map(|()| c),
                None => Ok(c),
            };
            let ctx = filter_ctx(Some(&primary.address));
            let filtered = match crate::preselect::prefill_candidates(&self.config.preselect, pool, &self.prefill) {
                Some(c) => self.prefill.filter_among(&ctx, c),
                None => self.prefill.filter(&ctx),
            };
            filtered.and_then(allowed).ok().and_then(|c| {
                let (ps, _) = run.score(&c);
                let mut totals = Buf::<f64>::take();
                totals.extend(ps.iter().map(|s| s.total));
                let first = self.prefill.picker.pick(&totals, &[], input.seed).first().and_then(|&i| ps.get(i));
                first.map(|s| s.named(&pool.endpoints))
            })
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
            sticky,
            spread: spread && !sticky,
            tiers,
        })
    }

    /// The tier each candidate leads in: a session's sticky endpoint while it is a candidate
    /// (ready, serving the model, not saturated) and holding it pays
    /// ([`prefix_affinity::session_holds`]), then the affine candidates when the affinity
    /// filter holds (the primary keeps the cache; the others remain fallbacks), or the one
    /// candidate a hot prefix spreads to ([`prefix_affinity::spread_to`]). Within each tier
    /// the score order stands.
    fn tiers(&self, all: &[Scored], endpoints: &[Endpoint], input: &SchedulingInput<'_>) -> Tiers {
        let endpoint = |s: &Scored| endpoints.get(s.position);
        let address = |s: &Scored| endpoint(s).map_or("", |e| e.address.as_str());
        let gate = &self.config.prefix.affinity_filter;
        let sticky = input.sticky.and_then(|a| all.iter().position(|s| address(s) == a));
        // The gate's TTFT estimates only when it can apply: a session to weigh, or some
        // candidates affine and not all.
        let some_affine = all.iter().any(|s| s.affine) && !all.iter().all(|s| s.affine);
        let weigh = !input.load_only && gate.enabled && (some_affine || (sticky.is_some() && all.len() > 1));
        let mut estimates = Buf::<prefix_affinity::Estimate>::take();
        if weigh {
            let queued = |a: &str| input.inflight_tokens.and_then(|m| m.get(a)).copied().unwrap_or(0);
            let own = |s: &Scored| input.prompt_tokens.saturating_sub(s.cached_tokens) as u64;
            estimates.extend(all.iter().map(|s| {
                let m = endpoint(s).and_then(|e| e.metrics).unwrap_or_default();
                let rate = m.prefill_tokens_per_s;
                let wait_ms = gate.wait_ms(queued(address(s)), rate, m.waiting, m.ttft_ms);
                let ttft_ms = wait_ms + gate.ttft_ms(own(s), rate);
                prefix_affinity::Estimate { affine: s.affine, ttft_ms, wait_ms }
            }));
        }
        let spread = if weigh && some_affine { prefix_affinity::spread_to(gate, &estimates) } else { None };
        let affinity_held = spread.is_none() && weigh && some_affine && prefix_affinity::holds(gate, &estimates);
        let sticky = sticky.filter(|&i| !weigh || prefix_affinity::session_holds(gate, &estimates, i));
        let tiers = all
            .iter()
            .enumerate()
            .map(|(i, s)| {
                if sticky == Some(i) {
                    tier::STICKY
                } else if spread == Some(i) || (affinity_held && s.affine) {
                    tier::AFFINE
                } else {
                    tier::NONE
                }
            })
            .collect();
        Tiers { tiers, sticky: sticky.is_some(), spread: spread.is_some() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::{Endpoint, EndpointMetrics, LoraState, Role};
    use crate::prefix::block_hashes;
    use crate::request::Prompt;
    use crate::scorers::{kv_cache_utilization as kv, precise_prefix_cache as precise, prefix_cache as prefix, queue};

    fn pool(n: usize) -> PoolState {
        let endpoints = (0..n).map(|i| Endpoint::idle(format!("10.0.0.{i}:8000"), "m")).collect();
        PoolState { version: 1, endpoints, ..Default::default() }
    }

    /// `n` endpoints with KV-event ids 0..n and 16-token blocks, for precise matches.
    fn precise_pool(n: usize) -> PoolState {
        let mut p = pool(n);
        for (i, e) in p.endpoints.iter_mut().enumerate() {
            e.id = i as u32;
            e.block_size = 16;
        }
        p
    }

    fn scheduler() -> Scheduler {
        Scheduler::new(SchedulerConfig::default()).unwrap()
    }

    /// A request to schedule, built up from "model `m`, nothing known".
    #[derive(Clone)]
    struct Case {
        model: String,
        hashes: Vec<u64>,
        inflight: HashMap<String, u32>,
        inflight_tokens: Option<HashMap<String, u64>>,
        extra: Option<HashMap<&'static str, usize>>,
        precise: Option<HashMap<u32, (f64, usize)>>,
        prompt_tokens: usize,
        sticky: Option<String>,
        load_only: bool,
        seed: u64,
    }

    impl Case {
        fn new() -> Self {
            Self {
                model: "m".into(),
                hashes: vec![],
                inflight: HashMap::new(),
                inflight_tokens: None,
                extra: None,
                precise: None,
                prompt_tokens: 0,
                sticky: None,
                load_only: false,
                seed: 3,
            }
        }
        /// A text prompt, hashed as the scheduler's prefix config says.
        fn text(s: &Scheduler, model: &str, prompt: &str) -> Self {
            let hashes = block_hashes(&s.config.prefix, model, None, &Prompt::Text(prompt.into()));
            Self { model: model.into(), hashes, prompt_tokens: prompt.len() / 4, ..Self::new() }
        }
        fn hashes(self, hashes: &[u64]) -> Self {
            Self { hashes: hashes.to_vec(), prompt_tokens: hashes.len() * 64, ..self }
        }
        fn model(self, model: &str) -> Self {
            Self { model: model.into(), ..self }
        }
        fn seed(self, seed: u64) -> Self {
            Self { seed, ..self }
        }
        fn tokens(self, prompt_tokens: usize) -> Self {
            Self { prompt_tokens, ..self }
        }
        fn inflight(self, to: &str, n: u32) -> Self {
            Self { inflight: [(to.to_owned(), n)].into_iter().collect(), ..self }
        }
        fn queued_tokens(self, to: &str, n: u64) -> Self {
            Self { inflight_tokens: Some([(to.to_owned(), n)].into_iter().collect()), ..self }
        }
        fn learned(self, to: &str, blocks: usize) -> Self {
            // The matches borrow their addresses, as from the affinity table: a test's live on.
            let to: &'static str = Box::leak(to.to_owned().into_boxed_str());
            Self { extra: Some([(to, blocks)].into_iter().collect()), ..self }
        }
        fn precise(self, id: u32, score: f64, blocks: usize) -> Self {
            Self { precise: Some([(id, (score, blocks))].into_iter().collect()), ..self }
        }
        fn sticky(self, to: &str) -> Self {
            Self { sticky: Some(to.to_owned()), ..self }
        }
        fn load_only(self, load_only: bool) -> Self {
            Self { load_only, ..self }
        }
        fn input(&self) -> SchedulingInput<'_> {
            SchedulingInput {
                sheddable: false,
                now_ms: 0,
                model: &self.model,
                block_hashes: &self.hashes,
                anchors: &[],
                inflight: &self.inflight,
                inflight_tokens: self.inflight_tokens.as_ref(),
                seed: self.seed,
                extra_matches: self.extra.as_ref(),
                precise: self.precise.as_ref(),
                prompt_tokens: self.prompt_tokens,
                sticky: self.sticky.as_deref(),
                load_only: self.load_only,
                subset: None,
                session_key: None,
            }
        }
        fn schedule(&self, s: &Scheduler, pool: &PoolState, st: &SchedulerState) -> Result<Decision, ScheduleError> {
            s.schedule(&self.input(), pool, st)
        }
        /// Schedule and commit, as a scheduler does.
        fn route(&self, s: &Scheduler, pool: &PoolState, st: &mut SchedulerState) -> Decision {
            let d = self.schedule(s, pool, st).unwrap();
            st.commit(&d, &self.hashes, &[]);
            d
        }
    }

    fn run(s: &Scheduler, pool: &PoolState, st: &mut SchedulerState, prompt: &str, seed: u64) -> Decision {
        Case::text(s, "m", prompt).seed(seed).route(s, pool, st)
    }

    #[test]
    fn a_prefix_the_engine_has_since_evicted_no_longer_pulls() {
        // Engines of 256 blocks of 16 tokens (4,096 tokens); the index counts on 90% of it.
        let s = scheduler();
        let mut p = pool(4);
        for e in &mut p.endpoints {
            (e.block_size, e.kv_blocks, e.kv_written) = (16, 256, Some(0));
        }
        let mut st = s.new_state();
        let shared = "You are a helpful assistant. ".repeat(100);
        let first = run(&s, &p, &mut st, &format!("{shared} question 0"), 1);
        let holder = p.position(&first.endpoints[0]).unwrap();
        let again = run(&s, &p, &mut st, &format!("{shared} question 1"), 2);
        assert_eq!(again.endpoints[0], first.endpoints[0], "held: the prefix pulls");
        assert!(again.scores[0].matched_blocks > 0);
        // The holder's engine writes 3,600 tokens of other prompts: within 90% of its cache
        // (3,686 tokens), so the prefix is still held, and using it stamps it anew.
        p.endpoints[holder].kv_written = Some(3_600);
        let warm = run(&s, &p, &mut st, &format!("{shared} question 2"), 3);
        assert_eq!(warm.endpoints[0], first.endpoints[0], "still held after 3,600 tokens of writes");
        // A cache's worth of writes after that last use: evicted, and the request is cold.
        p.endpoints[holder].kv_written = Some(3_600 + 3_686);
        let cold = Case::text(&s, "m", &format!("{shared} question 3")).seed(4).schedule(&s, &p, &st).unwrap();
        assert!(cold.cold, "no endpoint is believed to hold the prefix");
        assert!(cold.all.iter().all(|c| c.matched_blocks == 0), "{:?}", cold.all);
    }

    #[test]
    fn shared_prefix_sticks_and_unrelated_spread() {
        let s = scheduler();
        let p = pool(4);
        let mut st = s.new_state();
        let shared = "You are a helpful assistant. ".repeat(100);
        let first = run(&s, &p, &mut st, &format!("{shared} question 0"), 1);
        for q in 1..10 {
            let d = run(&s, &p, &mut st, &format!("{shared} question {q}"), q);
            assert_eq!(d.endpoints[0], first.endpoints[0]);
            assert!(d.scores[0].score(prefix::NAME) > 0.9);
        }
        let mut seen = std::collections::HashSet::new();
        for g in 0..40 {
            seen.insert(
                run(&s, &p, &mut st, &format!("{g} unrelated group {g} ").repeat(50), 1000 + g).endpoints[0].clone(),
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
            let mut st = s.new_state();
            let first = run(s, &p, &mut st, &format!("{preamble}{}", own(0)), 1);
            let d = (1..4).map(|k| run(s, &p, &mut st, &format!("{preamble}{}", own(k)), k as u64)).collect::<Vec<_>>();
            (first, d)
        };
        let (first, later) = sessions(&scheduler());
        let p4 = pool(4);
        let held = later[0]
            .all
            .iter()
            .find(|e| p4.endpoints[e.position].address == first.endpoints[0])
            .map(|e| e.score(prefix::NAME))
            .unwrap_or(0.0);
        assert!(held > 0.5 && held < 0.8, "the preamble is a partial match: {held}");
        let mut used: std::collections::HashSet<_> = later.iter().map(|d| d.endpoints[0].clone()).collect();
        used.insert(first.endpoints[0].clone());
        assert_eq!(used.len(), 4, "below the threshold, new sessions spread over the pool");
        assert!(later.iter().all(|d| d.cold), "spread like cold requests");
        // The same sessions with the gate off: the preamble's holder takes every one.
        let mut off = scheduler();
        off.config.prefix.affinity_threshold = 0.0;
        let (first, later) = sessions(&off);
        assert!(later.iter().all(|d| d.endpoints[0] == first.endpoints[0]), "affinity to a 59% match");
        // A long match (a turn's own history, 90%+) still sticks with the gate on.
        let s = scheduler();
        let p = pool(4);
        let mut st = s.new_state();
        let history = format!("{preamble}{}", own(9));
        let a = run(&s, &p, &mut st, &history, 1);
        let b = run(&s, &p, &mut st, &format!("{history} and one more question"), 2);
        assert_eq!(b.endpoints[0], a.endpoints[0]);
        assert!(b.scores[0].score(prefix::NAME) >= 0.8 && !b.cold);
    }

    #[test]
    fn a_running_adapter_outranks_a_free_slot_that_cold_spreading_favours() {
        // The CI failure this guards: engine 1 runs `tweet` and has some KV in use, engine 2 has
        // a free slot and has never received a cold request. With no-hit-lru spreading the
        // adapter request as a cold prefix, engine 2 won by the LRU point.
        let s = scheduler();
        let mut p = pool(3);
        let lora = |running: &[&str]| {
            Some(LoraState { running: running.iter().map(|a| a.to_string()).collect(), waiting: vec![], max_lora: 1 })
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
        let mut st = s.new_state();
        // Engine 1 received the last cold request, so it ranks last in the no-hit LRU.
        st.no_hit_lru.record(&p.endpoints[0].address);
        st.no_hit_lru.record(&p.endpoints[1].address);
        for k in 0..4 {
            let d = Case::text(&s, "tweet", &format!("tweet {k}")).tokens(2).seed(k).route(&s, &p, &mut st);
            assert_eq!(d.endpoints[0], p.endpoints[1].address, "tweet goes where tweet runs: {:?}", d.scores);
        }
        // A base-model cold request still spreads: it goes to the least recently used engine.
        let d = run(&s, &p, &mut st, "hello", 9);
        assert_eq!(d.endpoints[0], p.endpoints[2].address);
    }

    #[test]
    fn a_silent_host_leaves_only_the_schedulers_own_load() {
        let s = scheduler();
        let mut p = pool(3);
        let mut st = s.new_state();
        let prompt = "the same long system prompt ".repeat(40);
        let home = run(&s, &p, &mut st, &prompt, 1).endpoints[0].clone();
        // The host's (possibly stale) metrics call the home endpoint idle and the others busy.
        for e in &mut p.endpoints {
            let waiting = if e.address == home { 0.0 } else { 4.0 };
            e.metrics = Some(EndpointMetrics { waiting, ..Default::default() });
        }
        // This scheduler itself has two requests in flight to home, none elsewhere.
        let case = Case::text(&s, "m", &prompt).tokens(300).inflight(&home, 2);
        let fresh = case.schedule(&s, &p, &st).unwrap();
        assert_eq!(fresh.endpoints[0], home, "prefix and host metrics favour home");
        let stale = case.load_only(true).schedule(&s, &p, &st).unwrap();
        assert_ne!(stale.endpoints[0], home, "load-only: home has this scheduler's in-flight requests");
        for sc in &stale.scores {
            let expected = if sc.address == home { 0.0 } else { 1.0 };
            assert_eq!((sc.score(queue::NAME), sc.total), (expected, 2.0 * expected), "{sc:?}");
        }
    }

    #[test]
    fn saturated_endpoint_is_avoided_even_with_prefix() {
        let s = scheduler();
        let mut p = pool(3);
        let mut st = s.new_state();
        let prompt = "shared ".repeat(300);
        let first = run(&s, &p, &mut st, &prompt, 3);
        let hot = p.endpoints.iter_mut().find(|e| e.address == first.endpoints[0]).unwrap();
        hot.metrics = Some(EndpointMetrics { waiting: 20.0, running: 8.0, kv_usage: 0.5, ..Default::default() });
        for seed in 0..10 {
            let d = run(&s, &p, &mut st, &prompt, seed);
            assert_ne!(d.endpoints[0], first.endpoints[0]);
        }
    }

    #[test]
    fn cold_prefixes_spread_evenly_on_an_idle_pool() {
        let s = scheduler();
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
        let s = scheduler();
        let p = pool(4);
        let target = p.endpoints[2].address.clone();
        let case = Case::text(&s, "m", &"a long shared system prompt ".repeat(40)).tokens(0);
        let n = case.hashes.len();
        let case = case.learned(&target, n);
        let fresh = s.new_state();
        for seed in 0..8 {
            let d = case.clone().seed(seed).schedule(&s, &p, &fresh).unwrap();
            assert_eq!(d.endpoints[0], target);
            assert!(!d.cold);
        }
    }

    #[test]
    fn precise_matches_route_to_the_holder_even_with_no_routing_history() {
        let s = scheduler();
        let mut p = pool(4);
        for (i, e) in p.endpoints.iter_mut().enumerate() {
            e.id = i as u32 + 10;
        }
        let d = Case::new().hashes(&[1, 2, 3]).tokens(0).seed(5).precise(12, 0.9, 30).schedule(&s, &p, &s.new_state());
        let d = d.unwrap();
        assert_eq!(d.endpoints[0], p.endpoints[2].address);
        assert!(!d.cold);
        assert!((d.scores[0].score(precise::NAME) - 0.9).abs() < 1e-9);
    }

    #[test]
    fn approximate_and_precise_affinity_count_once_against_load() {
        // Endpoint 0 holds the prompt by both measures but has a queue; endpoint 1 holds
        // nothing and is idle. Affinity (3) must not count twice (6) against load (2 + 2).
        // (Scores alone: the affinity filter, which would keep the holder, is off.)
        let mut s = scheduler();
        s.config.prefix.affinity_filter.enabled = false;
        let mut p = pool(2);
        for (i, e) in p.endpoints.iter_mut().enumerate() {
            e.id = i as u32;
        }
        p.endpoints[0].metrics = Some(EndpointMetrics { waiting: 4.0, kv_usage: 0.6, ..Default::default() });
        let holder = p.endpoints[0].address.clone();
        let case = Case::new().hashes(&[7, 8, 9]).tokens(48).seed(1).learned(&holder, 3).precise(0, 1.0, 3);
        let d = case.schedule(&s, &p, &s.new_state()).unwrap();
        let held = d.scores.iter().find(|x| x.address == holder).unwrap();
        assert!((held.score(prefix::NAME) - 1.0).abs() < 1e-9 && (held.score(precise::NAME) - 1.0).abs() < 1e-9);
        // 3 (affinity, once) + 0 (worst queue) + 2 * 0.4 (KV) + LRU; the idle one: 2 + 2 + LRU.
        let lru = held.score(crate::scorers::no_hit_lru::NAME);
        assert!((held.total - (3.8 + lru)).abs() < 1e-9, "{}", held.total);
        assert!((held.score(kv::NAME) - 0.4).abs() < 1e-9);
        assert_eq!(d.endpoints[0], p.endpoints[1].address, "the idle endpoint wins");
    }

    #[test]
    fn a_match_learned_from_another_worker_is_gated_by_what_it_may_hold() {
        // A 200-block token prompt whose first 161 blocks (80.5%) another worker sent to
        // endpoint 0: the affinity table proves 144 (0.72, under the 0.8 gate) and bounds it
        // at 161. The gate must judge the bound, as it does for this worker's own index.
        let s = scheduler();
        let p = pool(3);
        let hashes: Vec<u64> = (1..=200).collect();
        let holder = p.endpoints[0].address.clone();
        let d = Case::new().hashes(&hashes).learned(&holder, 144).schedule(&s, &p, &s.new_state()).unwrap();
        assert!(!d.cold, "the holder passes the gate");
        assert_eq!(d.endpoints[0], holder);
        let proven = d.scores[0].score(prefix::NAME);
        assert!((proven - 0.72).abs() < 1e-9, "the score counts proven blocks: {proven}");
        // Proven 128 (bounded at 143, 0.715): under the gate, spread cold.
        let d = Case::new().hashes(&hashes).learned(&holder, 128).schedule(&s, &p, &s.new_state()).unwrap();
        assert!(d.cold);
    }

    #[test]
    fn the_affinity_filter_keeps_a_warm_request_on_its_cache_until_the_ttft_gate() {
        // Endpoint 0 holds 90% of a 6,400-token prompt but is the busiest (its queue and KV
        // below saturation); endpoints 1 and 2 are idle and hold nothing.
        let mut s = scheduler();
        let mut p = precise_pool(3);
        p.endpoints[0].metrics = Some(EndpointMetrics { waiting: 4.0, kv_usage: 0.9, ..Default::default() });
        let holder = p.endpoints[0].address.clone();
        let st = s.new_state();
        let case = |queued: u64| {
            Case::new()
                .hashes(&[1, 2, 3])
                .tokens(6_400)
                .seed(2)
                .precise(0, 0.9, 360)
                .inflight(&holder, 6)
                .queued_tokens(&holder, queued)
        };
        let d = case(1_000).schedule(&s, &p, &st).unwrap();
        assert_eq!(d.endpoints[0], holder, "the affine endpoint leads: {:?}", d.scores);
        assert!(d.scores[0].affine && !d.scores[1].affine);
        assert_eq!(d.tiers, vec![tier::AFFINE, tier::NONE, tier::NONE], "the picker keeps it");
        assert_eq!(d.endpoints.len(), 3, "the others stay as fallbacks");
        assert!(d.scores[1].total > d.scores[0].total, "by score alone the idle endpoint would win");
        // Scores alone (filter off) pick an idle endpoint.
        s.config.prefix.affinity_filter.enabled = false;
        let d = case(1_000).schedule(&s, &p, &st).unwrap();
        assert_ne!(d.endpoints[0], holder);
        assert!(d.tiers.iter().all(|&t| t == tier::NONE), "no filter, no tier: {:?}", d.tiers);
        s.config.prefix.affinity_filter.enabled = true;
        // The TTFT gate, with hot prefixes never spreading: 300,000 queued uncached tokens at
        // 15,928 tokens/s is 18.8 s behind an idle endpoint's 6,400 / 15,928 = 0.4 s, more than
        // the 18 s penalty.
        s.config.prefix.affinity_filter.hot_prefix_ttft_ms = 0.0;
        assert_ne!(case(300_000).schedule(&s, &p, &st).unwrap().endpoints[0], holder, "the gate yields to load");
        let d = case(280_000).schedule(&s, &p, &st).unwrap();
        assert_eq!(d.endpoints[0], holder, "17.6 s + 0.04 s behind 0.4 s is within 18 s");
        assert!(!d.spread);
    }

    #[test]
    fn a_hot_prefix_spreads_to_an_idle_endpoint_before_its_holder_queues() {
        // As above: endpoint 0 holds 90% of a 6,400-token prompt; 1 and 2 are idle and would
        // compute all of it in 402 ms.
        let s = scheduler();
        let p = precise_pool(3);
        let holder = p.endpoints[0].address.clone();
        let st = s.new_state();
        let case = |queued: u64| {
            Case::new().hashes(&[1, 2, 3]).tokens(6_400).seed(2).precise(0, 0.9, 360).queued_tokens(&holder, queued)
        };
        // 1,000 queued + 640 new: 103 ms, under the 250 ms target. The holder keeps it.
        let d = case(1_000).schedule(&s, &p, &st).unwrap();
        assert!(d.endpoints[0] == holder && !d.spread);
        // 4,000 queued: 291 ms, hot, but the others would take 402 ms. Still the holder.
        let d = case(4_000).schedule(&s, &p, &st).unwrap();
        assert!(d.endpoints[0] == holder && !d.spread);
        // 6,000 queued: 417 ms. An idle endpoint answers sooner computing it all: it leads, and
        // the holder follows as a fallback.
        let d = case(6_000).schedule(&s, &p, &st).unwrap();
        assert!(d.endpoints[0] != holder && d.spread, "{:?}", d.endpoints);
        assert!(d.endpoints.contains(&holder));
        assert_eq!(d.tiers.iter().filter(|&&t| t == tier::AFFINE).count(), 1, "only the replica leads");
        // A session bound to the holder stays within its 1 s of hysteresis, and nothing spreads.
        let d = case(6_000).sticky(&holder).schedule(&s, &p, &st).unwrap();
        assert!(d.endpoints[0] == holder && d.sticky && !d.spread);
    }

    #[test]
    fn errors_and_fallbacks() {
        let s = scheduler();
        let st = s.new_state();
        let case = Case::new();
        assert_eq!(case.schedule(&s, &PoolState::default(), &st), Err(ScheduleError::NoEndpoints));
        let bad = Case::new().model("zzz");
        assert_eq!(bad.schedule(&s, &pool(2), &st), Err(ScheduleError::UnknownModel("zzz".into())));
        let mut p = pool(2);
        p.endpoints.iter_mut().for_each(|e| e.ready = false);
        assert_eq!(case.schedule(&s, &p, &st), Err(ScheduleError::NoEndpoints));
        let d = case.schedule(&s, &pool(5), &st).unwrap();
        assert_eq!(d.endpoints.len(), 3);
        assert_eq!(d.header_value().split(',').count(), 3);
    }

    #[test]
    fn long_uncached_prompts_get_a_prefill_endpoint_and_short_or_cached_ones_do_not() {
        let s = scheduler();
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
        let off = Scheduler::new(SchedulerConfig { pd: pd::PdConfig { threshold_tokens: 0 }, ..Default::default() });
        let off = off.unwrap();
        assert!(run(&off, &p, &mut off.new_state(), &long, 1).prefill.is_none());
        assert!(run(&s, &pool(4), &mut s.new_state(), &long, 1).prefill.is_none());
    }

    #[test]
    fn a_large_pool_finds_its_prefill_endpoints_from_the_index() {
        // Past `preselect.above`, the prefill profile starts from the index's prefill-role
        // endpoints, not the whole pool; a role changed in place by a delta is followed.
        let s = scheduler();
        let mut p = pool(1_000);
        for i in [17, 640] {
            p.endpoints[i].role = Role::Prefill;
        }
        let long = "abcd".repeat(64 * 64);
        let mut st = s.new_state();
        let d = run(&s, &p, &mut st, &long, 1);
        let pre = d.prefill.expect("split on a large pool");
        assert!([17, 640].map(|i| p.endpoints[i].address.clone()).contains(&pre.address), "{}", pre.address);
        p.endpoints[17].role = Role::Both;
        p.endpoints[640].role = Role::Both;
        p.endpoints[333].role = Role::Prefill;
        p.index_updated(&[17, 333, 640]);
        let d = run(&s, &p, &mut s.new_state(), &long, 2);
        assert_eq!(d.prefill.map(|x| x.address), Some(p.endpoints[333].address.clone()));
        p.endpoints[333].role = Role::Both;
        p.index_updated(&[333]);
        assert!(run(&s, &p, &mut s.new_state(), &long, 3).prefill.is_none(), "no prefill endpoint left");
    }

    #[test]
    fn a_sticky_endpoint_leads_while_it_is_healthy_and_not_saturated() {
        let s = scheduler();
        let mut p = pool(4);
        let st = s.new_state();
        let target = p.endpoints[3].address.clone();
        let case = |to: &str| Case::new().tokens(10).seed(9).sticky(to);
        for _ in 0..5 {
            let d = case(&target).schedule(&s, &p, &st).unwrap();
            assert_eq!(d.endpoints[0], target);
            assert!(d.sticky && d.endpoints.len() == 3 && !d.endpoints[1..].contains(&target));
        }
        // Saturated or gone: routed elsewhere, not sticky.
        p.endpoints[3].metrics = Some(EndpointMetrics { waiting: 50.0, ..Default::default() });
        let d = case(&target).schedule(&s, &p, &st).unwrap();
        assert!(d.endpoints[0] != target && !d.sticky);
        p.endpoints[3].ready = false;
        assert_ne!(case(&target).schedule(&s, &p, &st).unwrap().endpoints[0], target);
        assert!(!case("10.9.9.9:1").schedule(&s, &p, &st).unwrap().sticky, "unknown endpoint");
    }

    #[test]
    fn a_session_moves_once_its_cached_share_no_longer_pays_for_its_queue() {
        let s = scheduler();
        let mut p = pool(4);
        let st = s.new_state();
        let target = p.endpoints[3].address.clone();
        // A 20-block prompt (1,280 tokens); the bound endpoint holds 10 blocks (640 tokens),
        // under the affinity threshold, so only the session's binding can keep it there.
        let hashes: Vec<u64> = (1..=20).collect();
        let case = |queued: u64| {
            Case::new().hashes(&hashes).seed(9).sticky(&target).learned(&target, 10).queued_tokens(&target, queued)
        };
        // 500 queued + 640 new there, against 1,280 new elsewhere: holding pays.
        let d = case(500).schedule(&s, &p, &st).unwrap();
        assert!(d.sticky && d.endpoints[0] == target);
        // 700 queued: 1,340 there, 1,280 elsewhere, 4 ms worse: within the default 1 s of
        // hysteresis, so the session stays; with none, it moves.
        assert!(case(700).schedule(&s, &p, &st).unwrap().sticky);
        let mut eager = SchedulerConfig::default();
        eager.prefix.affinity_filter.max_session_penalty_ms = 0.0;
        let s_eager = Scheduler::new(eager).unwrap();
        let d = case(700).schedule(&s_eager, &p, &s_eager.new_state()).unwrap();
        assert!(!d.sticky && d.endpoints[0] != target, "{:?}", d.endpoints);
        // 17,000 queued: 17,640 there against 1,280, 1.03 s worse. The session moves.
        let d = case(17_000).schedule(&s, &p, &st).unwrap();
        assert!(!d.sticky && d.endpoints[0] != target, "{:?}", d.endpoints);
        // The engine's learned rate is four times the configured one: its queue clears sooner.
        p.endpoints[3].metrics = Some(EndpointMetrics { prefill_tokens_per_s: 4.0 * 15_928.0, ..Default::default() });
        assert!(case(17_000).schedule(&s, &p, &st).unwrap().sticky);
        // Nothing queued from here, but the engine reports two requests waiting for KV and
        // first tokens taking 3 s: the session moves, and stays while nothing waits there.
        p.endpoints[3].metrics = Some(EndpointMetrics { waiting: 2.0, ttft_ms: 3_000.0, ..Default::default() });
        assert!(!case(0).schedule(&s, &p, &st).unwrap().sticky);
        p.endpoints[3].metrics = Some(EndpointMetrics { waiting: 0.0, ttft_ms: 3_000.0, ..Default::default() });
        assert!(case(0).schedule(&s, &p, &st).unwrap().sticky);
        // A silent host (load-only) or the gate turned off: the binding holds, as before.
        p.endpoints[3].metrics = None;
        assert!(case(17_000).load_only(true).schedule(&s, &p, &st).unwrap().sticky);
        let mut off = SchedulerConfig::default();
        off.prefix.affinity_filter.enabled = false;
        let s_off = Scheduler::new(off).unwrap();
        assert!(case(17_000).schedule(&s_off, &p, &s_off.new_state()).unwrap().sticky);
    }
}
