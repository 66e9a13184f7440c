//! A byte-level BPE tokenizer that reads a Hugging Face `tokenizer.json` and gives exactly the
//! ids vLLM gets, fast enough to run inside the Envoy filter (`reference/envoy-wasm.md` §10:
//! the `tokenizers` crate costs ~225 ms per 400 KB body in Envoy; this design ~12–18 ms).
//!
//! Supported shape, refused otherwise with [`TokenizerError::Unsupported`]: model `BPE` with no
//! dropout, `unk_token`, subword prefix/suffix, `byte_fallback` or `ignore_merges`; a
//! `ByteLevel` pre-tokenizer with `use_regex: true` and `add_prefix_space: false`; no
//! normalizer. Added tokens are split out first (leftmost-longest), as HF does.

use hashbrown::HashMap;
use serde::Deserialize;
use thiserror::Error;
use unicode_general_category::{get_general_category, GeneralCategory as G};

#[derive(Debug, Error, PartialEq)]
pub enum TokenizerError {
    #[error("tokenizer.json is not valid: {0}")]
    Invalid(String),
    #[error("tokenizer.json uses a shape this tokenizer does not implement: {0}")]
    Unsupported(String),
}

#[derive(Deserialize)]
struct AddedToken {
    id: u32,
    content: String,
}

#[derive(Deserialize)]
struct PreTokenizer {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    add_prefix_space: bool,
    #[serde(default = "yes")]
    use_regex: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Merge {
    Text(String),
    Pair(String, String),
}

#[derive(Deserialize)]
struct Model {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    dropout: Option<f64>,
    #[serde(default)]
    unk_token: Option<String>,
    #[serde(default)]
    continuing_subword_prefix: Option<String>,
    #[serde(default)]
    end_of_word_suffix: Option<String>,
    #[serde(default)]
    byte_fallback: bool,
    #[serde(default)]
    ignore_merges: bool,
    vocab: std::collections::HashMap<String, u32>,
    merges: Vec<Merge>,
}

#[derive(Deserialize)]
struct Special {
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct PostProcessor {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    special_tokens: std::collections::HashMap<String, Special>,
    #[serde(default)]
    single: Vec<serde_json::Value>,
}

#[derive(Deserialize)]
struct TokenizerJson {
    #[serde(default)]
    added_tokens: Vec<AddedToken>,
    #[serde(default)]
    normalizer: Option<serde_json::Value>,
    #[serde(default)]
    pre_tokenizer: Option<PreTokenizer>,
    #[serde(default)]
    post_processor: Option<PostProcessor>,
    model: Model,
}

/// GPT-2's byte → printable-char table, inverted: char → byte.
fn unicode_to_byte() -> HashMap<char, u8> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..=255u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.iter().zip(&cs).filter_map(|(&b, &c)| Some((char::from_u32(c)?, b as u8))).collect()
}

/// Open-addressing table from a merge pair to (rank, merged id). Linear probing, load ≤ 0.5:
/// hashbrown probes 4-byte groups on 32-bit Wasm and was 3–5× slower there (§10.6).
struct PairTable {
    keys: Vec<u64>,
    vals: Vec<(u32, u32)>,
    mask: usize,
}

const EMPTY: u64 = u64::MAX;

impl PairTable {
    fn new(n: usize) -> Self {
        let cap = (n.max(1) * 2).next_power_of_two();
        Self { keys: vec![EMPTY; cap], vals: vec![(0, 0); cap], mask: cap - 1 }
    }
    #[inline]
    fn slot(&self, k: u64) -> usize {
        (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & self.mask
    }
    fn insert(&mut self, k: u64, v: (u32, u32)) {
        let mut i = self.slot(k);
        loop {
            match self.keys.get(i).copied() {
                Some(EMPTY) => {
                    self.keys[i] = k;
                    self.vals[i] = v;
                    return;
                }
                Some(x) if x == k => return, // first (lowest-rank) merge wins
                _ => i = (i + 1) & self.mask,
            }
        }
    }
    #[inline]
    fn get(&self, k: u64) -> Option<(u32, u32)> {
        let mut i = self.slot(k);
        loop {
            match self.keys.get(i).copied() {
                Some(EMPTY) | None => return None,
                Some(x) if x == k => return self.vals.get(i).copied(),
                _ => i = (i + 1) & self.mask,
            }
        }
    }
}

/// A loaded tokenizer.
pub struct Tokenizer {
    byte_ids: [u32; 256],
    merges: PairTable,
    /// Added tokens (content, id), longest first.
    added: Vec<(String, u32)>,
    /// Ids the post-processor puts before the sequence (BOS) when special tokens are added.
    prefix_ids: Vec<u32>,
    cache: HashMap<Vec<u8>, Vec<u32>>,
    cache_limit: usize,
}

impl Tokenizer {
    /// Load from the text of a `tokenizer.json`.
    pub fn from_json(text: &[u8]) -> Result<Self, TokenizerError> {
        let t: TokenizerJson = serde_json::from_slice(text).map_err(|e| TokenizerError::Invalid(e.to_string()))?;
        let m = &t.model;
        let unsupported = |what: &str| Err(TokenizerError::Unsupported(what.to_owned()));
        if m.kind != "BPE" {
            return unsupported(&format!("model type {}", m.kind));
        }
        if m.dropout.is_some_and(|d| d > 0.0) || m.unk_token.is_some() || m.byte_fallback || m.ignore_merges {
            return unsupported("BPE dropout, unk_token, byte_fallback or ignore_merges");
        }
        if m.continuing_subword_prefix.as_deref().is_some_and(|s| !s.is_empty())
            || m.end_of_word_suffix.as_deref().is_some_and(|s| !s.is_empty())
        {
            return unsupported("continuing_subword_prefix / end_of_word_suffix");
        }
        if t.normalizer.as_ref().is_some_and(|n| !n.is_null()) {
            return unsupported("a normalizer");
        }
        match &t.pre_tokenizer {
            Some(p) if p.kind == "ByteLevel" && p.use_regex && !p.add_prefix_space => {}
            _ => return unsupported("pre_tokenizer other than ByteLevel(use_regex, no prefix space)"),
        }
        let u2b = unicode_to_byte();
        let to_bytes = |s: &str| -> Option<Vec<u8>> { s.chars().map(|c| u2b.get(&c).copied()).collect() };
        let mut by_bytes: HashMap<Vec<u8>, u32> = HashMap::with_capacity(m.vocab.len());
        for (tok, id) in &m.vocab {
            if let Some(b) = to_bytes(tok) {
                by_bytes.insert(b, *id);
            }
        }
        let mut byte_ids = [0u32; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = *by_bytes
                .get(&vec![b as u8])
                .ok_or_else(|| TokenizerError::Unsupported(format!("no vocab entry for byte {b:#04x}")))?;
        }
        let mut merges = PairTable::new(m.merges.len());
        for (rank, mg) in m.merges.iter().enumerate() {
            let (a, b) = match mg {
                Merge::Text(s) => match s.split_once(' ') {
                    Some(p) => p,
                    None => return Err(TokenizerError::Invalid(format!("merge `{s}`"))),
                },
                Merge::Pair(a, b) => (a.as_str(), b.as_str()),
            };
            let (Some(ab), Some(bb)) = (to_bytes(a), to_bytes(b)) else {
                return Err(TokenizerError::Invalid(format!("merge `{a} {b}` is not byte-level")));
            };
            let mut joined = ab.clone();
            joined.extend_from_slice(&bb);
            let (Some(&ia), Some(&ib), Some(&ij)) = (by_bytes.get(&ab), by_bytes.get(&bb), by_bytes.get(&joined))
            else {
                return Err(TokenizerError::Invalid(format!("merge `{a} {b}` names tokens outside the vocab")));
            };
            merges.insert(u64::from(ia) << 32 | u64::from(ib), (rank as u32, ij));
        }
        let mut added: Vec<(String, u32)> =
            t.added_tokens.iter().filter(|a| !a.content.is_empty()).map(|a| (a.content.clone(), a.id)).collect();
        added.sort_by_key(|a| std::cmp::Reverse(a.0.len()));
        let mut prefix_ids = Vec::new();
        if let Some(pp) = &t.post_processor {
            if pp.kind == "TemplateProcessing" {
                for piece in &pp.single {
                    if let Some(id) = piece.get("SpecialToken").and_then(|s| s.get("id")).and_then(|v| v.as_str()) {
                        if let Some(sp) = pp.special_tokens.get(id) {
                            prefix_ids.extend_from_slice(&sp.ids);
                        }
                    } else {
                        break; // only a leading special token (BOS) is supported
                    }
                }
            }
        }
        Ok(Self { byte_ids, merges, added, prefix_ids, cache: HashMap::new(), cache_limit: 1 << 16 })
    }

    /// Ids the post-processor adds in front (BOS), as vLLM's `/tokenize` and completions do.
    pub fn prefix_ids(&self) -> &[u32] {
        &self.prefix_ids
    }

    /// Tokenize `text`. With `add_special_tokens` the post-processor's leading ids come first.
    /// Stops once `max_tokens` ids are produced (0 = no limit); the ids returned are then
    /// exactly the first ids of the full tokenization.
    pub fn encode(&mut self, text: &str, add_special_tokens: bool, max_tokens: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special_tokens {
            out.extend_from_slice(&self.prefix_ids);
        }
        let limit = if max_tokens == 0 { usize::MAX } else { max_tokens };
        self.encode_from(text, 0, &mut out, limit, |_, _| {});
        out.truncate(limit);
        out
    }

    /// Longest added token, in bytes: text this close to a cut may still become one.
    pub fn longest_added(&self) -> usize {
        self.added.first().map_or(0, |(c, _)| c.len())
    }

    /// Tokenize `text[start..]` onto `out`, up to `limit` ids in all. `start` must be a
    /// boundary of `text`'s full tokenization (0, or one `boundary` reported): the ids then
    /// continue it exactly. `boundary(offset, ids)` is told each offset where a piece of the
    /// full tokenization starts, with the ids before it, in order; a later call may resume
    /// there, on this text or on any text that extends `text[..offset + margin]`, for the margin
    /// of [`crate::token_prefix`].
    pub fn encode_from(
        &mut self,
        text: &str,
        start: usize,
        out: &mut Vec<u32>,
        limit: usize,
        mut boundary: impl FnMut(usize, usize),
    ) {
        let mut at = start.min(text.len());
        // The next occurrence of each added token at or after `at`, found once per token and
        // searched again only after the scan passes it (one pass over the text per token,
        // however many occurrences).
        // `None`: not searched yet; `Some(None)`: no occurrence left.
        let mut next: Vec<Option<Option<usize>>> = vec![None; self.added.len()];
        while at < text.len() && out.len() < limit {
            // The leftmost (then longest: `added` is longest first) added token.
            let mut best: Option<(usize, usize, u32)> = None;
            for ((content, id), slot) in self.added.iter().zip(next.iter_mut()) {
                if slot.is_none_or(|found| found.is_some_and(|p| p < at)) {
                    *slot = Some(text.get(at..).and_then(|r| r.find(content.as_str())).map(|p| at + p));
                }
                if let Some(Some(pos)) = *slot {
                    if best.is_none_or(|(p, _, _)| pos < p) {
                        best = Some((pos, content.len(), *id));
                    }
                }
            }
            let seg_end = best.map_or(text.len(), |(pos, _, _)| pos);
            let segment = text.get(at..seg_end).unwrap_or("");
            self.encode_segment(segment, at, out, limit, &mut boundary);
            match best {
                Some((pos, len, id)) if out.len() < limit => {
                    boundary(pos, out.len());
                    out.push(id);
                    at = pos + len;
                }
                _ => break,
            }
        }
    }

    fn encode_segment(
        &mut self,
        text: &str,
        base: usize,
        out: &mut Vec<u32>,
        limit: usize,
        boundary: &mut impl FnMut(usize, usize),
    ) {
        let mut i = 0;
        while i < text.len() && out.len() < limit {
            let end = next_pretoken(text, i);
            boundary(base + i, out.len());
            let word = text.as_bytes().get(i..end).unwrap_or(&[]);
            self.encode_word(word, out);
            i = end.max(i + 1);
        }
    }

    fn encode_word(&mut self, word: &[u8], out: &mut Vec<u32>) {
        if let Some(ids) = self.cache.get(word) {
            out.extend_from_slice(ids);
            return;
        }
        let mut syms: Vec<u32> = word.iter().map(|&b| self.byte_ids[b as usize]).collect();
        // Merge the lowest-rank adjacent pair (leftmost on ties) until none is mergeable.
        loop {
            let mut best: Option<(u32, usize, u32)> = None;
            for (i, w) in syms.windows(2).enumerate() {
                if let [a, b] = w {
                    if let Some((rank, merged)) = self.merges.get(u64::from(*a) << 32 | u64::from(*b)) {
                        if best.is_none_or(|(r, _, _)| rank < r) {
                            best = Some((rank, i, merged));
                        }
                    }
                }
            }
            let Some((_, i, merged)) = best else { break };
            syms[i] = merged;
            syms.remove(i + 1);
        }
        out.extend_from_slice(&syms);
        if self.cache.len() >= self.cache_limit {
            self.cache.clear();
        }
        self.cache.insert(word.to_vec(), syms);
    }
}

#[inline]
fn is_letter(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_alphabetic();
    }
    matches!(
        get_general_category(c),
        G::UppercaseLetter | G::LowercaseLetter | G::TitlecaseLetter | G::ModifierLetter | G::OtherLetter
    )
}

#[inline]
fn is_number(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_digit();
    }
    matches!(get_general_category(c), G::DecimalNumber | G::LetterNumber | G::OtherNumber)
}

#[derive(PartialEq, Clone, Copy)]
enum Class {
    Space,
    Letter,
    Number,
    Other,
}

#[inline]
fn class(c: char) -> Class {
    if c.is_whitespace() {
        Class::Space
    } else if is_letter(c) {
        Class::Letter
    } else if is_number(c) {
        Class::Number
    } else {
        Class::Other
    }
}

/// End (byte offset) of the pre-token starting at `i`: a hand-written scanner equal to GPT-2's
/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
fn next_pretoken(text: &str, i: usize) -> usize {
    let s = text.get(i..).unwrap_or("");
    let mut it = s.char_indices();
    let Some((_, c0)) = it.next() else { return text.len() };
    if c0 == '\'' {
        for suf in ["s", "t", "re", "ve", "m", "ll", "d"] {
            if s.get(1..).is_some_and(|r| r.starts_with(suf)) {
                return i + 1 + suf.len();
            }
        }
    }
    // ` ?X+` alternatives: an optional single space, then a run of one class.
    let (start, run_class) = if c0 == ' ' {
        match s.get(1..).and_then(|r| r.chars().next()) {
            Some(c1) if class(c1) != Class::Space => (1, class(c1)),
            _ => (0, Class::Space),
        }
    } else {
        (0, class(c0))
    };
    if run_class != Class::Space {
        let body = s.get(start..).unwrap_or("");
        let len = body.char_indices().find(|(_, c)| class(*c) != run_class).map(|(p, _)| p).unwrap_or(body.len());
        return i + start + len;
    }
    // Whitespace: `\s+(?!\S)` leaves the last whitespace char before a non-space; else `\s+`.
    let mut last_start = 0;
    let mut end = s.len();
    let mut count = 0;
    for (p, c) in s.char_indices() {
        if !c.is_whitespace() {
            end = p;
            break;
        }
        count += 1;
        last_start = p;
    }
    if end < s.len() && count > 1 {
        return i + last_start;
    }
    i + end
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(path: &str) -> Option<String> {
        attache_fixtures::read_vllm(path).ok()
    }

    fn load() -> Tokenizer {
        let text = reference("model/tokenizer.json").expect("reference tokenizer beside the repository");
        Tokenizer::from_json(text.as_bytes()).unwrap()
    }

    #[test]
    fn pretokenizer_matches_gpt2_regex_on_tricky_cases() {
        fn split(t: &str) -> Vec<&str> {
            let mut v = Vec::new();
            let mut i = 0;
            while i < t.len() {
                let e = next_pretoken(t, i);
                v.push(&t[i..e]);
                i = e;
            }
            v
        }
        assert_eq!(split("Hello world"), ["Hello", " world"]);
        assert_eq!(split("a  b"), ["a", " ", " b"]);
        assert_eq!(split("x's it'll"), ["x", "'s", " it", "'ll"]);
        assert_eq!(split("!!'s 42abc"), ["!!'", "s", " 42", "abc"]);
        assert_eq!(split("end  "), ["end", "  "]);
        assert_eq!(split("a\n\nb"), ["a", "\n", "\n", "b"]);
        assert_eq!(split("日本 語"), ["日本", " 語"]);
    }

    #[test]
    fn identical_ids_to_real_vllm_for_every_captured_prompt() {
        let mut t = load();
        let caps: serde_json::Value = serde_json::from_str(&reference("http/prompts-tokenized.json").unwrap()).unwrap();
        let mut n = 0;
        for (name, v) in caps.as_object().unwrap() {
            let want: Vec<u32> = v["tokenize_response"]["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let got = t.encode(v["prompt"].as_str().unwrap(), true, 0);
            assert_eq!(got, want, "prompt {name}");
            // The capped form is exactly a prefix of the full one.
            assert_eq!(t.encode(v["prompt"].as_str().unwrap(), true, 37), want[..37]);
            n += 1;
        }
        assert_eq!(n, 8);
    }

    #[test]
    fn chat_template_rendered_prompt_matches_real_vllm() {
        let mut t = load();
        let cap: serde_json::Value =
            serde_json::from_str(&reference("http/chat-prompt-tokenized.json").unwrap()).unwrap();
        let msgs = cap["messages"].as_array().unwrap();
        // The reference model's template: `<s>{role}: {content}\n` per message, then `assistant:`.
        let mut rendered = String::new();
        for m in msgs {
            rendered.push_str(&format!("<s>{}: {}\n", m["role"].as_str().unwrap(), m["content"].as_str().unwrap()));
        }
        rendered.push_str("assistant:");
        let want: Vec<u32> =
            cap["tokenize_response"]["tokens"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        assert_eq!(t.encode(&rendered, false, 0), want);
        assert_eq!(want.len(), 275);
    }

    #[test]
    fn refuses_shapes_it_does_not_implement() {
        let base = reference("model/tokenizer.json").unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&base).unwrap();
        v["normalizer"] = serde_json::json!({"type": "NFC"});
        assert!(matches!(Tokenizer::from_json(v.to_string().as_bytes()), Err(TokenizerError::Unsupported(_))));
        let mut v: serde_json::Value = serde_json::from_str(&base).unwrap();
        v["model"]["type"] = serde_json::json!("Unigram");
        assert!(matches!(Tokenizer::from_json(v.to_string().as_bytes()), Err(TokenizerError::Unsupported(_))));
        assert!(matches!(Tokenizer::from_json(b"{"), Err(TokenizerError::Invalid(_))));
    }
}
