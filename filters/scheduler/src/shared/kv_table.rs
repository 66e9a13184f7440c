//! The precise index in shared data, so every Envoy worker sees what the host's index says.
//!
//! A fixed number of slots (`precise.slots`), key `attache.kv.<slot>`, slot = block key modulo
//! slots. Each holds a bucket: the epoch it was written in (u32), then entries
//! `[key u64][n u8][(endpoint u16, tiers u8) × n]`, little-endian. The root context that holds
//! the snapshot stream applies `IndexDelta`s with compare-and-swap writes (in per-worker mode
//! several roots apply the same idempotent deltas). A full resend bumps `attache.kv.epoch`:
//! buckets from older epochs read as empty, so a reset costs one write. Memory is bounded by
//! the slot count and the host's bounded index; an update costs what changed.

use attache_proto::v1::IndexDelta;
use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::types::Status;

const EPOCH_KEY: &str = "attache.kv.epoch";

/// A decoded bucket.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Bucket {
    pub entries: Vec<(u64, Vec<(u16, u8)>)>,
}

/// Decode a bucket; `None` if it is from another epoch or malformed (both read as empty).
pub fn decode(bytes: &[u8], epoch: u32) -> Option<Bucket> {
    let (e, mut rest) = bytes.split_first_chunk::<4>()?;
    if u32::from_le_bytes(*e) != epoch {
        return None;
    }
    let mut b = Bucket::default();
    while !rest.is_empty() {
        let (k, r) = rest.split_first_chunk::<8>()?;
        let (n, mut r) = r.split_first()?;
        let mut holders = Vec::with_capacity(usize::from(*n));
        for _ in 0..*n {
            let (h, r2) = r.split_first_chunk::<3>()?;
            holders.push((u16::from_le_bytes([h[0], h[1]]), h[2]));
            r = r2;
        }
        b.entries.push((u64::from_le_bytes(*k), holders));
        rest = r;
    }
    Some(b)
}

pub fn encode(b: &Bucket, epoch: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + b.entries.len() * 12);
    out.extend_from_slice(&epoch.to_le_bytes());
    for (k, hs) in &b.entries {
        out.extend_from_slice(&k.to_le_bytes());
        out.push(hs.len().min(255) as u8);
        for (ep, t) in hs.iter().take(255) {
            out.extend_from_slice(&ep.to_le_bytes());
            out.push(*t);
        }
    }
    out
}

/// Set `endpoint`'s tiers for `key` (0 removes it).
pub fn set(b: &mut Bucket, key: u64, endpoint: u16, tiers: u8) {
    let pos = b.entries.iter().position(|(k, _)| *k == key);
    match (pos, tiers) {
        (None, 0) => {}
        (None, t) => b.entries.push((key, vec![(endpoint, t)])),
        (Some(i), t) => {
            let hs = &mut b.entries[i].1;
            match (hs.iter().position(|h| h.0 == endpoint), t) {
                (Some(j), 0) => {
                    hs.swap_remove(j);
                }
                (Some(j), t) => hs[j].1 = t,
                (None, 0) => {}
                (None, t) => hs.push((endpoint, t)),
            }
            if hs.is_empty() {
                b.entries.swap_remove(i);
            }
        }
    }
}

fn slot_key(key: u64, slots: u64) -> String {
    format!("attache.kv.{}", key % slots.max(1))
}

/// The current epoch (0 before the first resend).
pub fn epoch() -> u32 {
    hostcalls::get_shared_data(EPOCH_KEY)
        .ok()
        .and_then(|(v, _)| v)
        .and_then(|v| v.get(..4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes))
        .unwrap_or(0)
}

/// Apply one `IndexDelta` from the host. Returns the number of slot writes.
pub fn apply(d: &IndexDelta, slots: u64) -> usize {
    let mut ep = epoch();
    if d.reset {
        ep = ep.wrapping_add(1);
        let _ = hostcalls::set_shared_data(EPOCH_KEY, Some(&ep.to_le_bytes()), None);
    }
    let mut by_slot: HashMap<u64, Vec<(u64, u16, u8)>> = HashMap::new();
    for ((k, e), t) in d.keys.iter().zip(&d.endpoints).zip(&d.tiers) {
        let (Ok(e), Ok(t)) = (u16::try_from(*e), u8::try_from(*t)) else { continue };
        by_slot.entry(k % slots.max(1)).or_default().push((*k, e, t));
    }
    let mut writes = 0;
    for (slot, changes) in by_slot {
        let name = format!("attache.kv.{slot}");
        // Compare-and-swap: several root contexts may write the same slot.
        for _attempt in 0..8 {
            let (cur, cas) = hostcalls::get_shared_data(&name).unwrap_or((None, None));
            let mut b = cur.as_deref().and_then(|c| decode(c, ep)).unwrap_or_default();
            for (k, e, t) in &changes {
                set(&mut b, *k, *e, *t);
            }
            match hostcalls::set_shared_data(&name, Some(&encode(&b, ep)), cas) {
                Ok(()) => {
                    writes += 1;
                    break;
                }
                Err(Status::CasMismatch) => continue,
                Err(_) => break,
            }
        }
    }
    writes
}

/// A worker's reader: one epoch read per request, then one slot read per block key.
pub struct Reader {
    epoch: u32,
    slots: u64,
}

impl attache_policies::plan::KvIndexView for Reader {
    fn holders(&self, key: u64) -> Vec<(u16, u8)> {
        Reader::holders(self, key)
    }
}

impl Reader {
    pub fn new(slots: u64) -> Self {
        Self { epoch: epoch(), slots }
    }

    pub fn holders(&self, key: u64) -> Vec<(u16, u8)> {
        let Ok((Some(v), _)) = hostcalls::get_shared_data(&slot_key(key, self.slots)) else { return Vec::new() };
        decode(&v, self.epoch)
            .and_then(|b| b.entries.into_iter().find(|(k, _)| *k == key).map(|(_, h)| h))
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_roundtrip_set_and_epochs() {
        let mut b = Bucket::default();
        set(&mut b, 7, 1, 1);
        set(&mut b, 7, 2, 2);
        set(&mut b, 9, 1, 3);
        set(&mut b, 7, 1, 0);
        let bytes = encode(&b, 5);
        let back = decode(&bytes, 5).unwrap();
        assert_eq!(back, b);
        assert_eq!(back.entries.iter().find(|e| e.0 == 7).unwrap().1, vec![(2, 2)]);
        assert!(decode(&bytes, 6).is_none(), "another epoch reads as empty");
        assert!(decode(&bytes[..bytes.len() - 1], 5).is_none(), "truncated reads as empty");
        set(&mut b, 9, 1, 0);
        set(&mut b, 7, 2, 0);
        assert!(b.entries.is_empty());
    }
}
