//! The KV block pool, modelled on vLLM's `BlockPool`: a fixed number of blocks; a free queue in
//! LRU order that also holds cached-but-unreferenced blocks (still hit-able until reused); a
//! map from block hash to cached block.

use std::num::NonZeroUsize;

use hashbrown::HashMap;
use lru::LruCache;

pub type BlockId = u32;

#[derive(Debug, Clone, Default)]
struct Block {
    hash: Option<u64>,
    refs: u32,
}

/// Events the pool reports, published as vLLM KV events.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Newly cached full blocks of one request: a contiguous run of the chain.
    Stored { hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, block_size: u32 },
    /// Cached blocks evicted for reuse.
    Removed(Vec<u64>),
    /// The prefix cache was reset.
    Cleared,
}

pub struct BlockPool {
    blocks: Vec<Block>,
    /// Free blocks (refs == 0), least recently freed first.
    free: LruCache<BlockId, ()>,
    cached: HashMap<u64, BlockId>,
    pub events: Vec<KvEvent>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        let n = num_blocks.max(1);
        let mut free = LruCache::new(NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN));
        for i in 0..n as BlockId {
            free.put(i, ());
        }
        Self { blocks: vec![Block::default(); n], free, cached: HashMap::new(), events: Vec::new() }
    }

    pub fn capacity(&self) -> usize {
        self.blocks.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// vLLM's `kv_cache_usage_perc`: share of blocks referenced by running requests.
    pub fn usage(&self) -> f64 {
        1.0 - self.free.len() as f64 / self.blocks.len() as f64
    }

    /// How many leading hashes are cached.
    pub fn longest_cached(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.cached.contains_key(*h)).count()
    }

    /// Take a reference on the cached blocks of `hashes` (all must be cached).
    pub fn acquire_cached(&mut self, hashes: &[u64]) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(hashes.len());
        for h in hashes {
            if let Some(&id) = self.cached.get(h) {
                let b = &mut self.blocks[id as usize];
                if b.refs == 0 {
                    self.free.pop(&id);
                }
                b.refs += 1;
                out.push(id);
            }
        }
        out
    }

    /// Allocate `n` fresh blocks, evicting least-recently-freed cached blocks. `None` if there
    /// are not enough free blocks (nothing is allocated then).
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if self.free.len() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        let mut removed = Vec::new();
        for _ in 0..n {
            let (id, ()) = self.free.pop_lru()?;
            let b = &mut self.blocks[id as usize];
            if let Some(h) = b.hash.take() {
                self.cached.remove(&h);
                removed.push(h);
            }
            b.refs = 1;
            out.push(id);
        }
        if !removed.is_empty() {
            self.events.push(KvEvent::Removed(removed));
        }
        Some(out)
    }

    /// Mark `id` as holding the full block `hash` (it becomes hit-able). If another block
    /// already caches that hash, this one stays uncached (as vLLM does for duplicates).
    pub fn store(&mut self, id: BlockId, hash: u64) -> bool {
        if self.cached.contains_key(&hash) {
            return false;
        }
        if let Some(b) = self.blocks.get_mut(id as usize) {
            b.hash = Some(hash);
            self.cached.insert(hash, id);
            return true;
        }
        false
    }

    /// Release a request's blocks. They are freed tail first, so a chain's tail is evicted
    /// before its head.
    pub fn release(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            if let Some(b) = self.blocks.get_mut(id as usize) {
                b.refs = b.refs.saturating_sub(1);
                if b.refs == 0 {
                    self.free.put(id, ());
                }
            }
        }
    }

    /// Drop every cached hash (AllBlocksCleared).
    pub fn clear_cache(&mut self) {
        for b in &mut self.blocks {
            if b.refs == 0 {
                b.hash = None;
            }
        }
        self.cached.retain(|_, id| self.blocks[*id as usize].hash.is_some());
        self.events.push(KvEvent::Cleared);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_blocks_survive_release_until_reused_lru() {
        let mut p = BlockPool::new(4);
        let a = p.allocate(2).unwrap();
        p.store(a[0], 100);
        p.store(a[1], 101);
        assert_eq!(p.usage(), 0.5);
        p.release(&a);
        assert_eq!(p.usage(), 0.0);
        assert_eq!(p.longest_cached(&[100, 101, 102]), 2);
        // Two never-used blocks are older in the free queue than a; they go first.
        let b = p.allocate(2).unwrap();
        assert_eq!(p.longest_cached(&[100, 101]), 2);
        // Next allocation evicts the tail (101) first, as vLLM frees chains tail first.
        let c = p.allocate(1).unwrap();
        assert_eq!(p.longest_cached(&[100, 101]), 1);
        assert_eq!(p.events, vec![KvEvent::Removed(vec![101])]);
        let hit = p.acquire_cached(&[100]);
        assert_eq!(hit.len(), 1);
        assert!(p.allocate(1).is_none(), "all 4 blocks referenced");
        p.release(&b);
        p.release(&c);
        p.release(&hit);
        assert_eq!(p.num_free(), 4);
    }
}
