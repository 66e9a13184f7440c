//! Block keys: the xxhash64 chain over blocks of a prompt, seeded by model and cache salt.
//!
//! `h0 = xxh64(model ‖ cache_salt)`; `h_i = xxh64(LE64(xxh64(block_i)) ‖ LE64(h_{i-1}))`. The
//! host computes precise keys from the `token_ids` of each `BlockStored` event and the filter
//! from the prompt it tokenizes, so both sides agree whatever hash the engine itself uses
//! (llm-d's dual-key design). The approximate prefix hasher (`attache_policies::prefix`)
//! chains its pseudo-token blocks with the same [`chain`].

use xxhash_rust::xxh64::{xxh64, Xxh64};

/// The seed of a request's hash chain: model and cache salt.
pub fn chain_seed(model: &str, cache_salt: Option<&str>) -> u64 {
    // The hash of the concatenation, streamed: no buffer to allocate per chain.
    let mut h = Xxh64::new(0);
    h.update(model.as_bytes());
    h.update(cache_salt.unwrap_or("").as_bytes());
    h.digest()
}

/// One link of the chain: the key of `block` (its bytes) after the block keyed `prev`.
#[inline]
pub fn chain(prev: u64, block: &[u8]) -> u64 {
    link(prev, xxh64(block, 0))
}

/// The same link from the block's own hash (`xxh64(block)`), for a caller that hashed the
/// block streamed.
#[inline]
pub fn link(prev: u64, block_hash: u64) -> u64 {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&block_hash.to_le_bytes());
    b[8..].copy_from_slice(&prev.to_le_bytes());
    xxh64(&b, 0)
}

/// Precise block keys: the chain over token ids (little-endian u32), but only over *full*
/// blocks of the engine's block size, continuing from `parent` (the previous block's key, or
/// [`chain_seed`] at the start).
pub fn token_block_keys(parent: u64, tokens: &[u32], block_size: usize) -> Vec<u64> {
    token_block_key_iter(parent, tokens, block_size).collect()
}

/// [`token_block_keys`] one key at a time: a caller that stops early hashes no further.
pub fn token_block_key_iter(parent: u64, tokens: &[u32], block_size: usize) -> impl Iterator<Item = u64> + '_ {
    let bs = block_size.max(1);
    let mut prev = parent;
    let mut buf = Vec::with_capacity(bs * 4);
    tokens.chunks_exact(bs).map(move |block| {
        buf.clear();
        for id in block {
            buf.extend_from_slice(&id.to_le_bytes());
        }
        prev = chain(prev, &buf);
        prev
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_block_keys_continue_a_chain_and_skip_partial_blocks() {
        let seed = chain_seed("m", None);
        let toks: Vec<u32> = (0..10).collect();
        let all = token_block_keys(seed, &toks, 4);
        assert_eq!(all.len(), 2, "the partial third block is not hashed");
        let tail = token_block_keys(all[0], &toks[4..], 4);
        assert_eq!(tail, all[1..]);
    }

    #[test]
    fn salt_changes_the_seed() {
        assert_ne!(chain_seed("m", None), chain_seed("m", Some("s")));
        assert_eq!(chain_seed("ms", None), chain_seed("m", Some("s")), "model and salt are concatenated");
        assert_eq!(chain_seed("model", Some("salt")), xxh64(b"modelsalt", 0));
    }
}
