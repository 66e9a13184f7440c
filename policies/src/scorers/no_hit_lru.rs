//! `no-hit-lru-scorer` (llm-d): for a cold request (no endpoint holds enough of its prefix),
//! endpoints that received a cold request least recently (or never) score up to 1, so new
//! prefixes spread evenly even when load metrics cannot tell endpoints apart. A warm request
//! scores 0.5 everywhere. A request for a LoRA adapter has its affinity already, where the
//! adapter runs: spreading it would weigh as much as a tier step and load the adapter elsewhere,
//! so it counts as warm.

use super::{lora_affinity, ScoreContext, Scorer};

pub struct NoHitLru;

pub const NAME: &str = "no-hit-lru-scorer";

impl Scorer for NoHitLru {
    fn name(&self) -> &'static str {
        NAME
    }

    fn doc(&self) -> &'static str {
        "spreads cold prefixes: the endpoint that least recently got a cold request scores 1"
    }

    fn score(&self, ctx: &ScoreContext<'_>, out: &mut [f64]) {
        let cold = ctx.cold && ctx.candidates().all(|e| lora_affinity::tier(e, ctx.model) <= 0.0);
        if !cold || ctx.len() < 2 {
            out.fill(if cold { 1.0 } else { 0.5 });
            return;
        }
        // (last cold request, position): least recent first, ties in pool order.
        let mut order = crate::scratch::Buf::<(u64, usize)>::take();
        order.extend(ctx.candidates().enumerate().map(|(i, e)| (ctx.last_cold.last_cold(&e.address), i)));
        order.sort_unstable();
        let n = order.len().saturating_sub(1).max(1) as f64;
        for (rank, &(_, i)) in order.iter().enumerate() {
            if let Some(s) = out.get_mut(i) {
                *s = 1.0 - rank as f64 / n;
            }
        }
    }
}

/// The scorer's state: when each endpoint last received a cold request. Schedulers that
/// share one pool (an Envoy's workers) share this table, so their first requests for new
/// prefixes do not all go to the same never-used endpoint: each keeps the records it made
/// since the last share ([`LastCold::share`]) and replays them on the shared table.
#[derive(Debug, Default, Clone)]
pub struct LastCold {
    tick: u64,
    last_cold: hashbrown::HashMap<String, u64>,
    unshared: Vec<String>,
}

/// Records kept for the next share at most; past it the oldest wait no longer (the shared
/// table then misses them, as if another scheduler had won every race).
const MAX_UNSHARED: usize = 256;

impl LastCold {
    /// Remember that `address` received a cold request.
    pub fn record(&mut self, address: &str) {
        self.apply(address);
        if self.unshared.len() < MAX_UNSHARED {
            self.unshared.push(address.to_owned());
        }
    }

    fn apply(&mut self, address: &str) {
        self.tick += 1;
        if self.last_cold.len() > 4096 && !self.last_cold.contains_key(address) {
            self.last_cold.clear();
        }
        match self.last_cold.get_mut(address) {
            Some(t) => *t = self.tick,
            None => {
                self.last_cold.insert(address.to_owned(), self.tick);
            }
        }
    }

    /// When `address` last received a cold request (0: never).
    pub fn last_cold(&self, address: &str) -> u64 {
        self.last_cold.get(address).copied().unwrap_or(0)
    }

    /// Whether this table holds records the shared one has not seen.
    pub fn has_unshared(&self) -> bool {
        !self.unshared.is_empty()
    }

    /// Take the shared table (`shared`, as [`LastCold::encode`] wrote it; `None` when there is
    /// none yet) with this table's unshared records replayed on it. Says what to write back:
    /// the result, when there were records to replay or the shared table did not decode (it
    /// is replaced, and said so, to be counted). The caller confirms a write that lands with
    /// [`LastCold::shared`].
    pub fn share(&mut self, shared: Option<&[u8]>) -> Share {
        let (mut next, corrupt) = match shared.map(Self::decode) {
            None => (Self::default(), false),
            Some(Some(t)) => (t, false),
            Some(None) => (Self::default(), true),
        };
        for a in &self.unshared {
            next.apply(a);
        }
        let write = (self.has_unshared() || corrupt).then(|| next.encode());
        next.unshared = std::mem::take(&mut self.unshared);
        *self = next;
        Share { write, corrupt }
    }

    /// The write [`LastCold::share`] returned landed: its records are shared now.
    pub fn shared(&mut self) {
        self.unshared.clear();
    }

    /// The table as bytes: the tick, then per endpoint its tick and address
    /// (`u64`, `u16` length, UTF-8), big-endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + self.last_cold.len() * 32);
        out.extend_from_slice(&self.tick.to_be_bytes());
        for (a, t) in &self.last_cold {
            let Ok(len) = u16::try_from(a.len()) else { continue };
            out.extend_from_slice(&t.to_be_bytes());
            out.extend_from_slice(&len.to_be_bytes());
            out.extend_from_slice(a.as_bytes());
        }
        out
    }

    /// The table [`LastCold::encode`] wrote, or `None` when `bytes` is not one.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let (tick, mut rest) = bytes.split_first_chunk::<8>()?;
        let mut t = Self { tick: u64::from_be_bytes(*tick), ..Self::default() };
        while !rest.is_empty() {
            let (at, r) = rest.split_first_chunk::<8>()?;
            let (len, r) = r.split_first_chunk::<2>()?;
            let len = usize::from(u16::from_be_bytes(*len));
            let address = std::str::from_utf8(r.get(..len)?).ok()?;
            t.last_cold.insert(address.to_owned(), u64::from_be_bytes(*at));
            rest = r.get(len..)?;
        }
        Some(t)
    }
}

/// What [`LastCold::share`] found and wants written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The table to write back, if any.
    pub write: Option<Vec<u8>>,
    /// The shared table did not decode and is being replaced.
    pub corrupt: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Endpoint;

    #[test]
    fn cold_requests_prefer_least_recently_used() {
        let eps: Vec<Endpoint> =
            ["a", "b", "c"].iter().map(|a| Endpoint { address: (*a).into(), ..Default::default() }).collect();
        let positions = [0, 1, 2];
        let mut lru = LastCold::default();
        lru.record("a");
        lru.record("c");
        let sat = crate::filters::saturation::SaturationConfig::default();
        let sessions = crate::scorers::session_load::ActiveSessions::default();
        let ctx = |cold| ScoreContext {
            model: "m",
            endpoints: &eps,
            positions: &positions,
            inflight: &[0, 0, 0],
            matched_blocks: &[0, 0, 0],
            total_blocks: 0,
            precise: None,
            cold,
            load_only: false,
            saturation: &sat,
            last_cold: &lru,
            sessions: &sessions,
            session_key: None,
        };
        let scored = |c: &ScoreContext<'_>| {
            let mut out = vec![f64::NAN; 3];
            NoHitLru.score(c, &mut out);
            out
        };
        assert_eq!(scored(&ctx(true)), vec![0.5, 1.0, 0.0]);
        assert_eq!(scored(&ctx(false)), vec![0.5; 3]);
    }

    #[test]
    fn schedulers_sharing_the_table_spread_their_first_cold_requests() {
        // Two workers, four endpoints: without sharing, each sends its first cold request to
        // the same never-used endpoint.
        let eps = ["a", "b", "c", "d"];
        let pick = |lru: &LastCold| *eps.iter().min_by_key(|a| lru.last_cold(a)).expect("endpoints");
        let (mut w1, mut w2) = (LastCold::default(), LastCold::default());
        let mut shared: Option<Vec<u8>> = None;
        let mut picks = Vec::new();
        for round in 0..4 {
            let w = if round % 2 == 0 { &mut w1 } else { &mut w2 };
            let p = pick(w);
            w.record(p);
            picks.push(p);
            // The tick: replay this worker's record on the shared table and write it back.
            let share = w.share(shared.as_deref());
            assert!(!share.corrupt);
            shared = Some(share.write.expect("a record to share"));
            w.shared();
            assert!(!w.has_unshared());
            // The other worker adopts it at its next tick (nothing of its own to replay).
            let other = if round % 2 == 0 { &mut w2 } else { &mut w1 };
            assert_eq!(other.share(shared.as_deref()), Share { write: None, corrupt: false });
        }
        picks.sort_unstable();
        assert_eq!(picks, eps, "each endpoint got one first cold request");
    }

    #[test]
    fn a_lost_write_keeps_records_for_the_next_share_and_corrupt_tables_are_replaced() {
        let mut w = LastCold::default();
        w.record("a");
        let first = w.share(None).write.expect("a write");
        // The write lost a race: the record stays unshared and is replayed on the next share.
        assert!(w.has_unshared());
        let mut other = LastCold::default();
        other.record("b");
        let theirs = other.share(None).write.expect("a write");
        let again = w.share(Some(&theirs)).write.expect("still a write");
        let merged = LastCold::decode(&again).expect("round-trips");
        assert!(merged.last_cold("a") > merged.last_cold("b"), "replayed after theirs");
        assert_eq!(LastCold::decode(&first).map(|t| t.last_cold("a")), Some(1));
        let fixed = w.share(Some(&[1, 2, 3]));
        assert!(fixed.corrupt && fixed.write.is_some(), "a corrupt table is replaced and said so");
        assert!(w.last_cold("a") > 0, "its own records survive a corrupt table");
        assert_eq!(LastCold::decode(&[0; 8]).map(|t| t.last_cold("a")), Some(0));
        assert!(LastCold::decode(&[0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 9, b'a']).is_none());
    }
}
