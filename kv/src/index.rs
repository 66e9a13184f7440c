//! The precise prefix index: block key → the endpoints that hold the block, and in which tier.
//!
//! Keys are Attaché's own ([`crate::block_key::token_block_keys`]), recomputed from the
//! `token_ids` of each `BlockStored`, so the index works whatever hash the engine uses. Per
//! endpoint, an engine-hash → key map resolves parents and removals (llm-d's dual keys).
//!
//! Memory is bounded and allocated up front from `capacity`: two open-addressing tables at most
//! 80% full, one of 24-byte block slots (key, up to four holders inline, flags) and one of
//! 24-byte engine-hash entries, so about 60 bytes per (block, endpoint) entry; holders beyond
//! four per block go to a small overflow map. A full table evicts about 1% of the blocks with
//! CLOCK (a second-chance approximation of LRU: a lookup or store sets a block's reference bit,
//! the hand evicts blocks whose bit is clear). Every change is also queued as a [`Delta`] for
//! the filters, so pushing an update costs what changed, not the index size.

use hashbrown::HashMap;

use crate::block_key;
use crate::events::{EventRef, KvEvent, Tokens};
use crate::open_table::{Entry, OpenTable};

pub use crate::tier::{CPU, DISK, GPU, OTHER};

/// A change for the filters: after it, `endpoint` holds `key` in the tiers of `tiers`
/// (0 = not at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delta {
    pub key: u64,
    pub endpoint: u16,
    pub tiers: u8,
}

const INLINE: usize = 4;
const REFERENCED: u8 = 1;
const OVERFLOW: u8 = 2;

/// One block: 24 bytes.
#[derive(Clone, Copy, Default)]
struct Slot {
    key: u64,
    eps: [u16; INLINE],
    tiers: [u8; INLINE],
    len: u8,
    flags: u8,
}

impl Entry for Slot {
    fn key(&self) -> u64 {
        self.key
    }
}

/// Engine hash of one holder → our key: 24 bytes.
#[derive(Clone, Copy, Default)]
struct EngineEntry {
    /// (endpoint, engine hash) mixed into one non-zero key.
    key: u64,
    our_key: u64,
    endpoint: u16,
}

impl Entry for EngineEntry {
    fn key(&self) -> u64 {
        self.key
    }
}

/// The key 0 marks empty slots; map it elsewhere.
fn nz(k: u64) -> u64 {
    if k == 0 {
        0x9E37_79B9_7F4A_7C15
    } else {
        k
    }
}

/// (endpoint, engine hash) → table key. Bijective in the hash for a fixed endpoint; two
/// endpoints collide only with probability ~2^-64 per pair of blocks.
fn engine_key(endpoint: u16, hash: u64) -> u64 {
    nz(hash ^ (u64::from(endpoint) + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93))
}

/// Counters about what the index has seen.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct IndexStats {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub evicted_blocks: u64,
    /// `BlockStored` whose parent hash was unknown for that endpoint (missed events).
    pub orphan_events: u64,
    /// `BlockStored` whose token count did not match its block count.
    pub malformed_events: u64,
}

pub struct KvIndex {
    blocks: OpenTable<Slot>,
    engines: OpenTable<EngineEntry>,
    overflow: HashMap<u64, Vec<(u16, u8)>>,
    hand: usize,
    deltas: Vec<Delta>,
    /// Incremented each time deltas are taken.
    delta_seq: u64,
    /// Oldest engine timestamp (µs) behind the pending deltas, 0 if none.
    pending_event_us: u64,
    /// Reused per event, so applying one allocates nothing once warm.
    scratch: Scratch,
    pub stats: IndexStats,
}

/// The most the per-event buffers keep between events.
const SCRATCH_KEEP_BYTES: usize = 1 << 20;

#[derive(Default)]
struct Scratch {
    keys: Vec<u64>,
    hashes: Vec<u64>,
    block: Vec<u8>,
}

impl KvIndex {
    /// An index of at most `capacity` blocks and `capacity` (block, endpoint) entries. Both
    /// tables are allocated up front: about 60 bytes per entry of capacity.
    pub fn new(capacity: usize) -> Self {
        Self {
            blocks: OpenTable::with_capacity(capacity),
            engines: OpenTable::with_capacity(capacity),
            overflow: HashMap::new(),
            hand: 0,
            deltas: Vec::new(),
            delta_seq: 0,
            pending_event_us: 0,
            scratch: Scratch::default(),
            stats: IndexStats::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// (block, endpoint) pairs held.
    pub fn entries(&self) -> usize {
        self.blocks.occupied_from(0).map(|i| usize::from(self.blocks.get(i).len)).sum::<usize>()
            + self.overflow.values().map(Vec::len).sum::<usize>()
    }

    /// Take the changes made since the last call, and the sequence number they bring a
    /// subscriber to.
    /// Note the engine timestamp of the batch just applied: the oldest one behind the pending
    /// deltas is sent with them, for the propagation figure.
    pub fn note_event_time(&mut self, unix_us: u64) {
        if self.has_deltas() && unix_us > 0 && (self.pending_event_us == 0 || unix_us < self.pending_event_us) {
            self.pending_event_us = unix_us;
        }
    }

    /// The oldest event time behind the deltas taken last (0 if unknown); resets it.
    pub fn take_event_time(&mut self) -> u64 {
        std::mem::take(&mut self.pending_event_us)
    }

    pub fn take_deltas(&mut self) -> Vec<Delta> {
        self.delta_seq += 1;
        // The next batch of changes is likely as large as this one: one allocation, not a
        // doubling series (bounded, so one burst does not keep its memory).
        let cap = self.deltas.len().min(1024);
        std::mem::replace(&mut self.deltas, Vec::with_capacity(cap))
    }

    pub fn has_deltas(&self) -> bool {
        !self.deltas.is_empty()
    }

    /// The sequence of the last [`take_deltas`](Self::take_deltas).
    pub fn delta_seq(&self) -> u64 {
        self.delta_seq
    }

    /// Every entry, as deltas (a full resend), with the sequence it corresponds to. Changes not
    /// yet taken are included, so a subscriber must skip live deltas with seq <= the one
    /// returned, and may see a few changes twice (applying a delta is idempotent).
    pub fn dump(&self) -> (Vec<Delta>, u64) {
        let mut out = Vec::with_capacity(self.blocks.len());
        for i in self.blocks.occupied_from(0) {
            let s = self.blocks.get(i);
            for j in 0..usize::from(s.len) {
                out.push(Delta { key: s.key, endpoint: s.eps[j], tiers: s.tiers[j] });
            }
            if s.flags & OVERFLOW != 0 {
                for (ep, t) in self.overflow.get(&s.key).into_iter().flatten() {
                    out.push(Delta { key: s.key, endpoint: *ep, tiers: *t });
                }
            }
        }
        (out, self.delta_seq)
    }

    /// Evict about 1% of the blocks (CLOCK: a block whose reference bit is set gets a second
    /// chance), then drop engine-map entries that no longer point at a held block.
    fn make_room(&mut self) {
        let want = self.blocks.len() / 100 + 1;
        let n = self.blocks.slot_count();
        let mut evicted = 0;
        let mut visited = 0;
        while evicted < want && visited < 2 * n && !self.blocks.is_empty() {
            let i = self.hand % n;
            self.hand = i + 1;
            visited += 1;
            let s = *self.blocks.get(i);
            if s.key == 0 {
                continue;
            }
            if s.flags & REFERENCED != 0 {
                self.blocks.get_mut(i).flags &= !REFERENCED;
                continue;
            }
            self.drop_block_at(i);
            self.stats.evicted_blocks += 1;
            evicted += 1;
            // Backward-shift deletion may have moved an unvisited slot into i.
            self.hand = i;
        }
        self.sweep_engine_map();
    }

    fn drop_block_at(&mut self, i: usize) {
        let s = *self.blocks.get(i);
        for j in 0..usize::from(s.len) {
            self.deltas.push(Delta { key: s.key, endpoint: s.eps[j], tiers: 0 });
        }
        if s.flags & OVERFLOW != 0 {
            for (ep, _) in self.overflow.remove(&s.key).unwrap_or_default() {
                self.deltas.push(Delta { key: s.key, endpoint: ep, tiers: 0 });
            }
        }
        self.blocks.remove_at(i);
    }

    /// Remove engine-map entries whose block is gone or no longer held by that endpoint.
    fn sweep_engine_map(&mut self) {
        let stale: Vec<u64> = self
            .engines
            .occupied_from(0)
            .filter(|&i| {
                let e = self.engines.get(i);
                self.holder_tiers(e.our_key, e.endpoint) == 0
            })
            .map(|i| self.engines.get(i).key)
            .collect();
        for k in stale {
            if let Some(i) = self.engines.find(k) {
                self.engines.remove_at(i);
            }
        }
    }

    fn holder_tiers(&self, key: u64, endpoint: u16) -> u8 {
        let Some(i) = self.blocks.find(nz(key)) else { return 0 };
        let s = self.blocks.get(i);
        if let Some(j) = s.eps[..usize::from(s.len)].iter().position(|e| *e == endpoint) {
            return s.tiers[j];
        }
        self.overflow.get(&nz(key)).and_then(|v| v.iter().find(|h| h.0 == endpoint)).map(|h| h.1).unwrap_or(0)
    }

    /// Set `endpoint`'s tier mask for `key` (0 removes it), queueing a delta on change.
    fn set(&mut self, key: u64, endpoint: u16, tiers: u8) {
        self.update(key, endpoint, |_| tiers);
    }

    /// Change `endpoint`'s tier mask for `key` to `f(old)` with one probe of the block table,
    /// queueing a delta on change. Returns (old, new).
    fn update(&mut self, key: u64, endpoint: u16, f: impl FnOnce(u8) -> u8) -> (u8, u8) {
        let key = nz(key);
        let probe = self.blocks.probe(key);
        let found = probe.ok();
        let (old, pos) = match found {
            None => (0, None),
            Some(i) => {
                let s = self.blocks.get(i);
                match s.eps[..usize::from(s.len)].iter().position(|e| *e == endpoint) {
                    Some(j) => (s.tiers[j], Some(Ok(j))),
                    None if s.flags & OVERFLOW != 0 => {
                        let o = self.overflow.get(&key).and_then(|v| v.iter().position(|h| h.0 == endpoint));
                        match o {
                            Some(j) => (self.overflow.get(&key).map_or(0, |v| v[j].1), Some(Err(j))),
                            None => (0, None),
                        }
                    }
                    None => (0, None),
                }
            }
        };
        let tiers = f(old);
        if let Some(i) = found.filter(|_| old != 0 || tiers != 0) {
            // A stale removal (this endpoint no longer held it) is no use of the block.
            self.blocks.get_mut(i).flags |= REFERENCED;
        }
        if old == tiers {
            return (old, tiers);
        }
        let i = match found {
            Some(i) => i,
            None => {
                let slot = Slot { key, flags: REFERENCED, ..Slot::default() };
                let at = match probe {
                    Err(i) if !self.blocks.is_full() => self.blocks.insert_at(i, slot),
                    _ => {
                        self.make_room();
                        self.blocks.insert(slot)
                    }
                };
                match at {
                    Some(i) => i,
                    None => return (old, old),
                }
            }
        };
        let s = self.blocks.get_mut(i);
        let n = usize::from(s.len);
        match pos {
            Some(Ok(j)) if tiers == 0 => {
                s.eps.copy_within(j + 1..n, j);
                s.tiers.copy_within(j + 1..n, j);
                s.len -= 1;
            }
            Some(Ok(j)) => s.tiers[j] = tiers,
            Some(Err(j)) => {
                let v = self.overflow.entry(key).or_default();
                if tiers == 0 {
                    v.swap_remove(j);
                } else {
                    v[j].1 = tiers;
                }
            }
            None if n < INLINE => {
                s.eps[n] = endpoint;
                s.tiers[n] = tiers;
                s.len += 1;
            }
            None => {
                s.flags |= OVERFLOW;
                self.overflow.entry(key).or_default().push((endpoint, tiers));
            }
        }
        self.deltas.push(Delta { key, endpoint, tiers });
        if tiers == 0 {
            let s = *self.blocks.get(i);
            if s.len == 0 && self.overflow.get(&key).is_none_or(Vec::is_empty) {
                self.overflow.remove(&key);
                self.blocks.remove_at(i);
            }
        }
        (old, tiers)
    }

    /// Tier mask of `endpoint` for `key` (0 if not held). Marks the block as recently used.
    pub fn tiers(&mut self, key: u64, endpoint: u16) -> u8 {
        if let Some(i) = self.blocks.find(nz(key)) {
            self.blocks.get_mut(i).flags |= REFERENCED;
        }
        self.holder_tiers(key, endpoint)
    }

    /// Every (endpoint, tiers) holding `key`.
    pub fn holders(&self, key: u64) -> Vec<(u16, u8)> {
        let key = nz(key);
        let Some(i) = self.blocks.find(key) else { return Vec::new() };
        let s = self.blocks.get(i);
        let mut v: Vec<(u16, u8)> = (0..usize::from(s.len)).map(|j| (s.eps[j], s.tiers[j])).collect();
        if let Some(o) = self.overflow.get(&key) {
            v.extend_from_slice(o);
        }
        v
    }

    fn resolve(&mut self, endpoint: u16, engine_hash: u64) -> Option<u64> {
        let i = self.engines.find(engine_key(endpoint, engine_hash))?;
        let e = *self.engines.get(i);
        if self.holder_tiers(e.our_key, endpoint) == 0 {
            self.engines.remove_at(i); // stale: the block was evicted
            return None;
        }
        Some(e.our_key)
    }

    fn remember(&mut self, endpoint: u16, engine_hash: u64, our_key: u64) {
        let k = engine_key(endpoint, engine_hash);
        let entry = EngineEntry { key: k, our_key, endpoint };
        match self.engines.probe(k) {
            Ok(i) => self.engines.get_mut(i).our_key = our_key,
            Err(i) if !self.engines.is_full() => {
                let _ = self.engines.insert_at(i, entry);
            }
            Err(_) => {
                self.make_room();
                let _ = self.engines.insert(entry);
            }
        }
    }

    /// Forget everything `endpoint` holds (engine restart, AllBlocksCleared, endpoint gone).
    pub fn clear_endpoint(&mut self, endpoint: u16) {
        let mine: Vec<(u64, u64)> = self
            .engines
            .occupied_from(0)
            .map(|i| *self.engines.get(i))
            .filter(|e| e.endpoint == endpoint)
            .map(|e| (e.key, e.our_key))
            .collect();
        for (k, our) in mine {
            if let Some(i) = self.engines.find(k) {
                self.engines.remove_at(i);
            }
            self.set(our, endpoint, 0);
        }
    }

    /// Apply one decoded event from `endpoint`. `model` seeds chains that start at block 0
    /// (the event's `lora_name` replaces it when present, as vLLM keys LoRA blocks by name).
    pub fn apply(&mut self, endpoint: u16, model: &str, event: &KvEvent) {
        self.apply_ref(endpoint, model, event.as_ref());
    }

    /// [`apply`](Self::apply) for an event read in place ([`crate::events::BatchRef`]).
    ///
    /// Each block costs one probe of the block table and one of the engine-hash table. Both
    /// tables are far larger than the CPU's caches, so a probe is a cache miss: the keys of
    /// the whole event are computed first and every home slot is touched before any is used,
    /// so the misses overlap instead of queueing one behind the other.
    pub fn apply_ref(&mut self, endpoint: u16, model: &str, event: EventRef<'_>) {
        let mut scratch = std::mem::take(&mut self.scratch);
        match event {
            EventRef::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, lora_name, medium } => {
                let bs = block_size as usize;
                if bs == 0 || token_ids.len() != block_hashes.len() * bs {
                    self.stats.malformed_events += 1;
                } else if let Some(parent) = match parent_block_hash {
                    None => Some(block_key::chain_seed(lora_name.unwrap_or(model), None)),
                    Some(h) => self.resolve(endpoint, h),
                } {
                    block_keys(parent, token_ids, bs, &mut scratch);
                    scratch.hashes.clear();
                    scratch.hashes.extend(block_hashes.iter());
                    self.touch(&scratch.keys, &scratch.hashes, endpoint);
                    let bit = medium.bit();
                    for (eh, key) in scratch.hashes.iter().zip(&scratch.keys) {
                        self.update(*key, endpoint, |t| t | bit);
                        self.remember(endpoint, *eh, nz(*key));
                        self.stats.stored_blocks += 1;
                    }
                } else {
                    self.stats.orphan_events += 1;
                }
            }
            EventRef::BlockRemoved { block_hashes, medium } => {
                // Two rounds of overlapped misses: the engine-hash slots, which give the block
                // keys, then the block slots.
                scratch.hashes.clear();
                scratch.hashes.extend(block_hashes.iter());
                self.touch(&[], &scratch.hashes, endpoint);
                scratch.keys.clear();
                for eh in &scratch.hashes {
                    let key = self.engines.find(engine_key(endpoint, *eh)).map_or(0, |i| self.engines.get(i).our_key);
                    scratch.keys.push(key);
                }
                self.touch(&scratch.keys, &[], endpoint);
                let bit = medium.bit();
                for (eh, key) in scratch.hashes.iter().zip(&scratch.keys) {
                    if *key == 0 {
                        continue; // not known for this endpoint
                    }
                    let (old, new) = self.update(*key, endpoint, |t| t & !bit);
                    if old == 0 || new == 0 {
                        // Stale (the block was evicted) or no longer held in any tier.
                        if let Some(ei) = self.engines.find(engine_key(endpoint, *eh)) {
                            self.engines.remove_at(ei);
                        }
                    }
                    if old != 0 {
                        self.stats.removed_blocks += 1;
                    }
                }
            }
            EventRef::AllBlocksCleared => self.clear_endpoint(endpoint),
        }
        // Kept for the next event, unless one huge event grew it.
        if scratch.block.capacity() + 8 * (scratch.keys.capacity() + scratch.hashes.capacity()) <= SCRATCH_KEEP_BYTES {
            self.scratch = scratch;
        }
    }

    /// Load the home slot of every key, and of every (endpoint, engine hash), without using
    /// what was loaded: independent loads, so the CPU keeps their cache misses in flight
    /// together.
    fn touch(&self, keys: &[u64], engine_hashes: &[u64], endpoint: u16) {
        let mut acc = 0u64;
        // A 24-byte slot may straddle two cache lines: load its first and last bytes.
        for k in keys {
            let s = self.blocks.home(nz(*k));
            acc ^= s.key ^ u64::from(s.flags);
        }
        for h in engine_hashes {
            let e = self.engines.home(engine_key(endpoint, *h));
            acc ^= e.key ^ u64::from(e.endpoint);
        }
        std::hint::black_box(acc);
    }

    /// Heap bytes of the tables (allocated up front from the capacity) and the overflow map.
    pub fn heap_bytes(&self) -> usize {
        self.blocks.heap_bytes()
            + self.engines.heap_bytes()
            + self.overflow.values().map(|v| v.capacity() * 3 + 48).sum::<usize>()
    }
}

/// The keys of the full blocks of `tokens` after `parent`, into `scratch.keys`.
fn block_keys(parent: u64, tokens: Tokens<'_>, bs: usize, scratch: &mut Scratch) {
    scratch.keys.clear();
    scratch.block.clear();
    tokens.write_le(&mut scratch.block);
    let mut prev = parent;
    for block in scratch.block.chunks_exact(bs * 4) {
        prev = block_key::chain(prev, block);
        scratch.keys.push(prev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::Medium;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u32>, medium: Medium) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.collect(),
            block_size: 4,
            lora_name: None,
            medium,
        }
    }

    fn keys(tokens: std::ops::Range<u32>) -> Vec<u64> {
        block_key::token_block_keys(block_key::chain_seed("m", None), &tokens.collect::<Vec<_>>(), 4)
    }

    #[test]
    fn deltas_carry_the_oldest_event_time_behind_them() {
        let mut ix = KvIndex::new(1000);
        ix.note_event_time(5); // nothing pending: ignored
        ix.apply(1, "m", &stored(&[1], None, 0..4, Medium::Gpu));
        ix.note_event_time(300);
        ix.apply(1, "m", &stored(&[2], Some(1), 4..8, Medium::Gpu));
        ix.note_event_time(200);
        ix.note_event_time(400);
        let _ = ix.take_deltas();
        assert_eq!(ix.take_event_time(), 200);
        assert_eq!(ix.take_event_time(), 0, "reset once taken");
    }

    #[test]
    fn keys_are_recomputed_from_tokens_whatever_the_engine_hash() {
        let mut ix = KvIndex::new(100);
        // Two engines with unrelated hash settings store the same tokens.
        ix.apply(1, "m", &stored(&[111, 222], None, 0..8, Medium::Gpu));
        ix.apply(2, "m", &stored(&[9, 8], None, 0..8, Medium::Gpu));
        // A continuation whose parent is the engine's own hash 222.
        ix.apply(1, "m", &stored(&[333], Some(222), 8..12, Medium::Gpu));
        let k = keys(0..12);
        assert_eq!(ix.holders(k[0]).len(), 2);
        assert_eq!(ix.tiers(k[2], 1), GPU);
        assert_eq!(ix.tiers(k[2], 2), 0);
        // Unknown parent: counted, not indexed.
        ix.apply(2, "m", &stored(&[7], Some(999), 8..12, Medium::Gpu));
        assert_eq!(ix.stats.orphan_events, 1);
    }

    #[test]
    fn tiers_removal_clear_and_deltas() {
        let mut ix = KvIndex::new(100);
        let k = keys(0..4)[0];
        ix.apply(1, "m", &stored(&[5], None, 0..4, Medium::Gpu));
        ix.apply(1, "m", &stored(&[5], None, 0..4, Medium::Cpu)); // offloaded copy
        assert_eq!(ix.tiers(k, 1), GPU | CPU);
        ix.apply(1, "m", &KvEvent::BlockRemoved { block_hashes: vec![5], medium: Medium::Gpu });
        assert_eq!(ix.tiers(k, 1), CPU, "evicted from GPU, still in the CPU tier");
        assert_eq!(
            ix.take_deltas(),
            vec![
                Delta { key: k, endpoint: 1, tiers: GPU },
                Delta { key: k, endpoint: 1, tiers: GPU | CPU },
                Delta { key: k, endpoint: 1, tiers: CPU },
            ]
        );
        ix.apply(1, "m", &KvEvent::AllBlocksCleared);
        assert_eq!(ix.tiers(k, 1), 0);
        assert!(ix.is_empty());
        assert_eq!(ix.take_deltas(), vec![Delta { key: k, endpoint: 1, tiers: 0 }]);
    }

    #[test]
    fn many_holders_overflow_and_the_bound_holds() {
        let mut ix = KvIndex::new(50);
        let k = keys(0..4)[0];
        for ep in 0..7u16 {
            ix.apply(ep, "m", &stored(&[u64::from(ep) + 1], None, 0..4, Medium::Gpu));
        }
        assert_eq!(ix.holders(k).len(), 7);
        assert_eq!(ix.entries(), 7);
        for i in 0..1000u32 {
            ix.apply(9, "m", &stored(&[u64::from(i) + 100], None, i * 4 + 1000..i * 4 + 1004, Medium::Gpu));
        }
        assert!(ix.len() <= 50);
        assert!(ix.stats.evicted_blocks >= 950);
        // Removing a block held by an evicted key is harmless.
        ix.apply(9, "m", &KvEvent::BlockRemoved { block_hashes: vec![100], medium: Medium::Gpu });
    }

    #[test]
    fn malformed_store_is_counted() {
        let mut ix = KvIndex::new(10);
        ix.apply(1, "m", &stored(&[1, 2], None, 0..5, Medium::Gpu));
        assert_eq!(ix.stats.malformed_events, 1);
        assert!(ix.is_empty());
    }
}
