//! Drive a workload through a gateway and summarise what happened.

use std::sync::Arc;
use std::time::{Duration, Instant};

use attache_e2e::client::{self, Outcome};
use serde::Serialize;
use tokio::sync::Semaphore;

use crate::workload::Item;

/// One system's row in a results table.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub system: String,
    pub requests: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p95_ms: f64,
    pub output_tok_per_s: f64,
    pub prefix_hit_rate: f64,
    pub errors: usize,
    pub wall_s: f64,
}

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Send every item with at most `concurrency` in flight; returns outcomes in item order.
pub async fn drive(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    items: &[Item],
    concurrency: usize,
) -> (Vec<Outcome>, Duration) {
    let sem = Arc::new(Semaphore::new(concurrency.max(1)));
    let start = Instant::now();
    let mut handles = Vec::with_capacity(items.len());
    for it in items {
        let permit = sem.clone().acquire_owned().await;
        let http = http.clone();
        let url = url.to_string();
        let body = client::chat_body(model, &it.system, &it.user, it.max_tokens);
        handles.push(tokio::spawn(async move {
            let _p = permit;
            client::post(&http, &url, body, &[]).await
        }));
    }
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.unwrap_or_default());
    }
    (out, start.elapsed())
}

/// Summarise outcomes; `hits`/`queries` are the engines' prefix-cache counter deltas.
pub fn summarise(system: &str, outcomes: &[Outcome], wall: Duration, queries: f64, hits: f64) -> RunSummary {
    let mut ttft: Vec<f64> =
        outcomes.iter().filter(|o| o.ok()).filter_map(|o| o.ttft).map(|d| d.as_secs_f64() * 1000.0).collect();
    ttft.sort_by(f64::total_cmp);
    let tokens: u64 = outcomes.iter().filter(|o| o.ok()).map(|o| o.output_tokens).sum();
    let errors = outcomes.iter().filter(|o| !o.ok() || !o.done).count();
    RunSummary {
        system: system.into(),
        requests: outcomes.len(),
        ttft_p50_ms: round2(percentile(&ttft, 50.0)),
        ttft_p95_ms: round2(percentile(&ttft, 95.0)),
        output_tok_per_s: round2(tokens as f64 / wall.as_secs_f64().max(1e-9)),
        prefix_hit_rate: if queries > 0.0 { round4(hits / queries) } else { 0.0 },
        errors,
        wall_s: round2(wall.as_secs_f64()),
    }
}

pub fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}
fn round4(v: f64) -> f64 {
    (v * 10_000.0).round() / 10_000.0
}

/// Stamp a results document with the date and machine, write it as pretty JSON, and say where.
pub fn write_results(out: &std::path::Path, mut doc: serde_json::Value) -> anyhow::Result<()> {
    use anyhow::Context;
    doc["date"] = serde_json::json!(std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%dT%H:%M:%SZ")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()));
    doc["machine"] =
        serde_json::json!(format!("{} cores", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)));
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(out, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("writing {}", out.display()))?;
    println!("\nwrote {}", out.display());
    Ok(())
}

/// Print a results table.
pub fn print_table(title: &str, rows: &[RunSummary]) {
    println!("\n{title}");
    println!(
        "{:<14} {:>8} {:>12} {:>12} {:>17} {:>16} {:>7}",
        "system", "requests", "ttft_p50_ms", "ttft_p95_ms", "output_tok_per_s", "prefix_hit_rate", "errors"
    );
    for r in rows {
        println!(
            "{:<14} {:>8} {:>12.2} {:>12.2} {:>17.2} {:>16.4} {:>7}",
            r.system, r.requests, r.ttft_p50_ms, r.ttft_p95_ms, r.output_tok_per_s, r.prefix_hit_rate, r.errors
        );
    }
}

/// One request of an open-loop run, as sent.
pub struct Sent {
    /// 0 = warm-up, then the ladder's stages.
    pub stage: usize,
    /// Real time of sending, from the run's start.
    pub at: Duration,
    pub outcome: Outcome,
}

/// One stage's figures for one system (simulated time).
#[derive(Debug, Clone, Serialize)]
pub struct StageSummary {
    pub qps: f64,
    pub requests: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub output_tok_per_s: f64,
    pub errors: usize,
    /// Every request of the stage completed (no error, no timeout): the system sustained the
    /// stage's offered load.
    pub sustained: bool,
    /// TTFT p90 within the run's SLO.
    pub within_slo: bool,
}

fn completed(s: &Sent) -> bool {
    s.outcome.ok() && s.outcome.done
}

/// The summary row over the measured stages (stage > 0) and one row per stage, converting
/// real time to simulated time (`scale`). `rates[i]` is stage i's offered rate.
pub fn summarise_stages(
    system: &str,
    scale: f64,
    rates: &[f64],
    sent: &[Sent],
    hit_rate: f64,
    slo_ttft_p90_ms: f64,
) -> (RunSummary, Vec<StageSummary>) {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0 / scale;
    let ttfts = |v: &[&Sent]| {
        let mut t: Vec<f64> = v.iter().filter(|s| completed(s)).filter_map(|s| s.outcome.ttft).map(ms).collect();
        t.sort_by(f64::total_cmp);
        t
    };
    let tokens = |v: &[&Sent]| v.iter().filter(|s| completed(s)).map(|s| s.outcome.output_tokens).sum::<u64>() as f64;
    // Throughput: tokens over the span from the first send to the last completion.
    let span = |v: &[&Sent]| {
        let first = v.iter().map(|s| s.at).min().unwrap_or_default();
        let last = v.iter().map(|s| s.at + s.outcome.total).max().unwrap_or_default();
        last.saturating_sub(first).as_secs_f64() / scale
    };
    let measured: Vec<&Sent> = sent.iter().filter(|s| s.stage > 0).collect();
    let all = ttfts(&measured);
    let row = RunSummary {
        system: system.into(),
        requests: measured.len(),
        ttft_p50_ms: round2(percentile(&all, 50.0)),
        ttft_p95_ms: round2(percentile(&all, 95.0)),
        output_tok_per_s: round2(tokens(&measured) / span(&measured).max(1e-9)),
        prefix_hit_rate: round4(hit_rate),
        errors: measured.iter().filter(|s| !completed(s)).count(),
        wall_s: round2(span(&measured) * scale),
    };
    let stages = rates
        .iter()
        .enumerate()
        .skip(1)
        .map(|(i, &qps)| {
            let v: Vec<&Sent> = sent.iter().filter(|s| s.stage == i).collect();
            let t = ttfts(&v);
            let errors = v.iter().filter(|s| !completed(s)).count();
            let p90 = percentile(&t, 90.0);
            StageSummary {
                qps,
                requests: v.len(),
                ttft_p50_ms: round2(percentile(&t, 50.0)),
                ttft_p90_ms: round2(p90),
                output_tok_per_s: round2(tokens(&v) / span(&v).max(1e-9)),
                errors,
                sustained: errors == 0 && !v.is_empty(),
                within_slo: errors == 0 && p90.is_finite() && p90 <= slo_ttft_p90_ms,
            }
        })
        .collect();
    (row, stages)
}
