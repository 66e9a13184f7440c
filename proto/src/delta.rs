//! Snapshot deltas: what changed between two snapshots, and applying it, to the wire snapshot
//! (the agent's copy) and to the policies' pool state (each worker's copy). One logic for the
//! host that computes them and the filters that apply them.
//!
//! Endpoints are ordered by address in every snapshot (the host's pool is keyed by it), so an
//! endpoint a delta adds goes where a full snapshot would have put it.

use attache_policies::PoolState;

use crate::pool::to_endpoint;
use crate::v1;

/// Why a delta could not be applied; the receiver keeps its state and waits for a full
/// snapshot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeltaError {
    #[error("delta from version {base} (epoch {epoch}) does not follow version {have} (epoch {have_epoch})")]
    Gap { base: u64, epoch: u64, have: u64, have_epoch: u64 },
}

/// The delta from `prev` to `next`; `None` when they are of different host epochs (a
/// restarted host sends a full snapshot).
pub fn diff(prev: &v1::Snapshot, next: &v1::Snapshot) -> Option<v1::SnapshotDelta> {
    if prev.host_epoch != next.host_epoch {
        return None;
    }
    let mut upserts = Vec::new();
    let mut removed = Vec::new();
    // Both are sorted by address: one merge pass.
    let (mut i, mut j) = (0, 0);
    let (a, b) = (&prev.endpoints, &next.endpoints);
    while i < a.len() || j < b.len() {
        match (a.get(i), b.get(j)) {
            (Some(x), Some(y)) if x.address == y.address => {
                if x != y {
                    upserts.push(y.clone());
                }
                i += 1;
                j += 1;
            }
            (Some(x), Some(y)) if x.address < y.address => {
                removed.push(x.id);
                i += 1;
            }
            (Some(_), Some(y)) | (None, Some(y)) => {
                upserts.push(y.clone());
                j += 1;
            }
            (Some(x), None) => {
                removed.push(x.id);
                i += 1;
            }
            (None, None) => break,
        }
    }
    Some(v1::SnapshotDelta {
        version: next.version,
        base_version: prev.version,
        host_epoch: next.host_epoch,
        generated_unix_ms: next.generated_unix_ms,
        upserts,
        removed,
        saturation: next.saturation,
        dispatch_cost: next.dispatch_cost,
        observed_unix_ms: next.observed_unix_ms,
        objectives: (prev.objectives != next.objectives)
            .then(|| v1::Objectives { priorities: next.objectives.clone() }),
    })
}

fn check(d: &v1::SnapshotDelta, have: u64, have_epoch: u64) -> Result<(), DeltaError> {
    if d.base_version != have || d.host_epoch != have_epoch {
        return Err(DeltaError::Gap { base: d.base_version, epoch: d.host_epoch, have, have_epoch });
    }
    Ok(())
}

/// Where `address` is, or would go, in endpoints sorted by address.
fn slot<T>(list: &[T], address: &str, key: impl Fn(&T) -> &str) -> Result<usize, usize> {
    list.binary_search_by(|e| key(e).cmp(address))
}

/// Apply `d` to the wire snapshot `s`.
pub fn apply(s: &mut v1::Snapshot, d: &v1::SnapshotDelta) -> Result<(), DeltaError> {
    check(d, s.version, s.host_epoch)?;
    if !d.removed.is_empty() {
        s.endpoints.retain(|e| !d.removed.contains(&e.id));
    }
    for u in &d.upserts {
        match slot(&s.endpoints, &u.address, |e| e.address.as_str()) {
            Ok(p) => {
                if let Some(e) = s.endpoints.get_mut(p) {
                    *e = u.clone();
                }
            }
            Err(p) => s.endpoints.insert(p, u.clone()),
        }
    }
    s.version = d.version;
    s.generated_unix_ms = d.generated_unix_ms;
    s.saturation = d.saturation;
    s.dispatch_cost = d.dispatch_cost;
    s.observed_unix_ms = d.observed_unix_ms;
    if let Some(o) = &d.objectives {
        s.objectives = o.priorities.clone();
    }
    Ok(())
}

/// What applying a delta to a pool did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Positions of the endpoints updated in place.
    pub updated: Vec<usize>,
    /// Whether endpoints came or went (positions moved).
    pub reshaped: bool,
}

/// Apply `d` to `pool`, whose snapshot was `(epoch, pool.version)`. The pool's pre-selection
/// lookups follow: updated in place for changed endpoints, rebuilt when endpoints came or went.
pub fn apply_pool(pool: &mut PoolState, epoch: u64, d: &v1::SnapshotDelta) -> Result<Applied, DeltaError> {
    check(d, pool.version, epoch)?;
    let mut out = Applied::default();
    if !d.removed.is_empty() {
        let before = pool.endpoints.len();
        pool.endpoints.retain(|e| !d.removed.contains(&e.id));
        out.reshaped |= pool.endpoints.len() != before;
    }
    for u in &d.upserts {
        let e = to_endpoint(u);
        match slot(&pool.endpoints, &u.address, |e| e.address.as_str()) {
            Ok(p) => {
                if let Some(old) = pool.endpoints.get_mut(p) {
                    *old = e;
                    out.updated.push(p);
                }
            }
            Err(p) => {
                pool.endpoints.insert(p, e);
                out.reshaped = true;
            }
        }
    }
    pool.version = d.version;
    pool.saturation = d.saturation;
    pool.dispatch_cost = d.dispatch_cost;
    pool.observed_ms = d.observed_unix_ms;
    if let Some(o) = &d.objectives {
        pool.objectives = o.priorities.iter().map(|(k, v)| (k.clone(), *v)).collect();
    }
    if out.reshaped {
        pool.reindex();
    } else {
        pool.index_updated(&out.updated);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::to_pool;
    use prost::Message;

    fn ep(id: u32, waiting: f64) -> v1::Endpoint {
        v1::Endpoint {
            id,
            address: format!("10.0.{}.{}:8000", id / 256, id % 256),
            models: vec!["m".into()],
            ready: true,
            has_metrics: true,
            waiting,
            ..Default::default()
        }
    }

    fn snap(version: u64, eps: Vec<v1::Endpoint>) -> v1::Snapshot {
        let mut endpoints = eps;
        endpoints.sort_by(|a, b| a.address.cmp(&b.address));
        v1::Snapshot { version, host_epoch: 9, endpoints, ..Default::default() }
    }

    #[test]
    fn one_changed_engine_of_ten_thousand_is_a_small_delta() {
        let a = snap(1, (0..10_000).map(|i| ep(i, 0.0)).collect());
        let mut b = a.clone();
        b.version = 2;
        b.endpoints[4_321].waiting = 3.0;
        let d = diff(&a, &b).expect("same epoch");
        assert_eq!(d.upserts.len(), 1);
        assert!(d.removed.is_empty() && d.objectives.is_none());
        let bytes = v1::Update { kind: Some(v1::update::Kind::Delta(d)), sent_unix_ns: 1 }.encoded_len();
        assert!(bytes < 1_024, "{bytes} bytes");
        assert!(a.encoded_len() > 100 * bytes, "full {} bytes", a.encoded_len());
    }

    #[test]
    fn applying_the_diff_gives_the_next_snapshot_and_pool() {
        let a = snap(1, vec![ep(1, 0.0), ep(2, 1.0), ep(3, 2.0), ep(300, 0.0)]);
        let mut b = snap(2, vec![ep(2, 5.0), ep(3, 2.0), ep(4, 0.0), ep(300, 0.0)]);
        b.objectives.insert("batch".into(), -1);
        b.saturation = Some(0.5);
        let d = diff(&a, &b).expect("same epoch");
        assert_eq!(d.removed, vec![1]);
        assert_eq!(d.upserts.iter().map(|e| e.id).collect::<Vec<_>>(), vec![2, 4]);
        let mut s = a.clone();
        apply(&mut s, &d).expect("follows");
        assert_eq!(s, b);
        let mut pool = to_pool(&a);
        let applied = apply_pool(&mut pool, 9, &d).expect("follows");
        assert!(applied.reshaped);
        assert_eq!(pool, to_pool(&b));
    }

    #[test]
    fn a_delta_that_does_not_follow_changes_nothing() {
        let a = snap(1, vec![ep(1, 0.0)]);
        let b = snap(2, vec![ep(1, 1.0)]);
        let c = snap(3, vec![ep(1, 2.0)]);
        let d = diff(&b, &c).expect("same epoch");
        let mut s = a.clone();
        assert!(matches!(apply(&mut s, &d), Err(DeltaError::Gap { base: 2, have: 1, .. })));
        assert_eq!(s, a);
        let mut pool = to_pool(&a);
        assert!(apply_pool(&mut pool, 9, &d).is_err());
        assert!(apply_pool(&mut to_pool(&b), 8, &d).is_err(), "another epoch");
        assert_eq!(pool, to_pool(&a));
        let other = v1::Snapshot { host_epoch: 10, ..b.clone() };
        assert_eq!(diff(&a, &other), None);
    }

    #[test]
    fn updates_in_place_keep_the_preselection_lookups_current() {
        let a = snap(1, (0..300).map(|i| ep(i, 5.0)).collect());
        let mut pool = to_pool(&a);
        let before = pool.index().least_loaded("m", 1);
        let mut b = a.clone();
        b.version = 2;
        let idle = b.endpoints.iter().position(|e| e.id == 250).unwrap_or(0);
        b.endpoints[idle].waiting = 0.0;
        let d = diff(&a, &b).expect("same epoch");
        let applied = apply_pool(&mut pool, 9, &d).expect("follows");
        assert_eq!(applied.updated, vec![idle]);
        assert_ne!(before, vec![idle]);
        assert_eq!(pool.index().least_loaded("m", 1), vec![idle]);
    }
}
