//! Async inference into spare capacity, measured in one run on the real Envoy and simulated
//! engines. Three runs on fresh stacks, with the same request sequences:
//!
//! 1. **interactive**: streaming chat at a steady Poisson rate on a pool with headroom.
//! 2. **capacity**: the batch backlog alone, the worker's gate wide open: the pool's full
//!    output rate on that work.
//! 3. **interactive + async**: the same chat while `attache async` drains the backlog through
//!    the gateway, gated at its ceiling.
//!
//! Reported: interactive TTFT p95 with and without the worker (must stay ≤ 1.2×), batch
//! output tokens per second, and the share of the pool's idle capacity the batch work used:
//! batch tok/s in run 3 over (capacity − interactive tok/s of run 1), which must be ≥ 50%.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::async_worker::AsyncWorker;
use attache_e2e::client::{self, Outcome};
use attache_e2e::redis::Redis;
use attache_e2e::stats::stat_line;
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use attache_host::async_worker::job::{JobResult, Status};
use attache_host::async_worker::queue::Queue;
use attache_policies::rng::SplitMix64;
use serde_json::{json, Value};

use crate::run::{percentile, round2, write_results};

const MODEL: &str = "tinyllama";

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    #[arg(long, default_value = "bench/results/async.json")]
    out: PathBuf,
    #[arg(long, default_value_t = 2)]
    engines: u16,
    /// Sequences each engine runs at once.
    #[arg(long, default_value_t = 16)]
    max_num_seqs: usize,
    /// Seconds of traffic per run.
    #[arg(long, default_value_t = 60)]
    duration_s: u64,
    /// Interactive requests per second (Poisson), streaming, 64 output tokens.
    #[arg(long, default_value_t = 3.0)]
    interactive_rps: f64,
    /// Batch jobs submitted before each run (more than a run can finish).
    #[arg(long, default_value_t = 3000)]
    jobs: usize,
    /// Output tokens per batch job.
    #[arg(long, default_value_t = 256)]
    job_tokens: u64,
    /// Prompt tokens per batch job (each its own document): 800 for summaries (prefill-heavy);
    /// a generation backlog (synthetic data, evaluations) has short prompts and long outputs.
    #[arg(long, default_value_t = 800)]
    job_prompt_tokens: usize,
    /// The worker's saturation ceiling and concurrency in the interactive + async run.
    #[arg(long, default_value_t = 0.8)]
    ceiling: f64,
    #[arg(long, default_value_t = 10)]
    concurrency: usize,
    #[arg(long, default_value_t = 11)]
    seed: u64,
}

/// ~4 bytes per simulated token.
fn words(rng: &mut SplitMix64, tokens: usize) -> String {
    const W: [&str; 10] = ["report", "table", "figure", "claim", "source", "note", "total", "method", "result", "page"];
    let mut s = String::with_capacity(tokens * 4 + 8);
    while s.len() < tokens * 4 {
        s.push_str(W[(rng.next_u64() % W.len() as u64) as usize]);
        s.push(' ');
    }
    s
}

fn interactive_plan(a: &Args) -> Vec<(Duration, Vec<u8>)> {
    let mut rng = SplitMix64::new(a.seed);
    let system = format!("You are the support assistant. {}", words(&mut rng, 600));
    let (mut t, mut out) = (0.0, Vec::new());
    loop {
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        t += -(1.0 - u).ln() / a.interactive_rps;
        if t >= a.duration_s as f64 {
            return out;
        }
        let body = client::chat_body(MODEL, &system, &format!("Question: {}", words(&mut rng, 40)), 64);
        out.push((Duration::from_secs_f64(t), body));
    }
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// The backlog: summaries of `job_prompt_tokens`-token documents, each its own, sent under
/// `objective`.
fn jobs(a: &Args, objective: &str) -> Vec<Vec<u8>> {
    let mut rng = SplitMix64::new(a.seed ^ 0xba7c);
    (0..a.jobs)
        .map(|i| {
            let payload = json!({"model": MODEL, "max_tokens": a.job_tokens, "messages": [
                {"role": "user", "content": format!("Summarise document {i}: {}", words(&mut rng, a.job_prompt_tokens))}]});
            let job = json!({"id": format!("doc-{i:05}"), "created": unix_now(), "deadline": unix_now() + 3600.0,
                "payload": payload, "metadata": {"tenant": "batch", "objective": objective}});
            job.to_string().into_bytes()
        })
        .collect()
}

fn stack(name: &str, a: &Args) -> anyhow::Result<Stack> {
    let mut s = Stack::new(name)?;
    // `standard` (priority 0) is the capacity run's: never shed, so it measures the pool.
    s.host_flow = Some(json!({"objectives": {"interactive": 10, "standard": 0, "batch": -1}}));
    let opts = SimOpts {
        engines: a.engines,
        max_num_seqs: a.max_num_seqs,
        num_gpu_blocks: 4096,
        time_scale: 1.0,
        ..SimOpts::default()
    };
    s.start_sim(opts)?;
    s.start_host()?;
    let mut cfg = Stack::default_scheduler_config();
    cfg["flow"] = json!({"enabled": true});
    s.start_envoy(EnvoyKind::Attache, &cfg, 2)?;
    s.wait_snapshot(usize::from(a.engines), Duration::from_secs(20))?;
    Ok(s)
}

/// Per-second samples of a run: host saturation.
async fn sample_saturation(host_admin: u16, start: Instant, until: Instant) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    while Instant::now() < until {
        let snap = http_get_blocking(host_admin, "/v1/snapshot").unwrap_or_default();
        if let Some(s) = serde_json::from_str::<Value>(&snap).ok().and_then(|v| v["saturation"].as_f64()) {
            out.push((start.elapsed().as_secs_f64(), s));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    out
}

async fn run_interactive(url: String, plan: Arc<Vec<(Duration, Vec<u8>)>>, start: Instant) -> Vec<(f64, Outcome)> {
    let mut tasks = Vec::new();
    for i in 0..plan.len() {
        let (url, plan) = (url.clone(), plan.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until((start + plan[i].0).into()).await;
            let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap_or_default();
            let headers = [("x-llm-d-inference-objective", "interactive"), ("x-attache-tenant", "chat")];
            (plan[i].0.as_secs_f64(), client::post(&http, &url, plan[i].1.clone(), &headers).await)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap_or_default());
    }
    out
}

/// What one run measured.
struct RunResult {
    row: Value,
    ttft_p95: f64,
    interactive_tok_s: f64,
    batch_tok_s: f64,
    ttft_series: Vec<(f64, f64)>,
    batch_series: Vec<(f64, f64)>,
    saturation: Vec<(f64, f64)>,
}

/// Completion tokens of the jobs that finished inside the window, per second of it, and a
/// per-second series.
fn batch_tokens(results: &[JobResult], t0_unix: f64, window: f64) -> (u64, Vec<(f64, f64)>) {
    let mut per_s = vec![0u64; window.ceil() as usize + 1];
    let mut total = 0;
    for r in results.iter().filter(|r| r.status == Status::Completed) {
        let at = r.finished - t0_unix;
        if !(0.0..window).contains(&at) {
            continue;
        }
        let n = r.body["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        total += n;
        per_s[at as usize] += n;
    }
    (total, per_s.iter().enumerate().map(|(i, n)| (i as f64 + 0.5, *n as f64)).collect())
}

/// One run on a fresh stack: the interactive plan (if `chat`), and the worker (ceiling,
/// concurrency, the jobs' objective) over a fresh backlog.
async fn one_run(a: &Args, name: &str, chat: bool, worker: Option<(f64, usize, &str)>) -> anyhow::Result<RunResult> {
    let s = stack(&format!("async-{name}"), a)?;
    let redis = Redis::start(&s)?;
    let q = Queue::new(redis.addr(), "attache:async", Duration::from_secs(5));
    let worker = match worker {
        Some((ceiling, concurrency, objective)) => {
            q.submit(&jobs(a, objective)).await?;
            let (ceiling, concurrency) = (ceiling.to_string(), concurrency.to_string());
            let args = ["--ceiling", &ceiling, "--concurrency", &concurrency, "--gate-interval-ms", "100"];
            Some(AsyncWorker::start(&s, &redis, &args)?)
        }
        None => None,
    };
    let window = a.duration_s as f64;
    let start = Instant::now() + Duration::from_millis(300);
    let t0_unix = unix_now() + 0.3;
    let until = start + Duration::from_secs(a.duration_s);
    let sat = tokio::spawn(sample_saturation(s.host_admin_port, start, until));
    let plan = Arc::new(if chat { interactive_plan(a) } else { Vec::new() });
    let outcomes = run_interactive(s.url("/v1/chat/completions"), plan, start).await;
    tokio::time::sleep_until(until.into()).await;
    let saturation = sat.await.unwrap_or_default();
    let worker_metrics = worker.as_ref().map(AsyncWorker::metrics).unwrap_or_default();
    drop(worker);
    let results = q.results().await.unwrap_or_default();
    let (batch_total, batch_series) = batch_tokens(&results, t0_unix, window);
    let mut ttft: Vec<f64> = outcomes
        .iter()
        .filter_map(|(_, o)| o.ok().then_some(o.ttft).flatten())
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    let ttft_series = outcomes.iter().filter_map(|(at, o)| Some((*at, o.ttft?.as_secs_f64() * 1e3))).collect();
    ttft.sort_by(f64::total_cmp);
    let served = outcomes.iter().filter(|(_, o)| o.ok()).count();
    let interactive_tokens: u64 = outcomes.iter().map(|(_, o)| o.output_tokens).sum();
    let (p50, p95) = (percentile(&ttft, 50.0), percentile(&ttft, 95.0));
    let row = json!({
        "run": name,
        "interactive": {"requests": outcomes.len(), "served": served, "ttft_p50_ms": round2(p50), "ttft_p95_ms": round2(p95),
                        "output_tok_per_s": round2(interactive_tokens as f64 / window)},
        "batch": {"completed_in_window": results.iter().filter(|r| r.status == Status::Completed && (r.finished - t0_unix) < window).count(),
                  "output_tokens": batch_total, "output_tok_per_s": round2(batch_total as f64 / window),
                  "dead_lettered": results.iter().filter(|r| r.status == Status::DeadLettered).count()},
        "worker": if worker_metrics.is_empty() {
            Value::Null
        } else {
            json!({
                "dispatched": stat_line(&worker_metrics, "attache_async_dispatched_total"),
                "retried_shed": stat_line(&worker_metrics, "attache_async_retried_total{reason=\"shed\"}"),
                "gate_closed_saturated": stat_line(&worker_metrics, "attache_async_gate_closed_total{reason=\"saturated\"}"),
            })
        },
        "mean_saturation": round2(saturation.iter().map(|(_, s)| s).sum::<f64>() / saturation.len().max(1) as f64),
    });
    println!(
        "  {name:<20} interactive {served}/{} served, TTFT p50 {p50:>6.1} ms p95 {p95:>6.1} ms, {:>6.1} tok/s; batch {:>7.1} tok/s",
        outcomes.len(),
        interactive_tokens as f64 / window,
        batch_total as f64 / window
    );
    Ok(RunResult {
        row,
        ttft_p95: p95,
        interactive_tok_s: interactive_tokens as f64 / window,
        batch_tok_s: batch_total as f64 / window,
        ttft_series,
        batch_series,
        saturation,
    })
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    println!(
        "async: {} engines x {} sequences; {} interactive req/s for {} s; {} batch jobs of {} prompt and {} output tokens",
        a.engines, a.max_num_seqs, a.interactive_rps, a.duration_s, a.jobs, a.job_prompt_tokens, a.job_tokens
    );
    let alone = one_run(&a, "interactive", true, None).await?;
    let slots = usize::from(a.engines) * a.max_num_seqs;
    let capacity = one_run(&a, "capacity", false, Some((1e9, 2 * slots, "standard"))).await?;
    let both = one_run(&a, "interactive+async", true, Some((a.ceiling, a.concurrency, "batch"))).await?;
    let idle = (capacity.batch_tok_s - alone.interactive_tok_s).max(1e-9);
    let share = both.batch_tok_s / idle;
    let ttft_ratio = both.ttft_p95 / alone.ttft_p95;
    println!(
        "  interactive TTFT p95 {:.1} -> {:.1} ms ({ttft_ratio:.2}x, goal <= 1.2x); idle capacity {idle:.1} tok/s, batch used {:.1} ({:.0}%, goal >= 50%)",
        alone.ttft_p95,
        both.ttft_p95,
        both.batch_tok_s,
        share * 100.0
    );
    let svg = plot(&alone, &both, a.duration_s as f64);
    let svg_path = a.out.with_extension("svg");
    std::fs::write(&svg_path, svg)?;
    println!("wrote {}", svg_path.display());
    let doc = json!({
        "benchmark": "async",
        "command": "cargo xtask bench async",
        "config": {"engines": a.engines, "max_num_seqs": a.max_num_seqs, "duration_s": a.duration_s,
                   "interactive_rps": a.interactive_rps, "jobs": a.jobs, "job_tokens": a.job_tokens, "job_prompt_tokens": a.job_prompt_tokens,
                   "ceiling": a.ceiling, "concurrency": a.concurrency, "seed": a.seed},
        "runs": [alone.row, capacity.row, both.row],
        "capacity_tok_per_s": round2(capacity.batch_tok_s),
        "idle_capacity_tok_per_s": round2(idle),
        "batch_share_of_idle": round2(share),
        "interactive_ttft_p95_ratio": round2(ttft_ratio),
        "goals": {"ttft_p95_ratio_max": 1.2, "batch_share_of_idle_min": 0.5,
                  "met": ttft_ratio <= 1.2 && share >= 0.5},
        "series": {
            "interactive_ttft_ms_alone": alone.ttft_series, "interactive_ttft_ms_with_async": both.ttft_series,
            "batch_tok_per_s": both.batch_series, "saturation_with_async": both.saturation,
            "saturation_alone": alone.saturation,
        },
    });
    write_results(&a.out, doc)
}

/// Two panels over time: interactive TTFT (alone, with the worker), and the batch output rate
/// with the pool's saturation.
fn plot(alone: &RunResult, both: &RunResult, window: f64) -> String {
    use std::fmt::Write as _;
    let (w, h, left, top, panel) = (900.0, 520.0, 60.0, 30.0, 200.0);
    let x = |t: f64| left + (t / window).clamp(0.0, 1.0) * (w - left - 20.0);
    let ttft_max = alone.ttft_series.iter().chain(&both.ttft_series).map(|p| p.1).fold(1.0, f64::max);
    let tok_max = both.batch_series.iter().map(|p| p.1).fold(1.0, f64::max);
    let mut s = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n");
    let _ = writeln!(s, "<rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>");
    let _ =
        writeln!(s, "<text x=\"{left}\" y=\"18\">Interactive TTFT (ms): grey alone, blue with attache async</text>");
    let y1 = |v: f64| top + panel - v / ttft_max * panel;
    for (series, color) in [(&alone.ttft_series, "#999"), (&both.ttft_series, "#1f77b4")] {
        for (t, v) in series.iter() {
            let _ = writeln!(s, "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"2\" fill=\"{color}\"/>", x(*t), y1(*v));
        }
    }
    let _ = writeln!(
        s,
        "<text x=\"5\" y=\"{:.0}\">{ttft_max:.0}</text><text x=\"5\" y=\"{:.0}\">0</text>",
        top + 10.0,
        top + panel
    );
    let top2 = top + panel + 60.0;
    let _ = writeln!(s, "<text x=\"{left}\" y=\"{:.0}\">Batch output tok/s (orange, max {tok_max:.0}) and pool saturation (green, 0-1)</text>", top2 - 12.0);
    let y2 = |v: f64, max: f64| top2 + panel - (v / max).clamp(0.0, 1.0) * panel;
    let line = |pts: &[(f64, f64)], max: f64| {
        pts.iter().map(|(t, v)| format!("{:.1},{:.1}", x(*t), y2(*v, max))).collect::<Vec<_>>().join(" ")
    };
    let _ = writeln!(
        s,
        "<polyline fill=\"none\" stroke=\"#ff7f0e\" stroke-width=\"2\" points=\"{}\"/>",
        line(&both.batch_series, tok_max)
    );
    let _ = writeln!(
        s,
        "<polyline fill=\"none\" stroke=\"#2ca02c\" stroke-width=\"1.5\" points=\"{}\"/>",
        line(&both.saturation, 1.0)
    );
    for top in [top, top2] {
        let _ = writeln!(
            s,
            "<line x1=\"{left}\" y1=\"{:.0}\" x2=\"{:.0}\" y2=\"{:.0}\" stroke=\"black\"/>",
            top + panel,
            w - 20.0,
            top + panel
        );
    }
    let _ = writeln!(s, "<text x=\"{:.0}\" y=\"{:.0}\">time (s)</text>", w / 2.0, h - 8.0);
    s.push_str("</svg>\n");
    s
}
