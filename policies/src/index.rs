//! The approximate prefix index: which endpoints were sent which prefix blocks.
//!
//! It is learned from the scheduler's own decisions (llm-d's approximate mode), so it reflects
//! routing, not engine state. Memory is fixed when the index is made: a set-associative table
//! of `capacity` slots (32 bytes each), eight ways per bucket, least recently used way evicted.
//! Recording and matching a block touch one bucket and allocate nothing, and memory stays flat
//! however long the index has been filling.
//!
//! Long prompts are sampled: every block of the first [`DENSE_BLOCKS`] is recorded, then one
//! in [`STRIDE`], then the last. Chained hashes make this sound: a block's hash names its whole
//! prefix, so holding block `p` means holding every block before it. Past the dense head a
//! match length is exact to `STRIDE` blocks and never overstated, and a 100k-token prompt
//! touches about 250 buckets instead of 1,600.
//!
//! Engines evict. Where an engine reports how much it has written into its KV cache
//! ([`KvClock`]), each (block, endpoint) entry keeps that clock as of its last use, and a match
//! counts the block only while fewer than a cache's worth of tokens were written after it: the
//! engine's least-recently-used eviction, modelled without a list per endpoint.

use hashbrown::HashMap;

use crate::scratch::Buf;

/// Ways per bucket.
const WAYS: usize = 8;
/// Leading blocks that are all recorded (4,096 tokens at 64-token blocks).
pub const DENSE_BLOCKS: usize = 64;
/// Past the dense head, one block in this many is recorded.
pub const STRIDE: usize = 8;

/// The positions of an `n`-block prompt that the index records and probes, in order: the
/// dense head, one in [`STRIDE`] after it, the last block, and the caller's `anchors` (blocks
/// that end a message, where prompts that share a prefix diverge: a match is exact there).
fn sampled(n: usize, anchors: &[usize]) -> impl Iterator<Item = usize> + '_ {
    let dense = 0..n.min(DENSE_BLOCKS);
    let strided = (DENSE_BLOCKS + STRIDE - 1..n.saturating_sub(1)).step_by(STRIDE);
    let last = (n > DENSE_BLOCKS).then(|| n - 1);
    Merged::new(dense.chain(strided).chain(last), anchors.iter().copied().filter(move |&a| a >= DENSE_BLOCKS && a < n))
}

/// Two ascending runs of positions merged into one, ascending and without repeats, with no
/// buffer: a decision walks its probe points once per lookup, and a list of them per lookup
/// would be an allocation each. A position not above the last one given is skipped, so runs
/// out of order lose positions rather than repeat them.
struct Merged<A: Iterator<Item = usize>, B: Iterator<Item = usize>> {
    a: std::iter::Peekable<A>,
    b: std::iter::Peekable<B>,
    last: Option<usize>,
}

impl<A: Iterator<Item = usize>, B: Iterator<Item = usize>> Merged<A, B> {
    fn new(a: A, b: B) -> Self {
        Self { a: a.peekable(), b: b.peekable(), last: None }
    }
}

impl<A: Iterator<Item = usize>, B: Iterator<Item = usize>> Iterator for Merged<A, B> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        loop {
            let next = match (self.a.peek(), self.b.peek()) {
                (Some(&x), Some(&y)) if y < x => self.b.next(),
                (Some(_), _) => self.a.next(),
                (None, _) => self.b.next(),
            }?;
            if self.last.is_none_or(|l| next > l) {
                self.last = Some(next);
                return Some(next);
            }
        }
    }
}

/// How many leading blocks a prompt of `n` blocks may share with an endpoint that
/// [`ApproxPrefixIndex::match_lengths`] proved holds `matched`: past the dense blocks only
/// sampled positions are recorded, so the shared run can extend up to, not including, the next
/// sampled position. Exact where positions are dense (and at anchors).
pub fn match_upper_bound(n: usize, anchors: &[usize], matched: usize) -> usize {
    if matched == 0 || matched >= n {
        return matched.min(n);
    }
    sampled(n, anchors).find(|&p| p >= matched).unwrap_or(n)
}

/// Endpoints remembered per block.
const MAX_ENDPOINTS_PER_BLOCK: usize = 8;
/// More endpoints than this in the interner and it is reset (with the index): a bound, not a
/// limit any real pool reaches.
const MAX_INTERNED: usize = u16::MAX as usize;

/// An engine's KV cache as the index models it: `written`, the tokens it has written into its
/// cache so far (a clock that only moves forward while the engine lives), and `holds`, how
/// many tokens of writes a block survives. vLLM evicts the least recently used free block
/// first, so a block last used more than `holds` tokens of writes ago is taken as evicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvClock {
    pub written: u64,
    pub holds: u64,
}

impl KvClock {
    /// Whether a block last used at `stamp` (this clock modulo 2^32) is still held. A stamp
    /// ahead of the clock (the snapshot has not caught up with this scheduler's own recent
    /// decisions) counts as just used.
    fn still_holds(&self, stamp: u32) -> bool {
        let age = (self.written as u32).wrapping_sub(stamp) as i32;
        u64::from(age.max(0).unsigned_abs()) < self.holds
    }
}

crate::scratch::pooled!((u16, Option<KvClock>));

/// The endpoints' clocks during one match, each looked up once (by its name in the table).
struct Clocks<F> {
    clock: F,
    seen: Buf<(u16, Option<KvClock>)>,
}

impl<F: Fn(&str) -> Option<KvClock>> Clocks<F> {
    fn new(clock: F) -> Self {
        Self { clock, seen: Buf::take() }
    }

    /// Whether endpoint `id` (named `name`) still holds a block it used at `stamp`: yes when
    /// its engine has no clock.
    fn still_hold(&mut self, id: u16, name: Option<&String>, stamp: u32) -> bool {
        let c = match self.seen.iter().find(|(x, _)| *x == id) {
            Some((_, c)) => *c,
            None => {
                let c = name.and_then(|a| (self.clock)(a));
                self.seen.push((id, c));
                c
            }
        };
        c.is_none_or(|c| c.still_holds(stamp))
    }
}

/// One block: its hash, when it was last used, and the endpoints it was routed to.
#[derive(Clone, Copy, Default)]
struct Slot {
    hash: u64,
    stamp: u32,
    /// Endpoints in `ids`; 0 marks an empty slot.
    n: u16,
    ids: [u16; MAX_ENDPOINTS_PER_BLOCK],
}

impl Slot {
    /// Drop `id` from the block; true when that empties the slot.
    /// `written` is the slot's row of write clocks, kept in step with `ids`.
    fn remove(&mut self, id: u16, written: &mut Written) -> bool {
        let n = usize::from(self.n);
        let Some(p) = self.ids[..n].iter().position(|&x| x == id) else { return false };
        self.ids.copy_within(p + 1..n, p);
        written.copy_within(p + 1..n, p);
        self.n -= 1;
        self.n == 0
    }

    /// `id` used the block at its write clock `clock` (0 when it has none).
    fn add(&mut self, id: u16, clock: u32, written: &mut Written) {
        let n = usize::from(self.n);
        if let Some(p) = self.ids[..n].iter().position(|&x| x == id) {
            written[p] = clock;
            return;
        }
        if n == MAX_ENDPOINTS_PER_BLOCK {
            // Forget the endpoint that has held the block longest.
            self.ids.copy_within(1.., 0);
            written.copy_within(1.., 0);
            self.ids[n - 1] = id;
            written[n - 1] = clock;
        } else {
            self.ids[n] = id;
            written[n] = clock;
            self.n += 1;
        }
    }
}

/// For each endpoint of a slot, its [`KvClock`] (modulo 2^32) when it last used the block.
type Written = [u32; MAX_ENDPOINTS_PER_BLOCK];

/// Index from block hash to the endpoints (by address) that were sent that block.
pub struct ApproxPrefixIndex {
    slots: Vec<Slot>,
    /// Parallel to `slots`, read only for a slot a probe found: finding a block scans its
    /// bucket's slots alone, half a kilobyte less than with the clocks inline.
    written: Vec<Written>,
    buckets: usize,
    len: usize,
    /// Advances once per recorded request; slots keep the clock of their last use.
    clock: u32,
    ids: HashMap<String, u16>,
    names: Vec<String>,
}

#[inline]
fn bucket_of(hash: u64, buckets: usize) -> usize {
    // Lemire's multiply-shift reduction over a mixed hash.
    let h = hash.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((u128::from(h) * buckets as u128) >> 64) as usize
}

impl ApproxPrefixIndex {
    /// An index of at most `capacity` blocks (rounded down to a multiple of 8, at least 8).
    pub fn new(capacity: usize) -> Self {
        let buckets = (capacity / WAYS).max(1);
        Self {
            slots: vec![Slot::default(); buckets * WAYS],
            written: vec![[0; MAX_ENDPOINTS_PER_BLOCK]; buckets * WAYS],
            buckets,
            len: 0,
            clock: 0,
            ids: HashMap::new(),
            names: Vec::new(),
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Blocks the index can hold.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    fn clear(&mut self) {
        self.slots.fill(Slot::default());
        self.written.fill([0; MAX_ENDPOINTS_PER_BLOCK]);
        self.len = 0;
        self.clock = 0;
        self.ids.clear();
        self.names.clear();
    }

    fn intern(&mut self, address: &str) -> u16 {
        if let Some(id) = self.ids.get(address) {
            return *id;
        }
        if self.names.len() >= MAX_INTERNED {
            self.clear();
        }
        let id = self.names.len() as u16;
        self.names.push(address.to_owned());
        self.ids.insert(address.to_owned(), id);
        id
    }

    fn bucket(&self, hash: u64) -> std::ops::Range<usize> {
        let b = bucket_of(hash, self.buckets) * WAYS;
        b..b + WAYS
    }

    fn find(&self, hash: u64) -> Option<usize> {
        self.bucket(hash).find(|&i| self.slots[i].n > 0 && self.slots[i].hash == hash)
    }

    /// Record that the blocks `hashes` were routed to `address`; `anchors` are the block
    /// positions that end a message ([`crate::prefix::anchor_blocks`]), recorded as well.
    pub fn record(&mut self, hashes: &[u64], anchors: &[usize], address: &str) {
        self.record_at(hashes, anchors, address, None);
    }

    /// [`Self::record`], with the endpoint's KV write clock at the decision (`written`, see
    /// [`KvClock`]) when its engine reports one.
    pub fn record_at(&mut self, hashes: &[u64], anchors: &[usize], address: &str, written: Option<u64>) {
        let id = self.intern(address);
        if self.clock == u32::MAX {
            // Four billion requests: start the recency order afresh rather than wrap it.
            self.clear();
            return self.record_at(hashes, anchors, address, written);
        }
        let stamp = written.map_or(0, |w| w as u32);
        self.clock += 1;
        for h in sampled(hashes.len(), anchors).map(|p| hashes[p]) {
            let i = match self.find(h) {
                Some(i) => i,
                None => {
                    let range = self.bucket(h);
                    let i = range
                        .clone()
                        .find(|&i| self.slots[i].n == 0)
                        .unwrap_or_else(|| range.min_by_key(|&i| self.slots[i].stamp).unwrap_or(0));
                    if self.slots[i].n == 0 {
                        self.len += 1;
                    }
                    self.slots[i] = Slot { hash: h, ..Slot::default() };
                    i
                }
            };
            let slot = &mut self.slots[i];
            slot.add(id, stamp, &mut self.written[i]);
            slot.stamp = self.clock;
        }
    }

    /// For each endpoint address, the number of leading blocks of `hashes` it holds
    /// consecutively from the start. Stops as soon as no endpoint continues the run. Reading
    /// changes nothing: the decision's [`Self::record`] marks the request's blocks used (they
    /// are the last to be evicted from their bucket), the matched ones included.
    /// `anchors` are probed too, as [`Self::record`] recorded them.
    pub fn match_lengths(&self, hashes: &[u64], anchors: &[usize]) -> HashMap<&str, usize> {
        self.match_lengths_at(hashes, anchors, |_| None)
    }

    /// [`Self::match_lengths`], counting a block as held by an endpoint only while its engine's
    /// cache can still hold it: `clock` gives an endpoint's [`KvClock`] by address (`None`: no
    /// model of its cache, every recorded block counts, as in [`Self::match_lengths`]).
    pub fn match_lengths_at(
        &self,
        hashes: &[u64],
        anchors: &[usize],
        clock: impl Fn(&str) -> Option<KvClock>,
    ) -> HashMap<&str, usize> {
        // (endpoint, blocks confirmed so far); a run continues only through every probe.
        let mut run = Buf::<(u16, usize)>::take();
        let mut clocks = Clocks::new(clock);
        let mut confirmed = 0;
        for p in sampled(hashes.len(), anchors) {
            let Some(s) = self.find(hashes[p]) else { break };
            let slot = &self.slots[s];
            let mut any = false;
            let written = self.written.get(s).copied().unwrap_or_default();
            for (&id, &stamp) in slot.ids[..usize::from(slot.n)].iter().zip(&written) {
                if !clocks.still_hold(id, self.names.get(usize::from(id)), stamp) {
                    continue;
                }
                if p == 0 {
                    run.push((id, 1));
                    any = true;
                } else if let Some((_, n)) = run.iter_mut().find(|(x, _)| *x == id) {
                    if *n == confirmed {
                        *n = p + 1;
                        any = true;
                    }
                }
            }
            if !any {
                break;
            }
            confirmed = p + 1;
        }
        run.iter().filter_map(|&(id, n)| self.names.get(usize::from(id)).map(|a| (a.as_str(), n))).collect()
    }

    /// Undo what [`Self::record`] taught about `address` for the blocks from position `from`
    /// on (those it did not hold before): another endpoint turned out to serve them.
    pub fn unrecord(&mut self, hashes: &[u64], anchors: &[usize], from: usize, address: &str) {
        let Some(id) = self.ids.get(address).copied() else { return };
        for h in sampled(hashes.len(), anchors).filter(|&p| p >= from).map(|p| hashes[p]) {
            if let Some(i) = self.find(h) {
                if self.slots[i].remove(id, &mut self.written[i]) {
                    self.len -= 1;
                }
            }
        }
    }

    /// Forget an endpoint (it left the pool).
    pub fn forget(&mut self, address: &str) {
        let Some(id) = self.ids.get(address).copied() else { return };
        for (slot, written) in self.slots.iter_mut().zip(self.written.iter_mut()) {
            if slot.remove(id, written) {
                self.len -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_forgotten_once_a_cache_worth_of_writes_followed_it() {
        let mut ix = ApproxPrefixIndex::new(1_000);
        let a: Vec<u64> = (0..4).collect();
        ix.record_at(&a, &[], "e", Some(10_000));
        ix.record_at(&a[..2], &[], "f", Some(500));
        let at = |e: u64, f: u64| {
            move |addr: &str| match addr {
                "e" => Some(KvClock { written: e, holds: 1_000 }),
                "f" => Some(KvClock { written: f, holds: 1_000 }),
                _ => None,
            }
        };
        let m = ix.match_lengths_at(&a, &[], at(10_999, 1_499));
        assert_eq!((m.get("e"), m.get("f")), (Some(&4), Some(&2)), "within a cache's worth of writes");
        drop(m);
        let m = ix.match_lengths_at(&a, &[], at(11_000, 1_499));
        assert_eq!((m.get("e"), m.get("f")), (None, Some(&2)), "e wrote 1,000 tokens since: evicted");
        drop(m);
        // A snapshot behind this scheduler's own decision: the block was just used.
        assert_eq!(ix.match_lengths_at(&a, &[], at(9_000, 400)).len(), 2);
        // No clock for an endpoint: every recorded block counts, as without the model.
        assert_eq!(ix.match_lengths_at(&a, &[], |_| None), ix.match_lengths(&a, &[]));
        // Using a block again moves its clock: it survives another cache's worth.
        ix.record_at(&a, &[], "e", Some(10_900));
        assert_eq!(ix.match_lengths_at(&a, &[], at(11_500, 0)).get("e"), Some(&4));
        // The clock wraps at 2^32 without forgetting.
        let mut w = ApproxPrefixIndex::new(100);
        w.record_at(&a, &[], "e", Some(u64::from(u32::MAX) - 10));
        let c = |written| move |_: &str| Some(KvClock { written, holds: 100 });
        assert_eq!(w.match_lengths_at(&a, &[], c(u64::from(u32::MAX) + 50)).get("e"), Some(&4));
        assert!(w.match_lengths_at(&a, &[], c(u64::from(u32::MAX) + 95)).is_empty());
    }

    #[test]
    fn unrecording_keeps_what_the_endpoint_held_before() {
        let mut ix = ApproxPrefixIndex::new(1_000);
        let a: Vec<u64> = (0..8).collect();
        ix.record(&a[..4], &[], "e");
        ix.record(&a, &[], "e");
        ix.record(&a, &[], "f");
        ix.unrecord(&a, &[], 4, "e");
        let m = ix.match_lengths(&a, &[]);
        assert_eq!((m["e"], m["f"]), (4, 8));
        drop(m);
        ix.unrecord(&a, &[], 0, "f");
        ix.unrecord(&a, &[], 0, "e");
        assert!(ix.match_lengths(&a, &[]).is_empty() && ix.is_empty());
        ix.unrecord(&a, &[], 0, "never-seen");
    }

    #[test]
    fn a_strided_match_is_bounded_by_the_next_sampled_block() {
        // 113 blocks that share their first 93 with a recorded prompt: the probes confirm 88
        // (the last sampled block before they diverge is 87), the next probe, 95, fails.
        let a: Vec<u64> = (0..113).collect();
        let b: Vec<u64> = (0..113).map(|i| if i < 93 { i } else { 1_000 + i }).collect();
        let mut ix = ApproxPrefixIndex::new(1_000);
        ix.record(&a, &[], "e");
        let m = ix.match_lengths(&b, &[])["e"];
        assert_eq!(m, 88);
        assert_eq!(match_upper_bound(113, &[], m), 95);
        // Dense positions and anchors are exact; nothing and everything stay as they are.
        assert_eq!(match_upper_bound(113, &[], 40), 40);
        assert_eq!(match_upper_bound(113, &[90], 88), 90);
        assert_eq!(match_upper_bound(113, &[], 0), 0);
        assert_eq!(match_upper_bound(113, &[], 113), 113);
    }

    #[test]
    fn consecutive_prefix_per_endpoint() {
        let mut ix = ApproxPrefixIndex::new(100);
        ix.record(&[1, 2, 3], &[], "a:1");
        ix.record(&[1, 2], &[], "b:1");
        ix.record(&[9, 3], &[], "c:1"); // holds block 3 but not 1,2: no leading run
        let m = ix.match_lengths(&[1, 2, 3, 4], &[]);
        assert_eq!(m.get("a:1"), Some(&3));
        assert_eq!(m.get("b:1"), Some(&2));
        assert_eq!(m.get("c:1"), None);
        assert!(ix.match_lengths(&[7, 1], &[]).is_empty());
    }

    #[test]
    fn bounded_and_evicts_the_least_recently_used() {
        let mut ix = ApproxPrefixIndex::new(10);
        assert_eq!(ix.capacity(), 8, "one bucket of eight ways");
        for i in 0..8u64 {
            ix.record(&[i], &[], "a:1");
        }
        assert_eq!(ix.len(), 8);
        // A decision that uses block 0 records it again: block 1 becomes the least recently used.
        assert_eq!(ix.match_lengths(&[0], &[]).get("a:1"), Some(&1));
        ix.record(&[0], &[], "a:1");
        ix.record(&[100], &[], "a:1");
        assert_eq!(ix.len(), 8);
        assert_eq!(ix.match_lengths(&[0], &[]).get("a:1"), Some(&1));
        assert!(ix.match_lengths(&[1], &[]).is_empty());
        for i in 200..300u64 {
            ix.record(&[i], &[], "a:1");
        }
        assert_eq!(ix.len(), 8);
        assert_eq!(ix.match_lengths(&[299], &[]).get("a:1"), Some(&1));
        ix.forget("a:1");
        assert!(ix.match_lengths(&[299], &[]).is_empty());
        assert_eq!(ix.len(), 0);
    }

    #[test]
    fn a_block_remembers_its_latest_endpoints() {
        let mut ix = ApproxPrefixIndex::new(64);
        for e in 0..10 {
            ix.record(&[5], &[], &format!("e:{e}"));
        }
        let m = ix.match_lengths(&[5], &[]);
        assert_eq!(m.len(), MAX_ENDPOINTS_PER_BLOCK);
        assert!(m.contains_key("e:9") && m.contains_key("e:2"));
        assert!(!m.contains_key("e:0") && !m.contains_key("e:1"));
        drop(m);
        ix.forget("e:5");
        assert_eq!(ix.match_lengths(&[5], &[]).len(), MAX_ENDPOINTS_PER_BLOCK - 1);
        assert_eq!(ix.len(), 1);
    }

    #[test]
    fn long_prompts_are_sampled_and_never_overstated() {
        let mut ix = ApproxPrefixIndex::new(8_192);
        let a: Vec<u64> = (1..=1_000u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
        ix.record(&a, &[], "a:1");
        let recorded = sampled(1_000, &[]).count();
        assert_eq!(ix.len(), recorded);
        assert_eq!(recorded, 64 + (998 - 71) / 8 + 1 + 1, "dense head, every 8th, the last");
        assert_eq!(ix.match_lengths(&a, &[]).get("a:1"), Some(&1_000), "a full match is exact");
        // A prompt that shares 500 blocks then diverges: the match is the last probe inside
        // the shared part, at most STRIDE - 1 short, never longer.
        let mut b = a[..500].to_vec();
        b.extend((0..300u64).map(|i| i ^ 0xdead_beef));
        let m = *ix.match_lengths(&b, &[]).get("a:1").unwrap();
        assert!(m <= 500 && m > 500 - STRIDE, "{m}");
        // The dense head is exact.
        let mut c = a[..40].to_vec();
        c.extend((0..30u64).map(|i| i ^ 0xfeed));
        assert_eq!(ix.match_lengths(&c, &[]).get("a:1"), Some(&40));
    }

    #[test]
    fn an_anchor_makes_a_match_exact_where_a_message_ends() {
        // A 94-block system message, then each request's own question: without an anchor the
        // shared part reads as 88 blocks (the last sampled probe), with one it reads as 94.
        let system: Vec<u64> = (1..=94u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
        let ask = |q: u64| {
            let mut v = system.clone();
            v.extend((0..20u64).map(|i| (q << 32) ^ i ^ 0xabcd));
            v
        };
        let anchors = [93];
        let mut plain = ApproxPrefixIndex::new(8_192);
        plain.record(&ask(1), &[], "a:1");
        assert_eq!(plain.match_lengths(&ask(2), &[]).get("a:1"), Some(&88), "sampled: 7 blocks short");
        let mut anchored = ApproxPrefixIndex::new(8_192);
        anchored.record(&ask(1), &anchors, "a:1");
        assert_eq!(anchored.match_lengths(&ask(2), &anchors).get("a:1"), Some(&94));
        // An anchor never overstates: a prompt that diverges inside the message stops earlier.
        let mut early = system[..80].to_vec();
        early.extend((0..34u64).map(|i| i ^ 0x5555));
        let m = *anchored.match_lengths(&early, &anchors).get("a:1").unwrap_or(&0);
        assert!(m <= 80 && m > 80 - STRIDE, "{m}");
    }

    #[test]
    fn a_large_index_keeps_most_of_what_fits() {
        let mut ix = ApproxPrefixIndex::new(80_000);
        let hashes: Vec<u64> = (1..=40_000u64).map(|i| i.wrapping_mul(0xff51_afd7_ed55_8ccd)).collect();
        for chunk in hashes.chunks(DENSE_BLOCKS) {
            ix.record(chunk, &[], "a:1");
        }
        // Half full: hashing spreads blocks so that almost no bucket overflows.
        assert!(ix.len() > 39_000, "{}", ix.len());
        let m = ix.match_lengths(&hashes[..100], &[]);
        assert_eq!(m.get("a:1"), Some(&100));
    }
}

/// Leading-block counts up to which the affinity table probes by doubling (1, 2, 4, 8, 16);
/// past it, probes are at most an eighth of the run apart.
const TABLE_DOUBLING_UNTIL: usize = 16;

/// Block positions recorded in and probed from the affinity table: 0, 1, 3, 7, 15, then every
/// eighth of the run so far (17, 19, …, 31, 35, …, 63, 71, …) and the last block, plus the
/// `anchors` (blocks that end a message, [`crate::prefix::anchor_blocks`]), so a match learned
/// from another worker is exact where prompts that share messages diverge and, elsewhere, short
/// of the shared run by less than an eighth past 16 blocks ([`table_match_upper_bound`]). A hit
/// at position `i` proves the endpoint was sent the first `i + 1` blocks.
pub fn probe_points(n_blocks: usize, anchors: &[usize]) -> impl Iterator<Item = usize> + '_ {
    // Doubling, then growing by an eighth, to the last block (which ends the run either way:
    // the merge drops it when the growth lands on it).
    let growth = std::iter::successors(Some(1usize), move |&c| {
        Some(if c < TABLE_DOUBLING_UNTIL { c.saturating_mul(2) } else { c.saturating_add(c / 8) })
            .filter(|&next| next <= n_blocks)
    })
    .take_while(move |&c| c <= n_blocks)
    .map(|c| c - 1);
    let points = growth.chain(n_blocks.checked_sub(1));
    Merged::new(points, anchors.iter().copied().filter(move |&a| a < n_blocks))
}

/// How many leading blocks a prompt of `n` blocks may share with an endpoint that
/// [`AffinityTable::matches`] proved holds `matched`: up to, not including, the next probe
/// point (the table's counterpart of [`match_upper_bound`]).
pub fn table_match_upper_bound(n: usize, anchors: &[usize], matched: usize) -> usize {
    if matched == 0 || matched >= n {
        return matched.min(n);
    }
    probe_points(n, anchors).find(|&p| p >= matched).unwrap_or(n)
}

/// The `(block hash)` entries a decision adds to the affinity table: its probe points past the
/// `known` leading blocks the table already proves for its endpoint ([`AffinityTable::matches`];
/// 0 adds them all). A repeated prefix then adds nothing, and a new question on a known system
/// prompt adds only its own tail.
pub fn shared_entries(hashes: &[u64], anchors: &[usize], known: usize) -> Vec<u64> {
    // Sized once: about 20 probe points per thousand blocks, plus the anchors.
    let mut out = Vec::with_capacity(32 + anchors.len());
    out.extend(probe_points(hashes.len(), anchors).filter(|&i| i + 1 > known).filter_map(|i| hashes.get(i)).copied());
    out
}

/// What every Envoy worker learns of the others' decisions: a bounded, direct-mapped table of
/// `slots` entries, block hash → the endpoint it was routed to. Each worker holds its own copy,
/// fed by its own decisions at once and by the other workers' from its tick (the filter's
/// affinity log), so a request reads only this worker's memory. A colliding hash overwrites,
/// so the table never holds more than `slots` entries (16 bytes each). An entry stored with
/// its endpoint's KV write clock ([`KvClock`]) stops counting once the engine has written a
/// cache's worth after it, as in [`ApproxPrefixIndex::match_lengths_at`].
pub struct AffinityTable {
    /// `(hash, endpoint id + 1, clock stamp)`; id 0 marks an empty slot.
    slots: Vec<(u64, u16, Stamp)>,
    ids: HashMap<String, u16>,
    names: Vec<String>,
}

/// An entry's KV write clock (modulo 2^32), when it was stored with one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Stamp(Option<u32>);

impl AffinityTable {
    /// A table of `slots` entries (0: a table that holds nothing).
    pub fn new(slots: u64) -> Self {
        Self { slots: vec![(0, 0, Stamp(None)); slots as usize], ids: HashMap::new(), names: Vec::new() }
    }

    /// Entries the table can hold.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.slots.iter().filter(|(_, id, _)| *id != 0).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn slot_of(&self, hash: u64) -> Option<usize> {
        let n = self.slots.len() as u64;
        (n > 0).then(|| (hash % n) as usize)
    }

    fn intern(&mut self, endpoint: &str) -> u16 {
        if let Some(id) = self.ids.get(endpoint) {
            return *id;
        }
        if self.names.len() >= usize::from(u16::MAX) - 1 {
            // More distinct endpoints than any pool has: start afresh rather than wrap ids.
            self.slots.fill((0, 0, Stamp(None)));
            self.ids.clear();
            self.names.clear();
        }
        self.names.push(endpoint.to_owned());
        let id = self.names.len() as u16;
        self.ids.insert(endpoint.to_owned(), id);
        id
    }

    /// Record that the block `hash` (and so its whole prefix) was routed to `endpoint`.
    pub fn store(&mut self, hash: u64, endpoint: &str) {
        self.store_at(hash, endpoint, None);
    }

    /// [`Self::store`], with the endpoint's KV write clock when it was routed there.
    pub fn store_at(&mut self, hash: u64, endpoint: &str, written: Option<u64>) {
        if endpoint.is_empty() {
            return;
        }
        let Some(s) = self.slot_of(hash) else { return };
        let id = self.intern(endpoint);
        self.slots[s] = (hash, id, Stamp(written.map(|w| w as u32)));
    }

    /// Record a whole decision: every probe point of `hashes` (and `anchors`).
    pub fn record(&mut self, hashes: &[u64], anchors: &[usize], endpoint: &str) {
        for h in shared_entries(hashes, anchors, 0) {
            self.store(h, endpoint);
        }
    }

    /// Endpoints the table says hold a prefix of `hashes`, with the number of leading blocks
    /// proven: the deepest probe point that matches, per endpoint, even past a probe whose
    /// slot a colliding entry took. `anchors` are probed
    /// too ([`probe_points`]).
    pub fn matches(&self, hashes: &[u64], anchors: &[usize]) -> HashMap<&str, usize> {
        self.matches_at(hashes, anchors, |_| None)
    }

    /// [`Self::matches`], skipping entries whose engine has since written a cache's worth
    /// (`clock` by endpoint address, as for [`ApproxPrefixIndex::match_lengths_at`]).
    pub fn matches_at(
        &self,
        hashes: &[u64],
        anchors: &[usize],
        clock: impl Fn(&str) -> Option<KvClock>,
    ) -> HashMap<&str, usize> {
        let mut found = Buf::<(u16, usize)>::take();
        let mut clocks = Clocks::new(clock);
        let mut held = |id: u16, stamp: Stamp| match stamp {
            Stamp(Some(stamp)) => clocks.still_hold(id, self.names.get(usize::from(id).wrapping_sub(1)), stamp),
            Stamp(None) => true,
        };
        for i in probe_points(hashes.len(), anchors) {
            let Some(h) = hashes.get(i) else { break };
            let Some(s) = self.slot_of(*h) else { break };
            match self.slots[s] {
                (stored, id, stamp) if id != 0 && stored == *h && held(id, stamp) => {
                    match found.iter_mut().find(|(x, _)| *x == id) {
                        Some((_, n)) => *n = (*n).max(i + 1),
                        None => found.push((id, i + 1)),
                    }
                }
                // A miss does not end the walk: a later decision whose block collided with this
                // one overwrote its slot, and a deeper hit still proves the whole prefix (a
                // block's hash chains every block before it). Past a real divergence the deeper
                // probes miss too.
                _ => {}
            }
        }
        found.iter().filter_map(|&(id, n)| self.names.get(usize::from(id) - 1).map(|a| (a.as_str(), n))).collect()
    }
}

#[cfg(test)]
mod shared_tests {
    use super::*;

    #[test]
    fn positions_merge_anchors_as_a_sorted_deduplicated_list_would() {
        // The merged iterators against the list they replace: the base positions and the
        // anchors in range, sorted, without repeats.
        let mut seed = 7u64;
        let mut next = |m: usize| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) as usize % m.max(1)
        };
        for _ in 0..500 {
            let n = next(3_000);
            let mut anchors: Vec<usize> = (0..next(12)).map(|_| next(n + 10)).collect();
            anchors.sort_unstable();
            anchors.dedup();
            let reference = |base: Vec<usize>, keep: &dyn Fn(usize) -> bool| {
                let mut v: Vec<usize> = base.into_iter().chain(anchors.iter().copied().filter(|&a| keep(a))).collect();
                v.sort_unstable();
                v.dedup();
                v
            };
            let dense: Vec<usize> = (0..n.min(DENSE_BLOCKS))
                .chain((DENSE_BLOCKS + STRIDE - 1..n.saturating_sub(1)).step_by(STRIDE))
                .chain((n > DENSE_BLOCKS).then(|| n - 1))
                .collect();
            let want = reference(dense, &|a| a >= DENSE_BLOCKS && a < n);
            assert_eq!(sampled(n, &anchors).collect::<Vec<_>>(), want, "sampled({n}, {anchors:?})");
            let mut growth = Vec::new();
            let mut c = 1usize;
            while c <= n {
                growth.push(c - 1);
                c = if c < TABLE_DOUBLING_UNTIL { c * 2 } else { c + c / 8 };
            }
            growth.extend(n.checked_sub(1));
            let want = reference(growth, &|a| a < n);
            assert_eq!(probe_points(n, &anchors).collect::<Vec<_>>(), want, "probe_points({n}, {anchors:?})");
        }
    }

    #[test]
    fn probe_points_are_logarithmic_and_end_at_the_last_block() {
        let probe_points = |n, a: &[usize]| probe_points(n, a).collect::<Vec<_>>();
        assert_eq!(probe_points(0, &[]), Vec::<usize>::new());
        assert_eq!(probe_points(1, &[]), vec![0]);
        assert_eq!(probe_points(10, &[]), vec![0, 1, 3, 7, 9]);
        assert_eq!(probe_points(16, &[]), vec![0, 1, 3, 7, 15]);
        assert_eq!(probe_points(40, &[]), vec![0, 1, 3, 7, 15, 17, 19, 21, 23, 26, 29, 32, 36, 39]);
        // Past 16 blocks consecutive probes are at most an eighth of the run apart.
        let p = probe_points(2_000, &[]);
        assert!(p.windows(2).all(|w| w[1] < 16 || (w[1] - w[0]) * 8 <= w[0] + 1), "{p:?}");
        assert!(p.len() < 60, "logarithmic: {} probes for 2,000 blocks", p.len());
    }

    #[test]
    fn a_table_entry_stops_counting_once_its_engine_wrote_a_cache_worth() {
        let mut t = AffinityTable::new(64);
        let h: Vec<u64> = (0..4).collect();
        for &x in &h {
            t.store_at(x, "e", Some(1_000));
            t.store(x + 100, "e");
        }
        let at = |written| move |_: &str| Some(KvClock { written, holds: 500 });
        assert_eq!(t.matches_at(&h, &[], at(1_499)).get("e"), Some(&4));
        assert!(t.matches_at(&h, &[], at(1_500)).is_empty(), "500 tokens written since: evicted");
        assert_eq!(t.matches_at(&h, &[], |_| None).get("e"), Some(&4), "no clock: as stored");
        let old: Vec<u64> = (100..104).collect();
        assert_eq!(t.matches_at(&old, &[], at(1_000_000)).get("e"), Some(&4), "stored without a clock: kept");
    }

    #[test]
    fn a_table_match_is_bounded_by_the_next_probe() {
        // A prompt of 200 blocks sharing its first 161 (80.5%) with what another worker sent.
        let (n, shared) = (200, 161);
        let last_below = |k: usize| probe_points(n, &[]).filter(|&p| p < k).last().unwrap_or(0) + 1;
        let confirmed = last_below(shared);
        assert_eq!(confirmed, 144, "the table proves 144 blocks: 0.72, under the 0.8 gate");
        let bound = table_match_upper_bound(n, &[], confirmed);
        assert_eq!(bound, 161, "it may hold up to the next probe, block 161: 0.805");
        // A 59% match (a shared preamble) stays under the gate.
        let weak = last_below(118);
        assert!((table_match_upper_bound(n, &[], weak) as f64 / n as f64) < 0.8);
        // Anchors are probes too: a match that ends at one is bounded by the probe after it.
        assert_eq!(table_match_upper_bound(n, &[150], 151), 161);
        assert_eq!(table_match_upper_bound(n, &[], 0), 0);
        assert_eq!(table_match_upper_bound(n, &[], n), n);
    }

    #[test]
    fn entries_the_table_already_proves_are_not_added_again() {
        let mut m = AffinityTable::new(4096);
        let system: Vec<u64> = (100..116).collect();
        m.record(&system, &[], "e1:1");
        // The same prompt again: the table proves all 16 blocks, so nothing is added.
        let known = m.matches(&system, &[]).get("e1:1").copied().unwrap_or(0);
        assert_eq!(known, 16);
        assert!(shared_entries(&system, &[], known).is_empty());
        // A new question after the system prompt: only the probe points past block 16.
        let mut asked = system.clone();
        asked.extend(900..920);
        let known = m.matches(&asked, &[]).get("e1:1").copied().unwrap_or(0);
        assert_eq!(known, 16, "probes 0, 1, 3, 7, 15 hold; 17 is new");
        let tail = shared_entries(&asked, &[], known);
        assert_eq!(tail, [17, 19, 21, 23, 26, 29, 32, 35].map(|i| asked[i]).to_vec());
        for h in tail {
            m.store(h, "e1:1");
        }
        // Added that way, the table proves the whole new prompt, as a full record would.
        assert_eq!(m.matches(&asked, &[]).get("e1:1"), Some(&36));
    }

    #[test]
    fn an_anchor_makes_a_match_learned_from_another_worker_exact_at_a_message_end() {
        let system: Vec<u64> = (1..=94u64).collect();
        let ask = |q: u64| {
            let mut v = system.clone();
            v.extend((0..20u64).map(|i| 10_000 * q + i));
            v
        };
        let anchors = [93];
        let mut m = AffinityTable::new(1 << 16);
        m.record(&ask(1), &anchors, "e1:1");
        assert_eq!(m.matches(&ask(2), &[]).get("e1:1"), Some(&91), "probes an eighth apart: block 90");
        assert_eq!(m.matches(&ask(2), &anchors).get("e1:1"), Some(&94));
    }

    #[test]
    fn the_deepest_probe_wins_per_endpoint_and_a_divergence_ends_the_match() {
        let mut m = AffinityTable::new(1 << 12);
        let a: Vec<u64> = (100..120).collect();
        m.record(&a[..4], &[], "e1:1");
        m.record(&a, &[], "e2:1");
        // e2 was sent all 20 blocks; block 3's slot now names e2, so e1 is proven to block 1.
        let got = m.matches(&a, &[]);
        assert_eq!(got.get("e2:1"), Some(&20));
        assert_eq!(got.get("e1:1"), None, "every probe e1 wrote was overwritten by e2's");
        let mut b = a[..10].to_vec();
        b.extend([7, 8, 9]);
        assert_eq!(m.matches(&b, &[]).get("e2:1"), Some(&8), "probe 7 matches, probe 12 does not");
        assert!(m.matches(&[5, 6], &[]).is_empty());
    }

    #[test]
    fn a_probe_overwritten_by_a_colliding_entry_does_not_cut_the_match() {
        let slots = 1u64 << 12;
        let mut m = AffinityTable::new(slots);
        let prompt: Vec<u64> = (1..=100u64).map(|i| i * 7_919).collect();
        m.record(&prompt, &[], "e1:1");
        assert_eq!(m.matches(&prompt, &[]).get("e1:1"), Some(&100));
        // Another prompt's block lands in the slot of probe 19 (same hash modulo the table).
        let probe: Vec<usize> = probe_points(prompt.len(), &[]).collect();
        assert!(probe.contains(&19));
        m.store(prompt[19] + slots, "e2:1");
        let got = m.matches(&prompt, &[]);
        assert_eq!(got.get("e1:1"), Some(&100), "the deeper probes still prove all 100 blocks");
        assert_eq!(got.get("e2:1"), None, "the colliding entry names another chain");
    }

    #[test]
    fn the_table_stays_bounded_and_an_empty_one_matches_nothing() {
        let mut m = AffinityTable::new(64);
        for i in 0..10_000u64 {
            m.store(i.wrapping_mul(0x9E37_79B9_7F4A_7C15), &format!("e{}:1", i % 7));
        }
        assert!(m.len() <= 64 && m.capacity() == 64);
        let mut off = AffinityTable::new(0);
        off.record(&[1, 2, 3], &[], "e1:1");
        assert!(off.is_empty() && off.matches(&[1, 2, 3], &[]).is_empty());
    }
}
