//! A store of tokenized text prefixes, so that a conversation's next turn tokenizes only what
//! it added (llm-d's kv-cache manager keeps an LRU prefix store of tokenizations for the same
//! reason).
//!
//! The text is cut into fixed chunks of [`CHUNK_BYTES`] and keyed by a hash chain over them:
//! the key at chunk `j` is `xxh64(chunk_j, seed = key_{j-1})`, so one key names the whole text
//! before its boundary. After a tokenization, the store keeps the ids up to a *resume point*:
//! the last piece boundary of the tokenization that lies at least [`margin`] bytes before the
//! end of the text's last whole chunk (or before where a token limit stopped it), under the key
//! of the first chunk that covers that margin. A later text that shares those chunks resumes
//! there and tokenizes only the rest.
//!
//! Why resuming is exact: the byte-level BPE tokenizer first splits out added tokens (leftmost,
//! then longest), then cuts each segment into pre-tokens with GPT-2's pattern, and merges inside
//! each pre-token alone. Each of those choices reads the text forward from where a piece starts,
//! through the piece and at most one character past it (or an added token's length). A boundary
//! that far inside the shared text is therefore a boundary of every text that extends it, with
//! the same ids before it; [`crate::tokenizer::Tokenizer::encode_from`] continues from there as a
//! whole tokenization would.

use lru::LruCache;
use xxhash_rust::xxh64::xxh64;

/// Bytes per chunk of the key chain.
pub const CHUNK_BYTES: usize = 4096;

/// Bytes an entry costs besides its ids (key, offsets, the LRU's links).
const ENTRY_OVERHEAD: usize = 64;

/// How far before a chunk's end a resume point must lie: every added token that could still
/// start before the end, plus the pre-tokenizer's one character of lookahead.
pub fn margin(longest_added: usize) -> usize {
    longest_added + 8
}

/// What the store has done, for the filter's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Tokenizations that resumed from a stored prefix.
    pub hits: u64,
    /// Tokenizations of a text of a chunk or more that found nothing to resume from.
    pub misses: u64,
    /// Bytes of text that resuming skipped.
    pub bytes_skipped: u64,
    /// Bytes the store holds now.
    pub bytes: u64,
    /// Entries evicted to stay within the bound.
    pub evicted: u64,
}

/// A stored prefix: the ids of the text before `resume`.
struct Entry {
    resume: usize,
    ids: Vec<u32>,
}

impl Entry {
    fn cost(&self) -> usize {
        Self::cost_of(self.ids.len())
    }

    fn cost_of(ids: usize) -> usize {
        ids * 4 + ENTRY_OVERHEAD
    }
}

/// Where a tokenization starts: at `resume`, after `ids`.
struct Resume<'a> {
    resume: usize,
    ids: &'a [u32],
}

/// Bounded tokenization prefix store, per worker.
pub struct TokenPrefixStore {
    entries: LruCache<u64, Entry>,
    max_bytes: usize,
    stats: StoreStats,
}

impl std::fmt::Debug for TokenPrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenPrefixStore").field("max_bytes", &self.max_bytes).field("stats", &self.stats).finish()
    }
}

/// The key chain of a text, computed as far as it is asked for: key `j` names the text
/// before the end of chunk `j`. `seed` separates tokenizations that differ in more than the
/// text (special tokens added).
struct KeyChain<'t> {
    chunks: std::slice::ChunksExact<'t, u8>,
    keys: Vec<u64>,
    prev: u64,
}

impl<'t> KeyChain<'t> {
    fn new(text: &'t str, seed: u64) -> Self {
        Self { chunks: text.as_bytes().chunks_exact(CHUNK_BYTES), keys: Vec::new(), prev: seed }
    }

    /// Key `j`, if the text has that many whole chunks.
    fn get(&mut self, j: usize) -> Option<u64> {
        while self.keys.len() <= j {
            let c = self.chunks.next()?;
            self.prev = xxh64(c, self.prev);
            self.keys.push(self.prev);
        }
        self.keys.get(j).copied()
    }
}

impl TokenPrefixStore {
    /// A store of at most `max_bytes` of ids (0: store nothing).
    pub fn new(max_bytes: usize) -> Self {
        Self { entries: LruCache::unbounded(), max_bytes, stats: StoreStats::default() }
    }

    pub fn stats(&self) -> StoreStats {
        self.stats
    }

    pub fn enabled(&self) -> bool {
        self.max_bytes > 0
    }

    /// The longest stored prefix of the text `chain` keys, or the first that already holds
    /// `limit` ids (hashing no further chunk than that).
    fn find(&mut self, chain: &mut KeyChain<'_>, limit: usize) -> Option<Resume<'_>> {
        if !self.enabled() {
            return None;
        }
        let mut hit = None;
        let mut j = 0;
        while let Some(k) = chain.get(j) {
            if let Some(e) = self.entries.peek(&k) {
                hit = Some(k);
                if e.ids.len() >= limit {
                    break;
                }
            }
            j += 1;
        }
        match hit.and_then(|k| self.entries.get(&k)) {
            Some(e) => {
                self.stats.hits += 1;
                self.stats.bytes_skipped += e.resume as u64;
                Some(Resume { resume: e.resume, ids: &e.ids })
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Remember `ids[..ids_at]`, the ids of the text before `resume`, under `key` (the key of
    /// the chunk the resume point was chosen for). Evicts least recently used entries to stay
    /// within the bound; an entry larger than the bound is not stored.
    pub fn insert(&mut self, key: u64, resume: usize, ids: &[u32], ids_at: usize) {
        let Some(prefix) = ids.get(..ids_at) else { return };
        let cost = Entry::cost_of(prefix.len());
        if !self.enabled() || cost > self.max_bytes || resume == 0 {
            return;
        }
        let entry = Entry { resume, ids: prefix.to_vec() };
        if let Some(old) = self.entries.pop(&key) {
            self.stats.bytes = self.stats.bytes.saturating_sub(old.cost() as u64);
        }
        while self.stats.bytes as usize + cost > self.max_bytes {
            let Some((_, old)) = self.entries.pop_lru() else { break };
            self.stats.bytes = self.stats.bytes.saturating_sub(old.cost() as u64);
            self.stats.evicted += 1;
        }
        self.stats.bytes += cost as u64;
        self.entries.put(key, entry);
    }
}

/// Tokenize `text` as [`crate::tokenizer::Tokenizer::encode`] would, resuming from the longest
/// stored prefix and storing the result's resume point for the next text that extends it.
pub fn encode_with_store(
    tokenizer: &mut crate::tokenizer::Tokenizer,
    store: &mut TokenPrefixStore,
    text: &str,
    add_special_tokens: bool,
    max_tokens: usize,
) -> Vec<u32> {
    if !store.enabled() || text.len() < CHUNK_BYTES {
        return tokenizer.encode(text, add_special_tokens, max_tokens);
    }
    let limit = if max_tokens == 0 { usize::MAX } else { max_tokens };
    let mut chain = KeyChain::new(text, u64::from(add_special_tokens));
    let mut out = Vec::with_capacity(text.len() / 3 + 2);
    let start = match store.find(&mut chain, limit) {
        Some(r) => {
            out.extend_from_slice(r.ids);
            r.resume
        }
        None => {
            if add_special_tokens {
                out.extend_from_slice(tokenizer.prefix_ids());
            }
            0
        }
    };
    if out.len() >= limit {
        out.truncate(limit);
        return out;
    }
    // The resume point for the text's last whole chunk: the last boundary before its margin.
    let chunk_end = text.len() / CHUNK_BYTES * CHUNK_BYTES;
    let cut = chunk_end.saturating_sub(margin(tokenizer.longest_added()));
    let mut last = (start, out.len());
    tokenizer.encode_from(text, start, &mut out, limit, |offset, ids| {
        if offset <= cut {
            last = (offset, ids);
        }
    });
    // A boundary the tokenization reported is proven, even if a limit stopped it before the
    // cut. It is stored, when it moved past where this text resumed, under the key of the first
    // chunk that covers its margin: the last chunk, unless a limit stopped the tokenization
    // early, and then every text that shares the tokenized part finds it.
    let covering = (last.0 + margin(tokenizer.longest_added())).div_ceil(CHUNK_BYTES);
    if let (Some(key), true) = (covering.checked_sub(1).and_then(|j| chain.get(j)), last.0 > start) {
        store.insert(key, last.0, &out, last.1);
    }
    out.truncate(limit);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::Tokenizer;

    fn tokenizer() -> Tokenizer {
        let text = attache_fixtures::read_vllm("model/tokenizer.json").expect("reference tokenizer");
        Tokenizer::from_json(text.as_bytes()).unwrap()
    }

    /// A deterministic stream of awkward text: words, numbers, runs of spaces and newlines,
    /// contractions, punctuation, multi-byte characters and the model's added tokens.
    fn awkward(seed: u64, bytes: usize) -> String {
        let parts = [
            "Hello",
            " world",
            "  ",
            "\n\n",
            "'s",
            " it'll",
            "42",
            " 3.14",
            "!!",
            " 日本語",
            "é",
            "  \n",
            "<s>",
            "</s>",
            "<pad>",
            " <s>",
            "x</s",
            ">",
            "<pa",
            "🦀",
            "\t",
            "don't",
            " ",
            "ab",
            "—",
            "\u{300}",
        ];
        let mut s = String::new();
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        while s.len() < bytes {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            s.push_str(parts[(x % parts.len() as u64) as usize]);
        }
        s
    }

    /// Every cut of a growing text, resumed from the store, gives the full tokenization's ids:
    /// cuts anywhere, inside multi-byte characters (moved to the char boundary before), inside
    /// added tokens, inside runs of spaces and inside words that BPE merges.
    #[test]
    fn resumed_ids_equal_a_full_tokenization_at_random_cuts() {
        let mut t = tokenizer();
        for seed in 1..=6u64 {
            let full = awkward(seed, 6 * CHUNK_BYTES + 777);
            let mut store = TokenPrefixStore::new(64 << 20);
            let mut x = seed;
            let mut cuts: Vec<usize> = (0..12)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (x >> 33) as usize % full.len()
                })
                .collect();
            cuts.sort_unstable();
            cuts.push(full.len());
            for cut in cuts {
                let mut c = cut;
                while !full.is_char_boundary(c) {
                    c -= 1;
                }
                let text = &full[..c];
                for special in [false, true] {
                    let want = t.encode(text, special, 0);
                    let got = encode_with_store(&mut t, &mut store, text, special, 0);
                    assert_eq!(got, want, "seed {seed}, cut {c}, special {special}");
                    let capped = encode_with_store(&mut t, &mut store, text, special, 1000);
                    assert_eq!(capped, want[..want.len().min(1000)], "seed {seed}, cut {c}, capped");
                }
            }
            let s = store.stats();
            assert!(s.hits > 0 && s.bytes_skipped > 0, "the growing text resumed: {s:?}");
        }
    }

    /// The prompts captured from the real vLLM 0.32 (whose full tokenization equals vLLM's ids:
    /// `tokenizer::tests`), strung together into a conversation past several chunks and cut
    /// at every captured prompt's end and at random points: resuming gives the full ids.
    #[test]
    fn resumed_ids_equal_a_full_tokenization_of_the_captured_prompts() {
        let mut t = tokenizer();
        let caps: serde_json::Value =
            serde_json::from_str(&attache_fixtures::read_vllm("http/prompts-tokenized.json").unwrap()).unwrap();
        let prompts: Vec<&str> = caps.as_object().unwrap().values().map(|v| v["prompt"].as_str().unwrap()).collect();
        let mut store = TokenPrefixStore::new(64 << 20);
        let mut text = String::new();
        let mut x = 99u64;
        for round in 0..4 {
            for p in &prompts {
                text.push_str(if round % 2 == 0 { "<s>user: " } else { "\n</s>" });
                text.push_str(p);
                for cut in [text.len(), {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (x >> 33) as usize % text.len()
                }] {
                    let mut c = cut;
                    while !text.is_char_boundary(c) {
                        c -= 1;
                    }
                    let part = &text[..c];
                    assert_eq!(
                        encode_with_store(&mut t, &mut store, part, true, 0),
                        t.encode(part, true, 0),
                        "cut {c}"
                    );
                }
            }
        }
        assert!(text.len() > 8 * CHUNK_BYTES);
        assert!(store.stats().hits > 10, "{:?}", store.stats());
    }

    /// A conversation that grows turn by turn tokenizes only its new text: after the first turn,
    /// every turn hits, and the bytes skipped are most of the text.
    #[test]
    fn a_growing_conversation_hits_from_the_second_turn() {
        let mut t = tokenizer();
        let mut store = TokenPrefixStore::new(64 << 20);
        let mut text = String::new();
        let mut total = 0usize;
        for turn in 0..20 {
            text.push_str(&format!("<s>user: {}\n<s>assistant: {}\n", awkward(turn, 3000), awkward(turn + 99, 2000)));
            total += text.len();
            assert_eq!(encode_with_store(&mut t, &mut store, &text, false, 0), t.encode(&text, false, 0));
        }
        let s = store.stats();
        assert_eq!(s.hits, 19, "{s:?}");
        assert!(s.bytes_skipped as f64 > 0.8 * (total as f64 - text.len() as f64), "{s:?}");
    }

    /// A tokenization a token limit stopped is stored under the chunk that covers where it
    /// stopped, so another conversation that shares that part resumes from it.
    #[test]
    fn a_capped_tokenization_is_found_by_every_text_that_shares_the_capped_part() {
        let mut t = tokenizer();
        let mut store = TokenPrefixStore::new(64 << 20);
        let shared = awkward(7, 5 * CHUNK_BYTES);
        let a = format!("{shared}{}", awkward(8, 3 * CHUNK_BYTES));
        let b = format!("{shared}{}", awkward(9, 3 * CHUNK_BYTES));
        assert!(t.encode(&shared, false, 0).len() > 1600, "the cap falls inside the shared part");
        encode_with_store(&mut t, &mut store, &a, false, 1500);
        assert_eq!(encode_with_store(&mut t, &mut store, &b, false, 1500), t.encode(&b, false, 1500));
        assert_eq!(store.stats().hits, 1, "{:?}", store.stats());
    }

    #[test]
    fn the_store_stays_within_its_bound_and_counts_evictions() {
        let mut t = tokenizer();
        let mut store = TokenPrefixStore::new(64 << 10);
        for i in 0..20 {
            let text = awkward(1000 + i, 3 * CHUNK_BYTES);
            encode_with_store(&mut t, &mut store, &text, false, 0);
            assert!(store.stats().bytes <= 64 << 10, "{:?}", store.stats());
        }
        assert!(store.stats().evicted > 0);
        // Off: nothing stored, nothing counted.
        let mut off = TokenPrefixStore::new(0);
        let text = awkward(5, 3 * CHUNK_BYTES);
        assert_eq!(encode_with_store(&mut t, &mut off, &text, false, 0), t.encode(&text, false, 0));
        assert_eq!(off.stats(), StoreStats::default());
    }

    /// The one-pass search for added tokens splits them out exactly as searching the rest of
    /// the text for each, at every step, did.
    #[test]
    fn added_tokens_split_as_a_search_from_each_position_would() {
        let mut t = tokenizer();
        for seed in 0..40 {
            let text = awkward(seed, 900);
            let mut naive = Vec::new();
            let mut rest = text.as_str();
            // Reference: find the leftmost (then longest) added token in what is left.
            let added = [("<s>", 0u32), ("</s>", 1), ("<pad>", 2)];
            loop {
                let best = added
                    .iter()
                    .filter_map(|(c, id)| rest.find(c).map(|p| (p, c.len(), *id)))
                    .min_by_key(|&(p, l, _)| (p, std::cmp::Reverse(l)));
                let seg_end = best.map_or(rest.len(), |b| b.0);
                naive.extend(t.encode(&rest[..seg_end], false, 0));
                match best {
                    Some((p, l, id)) => {
                        naive.push(id);
                        rest = &rest[p + l..];
                    }
                    None => break,
                }
            }
            assert_eq!(t.encode(&text, false, 0), naive, "seed {seed}");
        }
    }
}
