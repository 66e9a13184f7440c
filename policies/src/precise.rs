//! Precise prefix matching: how much of a request's prefix each endpoint actually holds, from
//! the index of engine KV events, weighted by the tier each block sits in.

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

// Tier bits, as the host's index stores them.
pub use attache_kv::tier::{CPU, DISK, GPU, OTHER};

/// How much a block is worth by where it is: reloading from CPU or disk is cheaper than
/// recomputing, but not free.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierWeights {
    pub gpu: f64,
    pub cpu: f64,
    pub disk: f64,
}

impl Default for TierWeights {
    fn default() -> Self {
        Self { gpu: 1.0, cpu: 0.8, disk: 0.5 }
    }
}

impl TierWeights {
    /// Weight of the best tier in `mask` (0 if none).
    pub fn best(&self, mask: u8) -> f64 {
        if mask & GPU != 0 {
            self.gpu
        } else if mask & CPU != 0 {
            self.cpu
        } else if mask & DISK != 0 {
            self.disk
        } else if mask & OTHER != 0 {
            // A tier the host does not know: worth no more than the cheapest known one.
            self.gpu.min(self.cpu).min(self.disk)
        } else {
            0.0
        }
    }
}

/// One endpoint's match.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PreciseMatch {
    /// Leading blocks held consecutively from the first.
    pub blocks: usize,
    /// Sum of the tier weights of those blocks.
    pub weighted: f64,
}

/// For each endpoint, the longest run of `keys` it holds from the start, and its weight.
/// `holders(key)` lists (endpoint id, tier mask) for a key. Stops as soon as no endpoint
/// continues its run, so a miss costs one lookup, and a lazy `keys` hashes no further block.
pub fn match_prefix(
    keys: impl IntoIterator<Item = u64>,
    weights: &TierWeights,
    mut holders: impl FnMut(u64) -> Vec<(u16, u8)>,
) -> HashMap<u16, PreciseMatch> {
    let mut out: HashMap<u16, PreciseMatch> = HashMap::new();
    for (i, k) in keys.into_iter().enumerate() {
        let mut any = false;
        for (ep, mask) in holders(k) {
            let w = weights.best(mask);
            if w <= 0.0 {
                continue;
            }
            let m = out.entry(ep).or_default();
            if m.blocks == i {
                m.blocks += 1;
                m.weighted += w;
                any = true;
            }
        }
        if !any {
            break;
        }
    }
    out.retain(|_, m| m.blocks > 0);
    out
}

/// The precise prefix score of a match: weighted matched blocks over the request's blocks.
pub fn score(m: Option<&PreciseMatch>, total_blocks: usize) -> f64 {
    match m {
        Some(m) if total_blocks > 0 => (m.weighted / total_blocks as f64).clamp(0.0, 1.0),
        _ => 0.0,
    }
}

/// Precise scores for every endpoint with a known block size: `keys_for(block_size)` gives the
/// request's block count at that size and its block keys, which are matched against the index
/// and scored. The keys are taken one at a time, so a lazy iterator stops hashing at the first
/// block no endpoint holds. Returns endpoint id → (score, matched blocks).
pub fn scores<K: IntoIterator<Item = u64>>(
    pool: &crate::PoolState,
    weights: &TierWeights,
    mut keys_for: impl FnMut(usize) -> (usize, K),
    mut holders: impl FnMut(u64) -> Vec<(u16, u8)>,
) -> HashMap<u32, (f64, usize)> {
    let mut out = HashMap::new();
    for bs in pool.block_sizes() {
        let (total, keys) = keys_for(bs as usize);
        if total == 0 {
            continue;
        }
        // Only the holders are visited, not the pool: a lookup each on large pools.
        for (id, pm) in match_prefix(keys, weights, &mut holders) {
            let id = u32::from(id);
            if pool.by_id(id).is_some_and(|e| e.block_size == bs) {
                out.insert(id, (score(Some(&pm), total), pm.blocks));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Endpoint, PoolState};

    /// Endpoint `i` has id `i`; sizes cycle through `sizes` (0: unknown).
    fn pool(n: usize, sizes: &[u32]) -> PoolState {
        let endpoints = (0..n)
            .map(|i| Endpoint {
                id: i as u32,
                block_size: sizes[i % sizes.len()],
                ..Endpoint::idle(format!("10.0.{}.{}:8000", i / 256, i % 256), "m")
            })
            .collect();
        PoolState { endpoints, ..Default::default() }
    }

    #[test]
    fn scores_key_each_block_size_and_visit_only_holders() {
        // Ids 0..4 hold the 16-token keys [16, 17]; ids 1 and 2 hold the 32-token key [32].
        let holders = |k: u64| match k {
            16 | 17 => vec![(0, GPU), (1, GPU), (2, GPU), (3, GPU)],
            32 => vec![(1, GPU), (2, CPU)],
            _ => vec![],
        };
        let keys = |bs: usize| (2, if bs == 16 { vec![16, 17] } else { vec![32, 33] });
        for n in [8, 1_000] {
            let mut p = pool(n, &[16, 32, 0]);
            assert_eq!(p.block_sizes(), vec![16, 32], "{n} endpoints");
            let s = scores(&p, &TierWeights::default(), keys, holders);
            // 0 and 3 have 16-token blocks (both keys); 1 has 32 (one of two); 2 is unknown.
            assert_eq!(s.get(&0), Some(&(1.0, 2)), "{n}: {s:?}");
            assert_eq!(s.get(&3), Some(&(1.0, 2)));
            assert_eq!(s.get(&1), Some(&(0.5, 1)));
            assert!(!s.contains_key(&2), "no known block size: not scored");
            // An engine restarted with another block size, changed in place by a delta.
            p.endpoints[2].block_size = 64;
            p.index_updated(&[2]);
            assert_eq!(p.block_sizes(), vec![16, 32, 64], "{n} endpoints, after the delta");
            assert_eq!(p.by_id(2).map(|e| e.block_size), Some(64));
        }
    }

    #[test]
    fn longest_consecutive_run_weighted_by_tier() {
        let table: std::collections::HashMap<u64, Vec<(u16, u8)>> =
            [(1, vec![(0, GPU), (1, CPU)]), (2, vec![(0, GPU), (1, CPU), (2, GPU)]), (3, vec![(1, CPU | GPU)])]
                .into_iter()
                .collect();
        let m = match_prefix([1, 2, 3, 4], &TierWeights::default(), |k| table.get(&k).cloned().unwrap_or_default());
        assert_eq!(m[&0], PreciseMatch { blocks: 2, weighted: 2.0 });
        assert_eq!(m[&1].blocks, 3);
        assert!((m[&1].weighted - (0.8 + 0.8 + 1.0)).abs() < 1e-9);
        assert!(!m.contains_key(&2), "endpoint 2 lacks block 1");
        assert!((score(m.get(&1), 4) - 0.65).abs() < 1e-9);
        assert_eq!(score(None, 4), 0.0);
    }

    /// Keys are pulled one at a time: past the first block no endpoint holds, no further key
    /// is hashed, and the score still counts every block of the request.
    #[test]
    fn matching_stops_hashing_at_the_first_block_nobody_holds() {
        let tokens: Vec<u32> = (0..16 * 100).collect();
        let seed = attache_kv::block_key::chain_seed("m", None);
        let all = attache_kv::block_key::token_block_keys(seed, &tokens, 16);
        let held: std::collections::HashSet<u64> = all.iter().take(3).copied().collect();
        let hashed = std::cell::Cell::new(0usize);
        let keys =
            attache_kv::block_key::token_block_key_iter(seed, &tokens, 16).inspect(|_| hashed.set(hashed.get() + 1));
        let m =
            match_prefix(keys, &TierWeights::default(), |k| if held.contains(&k) { vec![(7, GPU)] } else { vec![] });
        assert_eq!(m[&7].blocks, 3);
        assert_eq!(hashed.get(), 4, "three held blocks and the first miss, of 100");
        let p = pool(8, &[16]);
        let s = scores(
            &p,
            &TierWeights::default(),
            |bs| (tokens.len() / bs, attache_kv::block_key::token_block_key_iter(seed, &tokens, bs)),
            |k| if held.contains(&k) { vec![(7, GPU)] } else { vec![] },
        );
        assert_eq!(s.get(&7), Some(&(0.03, 3)), "3 of 100 blocks");
    }

    #[test]
    fn an_unknown_tier_weighs_least() {
        let w = TierWeights::default();
        assert_eq!(w.best(OTHER), w.disk, "below every known tier by default");
        let odd = TierWeights { gpu: 1.0, cpu: 0.3, disk: 0.6 };
        assert_eq!(odd.best(OTHER), 0.3, "the least of the configured weights");
        assert_eq!(w.best(OTHER | CPU), w.cpu, "a known tier wins");
    }
}
