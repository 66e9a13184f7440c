//! Snapshots in shared data: written from the host's stream (by the agent), read into a
//! worker's cached [`PoolState`] (by the scheduler).
//!
//! Shared-data layout (namespaced by `vm_id`): `attache.snapshot` holds the encoded
//! `attache.v1.Snapshot`; `attache.snapshot.version` holds 16 bytes, host epoch then version,
//! big-endian. Workers read the small version key per request and decode the snapshot only
//! when it changes (a 1 MB shared-data read costs ~90 µs; `reference/envoy-wasm.md` §9.7).

use attache_policies::PoolState;
use attache_proto::v1;
use prost::Message;
use proxy_wasm::types::LogLevel;

use crate::hostcalls as host;

pub const SNAPSHOT_KEY: &str = "attache.snapshot";
pub const VERSION_KEY: &str = "attache.snapshot.version";
/// Written (empty) after every snapshot: its CAS token, which Envoy advances on every write,
/// says whether anything changed. An empty value costs a worker one host call per request
/// and no copy into the VM (a value would need an allocation call back into the VM too).
pub const CHANGED_KEY: &str = "attache.snapshot.changed";
/// When the snapshot stream last carried anything (heartbeats included): ms since the epoch,
/// 8 bytes little-endian. Workers compare it with their clock to notice a silent host.
pub const HEARD_KEY: &str = "attache.host.heard_ms";

pub use attache_proto::pool::to_pool;

fn version_key(s: &v1::Snapshot) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&s.host_epoch.to_be_bytes());
    k[8..].copy_from_slice(&s.version.to_be_bytes());
    k
}

/// Write a snapshot for every worker: the snapshot first, then the version key, then the
/// change signal.
pub fn publish(s: &v1::Snapshot) -> bool {
    let bytes = s.encode_to_vec();
    host::set_shared_data(SNAPSHOT_KEY, &bytes)
        && host::set_shared_data(VERSION_KEY, &version_key(s))
        && host::set_shared_data(CHANGED_KEY, &[])
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
    key: Option<Vec<u8>>,
    /// The change signal's CAS token when this cache last looked at the version key.
    seen: Option<u32>,
    pub pool: PoolState,
    /// When this worker last saw a new version (ms since epoch).
    pub updated_ms: u64,
    pub decode_failures: u64,
}

impl SnapshotCache {
    /// Re-read the snapshot if its version key changed. Returns true if the pool changed.
    pub fn refresh(&mut self, now_ms: u64) -> bool {
        let (_, signal) = host::shared_data_cas(CHANGED_KEY);
        if signal.is_some() && signal == self.seen {
            return false;
        }
        let Some(key) = host::shared_data(VERSION_KEY) else {
            return false;
        };
        if self.key.as_deref() == Some(key.as_slice()) {
            self.seen = signal;
            return false;
        }
        let Some(bytes) = host::shared_data(SNAPSHOT_KEY) else {
            return false;
        };
        // Looked at, whatever the outcome: bytes that do not decode are not retried until the
        // next write.
        self.seen = signal;
        match decode_pool(&bytes) {
            Ok(pool) => {
                self.pool = pool;
                self.key = Some(key);
                self.updated_ms = now_ms;
                true
            }
            Err(e) => {
                self.decode_failures += 1;
                host::log(LogLevel::Warn, &format!("attache: undecodable snapshot ignored: {e}"));
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_version_is_a_new_key() {
        let s = v1::Snapshot { version: 7, host_epoch: 1, ..Default::default() };
        assert_ne!(version_key(&s), version_key(&v1::Snapshot { version: 8, ..s.clone() }));
        assert_ne!(version_key(&s), version_key(&v1::Snapshot { host_epoch: 2, ..s.clone() }));
    }
}
