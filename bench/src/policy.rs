//! Policy-module figures, measured side by side in one run on the real Envoy:
//! - per-request cost of custom scorer filters: the same requests through Envoy with no
//!   scorer slot, with one empty slot (the passthrough defaults plus the picker), and with one
//!   active scorer (the SLO/TTFT example) — client latency and Envoy CPU per request,
//!   alternating configurations round by round;
//! - upload time (signature check + wasmtime admission) and the time from `promote` to the
//!   first response served by the promoted version, under a steady request loop.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use attache_e2e::client;
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use serde_json::{json, Value};

use crate::run::{percentile, write_results};

const TOKEN: &str = "bench-admin-token-0123456789";
const MODEL: &str = "tinyllama";

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    #[arg(long, default_value = "bench/results/policy.json")]
    out: PathBuf,
    /// Sequential requests per configuration per round.
    #[arg(long, default_value_t = 600)]
    requests: usize,
    /// Rounds; configurations alternate within each round.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Promotions to time.
    #[arg(long, default_value_t = 10)]
    promotions: usize,
}

/// Envoy's CPU time so far, in seconds: the sum of its threads' scheduler run time
/// (`/proc/<pid>/task/*/schedstat`, nanoseconds).
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let mut ns = 0u64;
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let stat = std::fs::read_to_string(t?.path().join("schedstat")).unwrap_or_default();
        ns += stat.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    }
    Ok(ns as f64 / 1e9)
}

struct Admin {
    http: reqwest::Client,
    base: String,
}

impl Admin {
    async fn call(&self, req: reqwest::RequestBuilder) -> anyhow::Result<Value> {
        let r = req.bearer_auth(TOKEN).send().await?;
        let status = r.status();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            bail!("{status}: {v}");
        }
        Ok(v)
    }
    async fn upload(&self, slot: &str, version: &str, bytes: Vec<u8>, params: &Value) -> anyhow::Result<String> {
        let url = format!("{}/v1/policy/modules", self.base);
        let q = [("slot", slot), ("version", version), ("params", &params.to_string())];
        let v = self.call(self.http.post(url).query(&q).body(bytes)).await?;
        Ok(v["sha256"].as_str().context("sha256")?.to_owned())
    }
    async fn rollout(&self, slot: &str, module: &str, percent: f64) -> anyhow::Result<()> {
        let url = format!("{}/v1/policy/slots/{slot}/rollout", self.base);
        self.call(self.http.post(url).json(&json!({"module": module, "canary_percent": percent}))).await.map(|_| ())
    }
    async fn promote(&self, slot: &str) -> anyhow::Result<()> {
        let url = format!("{}/v1/policy/slots/{slot}/promote", self.base);
        self.call(self.http.post(url)).await.map(|_| ())
    }
}

fn sign(s: &Stack, keys: &std::path::Path, module: &str) -> anyhow::Result<Vec<u8>> {
    let out = s.workdir.join(format!("{module}.signed.wasm"));
    let st = std::process::Command::new(&s.paths.host_bin)
        .args(["policy", "sign", "--key"])
        .arg(keys.join("attache.key"))
        .arg("--in")
        .arg(s.paths.module(module))
        .arg("--out")
        .arg(&out)
        .output()?;
    if !st.status.success() {
        bail!("sign: {}", String::from_utf8_lossy(&st.stderr));
    }
    Ok(std::fs::read(out)?)
}

/// Sequential requests; returns per-request latency (ms) and Envoy CPU µs per request.
async fn measure(s: &Stack, n: usize, expect_header: Option<&str>) -> anyhow::Result<(Vec<f64>, f64)> {
    let http = reqwest::Client::new();
    let url = s.url("/v1/chat/completions");
    let pid = s.envoy.as_ref().context("envoy")?.pid();
    // Warm-up, and wait for the expected scorer to act.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let o = client::post(&http, &url, client::chat_body(MODEL, "warm-up", "hi", 1), &[]).await;
        if o.ok() && o.header("x-attache-scorers") == expect_header {
            break;
        }
        if Instant::now() > deadline {
            bail!("configuration never became active (x-attache-scorers {:?})", o.header("x-attache-scorers"));
        }
    }
    // Envoy also works while idle (snapshot stream, stats); measure that rate and subtract it.
    let (idle0, t_idle) = (cpu_seconds(pid)?, Instant::now());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle_rate = (cpu_seconds(pid)? - idle0) / t_idle.elapsed().as_secs_f64();
    let (cpu0, t0) = (cpu_seconds(pid)?, Instant::now());
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let body = client::chat_body(MODEL, &format!("system prompt {}", i % 50), "hello", 1);
        let t = Instant::now();
        let o = client::post(&http, &url, body, &[("x-session-id", &format!("s{i}"))]).await;
        if !o.ok() {
            bail!("request failed: {} {}", o.status, o.body);
        }
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let busy = cpu_seconds(pid)? - cpu0 - idle_rate * t0.elapsed().as_secs_f64();
    let cpu = busy.max(0.0) / n as f64 * 1e6;
    Ok((lat, cpu))
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let mut s = Stack::new("bench-policy")?;
    let keys = s.workdir.join("keys");
    let token_file = s.workdir.join("admin.token");
    std::fs::write(&token_file, TOKEN)?;
    let st = std::process::Command::new(&s.paths.host_bin).args(["policy", "keygen", "--out"]).arg(&keys).output()?;
    if !st.status.success() {
        bail!("keygen: {}", String::from_utf8_lossy(&st.stderr));
    }
    s.host_policy = Some(json!({
        "store_dir": s.workdir.join("policies"),
        "trust": keys.join("attache.pub"),
        "admin_token_file": token_file,
        "envoy_admin": [format!("http://127.0.0.1:{}", s.envoy_admin_port)],
        "auto": {"enabled": false},
    }));
    // Fast engines: the figures are about the gateway.
    let opts = SimOpts { engines: 4, time_scale: 0.01, ..SimOpts::default() };
    let engines = usize::from(opts.engines);
    s.start_sim(opts)?;
    s.start_host()?;
    let admin = Admin { http: reqwest::Client::new(), base: format!("http://127.0.0.1:{}", s.host_admin_port) };

    let slo = sign(&s, &keys, "attache_scorer_slo_ttft")?;
    let cost = sign(&s, &keys, "attache_scorer_cost_aware")?;
    let t = Instant::now();
    let v1 = admin.upload("slo", "v1", slo.clone(), &json!({})).await?;
    let upload_ms = t.elapsed().as_secs_f64() * 1000.0;
    let v2 = admin.upload("slo", "v2", cost.clone(), &json!({"costs": {"l4": 1.0}})).await?;
    admin.rollout("slo", &v1, 100.0).await?;
    admin.promote("slo").await?;
    println!("upload (verify + admission): {upload_ms:.0} ms for a {} KB module", slo.len() / 1024);

    // Per-request cost: alternate the three chains round by round.
    let active = format!("slo=stable@{}", &v1[..12]);
    let configs: [(&str, Vec<String>, Option<&str>); 3] = [
        ("scheduler only", vec![], None),
        ("one empty scorer slot", vec!["empty".into()], None),
        ("one active scorer", vec!["slo".into()], Some(active.as_str())),
    ];
    let mut lat: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    for round in 0..args.rounds {
        for (k, (name, slots, header)) in configs.iter().enumerate() {
            s.scorer_slots = slots.clone();
            s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2)?;
            s.wait_snapshot(engines, Duration::from_secs(20))?;
            let (l, c) = measure(&s, args.requests, *header).await?;
            let mut sorted = l.clone();
            sorted.sort_by(f64::total_cmp);
            println!(
                "round {round} {name:<22} p50 {:.3} ms  p90 {:.3} ms  Envoy CPU {c:.0} us/request",
                percentile(&sorted, 50.0),
                percentile(&sorted, 90.0)
            );
            lat[k].extend(l);
            cpu[k].push(c);
        }
    }
    let mut rows = Vec::new();
    for (k, (name, _, _)) in configs.iter().enumerate() {
        lat[k].sort_by(f64::total_cmp);
        cpu[k].sort_by(f64::total_cmp);
        rows.push(json!({
            "chain": name,
            "requests": lat[k].len(),
            "latency_p50_ms": percentile(&lat[k], 50.0),
            "latency_p90_ms": percentile(&lat[k], 90.0),
            "envoy_cpu_us_per_request_median": percentile(&cpu[k], 50.0),
        }));
    }
    let base_p50 = rows[0]["latency_p50_ms"].as_f64().unwrap_or(0.0);
    let base_cpu = rows[0]["envoy_cpu_us_per_request_median"].as_f64().unwrap_or(0.0);
    for r in rows.iter_mut() {
        let p50 = r["latency_p50_ms"].as_f64().unwrap_or(0.0);
        let c = r["envoy_cpu_us_per_request_median"].as_f64().unwrap_or(0.0);
        r["added_latency_p50_us"] = json!(((p50 - base_p50) * 1000.0).round());
        r["added_envoy_cpu_us_per_request"] = json!((c - base_cpu).round());
    }
    println!("\nper-request cost of scorer filters ({} rounds x {} requests each):", args.rounds, args.requests);
    for r in &rows {
        println!(
            "  {:<22} latency p50 {:.3} ms ({:+} us)  Envoy CPU {:.0} us/request ({:+} us)",
            r["chain"].as_str().unwrap_or(""),
            r["latency_p50_ms"].as_f64().unwrap_or(0.0),
            r["added_latency_p50_us"],
            r["envoy_cpu_us_per_request_median"].as_f64().unwrap_or(0.0),
            r["added_envoy_cpu_us_per_request"]
        );
    }

    // Promote -> first response by the promoted version, under a steady loop (Envoy with the
    // slot is running from the last configuration above).
    let stop = Arc::new(AtomicBool::new(false));
    let seen: Arc<Mutex<Vec<(Instant, String)>>> = Arc::new(Mutex::new(Vec::new()));
    let url = s.url("/v1/chat/completions");
    let loops: Vec<_> = (0..4)
        .map(|w| {
            let (stop, seen, url) = (stop.clone(), seen.clone(), url.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let mut i = w;
                let mut failed = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let sid = format!("s{}", i % 500);
                    i += 4;
                    let o =
                        client::post(&http, &url, client::chat_body(MODEL, &sid, "hi", 1), &[("x-session-id", &sid)])
                            .await;
                    failed += usize::from(!o.ok());
                    let h = o.header("x-attache-scorers").unwrap_or("").to_owned();
                    seen.lock().unwrap_or_else(|p| p.into_inner()).push((Instant::now(), h));
                }
                failed
            })
        })
        .collect();
    let mut promote_ms = Vec::new();
    let versions = [v2.clone(), v1.clone()];
    for k in 0..args.promotions {
        let next = &versions[k % 2];
        admin.rollout("slo", next, 5.0).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        admin.promote("slo").await?;
        let promoted = Instant::now();
        let want = format!("slo=stable@{}", &next[..12]);
        let deadline = promoted + Duration::from_secs(10);
        let first = loop {
            let hit = seen
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .find(|(at, h)| *at > promoted && *h == want)
                .map(|(at, _)| *at);
            if let Some(at) = hit {
                break at;
            }
            if Instant::now() > deadline {
                bail!("promotion {k} never served");
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        promote_ms.push((first - promoted).as_secs_f64() * 1000.0);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut failed = 0;
    for l in loops {
        failed += l.await.unwrap_or(0);
    }
    let served = seen.lock().unwrap_or_else(|p| p.into_inner()).len();
    promote_ms.sort_by(f64::total_cmp);
    println!(
        "\npromote -> first response by the promoted version ({} promotions): p50 {:.1} ms, max {:.1} ms; {served} requests during them, {failed} failed",
        promote_ms.len(),
        percentile(&promote_ms, 50.0),
        promote_ms.last().copied().unwrap_or(f64::NAN)
    );
    write_results(
        &args.out,
        json!({
            "benchmark": "policy modules: scorer filter cost, upload and promotion",
            "command": "cargo xtask bench policy",
            "setup": {"engines": engines, "sim_time_scale": 0.01, "envoy_concurrency": 2,
                      "requests_per_config_per_round": args.requests, "rounds": args.rounds,
                      "scorer": "attache_scorer_slo_ttft", "module_kb": slo.len() / 1024},
            "chains": rows,
            "upload_ms": upload_ms,
            "promote_to_first_response_ms": {"p50": percentile(&promote_ms, 50.0), "max": promote_ms.last(), "samples": promote_ms},
            "requests_during_promotions": served,
            "failed_during_promotions": failed,
        }),
    )?;
    if failed > 0 {
        bail!("{failed} requests failed during promotions");
    }
    Ok(())
}
