//! Snapshots in shared data: written from the host's stream (by the agent), read into a
//! worker's cached [`PoolState`] (by the scheduler).
//!
//! Shared-data layout (namespaced by `vm_id`): `attache.snapshot` holds the encoded
//! `attache.v1.Snapshot`; `attache.snapshot.version` holds 16 bytes, host epoch then version,
//! big-endian. Workers read the small version key per request and decode the snapshot only
//! when it changes (a 1 MB shared-data read costs ~90 µs; `reference/envoy-wasm.md` §9.7).

use attache_policies::endpoint::LoraState;
use attache_policies::{Endpoint, EndpointMetrics, PoolState, Role};
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

/// Convert the wire snapshot into the policies' pool state.
pub fn to_pool(s: &v1::Snapshot) -> PoolState {
    PoolState {
        version: s.version,
        endpoints: s
            .endpoints
            .iter()
            .map(|e| Endpoint {
                id: e.id,
                block_size: e.block_size,
                address: e.address.clone(),
                models: e.models.clone(),
                role: Role::from_label(&e.role),
                ready: e.ready,
                metrics: e.has_metrics.then_some(EndpointMetrics {
                    waiting: e.waiting,
                    running: e.running,
                    kv_usage: e.kv_usage,
                    age_ms: e.metrics_age_ms,
                    ttft_ms: e.ttft_ms,
                }),
                labels: {
                    let mut l: Vec<(String, String)> = e.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                    l.sort();
                    l
                },
                lora: (e.max_lora > 0).then(|| LoraState {
                    running: e.lora_running.clone(),
                    waiting: e.lora_waiting.clone(),
                    max_lora: e.max_lora,
                }),
            })
            .collect(),
        saturation: s.saturation,
        dispatch_cost: s.dispatch_cost,
        observed_ms: s.observed_unix_ms,
        objectives: s.objectives.iter().map(|(k, v)| (k.clone(), *v)).collect(),
    }
}

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
    fn wire_snapshot_to_pool() {
        let s = v1::Snapshot {
            version: 7,
            host_epoch: 1,
            generated_unix_ms: 0,
            endpoints: vec![
                v1::Endpoint {
                    address: "1.2.3.4:80".into(),
                    models: vec!["m".into()],
                    role: "decode".into(),
                    ready: true,
                    has_metrics: true,
                    waiting: 3.0,
                    kv_usage: 0.5,
                    metrics_age_ms: 20,
                    ..Default::default()
                },
                v1::Endpoint { address: "1.2.3.5:80".into(), ..Default::default() },
            ],
            saturation: Some(1.5),
            objectives: [("chat".to_owned(), 10)].into(),
            dispatch_cost: 0.1,
            observed_unix_ms: 42,
        };
        let p = to_pool(&s);
        assert_eq!((p.dispatch_cost, p.observed_ms), (0.1, 42));
        assert_eq!(p.version, 7);
        assert_eq!(p.endpoints[0].role, Role::Decode);
        assert_eq!(p.endpoints[0].metrics.unwrap().waiting, 3.0);
        assert!(p.endpoints[1].metrics.is_none());
        assert!(!p.endpoints[1].ready);
        assert_eq!((p.saturation, p.objectives.get("chat")), (Some(1.5), Some(&10)));
        assert_ne!(version_key(&s), version_key(&v1::Snapshot { version: 8, ..s.clone() }));
    }
}
