//! The KV block pool, modelled on vLLM's `BlockPool`: a fixed number of blocks; a free queue in
//! LRU order that also holds cached-but-unreferenced blocks (still hit-able until reused); a
//! map from block hash to cached block. An optional CPU-offload tier keeps blocks evicted from
//! the GPU pool (bounded, LRU) so a later request can reload them instead of recomputing.

use std::num::NonZeroUsize;

use hashbrown::HashMap;
use lru::LruCache;

pub type BlockId = u32;

/// Where a cached block lives (vLLM's event `medium`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    Gpu,
    Cpu,
}

impl Medium {
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
        }
    }
}

/// What a cached block is, enough to announce it again in another tier: its parent's id and
/// its tokens.
#[derive(Debug, Clone, Default, PartialEq)]
struct Content {
    parent: Option<u64>,
    tokens: Vec<u32>,
}

#[derive(Debug, Clone, Default)]
struct Block {
    hash: Option<u64>,
    refs: u32,
    content: Content,
}

/// Events the pool reports, published as vLLM KV events.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Newly cached full blocks of one request: a contiguous run of the chain.
    Stored { hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, block_size: u32, medium: Medium },
    /// Cached blocks dropped from a tier.
    Removed { hashes: Vec<u64>, medium: Medium },
    /// The prefix cache was reset.
    Cleared,
}

/// A prefix lookup: how many leading blocks are cached, and how many of those only on CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Hit {
    pub blocks: usize,
    pub from_cpu: usize,
}

pub struct BlockPool {
    blocks: Vec<Block>,
    /// Free blocks (refs == 0), least recently freed first.
    free: LruCache<BlockId, ()>,
    cached: HashMap<u64, BlockId>,
    /// CPU-offload tier: evicted GPU blocks, least recently used first (None = no offload).
    cpu: Option<LruCache<u64, Content>>,
    block_size: u32,
    pub events: Vec<KvEvent>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        Self::with_cpu_tier(num_blocks, 0, 16)
    }

    /// A pool of `num_blocks` GPU blocks plus a CPU tier of `cpu_blocks` (0 = none).
    pub fn with_cpu_tier(num_blocks: usize, cpu_blocks: usize, block_size: usize) -> Self {
        let n = num_blocks.max(1);
        let mut free = LruCache::new(NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN));
        for i in 0..n as BlockId {
            free.put(i, ());
        }
        Self {
            blocks: vec![Block::default(); n],
            free,
            cached: HashMap::new(),
            cpu: NonZeroUsize::new(cpu_blocks).map(LruCache::new),
            block_size: block_size as u32,
            events: Vec::new(),
        }
    }

    /// Blocks held in the CPU tier.
    pub fn cpu_len(&self) -> usize {
        self.cpu.as_ref().map_or(0, LruCache::len)
    }

    /// How many leading hashes are cached in either tier.
    pub fn lookup(&self, hashes: &[u64]) -> Hit {
        let mut hit = Hit::default();
        for h in hashes {
            if self.cached.contains_key(h) {
                hit.blocks += 1;
            } else if self.cpu.as_ref().is_some_and(|c| c.contains(h)) {
                hit.blocks += 1;
                hit.from_cpu += 1;
            } else {
                break;
            }
        }
        hit
    }

    /// Reference the leading cached blocks of `hashes` for a new request, reloading CPU-tier
    /// blocks into fresh GPU blocks. Returns the blocks, in chain order, and how many were
    /// reloaded; stops early if a block vanished or no GPU block is free for a reload.
    pub fn acquire_prefix(&mut self, hashes: &[u64]) -> (Vec<BlockId>, usize) {
        let mut out = Vec::with_capacity(hashes.len());
        let mut reloaded = 0;
        for &h in hashes {
            if self.cached.contains_key(&h) {
                out.extend(self.acquire_cached(&[h]));
                continue;
            }
            let Some(content) = self.cpu.as_mut().and_then(|c| c.get(&h).cloned()) else { break };
            let Some(fresh) = self.allocate(1) else { break };
            let Some(&id) = fresh.first() else { break };
            if self.store(id, h, content.parent, content.tokens.clone()) {
                self.events.push(KvEvent::Stored {
                    hashes: vec![h],
                    parent: content.parent,
                    tokens: content.tokens,
                    block_size: self.block_size,
                    medium: Medium::Gpu,
                });
            }
            out.push(id);
            reloaded += 1;
        }
        (out, reloaded)
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
        let mut cpu_dropped = Vec::new();
        for _ in 0..n {
            let (id, ()) = self.free.pop_lru()?;
            let b = &mut self.blocks[id as usize];
            let content = std::mem::take(&mut b.content);
            if let Some(h) = b.hash.take() {
                self.cached.remove(&h);
                removed.push(h);
                // Offload: the evicted block moves to the CPU tier (announced before the GPU
                // copy is removed, so a subscriber never loses the chain in between).
                if let Some(cpu) = self.cpu.as_mut() {
                    if !cpu.contains(&h) {
                        self.events.push(KvEvent::Stored {
                            hashes: vec![h],
                            parent: content.parent,
                            tokens: content.tokens.clone(),
                            block_size: self.block_size,
                            medium: Medium::Cpu,
                        });
                        if let Some((old, _)) = cpu.push(h, content) {
                            if old != h {
                                cpu_dropped.push(old);
                            }
                        }
                    }
                }
            }
            b.refs = 1;
            out.push(id);
        }
        if !removed.is_empty() {
            self.events.push(KvEvent::Removed { hashes: removed, medium: Medium::Gpu });
        }
        if !cpu_dropped.is_empty() {
            self.events.push(KvEvent::Removed { hashes: cpu_dropped, medium: Medium::Cpu });
        }
        Some(out)
    }

    /// Mark `id` as holding the full block `hash` (it becomes hit-able). If another block
    /// already caches that hash, this one stays uncached (as vLLM does for duplicates).
    pub fn store(&mut self, id: BlockId, hash: u64, parent: Option<u64>, tokens: Vec<u32>) -> bool {
        if self.cached.contains_key(&hash) {
            return false;
        }
        if let Some(b) = self.blocks.get_mut(id as usize) {
            b.hash = Some(hash);
            b.content = Content { parent, tokens };
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
        if let Some(cpu) = self.cpu.as_mut() {
            cpu.clear();
        }
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
        p.store(a[0], 100, None, vec![]);
        p.store(a[1], 101, Some(100), vec![]);
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
        assert_eq!(p.events, vec![KvEvent::Removed { hashes: vec![101], medium: Medium::Gpu }]);
        let hit = p.acquire_cached(&[100]);
        assert_eq!(hit.len(), 1);
        assert!(p.allocate(1).is_none(), "all 4 blocks referenced");
        p.release(&b);
        p.release(&c);
        p.release(&hit);
        assert_eq!(p.num_free(), 4);
    }

    #[test]
    fn evicted_blocks_move_to_the_cpu_tier_and_reload_from_it() {
        let mut p = BlockPool::with_cpu_tier(2, 2, 4);
        let a = p.allocate(2).unwrap();
        p.store(a[0], 100, None, vec![1, 2, 3, 4]);
        p.store(a[1], 101, Some(100), vec![5, 6, 7, 8]);
        p.release(&a);
        // Reusing both GPU blocks offloads the chain: CPU stores first, then the GPU removal.
        let b = p.allocate(2).unwrap();
        let stored_cpu = |h: u64, parent: Option<u64>, tokens: Vec<u32>| KvEvent::Stored {
            hashes: vec![h],
            parent,
            tokens,
            block_size: 4,
            medium: Medium::Cpu,
        };
        assert_eq!(
            p.events.drain(..).collect::<Vec<_>>(),
            vec![
                stored_cpu(101, Some(100), vec![5, 6, 7, 8]),
                stored_cpu(100, None, vec![1, 2, 3, 4]),
                KvEvent::Removed { hashes: vec![101, 100], medium: Medium::Gpu },
            ]
        );
        assert_eq!(p.lookup(&[100, 101, 102]), Hit { blocks: 2, from_cpu: 2 });
        assert_eq!(p.cpu_len(), 2);
        // No GPU block is free: a reload cannot happen.
        assert_eq!(p.acquire_prefix(&[100, 101]), (vec![], 0));
        p.release(&b);
        let (blocks, reloaded) = p.acquire_prefix(&[100, 101]);
        assert_eq!((blocks.len(), reloaded), (2, 2));
        assert_eq!(p.lookup(&[100, 101]), Hit { blocks: 2, from_cpu: 0 });
        assert!(p
            .events
            .iter()
            .any(|e| matches!(e, KvEvent::Stored { medium: Medium::Gpu, hashes, .. } if hashes == &vec![100])));
        // The CPU tier is bounded: a third offloaded block drops the least recently used one.
        p.release(&blocks);
        p.events.clear();
        let c = p.allocate(2).unwrap();
        p.store(c[0], 200, None, vec![9, 9, 9, 9]);
        p.release(&c);
        let _ = p.allocate(2).unwrap();
        assert_eq!(p.cpu_len(), 2);
        assert!(p.events.iter().any(|e| matches!(e, KvEvent::Removed { medium: Medium::Cpu, .. })), "{:?}", p.events);
    }
}
