//! One whole decision as the filter makes it, outside Envoy: parse the body, `policies::plan`,
//! then `plan::learn`, on pools of 100, 1,000 and 10,000 endpoints, approximate and precise,
//! with the allocations each decision makes counted.
//!
//! Native: `cargo run --release -p attache-policies --example decision_path`
//!
//! In V8 (Envoy's Wasm engine), through Node's WASI:
//! `cargo build --profile wasm --target wasm32-wasip1 -p attache-policies --example decision_path`
//! then `node bench/wasi-run.mjs $CARGO_TARGET_DIR/wasm32-wasip1/wasm/examples/decision_path.wasm`.
//! `cargo xtask bench decision-path` runs both. Inside Envoy, each worker's decision time is
//! `attache_decision_us`; a filter built with `--features stage-timings` splits it by stage.

use std::time::Instant;

use hashbrown::HashMap;

use attache_policies::endpoint::{Endpoint, EndpointMetrics, PoolState};
use attache_policies::index::AffinityTable;
use attache_policies::plan::{self, KvIndexView, PlanConfig, PlanRequest, StateView};
use attache_policies::plugin_config::ScoringConfig;
use attache_policies::request::{parse, Api};
use attache_policies::session::SessionConfig;
use attache_policies::{Scheduler, SchedulerConfig};

#[path = "common/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::allocs;

/// A pool of `n` ready endpoints serving `tinyllama` with 16-token KV blocks, loads spread.
fn pool(n: usize) -> PoolState {
    let endpoints = (0..n)
        .map(|i| Endpoint {
            id: i as u32,
            block_size: 16,
            metrics: Some(EndpointMetrics { waiting: (i % 3) as f64, running: (i % 17) as f64, ..Default::default() }),
            ..Endpoint::idle(format!("10.{}.{}.{}:8000", i / 65_536, (i / 256) % 256, i % 256), "tinyllama")
        })
        .collect();
    PoolState { version: 1, endpoints, ..Default::default() }
}

/// The precise index: block key → (endpoint id, tier mask).
struct Kv(HashMap<u64, Vec<(u16, u8)>>);

impl KvIndexView for Kv {
    fn holders(&self, key: u64) -> Vec<(u16, u8)> {
        self.0.get(&key).cloned().unwrap_or_default()
    }
}

/// A chat body of about `bytes`, its system prompt one of 20 (shared prefixes).
fn body(i: usize, bytes: usize) -> Result<Vec<u8>, serde_json::Error> {
    let words = ["alpha ", "beta ", "gamma ", "delta ", "envoy ", "filter "];
    let mut text = format!("worker q{i}: ");
    let mut k = i;
    while text.len() < bytes.saturating_sub(120) {
        text.push_str(words[k % words.len()]);
        k += 1;
    }
    serde_json::to_vec(&serde_json::json!({"model": "tinyllama", "stream": true, "max_tokens": 4,
        "messages": [{"role": "system", "content": format!("system {}", i % 20)}, {"role": "user", "content": text}]}))
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * q) as usize).copied().unwrap_or(0.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let scheduler = Scheduler::new(SchedulerConfig::default())?;
    let (sessions, scoring) = (SessionConfig::default(), ScoringConfig::default());
    let settings = PlanConfig { scheduler: &scheduler, sessions: &sessions, scoring: &scoring };
    println!("one decision (parse + plan + learn), microseconds p50 / p99, and allocations per decision");
    for n in [100usize, 1_000, 10_000] {
        let p = pool(n);
        for size in [200usize, 4096] {
            for precise in [false, true] {
                let mut state = scheduler.new_state();
                let mut affinity = AffinityTable::new(scheduler.config.prefix.shared_slots);
                let (mut inflight, mut inflight_tokens): (HashMap<String, u32>, HashMap<String, u64>) =
                    (HashMap::new(), HashMap::new());
                // Three engines hold every block key precise requests ask for.
                let kv = Kv(HashMap::new());
                let mut kv = kv;
                let bodies = (0..4_000).map(|i| body(i, size)).collect::<Result<Vec<_>, _>>()?;
                let (mut times, mut counted) = (Vec::with_capacity(bodies.len()), 0u64);
                for (i, b) in bodies.iter().enumerate() {
                    let ids: Vec<u32> = b.chunks(4).map(|c| c.iter().map(|&x| u32::from(x)).sum()).collect();
                    if precise && i == 0 {
                        let keys = attache_policies::prefix::token_block_keys(
                            attache_policies::prefix::chain_seed("tinyllama", None),
                            &ids,
                            16,
                        );
                        for k in keys {
                            kv.0.insert(k, vec![(1, 1), (2, 1), (3, 1)]);
                        }
                    }
                    let (t, a) = (Instant::now(), allocs());
                    let req = parse(Api::ChatCompletions, b)?;
                    let request = PlanRequest {
                        id: i as u32,
                        req: &req,
                        body_len: b.len(),
                        prompt_ids: precise.then_some(ids.as_slice()),
                        sticky: None,
                        session_key: None,
                        rollout_session: None,
                        subset: None,
                    };
                    let view = StateView {
                        pool: &p,
                        state: &state,
                        affinity: Some(&affinity),
                        kv: precise.then_some(&kv as &dyn KvIndexView),
                        inflight: &inflight,
                        inflight_tokens: &inflight_tokens,
                        host_silent_ms: 0,
                    };
                    let planned = plan::plan(&request, &view, &settings).map_err(|e| e.reason)?;
                    let published = plan::learn(&planned, &mut state, Some(&mut affinity), 64);
                    // In-flight accounting, as the filter's worker keeps it (the request ends
                    // before the next: entries stay, at zero).
                    let to = &planned.dispatch.endpoint;
                    inflight.entry_ref(to.as_str()).or_insert(0);
                    inflight_tokens.entry_ref(to.as_str()).or_insert(0);
                    drop((planned, published, req));
                    times.push(t.elapsed().as_secs_f64() * 1e6);
                    counted += allocs() - a;
                }
                println!(
                    "{n:>6} endpoints  {size:>5} B  {:<11} {:>7.1} / {:>7.1} us  {:>5.0} allocations",
                    if precise { "precise" } else { "approximate" },
                    quantile(&mut times, 0.5),
                    quantile(&mut times, 0.99),
                    counted as f64 / bodies.len() as f64,
                );
            }
        }
    }
    Ok(())
}
