//! KV-event ingest: how fast the host decodes and indexes block events on one core, and what
//! one (block, endpoint) entry costs in memory. Payloads are encoded with the simulator's
//! vLLM-exact encoder; memory is counted by the global allocator of this binary.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

use attache_kv::events as kv_events;
use attache_kv::KvIndex;
use attache_sim::kv::{KvEvent, Medium};
use attache_sim::kv_publish::{encode_batch, Encoding};
use serde_json::json;

/// Counts live heap bytes.
pub struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static ALLOCS: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// Batches like an engine's: each stores `blocks` blocks of a fresh chain (16-token blocks),
/// and removes as many old ones once `keep` blocks are cached.
fn payloads(batches: usize, blocks: usize, keep: usize, encoding: Encoding) -> (Vec<Vec<u8>>, usize) {
    let mut out = Vec::with_capacity(batches);
    let mut events_total = 0;
    let mut next_hash: u64 = 1 << 40;
    let mut live_hashes = std::collections::VecDeque::new();
    for b in 0..batches {
        let hashes: Vec<u64> = (0..blocks as u64).map(|i| next_hash + i).collect();
        next_hash += blocks as u64;
        let tokens: Vec<u32> =
            (0..(blocks * 16) as u32).map(|t| t.wrapping_mul(2_654_435_761).wrapping_add(b as u32) % 32_000).collect();
        let mut events =
            vec![KvEvent::Stored { hashes: hashes.clone(), parent: None, tokens, block_size: 16, medium: Medium::Gpu }];
        live_hashes.extend(hashes);
        if live_hashes.len() > keep {
            let gone: Vec<u64> = (0..blocks).filter_map(|_| live_hashes.pop_front()).collect();
            events_total += gone.len();
            events.push(KvEvent::Removed { hashes: gone, medium: Medium::Gpu });
        }
        events_total += blocks;
        out.push(encode_batch(b as f64, &events, encoding));
    }
    (out, events_total)
}

const ROUNDS: usize = 3;

pub fn run(out_path: &std::path::Path) -> anyhow::Result<()> {
    // Ingest: 50,000 batches of 16 stored blocks (and as many removals once 200k are held),
    // three rounds each on a fresh index; the median round is the figure.
    let mut rows = Vec::new();
    for enc in [Encoding::Map, Encoding::Array] {
        let (batches, events) = payloads(50_000, 16, 200_000, enc);
        let mut rates = Vec::new();
        let mut allocs = 0;
        for _ in 0..ROUNDS {
            let mut ix = KvIndex::new(1 << 20);
            let allocs_before = ALLOCS.load(Ordering::Relaxed);
            let start = Instant::now();
            for (i, p) in batches.iter().enumerate() {
                kv_events::visit_batch(p, |e| ix.apply_ref(0, "tinyllama", e))?;
                // The host's push task takes the deltas every couple of milliseconds.
                if i % 64 == 63 {
                    std::hint::black_box(ix.take_deltas());
                }
            }
            rates.push(events as f64 / start.elapsed().as_secs_f64());
            allocs = ALLOCS.load(Ordering::Relaxed) - allocs_before;
        }
        rates.sort_by(f64::total_cmp);
        let median = rates[rates.len() / 2];
        // Decoding alone, for the split between the msgpack reader and the index.
        let start = Instant::now();
        let mut seen = 0usize;
        for p in &batches {
            kv_events::visit_batch(p, |e| seen += std::hint::black_box(e).medium().is_some() as usize)?;
        }
        let decode_rate = events as f64 / start.elapsed().as_secs_f64();
        let name = if enc == Encoding::Map { "map" } else { "array" };
        println!(
            "ingest ({name} encoding): {events} block events, {:.2} M/s on one core (median of {ROUNDS} rounds; {:.2}–{:.2})",
            median / 1e6,
            rates[0] / 1e6,
            rates[rates.len() - 1] / 1e6
        );
        rows.push(json!({
            "encoding": name,
            "block_events": events,
            "rounds": ROUNDS,
            "block_events_per_s": median.round(),
            "min_per_s": rates[0].round(),
            "max_per_s": rates[rates.len() - 1].round(),
            "decode_only_per_s": decode_rate.round(),
            "allocations": allocs,
        }));
        println!(
            "  heap allocations in a round: {allocs} for {} batches (the index's reused buffers and the deltas the push takes)",
            batches.len()
        );
        println!("  decoding alone: {:.2} M block events/s ({seen} events)", decode_rate / 1e6);
    }

    // Memory: 1,000,000 (block, endpoint) entries, 8 endpoints each holding its own chains.
    let before = live();
    let mut ix = KvIndex::new(1_000_000);
    let per_ep = 125_000usize;
    for ep in 0..8u16 {
        let mut parent: Option<u64> = None;
        for i in 0..per_ep / 16 {
            let hashes: Vec<u64> = (0..16u64).map(|j| (u64::from(ep) << 48) | ((i as u64) << 8) | j).collect();
            let tokens: Vec<u32> = (0..256u32).map(|t| t ^ (i as u32) << 8 ^ u32::from(ep) << 24).collect();
            ix.apply(
                ep,
                "tinyllama",
                &attache_kv::events::KvEvent::BlockStored {
                    block_hashes: hashes.clone(),
                    parent_block_hash: parent,
                    token_ids: tokens,
                    block_size: 16,
                    lora_name: None,
                    medium: attache_kv::events::Medium::Gpu,
                },
            );
            parent = hashes.last().copied();
            if i % 64 == 63 {
                parent = None; // start a new chain now and then
            }
        }
    }
    let _ = ix.take_deltas();
    let entries = ix.entries();
    let bytes = live() - before;
    let per_entry = bytes as f64 / entries as f64;
    println!("index memory: {entries} (block, endpoint) entries use {bytes} bytes = {per_entry:.1} bytes per entry (engine-hash map included)");
    let doc = json!({
        "command": "cargo xtask bench kv-ingest",
        "machine": format!("{} cores", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)),
        "ingest": rows,
        "memory": {"entries": entries, "bytes": bytes, "bytes_per_entry": (per_entry * 10.0).round() / 10.0},
    });
    // With the build and the date, as every benchmark's results.
    crate::run::write_results(out_path, doc)
}
