//! vLLM's prefix-cache block hash, `sha256_cbor` flavour (`tests/fixtures/vllm-0.32/README.md`):
//! `h[i] = sha256(cbor([h[i-1] (32 bytes), [tokens of block i], extra_keys]))`, seeded with
//! `NONE = sha256(cbor("vllm-none-hash"))`. The event id is the digest's last 8 bytes as a
//! big-endian u64.

use sha2::{Digest, Sha256};

pub type Digest32 = [u8; 32];

fn cbor_head(out: &mut Vec<u8>, major: u8, v: u64) {
    let m = major << 5;
    if v < 24 {
        out.push(m | v as u8);
    } else if v < 0x100 {
        out.extend_from_slice(&[m | 24, v as u8]);
    } else if v < 0x1_0000 {
        out.push(m | 25);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v < 0x1_0000_0000 {
        out.push(m | 26);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

fn sha(bytes: &[u8]) -> Digest32 {
    Sha256::digest(bytes).into()
}

/// `NONE` for `sha256_cbor` when `PYTHONHASHSEED` is unset; otherwise `H(seed string)`.
pub fn none_hash(seed: Option<&str>) -> Digest32 {
    let s = seed.unwrap_or("vllm-none-hash");
    let mut b = Vec::with_capacity(s.len() + 9);
    cbor_head(&mut b, 3, s.len() as u64);
    b.extend_from_slice(s.as_bytes());
    sha(&b)
}

/// Hash one block given its parent's full digest. `extra` is `None` (no LoRA, mm or salt).
pub fn block_digest(parent: &Digest32, tokens: &[u32]) -> Digest32 {
    let mut b = Vec::with_capacity(40 + tokens.len() * 3);
    cbor_head(&mut b, 4, 3);
    cbor_head(&mut b, 2, 32);
    b.extend_from_slice(parent);
    cbor_head(&mut b, 4, tokens.len() as u64);
    for &t in tokens {
        cbor_head(&mut b, 0, u64::from(t));
    }
    b.push(0xf6); // null
    sha(&b)
}

/// The u64 id vLLM puts in KV events.
pub fn event_id(d: &Digest32) -> u64 {
    let mut last = [0u8; 8];
    last.copy_from_slice(&d[24..]);
    u64::from_be_bytes(last)
}

/// Digests of every full block of `tokens`.
pub fn chain(seed: &Digest32, tokens: &[u32], block_size: usize) -> Vec<Digest32> {
    let mut prev = *seed;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|b| {
            prev = block_digest(&prev, b);
            prev
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn none_hash_matches_vllm() {
        let h = none_hash(None);
        let hex: String = h.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0");
    }

    #[test]
    fn reproduces_real_vllm_block_hashes() {
        // First BlockStored batch of the real vLLM 0.32 run with sha256_cbor, block size 32.
        let text = attache_fixtures::read_vllm("sha256_cbor/kv-events.decoded.jsonl").unwrap();
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        let ev = &first["payload"][1][0];
        assert_eq!(ev["type"], "BlockStored");
        let toks: Vec<u32> = ev["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let want: Vec<u64> = ev["block_hashes"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        let got: Vec<u64> = chain(&none_hash(None), &toks, 32).iter().map(event_id).collect();
        assert_eq!(got, want);
    }
}
