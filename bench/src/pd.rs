//! Prefill/decode disaggregation on a long-prompt workload, side by side in one run: the same
//! 4 simulated engines as 4 mixed engines (`aggregated`) and as 2 prefill + 2 decode
//! (`disaggregated`), both behind Envoy with Attaché, the same request sequence, cold engines.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use attache_e2e::client::{self, Outcome};
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use attache_policies::rng::SplitMix64;
use serde_json::json;

use crate::run::{percentile, write_results};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    #[arg(long, default_value = "bench/results/pd.json")]
    out: PathBuf,
    /// Requests per run.
    #[arg(long, default_value_t = 160)]
    requests: usize,
    /// Arrival rates (Poisson), one set of runs each.
    #[arg(long, value_delimiter = ',', default_values_t = [2.0, 4.0])]
    rps: Vec<f64>,
    /// Prompt length in tokens (unique prompts: nothing is cached).
    #[arg(long, default_value_t = 6000)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    max_tokens: u64,
    #[arg(long, default_value_t = 11)]
    seed: u64,
}

struct Item {
    at: Duration,
    body: Vec<u8>,
}

fn plan(a: &Args, rps: f64) -> Vec<Item> {
    let mut rng = SplitMix64::new(a.seed);
    const W: [&str; 8] = ["log", "trace", "span", "error", "retry", "cache", "shard", "lease"];
    let mut t = 0.0;
    (0..a.requests)
        .map(|i| {
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            t += -(1.0 - u).ln() / rps;
            let mut doc = format!("Document {i}. ");
            while doc.len() < a.prompt_tokens * 4 {
                doc.push_str(W[(rng.next_u64() % W.len() as u64) as usize]);
                doc.push(' ');
            }
            let body = client::chat_body("tinyllama", &doc, "Summarise the incident above.", a.max_tokens);
            Item { at: Duration::from_secs_f64(t), body }
        })
        .collect()
}

fn r2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let mut runs = Vec::new();
    for &rps in &a.rps {
        runs.extend(run_rate(&a, rps).await?);
    }
    let doc = json!({
        "scenario": "long-prompt-pd",
        "command": "cargo xtask bench pd",
        "config": {"engines": 4, "requests": a.requests, "rps": a.rps, "prompt_tokens": a.prompt_tokens,
                    "max_tokens": a.max_tokens, "num_gpu_blocks": 8192, "kv_transfer_cost": 0.1,
                    "pd_threshold_tokens": 16, "seed": a.seed},
        "runs": runs,
    });
    write_results(&a.out, doc)
}

/// The three layouts at one arrival rate, on the same request sequence.
async fn run_rate(a: &Args, rps: f64) -> anyhow::Result<Vec<serde_json::Value>> {
    let items = Arc::new(plan(a, rps));
    println!(
        "P/D: {} requests at {rps}/s, {}-token unique prompts, {} output tokens, 4 engines",
        a.requests, a.prompt_tokens, a.max_tokens
    );
    let mut runs = Vec::new();
    // The must-show comparison is 4 mixed against 2P+2D; 1P+3D shows what the P:D ratio does
    // when prefill is the lighter side of the load.
    for (system, roles) in [
        ("aggregated", ["both"; 4]),
        ("disaggregated", ["prefill", "prefill", "decode", "decode"]),
        ("disaggregated-1p3d", ["prefill", "decode", "decode", "decode"]),
    ] {
        let mut s = Stack::new(&format!("pd-{system}"))?;
        s.endpoint_roles = roles.iter().map(|r| r.to_string()).collect();
        s.start_sim(SimOpts { engines: 4, num_gpu_blocks: 8192, time_scale: 1.0, ..SimOpts::default() })?;
        s.start_host()?;
        s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2)?;
        s.wait_snapshot(4, Duration::from_secs(20))?;
        let url = s.url("/v1/chat/completions");
        let start = Instant::now() + Duration::from_millis(200);
        let mut tasks = Vec::new();
        for i in 0..items.len() {
            let (url, items) = (url.clone(), items.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until((start + items[i].at).into()).await;
                let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap_or_default();
                client::post(&http, &url, items[i].body.clone(), &[]).await
            }));
        }
        let mut outcomes: Vec<Outcome> = Vec::new();
        for t in tasks {
            outcomes.push(t.await.unwrap_or_default());
        }
        let wall = start.elapsed().as_secs_f64();
        let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok() && o.done).collect();
        let mut ttft: Vec<f64> = ok.iter().filter_map(|o| o.ttft).map(|d| d.as_secs_f64() * 1000.0).collect();
        ttft.sort_by(f64::total_cmp);
        // Inter-token latency per request: decode time over the tokens after the first.
        let mut itl: Vec<f64> = ok
            .iter()
            .filter(|o| o.output_tokens > 1)
            .filter_map(|o| o.ttft.map(|t| (o.total - t).as_secs_f64() * 1000.0 / (o.output_tokens - 1) as f64))
            .collect();
        itl.sort_by(f64::total_cmp);
        let tokens: u64 = ok.iter().map(|o| o.output_tokens).sum();
        let split = s.envoy_stat("wasmcustom.attache.pd.disaggregated");
        let row = json!({
            "system": system, "rps": rps, "roles": roles, "requests": outcomes.len(), "errors": outcomes.len() - ok.len(),
            "ttft_p50_ms": r2(percentile(&ttft, 50.0)), "ttft_p95_ms": r2(percentile(&ttft, 95.0)),
            "itl_p50_ms": r2(percentile(&itl, 50.0)), "itl_p95_ms": r2(percentile(&itl, 95.0)),
            "itl_p99_ms": r2(percentile(&itl, 99.0)),
            "output_tok_per_s": r2(tokens as f64 / wall), "wall_s": r2(wall), "disaggregated_requests": split,
            "sim_lost_ms": r2(s.sim_lost_ms().await.unwrap_or(0.0)),
        });
        println!(
            "  {system:<19} TTFT p50 {:>8.1} p95 {:>8.1} ms; ITL p50 {:>6.2} p95 {:>6.2} ms; {:>7.1} tok/s; {} split; {} errors",
            percentile(&ttft, 50.0),
            percentile(&ttft, 95.0),
            percentile(&itl, 50.0),
            percentile(&itl, 95.0),
            tokens as f64 / wall,
            split,
            outcomes.len() - ok.len()
        );
        runs.push(row);
    }
    Ok(runs)
}
