//! `session-load-scorer`: sessions are load even between their turns. An agent session bound to
//! an endpoint comes back within seconds with its whole context, longer each turn, but while it
//! waits on a tool or the user no queue or KV gauge counts it. So endpoints with few active
//! sessions look as free as idle ones, and new sessions pile onto them; under KV pressure their
//! contexts then evict each other. This scorer counts, per endpoint, the context tokens of the
//! sessions bound there and active within [`ACTIVE_MS`], and scores the endpoint by the share of
//! its KV cache they leave free: 1 where no active session waits, 0 where their contexts fill
//! the cache (1 where the cache size is unknown: nothing to weigh them against). The request's
//! own session does not count against its endpoint. With no active sessions anywhere it scores
//! 0 everywhere (it has nothing to go on), so routing without sessions is unchanged. Sessions
//! lapse by the host's clock: hosts call [`crate::SchedulerState::advance`] before each plan,
//! and [`crate::plan::learn`] records each session's latest turn.

use std::collections::VecDeque;

use hashbrown::HashMap;

use super::{ScoreContext, Scorer};

pub struct SessionLoad;

pub const NAME: &str = "session-load-scorer";

/// A session counts as active for this long after its last turn was routed.
pub const ACTIVE_MS: u64 = 30_000;
/// Sessions tracked per scheduler; beyond it the least recently seen stops counting.
pub const MAX_SESSIONS: usize = 16_384;

impl Scorer for SessionLoad {
    fn name(&self) -> &'static str {
        NAME
    }

    fn doc(&self) -> &'static str {
        "spreads sessions: the share of the endpoint's KV cache the contexts of its active sessions (30 s) leave free"
    }

    fn active(&self, ctx: &ScoreContext<'_>) -> bool {
        !ctx.sessions.is_empty()
    }

    /// It scores from this scheduler's own routing, so it holds while the host is silent.
    fn load_only_weight(&self, weight: f64) -> f64 {
        weight
    }

    fn score(&self, ctx: &ScoreContext<'_>, out: &mut [f64]) {
        let sessions = ctx.sessions;
        // Nothing to go on: 0 everywhere, as an inactive scorer counts.
        if sessions.is_empty() {
            out.fill(0.0);
            return;
        }
        let own = ctx.session_key.and_then(|k| sessions.bound(k));
        let load = |address: &str| {
            let tokens = sessions.tokens(address);
            match own {
                Some((at, mine)) if at == address => tokens.saturating_sub(mine),
                _ => tokens,
            }
        };
        for (e, s) in ctx.candidates().zip(out.iter_mut()) {
            let capacity = e.kv_blocks.saturating_mul(u64::from(e.block_size));
            // An engine whose cache size is unknown has nothing to weigh its sessions against.
            *s = if capacity == 0 { 1.0 } else { 1.0 - (load(&e.address) as f64 / capacity as f64).min(1.0) };
        }
    }
}

#[derive(Debug, Clone)]
struct Bound {
    endpoint: String,
    tokens: u64,
    /// Which touch bound it: an entry of the queue with another is stale.
    seq: u64,
}

/// The scorer's state: each active session's endpoint and context tokens, and their sum per
/// endpoint, kept as sessions are bound, move and lapse.
#[derive(Debug, Clone, Default)]
pub struct ActiveSessions {
    by_key: HashMap<u64, Bound>,
    tokens: HashMap<String, u64>,
    /// (last seen, touch, key) in the order seen; an entry whose session was seen again since
    /// is stale.
    order: VecDeque<(u64, u64, u64)>,
    touches: u64,
    /// The latest time seen: a clock that steps back (or a late, older report) ages nothing
    /// backwards and keeps the queue in time order.
    latest_ms: u64,
}

impl ActiveSessions {
    /// Whether no session is active.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Active sessions tracked.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Context tokens of the active sessions bound to `address`.
    pub fn tokens(&self, address: &str) -> u64 {
        self.tokens.get(address).copied().unwrap_or(0)
    }

    /// The endpoint session `key` is bound to, and its context tokens.
    pub fn bound(&self, key: u64) -> Option<(&str, u64)> {
        self.by_key.get(&key).map(|b| (b.endpoint.as_str(), b.tokens))
    }

    /// Session `key` was routed to `endpoint` at `now_ms` with a `tokens`-token context.
    pub fn touch(&mut self, key: u64, endpoint: &str, tokens: u64, now_ms: u64) {
        self.expire(now_ms);
        let now_ms = self.latest_ms;
        if let Some(old) = self.by_key.remove(&key) {
            self.release(&old);
        }
        while self.by_key.len() >= MAX_SESSIONS {
            let Some((_, seq, oldest)) = self.order.pop_front() else { break };
            self.drop_if_current(oldest, seq);
        }
        self.touches += 1;
        let seq = self.touches;
        match self.tokens.get_mut(endpoint) {
            Some(t) => *t = t.saturating_add(tokens),
            None => {
                self.tokens.insert(endpoint.to_owned(), tokens);
            }
        }
        self.by_key.insert(key, Bound { endpoint: endpoint.to_owned(), tokens, seq });
        self.order.push_back((now_ms, seq, key));
        // Stale entries (sessions seen again) are dropped as they reach the front; bound the
        // queue when sessions come back faster than they lapse.
        if self.order.len() > 4 * MAX_SESSIONS {
            let by_key = &self.by_key;
            self.order.retain(|(_, seq, k)| by_key.get(k).is_some_and(|b| b.seq == *seq));
        }
    }

    /// Sessions not seen for [`ACTIVE_MS`] before `now_ms` stop counting.
    pub fn expire(&mut self, now_ms: u64) {
        self.latest_ms = self.latest_ms.max(now_ms);
        let now_ms = self.latest_ms;
        while let Some(&(last_ms, seq, key)) = self.order.front() {
            if last_ms.saturating_add(ACTIVE_MS) > now_ms {
                break;
            }
            self.order.pop_front();
            self.drop_if_current(key, seq);
        }
    }

    fn drop_if_current(&mut self, key: u64, seq: u64) {
        if self.by_key.get(&key).is_some_and(|b| b.seq == seq) {
            if let Some(old) = self.by_key.remove(&key) {
                self.release(&old);
            }
        }
    }

    fn release(&mut self, old: &Bound) {
        if let Some(t) = self.tokens.get_mut(&old.endpoint) {
            *t = t.saturating_sub(old.tokens);
            if *t == 0 {
                self.tokens.remove(&old.endpoint);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Endpoint;
    use crate::filters::saturation::SaturationConfig;
    use crate::scorers::no_hit_lru::LastCold;

    /// Score `eps` with these active sessions, for the request of session `key`.
    fn score(eps: &[&Endpoint], sessions: &ActiveSessions, key: Option<u64>) -> Vec<f64> {
        let (sat, lru) = (SaturationConfig::default(), LastCold::default());
        let zeros = vec![0; eps.len()];
        let endpoints: Vec<Endpoint> = eps.iter().map(|&e| e.clone()).collect();
        let positions: Vec<usize> = (0..eps.len()).collect();
        let ctx = ScoreContext {
            model: "m",
            endpoints: &endpoints,
            positions: &positions,
            inflight: &zeros,
            matched_blocks: &[],
            total_blocks: 0,
            precise: None,
            cold: false,
            load_only: false,
            saturation: &sat,
            last_cold: &lru,
            sessions,
            session_key: key,
        };
        let mut out = vec![f64::NAN; eps.len()];
        SessionLoad.score(&ctx, &mut out);
        assert!(out.iter().all(|v| (0.0..=1.0).contains(v)), "{out:?}");
        out
    }

    fn eps(kv_blocks: u64) -> Vec<Endpoint> {
        ["a", "b", "c"]
            .iter()
            .map(|a| Endpoint { address: (*a).into(), kv_blocks, block_size: 16, ..Default::default() })
            .collect()
    }

    #[test]
    fn sessions_count_against_their_endpoint_until_they_lapse_or_move() {
        let mut s = ActiveSessions::default();
        s.touch(1, "a", 20_000, 0);
        s.touch(2, "a", 6_000, 1_000);
        s.touch(3, "b", 4_000, 2_000);
        assert_eq!((s.tokens("a"), s.tokens("b"), s.tokens("c")), (26_000, 4_000, 0));
        // The next turn of session 1 is longer and moves to c.
        s.touch(1, "c", 23_000, 5_000);
        assert_eq!((s.tokens("a"), s.tokens("c"), s.len()), (6_000, 23_000, 3));
        // Session 2 lapses 30 s after its last turn; session 1 was seen since.
        s.touch(3, "b", 7_000, 31_000);
        assert_eq!((s.tokens("a"), s.tokens("b"), s.tokens("c")), (0, 7_000, 23_000));
        assert_eq!(s.bound(2), None);
        assert_eq!(s.bound(1), Some(("c", 23_000)));
        // A clock that steps back neither revives nor strands anything.
        s.touch(4, "a", 1_000, 10_000);
        assert_eq!(s.tokens("a"), 1_000);
        s.expire(61_000);
        assert!(s.is_empty() && s.tokens("a") == 0 && s.tokens("b") == 0);
    }

    #[test]
    fn a_small_engine_nearly_full_scores_below_a_large_one_half_full() {
        let mut pool = eps(1_024);
        pool[1].kv_blocks = 4_096;
        let refs: Vec<&Endpoint> = pool.iter().collect();
        let mut s = ActiveSessions::default();
        s.touch(1, "a", 15_000, 0);
        s.touch(2, "b", 40_000, 0);
        let v = score(&refs, &s, None);
        assert!(v[0] < v[1] && v[1] < v[2], "{v:?}");
    }

    #[test]
    fn the_table_stays_bounded() {
        let mut s = ActiveSessions::default();
        for k in 0..(MAX_SESSIONS as u64 + 10) {
            s.touch(k, "a", 1, 0);
        }
        assert_eq!(s.len(), MAX_SESSIONS);
        assert_eq!(s.tokens("a"), MAX_SESSIONS as u64);
        assert_eq!(s.bound(0), None, "the least recently seen stops counting");
        // Sessions seen over and over leave no growing queue behind.
        for i in 0..(5 * MAX_SESSIONS as u64) {
            s.touch(i % 3, "b", 1, 1);
        }
        assert!(s.order.len() <= 4 * MAX_SESSIONS, "{}", s.order.len());
    }

    #[test]
    fn new_sessions_go_where_active_contexts_leave_the_most_cache() {
        // Engines of 2,048 blocks of 16 tokens: 32,768 tokens.
        let pool = eps(2_048);
        let refs: Vec<&Endpoint> = pool.iter().collect();
        let mut s = ActiveSessions::default();
        s.touch(1, "a", 30_000, 0);
        s.touch(2, "b", 8_000, 0);
        let new = score(&refs, &s, None);
        assert!(new[2] > new[1] && new[1] > new[0], "{new:?}");
        assert!((new[2] - 1.0).abs() < 1e-9 && (new[1] - (1.0 - 8_000.0 / 32_768.0)).abs() < 1e-9);
        // Session 1's own context does not count against its endpoint.
        let own = score(&refs, &s, Some(1));
        assert!((own[0] - 1.0).abs() < 1e-9 && own[1] < 1.0, "{own:?}");
        // Cache size unknown: nothing to weigh the sessions against.
        let unknown = eps(0);
        let refs: Vec<&Endpoint> = unknown.iter().collect();
        let neutral = score(&refs, &s, None);
        assert!(neutral.iter().all(|&v| (v - 1.0).abs() < 1e-9), "{neutral:?}");
        // No active session: nothing to go on, every endpoint scores 0.
        let none = ActiveSessions::default();
        assert!(score(&refs, &none, None).iter().all(|&v| v == 0.0));
    }
}
