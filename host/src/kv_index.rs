//! The precise prefix index: block key → the endpoints that hold the block, and in which tier.
//!
//! Keys are Attaché's own ([`attache_policies::prefix::token_block_keys`]), recomputed from the
//! `token_ids` of each `BlockStored`, so the index works whatever hash the engine uses. Per
//! endpoint, an engine-hash → key map resolves parents and removals (llm-d's dual keys).
//!
//! Memory is bounded: at most `capacity` blocks. A full index evicts with CLOCK (a
//! second-chance approximation of LRU: a lookup or store sets a block's reference bit, and the
//! hand evicts the first block whose bit is clear). Layout per block: a 24-byte slot (key, up
//! to four holders inline, flags) and a hash-map entry of key → slot; holders beyond four go to
//! an overflow map. Every change is also queued as a [`Delta`] for the filters, so pushing an
//! update costs what changed, not the index size.

use attache_policies::prefix;
use hashbrown::HashMap;

use crate::kv_events::{KvEvent, Medium};

pub use attache_policies::precise::{CPU, DISK, GPU};

pub fn tier_bit(m: Medium) -> u8 {
    match m {
        Medium::Gpu => GPU,
        Medium::Cpu => CPU,
        Medium::Disk => DISK,
    }
}

/// A change for the filters: after it, `endpoint` holds `key` in the tiers of `tiers`
/// (0 = not at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delta {
    pub key: u64,
    pub endpoint: u16,
    pub tiers: u8,
}

const INLINE: usize = 4;

#[derive(Clone, Copy, Default)]
struct Slot {
    key: u64,
    /// (endpoint, tier mask); `len` of them are used.
    holders: [(u16, u8); INLINE],
    len: u8,
    referenced: bool,
    overflow: bool,
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

#[derive(Default)]
struct EngineMap {
    /// Engine's block hash → our key.
    keys: HashMap<u64, u64>,
}

pub struct KvIndex {
    slots: Vec<Slot>,
    by_key: HashMap<u64, u32>,
    overflow: HashMap<u64, Vec<(u16, u8)>>,
    free: Vec<u32>,
    hand: usize,
    capacity: usize,
    engines: HashMap<u16, EngineMap>,
    deltas: Vec<Delta>,
    pub stats: IndexStats,
}

impl KvIndex {
    pub fn new(capacity: usize) -> Self {
        Self {
            slots: Vec::new(),
            by_key: HashMap::new(),
            overflow: HashMap::new(),
            free: Vec::new(),
            hand: 0,
            capacity: capacity.max(1),
            engines: HashMap::new(),
            deltas: Vec::new(),
            stats: IndexStats::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// (block, endpoint) pairs held.
    pub fn entries(&self) -> usize {
        self.slots.iter().filter(|s| s.len > 0).map(|s| usize::from(s.len)).sum::<usize>()
            + self.overflow.values().map(Vec::len).sum::<usize>()
    }

    /// Take the changes made since the last call.
    pub fn take_deltas(&mut self) -> Vec<Delta> {
        std::mem::take(&mut self.deltas)
    }

    fn slot_for(&mut self, key: u64) -> u32 {
        if let Some(&i) = self.by_key.get(&key) {
            return i;
        }
        if self.by_key.len() >= self.capacity {
            self.evict_one();
        }
        let slot = Slot { key, referenced: true, ..Slot::default() };
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.by_key.insert(key, i);
        i
    }

    fn evict_one(&mut self) {
        let n = self.slots.len();
        for _ in 0..2 * n + 1 {
            let i = self.hand % n.max(1);
            self.hand = i + 1;
            let s = &mut self.slots[i];
            if s.len == 0 && !s.overflow {
                continue; // free slot
            }
            if s.referenced {
                s.referenced = false;
                continue;
            }
            let key = s.key;
            self.drop_block(key);
            self.stats.evicted_blocks += 1;
            return;
        }
    }

    fn drop_block(&mut self, key: u64) {
        let Some(i) = self.by_key.remove(&key) else { return };
        let s = self.slots[i as usize];
        for &(ep, _) in &s.holders[..usize::from(s.len)] {
            self.deltas.push(Delta { key, endpoint: ep, tiers: 0 });
        }
        if s.overflow {
            for (ep, _) in self.overflow.remove(&key).unwrap_or_default() {
                self.deltas.push(Delta { key, endpoint: ep, tiers: 0 });
            }
        }
        self.slots[i as usize] = Slot::default();
        self.free.push(i);
    }

    /// Set `endpoint`'s tier mask for `key` (0 removes it), queueing a delta on change.
    fn set(&mut self, key: u64, endpoint: u16, tiers: u8) {
        if tiers == 0 && !self.by_key.contains_key(&key) {
            return;
        }
        let i = self.slot_for(key) as usize;
        let s = &mut self.slots[i];
        s.referenced = true;
        let n = usize::from(s.len);
        let changed = if let Some(pos) = s.holders[..n].iter().position(|h| h.0 == endpoint) {
            let old = s.holders[pos].1;
            if tiers == 0 {
                s.holders.copy_within(pos + 1..n, pos);
                s.len -= 1;
            } else {
                s.holders[pos].1 = tiers;
            }
            old != tiers
        } else if s.overflow && self.overflow.get(&key).is_some_and(|v| v.iter().any(|h| h.0 == endpoint)) {
            let v = self.overflow.entry(key).or_default();
            let pos = v.iter().position(|h| h.0 == endpoint).unwrap_or(0);
            let old = v[pos].1;
            if tiers == 0 {
                v.swap_remove(pos);
            } else {
                v[pos].1 = tiers;
            }
            old != tiers
        } else if tiers == 0 {
            false
        } else if n < INLINE {
            s.holders[n] = (endpoint, tiers);
            s.len += 1;
            true
        } else {
            s.overflow = true;
            self.overflow.entry(key).or_default().push((endpoint, tiers));
            true
        };
        if changed {
            self.deltas.push(Delta { key, endpoint, tiers });
        }
        let s = self.slots[i];
        let empty_overflow = !s.overflow || self.overflow.get(&key).is_none_or(Vec::is_empty);
        if s.len == 0 && empty_overflow {
            self.overflow.remove(&key);
            self.by_key.remove(&key);
            self.slots[i] = Slot::default();
            self.free.push(i as u32);
        }
    }

    /// Tier mask of `endpoint` for `key` (0 if not held). Marks the block as recently used.
    pub fn tiers(&mut self, key: u64, endpoint: u16) -> u8 {
        let Some(&i) = self.by_key.get(&key) else { return 0 };
        let s = &mut self.slots[i as usize];
        s.referenced = true;
        if let Some(h) = s.holders[..usize::from(s.len)].iter().find(|h| h.0 == endpoint) {
            return h.1;
        }
        self.overflow.get(&key).and_then(|v| v.iter().find(|h| h.0 == endpoint)).map(|h| h.1).unwrap_or(0)
    }

    /// Every (endpoint, tiers) holding `key`.
    pub fn holders(&self, key: u64) -> Vec<(u16, u8)> {
        let Some(&i) = self.by_key.get(&key) else { return Vec::new() };
        let s = &self.slots[i as usize];
        let mut v = s.holders[..usize::from(s.len)].to_vec();
        if let Some(o) = self.overflow.get(&key) {
            v.extend_from_slice(o);
        }
        v
    }

    /// Forget everything `endpoint` holds (engine restart, AllBlocksCleared, endpoint gone).
    pub fn clear_endpoint(&mut self, endpoint: u16) {
        if let Some(em) = self.engines.remove(&endpoint) {
            for key in em.keys.into_values() {
                self.set(key, endpoint, 0);
            }
        }
    }

    /// Apply one decoded event from `endpoint`. `model` seeds chains that start at block 0
    /// (the event's `lora_name` replaces it when present, as vLLM keys LoRA blocks by name).
    pub fn apply(&mut self, endpoint: u16, model: &str, event: &KvEvent) {
        match event {
            KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, lora_name, medium } => {
                let bs = *block_size as usize;
                if bs == 0 || token_ids.len() != block_hashes.len() * bs {
                    self.stats.malformed_events += 1;
                    return;
                }
                let parent = match parent_block_hash {
                    None => prefix::chain_seed(lora_name.as_deref().unwrap_or(model), None),
                    Some(h) => match self.engines.get(&endpoint).and_then(|e| e.keys.get(h)) {
                        Some(k) => *k,
                        None => {
                            self.stats.orphan_events += 1;
                            return;
                        }
                    },
                };
                let keys = prefix::token_block_keys(parent, token_ids, bs);
                let bit = tier_bit(*medium);
                for (eh, key) in block_hashes.iter().zip(keys) {
                    self.engines.entry(endpoint).or_default().keys.insert(*eh, key);
                    let t = self.tiers(key, endpoint) | bit;
                    self.set(key, endpoint, t);
                    self.stats.stored_blocks += 1;
                }
            }
            KvEvent::BlockRemoved { block_hashes, medium } => {
                let bit = tier_bit(*medium);
                for eh in block_hashes {
                    let Some(key) = self.engines.get(&endpoint).and_then(|e| e.keys.get(eh)).copied() else { continue };
                    let t = self.tiers(key, endpoint) & !bit;
                    self.set(key, endpoint, t);
                    if t == 0 {
                        if let Some(e) = self.engines.get_mut(&endpoint) {
                            e.keys.remove(eh);
                        }
                    }
                    self.stats.removed_blocks += 1;
                }
            }
            KvEvent::AllBlocksCleared => self.clear_endpoint(endpoint),
        }
    }

    /// Approximate heap bytes used (from capacities): for the bytes-per-entry figure.
    pub fn heap_bytes(&self) -> usize {
        let map = |cap: usize, entry: usize| cap * (entry + 1);
        self.slots.capacity() * std::mem::size_of::<Slot>()
            + map(self.by_key.capacity(), 12)
            + self.free.capacity() * 4
            + self.overflow.values().map(|v| v.capacity() * 3 + 32).sum::<usize>()
            + self.engines.values().map(|e| map(e.keys.capacity(), 16)).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        prefix::token_block_keys(prefix::chain_seed("m", None), &tokens.collect::<Vec<_>>(), 4)
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
