//! One profile run over a pool: what each candidate is proven to hold, its scores by plugin
//! name, and its weighted total.

use hashbrown::HashMap;

use super::Profile;
use crate::endpoint::Endpoint;
use crate::filters::saturation::SaturationConfig;
use crate::index;
use crate::scorers::no_hit_lru::LastCold;
use crate::scorers::session_load::ActiveSessions;
use crate::scorers::ScoreContext;
use crate::scratch::Buf;

/// What scheduling needs to know about one request.
#[derive(Clone, Copy)]
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
    pub extra_matches: Option<&'a HashMap<&'a str, usize>>,
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
    /// The gateway's subset hint: only these endpoints may be chosen (`None`: the whole pool).
    pub subset: Option<&'a crate::filters::subset::Subset>,
    /// The request's session key (`None`: no session header).
    pub session_key: Option<u64>,
    /// The request is of a sheddable band ([`crate::spare`]).
    pub sheddable: bool,
    /// The caller's clock, in milliseconds.
    pub now_ms: u64,
}

/// One scored candidate, by its position in the pool: what the picker orders. The candidates
/// the decision keeps are named ([`ScoredEndpoint`]); the others never copy their address.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// Position in the pool's endpoints.
    pub position: usize,
    /// Each scorer's score (0..1), keyed by plugin type, in profile order; a scorer that had
    /// nothing to go on (the precise scorer without token ids) is left out.
    pub scores: ScoreList,
    /// The weighted total.
    pub total: f64,
    /// The best prefix-affinity score (approximate or precise): what custom scorers see.
    pub prefix_hit: f64,
    pub matched_blocks: usize,
    /// Prompt tokens this endpoint is expected to hold (approximate or precise, the larger).
    pub cached_tokens: usize,
    /// It holds at least `prefix.affinity_threshold` of the prompt.
    pub affine: bool,
}

impl Scored {
    /// The score of the scorer named `name` (0 when the profile has none).
    pub fn score(&self, name: &str) -> f64 {
        self.scores.iter().find(|(n, _)| *n == name).map_or(0.0, |(_, v)| *v)
    }

    /// This candidate with its address, from the pool it was scored on.
    pub fn named(&self, endpoints: &[Endpoint]) -> ScoredEndpoint {
        let e = endpoints.get(self.position);
        let address = e.map(|e| e.address.clone()).unwrap_or_default();
        let (kv_written, kv_hits) = (e.and_then(|e| e.kv_written), e.and_then(|e| e.kv_hits));
        ScoredEndpoint { address, kv_written, kv_hits, scored: self.clone() }
    }
}

/// A candidate the decision keeps (the primary, the fallbacks, the prefiller), with its
/// address: for the headers, the decision log and metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredEndpoint {
    pub address: String,
    /// Its engine's KV write clock when the decision was made ([`Endpoint::kv_written`]): what
    /// the approximate index stamps the request's blocks with.
    pub kv_written: Option<u64>,
    /// Its engine's prefix-cache hits then ([`Endpoint::kv_hits`]).
    pub kv_hits: Option<u64>,
    pub scored: Scored,
}

impl std::ops::Deref for ScoredEndpoint {
    type Target = Scored;

    fn deref(&self) -> &Scored {
        &self.scored
    }
}

/// Most scorers a profile can list: each registered scorer at most once.
pub const MAX_SCORERS: usize = 8;

/// A candidate's scores by plugin type, held inline: a decision scores every candidate, and a
/// list of its own per candidate would be an allocation each.
#[derive(Clone, Copy, PartialEq)]
pub struct ScoreList {
    len: u8,
    items: [(&'static str, f64); MAX_SCORERS],
}

impl Default for ScoreList {
    fn default() -> Self {
        Self { len: 0, items: [("", 0.0); MAX_SCORERS] }
    }
}

impl std::ops::Deref for ScoreList {
    type Target = [(&'static str, f64)];

    fn deref(&self) -> &Self::Target {
        self.items.get(..usize::from(self.len)).unwrap_or_default()
    }
}

impl std::fmt::Debug for ScoreList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl FromIterator<(&'static str, f64)> for ScoreList {
    /// The first [`MAX_SCORERS`] scores (a profile resolves with no more).
    fn from_iter<I: IntoIterator<Item = (&'static str, f64)>>(iter: I) -> Self {
        let mut list = Self::default();
        for (slot, score) in list.items.iter_mut().zip(iter) {
            *slot = score;
            list.len += 1;
        }
        list
    }
}

/// A profile applied to one request over one pool.
pub struct ProfileRun<'a> {
    pub profile: &'a Profile,
    pub endpoints: &'a [Endpoint],
    pub input: &'a SchedulingInput<'a>,
    /// Leading blocks each endpoint holds by this scheduler's approximate index.
    pub matches: &'a HashMap<&'a str, usize>,
    pub last_cold: &'a LastCold,
    pub sessions: &'a ActiveSessions,
    pub saturation: &'a SaturationConfig,
    /// `prefix.affinity_threshold`.
    pub affinity_threshold: f64,
    /// `prefix.block_size_tokens`.
    pub block_tokens: usize,
}

impl ProfileRun<'_> {
    /// Leading blocks `e` is proven to hold, by this worker's index and by what the other
    /// workers learned (the affinity table).
    fn proven(&self, e: &Endpoint) -> (usize, usize) {
        let local = self.matches.get(e.address.as_str()).copied().unwrap_or(0);
        (local, self.input.extra_matches.and_then(|m| m.get(e.address.as_str())).copied().unwrap_or(0))
    }

    /// The share of the prompt `e` may hold, by either index: for the gate, a match is known
    /// only to the last block either index records before the prompts diverge
    /// ([`index::match_upper_bound`], [`index::table_match_upper_bound`]); precise matches count
    /// blocks over the prompt's full blocks (the tier-weighted score where unknown).
    fn held(&self, e: &Endpoint, (local, extra): (usize, usize), (ps, pb): (f64, usize)) -> f64 {
        let (total, anchors, tokens) = (self.input.block_hashes.len(), self.input.anchors, self.input.prompt_tokens);
        let bound =
            index::match_upper_bound(total, anchors, local).max(index::table_match_upper_bound(total, anchors, extra));
        let approx = if total == 0 { 0.0 } else { bound as f64 / total as f64 };
        let keys = if e.block_size == 0 { 0 } else { tokens / e.block_size as usize };
        let exact = if keys == 0 { ps } else { pb as f64 / keys as f64 };
        approx.max(exact).min(1.0)
    }

    /// Score `candidates` (positions in the pool): every candidate, in pool order, and whether
    /// none of them holds enough of the prompt to count. The columns the scorers read are
    /// [`Buf`]s: only the returned list is allocated.
    pub fn score(&self, candidates: &[usize]) -> (Vec<Scored>, bool) {
        let input = self.input;
        // What each candidate holds and has in flight, in one pass, one column per kind (what
        // the scorers read).
        let (mut positions, mut matched) = (Buf::<usize>::take(), Buf::<usize>::take());
        let (mut precise, mut affine, mut inflight) =
            (Buf::<(f64, usize)>::take(), Buf::<bool>::take(), Buf::<u32>::take());
        for &i in candidates {
            let Some(e) = self.endpoints.get(i) else { continue };
            let proven = self.proven(e);
            let exact = input.precise.and_then(|p| p.get(&e.id)).copied().unwrap_or((0.0, 0));
            let held = self.held(e, proven, exact);
            positions.push(i);
            matched.push(proven.0.max(proven.1));
            precise.push(exact);
            affine.push(held > 0.0 && held >= self.affinity_threshold);
            inflight.push(input.inflight.get(e.address.as_str()).copied().unwrap_or(0));
        }
        let cold = !affine.iter().any(|&a| a);
        let ctx = ScoreContext {
            model: input.model,
            endpoints: self.endpoints,
            positions: &positions,
            inflight: &inflight,
            matched_blocks: &matched,
            total_blocks: input.block_hashes.len(),
            precise: input.precise.map(|_| precise.as_slice()),
            cold,
            load_only: input.load_only,
            saturation: self.saturation,
            last_cold: self.last_cold,
            sessions: self.sessions,
            session_key: input.session_key,
        };
        // One buffer, a column of `n` per scorer.
        let n = positions.len();
        let mut by_scorer = Buf::<f64>::take();
        by_scorer.resize(n * self.profile.scorers.len(), 0.0);
        for ((s, _), col) in self.profile.scorers.iter().zip(by_scorer.chunks_exact_mut(n.max(1))) {
            s.score(&ctx, col);
        }
        // A scorer with nothing to go on for this request counts 0 and is not listed.
        let mut listed = [(false, ""); MAX_SCORERS];
        for (slot, (s, _)) in listed.iter_mut().zip(&self.profile.scorers) {
            *slot = (s.active(&ctx), s.name());
        }
        let weighting = self.profile.weighting(input.load_only);
        let mut row = [0.0f64; MAX_SCORERS];
        let mut scored = Vec::with_capacity(n);
        scored.extend(ctx.candidates().zip(positions.iter()).enumerate().filter_map(|(i, (e, &position))| {
            for (slot, col) in row.iter_mut().zip(by_scorer.chunks_exact(n.max(1))) {
                *slot = *col.get(i)?;
            }
            let (&affine, &(_, precise_blocks), &matched_blocks) = (affine.get(i)?, precise.get(i)?, matched.get(i)?);
            let (total, prefix_hit) = weighting.total(&row, affine);
            let scores = listed.iter().zip(&row).filter(|((on, _), _)| *on).map(|((_, name), v)| (*name, *v)).collect();
            let cached_tokens = (matched_blocks * self.block_tokens).max(precise_blocks * e.block_size as usize);
            Some(Scored {
                position,
                scores,
                total,
                prefix_hit,
                matched_blocks,
                cached_tokens: cached_tokens.min(input.prompt_tokens),
                affine,
            })
        }));
        (scored, cold)
    }
}
