//! The protocol between the scheduler, custom scorers and the picker, as Envoy filter state.
//!
//! The scheduler filter filters and scores the candidates with the built-in scorers, picks a
//! primary endpoint (so the request is routed even if nothing downstream acts), and writes a
//! [`ScoringContext`] to the request's filter state under [`CONTEXT_PROPERTY`]. Each custom
//! scorer filter after it reads the context, scores every candidate 0..1 and appends a
//! [`ScoreEntry`] to the [`ScoreSheet`] under [`SCORES_PROPERTY`]. The picker filter then
//! combines the built-in totals with each entry times its configured weight ([`combine`]) and
//! rewrites the destination header.
//!
//! Both values use a small, versioned, little-endian binary encoding (not JSON: every scorer
//! decodes the context on every request). Decoding is bounds-checked and never panics.
//!
//! Rollout: the scheduler puts a sticky per-session `bucket` (0..10000) in the context. A
//! scorer slot acts only on requests whose bucket falls in its configured range, so a canary
//! and a stable version of the same scorer can both sit in the chain and split the traffic.

use crate::rng::SplitMix64;

/// Filter-state key (`wasm.attache_ctx`) of the scheduling context.
pub const CONTEXT_PROPERTY: &str = "attache_ctx";
/// Filter-state key (`wasm.attache_scores`) of the score sheet.
pub const SCORES_PROPERTY: &str = "attache_scores";
/// Filter-state key a scorer sets to its `slot/arm/version` while it scores and clears when
/// done. Still set when the response starts means the scorer trapped on this request.
pub const SCORING_PROPERTY: &str = "attache_scoring";
/// Filter-state key (`wasm.attache_tiers`) of the tiers the scheduler's filters put the
/// candidates in, one byte per candidate in context order ([`crate::pickers::tier`]): scores,
/// custom ones included, order candidates within a tier, never across. Absent: no tiers.
pub const TIERS_PROPERTY: &str = "attache_tiers";
/// Filter-state key the picker sets to the primary endpoint it chose.
pub const PICKED_PROPERTY: &str = "attache_picked";
/// Rollout buckets: a request's bucket is in `0..BUCKETS`.
pub const BUCKETS: u16 = 10_000;

const CONTEXT_MAGIC: u8 = 0xA7;
const SHEET_MAGIC: u8 = 0xA8;
/// The encoding's version: 2 added a sheet entry's removals, 3 its chosen candidate (older
/// values still decode).
const VERSION: u8 = 3;
/// `chosen` encoded when there is none.
const NOT_CHOSEN: u16 = u16::MAX;

/// What a scorer knows about one candidate endpoint.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Candidate {
    /// `ip:port`.
    pub address: String,
    /// Pod labels (e.g. `attache.io/accelerator: l4`), sorted by key.
    pub labels: Vec<(String, String)>,
    pub waiting: f32,
    pub running: f32,
    /// KV-cache utilisation, 0..1.
    pub kv_usage: f32,
    /// Recent mean time to first token on this endpoint, ms (0 = unknown).
    pub ttft_ms: f32,
    /// Fraction of the prompt's blocks this endpoint is expected to hold, 0..1.
    pub prefix_hit: f32,
    /// The scheduler's built-in weighted total.
    pub score: f64,
}

impl Candidate {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// The per-request scheduling context the scheduler hands to scorers.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ScoringContext {
    /// Rollout bucket, `0..BUCKETS`, sticky per session.
    pub bucket: u16,
    /// Seed for the picker's tie-break.
    pub seed: u64,
    /// How many endpoints (primary + fallbacks) the picker emits.
    pub max_endpoints: u8,
    pub model: String,
    /// Prompt length in tokens (estimated when not tokenized).
    pub prompt_tokens: u32,
    /// `max_tokens` / `max_completion_tokens` if the request gave one, else 0.
    pub max_tokens: u32,
    pub stream: bool,
    pub candidates: Vec<Candidate>,
}

/// Which side of a rollout a scorer slot is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arm {
    Stable,
    Canary,
    /// A candidate that scores every request beside the live version and acts on none: the
    /// picker picks with it as well, to compare, and routes without it.
    Shadow,
}

impl Arm {
    pub fn as_str(self) -> &'static str {
        match self {
            Arm::Stable => "stable",
            Arm::Canary => "canary",
            Arm::Shadow => "shadow",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "stable" => Some(Arm::Stable),
            "canary" => Some(Arm::Canary),
            "shadow" => Some(Arm::Shadow),
            _ => None,
        }
    }

    /// Whether its entry counts in the pick that routes the request.
    pub fn acts(self) -> bool {
        self != Arm::Shadow
    }
}

/// One scorer's output for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreEntry {
    /// The scorer slot (e.g. `slo`); at most one entry per slot counts.
    pub slot: String,
    pub arm: Arm,
    /// Module version (sha256 hex prefix) that produced the scores.
    pub version: String,
    pub weight: f64,
    /// One score per candidate, in context order; the picker clamps to 0..1.
    pub scores: Vec<f32>,
    /// Candidates (context indices) the module removes, each with its reason: a filter
    /// module's verdict, which the picker applies across the scheduler's tiers.
    pub removed: Vec<(u16, String)>,
    /// The candidate (context index) a picker module chooses as the primary, among the
    /// leading tier's; the rest keep the combined order.
    pub chosen: Option<u16>,
}

/// Every scorer's entry for one request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ScoreSheet {
    pub entries: Vec<ScoreEntry>,
}

/// A context or sheet that could not be decoded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    #[error("truncated at byte {0}")]
    Truncated(usize),
    #[error("not an Attaché scoring value (magic {0:#x})")]
    BadMagic(u8),
    #[error("unsupported encoding version {0}")]
    BadVersion(u8),
    #[error("string is not UTF-8")]
    BadString,
    #[error("{0} trailing bytes")]
    Trailing(usize),
    #[error("unknown arm {0}")]
    BadArm(u8),
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f32(&mut self, v: f32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f64(&mut self, v: f64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// Strings longer than 65535 bytes are cut (at a char boundary).
    fn str(&mut self, s: &str) {
        let mut end = s.len().min(usize::from(u16::MAX));
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        let s = s.get(..end).unwrap_or("");
        self.u16(s.len() as u16);
        self.0.extend_from_slice(s.as_bytes());
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let s = self.buf.get(self.pos..self.pos + n).ok_or(DecodeError::Truncated(self.pos))?;
        self.pos += n;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.arr::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.arr()?))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    fn f32(&mut self) -> Result<f32, DecodeError> {
        Ok(f32::from_le_bytes(self.arr()?))
    }
    fn f64(&mut self) -> Result<f64, DecodeError> {
        Ok(f64::from_le_bytes(self.arr()?))
    }
    fn str(&mut self) -> Result<String, DecodeError> {
        let n = usize::from(self.u16()?);
        let b = self.take(n)?;
        std::str::from_utf8(b).map(str::to_owned).map_err(|_| DecodeError::BadString)
    }
    /// Check the magic; the version (1 ..= [`VERSION`]).
    fn header(&mut self, magic: u8) -> Result<u8, DecodeError> {
        let m = self.u8()?;
        if m != magic {
            return Err(DecodeError::BadMagic(m));
        }
        let v = self.u8()?;
        if !(1..=VERSION).contains(&v) {
            return Err(DecodeError::BadVersion(v));
        }
        Ok(v)
    }
    fn finish(&self) -> Result<(), DecodeError> {
        match self.buf.len() - self.pos {
            0 => Ok(()),
            n => Err(DecodeError::Trailing(n)),
        }
    }
}

impl ScoringContext {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer(Vec::with_capacity(64 + self.candidates.len() * 64));
        w.u8(CONTEXT_MAGIC);
        w.u8(VERSION);
        w.u16(self.bucket);
        w.u64(self.seed);
        w.u8(self.max_endpoints);
        w.str(&self.model);
        w.u32(self.prompt_tokens);
        w.u32(self.max_tokens);
        w.u8(u8::from(self.stream));
        w.u16(self.candidates.len().min(usize::from(u16::MAX)) as u16);
        for c in self.candidates.iter().take(usize::from(u16::MAX)) {
            w.str(&c.address);
            w.u8(c.labels.len().min(255) as u8);
            for (k, v) in c.labels.iter().take(255) {
                w.str(k);
                w.str(v);
            }
            w.f32(c.waiting);
            w.f32(c.running);
            w.f32(c.kv_usage);
            w.f32(c.ttft_ms);
            w.f32(c.prefix_hit);
            w.f64(c.score);
        }
        w.0
    }

    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader { buf, pos: 0 };
        r.header(CONTEXT_MAGIC)?;
        let mut ctx = ScoringContext {
            bucket: r.u16()?,
            seed: r.u64()?,
            max_endpoints: r.u8()?,
            model: r.str()?,
            prompt_tokens: r.u32()?,
            max_tokens: r.u32()?,
            stream: r.u8()? != 0,
            candidates: Vec::new(),
        };
        let n = usize::from(r.u16()?);
        // Each candidate takes at least 31 bytes; do not trust `n` for the allocation.
        ctx.candidates.reserve(n.min(buf.len() / 31));
        for _ in 0..n {
            let address = r.str()?;
            let nl = usize::from(r.u8()?);
            let mut labels = Vec::with_capacity(nl);
            for _ in 0..nl {
                labels.push((r.str()?, r.str()?));
            }
            ctx.candidates.push(Candidate {
                address,
                labels,
                waiting: r.f32()?,
                running: r.f32()?,
                kv_usage: r.f32()?,
                ttft_ms: r.f32()?,
                prefix_hit: r.f32()?,
                score: r.f64()?,
            });
        }
        r.finish()?;
        Ok(ctx)
    }
}

impl ScoreSheet {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer(Vec::new());
        w.u8(SHEET_MAGIC);
        w.u8(VERSION);
        w.u8(self.entries.len().min(255) as u8);
        for e in self.entries.iter().take(255) {
            w.str(&e.slot);
            w.u8(match e.arm {
                Arm::Stable => 0,
                Arm::Canary => 1,
                Arm::Shadow => 2,
            });
            w.str(&e.version);
            w.f64(e.weight);
            w.u16(e.scores.len().min(usize::from(u16::MAX)) as u16);
            for s in e.scores.iter().take(usize::from(u16::MAX)) {
                w.f32(*s);
            }
            w.u16(e.removed.len().min(usize::from(u16::MAX)) as u16);
            for (i, reason) in e.removed.iter().take(usize::from(u16::MAX)) {
                w.u16(*i);
                w.str(reason);
            }
            w.u16(e.chosen.unwrap_or(NOT_CHOSEN));
        }
        w.0
    }

    /// Decode a sheet; an empty buffer is an empty sheet.
    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        if buf.is_empty() {
            return Ok(Self::default());
        }
        let mut r = Reader { buf, pos: 0 };
        let version = r.header(SHEET_MAGIC)?;
        let n = usize::from(r.u8()?);
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let slot = r.str()?;
            let arm = match r.u8()? {
                0 => Arm::Stable,
                1 => Arm::Canary,
                2 => Arm::Shadow,
                a => return Err(DecodeError::BadArm(a)),
            };
            let module = r.str()?;
            let weight = r.f64()?;
            let k = usize::from(r.u16()?);
            let mut scores = Vec::with_capacity(k.min(buf.len() / 4));
            for _ in 0..k {
                scores.push(r.f32()?);
            }
            let mut removed = Vec::new();
            if version >= 2 {
                for _ in 0..r.u16()? {
                    removed.push((r.u16()?, r.str()?));
                }
            }
            let chosen = if version >= 3 { Some(r.u16()?).filter(|&c| c != NOT_CHOSEN) } else { None };
            entries.push(ScoreEntry { slot, arm, version: module, weight, scores, removed, chosen });
        }
        r.finish()?;
        Ok(Self { entries })
    }

    /// Add or replace the entry for `entry.slot` (a slot counts once even if, during an
    /// update, both its stable and canary filters acted). A shadow entry sits beside the
    /// slot's live one.
    pub fn put(&mut self, entry: ScoreEntry) {
        self.entries.retain(|e| e.slot != entry.slot || e.arm.acts() != entry.arm.acts());
        self.entries.push(entry);
    }

    /// Whether a shadow candidate scored this request.
    pub fn has_shadow(&self) -> bool {
        self.entries.iter().any(|e| !e.arm.acts())
    }
}

/// A rollout arm's share of the buckets: `[from, to)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketRange {
    pub from: u16,
    pub to: u16,
}

impl BucketRange {
    pub const ALL: BucketRange = BucketRange { from: 0, to: BUCKETS };
    pub const NONE: BucketRange = BucketRange { from: 0, to: 0 };

    pub fn contains(&self, bucket: u16) -> bool {
        self.from <= bucket && bucket < self.to
    }

    /// The canary's range for `percent` (0..=100, two decimals kept) and the stable's rest.
    pub fn split(percent: f64) -> (BucketRange, BucketRange) {
        let p = if percent.is_finite() { percent.clamp(0.0, 100.0) } else { 0.0 };
        let cut = ((p * f64::from(BUCKETS)) / 100.0).round() as u16;
        (BucketRange { from: 0, to: cut }, BucketRange { from: cut, to: BUCKETS })
    }
}

/// The rollout bucket of a session key (sticky: the same key always lands in the same bucket).
/// Requests without a session key use their own random seed.
pub fn bucket_of(session_key: &[u8]) -> u16 {
    let h = xxhash_rust::xxh64::xxh64(session_key, 0x5eed_0b0c_4e75);
    (h % u64::from(BUCKETS)) as u16
}

/// The bucket of a request without a session key: spread by its seed.
pub fn bucket_of_seed(seed: u64) -> u16 {
    (SplitMix64::new(seed).next_u64() % u64::from(BUCKETS)) as u16
}

/// Combine built-in totals with every entry's weighted, clamped scores; an entry whose score
/// count does not match the candidates is ignored (and reported in the second value).
pub fn combine(ctx: &ScoringContext, sheet: &ScoreSheet) -> (Vec<f64>, usize) {
    let mut totals: Vec<f64> = ctx.candidates.iter().map(|c| c.score).collect();
    let mut ignored = 0;
    for e in sheet.entries.iter().filter(|e| e.arm.acts()) {
        if e.scores.len() != totals.len() || !e.weight.is_finite() {
            ignored += 1;
            continue;
        }
        for (t, s) in totals.iter_mut().zip(&e.scores) {
            let s = if s.is_finite() { f64::from(*s).clamp(0.0, 1.0) } else { 0.0 };
            *t += e.weight * s;
        }
    }
    (totals, ignored)
}

/// Per candidate, whether a filter module removed it (entries of the wrong length or with a
/// non-finite weight are ignored, as [`combine`] ignores them).
pub fn removals(ctx: &ScoringContext, sheet: &ScoreSheet) -> Vec<bool> {
    let n = ctx.candidates.len();
    let mut removed = vec![false; n];
    for e in sheet.entries.iter().filter(|e| e.arm.acts() && e.scores.len() == n && e.weight.is_finite()) {
        for (i, _) in &e.removed {
            if let Some(r) = removed.get_mut(usize::from(*i)) {
                *r = true;
            }
        }
    }
    removed
}

/// Pick endpoints (primary + fallbacks) from the combined scores, with the context's seed,
/// keeping the scheduler's `tiers` (one per candidate; any other length counts as none).
/// Returns them, the sheet entries ignored, and the candidates filter modules removed.
pub fn pick<'a>(ctx: &'a ScoringContext, sheet: &ScoreSheet, tiers: &[u8]) -> (Vec<&'a str>, usize, usize) {
    let (totals, ignored) = combine(ctx, sheet);
    let mut order = crate::pickers::max_score::max_score(&totals, totals.len(), ctx.seed);
    if tiers.len() == totals.len() {
        crate::pickers::max_score::by_tier(&mut order, |i| tiers.get(i).copied().unwrap_or(crate::pickers::tier::NONE));
    }
    // Filter modules' removals apply across tiers; if they would remove every candidate, none
    // is removed (the pool degrades to the scores, as the scheduler's soft filters do).
    let removed = removals(ctx, sheet);
    let mut dropped = 0;
    if removed.iter().any(|r| !r) {
        order.retain(|&i| !removed.get(i).copied().unwrap_or(false));
        dropped = removed.iter().filter(|r| **r).count();
    }
    choose(ctx, sheet, tiers, &mut order);
    order.truncate(usize::from(ctx.max_endpoints.max(1)));
    let addrs = order.iter().filter_map(|&i| ctx.candidates.get(i).map(|c| c.address.as_str())).collect();
    (addrs, ignored, dropped)
}

/// A picker module's choice: the first live entry's chosen candidate goes first, if it is
/// still in `order` (not removed) and in the leading tier (a sticky session's endpoint and the
/// affinity filter's holders stay in front, as for scores).
fn choose(ctx: &ScoringContext, sheet: &ScoreSheet, tiers: &[u8], order: &mut Vec<usize>) {
    let n = ctx.candidates.len();
    let choice = sheet
        .entries
        .iter()
        .filter(|e| e.arm.acts() && e.scores.len() == n && e.weight.is_finite())
        .find_map(|e| e.chosen.map(usize::from));
    let (Some(c), Some(&first)) = (choice, order.first()) else { return };
    let tier = |i: usize| tiers.get(i).copied().unwrap_or(crate::pickers::tier::NONE);
    if tiers.len() == n && tier(c) != tier(first) {
        return;
    }
    if let Some(at) = order.iter().position(|&i| i == c) {
        let c = order.remove(at);
        order.insert(0, c);
    }
}

/// What one shadow candidate would have done with a request: its slot, and the candidate (by
/// position in the context) that would have been the primary, with the candidate live.
#[derive(Debug, Clone, PartialEq)]
pub struct ShadowPick {
    pub slot: String,
    pub primary: Option<usize>,
}

/// For each shadow entry, the pick with it in place of its slot's live entry (the other
/// slots' live entries as they are). Compare with [`pick`]'s primary.
pub fn shadow_picks(ctx: &ScoringContext, sheet: &ScoreSheet, tiers: &[u8]) -> Vec<ShadowPick> {
    let mut out = Vec::new();
    for shadow in sheet.entries.iter().filter(|e| !e.arm.acts()) {
        let mut candidate = ScoreSheet::default();
        for e in sheet.entries.iter().filter(|e| e.arm.acts() && e.slot != shadow.slot) {
            candidate.entries.push(e.clone());
        }
        candidate.entries.push(ScoreEntry { arm: Arm::Stable, ..shadow.clone() });
        let (picked, _, _) = pick(ctx, &candidate, tiers);
        let primary = picked.first().and_then(|a| ctx.candidates.iter().position(|c| c.address == *a));
        out.push(ShadowPick { slot: shadow.slot.clone(), primary });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> ScoringContext {
        ScoringContext {
            bucket: 4242,
            seed: 7,
            max_endpoints: 2,
            model: "tinyllama".into(),
            prompt_tokens: 900,
            max_tokens: 64,
            stream: true,
            candidates: (0..3)
                .map(|i| Candidate {
                    address: format!("10.0.0.{i}:8000"),
                    labels: vec![("attache.io/accelerator".into(), ["h100", "l4", "a10g"][i].into())],
                    waiting: i as f32,
                    ttft_ms: 100.0 * (i + 1) as f32,
                    prefix_hit: 0.5,
                    score: 1.0,
                    ..Default::default()
                })
                .collect(),
        }
    }

    #[test]
    fn context_and_sheet_round_trip() {
        let c = ctx();
        let bytes = c.encode();
        assert_eq!(ScoringContext::decode(&bytes).unwrap(), c);
        let mut s = ScoreSheet::default();
        s.put(ScoreEntry {
            slot: "slo".into(),
            arm: Arm::Canary,
            version: "ab12".into(),
            weight: 2.0,
            scores: vec![0.1, 0.9, 0.5],
            removed: vec![(1, "class l4".into())],
            chosen: None,
        });
        assert_eq!(ScoreSheet::decode(&s.encode()).unwrap(), s);
        // A version 2 sheet (no choice) and a version 1 sheet (no removals either) still decode:
        // each entry ends with its removals count (u16), then its choice (u16).
        let mut old = ScoreSheet::default();
        old.put(ScoreEntry { removed: Vec::new(), ..s.entries[0].clone() });
        let mut bytes = old.encode();
        bytes.truncate(bytes.len() - 2);
        bytes[1] = 2;
        assert_eq!(ScoreSheet::decode(&bytes).unwrap(), old, "version 2");
        bytes.truncate(bytes.len() - 2);
        bytes[1] = 1;
        assert_eq!(ScoreSheet::decode(&bytes).unwrap(), old, "version 1");
        assert_eq!(ScoreSheet::decode(b"").unwrap(), ScoreSheet::default());
    }

    #[test]
    fn custom_scores_order_candidates_within_the_schedulers_tiers() {
        use crate::pickers::tier;
        let c = ctx();
        let mut s = ScoreSheet::default();
        // A heavy scorer wants candidate 2; the affinity filter kept candidate 0 (the holder).
        s.put(ScoreEntry {
            slot: "cost".into(),
            arm: Arm::Stable,
            version: "v1".into(),
            weight: 10.0,
            scores: vec![0.0, 0.5, 1.0],
            removed: Vec::new(),
            chosen: None,
        });
        assert_eq!(pick(&c, &s, &[]).0, vec!["10.0.0.2:8000", "10.0.0.1:8000"]);
        let affine = [tier::AFFINE, tier::NONE, tier::NONE];
        assert_eq!(
            pick(&c, &s, &affine).0,
            vec!["10.0.0.0:8000", "10.0.0.2:8000"],
            "holder leads, scores pick fallbacks"
        );
        // Two holders: the scorer chooses between them.
        let two = [tier::AFFINE, tier::AFFINE, tier::NONE];
        assert_eq!(pick(&c, &s, &two).0, vec!["10.0.0.1:8000", "10.0.0.0:8000"]);
        // A sticky endpoint leads over the holders.
        let sticky = [tier::AFFINE, tier::STICKY, tier::NONE];
        assert_eq!(pick(&c, &s, &sticky).0[0], "10.0.0.1:8000");
        // Tiers of the wrong length are ignored, not misapplied.
        assert_eq!(pick(&c, &s, &[tier::AFFINE]).0[0], "10.0.0.2:8000");
    }

    #[test]
    fn a_filter_modules_removals_apply_across_tiers_unless_they_remove_everything() {
        use crate::pickers::tier;
        let c = ctx();
        let mut s = ScoreSheet::default();
        // A filter module removes candidate 0, the prefix holder the affinity filter kept.
        s.put(ScoreEntry {
            slot: "no-h100".into(),
            arm: Arm::Stable,
            version: "v1".into(),
            weight: 0.0,
            scores: vec![0.5, 0.5, 0.5],
            removed: vec![(0, "class h100".into())],
            chosen: None,
        });
        let affine = [tier::AFFINE, tier::NONE, tier::NONE];
        let (picked, _, removed) = pick(&c, &s, &affine);
        assert!(!picked.contains(&"10.0.0.0:8000"), "{picked:?}");
        assert_eq!(removed, 1);
        assert_eq!(removals(&c, &s), vec![true, false, false]);
        // Removing every candidate removes none.
        s.put(ScoreEntry {
            slot: "none".into(),
            arm: Arm::Stable,
            version: "v1".into(),
            weight: 0.0,
            scores: vec![0.5, 0.5, 0.5],
            removed: vec![(1, "x".into()), (2, "y".into()), (7, "out of range".into())],
            chosen: None,
        });
        let (picked, _, removed) = pick(&c, &s, &affine);
        assert_eq!((picked[0], removed), ("10.0.0.0:8000", 0));
    }

    #[test]
    fn a_shadow_entry_never_acts_and_its_pick_is_computed_beside_the_live_one() {
        let c = ctx();
        let entry = |arm, scores: Vec<f32>, removed| ScoreEntry {
            slot: "cost".into(),
            arm,
            version: "v".into(),
            weight: 10.0,
            scores,
            removed,
            chosen: None,
        };
        let mut s = ScoreSheet::default();
        s.put(entry(Arm::Stable, vec![0.0, 1.0, 0.0], Vec::new()));
        // The shadow prefers candidate 2 and removes candidate 1; it sits beside the live entry.
        s.put(entry(Arm::Shadow, vec![0.0, 0.0, 1.0], vec![(1, "class l4".into())]));
        assert_eq!(s.entries.len(), 2);
        assert!(s.has_shadow());
        let decoded = ScoreSheet::decode(&s.encode()).unwrap();
        assert_eq!(decoded, s);
        // Live: the stable entry alone routes, and nothing is removed.
        let (picked, _, removed) = pick(&c, &s, &[]);
        assert_eq!((picked[0], removed), ("10.0.0.1:8000", 0));
        assert_eq!(removals(&c, &s), vec![false; 3]);
        // Shadow: the slot's shadow entry in place of its live one.
        assert_eq!(shadow_picks(&c, &s, &[]), vec![ShadowPick { slot: "cost".into(), primary: Some(2) }]);
        // A second put of the slot's shadow replaces the first, not the live entry.
        s.put(entry(Arm::Shadow, vec![1.0, 0.0, 0.0], Vec::new()));
        assert_eq!(s.entries.len(), 2);
        assert_eq!(shadow_picks(&c, &s, &[])[0].primary, Some(0));
        assert_eq!(Arm::parse("shadow"), Some(Arm::Shadow));
    }

    #[test]
    fn a_picker_modules_choice_leads_within_the_leading_tier() {
        use crate::pickers::tier;
        let c = ctx();
        let mut s = ScoreSheet::default();
        s.put(ScoreEntry {
            slot: "pick".into(),
            arm: Arm::Stable,
            version: "v1".into(),
            weight: 0.0,
            scores: vec![0.0; 3],
            removed: Vec::new(),
            chosen: Some(2),
        });
        let decoded = ScoreSheet::decode(&s.encode()).unwrap();
        assert_eq!(decoded, s, "the choice round-trips");
        let (picked, _, _) = pick(&c, &s, &[]);
        assert_eq!(picked, vec!["10.0.0.2:8000", "10.0.0.1:8000"], "chosen first, the rest in order");
        // A candidate outside the leading tier is not chosen: the sticky endpoint stays first.
        let sticky = [tier::STICKY, tier::NONE, tier::NONE];
        assert_eq!(pick(&c, &s, &sticky).0[0], "10.0.0.0:8000");
        // A removed candidate is not chosen either.
        s.entries[0].removed = vec![(2, "drained".into())];
        assert_ne!(pick(&c, &s, &[]).0[0], "10.0.0.2:8000");
        // A shadow's choice acts on nothing.
        s.entries[0].removed.clear();
        s.entries[0].arm = Arm::Shadow;
        let unchosen = pick(&c, &ScoreSheet::default(), &[]).0;
        assert_eq!(pick(&c, &s, &[]).0, unchosen, "the shadow's choice changed the pick");
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        let bytes = ctx().encode();
        for cut in 0..bytes.len() {
            assert!(ScoringContext::decode(&bytes[..cut]).is_err(), "prefix of {cut} bytes decoded");
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert_eq!(ScoringContext::decode(&extra), Err(DecodeError::Trailing(1)));
        assert!(matches!(ScoringContext::decode(&[0x00, 1]), Err(DecodeError::BadMagic(0))));
        assert!(matches!(ScoreSheet::decode(&[SHEET_MAGIC, 9]), Err(DecodeError::BadVersion(9))));
        // A huge declared count with no data behind it must not allocate or loop long.
        let mut lying = vec![CONTEXT_MAGIC, VERSION];
        lying.extend_from_slice(&[0; 2 + 8 + 1 + 2 + 4 + 4 + 1]);
        lying.extend_from_slice(&u16::MAX.to_le_bytes());
        assert!(matches!(ScoringContext::decode(&lying), Err(DecodeError::Truncated(_))));
    }

    #[test]
    fn weighted_scores_change_the_pick_and_bad_entries_are_ignored() {
        let c = ctx();
        let mut s = ScoreSheet::default();
        // Equal built-in totals: the scorer decides.
        s.put(ScoreEntry {
            slot: "slo".into(),
            arm: Arm::Stable,
            version: "v1".into(),
            weight: 1.0,
            scores: vec![0.0, 0.0, 1.0],
            removed: Vec::new(),
            chosen: None,
        });
        assert_eq!(pick(&c, &s, &[]).0[0], "10.0.0.2:8000");
        // Replacing the slot's entry (canary after stable) keeps one entry per slot.
        s.put(ScoreEntry {
            slot: "slo".into(),
            arm: Arm::Canary,
            version: "v2".into(),
            weight: 1.0,
            scores: vec![1.0, 0.0, 0.0],
            removed: Vec::new(),
            chosen: None,
        });
        assert_eq!(s.entries.len(), 1);
        assert_eq!(pick(&c, &s, &[]).0[0], "10.0.0.0:8000");
        // Out-of-range and NaN scores are clamped, a wrong-length entry is ignored.
        s.put(ScoreEntry {
            slot: "x".into(),
            arm: Arm::Stable,
            version: "v".into(),
            weight: 5.0,
            scores: vec![f32::NAN, 9.0, -3.0],
            removed: Vec::new(),
            chosen: None,
        });
        s.put(ScoreEntry {
            slot: "bad".into(),
            arm: Arm::Stable,
            version: "v".into(),
            weight: 100.0,
            scores: vec![1.0],
            removed: Vec::new(),
            chosen: None,
        });
        let (totals, ignored) = combine(&c, &s);
        assert_eq!(ignored, 1);
        assert_eq!(totals, vec![2.0, 6.0, 1.0]);
        assert_eq!(pick(&c, &s, &[]).0, vec!["10.0.0.1:8000", "10.0.0.0:8000"]);
    }

    #[test]
    fn buckets_are_sticky_and_split_by_percent() {
        assert_eq!(bucket_of(b"session-1"), bucket_of(b"session-1"));
        let n = 20_000u32;
        let canary =
            (0..n).filter(|i| BucketRange::split(5.0).0.contains(bucket_of(format!("s{i}").as_bytes()))).count();
        let share = canary as f64 / f64::from(n);
        assert!((0.04..0.06).contains(&share), "5% canary got {share}");
        let (c, s) = BucketRange::split(5.0);
        assert_eq!((c.to, s.from, s.to), (500, 500, BUCKETS));
        assert!(!BucketRange::NONE.contains(0) && BucketRange::ALL.contains(BUCKETS - 1));
        assert_eq!(BucketRange::split(f64::NAN).0, BucketRange::NONE);
        assert_eq!(BucketRange::split(250.0).0, BucketRange::ALL);
    }
}
