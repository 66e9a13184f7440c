//! `attache-bench`: the demo and the side-by-side benchmarks.

// A harness: its scenarios read top to bottom (workspace lint `too_many_lines`).
#![allow(clippy::too_many_lines)]

mod agents;
mod async_batch;
mod closed_loop;
mod compare;
mod conversation;
mod cpus;
mod epp;
mod flow_control;
mod kv_ingest;
mod load;
mod models;
mod overhead;
mod pd;
mod peers;
mod policy;
mod precise_growth;
mod procstat;
mod progress;
mod repeats;
mod responses;
mod run;
mod scale;
mod scenario;
mod shared_prefix;
mod spread;
mod up;
mod workload;

#[global_allocator]
static ALLOC: kv_ingest::Counting = kv_ingest::Counting;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use clap::{Parser, Subcommand};
use serde_json::json;

#[derive(Parser)]
#[command(name = "attache-bench", about = "Attaché demo and benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Shared-prefix chat through Envoy: plain round-robin, then Attaché, on 4 simulated engines.
    Demo(DemoArgs),
    /// Async inference into spare capacity: interactive chat with and without `attache async`
    /// draining a batch backlog (TTFT p95 ratio, batch share of the idle capacity).
    Async(async_batch::Args),
    /// Start simulated engines, the host and Envoy, and keep them running until Ctrl-C.
    Up(up::Args),
    /// llm-d's shared-prefix workload on 8 engines: round-robin vs approximate vs precise.
    SharedPrefix(shared_prefix::Args),
    /// Custom scorer filters: per-request cost, upload time, promote -> first served request.
    Policy(policy::Args),
    /// Flow control: bursty agents vs interactive chat (TTFT vs idle), and tenant fairness.
    FlowControl(flow_control::Args),
    /// Prefill/decode disaggregation on long prompts: 4 mixed engines vs 2P+2D and 1P+3D.
    Pd(pd::Args),
    /// Multi-turn agents: session- and Responses-aware routing vs round-robin vs an oracle.
    Agents(agents::Args),
    /// Gateway Responses state: a continuation vs a plain request of the same size, and the
    /// host's bytes per stored response.
    Responses(responses::Args),
    /// The cost of deciding in Envoy: added latency and Envoy CPU per request vs plain Envoy.
    Overhead(overhead::Args),
    /// One conversation growing from 2k to 100k tokens: proxy CPU per request of each mode.
    PreciseGrowth(precise_growth::Args),
    /// In-Envoy filter vs endpoint picker (ext_proc): added latency and CPU per request.
    Epp(epp::Args),
    /// Side by side with the peer routers on file-described scenarios (`bench/scenarios/`).
    Peers(compare::Args),
    /// Sustained load: 2,000 concurrent streaming clients for 60 s; errors, latency, memory, CPU.
    Load(load::Args),
    /// Many models behind one gateway: decision time against one model on as many engines.
    Models(models::Args),
    /// Pools of 100, 1,000 and 10,000 endpoints: decision time, snapshot bytes, Envoy memory,
    /// host CPU and memory, KV-event propagation.
    Scale(scale::Args),
    /// Host KV-event ingest rate on one core, and index bytes per entry.
    KvIngest {
        #[arg(long, default_value = "bench/results/kv-ingest.json")]
        out: PathBuf,
    },
}

#[derive(Parser, Debug, Clone)]
struct DemoArgs {
    #[arg(long, default_value = "bench/results/demo.json")]
    out: PathBuf,
    #[arg(long, default_value_t = 4)]
    engines: u16,
    /// Distinct long system prompts.
    #[arg(long, default_value_t = 16)]
    groups: usize,
    /// Requests per system prompt.
    #[arg(long, default_value_t = 16)]
    per_group: usize,
    #[arg(long, default_value_t = 4000)]
    prefix_tokens: usize,
    #[arg(long, default_value_t = 60)]
    question_tokens: usize,
    #[arg(long, default_value_t = 48)]
    max_tokens: u64,
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Simulated step times are multiplied by this.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Share of the cluster's KV cache the shared prefixes fill (llm-d's canonical run: ~0.73).
    #[arg(long, default_value_t = 0.73)]
    prefix_kv_share: f64,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    envoy_concurrency: u32,
    /// Also run Attaché with another build of the filter, `LABEL=PATH`, in the same run: e.g.
    /// `--variant-wasm before=/tmp/old/attache_scheduler_filter.wasm` for a before/after check.
    #[arg(long = "variant-wasm")]
    variant_wasm: Vec<String>,
}

async fn demo(a: DemoArgs) -> anyhow::Result<()> {
    let items =
        workload::shared_prefix(a.groups, a.per_group, a.prefix_tokens, a.question_tokens, a.max_tokens, a.seed);
    let prefix_total = (a.groups * a.prefix_tokens) as f64;
    let blocks_per_engine =
        ((prefix_total / a.prefix_kv_share) / f64::from(a.engines) / a.block_size as f64).ceil() as usize;
    let sim = SimOpts {
        engines: a.engines,
        model: "tinyllama".into(),
        block_size: a.block_size,
        num_gpu_blocks: blocks_per_engine,
        max_num_seqs: 32,
        time_scale: a.time_scale,
        kv_events: false,
        ..SimOpts::default()
    };
    println!(
        "demo: {} requests ({} groups x {}), {}-token shared prefixes, {} engines x {} KV blocks of {} tokens, concurrency {}, time scale {}",
        items.len(),
        a.groups,
        a.per_group,
        a.prefix_tokens,
        a.engines,
        blocks_per_engine,
        a.block_size,
        a.concurrency,
        a.time_scale
    );
    let mut rows = Vec::new();
    let mut systems =
        vec![("round-robin".to_owned(), EnvoyKind::RoundRobin, None), ("attache".to_owned(), EnvoyKind::Attache, None)];
    for v in &a.variant_wasm {
        let (label, path) = v.split_once('=').with_context(|| format!("--variant-wasm {v}: expected LABEL=PATH"))?;
        anyhow::ensure!(std::path::Path::new(path).exists(), "--variant-wasm {label}: no filter at {path}");
        systems.push((format!("attache/{label}"), EnvoyKind::Attache, Some(PathBuf::from(path))));
    }
    for (system, kind, wasm) in &systems {
        let (system, kind) = (system.as_str(), *kind);
        let mut stack = Stack::new(&format!("demo-{}", system.replace('/', "-")))?;
        if let Some(w) = wasm {
            stack.paths.wasm.clone_from(w);
        }
        stack.start_sim(sim.clone())?;
        if kind != EnvoyKind::RoundRobin {
            stack.start_host()?;
        }
        stack.start_envoy(kind, &Stack::default_scheduler_config(), a.envoy_concurrency)?;
        if kind != EnvoyKind::RoundRobin {
            stack.wait_snapshot(usize::from(a.engines), Duration::from_secs(20))?;
        }
        let (q0, h0) = stack.prefix_counters().await?;
        let (outcomes, wall) = run::drive(
            &format!("demo/{system}"),
            &stack.http,
            &stack.url("/v1/chat/completions"),
            "tinyllama",
            &items,
            a.concurrency,
        )
        .await;
        let (q1, h1) = stack.prefix_counters().await?;
        let row = run::summarise(system, &outcomes, wall, q1 - q0, h1 - h0);
        println!("  {system}: done in {:.1}s", row.wall_s);
        rows.push(row);
    }
    run::print_table("shared-prefix chat (demo)", &rows);
    let doc = json!({
        "scenario": "shared-prefix-chat",
        "command": "cargo xtask demo",
        "config": {
            "engines": a.engines, "groups": a.groups, "per_group": a.per_group, "prefix_tokens": a.prefix_tokens,
            "question_tokens": a.question_tokens, "max_tokens": a.max_tokens, "concurrency": a.concurrency,
            "time_scale": a.time_scale, "block_size": a.block_size, "num_gpu_blocks_per_engine": blocks_per_engine,
            "prefix_kv_share": a.prefix_kv_share, "seed": a.seed,
        },
        "runs": rows,
    });
    crate::run::write_results(&a.out, doc)?;
    let plot = a.out.with_extension("svg");
    let title = format!("shared-prefix chat: {} engines, {} requests", a.engines, items.len());
    std::fs::write(&plot, crate::run::bars_svg(&title, &rows))
        .with_context(|| format!("writing {}", plot.display()))?;
    println!("wrote {}", plot.display());
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Demo(a) => demo(a).await,
        Cmd::Up(a) => up::run(a).await,
        Cmd::KvIngest { out } => kv_ingest::run(&out),
        Cmd::SharedPrefix(a) => shared_prefix::run(a).await,
        Cmd::Policy(a) => policy::run(a).await,
        Cmd::FlowControl(a) => flow_control::run(a).await,
        Cmd::Async(a) => async_batch::run(a).await,
        Cmd::Pd(a) => pd::run(a).await,
        Cmd::Overhead(a) => overhead::run(a).await,
        Cmd::PreciseGrowth(a) => precise_growth::run(a).await,
        Cmd::Epp(a) => epp::run(a).await,
        Cmd::Agents(a) => agents::run(a).await,
        Cmd::Responses(a) => responses::run(a).await,
        Cmd::Load(a) => load::run(a).await,
        Cmd::Models(a) => models::run(a).await,
        Cmd::Scale(a) => scale::run(a).await,
        Cmd::Peers(a) => compare::run(a).await,
    }
}
