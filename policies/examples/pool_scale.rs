//! Native cost of one decision on pools of 100, 1,000 and 10,000 endpoints, with pre-selection
//! (the default) and without (`preselect.above: 0`), side by side. The filter runs the same
//! code compiled to Wasm; `cargo xtask bench scale` measures it inside Envoy.
//!
//! `cargo run --release -p attache-policies --example pool_scale`

use std::time::Instant;

use hashbrown::HashMap;

use attache_policies::endpoint::{Endpoint, EndpointMetrics};
use attache_policies::preselect::PreselectConfig;
use attache_policies::{prefix, PoolState, Scheduler, SchedulerConfig, SchedulingInput};

fn pool(n: usize) -> PoolState {
    let endpoints = (0..n)
        .map(|i| Endpoint {
            id: i as u32,
            metrics: Some(EndpointMetrics { waiting: (i % 3) as f64, running: (i % 17) as f64, ..Default::default() }),
            ..Endpoint::idle(format!("10.{}.{}.{}:8000", i / 65_536, (i / 256) % 256, i % 256), "m")
        })
        .collect();
    PoolState { version: 1, endpoints, ..Default::default() }
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * q) as usize).copied().unwrap_or(0.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pcfg = attache_policies::config::PrefixConfig::default();
    println!("decision (schedule + commit) per request, microseconds, native; p50 / p99");
    for n in [100usize, 1_000, 10_000] {
        let p = pool(n);
        let mut row = Vec::new();
        for pre in [PreselectConfig::default(), PreselectConfig { above: 0, ..Default::default() }] {
            let scheduler = Scheduler::new(SchedulerConfig { preselect: pre, ..Default::default() })?;
            let mut state = scheduler.new_state();
            let inflight = HashMap::new();
            let mut times = Vec::new();
            let mut scored = 0usize;
            for i in 0..2_000u64 {
                let prompt = format!("system prompt {} user question {i}", i % 50);
                let h = prefix::block_hashes(&pcfg, "m", None, &attache_policies::request::Prompt::Text(prompt));
                let t = Instant::now();
                let input = SchedulingInput {
                    sheddable: false,
                    now_ms: 0,
                    model: "m",
                    block_hashes: &h,
                    anchors: &[],
                    inflight: &inflight,
                    inflight_tokens: None,
                    seed: i,
                    extra_matches: None,
                    precise: None,
                    prompt_tokens: 200,
                    sticky: None,
                    load_only: false,
                    subset: None,
                    session_key: None,
                };
                let d = scheduler.schedule(&input, &p, &state)?;
                state.commit(&d, &h, &[]);
                times.push(t.elapsed().as_secs_f64() * 1e6);
                scored += d.candidates;
            }
            row.push((quantile(&mut times, 0.5), quantile(&mut times, 0.99), scored / times.len().max(1)));
        }
        println!(
            "{n:>6} endpoints: pre-selected {:>6.1} / {:>6.1} ({} scored)   every endpoint {:>7.1} / {:>7.1} ({} scored)",
            row[0].0, row[0].1, row[0].2, row[1].0, row[1].1, row[1].2
        );
    }
    Ok(())
}
