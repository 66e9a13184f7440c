//! The side-by-side comparison: each system in turn, in one run, on identical fresh simulated
//! pools (cold caches), with the same seeded request plan from a scenario file
//! (`bench/scenarios/*.json`). Systems:
//! - `round-robin`: plain Envoy 1.40 (the "plain Kubernetes Service" of llm-d's claims);
//! - `attache-approx`, `attache-precise`: Envoy with Attaché (precise: KV events, and the
//!   reference model's tokenizer and chat template in the filter);
//! - `vllm-router-cache-aware`, `vllm-router-kv-aware` (fed the simulator's KV events),
//!   `smg-cache-aware`: the peer routers from PyPI (`crate::peers`).
//!
//! Every engine tokenizes with the reference model's tokenizer and chat template, so text and
//! chat prompts hash to the same blocks for the engines, Attaché's precise mode and the peers
//! that tokenize through the engine. Requests are streaming chat completions with text prompts,
//! what the peers route on. Times are simulated (real / time_scale). Per system the run writes
//! the demo's summary row, per-stage figures along the ladder, and checks; then a markdown
//! table and an SVG plot of TTFT and throughput per system across the ladder.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use attache_e2e::client::{self, Outcome};
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use serde_json::{json, Value};

use crate::closed_loop::{self, Throughput};
use crate::conversation::{Conversation, MODEL};
use crate::peers::{self, Peer, PeerVersions};
use crate::repeats::{Figures, SystemSeeds};
use crate::run::{round2, RunSummary, Sent, StageSummary};
use crate::scenario::{ApiKind, ClosedLoop, Scenario, SessionPlan, Stage};

pub const SYSTEMS: &str =
    "round-robin,attache-approx,attache-precise,vllm-router-cache-aware,vllm-router-kv-aware,smg-cache-aware";

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Scenario files to run (each writes `<out-dir>/peers-<name>.{json,md,svg}`).
    #[arg(long = "scenario", default_values = ["bench/scenarios/shared-prefix.json", "bench/scenarios/agentic.json",
        "bench/scenarios/bursty-chat.json", "bench/scenarios/low-cache.json"])]
    pub scenarios: Vec<PathBuf>,
    #[arg(long, default_value = SYSTEMS)]
    pub systems: String,
    #[arg(long, default_value = "bench/results")]
    pub out_dir: PathBuf,
    /// Multiply every stage's rate (and keep its duration): a quick run is `--rate-scale 0.2`.
    #[arg(long, default_value_t = 1.0)]
    pub rate_scale: f64,
    #[command(flatten)]
    pub peers: PeerVersions,
    #[arg(long, default_value_t = 2)]
    pub envoy_concurrency: u32,
    /// Runs per system, each on its own seed (the scenario's, then the next ones), interleaved:
    /// every system runs seed 1 before any runs seed 2, in an order rotated per seed.
    #[arg(long, default_value_t = 1)]
    pub seeds: usize,
    /// After each open-loop run, a closed-loop one on a fresh pool: `CONCURRENCY:SECONDS`
    /// (simulated), for throughput. Overrides the scenario's `closed_loop`.
    #[arg(long)]
    pub closed_loop: Option<ClosedLoop>,
}

/// What one system produced.
struct SystemRun {
    summary: RunSummary,
    stages: Vec<StageSummary>,
    extra: Value,
    /// Attaché's own expected prefix hit rate, calibrated and as believed
    /// ([`expected_hit_rate`]).
    expected_hit_rate: Option<IndexRates>,
}

/// Reference-model tokens per generated word, measured with the tokenizer the engines use.
fn words_per_token() -> anyhow::Result<f64> {
    let json = std::fs::read(crate::overhead::reference("model/tokenizer.json")).context("reference tokenizer")?;
    let mut t = attache_policies::tokenizer::Tokenizer::from_json(&json)?;
    let text = crate::scenario::TextGen::new(1, 1.0).words(4000);
    let n = t.encode(&text, false, usize::MAX).len();
    Ok(4000.0 / n.max(1) as f64)
}

/// Drive the whole plan against `url`: each session starts at its time and runs its turns in
/// order, carrying the conversation so far; a failed turn ends its session, and the turns it
/// did not send count as errors.
async fn drive(
    label: &str,
    url: &str,
    api: ApiKind,
    plan: Arc<Vec<SessionPlan>>,
    scale: f64,
    timeout_s: f64,
) -> Vec<Sent> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .timeout(Duration::from_secs_f64(timeout_s * scale))
        .build()
        .unwrap_or_default();
    let start = tokio::time::Instant::now();
    let turns = plan.iter().map(|p| p.users.len()).sum();
    let stages = plan.iter().map(|p| p.stage).max().unwrap_or(0) + 1;
    let progress = crate::progress::Progress::start(label, turns, stages, Duration::from_secs(10));
    let mut handles = Vec::with_capacity(plan.len());
    for i in 0..plan.len() {
        let p = &plan[i];
        tokio::time::sleep_until(start + Duration::from_secs_f64(p.start_s * scale)).await;
        progress.stage(p.stage);
        let (http, url, plan, progress) = (http.clone(), url.to_string(), plan.clone(), progress.clone());
        let label = label.to_string();
        handles.push(tokio::spawn(async move {
            let p = &plan[i];
            let sid = format!("session-{}", p.id);
            let mut convo = Conversation::new(api, p);
            let mut out = Vec::with_capacity(p.users.len());
            for (k, user) in p.users.iter().enumerate() {
                if k > 0 {
                    tokio::time::sleep(Duration::from_secs_f64(p.pauses_s[k] * scale)).await;
                }
                let body = convo.turn(p, k, user);
                let headers: Vec<(&str, &str)> = if p.session_header && api == ApiKind::Chat {
                    vec![("x-session-id", sid.as_str())]
                } else {
                    vec![]
                };
                let at = start.elapsed();
                let mut o = client::post(&http, &url, body.to_string().into_bytes(), &headers).await;
                convo.answered(o.streamed_text());
                trace(&label, &sid, k, at, &o);
                o.events.clear();
                o.body.truncate(300);
                let failed = !(o.ok() && o.done);
                out.push(Sent { stage: p.stage, at, outcome: o });
                progress.done();
                if failed {
                    for _ in k + 1..p.users.len() {
                        progress.done();
                        let error = Some("not sent: an earlier turn of the session failed".to_string());
                        out.push(Sent { stage: p.stage, at, outcome: Outcome { error, ..Outcome::default() } });
                    }
                    break;
                }
            }
            out
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        if let Ok(v) = h.await {
            all.extend(v);
        }
    }
    all
}

/// With `ATTACHE_BENCH_TRACE=FILE`, one JSON line per request (system, session, turn, time
/// sent, TTFT, engine, prompt tokens, and cached tokens where the usage reports them),
/// appended: to see where a system's tail comes from. Times are real, not simulated. Each line
/// goes out in one write, so concurrent sessions do not interleave their lines.
fn trace(label: &str, session: &str, turn: usize, at: Duration, o: &Outcome) {
    use std::io::Write as _;
    let Some(path) = std::env::var_os("ATTACHE_BENCH_TRACE") else { return };
    let usage = o
        .events
        .iter()
        .rev()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
        .unwrap_or(Value::Null);
    let line = json!({
        "system": label, "session": session, "turn": turn, "at_s": at.as_secs_f64(),
        "ttft_ms": o.ttft.map(|t| t.as_secs_f64() * 1000.0), "engine": o.engine_address,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": usage.pointer("/prompt_tokens_details/cached_tokens"),
    });
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = f.write_all(format!("{line}\n").as_bytes());
    }
}

fn summarise(system: &str, sc: &Scenario, stages: &[Stage], sent: &[Sent], hit_rate: f64) -> SystemRun {
    let rates: Vec<f64> = stages.iter().map(|s| s.rate).collect();
    let (summary, stages) =
        crate::run::summarise_stages(system, sc.pool.time_scale, &rates, sent, hit_rate, sc.slo_ttft_p90_ms);
    SystemRun { summary, stages, extra: json!({}), expected_hit_rate: None }
}

/// Prometheus samples of `prefix` from a peer's metrics endpoint, as `{"name{labels}": value}`.
async fn peer_metrics(port: u16, prefix: &str) -> Value {
    let text = match reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => return json!({}),
    };
    let mut m = serde_json::Map::new();
    for l in text.lines().filter(|l| l.starts_with(prefix)) {
        if let Some((k, v)) = l.rsplit_once(' ') {
            if let Ok(v) = v.parse::<f64>() {
                m.insert(k.to_string(), json!(v));
            }
        }
    }
    Value::Object(m)
}

/// A system up and serving on a fresh, cold pool.
struct Started {
    stack: Stack,
    url: String,
    proxy_pid: u32,
    /// A peer router's process and Prometheus port.
    peer: Option<(attache_e2e::process::Proc, u16)>,
}

/// `blocks`: KV blocks per engine (sized by the open-loop plan, so both loops get one pool).
async fn start(
    system: &str,
    sc: &Scenario,
    first: Option<&SessionPlan>,
    blocks: usize,
    a: &Args,
) -> anyhow::Result<Started> {
    let pool = &sc.pool;
    let sim = SimOpts {
        engines: pool.engines,
        model: MODEL.into(),
        block_size: pool.block_size,
        num_gpu_blocks: blocks,
        max_num_seqs: pool.max_num_seqs,
        max_num_batched_tokens: pool.max_num_batched_tokens,
        time_scale: pool.time_scale,
        kv_events: true,
        stream_interval: pool.stream_interval,
        prefill_scale: pool.prefill_scale,
        decode_scale: pool.decode_scale,
        tokenizer: Some(crate::overhead::reference("model/tokenizer.json")),
        chat_template: Some(crate::overhead::reference("model/chat_template.jinja")),
        ..SimOpts::default()
    };
    let mut stack = Stack::new(&format!("peers-{}-{system}", sc.name))?;
    stack.start_sim(sim)?;
    if let Some(peer) = Peer::from_name(system) {
        let bin = peers::ensure_venv(&stack.paths.root, &a.peers)?;
        let workers = stack.engine_addrs();
        let kv: Vec<(String, String)> = (0..pool.engines)
            .map(|i| {
                let p = stack.kv_base_port + 2 * i;
                (format!("tcp://127.0.0.1:{p}"), format!("tcp://127.0.0.1:{}", p + 1))
            })
            .collect();
        let (p, port, metrics) = peers::start(&stack, &bin, peer, &workers, &kv, pool.block_size)?;
        let proxy_pid = p.pid();
        let peer_proc = Some((p, metrics));
        peers::wait_serving(&format!("http://127.0.0.1:{port}/v1/chat/completions"), MODEL).await?;
        let url = format!("http://127.0.0.1:{port}{}", sc.api.path());
        if let (true, Some(first)) = (sc.api != ApiKind::Chat, first) {
            // A peer that does not route this API is reported as such, not run.
            let probe = Conversation::new(sc.api, first).turn(first, 0, first.users.first().map_or("", |u| &**u));
            let o = client::post(&stack.http, &url, probe.to_string().into_bytes(), &[]).await;
            anyhow::ensure!(o.ok(), "{UNSUPPORTED}: {} answered {} {:?}", sc.api.path(), o.status, o.error);
        }
        return Ok(Started { stack, url, proxy_pid, peer: peer_proc });
    }
    let (kind, config) = match system {
        "round-robin" => (EnvoyKind::RoundRobin, Stack::default_scheduler_config()),
        "attache-approx" => (EnvoyKind::Attache, Stack::default_scheduler_config()),
        "attache-precise" => (EnvoyKind::Attache, crate::overhead::precise_config()?),
        other => anyhow::bail!("unknown system {other} (known: {SYSTEMS})"),
    };
    if kind != EnvoyKind::RoundRobin {
        stack.start_host()?;
    }
    stack.start_envoy(kind, &config, a.envoy_concurrency)?;
    if kind != EnvoyKind::RoundRobin {
        stack.wait_snapshot(usize::from(pool.engines), Duration::from_secs(30))?;
    }
    let proxy_pid = stack.envoy.as_ref().map_or(0, |p| p.pid());
    let url = stack.url(sc.api.path());
    Ok(Started { stack, url, proxy_pid, peer: None })
}

/// What Attaché expected of the endpoints it picked, over the prompt tokens it sent.
#[derive(Debug, Clone, Copy)]
pub struct IndexRates {
    /// Calibrated against the engines' prefix-cache counters (policies::calibration).
    pub expected: f64,
    /// As its indexes believed, before calibration.
    pub believed: f64,
}

/// The hit rate Attaché expected for the endpoints it picked: the prompt tokens its primary was
/// expected to hold over the prompt tokens sent (`attache.prefix.{expected,believed,prompt}_tokens`,
/// added from each worker's tick). `None` for systems without the counters.
async fn expected_hit_rate(stack: &Stack) -> Option<IndexRates> {
    stack.envoy.as_ref()?;
    // The counters lag the requests by at most one tick.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stats = stack.envoy_stats();
    let get = |n: &str| attache_e2e::stats::stat_value(&stats, n) as f64;
    let total = get("wasmcustom.attache.prefix.prompt_tokens");
    (total > 0.0).then(|| IndexRates {
        expected: get("wasmcustom.attache.prefix.expected_tokens") / total,
        believed: get("wasmcustom.attache.prefix.believed_tokens") / total,
    })
}

async fn run_system(system: &str, sc: &Scenario, plan: Arc<Vec<SessionPlan>>, a: &Args) -> anyhow::Result<SystemRun> {
    let stages = sc.stages()?;
    let pool = &sc.pool;
    let blocks = sc.blocks_per_engine(plan.len());
    let Started { stack, url, proxy_pid, peer: peer_proc } = start(system, sc, plan.first(), blocks, a).await?;
    let (q0, h0) = stack.prefix_counters().await?;
    let lost0 = stack.sim_lost_ms().await?;
    let t0 = Instant::now();
    let cpu0 = crate::procstat::cpu_ns(proxy_pid);
    let sent =
        drive(&format!("{}/{system}", sc.name), &url, sc.api, plan.clone(), pool.time_scale, sc.request_timeout_s)
            .await;
    let real = t0.elapsed().as_secs_f64();
    let proxy_cpu_us = crate::procstat::cpu_ns(proxy_pid).saturating_sub(cpu0) as f64 / 1e3 / sent.len().max(1) as f64;
    let (q1, h1) = stack.prefix_counters().await?;
    let lost = stack.sim_lost_ms().await? - lost0;
    let hit = if q1 > q0 { (h1 - h0) / (q1 - q0) } else { 0.0 };
    let mut run = summarise(system, sc, &stages, &sent, hit);
    // How the system spread the load: requests each engine finished.
    let mut per_engine = Vec::new();
    for addr in stack.engine_addrs() {
        let text = stack.http.get(format!("http://{addr}/metrics")).send().await?.text().await?;
        let done: f64 = text
            .lines()
            .filter(|l| l.starts_with("vllm:request_success_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        per_engine.push(done as u64);
    }
    let lag = lost / 10.0 / (real * f64::from(pool.engines));
    run.extra = json!({"simulator_lag_percent": round2(lag), "real_seconds": round2(real),
                       "requests_per_engine": per_engine, "proxy_cpu_us_per_request": round2(proxy_cpu_us)});
    if plan.iter().any(|p| p.prompt_ids.is_some()) {
        run.extra["groups"] = groups_on_one_engine(&plan, &sent);
    }
    if let Some((_, metrics)) = &peer_proc {
        // What the peer's own counters say about its routing inputs (kv_aware's index lookups).
        run.extra["peer_metrics"] = peer_metrics(*metrics, "vllm_router_kv").await;
    }
    if system.starts_with("attache") {
        run.extra["session_sticky_hits"] = json!(stack.envoy_stat("wasmcustom.attache.session.sticky_hits"));
        run.expected_hit_rate = expected_hit_rate(&stack).await;
    }
    let expected = run
        .expected_hit_rate
        .map_or(String::new(), |e| format!(" (index expected {:.3}, believed {:.3})", e.expected, e.believed));
    println!(
        "  {system:<24} {} requests in {real:.0} s real, simulator lag {lag:.2}%, prefix hit rate {hit:.3}{expected}, per engine {per_engine:?}",
        sent.len()
    );
    println!(
        "    {:>6} {:>8} {:>12} {:>12} {:>17} {:>7}",
        "qps", "requests", "ttft_p50_ms", "ttft_p90_ms", "output_tok_per_s", "errors"
    );
    for s in &run.stages {
        println!(
            "    {:>6} {:>8} {:>12.1} {:>12.1} {:>17.1} {:>7}",
            s.qps, s.requests, s.ttft_p50_ms, s.ttft_p90_ms, s.output_tok_per_s, s.errors
        );
    }
    drop(peer_proc);
    Ok(run)
}

/// The closed-loop throughput of `system` on a fresh, cold pool.
async fn run_closed(
    system: &str,
    sc: &Scenario,
    plan: Arc<Vec<SessionPlan>>,
    cl: ClosedLoop,
    blocks: usize,
    a: &Args,
) -> anyhow::Result<Throughput> {
    let Started { stack, url, peer, .. } = start(system, sc, plan.first(), blocks, a).await?;
    let engines = stack.engine_addrs();
    let t =
        closed_loop::drive(&url, &engines, sc.api, plan.clone(), cl, sc.pool.time_scale, sc.request_timeout_s).await;
    let exhausted = if t.sessions >= plan.len() { " (the plan ran out: raise its stretch)" } else { "" };
    println!(
        "  {system:<24} closed loop, {} clients for {} s: {} turns, {:.1} output tok/s, engine hit rate {:?}, {} errors{exhausted}",
        cl.concurrency, cl.seconds, t.requests, t.output_tok_per_s, t.prefix_hit_rate, t.errors
    );
    drop((stack, peer));
    Ok(t)
}

/// The error of a peer that does not serve the scenario's API.
const UNSUPPORTED: &str = "does not serve this API";

/// Rollout groups whose served samples all landed on one engine, and their share.
fn groups_on_one_engine(plan: &[SessionPlan], sent: &[Sent]) -> Value {
    let mut engines: std::collections::BTreeMap<usize, std::collections::BTreeSet<String>> = Default::default();
    let mut at = 0;
    for p in plan {
        for s in sent.get(at..at + p.users.len()).unwrap_or(&[]) {
            if let Some(e) = s.outcome.engine_address.clone().filter(|_| s.outcome.ok()) {
                engines.entry(p.group).or_default().insert(e);
            }
        }
        at += p.users.len();
    }
    let one = engines.values().filter(|e| e.len() == 1).count();
    json!({"groups": engines.len(), "on_one_engine": one,
           "share": round2(one as f64 / engines.len().max(1) as f64)})
}

/// Must-show checks of the issues, computed from the mean rows over the seeds and, for the
/// comparisons with the peers, from the intervals.
fn checks(sc: &Scenario, rows: &[RunSummary], figs: &[Figures], extra: &serde_json::Map<String, Value>) -> Value {
    let row = |s: &str| rows.iter().find(|r| r.system == s);
    let fig = |s: &str| figs.iter().find(|f| f.system == s);
    let mut out = serde_json::Map::new();
    let ratio = |a: f64, b: f64| if b > 0.0 { (a / b * 1000.0).round() / 1000.0 } else { 0.0 };
    // The first seed's extras of a system.
    let first = |s: &str| extra.get(s).and_then(|e| e["seeds"].get(0)).cloned().unwrap_or(Value::Null);
    if let (ApiKind::Messages, Some(rr)) = (sc.api, row("round-robin")) {
        // The coding agent on the Messages API: TTFT p50 at most half of round-robin's, and an
        // engine-reported prefix hit rate of at least 0.8.
        for sys in ["attache-approx", "attache-precise"] {
            if let Some(r) = row(sys) {
                let t = ratio(r.ttft_p50_ms, rr.ttft_p50_ms);
                out.insert(
                    format!("{sys}_vs_round-robin"),
                    json!({"ttft_p50_ratio": t, "ttft_target": "<= 0.5", "prefix_hit_rate": r.prefix_hit_rate,
                           "hit_target": ">= 0.8", "met": t <= 0.5 && r.prefix_hit_rate >= 0.8}),
                );
            }
        }
    }
    if let (ApiKind::Generate, Some(rr)) = (sc.api, row("round-robin")) {
        let cpu = |s: &str| first(s)["proxy_cpu_us_per_request"].as_f64().unwrap_or(0.0);
        for sys in ["attache-approx", "attache-precise"] {
            if let Some(r) = row(sys) {
                out.insert(
                    format!("{sys}_vs_round-robin"),
                    json!({"prefix_hit_rate": [r.prefix_hit_rate, rr.prefix_hit_rate],
                           "output_tok_per_s_ratio": ratio(r.output_tok_per_s, rr.output_tok_per_s),
                           "ttft_p50_ratio": ratio(r.ttft_p50_ms, rr.ttft_p50_ms),
                           "groups_on_one_engine": first(sys)["groups"]["share"].clone(),
                           "proxy_cpu_us_per_request": cpu(sys)}),
                );
            }
        }
        out.insert(
            "precise_vs_approx_proxy_cpu".into(),
            json!({"ratio": ratio(cpu("attache-precise"), cpu("attache-approx")),
                   "note": "the first seed's run; the overhead benchmark's --api generate measures it over ten rounds"}),
        );
    }
    if sc.name == "kv-pressure" {
        // Under KV pressure, both modes at least match round-robin's output (the closed loop's
        // where it ran) and keep its TTFT p95, on the same runs.
        if let Some(rr) = fig("round-robin") {
            for sys in ["attache-approx", "attache-precise"] {
                let Some(f) = fig(sys) else { continue };
                let mean = |s: &Option<crate::spread::Spread>| s.as_ref().map_or(f64::NAN, |s| s.mean);
                let output = |f: &Figures| {
                    if f.closed_output_tok_per_s.is_some() {
                        mean(&f.closed_output_tok_per_s)
                    } else {
                        mean(&f.output_tok_per_s)
                    }
                };
                let (o, p95) = (ratio(output(f), output(rr)), ratio(mean(&f.ttft_p95_ms), mean(&rr.ttft_p95_ms)));
                out.insert(
                    format!("{sys}_under_kv_pressure_vs_round-robin"),
                    json!({"output_ratio": o, "output_target": ">= 1.0", "ttft_p95_ratio": p95,
                           "ttft_p95_target": "<= 1.0", "met": o >= 1.0 && p95 <= 1.0}),
                );
            }
        }
    }
    // The issue's goals against the best peer (lowest mean TTFT p50 among the peers run).
    let best_peer = figs
        .iter()
        .filter(|f| Peer::from_name(&f.system).is_some())
        .filter_map(|f| Some((f.system.as_str(), f.ttft_p50_ms.as_ref()?.mean)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    let best_attache = figs
        .iter()
        .filter(|f| f.system.starts_with("attache"))
        .filter_map(|f| Some((f.system.as_str(), f.ttft_p50_ms.as_ref()?.mean)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    if let (Some((peer, pt)), Some((sys, at))) = (best_peer, best_attache) {
        let goal = match sc.name.as_str() {
            "shared-prefix" | "agentic" => Some(0.8),
            "bursty-chat" => Some(1.0),
            _ => None,
        };
        let r = ratio(at, pt);
        out.insert(
            "ttft_p50_vs_best_peer".into(),
            json!({"attache": sys, "best_peer": peer, "ratio_of_means": r,
                   "goal": goal.map(|g| format!("<= {g}")), "met": goal.map(|g| r <= g)}),
        );
    }
    if sc.name == "low-cache" {
        if let Some(rr) = row("round-robin") {
            for sys in ["attache-approx", "attache-precise"] {
                if let Some(r) = row(sys) {
                    let ratio = r.output_tok_per_s / rr.output_tok_per_s;
                    out.insert(
                        format!("{sys}_throughput_vs_round-robin"),
                        json!({"ratio": (ratio * 1000.0).round() / 1000.0, "target": ">= 0.95", "met": ratio >= 0.95}),
                    );
                }
            }
        }
    }
    Value::Object(out)
}

fn markdown(
    sc: &Scenario,
    command: &str,
    figs: &[Figures],
    per_stage: &[(String, Vec<StageSummary>)],
    date: &str,
) -> String {
    let mut m = String::new();
    let _ = writeln!(m, "# {} ({date})\n\n{}\n", sc.name, sc.description);
    let _ = writeln!(
        m,
        "Command: `{command}`. Simulated time. \
         Each figure is the mean over the seeds with the lowest and highest in brackets.\n"
    );
    m.push_str(&crate::repeats::markdown(figs));
    let _ = writeln!(m, "\nTTFT p50 (ms) per stage, seed {}:\n", sc.seed);
    let qps: Vec<String> =
        per_stage.first().map(|(_, v)| v.iter().map(|s| s.qps.to_string()).collect()).unwrap_or_default();
    let _ = writeln!(m, "| system | {} |", qps.join(" | "));
    let _ = writeln!(m, "|---|{}", "---:|".repeat(qps.len()));
    for (sys, v) in per_stage {
        let cells: Vec<String> = v.iter().map(|s| format!("{:.0}", s.ttft_p50_ms)).collect();
        let _ = writeln!(m, "| {sys} | {} |", cells.join(" | "));
    }
    m
}

/// A plot panel: its label, whether its y axis is logarithmic, and the figure it plots.
type Panel = (&'static str, bool, fn(&StageSummary) -> f64);

/// An SVG with two panels, TTFT p50 (log scale) and output tok/s, against the stage rate.
pub fn svg(title: &str, per_stage: &[(String, Vec<StageSummary>)]) -> String {
    const COLORS: [&str; 6] = ["#7f7f7f", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];
    let (w, h, pad) = (440.0, 300.0, 60.0);
    let xs: Vec<f64> = per_stage.iter().flat_map(|(_, v)| v.iter().map(|s| s.qps)).collect();
    let (x0, x1) = (xs.iter().copied().fold(f64::INFINITY, f64::min), xs.iter().copied().fold(0.0, f64::max));
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"18\" font-size=\"14\">{title}</text>\n",
        2.0 * w + 20.0,
        h + 70.0 + 16.0 * per_stage.len() as f64
    );
    let panels: [Panel; 2] =
        [("TTFT p50 (ms, log)", true, |s| s.ttft_p50_ms), ("output tok/s", false, |s| s.output_tok_per_s)];
    for (pi, (label, log, get)) in panels.iter().enumerate() {
        let ox = pi as f64 * (w + 20.0);
        let vals: Vec<f64> = per_stage
            .iter()
            .flat_map(|(_, v)| v.iter().map(get))
            .filter(|v| v.is_finite() && (!*log || *v > 0.0))
            .collect();
        let t = |v: f64| if *log { v.max(1e-3).log10() } else { v };
        let lo = if *log { vals.iter().copied().map(t).fold(f64::INFINITY, f64::min).floor() } else { 0.0 };
        let hi = vals.iter().copied().map(t).fold(f64::NEG_INFINITY, f64::max);
        let hi = if *log { hi.ceil().max(lo + 1.0) } else { (hi * 1.1).max(1.0) };
        let px = |x: f64| ox + pad + (x - x0) / (x1 - x0).max(1e-9) * (w - pad - 10.0);
        let py = |v: f64| 30.0 + (h - 40.0) * (1.0 - (t(v) - lo) / (hi - lo).max(1e-9));
        let _ = writeln!(
            out,
            "<rect x=\"{}\" y=\"30\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#ccc\"/><text x=\"{}\" y=\"{}\">{label} vs offered rate (per s)</text>",
            ox + pad,
            w - pad - 10.0,
            h - 40.0,
            ox + pad,
            h + 20.0
        );
        // Log panels: one tick per decade; linear ones: five.
        let ticks = if *log { (hi - lo).round().clamp(1.0, 8.0) as u32 } else { 4 };
        for k in 0..=ticks {
            let f = f64::from(k) / f64::from(ticks);
            let v = lo + (hi - lo) * f;
            let shown = if *log { 10f64.powf(v) } else { v };
            let y = 30.0 + (h - 40.0) * (1.0 - f);
            let _ = writeln!(
                out,
                "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{shown:.0}</text>",
                ox + pad - 4.0,
                y + 4.0
            );
        }
        for x in xs.iter().take(per_stage.first().map_or(0, |(_, v)| v.len())) {
            let _ = writeln!(out, "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{x}</text>", px(*x), h + 2.0);
        }
        for (i, (_, v)) in per_stage.iter().enumerate() {
            let pts: Vec<String> = v
                .iter()
                .filter(|s| get(s).is_finite() && (!*log || get(s) > 0.0))
                .map(|s| format!("{:.1},{:.1}", px(s.qps), py(get(s))))
                .collect();
            let c = COLORS[i % COLORS.len()];
            let _ = writeln!(
                out,
                "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>",
                pts.join(" ")
            );
            for p in &pts {
                let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(out, "<circle cx=\"{x}\" cy=\"{y}\" r=\"3\" fill=\"{c}\"/>");
            }
        }
    }
    for (i, (sys, _)) in per_stage.iter().enumerate() {
        let y = h + 40.0 + 16.0 * i as f64;
        let c = COLORS[i % COLORS.len()];
        let _ = writeln!(out, "<rect x=\"60\" y=\"{:.0}\" width=\"14\" height=\"4\" fill=\"{c}\"/><text x=\"80\" y=\"{:.0}\">{sys}</text>", y - 4.0, y);
    }
    out.push_str("</svg>\n");
    out
}

/// Sessions a closed-loop run may need: every client starting a session each quarter of a
/// simulated second that its turns take at the least.
fn closed_sessions(sc: &Scenario, plan: &[SessionPlan], cl: ClosedLoop) -> usize {
    let turns = plan.iter().map(|p| p.users.len()).max().unwrap_or(1).max(1);
    (cl.concurrency as f64 * (cl.seconds / (turns as f64 * 0.25)).ceil()).max(1.0) as usize
        + usize::from(sc.pool.engines)
}

async fn run_scenario(path: &Path, a: &Args, wpt: f64) -> anyhow::Result<()> {
    let mut base = Scenario::load(path)?;
    if (a.rate_scale - 1.0).abs() > 1e-9 {
        let scale = |s: &str| -> anyhow::Result<String> {
            Ok(crate::scenario::parse_stages(s)?
                .iter()
                .map(|st| format!("{}:{}", round2(st.rate * a.rate_scale), st.seconds))
                .collect::<Vec<_>>()
                .join(","))
        };
        base.arrivals.ladder = scale(&base.arrivals.ladder)?;
        base.arrivals.warmup = scale(&base.arrivals.warmup)?;
    }
    let closed = a.closed_loop.or(base.closed_loop);
    let seeds = a.seeds.max(1);
    let systems: Vec<&str> = a.systems.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    let stages = base.stages()?;
    let mut all: Vec<SystemSeeds> = systems.iter().map(|s| SystemSeeds::new(s, seeds)).collect();
    // The first seed's per-stage figures and extras (the plot and the per-engine spread).
    let mut per_stage: Vec<Option<Vec<StageSummary>>> = vec![None; systems.len()];
    let mut extra = serde_json::Map::new();
    let mut blocks = 0;
    for r in 0..seeds {
        let sc = Scenario { seed: base.seed + r as u64, ..base.clone() };
        let plan = Arc::new(sc.plan(wpt)?);
        blocks = sc.blocks_per_engine(plan.len());
        let closed_plan = match closed {
            Some(cl) => Some(Arc::new(sc.closed_plan(wpt, closed_sessions(&sc, &plan, cl))?)),
            None => None,
        };
        let requests: usize = plan.iter().map(|p| p.users.len()).sum();
        println!(
            "\npeers/{} seed {} ({}/{seeds}): {} sessions, {} requests ({} in warm-up sessions), {} engines x {blocks} KV blocks, time scale {}",
            sc.name,
            sc.seed,
            r + 1,
            plan.len(),
            requests,
            plan.iter().filter(|p| p.stage == 0).map(|p| p.users.len()).sum::<usize>(),
            sc.pool.engines,
            sc.pool.time_scale
        );
        for i in crate::spread::rotation(systems.len(), r) {
            let system = systems[i];
            if extra.get(system).is_some_and(|e: &Value| e.get("unsupported").is_some()) {
                continue;
            }
            let steal = crate::procstat::StealMeter::start();
            let mut run = match run_system(system, &sc, plan.clone(), a).await {
                Err(e) if e.to_string().contains(UNSUPPORTED) => {
                    println!("  {system:<24} skipped: {e}");
                    extra.insert(system.to_string(), json!({"unsupported": e.to_string()}));
                    continue;
                }
                other => other.with_context(|| format!("{} seed {}: {system}", sc.name, sc.seed))?,
            };
            if let (Some(cl), Some(cp)) = (closed, &closed_plan) {
                let t = run_closed(system, &sc, cp.clone(), cl, blocks, a)
                    .await
                    .with_context(|| format!("{} seed {} closed loop: {system}", sc.name, sc.seed))?;
                all[i].closed[r] = Some(t);
            }
            // Hypervisor steal while this system ran: the other guests' share of this VM's
            // CPUs, which moves a system's figures between runs.
            if let (Some(o), Some(p)) = (run.extra.as_object_mut(), steal.percent()) {
                o.insert("steal_pct".into(), json!((p * 10.0).round() / 10.0));
            }
            all[i].open[r] = Some(run.summary);
            all[i].expected_hit[r] = run.expected_hit_rate.map(|e| e.expected);
            all[i].believed_hit[r] = run.expected_hit_rate.map(|e| e.believed);
            let seen = extra.entry(system.to_string()).or_insert_with(|| json!({"seeds": []}));
            if let Some(v) = seen["seeds"].as_array_mut() {
                v.push(run.extra);
            }
            if per_stage[i].is_none() {
                per_stage[i] = Some(std::mem::take(&mut run.stages));
            }
        }
    }
    let figs: Vec<Figures> =
        all.iter().filter(|s| s.open.iter().any(Option::is_some)).map(SystemSeeds::figures).collect();
    let rows: Vec<RunSummary> = all.iter().filter_map(SystemSeeds::mean_row).collect();
    let per_stage: Vec<(String, Vec<StageSummary>)> =
        systems.iter().zip(per_stage).filter_map(|(s, v)| Some(((*s).to_string(), v?))).collect();
    crate::repeats::print(&format!("peers/{} (simulated time)", base.name), &figs);
    let comparisons = crate::repeats::comparisons(&figs);
    if let Some(pairs) = comparisons.as_object() {
        for pair in pairs.keys() {
            let v =
                |f: &str| crate::repeats::verdict_of(&comparisons, pair, f).map_or("-".into(), |v| format!("{v:?}"));
            println!(
                "  {pair}: TTFT p50 {}, TTFT p95 {}, output {}",
                v("ttft_p50_ms"),
                v("ttft_p95_ms"),
                v("output_tok_per_s")
            );
        }
    }
    let mut checks = checks(&base, &rows, &figs, &extra);
    checks["calibration"] = crate::repeats::calibration(&figs, 0.1);
    println!("checks: {}", serde_json::to_string_pretty(&checks)?);
    let command = format!(
        "cargo xtask bench peers --scenario {} --seeds {seeds}{}{}",
        path.display(),
        if a.systems == SYSTEMS { String::new() } else { format!(" --systems {}", a.systems) },
        a.closed_loop.map_or(String::new(), |c| format!(" --closed-loop {}:{}", c.concurrency, c.seconds))
    );
    let doc = json!({
        "scenario": base.name,
        "command": command,
        "units": "simulated time: latencies are real ms / time_scale, rates per simulated second",
        "scenario_file": base,
        "seeds": (0..seeds).map(|r| base.seed + r as u64).collect::<Vec<_>>(),
        "interval": "lowest to highest over the seeds; a comparison is a win only when the intervals do not overlap",
        "closed_loop": closed,
        "reference_tokens_per_word": round2(1.0 / wpt),
        "num_gpu_blocks_per_engine": blocks,
        "peer_versions": {"vllm-router": a.peers.vllm_router_version, "smg": a.peers.smg_version},
        "figures": figs,
        "comparisons": comparisons,
        "runs": rows,
        "stages": per_stage.iter().map(|(n, v)| (n.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "checks": checks,
        "per_system": extra,
        "ladder": stages.iter().skip(1).map(|s| s.rate).collect::<Vec<_>>(),
    });
    let out = a.out_dir.join(format!("peers-{}", base.name));
    crate::run::write_results(&out.with_extension("json"), doc)?;
    let date = std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let md = markdown(&base, &command, &figs, &per_stage, &date);
    std::fs::write(out.with_extension("md"), md)?;
    std::fs::write(
        out.with_extension("svg"),
        svg(&format!("{} ({date}, seed {}, simulated time)", base.name, base.seed), &per_stage),
    )?;
    println!("wrote {}.md and {}.svg", out.display(), out.display());
    Ok(())
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let wpt = words_per_token()?;
    println!("peers: reference tokenizer gives {:.2} tokens per generated word", 1.0 / wpt);
    for path in &a.scenarios {
        run_scenario(path, &a, wpt).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(qps: f64, ttft: f64, tput: f64) -> StageSummary {
        StageSummary {
            qps,
            requests: 1,
            ttft_p50_ms: ttft,
            ttft_p90_ms: ttft,
            output_tok_per_s: tput,
            errors: 0,
            sustained: true,
            within_slo: true,
        }
    }

    #[test]
    fn svg_has_one_line_per_system_and_skips_missing_points() {
        let data = vec![
            ("a".to_string(), vec![stage(1.0, 100.0, 10.0), stage(2.0, 1000.0, 20.0)]),
            ("b".to_string(), vec![stage(1.0, 200.0, 10.0), stage(2.0, f64::NAN, 5.0)]),
        ];
        let s = svg("t", &data);
        assert_eq!(s.matches("<polyline").count(), 4, "two panels x two systems");
        assert_eq!(s.matches("<circle").count(), 7, "the NaN TTFT point is left out");
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn kv_pressure_and_low_cache_checks_read_the_means_over_the_seeds() {
        let row = |s: &str, t: f64, tp: f64| RunSummary {
            system: s.into(),
            requests: 1,
            ttft_p50_ms: t,
            ttft_p95_ms: t * 2.0,
            output_tok_per_s: tp,
            prefix_hit_rate: 0.0,
            errors: 0,
            wall_s: 1.0,
        };
        let sc = |name: &str| -> Scenario {
            serde_json::from_str(&format!(
                r#"{{"name": "{name}", "description": "", "pool": {{"engines": 1, "time_scale": 1}},
                    "workload": {{"kind": "unique", "prompt_tokens": 1, "output_tokens": 1}}, "arrivals": {{"ladder": "1:1"}}}}"#
            ))
            .unwrap()
        };
        let systems = [("round-robin", 50.0, 100.0), ("attache-precise", 40.0, 96.0), ("attache-approx", 55.0, 101.0)];
        let mut all = Vec::new();
        for (s, t, tp) in systems {
            let mut seeds = SystemSeeds::new(s, 2);
            seeds.open = vec![Some(row(s, t, tp)), Some(row(s, t + 2.0, tp + 2.0))];
            all.push(seeds);
        }
        let figs: Vec<Figures> = all.iter().map(SystemSeeds::figures).collect();
        let rows: Vec<RunSummary> = all.iter().filter_map(SystemSeeds::mean_row).collect();
        let c = checks(&sc("low-cache"), &rows, &figs, &serde_json::Map::new());
        assert_eq!(c["attache-precise_throughput_vs_round-robin"]["met"], json!(true), "0.96 of round-robin");
        let c = checks(&sc("kv-pressure"), &rows, &figs, &serde_json::Map::new());
        let precise = &c["attache-precise_under_kv_pressure_vs_round-robin"];
        assert_eq!(precise["met"], json!(false), "lower output fails");
        assert_eq!(precise["ttft_p95_ratio"], json!(0.804));
        let approx = &c["attache-approx_under_kv_pressure_vs_round-robin"];
        assert_eq!((approx["output_ratio"].clone(), approx["met"].clone()), (json!(1.01), json!(false)), "p95 1.1x");
        // With closed-loop figures, output is read from them.
        all[1].closed = vec![Some(Throughput { output_tok_per_s: 120.0, ..Throughput::default() }); 2];
        all[0].closed = vec![Some(Throughput { output_tok_per_s: 100.0, ..Throughput::default() }); 2];
        let figs: Vec<Figures> = all.iter().map(SystemSeeds::figures).collect();
        let c = checks(&sc("kv-pressure"), &rows, &figs, &serde_json::Map::new());
        assert_eq!(c["attache-precise_under_kv_pressure_vs_round-robin"]["met"], json!(true));
    }
}
