//! Flow control, measured side by side in one run on the real Envoy and simulated engines:
//!
//! - **bursty agents vs interactive chat**: one tenant floods the pool with agent loops
//!   (growing contexts, back-to-back turns, starting in bursts) at priority 0, while another
//!   sends interactive chat (Poisson arrivals, streaming) at priority 10 through the
//!   `interactive` objective. The interactive TTFT is measured on an idle pool, then under the
//!   flood without and with flow control (same request sequences, fresh engines each run).
//! - **fairness**: four tenants with 12, 6, 3 and 3 closed-loop clients oversubscribe the pool
//!   3×; Jain's index over the output tokens each was served, without and with flow control.
//!
//! Every request is accounted for: served, answered 429 or 503, or counted as lost.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use attache_e2e::client::{self, Outcome};
use attache_e2e::load::{self, TenantStats};
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use attache_policies::rng::SplitMix64;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::Mutex;

use crate::run::{percentile, write_results};

const MODEL: &str = "tinyllama";

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    #[arg(long, default_value = "bench/results/flow-control.json")]
    out: PathBuf,
    #[arg(long, default_value_t = 2)]
    engines: u16,
    /// Seconds of interactive traffic per run.
    #[arg(long, default_value_t = 60)]
    duration_s: u64,
    /// Interactive requests per second (Poisson).
    #[arg(long, default_value_t = 4.0)]
    interactive_rps: f64,
    /// Agent loops started per burst, and seconds between bursts.
    #[arg(long, default_value_t = 24)]
    agents_per_burst: usize,
    #[arg(long, default_value_t = 10)]
    burst_every_s: u64,
    /// Turns per agent loop.
    #[arg(long, default_value_t = 8)]
    turns: usize,
    /// The agent band's saturation ceiling with flow control (priority hold-back).
    #[arg(long, default_value_t = 0.25)]
    agent_ceiling: f64,
    /// Seconds of the fairness runs (after 3 s of warm-up).
    #[arg(long, default_value_t = 20)]
    fairness_s: u64,
    /// The saturation detector's queue threshold in the fairness runs.
    #[arg(long, default_value_t = 1.0)]
    fairness_queue_threshold: f64,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// ~4 bytes per simulated token.
fn words(rng: &mut SplitMix64, tokens: usize) -> String {
    const W: [&str; 12] =
        ["tool", "result", "file", "patch", "test", "build", "error", "line", "module", "call", "step", "value"];
    let mut s = String::with_capacity(tokens * 4 + 8);
    while s.len() < tokens * 4 {
        s.push_str(W[(rng.next_u64() % W.len() as u64) as usize]);
        s.push(' ');
    }
    s
}

/// One interactive request: when to send it and its body.
struct Chat {
    at: Duration,
    body: Vec<u8>,
}

fn interactive_plan(a: &Args) -> Vec<Chat> {
    let mut rng = SplitMix64::new(a.seed);
    let system = format!("You are the support assistant. {}", words(&mut rng, 600));
    let mut t = 0.0;
    let mut out = Vec::new();
    loop {
        // Exponential inter-arrival times.
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        t += -(1.0 - u).ln() / a.interactive_rps;
        if t >= a.duration_s as f64 {
            break;
        }
        let body = client::chat_body(MODEL, &system, &format!("Question: {}", words(&mut rng, 40)), 32);
        out.push(Chat { at: Duration::from_secs_f64(t), body });
    }
    out
}

/// One agent loop: its start and, per turn, the tool output it appends.
struct AgentLoop {
    at: Duration,
    system: String,
    tool_outputs: Vec<String>,
}

fn agent_plan(a: &Args) -> Vec<AgentLoop> {
    let mut rng = SplitMix64::new(a.seed ^ 0xa6e7);
    let mut out = Vec::new();
    let mut burst = 0u64;
    while burst * a.burst_every_s < a.duration_s {
        for i in 0..a.agents_per_burst {
            out.push(AgentLoop {
                at: Duration::from_secs(burst * a.burst_every_s) + Duration::from_millis(i as u64 * 20),
                system: format!("You are coding agent {burst}-{i}. Repository map: {}", words(&mut rng, 1500)),
                tool_outputs: (0..a.turns).map(|_| words(&mut rng, 300)).collect(),
            });
        }
        burst += 1;
    }
    out
}

#[derive(Debug, Default, Clone, Serialize)]
struct Tally {
    sent: usize,
    served: usize,
    shed: usize,
    lost: usize,
}

impl Tally {
    fn add(&mut self, o: &Outcome) {
        self.sent += 1;
        match (o.status, o.error.is_none() && (o.status != 200 || o.done)) {
            (200, true) => self.served += 1,
            (429 | 503, true) => self.shed += 1,
            _ => self.lost += 1,
        }
    }
}

async fn run_interactive(url: String, plan: Arc<Vec<Chat>>, start: Instant) -> (Vec<Outcome>, Tally) {
    let mut tasks = Vec::new();
    for i in 0..plan.len() {
        let (url, plan) = (url.clone(), plan.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until((start + plan[i].at).into()).await;
            let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap_or_default();
            let headers = [("x-llm-d-inference-objective", "interactive"), ("x-attache-tenant", "chat")];
            client::post(&http, &url, plan[i].body.clone(), &headers).await
        }));
    }
    let mut out = Vec::new();
    let mut tally = Tally::default();
    for t in tasks {
        let o = t.await.unwrap_or_default();
        tally.add(&o);
        out.push(o);
    }
    (out, tally)
}

/// Run every agent loop: turns back to back, each adding the reply and a tool output to the
/// conversation; a 429/503 waits its Retry-After (1 s) and retries the turn.
async fn run_agents(
    url: String,
    plan: Arc<Vec<AgentLoop>>,
    start: Instant,
    until: Instant,
    tokens: Arc<Mutex<u64>>,
) -> Tally {
    let mut tasks = Vec::new();
    for i in 0..plan.len() {
        let (url, plan, tokens) = (url.clone(), plan.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            let lp = &plan[i];
            tokio::time::sleep_until((start + lp.at).into()).await;
            let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap_or_default();
            let mut messages = vec![json!({"role": "system", "content": lp.system})];
            let mut tally = Tally::default();
            let headers = [("x-attache-tenant", "agents")];
            for tool in &lp.tool_outputs {
                messages.push(json!({"role": "user", "content": tool}));
                // The flood stops with the interactive traffic; turns in flight finish.
                while Instant::now() < until {
                    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 96, "stream": true,
                                      "stream_options": {"include_usage": true}});
                    let o = client::post(&http, &url, body.to_string().into_bytes(), &headers).await;
                    tally.add(&o);
                    if o.status == 429 || o.status == 503 {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                    if Instant::now() <= until {
                        *tokens.lock().await += o.output_tokens;
                    }
                    let reply = o.streamed_text();
                    messages.push(json!({"role": "assistant", "content": reply}));
                    break;
                }
            }
            tally
        }));
    }
    let mut total = Tally::default();
    for t in tasks {
        let t = t.await.unwrap_or_default();
        total.sent += t.sent;
        total.served += t.served;
        total.shed += t.shed;
        total.lost += t.lost;
    }
    total
}

fn sim(a: &Args, max_num_seqs: usize) -> SimOpts {
    SimOpts { engines: a.engines, max_num_seqs, num_gpu_blocks: 2048, time_scale: 1.0, ..SimOpts::default() }
}

/// A fresh stack: engines, the host (objectives interactive 10, agent 0) and Envoy, with flow
/// control as given.
fn stack(name: &str, opts: SimOpts, flow: Option<Value>, saturation: Value) -> anyhow::Result<Stack> {
    let mut s = Stack::new(name)?;
    s.host_flow = Some(json!({"saturation": saturation, "objectives": {"interactive": 10, "agent": 0}}));
    let engines = usize::from(opts.engines);
    s.start_sim(opts)?;
    s.start_host()?;
    let mut cfg = Stack::default_scheduler_config();
    if let Some(f) = flow {
        cfg["flow"] = f;
    }
    s.start_envoy(EnvoyKind::Attache, &cfg, 2)?;
    s.wait_snapshot(engines, Duration::from_secs(20))?;
    Ok(s)
}

fn ttft_ms(outcomes: &[Outcome]) -> Vec<f64> {
    let mut v: Vec<f64> =
        outcomes.iter().filter(|o| o.ok()).filter_map(|o| o.ttft).map(|d| d.as_secs_f64() * 1000.0).collect();
    v.sort_by(f64::total_cmp);
    v
}

fn r2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let chats = Arc::new(interactive_plan(&a));
    let agents = Arc::new(agent_plan(&a));
    let saturation = json!({"queue_threshold": 5.0, "kv_threshold": 0.8, "stale_ms": 200});
    let flow_on = json!({"enabled": true, "bands": {"0": {"ceiling": a.agent_ceiling}}});
    println!(
        "flow control: {} engines; {} interactive requests over {} s; {} agent loops x {} turns in bursts of {} every {} s",
        a.engines,
        chats.len(),
        a.duration_s,
        agents.len(),
        a.turns,
        a.agents_per_burst,
        a.burst_every_s
    );
    let mut runs = Vec::new();
    let mut p95 = std::collections::BTreeMap::new();
    for (system, with_agents, flow) in
        [("idle", false, Some(flow_on.clone())), ("flow-off", true, None), ("flow-on", true, Some(flow_on.clone()))]
    {
        let s = stack(&format!("flow-{system}"), sim(&a, 64), flow.clone(), saturation.clone())?;
        let url = s.url("/v1/chat/completions");
        let start = Instant::now() + Duration::from_millis(200);
        let tokens = Arc::new(Mutex::new(0u64));
        let until = start + Duration::from_secs(a.duration_s);
        let agent_task =
            with_agents.then(|| tokio::spawn(run_agents(url.clone(), agents.clone(), start, until, tokens.clone())));
        let (outcomes, chat_tally) = run_interactive(url, chats.clone(), start).await;
        let agent_tally = match agent_task {
            Some(t) => t.await.unwrap_or_default(),
            None => Tally::default(),
        };
        let wall = start.elapsed().as_secs_f64();
        let agent_tokens = *tokens.lock().await;
        let window = a.duration_s.max(1) as f64;
        let t = ttft_ms(&outcomes);
        let row = json!({
            "system": system,
            "flow_control": flow.is_some(),
            "agents": with_agents,
            "interactive": {
                "requests": chat_tally.sent, "served": chat_tally.served, "shed": chat_tally.shed, "lost": chat_tally.lost,
                "ttft_p50_ms": r2(percentile(&t, 50.0)), "ttft_p95_ms": r2(percentile(&t, 95.0)),
                "ttft_p99_ms": r2(percentile(&t, 99.0)),
            },
            "agent": {
                "requests": agent_tally.sent, "served": agent_tally.served, "shed": agent_tally.shed, "lost": agent_tally.lost,
                "output_tokens": agent_tokens, "output_tok_per_s": r2(agent_tokens as f64 / window),
            },
            "wall_s": r2(wall),
            "envoy_flow": {
                "enqueued": s.envoy_stat("wasmcustom.attache.flow.enqueued"),
                "dispatched": s.envoy_stat("wasmcustom.attache.flow.dispatched"),
                "queued_at_end": s.envoy_stat("wasmcustom.attache.flow.queued"),
            },
        });
        println!(
            "  {system:<9} interactive p50 {:>7.1} ms p95 {:>7.1} ms ({} sent, {} served, {} shed, {} lost); agents {} sent, {} served, {:.0} tok/s",
            percentile(&t, 50.0),
            percentile(&t, 95.0),
            chat_tally.sent,
            chat_tally.served,
            chat_tally.shed,
            chat_tally.lost,
            agent_tally.sent,
            agent_tally.served,
            agent_tokens as f64 / window
        );
        p95.insert(system, percentile(&t, 95.0));
        runs.push(row);
    }
    // Fairness: four tenants with 12, 6, 3 and 3 clients on a pool that runs 2 x 4 sequences.
    let clients = [12usize, 6, 3, 3];
    let fair_sat = json!({"queue_threshold": a.fairness_queue_threshold, "kv_threshold": 0.8, "stale_ms": 1000});
    let mut jain = std::collections::BTreeMap::new();
    for (system, flow) in [("fairness-flow-off", None), ("fairness-flow-on", Some(json!({"enabled": true})))] {
        let opts = SimOpts { time_scale: 0.5, ..sim(&a, 4) };
        let s = stack(system, opts, flow.clone(), fair_sat.clone())?;
        let (stats, tally) = load::tenants_closed_loop(
            &s.url("/v1/chat/completions"),
            &clients,
            Duration::from_secs(3),
            Duration::from_secs(a.fairness_s),
            24,
        )
        .await;
        let j = load::jain(&stats);
        let tenants: Vec<Value> = stats.iter().map(tenant_row).collect();
        println!(
            "  {system:<18} Jain {j:.3}; window tokens {:?}; {} served, {} shed, {} lost",
            stats.iter().map(|t| t.window_tokens).collect::<Vec<_>>(),
            tally.served,
            tally.shed,
            tally.lost
        );
        jain.insert(system, j);
        runs.push(json!({
            "system": system, "flow_control": flow.is_some(), "jain_fairness": (j * 1000.0).round() / 1000.0,
            "tenants": tenants, "served": tally.served, "shed": tally.shed, "lost": tally.lost,
        }));
    }
    let idle = p95.get("idle").copied().unwrap_or(f64::NAN);
    let ratio = |k: &str| r2(p95.get(k).copied().unwrap_or(f64::NAN) / idle);
    let doc = json!({
        "scenario": "bursty-agents-vs-interactive-chat",
        "command": "cargo xtask bench flow-control",
        "interactive_p95_ratio_vs_idle": ratio("flow-on"),
        "interactive_p95_ratio_vs_idle_without_flow_control": ratio("flow-off"),
        "jain_fairness": jain.get("fairness-flow-on").map(|j| (j * 1000.0).round() / 1000.0),
        "jain_fairness_without_flow_control": jain.get("fairness-flow-off").map(|j| (j * 1000.0).round() / 1000.0),
        "config": {
            "engines": a.engines, "max_num_seqs": 64, "num_gpu_blocks": 2048, "duration_s": a.duration_s,
            "interactive_rps": a.interactive_rps, "interactive_prompt_tokens": 650, "interactive_max_tokens": 32,
            "agents_per_burst": a.agents_per_burst, "burst_every_s": a.burst_every_s, "turns": a.turns,
            "agent_system_tokens": 1500, "agent_tool_output_tokens": 300, "agent_max_tokens": 96,
            "agent_band_ceiling": a.agent_ceiling, "saturation": saturation,
            "fairness": {"clients": clients, "engines": a.engines, "max_num_seqs": 4, "seconds": a.fairness_s,
                          "saturation": fair_sat},
            "seed": a.seed,
        },
        "runs": runs,
    });
    println!(
        "\ninteractive p95 TTFT vs idle: {:.2}x with flow control, {:.2}x without; Jain {:.3} with, {:.3} without",
        ratio("flow-on"),
        ratio("flow-off"),
        jain.get("fairness-flow-on").copied().unwrap_or(f64::NAN),
        jain.get("fairness-flow-off").copied().unwrap_or(f64::NAN)
    );
    write_results(&a.out, doc)
}

fn tenant_row(t: &TenantStats) -> Value {
    json!({"tenant": t.tenant, "clients": t.clients, "sent": t.sent, "served": t.served, "shed": t.shed,
           "window_tokens": t.window_tokens, "window_requests": t.window_requests})
}
