//! Entry logs: how the root contexts of one Envoy tell each other what they learned, off the
//! request path. Two logs use this layout:
//! - [`AFFINITY`]: where a worker routed a prefix block (`stamp`: when). Each worker keeps its
//!   own [`AffinityTable`] (policies::index), which a request reads without a host call. A
//!   decision goes into the deciding worker's table at once and into its pending batch; from
//!   its tick the worker appends the batch to its own log and reads the other workers' logs
//!   into its table. Another worker so learns a decision within two ticks
//!   (`prefix.shared_flush_ms`), and the request path copies no shared-data pages into the VM
//!   (about 10 µs a decision). The fleet agent writes what other Envoys learned here too.
//! - [`BINDINGS`]: session and Responses-id bindings a worker made (`stamp`: their expiry), for
//!   the fleet agent to report (the bindings themselves are in the sticky table).
//!
//! Shared-data layout (namespaced by `vm_id`), for a log named `<log>`:
//! - `<log>.writers`: the number of writer ids handed out (8 bytes, little-endian);
//!   a context takes the next one with compare-and-swap when it first writes.
//! - `<log>.w<id>.head`: the sequence number of that writer's next page (8 bytes LE).
//! - `<log>.w<id>.p<seq % RING>`: one page: its sequence number (8 bytes LE), then entries of
//!   key (8 bytes LE), stamp (8 bytes LE), address length (1 byte), address.
//!
//! Each log has one writer, which writes a page before the head that names it, so a reader
//! never follows a head to a page not yet written. A reader more than [`RING`] pages behind
//! skips what was overwritten (affinity is a hint). Memory is bounded: at most
//! [`MAX_WRITERS`] × ([`RING`] + 1) keys, each page at most [`PAGE_ENTRIES`] entries.

use attache_policies::index::AffinityTable;

use crate::hostcalls as host;

/// The prefix-affinity log.
pub const AFFINITY: &str = "attache.aff";
/// The session-binding log.
pub const BINDINGS: &str = "attache.bind";

/// One entry: a key (block hash, or sticky-table key), a stamp (ms since the epoch) and an
/// endpoint address.
pub type Entry = (u64, u64, String);

/// An [`Entry`] borrowed from a page.
pub type EntryRef<'a> = (u64, u64, &'a str);

/// Pages kept per writer.
pub const RING: u64 = 32;
/// Entries per page.
pub const PAGE_ENTRIES: usize = 128;
/// Writer ids are taken modulo this (a worker VM that reloads takes a new one).
pub const MAX_WRITERS: u64 = 64;
/// Pages one flush may write; the rest of a batch is dropped, so readers one tick behind never
/// find their next page overwritten.
pub const PAGES_PER_FLUSH: usize = (RING / 2) as usize;
/// At most this many entries wait for a flush; past it new ones are dropped (the log is a
/// hint, and the deciding worker's own table and index have them already).
pub const PENDING_MAX: usize = PAGES_PER_FLUSH * PAGE_ENTRIES;

/// Encode one page: `seq`, then each `(key, stamp, endpoint)`. Endpoints longer than 255
/// bytes or empty are left out.
pub fn encode_page(seq: u64, entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + entries.len() * 34);
    out.extend_from_slice(&seq.to_le_bytes());
    for (key, stamp, endpoint) in entries {
        let Ok(len) = u8::try_from(endpoint.len()) else { continue };
        if len == 0 {
            continue;
        }
        out.extend_from_slice(&key.to_le_bytes());
        out.extend_from_slice(&stamp.to_le_bytes());
        out.push(len);
        out.extend_from_slice(endpoint.as_bytes());
    }
    out
}

/// Decode a page: its sequence number and entries. A truncated or non-UTF-8 entry ends the
/// page (what came before it stands); a page too short for its sequence number is `None`.
pub fn decode_page(bytes: &[u8]) -> Option<(u64, Vec<EntryRef<'_>>)> {
    let seq = host::read_u64(bytes)?;
    let mut rest = bytes.get(8..)?;
    let mut entries = Vec::new();
    while !rest.is_empty() {
        let Some(key) = host::read_u64(rest) else { break };
        let Some(stamp) = rest.get(8..).and_then(host::read_u64) else { break };
        let Some(&len) = rest.get(16) else { break };
        let end = 17 + usize::from(len);
        let Some(addr) = rest.get(17..end).and_then(|b| std::str::from_utf8(b).ok()) else { break };
        entries.push((key, stamp, addr));
        rest = rest.get(end..).unwrap_or_default();
    }
    Some((seq, entries))
}

/// One context's side of a log: its writer id (taken at its first write), its next sequence
/// number, and how far it has read each other writer's log.
pub struct EntryLog {
    name: &'static str,
    writer: Option<u64>,
    next_seq: u64,
    read_to: Vec<Option<u64>>,
}

impl EntryLog {
    /// A side of the log `name` ([`AFFINITY`] or [`BINDINGS`]).
    pub fn new(name: &'static str) -> Self {
        Self { name, writer: None, next_seq: 0, read_to: Vec::new() }
    }

    fn writers_key(&self) -> String {
        format!("{}.writers", self.name)
    }

    fn head_key(&self, writer: u64) -> String {
        format!("{}.w{writer}.head", self.name)
    }

    fn page_key(&self, writer: u64, seq: u64) -> String {
        format!("{}.w{writer}.p{}", self.name, seq % RING)
    }

    fn take_writer_id(&mut self) -> Option<u64> {
        if self.writer.is_some() {
            return self.writer;
        }
        let writers = self.writers_key();
        for _ in 0..8 {
            let (value, cas) = host::shared_data_cas(&writers);
            let n = value.as_deref().and_then(host::read_u64).unwrap_or(0);
            if host::set_shared_data_cas(&writers, &(n + 1).to_le_bytes(), cas) {
                let id = n % MAX_WRITERS;
                // A reloaded VM that took a used id goes on from that log's head.
                self.next_seq = host::shared_data(&self.head_key(id)).as_deref().and_then(host::read_u64).unwrap_or(0);
                self.writer = Some(id);
                return self.writer;
            }
        }
        None
    }

    /// Append `batch` to this context's log, at most [`PAGES_PER_FLUSH`] pages. Returns the
    /// entries written.
    pub fn write(&mut self, batch: &[Entry]) -> usize {
        if batch.is_empty() {
            return 0;
        }
        let Some(id) = self.take_writer_id() else { return 0 };
        let mut written = 0;
        for chunk in batch.chunks(PAGE_ENTRIES).take(PAGES_PER_FLUSH) {
            let seq = self.next_seq;
            if !host::set_shared_data(&self.page_key(id, seq), &encode_page(seq, chunk)) {
                break;
            }
            self.next_seq = seq + 1;
            if !host::set_shared_data(&self.head_key(id), &self.next_seq.to_le_bytes()) {
                break;
            }
            written += chunk.len();
        }
        written
    }

    /// Read every other writer's new pages into `table`, each entry stamped with its endpoint's
    /// KV write clock as `written` gives it now (a flush or two after the decision). Returns
    /// the entries learned.
    pub fn read_into(&mut self, table: &mut AffinityTable, written: impl Fn(&str) -> Option<u64>) -> usize {
        let mut learned = 0;
        self.read_new(|key, _, endpoint| {
            table.store_at(key, endpoint, written(endpoint));
            learned += 1;
        });
        learned
    }

    /// Every other writer's new entries, as `(key, stamp, endpoint)`.
    pub fn read_new(&mut self, mut each: impl FnMut(u64, u64, &str)) {
        let writers =
            host::shared_data(&self.writers_key()).as_deref().and_then(host::read_u64).unwrap_or(0).min(MAX_WRITERS);
        self.read_to.resize(writers as usize, None);
        for id in 0..writers {
            if Some(id) == self.writer {
                continue;
            }
            let Some(head) = host::shared_data(&self.head_key(id)).as_deref().and_then(host::read_u64) else {
                continue;
            };
            let oldest = head.saturating_sub(RING);
            let from = match self.read_to.get(id as usize).copied().flatten() {
                Some(n) if n == head => continue,
                Some(n) if n < head => n.max(oldest),
                // Not read before (replay what the ring still holds), or the log started over.
                _ => oldest,
            };
            for seq in from..head {
                let Some(page) = host::shared_data(&self.page_key(id, seq)) else { continue };
                match decode_page(&page) {
                    Some((s, entries)) if s == seq => {
                        for (key, stamp, endpoint) in entries {
                            each(key, stamp, endpoint);
                        }
                    }
                    // Overwritten by a later lap: skipped.
                    _ => {}
                }
            }
            if let Some(r) = self.read_to.get_mut(id as usize) {
                *r = Some(head);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_round_trips_and_leaves_out_addresses_it_cannot_frame() {
        let long = "x".repeat(256);
        let entries = vec![
            (7u64, 1, "10.0.0.1:8000".to_owned()),
            (8, 2, String::new()),
            (9, 3, long),
            (u64::MAX, 4, "b:1".into()),
        ];
        let bytes = encode_page(41, &entries);
        let (seq, got) = decode_page(&bytes).expect("decodes");
        assert_eq!(seq, 41);
        assert_eq!(got, vec![(7, 1, "10.0.0.1:8000"), (u64::MAX, 4, "b:1")]);
    }

    #[test]
    fn a_truncated_or_garbled_page_keeps_what_came_before_and_never_panics() {
        let bytes = encode_page(3, &[(1, 10, "a:1".into()), (2, 20, "b:2".into())]);
        for cut in 0..bytes.len() {
            let got = decode_page(&bytes[..cut]);
            if cut < 8 {
                assert!(got.is_none());
            } else {
                let (seq, entries) = got.expect("a sequence number decodes");
                assert_eq!(seq, 3);
                assert!(entries.len() <= 2);
                assert!(entries.iter().all(|e| *e == (1, 10, "a:1") || *e == (2, 20, "b:2")), "{entries:?}");
            }
        }
        let mut bad = encode_page(5, &[(1, 10, "a:1".into())]);
        bad[25] = 0xff; // not UTF-8
        assert_eq!(decode_page(&bad).map(|(_, e)| e.len()), Some(0));
    }
}
