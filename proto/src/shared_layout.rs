//! Where the snapshot lives in Envoy's shared data (namespaced by `vm_id`): the keys and the
//! version key's encoding. The snapshot agent writes it and every scheduler worker reads it;
//! the host's admission writes it too, to run a scheduler module on a pool of its own. One
//! definition, so the three cannot drift.
//!
//! `attache.snapshot` holds an encoded `attache.v1.Snapshot` (the base);
//! `attache.snapshot.deltas` the deltas that follow it, each framed as version (8 bytes) +
//! length (4 bytes), big-endian, then the encoded `attache.v1.SnapshotDelta`;
//! `attache.snapshot.version` holds the host epoch, the newest version and the encoded bytes of
//! every delta since the base, 8 bytes each, big-endian.

use crate::v1;

pub const SNAPSHOT_KEY: &str = "attache.snapshot";
pub const DELTAS_KEY: &str = "attache.snapshot.deltas";
pub const VERSION_KEY: &str = "attache.snapshot.version";
/// Written (empty) after every snapshot: its CAS token, which Envoy advances on every write,
/// says whether anything changed. An empty value costs a worker one host call per request
/// and no copy into the VM (a value would need an allocation call back into the VM too).
pub const CHANGED_KEY: &str = "attache.snapshot.changed";
/// When the snapshot stream last carried anything (heartbeats included): ms since the epoch,
/// 8 bytes little-endian. Workers compare it with their clock to notice a silent host.
pub const HEARD_KEY: &str = "attache.host.heard_ms";

/// The version key: host epoch, version, and the encoded bytes of every delta since the last
/// whole snapshot (so a worker knows how much it has to apply before reading any), big-endian.
pub fn version_key(s: &v1::Snapshot, delta_bytes: u64) -> [u8; 24] {
    let mut k = [0u8; 24];
    k[..8].copy_from_slice(&s.host_epoch.to_be_bytes());
    k[8..16].copy_from_slice(&s.version.to_be_bytes());
    k[16..].copy_from_slice(&delta_bytes.to_be_bytes());
    k
}

/// The shared data of a whole snapshot with no deltas, heard from at `now_ms`: what a worker
/// needs to schedule on `s`, key → value.
pub fn whole(s: &v1::Snapshot, now_ms: u64) -> Vec<(&'static str, Vec<u8>)> {
    use prost::Message;
    vec![
        (SNAPSHOT_KEY, s.encode_to_vec()),
        (DELTAS_KEY, Vec::new()),
        (VERSION_KEY, version_key(s, 0).to_vec()),
        (CHANGED_KEY, Vec::new()),
        (HEARD_KEY, now_ms.to_le_bytes().to_vec()),
    ]
}
