//! One whole decision as the filter makes it, outside Envoy: parse the body, `policies::plan`,
//! then `plan::learn`, on pools of 100, 1,000 and 10,000 endpoints, approximate and precise,
//! with the allocations each decision makes counted.
//!
//! Native: `cargo run --release -p attache-policies --example decision_path`
//!
//! In V8 (Envoy's Wasm engine), through Node's WASI:
//! `cargo build --profile wasm --target wasm32-wasip1 -p attache-policies --example decision_path`
//! then `node bench/wasi-run.mjs $CARGO_TARGET_DIR/wasm32-wasip1/wasm/examples/decision_path.wasm`.
//! `cargo xtask bench decision-path` runs both, warm and `--cold`.
//!
//! `--cold` clears the CPU caches before each decision (it writes 8 MB), as Envoy's other work
//! does between two requests: inside Envoy a decision starts with the pool, the tables and the
//! code out of cache, and costs about twice the warm figure. `--stages` adds each stage's time
//! and allocations (`policies::probe`); `--alloc-sites` prints where each allocation of one
//! warm decision per row comes from (build with debug symbols to see the frames). Inside
//! Envoy, each worker's decision time is `attache_decision_us`; the filter's `stage_timings`
//! option splits it by stage.

use std::collections::VecDeque;
use std::time::Instant;

use hashbrown::HashMap;

use attache_policies::endpoint::{Endpoint, EndpointMetrics, PoolState};
use attache_policies::index::AffinityTable;
use attache_policies::plan::{self, KvIndexView, PlanConfig, PlanRequest, StateView};
use attache_policies::plugin_config::ScoringConfig;
use attache_policies::request::{parse, Api};
use attache_policies::session::SessionConfig;
use attache_policies::{Scheduler, SchedulerConfig, SchedulerState};

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

/// Requests in flight while a decision is made (the scale benchmark's concurrency).
const IN_FLIGHT: usize = 4;

/// A request to `to` ended: the worker's tables forget an endpoint with nothing in flight.
fn finish(inflight: &mut HashMap<String, u32>, tokens: &mut HashMap<String, u64>, to: &str, uncached: u64) {
    if let Some(n) = inflight.get_mut(to) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            inflight.remove(to);
        }
    }
    if let Some(t) = tokens.get_mut(to) {
        *t = t.saturating_sub(uncached);
        if *t == 0 {
            tokens.remove(to);
        }
    }
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * q) as usize).copied().unwrap_or(0.0)
}

/// Per-probe times of the decisions so far (with `--stages`).
mod probes {
    use std::cell::RefCell;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    static ON: AtomicBool = AtomicBool::new(false);

    thread_local! {
        static LAST: RefCell<Option<(Instant, u64)>> = const { RefCell::new(None) };
        static TIMES: RefCell<Vec<(&'static str, Vec<f64>, u64)>> = const { RefCell::new(Vec::new()) };
    }

    /// Time the stages from now on, the probes inside `policies::plan` included.
    pub fn enable() {
        ON.store(true, Ordering::Relaxed);
        attache_policies::probe::set(hook);
    }

    pub fn begin() {
        if !ON.load(Ordering::Relaxed) {
            return;
        }
        LAST.with(|l| *l.borrow_mut() = Some((Instant::now(), super::allocs())));
    }

    pub fn hook(name: &'static str) {
        if !ON.load(Ordering::Relaxed) {
            return;
        }
        let now = (Instant::now(), super::allocs());
        let Some(last) = LAST.with(|l| l.borrow_mut().replace(now)) else { return };
        let us = now.0.duration_since(last.0).as_secs_f64() * 1e6;
        let allocs = now.1.saturating_sub(last.1);
        TIMES.with(|t| {
            let mut t = t.borrow_mut();
            match t.iter_mut().find(|(n, _, _)| *n == name) {
                Some((_, v, a)) => {
                    v.push(us);
                    *a += allocs;
                }
                None => t.push((name, vec![us], allocs)),
            }
        });
    }

    /// Each probe's mean / p50 / p99 µs and allocations per decision, then cleared; empty
    /// when nothing registered the hook (no `--stages`).
    pub fn report(quantile: fn(&mut [f64], f64) -> f64) -> String {
        TIMES.with(|t| {
            let mut out = String::new();
            for (name, v, allocs) in t.borrow_mut().iter_mut() {
                let n = v.len().max(1) as f64;
                let mean = v.iter().sum::<f64>() / n;
                out.push_str(&format!(
                    " {name}={mean:.1}/{:.1}/{:.1}({:.0})",
                    quantile(v, 0.5),
                    quantile(v, 0.99),
                    *allocs as f64 / n
                ));
                v.clear();
                *allocs = 0;
            }
            out
        })
    }
}

/// Touches 8 MB between decisions, so each starts with the pool, the tables and the code out
/// of the CPU caches, as in Envoy, where the connection's other work runs between two requests.
struct Evictor(Vec<u8>);

impl Evictor {
    fn evict(&mut self) {
        for (j, x) in self.0.iter_mut().enumerate().step_by(64) {
            *x = x.wrapping_add(j as u8);
        }
    }
}

/// One worker's state across decisions, as the filter keeps it.
struct Worker {
    state: SchedulerState,
    affinity: AffinityTable,
    inflight: HashMap<String, u32>,
    inflight_tokens: HashMap<String, u64>,
    /// The last `IN_FLIGHT` dispatches, still in flight.
    recent: VecDeque<(String, u64)>,
}

impl Worker {
    fn new(scheduler: &Scheduler) -> Self {
        Self {
            state: scheduler.new_state(),
            affinity: AffinityTable::new(scheduler.config.prefix.shared_slots),
            inflight: HashMap::new(),
            inflight_tokens: HashMap::new(),
            recent: VecDeque::new(),
        }
    }

    /// One decision as the filter makes it: parse, plan, learn, account.
    fn decide(
        &mut self,
        settings: &PlanConfig<'_>,
        pool: &PoolState,
        kv: Option<&Kv>,
        (id, body, ids): (u32, &[u8], Option<&[u32]>),
    ) -> Result<(), Box<dyn std::error::Error>> {
        probes::begin();
        let req = parse(Api::ChatCompletions, body)?;
        let request = PlanRequest {
            sheddable: false,
            id,
            req: &req,
            body_len: body.len(),
            prompt_ids: ids,
            sticky: None,
            session_key: None,
            rollout_session: None,
            subset: None,
            now_ms: u64::from(id),
        };
        let view = StateView {
            pool,
            state: &self.state,
            affinity: Some(&self.affinity),
            kv: kv.map(|k| k as &dyn KvIndexView),
            inflight: &self.inflight,
            inflight_tokens: &self.inflight_tokens,
            host_silent_ms: 0,
        };
        probes::hook("parse");
        let planned = plan::plan(&request, &view, settings).map_err(|e| e.reason)?;
        let published = plan::learn(&planned, &mut self.state, Some(&mut self.affinity), 64);
        // In-flight accounting: the last `IN_FLIGHT` decisions are in flight, and an endpoint
        // with none is forgotten.
        let (to, tokens) = (planned.dispatch.endpoint.clone(), planned.dispatch.uncached_tokens);
        *self.inflight.entry_ref(to.as_str()).or_insert(0) += 1;
        *self.inflight_tokens.entry_ref(to.as_str()).or_insert(0) += tokens;
        self.recent.push_back((to, tokens));
        if self.recent.len() > IN_FLIGHT {
            if let Some((done, tokens)) = self.recent.pop_front() {
                finish(&mut self.inflight, &mut self.inflight_tokens, &done, tokens);
            }
        }
        drop((planned, published, req));
        probes::hook("learn");
        Ok(())
    }
}

/// One row: `n` endpoints, bodies of about `size` bytes, approximate or precise.
fn row(
    settings: &PlanConfig<'_>,
    (n, size, precise): (usize, usize, bool),
    mut evictor: Option<&mut Evictor>,
) -> Result<(), Box<dyn std::error::Error>> {
    let p = pool(n);
    let mut worker = Worker::new(settings.scheduler);
    let mut kv = Kv(HashMap::new());
    let bodies = (0..4_000).map(|i| body(i, size)).collect::<Result<Vec<_>, _>>()?;
    let (mut times, mut counted) = (Vec::with_capacity(bodies.len()), 0u64);
    for (i, b) in bodies.iter().enumerate() {
        let ids: Vec<u32> = b.chunks(4).map(|c| c.iter().map(|&x| u32::from(x)).sum()).collect();
        if precise && i == 0 {
            // Three engines hold every block key precise requests ask for.
            let seed = attache_policies::prefix::chain_seed("tinyllama", None);
            for k in attache_policies::prefix::token_block_keys(seed, &ids, 16) {
                kv.0.insert(k, vec![(1, 1), (2, 1), (3, 1)]);
            }
        }
        if let Some(e) = evictor.as_deref_mut() {
            e.evict();
        }
        let (t, a) = (Instant::now(), allocs());
        let ids = precise.then_some(ids.as_slice());
        // One warm decision's allocations, by site (`--alloc-sites`).
        let sites = i == 3_000 && std::env::args().any(|a| a == "--alloc-sites");
        if sites {
            eprintln!("allocations of decision {i} ({n} endpoints, {size} B, precise {precise}):");
        }
        counting_alloc::print_sites(sites);
        worker.decide(settings, &p, precise.then_some(&kv), (i as u32, b, ids))?;
        counting_alloc::print_sites(false);
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
    let by_stage = probes::report(quantile);
    if !by_stage.is_empty() {
        println!("    by stage, mean / p50 / p99 us (allocations):{by_stage}");
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cold = std::env::args().any(|a| a == "--cold");
    if std::env::args().any(|a| a == "--stages") {
        probes::enable();
    }
    let scheduler = Scheduler::new(SchedulerConfig::default())?;
    let (sessions, scoring) = (SessionConfig::default(), ScoringConfig::default());
    let settings = PlanConfig { scheduler: &scheduler, sessions: &sessions, scoring: &scoring };
    let mut evictor = cold.then(|| Evictor(vec![0u8; 8 << 20]));
    println!(
        "one decision (parse + plan + learn), microseconds p50 / p99, and allocations per decision{}",
        if cold { "; caches cleared before each (--cold)" } else { "" }
    );
    for n in [100usize, 1_000, 10_000] {
        for size in [200usize, 4096] {
            for precise in [false, true] {
                row(&settings, (n, size, precise), evictor.as_mut())?;
            }
        }
    }
    if let Some(e) = evictor {
        // Read what was written, so the eviction is not optimised away.
        std::hint::black_box(e.0.iter().map(|&x| u64::from(x)).sum::<u64>());
    }
    Ok(())
}
