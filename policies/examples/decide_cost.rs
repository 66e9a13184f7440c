//! Native cost of the size-dependent parts of an approximate decision: scanning the JSON,
//! parsing the request, hashing its blocks, and matching + recording them in the prefix index,
//! for chat bodies of 4 KB, 100 KB and 400 KB (the overhead benchmark's sizes). The filter runs
//! the same code compiled to Wasm; `cargo xtask bench overhead` measures it inside Envoy.
//!
//! `cargo run --release -p attache-policies --example decide_cost`

use std::time::Instant;

use hashbrown::HashMap;

use attache_policies::config::PrefixConfig;
use attache_policies::endpoint::Endpoint;
use attache_policies::request::{parse, Api};
use attache_policies::{prefix, ApproxPrefixIndex, PoolState, Scheduler, SchedulingInput};

#[path = "common/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::allocs;

fn body(i: usize, bytes: usize) -> Result<Vec<u8>, serde_json::Error> {
    let words = ["alpha ", "beta ", "gamma ", "delta ", "envoy ", "filter "];
    let mut text = format!("request {i}: ");
    let mut k = 0;
    while text.len() < bytes.saturating_sub(120) {
        text.push_str(words[k % words.len()]);
        k += 1;
    }
    serde_json::to_vec(&serde_json::json!({"model": "tinyllama", "stream": true, "max_tokens": 8,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]}))
}

/// A pool of `n` ready, idle endpoints serving `tinyllama`.
fn pool(n: usize) -> PoolState {
    let endpoints = (0..n).map(|i| Endpoint::idle(format!("10.0.0.{i}:8000"), "tinyllama")).collect();
    PoolState { version: 1, endpoints, ..Default::default() }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cfg = PrefixConfig::default();
    let mut ix = ApproxPrefixIndex::new(cfg.index_capacity);
    let scheduler = Scheduler::new(attache_policies::SchedulerConfig::default())?;
    let mut state = scheduler.new_state();
    let pools = [pool(1), pool(8)];
    let inflight = HashMap::new();
    println!("per request, microseconds (native, this machine)");
    for size in [4096usize, 102_400, 409_600] {
        let n = if size > 100_000 { 300 } else { 3000 };
        let bodies = (0..n).map(|i| body(i, size)).collect::<Result<Vec<_>, _>>()?;
        let (mut scan, mut parse_s, mut hash, mut index) = (0.0, 0.0, 0.0, 0.0);
        let mut decide = [0.0; 2];
        // Allocations: parse, hashes, index, schedule+commit on 1 and 8 endpoints.
        let mut counts = [0u64; 5];
        for (i, b) in bodies.iter().enumerate() {
            let t = Instant::now();
            let _: serde::de::IgnoredAny = serde_json::from_slice(b)?;
            scan += t.elapsed().as_secs_f64();
            let (t, a) = (Instant::now(), allocs());
            let r = parse(Api::ChatCompletions, b)?;
            parse_s += t.elapsed().as_secs_f64();
            counts[0] += allocs() - a;
            let (t, a) = (Instant::now(), allocs());
            let h = prefix::block_hashes(&cfg, &r.model, None, &r.prompt);
            let anchors = prefix::anchor_blocks(&cfg, &r.message_ends);
            hash += t.elapsed().as_secs_f64();
            counts[1] += allocs() - a;
            let (t, a) = (Instant::now(), allocs());
            let matched = ix.match_lengths(&h, &anchors).len();
            ix.record(&h, &anchors, if (i + matched).is_multiple_of(2) { "10.0.0.1:8000" } else { "10.0.0.2:8000" });
            index += t.elapsed().as_secs_f64();
            counts[2] += allocs() - a;
            // The whole pipeline on the hashes: filters, scorers, picker, then commit.
            for (k, (p, spent)) in pools.iter().zip(decide.iter_mut()).enumerate() {
                let (t, a) = (Instant::now(), allocs());
                let input = SchedulingInput {
                    sheddable: false,
                    now_ms: 0,
                    model: &r.model,
                    block_hashes: &h,
                    anchors: &anchors,
                    inflight: &inflight,
                    inflight_tokens: None,
                    seed: h.first().copied().unwrap_or(0),
                    extra_matches: None,
                    precise: None,
                    prompt_tokens: r.prompt.approx_tokens(),
                    sticky: None,
                    load_only: false,
                    subset: None,
                    session_key: None,
                };
                let d = scheduler.schedule(&input, p, &state)?;
                state.commit(&d, &h, &anchors);
                *spent += t.elapsed().as_secs_f64();
                counts[3 + k] += allocs() - a;
            }
        }
        let us = |v: f64| v / n as f64 * 1e6;
        println!(
            "{size:>7} B: JSON scan {:>7.1}  parse {:>7.1}  block hashes {:>6.1}  index match+record {:>6.1}  \
             schedule+commit 1 / 8 endpoints {:>6.1} / {:>6.1}",
            us(scan),
            us(parse_s),
            us(hash),
            us(index),
            us(decide[0]),
            us(decide[1])
        );
        let per = |c: u64| c as f64 / n as f64;
        println!(
            "{:>9}  allocations per request: parse {:.0}  block hashes {:.0}  index {:.0}  schedule+commit {:.0} / {:.0}",
            "",
            per(counts[0]),
            per(counts[1]),
            per(counts[2]),
            per(counts[3]),
            per(counts[4])
        );
    }
    Ok(())
}
