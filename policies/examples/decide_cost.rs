//! Native cost of the size-dependent parts of an approximate decision: scanning the JSON,
//! parsing the request, hashing its blocks, and matching + recording them in the prefix index,
//! for chat bodies of 4 KB, 100 KB and 400 KB (the overhead benchmark's sizes). The filter runs
//! the same code compiled to Wasm; `cargo xtask bench overhead` measures it inside Envoy.
//!
//! `cargo run --release -p attache-policies --example decide_cost`

use std::time::Instant;

use attache_policies::config::PrefixConfig;
use attache_policies::request::{parse, Api};
use attache_policies::{prefix, ApproxPrefixIndex};

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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cfg = PrefixConfig::default();
    let mut ix = ApproxPrefixIndex::new(cfg.index_capacity);
    println!("per request, microseconds (native, this machine)");
    for size in [4096usize, 102_400, 409_600] {
        let n = if size > 100_000 { 300 } else { 3000 };
        let bodies = (0..n).map(|i| body(i, size)).collect::<Result<Vec<_>, _>>()?;
        let (mut scan, mut parse_s, mut hash, mut index) = (0.0, 0.0, 0.0, 0.0);
        for (i, b) in bodies.iter().enumerate() {
            let t = Instant::now();
            let _: serde::de::IgnoredAny = serde_json::from_slice(b)?;
            scan += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let r = parse(Api::ChatCompletions, b)?;
            parse_s += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let h = prefix::block_hashes(&cfg, &r.model, None, &r.prompt);
            hash += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let m = ix.match_lengths(&h);
            ix.record(&h, if (i + m.len()).is_multiple_of(2) { "10.0.0.1:8000" } else { "10.0.0.2:8000" });
            index += t.elapsed().as_secs_f64();
        }
        let us = |v: f64| v / n as f64 * 1e6;
        println!(
            "{size:>7} B: JSON scan {:>7.1}  parse {:>7.1}  block hashes {:>6.1}  index match+record {:>6.1}",
            us(scan),
            us(parse_s),
            us(hash),
            us(index)
        );
    }
    Ok(())
}
