//! Snapshots in shared data: written from the host's stream (by the agent), read into a
//! worker's cached [`PoolState`] (by the scheduler).
//!
//! Shared-data layout: [`attache_proto::shared_layout`] (the base snapshot, the delta log,
//! the version key), namespaced by `vm_id`. Workers read the small version key per request; when it moves
//! they apply the deltas they lack, skipping those they have by the frame's version alone, and
//! read the whole base only when they fell behind it (a 1 MB shared-data read costs ~90 µs
//! and decoding 10,000 endpoints far more; `reference/envoy-wasm.md` §9.7). The agent folds
//! the deltas into a new base once they pass [`LOG_MAX_BYTES`] or [`LOG_MAX_ENTRIES`], keeping
//! the newest in the log so that workers a few versions behind need not read the base.

use attache_policies::PoolState;
use attache_proto::v1;
use prost::Message;
use proxy_wasm::types::LogLevel;

use crate::hostcalls as host;

use attache_proto::shared_layout::version_key;
pub use attache_proto::shared_layout::{CHANGED_KEY, DELTAS_KEY, HEARD_KEY, SNAPSHOT_KEY, VERSION_KEY};
/// The delta log is folded into a new base past this many bytes or entries since the last one.
pub const LOG_MAX_BYTES: usize = 256 * 1024;
pub const LOG_MAX_ENTRIES: usize = 512;
/// What stays in the log when it is folded: the newest deltas, for workers a little behind.
pub const LOG_KEEP_BYTES: usize = 64 * 1024;
pub const LOG_KEEP_ENTRIES: usize = 64;

pub use attache_proto::pool::to_pool;

/// Write a snapshot for every worker: the snapshot first, then an empty delta log, then the
/// version key, then the change signal.
pub fn publish(s: &v1::Snapshot) -> bool {
    let bytes = s.encode_to_vec();
    host::set_shared_data(SNAPSHOT_KEY, &bytes)
        && host::set_shared_data(DELTAS_KEY, &[])
        && host::set_shared_data(VERSION_KEY, &version_key(s, 0))
        && host::set_shared_data(CHANGED_KEY, &[])
}

/// Why the agent could not take a delta.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// No snapshot yet, or the delta does not follow the one held: the stream must restart
    /// with a full snapshot.
    Gap,
    /// Shared data refused the write.
    Write,
}

/// The agent's copy of the newest snapshot and the delta log it published with its base.
#[derive(Default)]
pub struct Publisher {
    current: Option<v1::Snapshot>,
    /// (version, framed delta), oldest first.
    frames: std::collections::VecDeque<(u64, Vec<u8>)>,
    bytes: usize,
    /// Deltas since the base was written.
    since_base: usize,
    /// Encoded bytes of every delta since the last whole snapshot.
    total: u64,
}

impl Publisher {
    /// A whole snapshot: the new base, with an empty log.
    pub fn full(&mut self, s: v1::Snapshot) -> bool {
        self.frames.clear();
        self.bytes = 0;
        self.since_base = 0;
        self.total = 0;
        let ok = publish(&s);
        self.current = Some(s);
        ok
    }

    /// A delta: applied to the held snapshot and appended to the log. Past [`LOG_MAX_BYTES`]
    /// or [`LOG_MAX_ENTRIES`] since the base, the held snapshot becomes the new base; the
    /// newest deltas stay in the log ([`LOG_KEEP_BYTES`], [`LOG_KEEP_ENTRIES`]), so workers a
    /// few versions behind still catch up by them. Returns the new snapshot's (epoch, version).
    pub fn delta(&mut self, d: &v1::SnapshotDelta) -> Result<(u64, u64), Refused> {
        let cur = self.current.as_mut().ok_or(Refused::Gap)?;
        attache_proto::delta::apply(cur, d).map_err(|_| Refused::Gap)?;
        let at = (cur.host_epoch, cur.version);
        let body = d.encode_to_vec();
        let mut frame = Vec::with_capacity(12 + body.len());
        frame.extend_from_slice(&d.version.to_be_bytes());
        frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
        frame.extend_from_slice(&body);
        self.bytes += frame.len();
        self.frames.push_back((d.version, frame));
        self.since_base += 1;
        self.total += body.len() as u64;
        let key = version_key(cur, self.total);
        let mut ok = true;
        if self.bytes > LOG_MAX_BYTES || self.since_base >= LOG_MAX_ENTRIES {
            while self.bytes > LOG_KEEP_BYTES || self.frames.len() > LOG_KEEP_ENTRIES {
                let Some((_, f)) = self.frames.pop_front() else { break };
                self.bytes -= f.len();
            }
            self.since_base = 0;
            ok &= host::set_shared_data(SNAPSHOT_KEY, &cur.encode_to_vec());
        }
        let log: Vec<u8> = self.frames.iter().flat_map(|(_, f)| f.iter().copied()).collect();
        ok = ok
            && host::set_shared_data(DELTAS_KEY, &log)
            && host::set_shared_data(VERSION_KEY, &key)
            && host::set_shared_data(CHANGED_KEY, &[]);
        if ok {
            Ok(at)
        } else {
            Err(Refused::Write)
        }
    }
}

/// The framed deltas in `log` newer than `after`, in order; stops at a torn frame.
fn deltas_after(log: &[u8], after: u64) -> Vec<v1::SnapshotDelta> {
    let mut out = Vec::new();
    let mut rest = log;
    while rest.len() >= 12 {
        let (head, tail) = rest.split_at(12);
        let version = head.get(..8).and_then(|b| <[u8; 8]>::try_from(b).ok()).map_or(0, u64::from_be_bytes);
        let len = head.get(8..12).and_then(|b| <[u8; 4]>::try_from(b).ok()).map_or(0, u32::from_be_bytes) as usize;
        let Some(body) = tail.get(..len) else { break };
        if version > after {
            match v1::SnapshotDelta::decode(body) {
                Ok(d) => out.push(d),
                Err(_) => break,
            }
        }
        rest = tail.get(len..).unwrap_or_default();
    }
    out
}

/// Decode the host's snapshot bytes into the pool the scheduler reads (fuzzed:
/// `tests/fuzz/fuzz_targets/snapshot_decode.rs`).
pub fn decode_pool(bytes: &[u8]) -> Result<PoolState, prost::DecodeError> {
    v1::Snapshot::decode(bytes).map(|s| to_pool(&s))
}

/// Record that the host was heard from at `now_ms`.
pub fn heard(now_ms: u64) {
    let _ = host::set_shared_data(HEARD_KEY, &now_ms.to_le_bytes());
}

/// When the host was last heard from (ms since epoch), by any root context of this Envoy, or
/// `None` if it never was (then there is no snapshot either, and nothing to distrust).
pub fn heard_ms() -> Option<u64> {
    host::read_u64(&host::shared_data(HEARD_KEY)?)
}

/// A worker's cached view of the newest snapshot.
#[derive(Default)]
pub struct SnapshotCache {
    /// The (epoch, version) of `pool`.
    at: Option<(u64, u64)>,
    /// The change signal's CAS token when this cache last looked at the version key.
    seen: Option<u32>,
    pub pool: PoolState,
    /// When this worker last saw a new version (ms since epoch).
    pub updated_ms: u64,
    pub decode_failures: u64,
    /// Versions taken as deltas, and whole snapshots read.
    pub deltas_applied: u64,
    pub full_reads: u64,
    /// When the worker's tick last took new versions.
    ticked_ms: Option<u64>,
}

/// A request takes new snapshot versions itself only when the worker's tick has not run for
/// this long (two snapshot ticks) or the worker has no ready endpoint. Otherwise it schedules on
/// the pool as of the last tick, at most one tick (20 ms) old, without a look at shared data:
/// applying even a small delta inside a request made it one of the slowest 1% (a delta reads
/// the log and moves the endpoint in the load order), and the engine metrics behind it are a
/// 50 ms scrape old anyway.
pub const REQUEST_REFRESH_AFTER_MS: u64 = 40;

/// (epoch, version, delta bytes since the last whole snapshot).
fn parse_key(k: &[u8]) -> Option<(u64, u64, u64)> {
    let word = |r: std::ops::Range<usize>| k.get(r).and_then(|b| <[u8; 8]>::try_from(b).ok()).map(u64::from_be_bytes);
    Some((word(0..8)?, word(8..16)?, word(16..24).unwrap_or(0)))
}

/// Who is catching up: the worker's tick always applies what is new; a request may leave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Caller {
    Tick,
    Request,
}

impl SnapshotCache {
    /// From the worker's tick: take new versions.
    pub fn refresh_on_tick(&mut self, now_ms: u64) -> bool {
        self.ticked_ms = Some(now_ms);
        self.catch_up(now_ms, Caller::Tick)
    }

    /// From a request: take new versions only if the tick is not keeping up (see
    /// [`REQUEST_REFRESH_AFTER_MS`]).
    pub fn refresh_for_request(&mut self, now_ms: u64) -> bool {
        self.catch_up(now_ms, Caller::Request)
    }

    /// Whether a request leaves new versions to the tick: it runs, and the worker has a pool
    /// with a ready endpoint.
    fn leave_to_tick(&self, now_ms: u64) -> bool {
        let ticking = self.ticked_ms.is_some_and(|t| now_ms.saturating_sub(t) <= REQUEST_REFRESH_AFTER_MS);
        ticking && self.at.is_some() && self.pool.has_ready()
    }

    /// Catch up with the newest snapshot (from anywhere: tests, the queue).
    pub fn refresh(&mut self, now_ms: u64) -> bool {
        self.catch_up(now_ms, Caller::Tick)
    }

    /// Catch up with the newest snapshot if the version key moved: by the deltas this worker
    /// lacks when it is on the base's chain, else by reading the base and its deltas. Returns
    /// true if the pool changed.
    fn catch_up(&mut self, now_ms: u64, caller: Caller) -> bool {
        if caller == Caller::Request && self.leave_to_tick(now_ms) {
            return false;
        }
        let (_, signal) = host::shared_data_cas(CHANGED_KEY);
        if signal.is_some() && signal == self.seen {
            return false;
        }
        let Some(target) = host::shared_data(VERSION_KEY).as_deref().and_then(parse_key) else {
            return false;
        };
        // Looked at, whatever the outcome: bytes that do not decode are not retried until the
        // next write.
        self.seen = signal;
        if let Some((epoch, have)) = self.at {
            if epoch == target.0 && have >= target.1 {
                return false;
            }
            if epoch == target.0 && self.follow(epoch, have) {
                self.updated_ms = now_ms;
                return true;
            }
        }
        self.reload(now_ms)
    }

    /// Apply the logged deltas after `have`; false when they do not chain from it.
    fn follow(&mut self, epoch: u64, have: u64) -> bool {
        let Some(log) = host::shared_data(DELTAS_KEY) else { return false };
        let deltas = deltas_after(&log, have);
        if deltas.first().is_none_or(|d| d.base_version != have) {
            return false;
        }
        for d in &deltas {
            if attache_proto::delta::apply_pool(&mut self.pool, epoch, d).is_err() {
                // Half-applied: start over from the base.
                self.at = None;
                return false;
            }
            self.at = Some((epoch, d.version));
            self.deltas_applied += 1;
        }
        true
    }

    /// Read the base snapshot and apply every delta logged after it.
    fn reload(&mut self, now_ms: u64) -> bool {
        let Some(bytes) = host::shared_data(SNAPSHOT_KEY) else {
            return false;
        };
        let s = match v1::Snapshot::decode(bytes.as_slice()) {
            Ok(s) => s,
            Err(e) => {
                self.decode_failures += 1;
                host::log(LogLevel::Warn, &format!("attache: undecodable snapshot ignored: {e}"));
                return false;
            }
        };
        self.full_reads += 1;
        self.pool = to_pool(&s);
        // Build a large pool's pre-selection lookups here, not in the next decision.
        if self.pool.endpoints.len() > attache_policies::preselect::PreselectConfig::default().above {
            let _ = self.pool.index();
        }
        self.at = Some((s.host_epoch, s.version));
        self.updated_ms = now_ms;
        let _ = self.follow(s.host_epoch, s.version);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_is_skipped_by_version_and_stops_at_a_torn_frame() {
        let d = |v: u64| v1::SnapshotDelta { version: v, base_version: v - 1, ..Default::default() };
        let mut log = Vec::new();
        for v in 2..=5 {
            let b = d(v).encode_to_vec();
            log.extend_from_slice(&v.to_be_bytes());
            log.extend_from_slice(&(b.len() as u32).to_be_bytes());
            log.extend_from_slice(&b);
        }
        let after = |log: &[u8], n| deltas_after(log, n).iter().map(|d| d.version).collect::<Vec<_>>();
        assert_eq!(after(&log, 1), vec![2, 3, 4, 5]);
        assert_eq!(after(&log, 3), vec![4, 5]);
        assert_eq!(after(&log, 5), Vec::<u64>::new());
        log.truncate(log.len() - 1);
        assert_eq!(after(&log, 3), vec![4], "the torn last frame is left out");
        assert_eq!(
            parse_key(&version_key(&v1::Snapshot { version: 7, host_epoch: 3, ..Default::default() }, 90)),
            Some((3, 7, 90))
        );
        assert_eq!(parse_key(&[1, 2]), None);
    }

    #[test]
    fn a_new_version_is_a_new_key() {
        let s = v1::Snapshot { version: 7, host_epoch: 1, ..Default::default() };
        assert_ne!(version_key(&s, 0), version_key(&v1::Snapshot { version: 8, ..s.clone() }, 0));
        assert_ne!(version_key(&s, 0), version_key(&v1::Snapshot { host_epoch: 2, ..s.clone() }, 0));
    }
}
