//! Sustained load: `concurrency` closed-loop clients, each sending one streaming chat request
//! after another through Envoy with Attaché to the simulated pool for `seconds`, on loopback.
//! Every request is counted (served, or an error with its status); Envoy's and the host's
//! resident memory is read once every client has its first stream open (start) and when the
//! window closes (end), and sampled in between; the host's and Envoy's CPU is reported.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use attache_e2e::client;
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use serde_json::json;

use crate::procstat::{cpu_ns, rss_mb};
use crate::run::{percentile, write_results};

#[derive(clap::Parser, Debug, Clone)]
pub struct Args {
    #[arg(long, default_value = "bench/results/load.json")]
    pub out: PathBuf,
    /// Concurrent streaming clients.
    #[arg(long, default_value_t = 2000)]
    pub concurrency: usize,
    /// Length of the measured load window, seconds.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Load before the window, seconds: connections open and the bounded tables (the
    /// affinity table in shared data, the prefix index) fill. Requests in it count too.
    #[arg(long, default_value_t = 30)]
    pub warmup_seconds: u64,
    #[arg(long, default_value_t = 8)]
    pub engines: u16,
    /// Sequences each simulated engine runs at once (engines x this >= concurrency keeps every
    /// stream running rather than queued in the engine).
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Output tokens per request (one streamed chunk each).
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u64,
    /// Simulated step times are multiplied by this.
    #[arg(long, default_value_t = 0.2)]
    pub time_scale: f64,
    #[arg(long, default_value_t = 2)]
    pub envoy_concurrency: u32,
    /// `attache-precise` (KV events on), `attache-approx`, or `round-robin` (plain Envoy, to
    /// tell Envoy's own memory from the filter's).
    #[arg(long, default_value = "attache-precise")]
    pub system: String,
    /// Skip the plain-Envoy run that comes first.
    #[arg(long)]
    pub no_baseline: bool,
}

#[derive(Default)]
struct Tally {
    sent: AtomicUsize,
    served: AtomicUsize,
}

/// One sample of the processes under test.
fn sample(stack: &Stack) -> (f64, f64) {
    let envoy = stack.envoy.as_ref().map_or(0.0, |p| rss_mb(p.pid()));
    let host = stack.host.as_ref().map_or(0.0, |p| rss_mb(p.pid()));
    (envoy, host)
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

/// Run the load against `system` and return its results document.
async fn run_one(a: &Args, system: &str) -> anyhow::Result<serde_json::Value> {
    let sim = SimOpts {
        engines: a.engines,
        model: "tinyllama".into(),
        num_gpu_blocks: 16_384,
        max_num_seqs: a.max_num_seqs,
        max_num_batched_tokens: 8192,
        time_scale: a.time_scale,
        kv_events: system == "attache-precise",
        ..SimOpts::default()
    };
    let (kind, config) = match system {
        "attache-precise" => {
            (EnvoyKind::Attache, json!({"role": "scheduler", "scheduler": {"precise": {"enabled": true}}}))
        }
        "attache-approx" => (EnvoyKind::Attache, Stack::default_scheduler_config()),
        "round-robin" => (EnvoyKind::RoundRobin, json!({})),
        other => anyhow::bail!("unknown system {other}: attache-precise, attache-approx or round-robin"),
    };
    let mut stack = Stack::new(&format!("load-{system}"))?;
    stack.start_sim(sim)?;
    if kind != EnvoyKind::RoundRobin {
        stack.start_host()?;
    }
    stack.start_envoy(kind, &config, a.envoy_concurrency)?;
    if kind != EnvoyKind::RoundRobin {
        stack.wait_snapshot(usize::from(a.engines), Duration::from_secs(30))?;
    }
    let envoy_pid = stack.envoy.as_ref().map(|p| p.pid()).unwrap_or(0);
    let host_pid = stack.host.as_ref().map(|p| p.pid()).unwrap_or(0);
    let idle = sample(&stack);
    println!(
        "load: {} streaming clients for {} s through Envoy ({} workers, {}) to {} simulated engines x {} seqs, {} tokens each",
        a.concurrency, a.seconds, a.envoy_concurrency, system, a.engines, a.max_num_seqs, a.max_tokens
    );
    println!("  idle: envoy {:.1} MiB, host {:.1} MiB", idle.0, idle.1);

    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(a.concurrency + 16)
        .timeout(Duration::from_secs(120))
        .build()?;
    let url = stack.url("/v1/chat/completions");
    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    let window_start = started + Duration::from_secs(a.warmup_seconds);
    let deadline = window_start + Duration::from_secs(a.seconds);
    let mut handles = Vec::with_capacity(a.concurrency);
    for c in 0..a.concurrency {
        let (http, url, tally, max_tokens) = (http.clone(), url.clone(), tally.clone(), a.max_tokens);
        handles.push(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            let mut n = 0usize;
            // Bounded loop: a client starts no request after the deadline.
            while Instant::now() < deadline {
                // A few prompt families so prefix scoring has something to do.
                let system =
                    format!("You are support agent {} for a storage product. Answer in short sentences.", c % 16);
                let body = client::chat_body(
                    "tinyllama",
                    &system,
                    &format!("client {c} question {n}: what is new?"),
                    max_tokens,
                );
                tally.sent.fetch_add(1, Ordering::Relaxed);
                let mut o = client::post(&http, &url, body, &[]).await;
                if o.ok() && o.done {
                    tally.served.fetch_add(1, Ordering::Relaxed);
                }
                o.events.clear();
                o.body.truncate(200);
                o.headers.clear();
                outcomes.push(o);
                n += 1;
            }
            outcomes
        }));
    }
    // Start: the end of the warm-up. Memory read before it measures connection set-up and
    // bounded tables filling; those samples are kept in the results.
    let mut ramp = Vec::new();
    while Instant::now() + Duration::from_secs(2) < window_start {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let s = sample(&stack);
        ramp.push(
            json!({"t_s": round1(started.elapsed().as_secs_f64()), "envoy_mb": round1(s.0), "host_mb": round1(s.1)}),
        );
    }
    tokio::time::sleep(window_start.saturating_duration_since(Instant::now())).await;
    let ramp_s = started.elapsed().as_secs_f64();
    let start = sample(&stack);
    let (host_cpu0, envoy_cpu0, t_cpu0) = (cpu_ns(host_pid), cpu_ns(envoy_pid), Instant::now());
    println!(
        "  window starts after {ramp_s:.1} s of warm-up ({} requests served): envoy {:.1} MiB, host {:.1} MiB",
        tally.served.load(Ordering::Relaxed),
        start.0,
        start.1
    );
    let mut samples = vec![
        json!({"t_s": round1(started.elapsed().as_secs_f64()), "envoy_mb": round1(start.0), "host_mb": round1(start.1)}),
    ];
    while Instant::now() + Duration::from_secs(10) < deadline {
        tokio::time::sleep(Duration::from_secs(10)).await;
        let s = sample(&stack);
        println!(
            "  t={:>3.0}s sent {} served {}: envoy {:.1} MiB, host {:.1} MiB",
            started.elapsed().as_secs_f64(),
            tally.sent.load(Ordering::Relaxed),
            tally.served.load(Ordering::Relaxed),
            s.0,
            s.1
        );
        samples.push(
            json!({"t_s": round1(started.elapsed().as_secs_f64()), "envoy_mb": round1(s.0), "host_mb": round1(s.1)}),
        );
    }
    tokio::time::sleep(deadline.saturating_duration_since(Instant::now())).await;
    let end = sample(&stack);
    let cpu_window = t_cpu0.elapsed().as_secs_f64();
    let host_cpu = (cpu_ns(host_pid).saturating_sub(host_cpu0)) as f64 / 1e9 / cpu_window;
    let envoy_cpu = (cpu_ns(envoy_pid).saturating_sub(envoy_cpu0)) as f64 / 1e9 / cpu_window;
    samples.push(
        json!({"t_s": round1(started.elapsed().as_secs_f64()), "envoy_mb": round1(end.0), "host_mb": round1(end.1)}),
    );

    let mut outcomes = Vec::new();
    for h in handles {
        outcomes.extend(h.await.unwrap_or_default());
    }
    let drained_s = started.elapsed().as_secs_f64();
    let requests = outcomes.len();
    let failed: Vec<&client::Outcome> = outcomes.iter().filter(|o| !(o.ok() && o.done)).collect();
    let mut by_status = std::collections::BTreeMap::<String, usize>::new();
    for o in &failed {
        let key = match &o.error {
            Some(e) => format!("transport: {}", e.chars().take(80).collect::<String>()),
            None if o.status == 200 => "stream ended without [DONE]".into(),
            None => format!("{} {}", o.status, o.body.chars().take(80).collect::<String>()),
        };
        *by_status.entry(key).or_default() += 1;
    }
    let mut lat: Vec<f64> =
        outcomes.iter().filter(|o| o.ok() && o.done).map(|o| o.total.as_secs_f64() * 1000.0).collect();
    lat.sort_by(f64::total_cmp);
    let mut ttft: Vec<f64> =
        outcomes.iter().filter(|o| o.ok() && o.done).filter_map(|o| o.ttft).map(|d| d.as_secs_f64() * 1000.0).collect();
    ttft.sort_by(f64::total_cmp);
    let tokens: u64 = outcomes.iter().filter(|o| o.ok() && o.done).map(|o| o.output_tokens).sum();
    let load_only = stack.envoy_stat("wasmcustom.attache.host.load_only_decisions");
    let host_alive = stack.host.as_mut().is_some_and(|p| p.is_running());
    let envoy_alive = stack.envoy.as_mut().is_some_and(|p| p.is_running());

    println!("\nsustained load ({} clients, {} s)", a.concurrency, a.seconds);
    println!(
        "  requests {requests}, errors {}, {:.0} req/s, {:.0} output tok/s",
        failed.len(),
        requests as f64 / drained_s,
        tokens as f64 / drained_s
    );
    println!(
        "  latency p50 {:.1} ms p99 {:.1} ms; TTFT p50 {:.1} ms p99 {:.1} ms",
        percentile(&lat, 50.0),
        percentile(&lat, 99.0),
        percentile(&ttft, 50.0),
        percentile(&ttft, 99.0)
    );
    println!("  memory (Envoy + host): start {:.1} MiB, end {:.1} MiB", start.0 + start.1, end.0 + end.1);
    println!("  CPU: host {host_cpu:.3} cores, Envoy {envoy_cpu:.3} cores");
    for (k, v) in &by_status {
        println!("  error: {v} x {k}");
    }
    let doc = json!({
        "scenario": "sustained-load",
        "command": "cargo xtask bench load",
        "config": {
            "concurrency": a.concurrency, "seconds": a.seconds, "warmup_seconds": a.warmup_seconds, "engines": a.engines, "max_num_seqs": a.max_num_seqs,
            "max_tokens": a.max_tokens, "time_scale": a.time_scale, "envoy_concurrency": a.envoy_concurrency,
            "system": system, "api": "chat completions, streaming",
        },
        "requests": requests,
        "errors": failed.len(),
        "errors_by_kind": by_status,
        "p50_ms": round1(percentile(&lat, 50.0)),
        "p99_ms": round1(percentile(&lat, 99.0)),
        "ttft_p50_ms": round1(percentile(&ttft, 50.0)),
        "ttft_p99_ms": round1(percentile(&ttft, 99.0)),
        "requests_per_s": round1(requests as f64 / drained_s),
        "output_tok_per_s": round1(tokens as f64 / drained_s),
        "memory_idle_mb": round1(idle.0 + idle.1),
        "memory_start_mb": round1(start.0 + start.1),
        "memory_end_mb": round1(end.0 + end.1),
        "memory_samples": samples,
        "memory_ramp_samples": ramp,
        "memory": "VmRSS of Envoy plus the host; start = end of the warm-up, end = when the measured window closes; idle = before any request; memory_ramp_samples = during the warm-up",
        "warmup_s": a.warmup_seconds,
        "host_cpu_cores": (host_cpu * 1000.0).round() / 1000.0,
        "envoy_cpu_cores": (envoy_cpu * 1000.0).round() / 1000.0,
        "load_only_decisions": load_only,
        "host_alive_at_end": host_alive,
        "envoy_alive_at_end": envoy_alive,
        "latency": "p50_ms/p99_ms: request to the stream's [DONE], client side; the client, Envoy, host and simulator share the machine's cores",
    });
    anyhow::ensure!(envoy_alive && (host_alive || kind == EnvoyKind::RoundRobin), "a process under test died");
    Ok(doc)
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    // Plain Envoy first, the same load and length: what Envoy's own memory does under it.
    let baseline =
        if a.no_baseline || a.system == "round-robin" { None } else { Some(run_one(&a, "round-robin").await?) };
    let mut doc = run_one(&a, &a.system).await?;
    let growth = |d: &serde_json::Value| {
        d["memory_end_mb"].as_f64().unwrap_or(0.0) - d["memory_start_mb"].as_f64().unwrap_or(0.0)
    };
    println!("\nmemory growth over the window: {} {:+.1} MiB", a.system, growth(&doc));
    if let Some(b) = baseline {
        println!("memory growth over the window: plain Envoy {:+.1} MiB", growth(&b));
        doc["baseline_round_robin"] = json!({
            "requests": b["requests"], "errors": b["errors"], "p50_ms": b["p50_ms"], "p99_ms": b["p99_ms"],
            "memory_start_mb": b["memory_start_mb"], "memory_end_mb": b["memory_end_mb"],
            "envoy_cpu_cores": b["envoy_cpu_cores"], "requests_per_s": b["requests_per_s"],
        });
    }
    let (requests, errors) = (doc["requests"].as_u64().unwrap_or(0), doc["errors"].as_u64().unwrap_or(0));
    write_results(&a.out, doc)?;
    anyhow::ensure!(errors == 0, "{errors} of {requests} requests failed");
    Ok(())
}
