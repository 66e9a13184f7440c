//! The approximate prefix index: which endpoints were sent which prefix blocks.
//!
//! It is learned from the scheduler's own decisions (llm-d's approximate mode), so it reflects
//! routing, not engine state. Memory is bounded: an LRU over block hashes, each holding the
//! small set of endpoints it was routed to.

use std::num::NonZeroUsize;

use hashbrown::HashMap;
use lru::LruCache;

/// Index from block hash to the endpoints (by address) that were sent that block.
pub struct ApproxPrefixIndex {
    blocks: LruCache<u64, Vec<u32>>,
    ids: HashMap<String, u32>,
    names: Vec<String>,
}

/// More endpoints than this in the interner and it is reset (with the index): a bound, not a
/// limit any real pool reaches.
const MAX_INTERNED: usize = 1 << 16;
/// Endpoints remembered per block.
const MAX_ENDPOINTS_PER_BLOCK: usize = 8;

impl ApproxPrefixIndex {
    pub fn new(capacity: usize) -> Self {
        let cap = NonZeroUsize::new(capacity.max(1)).unwrap_or(NonZeroUsize::MIN);
        Self { blocks: LruCache::new(cap), ids: HashMap::new(), names: Vec::new() }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    fn intern(&mut self, address: &str) -> u32 {
        if let Some(id) = self.ids.get(address) {
            return *id;
        }
        if self.names.len() >= MAX_INTERNED {
            self.blocks.clear();
            self.ids.clear();
            self.names.clear();
        }
        let id = self.names.len() as u32;
        self.names.push(address.to_owned());
        self.ids.insert(address.to_owned(), id);
        id
    }

    /// Record that the blocks `hashes` were routed to `address`.
    pub fn record(&mut self, hashes: &[u64], address: &str) {
        let id = self.intern(address);
        for h in hashes {
            match self.blocks.get_mut(h) {
                Some(set) => {
                    if !set.contains(&id) {
                        if set.len() >= MAX_ENDPOINTS_PER_BLOCK {
                            set.remove(0);
                        }
                        set.push(id);
                    }
                }
                None => {
                    self.blocks.put(*h, vec![id]);
                }
            }
        }
    }

    /// For each endpoint address, the number of leading blocks of `hashes` it holds
    /// consecutively from the start. Stops as soon as no endpoint continues the run.
    pub fn match_lengths(&mut self, hashes: &[u64]) -> HashMap<String, usize> {
        let mut run: HashMap<u32, usize> = HashMap::new();
        for (i, h) in hashes.iter().enumerate() {
            let Some(set) = self.blocks.get(h) else { break };
            let mut any = false;
            for id in set {
                if i == 0 {
                    run.insert(*id, 1);
                    any = true;
                } else if let Some(n) = run.get_mut(id) {
                    if *n == i {
                        *n += 1;
                        any = true;
                    }
                }
            }
            if !any {
                break;
            }
        }
        run.into_iter().filter_map(|(id, n)| self.names.get(id as usize).map(|a| (a.clone(), n))).collect()
    }

    /// Forget an endpoint (it left the pool).
    pub fn forget(&mut self, address: &str) {
        if let Some(id) = self.ids.get(address).copied() {
            for (_, set) in self.blocks.iter_mut() {
                set.retain(|x| *x != id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_prefix_per_endpoint() {
        let mut ix = ApproxPrefixIndex::new(100);
        ix.record(&[1, 2, 3], "a:1");
        ix.record(&[1, 2], "b:1");
        ix.record(&[9, 3], "c:1"); // holds block 3 but not 1,2: no leading run
        let m = ix.match_lengths(&[1, 2, 3, 4]);
        assert_eq!(m.get("a:1"), Some(&3));
        assert_eq!(m.get("b:1"), Some(&2));
        assert_eq!(m.get("c:1"), None);
        assert!(ix.match_lengths(&[7, 1]).is_empty());
    }

    #[test]
    fn bounded_by_lru() {
        let mut ix = ApproxPrefixIndex::new(10);
        for i in 0..100u64 {
            ix.record(&[i], "a:1");
        }
        assert_eq!(ix.len(), 10);
        assert!(ix.match_lengths(&[0]).is_empty());
        assert_eq!(ix.match_lengths(&[99]).get("a:1"), Some(&1));
        ix.forget("a:1");
        assert!(ix.match_lengths(&[99]).is_empty());
    }
}

/// A bounded table shared by every Envoy worker (shared data in the filter): slot → (block
/// hash, endpoint). It lets a worker learn where *another* worker sent a prefix. Writes
/// overwrite colliding slots, so its size never exceeds `slots` entries.
pub trait AffinityStore {
    fn load(&mut self, slot: u64) -> Option<(u64, String)>;
    fn store(&mut self, slot: u64, hash: u64, endpoint: &str);
}

/// Block positions recorded in and probed from the shared table: 0, 1, 3, 7, 15, … and the
/// last block. A hit at position `i` proves the endpoint was sent the first `i + 1` blocks.
pub fn probe_points(n_blocks: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut i = 1usize;
    while i <= n_blocks {
        v.push(i - 1);
        i = i.saturating_mul(2);
    }
    if n_blocks > 0 && v.last() != Some(&(n_blocks - 1)) {
        v.push(n_blocks - 1);
    }
    v
}

fn slot_of(hash: u64, slots: u64) -> u64 {
    hash % slots.max(1)
}

/// Record a decision in the shared table.
pub fn shared_record(store: &mut dyn AffinityStore, slots: u64, hashes: &[u64], endpoint: &str) {
    for i in probe_points(hashes.len()) {
        if let Some(h) = hashes.get(i) {
            store.store(slot_of(*h, slots), *h, endpoint);
        }
    }
}

/// Endpoints the shared table says hold a prefix of `hashes`, with the number of leading
/// blocks proven: the deepest probe point that still matches, per endpoint.
pub fn shared_matches(store: &mut dyn AffinityStore, slots: u64, hashes: &[u64]) -> HashMap<String, usize> {
    let mut out: HashMap<String, usize> = HashMap::new();
    for i in probe_points(hashes.len()) {
        let Some(h) = hashes.get(i) else { break };
        match store.load(slot_of(*h, slots)) {
            Some((stored, ep)) if stored == *h => {
                let e = out.entry(ep).or_insert(0);
                *e = (*e).max(i + 1);
            }
            // Deeper blocks of a chain cannot match if this one does not.
            _ => break,
        }
    }
    out
}

#[cfg(test)]
mod shared_tests {
    use super::*;

    #[derive(Default)]
    struct Mem(std::collections::HashMap<u64, (u64, String)>);
    impl AffinityStore for Mem {
        fn load(&mut self, slot: u64) -> Option<(u64, String)> {
            self.0.get(&slot).cloned()
        }
        fn store(&mut self, slot: u64, hash: u64, endpoint: &str) {
            self.0.insert(slot, (hash, endpoint.to_owned()));
        }
    }

    #[test]
    fn probe_points_are_logarithmic_and_end_at_the_last_block() {
        assert_eq!(probe_points(0), Vec::<usize>::new());
        assert_eq!(probe_points(1), vec![0]);
        assert_eq!(probe_points(10), vec![0, 1, 3, 7, 9]);
        assert_eq!(probe_points(16), vec![0, 1, 3, 7, 15]);
    }

    #[test]
    fn another_worker_learns_the_prefix_and_the_table_stays_bounded() {
        let mut m = Mem::default();
        let a: Vec<u64> = (100..120).collect();
        shared_record(&mut m, 64, &a, "e1:1");
        let mut b = a[..10].to_vec();
        b.extend([7, 8, 9]);
        assert_eq!(shared_matches(&mut m, 64, &b).get("e1:1"), Some(&8), "probe 7 matches, probe 12 does not");
        assert!(shared_matches(&mut m, 64, &[5, 6]).is_empty());
        for i in 0..10_000u64 {
            shared_record(&mut m, 64, &[i], "e2:1");
        }
        assert!(m.0.len() <= 64);
    }
}
