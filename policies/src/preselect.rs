//! Pre-selection on large pools: score a shortlist rather than every endpoint.
//!
//! Filtering and scoring visit each candidate and allocate a row for it, so a request's cost
//! grows with the pool. Past `above` endpoints the scheduler filters and scores only:
//! - every endpoint that holds something the request needs: a prefix match (this worker's
//!   index, the other workers' and replicas' affinity, or the precise KV index), the session's
//!   sticky endpoint, or the request's LoRA adapter loaded;
//! - and the `least_loaded` others with the least load (reported waiting + running, plus this
//!   worker's own requests in flight), drawn from the `2 × least_loaded` least loaded by the
//!   last snapshot plus `least_loaded` sampled at random (power-of-k), so equal loads spread.
//!
//! Those are the only endpoints any scorer could rank first that the shortlist can drop: one
//! holding nothing the request needs wins on load alone, and the least loaded are kept. The
//! lookups it needs ([`PoolIndex`]: address and id to position, each model's ready endpoints
//! by load, each adapter's holders) are built once per pool version, so a request costs
//! O(holders + least_loaded), not O(pool). Pools at or below `above` are scored whole, exactly
//! as before, and so is any request the shortlist cannot serve (an unknown model, or a
//! shortlist the filters empty, or a request restricted to a subset of the pool).

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

use crate::endpoint::PoolState;
use crate::profiles::{Profile, SchedulingInput};
use crate::scratch::Buf;

/// `scheduler.preselect`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PreselectConfig {
    /// Shortlist when the pool has more endpoints than this; 0 never shortlists.
    pub above: usize,
    /// Endpoints kept for their load alone, besides those that hold something the request
    /// needs.
    pub least_loaded: usize,
}

impl Default for PreselectConfig {
    fn default() -> Self {
        Self { above: 128, least_loaded: 32 }
    }
}

/// splitmix64: spreads `seed ^ i` for tie-breaks and samples.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The shortlist for `input` on a pool larger than `cfg.above`, in pool order; `None` when the
/// pool is small enough to score whole, or the model has no ready endpoint (the full path
/// then explains why).
pub fn shortlist(
    cfg: &PreselectConfig,
    pool: &PoolState,
    input: &SchedulingInput<'_>,
    matches: &HashMap<&str, usize>,
) -> Option<Vec<usize>> {
    // A subset (the gateway's endpoint hint) restricts the pool first: score it whole.
    if cfg.above == 0 || pool.endpoints.len() <= cfg.above || input.subset.is_some() {
        return None;
    }
    let eps = &pool.endpoints;
    let ix = pool.index();
    let by_load = ix.by_load.get(input.model).filter(|l| !l.is_empty())?;
    let k = cfg.least_loaded;
    let mut keep: Vec<usize> = Vec::with_capacity(matches.len() + 2 * k + 8);
    let at = |a: &str| ix.position(eps, a);
    keep.extend(matches.keys().filter_map(|a| at(a)));
    if let Some(extra) = input.extra_matches {
        keep.extend(extra.keys().filter_map(|a| at(a)));
    }
    if let Some(p) = input.precise {
        keep.extend(
            p.iter().filter(|(_, (_, blocks))| *blocks > 0).filter_map(|(id, _)| ix.by_id.get(id)).map(|&p| p as usize),
        );
    }
    if let Some(s) = input.sticky {
        keep.extend(at(s));
    }
    if let Some(holders) = ix.lora.get(input.model) {
        keep.extend(holders.iter().map(|&p| p as usize));
    }
    if k > 0 {
        // This worker's own requests in flight, by position: looked up once per endpoint in
        // flight (often none, rarely many), not once per endpoint drawn.
        let mut own = Buf::<(usize, f64)>::take();
        own.extend(input.inflight.iter().filter_map(|(a, &n)| Some((at(a)?, f64::from(n)))));
        own.sort_unstable_by_key(|x| x.0);
        let own_at = |p: usize| own.binary_search_by_key(&p, |x| x.0).map_or(0.0, |i| own.get(i).map_or(0.0, |x| x.1));
        // The `2k` least loaded by the snapshot, and `k` drawn from the rest of the model's
        // list (power-of-k): a draw among the first `2k`, or one drawn before, is skipped, so
        // every position appears once.
        let n = by_load.len();
        let head = by_load.len().min(2 * k);
        let mut drawn = Buf::<usize>::take();
        for j in 0..k as u64 {
            let i = (mix(input.seed ^ j.wrapping_mul(0x9E37)) % n as u64) as usize;
            if i >= head && !drawn.contains(&i) {
                drawn.push(i);
            }
        }
        let mut pick = Buf::<(f64, u64, usize)>::take();
        pick.extend(by_load.iter().take(head).chain(drawn.iter().filter_map(|&i| by_load.get(i))).map(|r| {
            let p = r.position as usize;
            (r.load + own_at(p), mix(input.seed ^ p as u64), p)
        }));
        // The `k` least loaded, ties broken by the seed: a selection, not a sort (the shortlist
        // is put in pool order below).
        let by_key = |a: &(f64, u64, usize), b: &(f64, u64, usize)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1));
        if pick.len() > k {
            pick.select_nth_unstable_by(k - 1, by_key);
            pick.truncate(k);
        }
        keep.extend(pick.iter().map(|x| x.2));
    }
    keep.sort_unstable();
    keep.dedup();
    Some(keep)
}

/// The starting candidates of the P/D prefill profile on a pool larger than `cfg.above`: the
/// endpoints of the prefill role (the index keeps them), rather than every endpoint for its
/// `prefill-filter` to drop. `None`: the pool is small, or `profile` has no `prefill-filter`
/// (a configured profile that picks among other roles sees the whole pool).
pub fn prefill_candidates(cfg: &PreselectConfig, pool: &PoolState, profile: &Profile) -> Option<Vec<usize>> {
    let large = cfg.above > 0 && pool.endpoints.len() > cfg.above;
    (large && by_role(profile)).then(|| pool.index().prefill.iter().map(|&p| p as usize).collect())
}

/// The P/D prefill `profile` can find no prefiller in `pool`: it keeps the prefill role alone
/// and the pool has no endpoint of that role (most pools). The scheduler then skips the
/// prefill run, which would filter every endpoint to find none.
pub fn no_prefiller(pool: &PoolState, profile: &Profile) -> bool {
    by_role(profile) && pool.index().prefill.is_empty()
}

/// `profile` has the `prefill-filter`: its candidates are the prefill role's endpoints.
fn by_role(profile: &Profile) -> bool {
    profile.filters.iter().any(|f| f.name() == crate::filters::prefill::NAME)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::{Endpoint, EndpointMetrics, LoraState};

    fn pool(n: usize) -> PoolState {
        let endpoints = (0..n)
            .map(|i| Endpoint {
                id: i as u32,
                address: format!("10.0.{}.{}:8000", i / 256, i % 256),
                models: vec!["m".into()],
                ready: true,
                metrics: Some(EndpointMetrics { waiting: 0.0, running: 10.0 + (i % 7) as f64, ..Default::default() }),
                ..Default::default()
            })
            .collect();
        PoolState { endpoints, ..Default::default() }
    }

    fn input<'a>(inflight: &'a HashMap<String, u32>) -> SchedulingInput<'a> {
        SchedulingInput {
            sheddable: false,
            now_ms: 0,
            model: "m",
            block_hashes: &[],
            anchors: &[],
            inflight,
            inflight_tokens: None,
            seed: 1,
            extra_matches: None,
            precise: None,
            prompt_tokens: 100,
            sticky: None,
            load_only: false,
            subset: None,
            session_key: None,
        }
    }

    #[test]
    fn a_small_pool_is_scored_whole() {
        let p = pool(128);
        let inflight = HashMap::new();
        assert_eq!(shortlist(&PreselectConfig::default(), &p, &input(&inflight), &HashMap::new()), None);
    }

    #[test]
    fn a_large_pool_keeps_every_holder_and_the_least_loaded() {
        let mut p = pool(1_000);
        // The idlest engines by what they report; this worker's own requests make 3 busy.
        for i in [3, 500, 999] {
            p.endpoints[i].metrics = Some(EndpointMetrics::default());
        }
        let mut inflight = HashMap::new();
        inflight.insert(p.endpoints[3].address.clone(), 50);
        p.endpoints[700].lora = Some(LoraState { running: vec!["m".into()], ..Default::default() });
        let matches: HashMap<&str, usize> = [(p.endpoints[10].address.as_str(), 4)].into_iter().collect();
        let extra: HashMap<&str, usize> = [(p.endpoints[11].address.as_str(), 2)].into_iter().collect();
        let precise: HashMap<u32, (f64, usize)> = [(12, (0.5, 3)), (13, (0.0, 0))].into_iter().collect();
        let mut inp = input(&inflight);
        inp.extra_matches = Some(&extra);
        inp.precise = Some(&precise);
        let sticky = p.endpoints[14].address.clone();
        inp.sticky = Some(&sticky);
        let cfg = PreselectConfig { above: 128, least_loaded: 2 };
        let c = shortlist(&cfg, &p, &inp, &matches);
        assert_eq!(c, Some(vec![10, 11, 12, 14, 500, 700, 999]), "holders, then the two least loaded, in pool order");
    }

    #[test]
    fn equal_loads_spread_over_the_pool() {
        let mut p = pool(10_000);
        for e in &mut p.endpoints {
            e.metrics = Some(EndpointMetrics::default());
        }
        let inflight = HashMap::new();
        let cfg = PreselectConfig { above: 128, least_loaded: 4 };
        let mut seen = hashbrown::HashSet::new();
        for seed in 0..200 {
            let mut inp = input(&inflight);
            inp.seed = seed;
            let c = shortlist(&cfg, &p, &inp, &HashMap::new()).unwrap_or_default();
            assert_eq!(c.len(), 4);
            seen.extend(c);
        }
        // Two hundred requests on an idle pool reach far more than the 8 lowest positions.
        assert!(seen.len() > 100, "{} distinct endpoints", seen.len());
    }

    #[test]
    fn an_unknown_model_or_unready_pool_is_left_to_the_full_path() {
        let mut p = pool(500);
        let inflight = HashMap::new();
        let mut inp = input(&inflight);
        inp.model = "other";
        assert_eq!(shortlist(&PreselectConfig::default(), &p, &inp, &HashMap::new()), None);
        p.endpoints.iter_mut().for_each(|e| e.ready = false);
        p.reindex();
        assert_eq!(shortlist(&PreselectConfig::default(), &p, &input(&inflight), &HashMap::new()), None);
    }

    #[test]
    fn a_shortlist_never_panics_on_odd_input() {
        let p = pool(200);
        let inflight = HashMap::new();
        let matches: HashMap<&str, usize> = [("nowhere:1", 3)].into_iter().collect();
        for least in [0, 1, 199, 200, 10_000] {
            let cfg = PreselectConfig { above: 10, least_loaded: least };
            let c = shortlist(&cfg, &p, &input(&inflight), &matches).unwrap_or_default();
            assert_eq!(c.len(), least.min(200));
            assert!(c.windows(2).all(|w| w[0] < w[1]));
        }
    }

    #[test]
    fn the_prefill_run_is_skipped_only_where_no_endpoint_could_prefill() {
        use crate::endpoint::Role;
        use crate::profiles::{ProfileConfig, ProfilesConfig};
        let defaults = ProfilesConfig::default();
        let by_role = Profile::resolve("prefill", &defaults.prefill).expect("the default prefill profile");
        let any = Profile::resolve("prefill", &ProfileConfig { plugins: defaults.decode.plugins.clone() })
            .expect("a prefill profile without the prefill filter");
        let mut p = pool(8);
        assert!(no_prefiller(&p, &by_role), "no endpoint of the prefill role");
        assert!(!no_prefiller(&p, &any), "a profile that picks among every role may find one");
        p.endpoints[3].role = Role::Prefill;
        p.reindex();
        assert!(!no_prefiller(&p, &by_role));
    }
}
