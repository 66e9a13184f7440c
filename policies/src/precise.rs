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
/// continues its run, so a miss costs one lookup.
pub fn match_prefix(
    keys: &[u64],
    weights: &TierWeights,
    mut holders: impl FnMut(u64) -> Vec<(u16, u8)>,
) -> HashMap<u16, PreciseMatch> {
    let mut out: HashMap<u16, PreciseMatch> = HashMap::new();
    for (i, k) in keys.iter().enumerate() {
        let mut any = false;
        for (ep, mask) in holders(*k) {
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

/// Precise scores for every endpoint with a known block size: the request's token ids are
/// cut into that size's block keys (`keys_for(block_size)`), matched against the index, and
/// scored. Returns endpoint id → (score, matched blocks).
pub fn scores(
    endpoints: &[crate::Endpoint],
    weights: &TierWeights,
    mut keys_for: impl FnMut(usize) -> Vec<u64>,
    mut holders: impl FnMut(u64) -> Vec<(u16, u8)>,
) -> HashMap<u32, (f64, usize)> {
    let mut sizes: Vec<u32> = endpoints.iter().map(|e| e.block_size).filter(|b| *b > 0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut out = HashMap::new();
    for bs in sizes {
        let keys = keys_for(bs as usize);
        if keys.is_empty() {
            continue;
        }
        let m = match_prefix(&keys, weights, &mut holders);
        for e in endpoints.iter().filter(|e| e.block_size == bs) {
            if let Some(pm) = u16::try_from(e.id).ok().and_then(|id| m.get(&id)) {
                out.insert(e.id, (score(Some(pm), keys.len()), pm.blocks));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_consecutive_run_weighted_by_tier() {
        let table: std::collections::HashMap<u64, Vec<(u16, u8)>> =
            [(1, vec![(0, GPU), (1, CPU)]), (2, vec![(0, GPU), (1, CPU), (2, GPU)]), (3, vec![(1, CPU | GPU)])]
                .into_iter()
                .collect();
        let m = match_prefix(&[1, 2, 3, 4], &TierWeights::default(), |k| table.get(&k).cloned().unwrap_or_default());
        assert_eq!(m[&0], PreciseMatch { blocks: 2, weighted: 2.0 });
        assert_eq!(m[&1].blocks, 3);
        assert!((m[&1].weighted - (0.8 + 0.8 + 1.0)).abs() < 1e-9);
        assert!(!m.contains_key(&2), "endpoint 2 lacks block 1");
        assert!((score(m.get(&1), 4) - 0.65).abs() < 1e-9);
        assert_eq!(score(None, 4), 0.0);
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
