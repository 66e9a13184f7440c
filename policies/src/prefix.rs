//! Approximate prefix block hashing, as llm-d's `estimate` token producer and
//! `approx-prefix-cache-producer` do it (`reference/llmd.md` §3.1).
//!
//! * Text is packed into pseudo-tokens of `bytes_per_token` bytes (4 by default, zero-padded),
//!   token ids are packed as little-endian u32.
//! * Blocks hold `block_size_tokens` tokens. The last partial block is hashed too.
//! * `h0 = xxh64(model ‖ cache_salt)`; `h_i = xxh64(LE64(xxh64(block_i)) ‖ LE64(h_{i-1}))`.
//! * Hashing stops after `max_prefix_tokens` tokens (0 = unlimited).

use attache_kv::block_key::{chain, link};
// The precise block-key rules live in attache-kv; callers that hash prompts find them here too.
pub use attache_kv::block_key::{chain_seed, token_block_key_iter, token_block_keys};
use xxhash_rust::xxh64::Xxh64;

use crate::config::PrefixConfig;
use crate::request::Prompt;

/// Zero bytes that pad a prompt's last pseudo-token.
const ZEROS: [u8; 64] = [0; 64];

/// Block hashes of `prompt`, at most `max_prefix_tokens / block_size_tokens` (rounded up).
pub fn block_hashes(cfg: &PrefixConfig, model: &str, cache_salt: Option<&str>, prompt: &Prompt) -> Vec<u64> {
    let block_tokens = cfg.block_size_tokens.max(1);
    let mut prev = chain_seed(model, cache_salt);
    match prompt {
        Prompt::Text(text) => {
            let bpt = cfg.bytes_per_token.max(1);
            let mut bytes = text.as_bytes();
            if cfg.max_prefix_tokens > 0 {
                let cap = cfg.max_prefix_tokens.saturating_mul(bpt);
                bytes = bytes.get(..cap.min(bytes.len())).unwrap_or(bytes);
            }
            let block_bytes = block_tokens.saturating_mul(bpt);
            let mut out = Vec::with_capacity(bytes.len().div_ceil(block_bytes));
            for block in bytes.chunks(block_bytes) {
                let rem = block.len() % bpt;
                let h = if rem == 0 {
                    chain(prev, block)
                } else {
                    // Zero-pad the last pseudo-token, as llm-d's estimate tokenizer does:
                    // hashed streamed, with no padded copy.
                    let mut x = Xxh64::new(0);
                    x.update(block);
                    let mut left = bpt - rem;
                    while left > 0 {
                        let n = left.min(ZEROS.len());
                        x.update(ZEROS.get(..n).unwrap_or_default());
                        left -= n;
                    }
                    link(prev, x.digest())
                };
                out.push(h);
                prev = h;
            }
            out
        }
        Prompt::Tokens(ids) => {
            let mut ids = ids.as_slice();
            if cfg.max_prefix_tokens > 0 {
                ids = ids.get(..cfg.max_prefix_tokens.min(ids.len())).unwrap_or(ids);
            }
            let mut out = Vec::with_capacity(ids.len().div_ceil(block_tokens));
            let mut buf = Vec::with_capacity(block_tokens * 4);
            for block in ids.chunks(block_tokens) {
                buf.clear();
                for id in block {
                    buf.extend_from_slice(&id.to_le_bytes());
                }
                let h = chain(prev, &buf);
                out.push(h);
                prev = h;
            }
            out
        }
    }
}

/// The approximate index's anchors for a text prompt: for each message boundary (byte offsets
/// in the text, from [`crate::request::InferenceRequest::message_ends`]), the last block that
/// lies wholly before it. Requests that share messages share those blocks, so recording them
/// keeps a match exact at message granularity where the index samples long prompts.
pub fn anchor_blocks(cfg: &PrefixConfig, message_ends: &[usize]) -> Vec<usize> {
    let block_bytes = cfg.block_size_tokens.max(1).saturating_mul(cfg.bytes_per_token.max(1));
    let cap = if cfg.max_prefix_tokens > 0 {
        cfg.max_prefix_tokens.div_ceil(cfg.block_size_tokens.max(1))
    } else {
        usize::MAX
    };
    let mut out: Vec<usize> =
        message_ends.iter().filter_map(|&e| (e / block_bytes).checked_sub(1)).filter(|&b| b < cap).collect();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(block: usize, cap: usize) -> PrefixConfig {
        PrefixConfig {
            block_size_tokens: block,
            max_prefix_tokens: cap,
            bytes_per_token: 4,
            index_capacity: 1000,
            shared_slots: 0,
            shared_flush_ms: 20,
            affinity_threshold: 0.8,
            cache_share: 0.9,
            affinity_filter: crate::config::AffinityGate::default(),
        }
    }

    #[test]
    fn anchors_are_the_last_whole_block_before_each_message_end() {
        // 64-token blocks of 4 bytes: 256 bytes a block.
        let c = cfg(64, 0);
        assert_eq!(anchor_blocks(&c, &[100, 256, 700, 24_100]), vec![0, 1, 93]);
        // Hashing stops at max_prefix_tokens; so do anchors.
        assert_eq!(anchor_blocks(&cfg(64, 640), &[2_600, 24_100]), vec![9]);
        // The anchored block's hash is the same in two prompts that share the message.
        let system = "s".repeat(24_000);
        let a = block_hashes(&c, "m", None, &Prompt::Text(format!("{system}\nquestion one")));
        let b = block_hashes(&c, "m", None, &Prompt::Text(format!("{system}\nanother question")));
        let k = anchor_blocks(&c, &[24_001])[0];
        assert_eq!(a[k], b[k]);
        assert_ne!(a[k + 1], b[k + 1]);
    }

    #[test]
    fn precise_keys_are_the_approximate_chain_over_full_token_blocks() {
        let toks: Vec<u32> = (0..10).collect();
        let all = token_block_keys(chain_seed("m", None), &toks, 4);
        let cfg = cfg(4, 0);
        assert_eq!(block_hashes(&cfg, "m", None, &Prompt::Tokens(toks[..8].to_vec())), all);
    }

    #[test]
    fn shared_prefix_shares_leading_hashes() {
        let c = cfg(4, 0); // 16 bytes per block
        let a = block_hashes(&c, "m", None, &Prompt::Text("0123456789abcdef0123456789abcdefXXXX".into()));
        let b = block_hashes(&c, "m", None, &Prompt::Text("0123456789abcdef0123456789abcdefYYYY".into()));
        assert_eq!(a.len(), 3);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
    }

    #[test]
    fn model_and_salt_change_the_whole_chain() {
        let c = cfg(4, 0);
        let t = Prompt::Text("0123456789abcdef0123456789abcdef".into());
        let a = block_hashes(&c, "m", None, &t);
        let b = block_hashes(&c, "other", None, &t);
        let s = block_hashes(&c, "m", Some("salt"), &t);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert!(a.iter().zip(&s).all(|(x, y)| x != y));
    }

    #[test]
    fn cap_limits_blocks_and_tokens_hash_like_le_bytes() {
        let c = cfg(2, 4);
        let h = block_hashes(&c, "m", None, &Prompt::Text("a".repeat(1000)));
        assert_eq!(h.len(), 2);
        // Token ids packed little-endian hash exactly like the same bytes as text.
        let ids = vec![u32::from_le_bytes(*b"abcd"), u32::from_le_bytes(*b"efgh")];
        let c = cfg(2, 0);
        assert_eq!(
            block_hashes(&c, "m", None, &Prompt::Tokens(ids)),
            block_hashes(&c, "m", None, &Prompt::Text("abcdefgh".into()))
        );
        assert!(block_hashes(&c, "m", None, &Prompt::Text(String::new())).is_empty());
    }

    #[test]
    fn a_padded_last_token_hashes_as_its_zero_padded_copy() {
        // Streamed padding against the copy it replaces, for pseudo-tokens wider than the
        // zero buffer too.
        for bpt in [1, 3, 4, 7, 100] {
            let c = PrefixConfig { bytes_per_token: bpt, ..cfg(4, 0) };
            for len in [1, 5, 17, 63, 64, 65, 1_001] {
                let text: String = (0..len).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
                let got = block_hashes(&c, "m", None, &Prompt::Text(text.clone()));
                let block_bytes = 4 * bpt;
                let mut prev = chain_seed("m", None);
                let want: Vec<u64> = text
                    .as_bytes()
                    .chunks(block_bytes)
                    .map(|b| {
                        let mut padded = b.to_vec();
                        padded.resize(b.len().div_ceil(bpt) * bpt, 0);
                        prev = chain(prev, &padded);
                        prev
                    })
                    .collect();
                assert_eq!(got, want, "{bpt} bytes per token, {len} bytes");
            }
        }
    }
}
