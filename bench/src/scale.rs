//! Pools of 100, 1,000 and 10,000 endpoints behind one Envoy and one host, in one run: what
//! each size costs and how fast state reaches the filter.
//!
//! The engines are the simulator's cheap mode (one process; engine i at 127.1.x.y on one
//! port), a number of them busy: their load gauges change every 50 ms and they publish KV
//! events, to the host's collector. Each pool is `N:B`, N engines of which B are busy; the
//! defaults hold the change constant (100 busy) while the pool grows, add 1,000 of 1,000 busy
//! (the host's worst case there), and 10,000 with one busy engine and no requests (what one
//! changed engine costs on the wire). For each pool, over one measured window:
//! - the filter's decision time (`attache_decision_us`, p50 and p99) for requests sent
//!   through Envoy;
//! - snapshot bytes per second the host sends, and the size of each delta against the number
//!   of endpoints it carries, read from a subscriber of the host's own stream;
//! - Envoy's memory (allocated and resident) and the host's CPU and memory;
//! - KV event to filter propagation (`attache_precise_propagation_us`, p99).
//!
//! A quiet pool then takes requests one at a time for a second window: the decision time
//! without concurrent load.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use attache_e2e::stats::{histogram_quantile, stat_line, stat_value};
use attache_e2e::{client, CheapOpts, EnvoyKind, SimOpts, Stack};
use attache_proto::v1::snapshot_service_client::SnapshotServiceClient;
use attache_proto::v1::{update, SubscribeRequest};
use attache_proto::Message;
use serde_json::json;

use crate::cpus::{own_cpus, pin};
use crate::procstat::{cpu_ns, rss_mb};

#[derive(clap::Parser, Debug, Clone)]
pub struct Args {
    #[arg(long, default_value = "bench/results/scale.json")]
    pub out: PathBuf,
    /// Pools as `engines:busy`, in order (a pool with at most one busy engine gets no
    /// requests, so only that engine changes).
    #[arg(long, value_delimiter = ',', default_value = "100:100,1000:100,10000:100,1000:1000,10000:1")]
    pub pools: Vec<String>,
    /// KV events per second over the whole pool.
    #[arg(long, default_value_t = 1_000)]
    pub kv_events_per_s: u64,
    /// Seconds measured per size.
    #[arg(long, default_value_t = 20)]
    pub window_s: u64,
    /// Requests in flight through Envoy during the window.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// For the one-at-a-time window, leave Envoy one core of its own: Envoy on the last core,
    /// the simulator, the host and this client on the others (`taskset`). Without it, on a
    /// small machine, the decision time includes waits for the co-located simulator and host.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub pin: bool,
}

/// Envoy alone on the last CPU, the other processes on the rest; `None` with one CPU.
fn isolate_envoy(s: &Stack) -> anyhow::Result<Option<String>> {
    let Some((envoy_cpu, others)) = crate::cpus::split() else { return Ok(None) };
    pin(s.envoy.as_ref().context("envoy")?.pid(), &envoy_cpu)?;
    for p in [s.sim.as_ref(), s.host.as_ref()].into_iter().flatten() {
        pin(p.pid(), &others)?;
    }
    pin(std::process::id(), &others)?;
    Ok(Some(format!("envoy on CPU {envoy_cpu}; simulator, host and client on CPUs {others}")))
}

/// Undo [`isolate_envoy`] for this process: back on `cpus`, as [`own_cpus`] read them before
/// (the next pool's processes start unpinned).
fn unpin_self(cpus: &str) -> anyhow::Result<()> {
    pin(std::process::id(), cpus)
}

/// Pools larger than this scrape idle engines at most every 4 s (the default 800 ms would be
/// 12,500 scrapes per second at 10,000 engines); the size's row says which applied.
const LARGE_POOL: u16 = 5_000;

/// What a subscriber of the host's stream saw.
#[derive(Default)]
struct StreamSeen {
    full_bytes: Vec<usize>,
    /// (bytes of the update, endpoints it carries).
    deltas: Vec<(usize, usize)>,
}

async fn watch_stream(port: u16, until: Instant) -> anyhow::Result<StreamSeen> {
    let mut client =
        SnapshotServiceClient::connect(format!("http://127.0.0.1:{port}")).await?.max_decoding_message_size(256 << 20);
    let mut stream = client.subscribe(SubscribeRequest { node: "scale-bench".into() }).await?.into_inner();
    let mut seen = StreamSeen::default();
    while let Some(left) = until.checked_duration_since(Instant::now()) {
        let Ok(m) = tokio::time::timeout(left, stream.message()).await else { break };
        let Some(u) = m? else { break };
        let bytes = u.encoded_len();
        match u.kind {
            Some(update::Kind::Full(_)) => seen.full_bytes.push(bytes),
            Some(update::Kind::Delta(d)) => seen.deltas.push((bytes, d.upserts.len() + d.removed.len())),
            _ => {}
        }
    }
    Ok(seen)
}

fn quantile(v: &mut [f64], q: f64) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * q).round() as usize).copied()
}

async fn host_metrics(s: &Stack) -> anyhow::Result<String> {
    Ok(s.http.get(format!("http://127.0.0.1:{}/metrics", s.host_admin_port)).send().await?.text().await?)
}

/// Requests through Envoy until `until`, `concurrency` at a time; returns (ok, errors).
async fn send_until(s: &Stack, until: Instant, concurrency: usize) -> (usize, usize) {
    let http = reqwest::Client::builder().pool_max_idle_per_host(64).build().unwrap_or_default();
    let url = s.url("/v1/chat/completions");
    let tasks = (0..concurrency.max(1)).map(|w| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let (mut ok, mut err, mut n) = (0, 0, 0usize);
            while Instant::now() < until {
                let body =
                    client::chat_body("tinyllama", &format!("system {}", n % 20), &format!("worker {w} q{n}"), 4);
                if client::post(&http, &url, body, &[]).await.ok() {
                    ok += 1;
                } else {
                    err += 1;
                }
                n += 1;
            }
            (ok, err)
        }
    });
    futures::future::join_all(tasks).await.into_iter().fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
}

/// `N` or `N:B`.
fn pool_spec(spec: &str) -> anyhow::Result<(u16, u16)> {
    let (n, b) = spec.split_once(':').unwrap_or((spec, "100"));
    let (n, b): (u16, u16) = (n.trim().parse()?, b.trim().parse()?);
    anyhow::ensure!(n > 0 && b <= n, "pool {spec:?}: need 0 < engines and busy <= engines");
    Ok((n, b))
}

async fn run_size(a: &Args, n: u16, busy: u16) -> anyhow::Result<serde_json::Value> {
    let mut s = Stack::new(&format!("scale-{n}-{busy}"))?;
    let (max_interval_ms, unready_ms) = if n > LARGE_POOL { (4_000, 10_000) } else { (800, 2_000) };
    s.host_extra = Some(json!({
        "scrape_max_interval_ms": max_interval_ms, "unready_after_ms": unready_ms, "models_interval_ms": 0,
    }));
    s.start_sim(SimOpts {
        engines: n,
        kv_events: true,
        cheap: Some(CheapOpts {
            busy: f64::from(busy) / f64::from(n),
            churn_ms: 50,
            kv_events_per_s: if busy == 0 { 0 } else { a.kv_events_per_s },
        }),
        ..SimOpts::default()
    })?;
    s.start_host()?;
    s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2)?;
    let t0 = Instant::now();
    s.wait_snapshot(usize::from(n), Duration::from_secs(180))?;
    let ready_s = t0.elapsed().as_secs_f64();
    // Let the idle engines' scrape intervals grow to their maximum.
    tokio::time::sleep(Duration::from_millis(2 * max_interval_ms)).await;

    let host_pid = s.host.as_ref().context("host")?.pid();
    let envoy_pid = s.envoy.as_ref().context("envoy")?.pid();
    let m0 = host_metrics(&s).await?;
    let (cpu0, started) = (cpu_ns(host_pid), Instant::now());
    let until = started + Duration::from_secs(a.window_s);
    let grpc = s.host_grpc_port;
    let watcher = tokio::spawn(watch_stream(grpc, until));
    let quiet = busy <= 1;
    let (ok, errors) = if quiet {
        tokio::time::sleep_until(until.into()).await;
        (0, 0)
    } else {
        send_until(&s, until, a.concurrency).await
    };
    let seen = watcher.await??;
    let secs = started.elapsed().as_secs_f64();
    let host_cores = cpu_ns(host_pid).saturating_sub(cpu0) as f64 / 1e9 / secs;
    let m1 = host_metrics(&s).await?;
    let rate = |name: &str| (stat_line(&m1, name) - stat_line(&m0, name)) / secs;
    let delta_bytes_per_s = rate("attache_host_snapshot_bytes_total{kind=\"delta\"}");
    let full_bytes_per_s = rate("attache_host_snapshot_bytes_total{kind=\"full\"}");
    // Scrapes per second: the duration histogram's count, summed over engines.
    let scrapes = |t: &str| {
        t.lines()
            .filter(|l| l.starts_with("attache_host_scrape_duration_seconds_count{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let scrapes_per_s = (scrapes(&m1) - scrapes(&m0)) / secs;
    // Envoy merges histograms at its stats flush (5 s).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let stats = s.envoy_stats();
    let q = |name: &str, p: &str| histogram_quantile(&stats, name, p);

    let mut per_delta: Vec<f64> = seen.deltas.iter().map(|&(b, _)| b as f64).collect();
    let one: Vec<f64> = seen.deltas.iter().filter(|&&(_, k)| k == 1).map(|&(b, _)| b as f64).collect();
    let carried: usize = seen.deltas.iter().map(|&(_, k)| k).sum();
    let delta_total: usize = seen.deltas.iter().map(|&(b, _)| b).sum();
    let row = json!({
        "endpoints": n,
        "busy_engines": busy,
        "requests_sent": !quiet,
        "scrape_max_interval_ms": max_interval_ms,
        "ready_after_s": ready_s,
        "window_s": secs,
        "requests_ok": ok,
        "requests_failed": errors,
        "decision_p50_us": q("wasmcustom.attache.decision_us", "P50"),
        "decision_p99_us": q("wasmcustom.attache.decision_us", "P99"),
        "kv_propagation_p99_us": q("wasmcustom.attache.precise.propagation_us", "P99"),
        "snapshot_delta_bytes_per_s": delta_bytes_per_s,
        "snapshot_full_bytes_per_s": full_bytes_per_s,
        "snapshot_full_bytes": seen.full_bytes.first(),
        "deltas_seen": seen.deltas.len(),
        "delta_bytes_p50": quantile(&mut per_delta, 0.5),
        "delta_bytes_max": per_delta.last(),
        "delta_bytes_per_endpoint_carried": (carried > 0).then(|| delta_total as f64 / carried as f64),
        "one_engine_delta_bytes_max": one.iter().copied().fold(None, |m: Option<f64>, b| Some(m.map_or(b, |m| m.max(b)))),
        "one_engine_deltas_seen": one.len(),
        "scrapes_per_s": scrapes_per_s,
        "host_cores": host_cores,
        "host_rss_mb": rss_mb(host_pid),
        "envoy_rss_mb": rss_mb(envoy_pid),
        "envoy_allocated_mb": stat_value(&stats, "server.memory_allocated") as f64 / (1024.0 * 1024.0),
    });
    // A quiet pool, after its bytes were measured: requests one at a time, for the decision
    // time without the concurrent load (the filter's own cost at this size).
    let mut row = row;
    if quiet {
        let before = own_cpus()?;
        let pinned = if a.pin { isolate_envoy(&s)? } else { None };
        // The histograms so far hold nothing: no request was sent before this window.
        let until = Instant::now() + Duration::from_secs(a.window_s);
        let (ok, errors) = send_until(&s, until, 1).await;
        if pinned.is_some() {
            unpin_self(&before)?;
        }
        tokio::time::sleep(Duration::from_secs(6)).await;
        let stats = s.envoy_stats();
        let q = |p: &str| histogram_quantile(&stats, "wasmcustom.attache.decision_us", p);
        row["sequential"] = json!({"requests_ok": ok, "requests_failed": errors,
                                   "decision_p50_us": q("P50"), "decision_p99_us": q("P99"),
                                   "pinned": pinned});
    }
    println!("{n:>6} endpoints, {busy} busy: {row}");
    Ok(row)
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for spec in &a.pools {
        let (n, busy) = pool_spec(spec)?;
        rows.push(run_size(&a, n, busy).await?);
    }
    let get = |r: &serde_json::Value, k: &str| r.get(k).and_then(serde_json::Value::as_f64);
    let at = |n: u16, busy: u16| rows.iter().find(|r| r["endpoints"] == json!(n) && r["busy_engines"] == json!(busy));
    // Envoy's memory per endpoint: the slope between the smallest and largest pools with
    // requests.
    let loaded: Vec<&serde_json::Value> = rows.iter().filter(|r| r["requests_sent"] == json!(true)).collect();
    let lo = loaded.iter().min_by_key(|r| r["endpoints"].as_u64().unwrap_or(0));
    let hi = loaded.iter().max_by_key(|r| r["endpoints"].as_u64().unwrap_or(0));
    let per_endpoint_kb = match (lo, hi) {
        (Some(lo), Some(hi)) => {
            let dn = get(hi, "endpoints").unwrap_or(0.0) - get(lo, "endpoints").unwrap_or(0.0);
            let dm = get(hi, "envoy_allocated_mb").unwrap_or(0.0) - get(lo, "envoy_allocated_mb").unwrap_or(0.0);
            (dn > 0.0).then(|| dm * 1024.0 / dn)
        }
        _ => None,
    };
    let p99_10k = at(10_000, 100).and_then(|r| get(r, "decision_p99_us"));
    let p99_10k_sequential = at(10_000, 1).and_then(|r| r["sequential"]["decision_p99_us"].as_f64());
    let cores_1k = at(1_000, 100).and_then(|r| get(r, "host_cores"));
    let cores_1k_all = at(1_000, 1_000).and_then(|r| get(r, "host_cores"));
    let one_10k = at(10_000, 1).and_then(|r| get(r, "one_engine_delta_bytes_max"));
    println!("envoy memory per endpoint: {per_endpoint_kb:?} KiB");
    println!(
        "decision p99 at 10,000: {p99_10k:?} us, one request at a time {p99_10k_sequential:?} us (target <= 100); host cores at 1,000 (100 busy): {cores_1k:?}, \
         (all busy): {cores_1k_all:?} (target <= 0.5); one changed engine at 10,000: {one_10k:?} bytes (target <= 1024)"
    );
    let doc = json!({
        "scenario": "scale",
        "command": format!("cargo xtask bench scale --pools {} --window-s {}", a.pools.join(","), a.window_s),
        "pools": rows,
        "envoy_allocated_kib_per_endpoint": per_endpoint_kb,
        "checks": {
            "decision_p99_us_at_10000": p99_10k, "decision_p99_us_at_10000_sequential": p99_10k_sequential,
            "decision_target_us": 100,
            "host_cores_at_1000_100_busy": cores_1k, "host_cores_at_1000_all_busy": cores_1k_all, "host_cores_target": 0.5,
            "one_engine_delta_bytes_at_10000": one_10k, "delta_bytes_target": 1024,
            "met": {
                "decision": p99_10k.is_some_and(|v| v <= 100.0),
                "decision_sequential": p99_10k_sequential.is_some_and(|v| v <= 100.0),
                "host_cpu": cores_1k.is_some_and(|v| v <= 0.5),
                "host_cpu_all_busy": cores_1k_all.is_some_and(|v| v <= 0.5),
                "delta_bytes": one_10k.is_some_and(|v| v <= 1024.0),
            },
        },
    });
    crate::run::write_results(&a.out, doc)
}
