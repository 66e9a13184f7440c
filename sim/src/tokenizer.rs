//! Byte-level fallback tokenizer: deterministic, prefix-stable, about 4 bytes per token.
//! A shared text prefix gives shared leading token ids, which is all prefix caching needs.

use xxhash_rust::xxh64::xxh64;

pub const VOCAB: u32 = 32_000;
/// BOS id prepended to completions prompts, as vLLM does.
pub const BOS: u32 = 0;

/// Tokenize `text`: BOS, then one id per 4-byte chunk.
pub fn encode(text: &str, add_bos: bool) -> Vec<u32> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len() / 4 + 2);
    if add_bos {
        out.push(BOS);
    }
    for chunk in bytes.chunks(4) {
        // Ids 0..3 are special (BOS, EOS, PAD); keep real tokens clear of them.
        out.push(3 + (xxh64(chunk, 0) % u64::from(VOCAB - 3)) as u32);
    }
    out
}

/// Text for generated token `id` (the simulator's "model" output).
pub fn decode_token(id: u32) -> &'static str {
    const WORDS: [&str; 8] = [" the", " cache", " engine", " token", " prefix", " block", " route", " pool"];
    WORDS[(id as usize) % WORDS.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_stable_and_bos() {
        let a = encode("hello world, this is shared", true);
        let b = encode("hello world, this is different", true);
        assert_eq!(a[0], BOS);
        assert_eq!(a[..5], b[..5]);
        assert!(a.iter().skip(1).all(|&t| (3..VOCAB).contains(&t)));
    }
}
