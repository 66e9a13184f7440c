//! In-Envoy versus endpoint picker: the same policies deciding inside Envoy (the Wasm filter)
//! or in the host's endpoint picker, which Envoy calls over `ext_proc` as Gateway API
//! gateways do (Istio's InferencePool shape). Both route to the same fast endpoint (an
//! in-process OpenAI stub that answers at once) with the same scheduler configuration; plain
//! Envoy round-robin is the baseline. For 4 KB, 100 KB and 400 KB chat bodies, sequential
//! requests on one connection and 64 concurrent streams, it reports the latency each adds over
//! plain Envoy (p50, p99) and the CPU per request of every process involved (Envoy, plus the
//! host, which runs the picker or feeds the filter). Systems take turns in interleaved rounds,
//! so drift on the shared machine hits them alike; the per-round spread is kept.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use attache_e2e::client;
use attache_e2e::stack::ExternalEngine;
use attache_e2e::{EnvoyKind, EppEnvoy, EppEnvoyOpts, Stack};
use attache_envoy::EppShape;
use serde_json::{json, Value};

use crate::overhead::{body, fast_endpoint};
use crate::procstat::{cpu_ns, StealMeter};
use crate::run::{percentile, write_results};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    #[arg(long, default_value = "bench/results/epp.json")]
    out: PathBuf,
    /// Body sizes in bytes.
    #[arg(long, value_delimiter = ',', default_values_t = [4096usize, 102_400, 409_600])]
    body_bytes: Vec<usize>,
    /// Measured requests per system, size and load at 4 KB (scaled down for larger bodies,
    /// at least 300).
    #[arg(long, default_value_t = 3000)]
    requests: usize,
    /// Concurrent streams of the concurrent load.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Interleaved rounds per size and load.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

const SYSTEMS: [&str; 3] = ["envoy", "in-envoy", "picker"];

/// One system: its stack, the URL it serves on, and the pids whose CPU it spends.
struct System {
    name: &'static str,
    url: String,
    pids: Vec<u32>,
    _stack: Stack,
    _envoy: Option<EppEnvoy>,
}

fn scheduler() -> Value {
    json!({"max_body_bytes": 4_194_304})
}

async fn start(name: &'static str, fast: std::net::SocketAddr) -> anyhow::Result<System> {
    let mut s = Stack::new(&format!("epp-bench-{name}"))?;
    s.external = vec![ExternalEngine { address: fast.to_string(), kv_publisher: None, kv_replay: None }];
    s.write_endpoints(&s.engine_addrs())?;
    let filter_config = json!({"role": "scheduler", "scheduler": scheduler()});
    match name {
        "envoy" => {
            s.start_envoy(EnvoyKind::RoundRobin, &filter_config, 2)?;
            let pids = vec![s.envoy.as_ref().map(|p| p.pid()).context("envoy")?];
            Ok(System { name, url: s.url("/v1/chat/completions"), pids, _stack: s, _envoy: None })
        }
        "in-envoy" => {
            s.start_host()?;
            s.start_envoy(EnvoyKind::Attache, &filter_config, 2)?;
            s.wait_snapshot(1, Duration::from_secs(20))?;
            let pids = vec![s.envoy.as_ref().context("envoy")?.pid(), s.host.as_ref().context("host")?.pid()];
            Ok(System { name, url: s.url("/v1/chat/completions"), pids, _stack: s, _envoy: None })
        }
        _ => {
            s.host_epp = Some(json!({"config": {"scheduler": scheduler()}}));
            s.start_host()?;
            let picker = std::net::SocketAddr::from(([127, 0, 0, 1], s.host_epp_port));
            let e = s.start_epp_envoy(
                "envoy-picker",
                &EppEnvoyOpts { concurrency: 2, ..EppEnvoyOpts::new(EppShape::OverrideHost, picker) },
            )?;
            wait_scheduled(&e.url("/v1/chat/completions")).await?;
            let pids = vec![e.proc.pid(), s.host.as_ref().context("host")?.pid()];
            Ok(System { name, url: e.url("/v1/chat/completions"), pids, _stack: s, _envoy: Some(e) })
        }
    }
}

/// Wait until the picker has a snapshot and schedules (its answer carries a session token).
async fn wait_scheduled(url: &str) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let o = client::post(&http, url, body(0, 1024), &[]).await;
        if o.status == 200 && o.header("x-session-token").is_some() {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the picker never scheduled: {} {}", o.status, o.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Latencies (µs) and CPU (ns) of one system at one size and load.
#[derive(Default)]
struct Samples {
    lat_us: Vec<f64>,
    cpu_ns: u64,
    round_p50_us: Vec<f64>,
}

fn cpu(pids: &[u32]) -> u64 {
    pids.iter().map(|&p| cpu_ns(p)).sum()
}

/// Send requests `from..to` to `sys` with `streams` concurrent connections (1: sequential).
async fn send(sys: &System, streams: usize, size: usize, from: usize, to: usize) -> anyhow::Result<(Vec<f64>, u64)> {
    let cpu0 = cpu(&sys.pids);
    let mut tasks = Vec::new();
    for k in 0..streams {
        let url = sys.url.clone();
        let http = reqwest::Client::builder().pool_max_idle_per_host(1).tcp_nodelay(true).build()?;
        let ids: Vec<usize> = (from..to).filter(|i| i % streams == k).collect();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(ids.len());
            for i in ids {
                let b = body(i, size);
                let t = Instant::now();
                let o = client::post(&http, &url, b, &[]).await;
                lat.push(t.elapsed().as_secs_f64() * 1e6);
                anyhow::ensure!(o.status == 200, "request {i} failed: {} {}", o.status, o.body);
            }
            Ok(lat)
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await??);
    }
    Ok((lat, cpu(&sys.pids).saturating_sub(cpu0)))
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    percentile(&v, 50.0)
}

/// One size and load: warm up, then `rounds` interleaved rounds over the systems.
async fn measure(systems: &[System], a: &Args, size: usize, streams: usize) -> anyhow::Result<Vec<Samples>> {
    let n = (a.requests * 4096 / size.max(1)).clamp(300, a.requests);
    for sys in systems {
        send(sys, streams, size, 10_000_000, 10_000_000 + (n / 10).max(2 * streams)).await?;
    }
    let mut samples: Vec<Samples> = systems.iter().map(|_| Samples::default()).collect();
    let per = n.div_ceil(a.rounds.max(1));
    for r in 0..a.rounds.max(1) {
        for k in (0..systems.len()).map(|k| (k + r) % systems.len()) {
            let (lat, cpu) = send(&systems[k], streams, size, r * per, ((r + 1) * per).min(n)).await?;
            let s = &mut samples[k];
            s.round_p50_us.push(median(&lat));
            s.lat_us.extend(lat);
            s.cpu_ns += cpu;
        }
    }
    Ok(samples)
}

/// One system's figures at one size and load, against the baseline's.
fn row(sys: &str, size: usize, load: &str, s: &Samples, base: &Samples) -> Value {
    let mut lat = s.lat_us.clone();
    lat.sort_by(f64::total_cmp);
    let mut blat = base.lat_us.clone();
    blat.sort_by(f64::total_cmp);
    let n = lat.len().max(1) as f64;
    let (p50, p99) = (percentile(&lat, 50.0), percentile(&lat, 99.0));
    let (b50, b99) = (percentile(&blat, 50.0), percentile(&blat, 99.0));
    let cpu_us = s.cpu_ns as f64 / 1e3 / n;
    let base_cpu_us = base.cpu_ns as f64 / 1e3 / base.lat_us.len().max(1) as f64;
    let spread: Vec<f64> = s.round_p50_us.iter().zip(&base.round_p50_us).map(|(a, b)| a - b).collect();
    let lo = spread.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = spread.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    json!({
        "system": sys, "body_bytes": size, "load": load, "requests": lat.len(),
        "p50_us": p50.round(), "p99_us": p99.round(),
        "added_p50_us": (p50 - b50).round(), "added_p99_us": (p99 - b99).round(),
        "cpu_us_per_req": (cpu_us * 10.0).round() / 10.0,
        "added_cpu_us_per_req": ((cpu_us - base_cpu_us) * 10.0).round() / 10.0,
        "added_p50_us_per_round": {"min": lo.round(), "median": median(&spread).round(), "max": hi.round()},
    })
}

/// In-Envoy over picker, for the added p50, p99 and CPU per request.
fn ratios(runs: &[Value], size: usize, load: &str) -> Value {
    let get = |sys: &str, key: &str| {
        runs.iter()
            .find(|r| r["system"] == sys && r["body_bytes"] == size && r["load"] == load)
            .and_then(|r| r[key].as_f64())
    };
    let ratio = |key: &str| match (get("in-envoy", key), get("picker", key)) {
        (Some(a), Some(b)) if b > 0.0 => json!(((a / b) * 1000.0).round() / 1000.0),
        _ => Value::Null,
    };
    json!({
        "body_bytes": size, "load": load,
        "in_envoy_over_picker": {
            "added_p50": ratio("added_p50_us"), "added_p99": ratio("added_p99_us"),
            "cpu_per_req": ratio("cpu_us_per_req"), "added_cpu_per_req": ratio("added_cpu_us_per_req"),
        },
    })
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let fast = fast_endpoint().await?;
    println!("epp: in-Envoy filter vs endpoint picker (Istio's shape) vs plain Envoy; Envoy --concurrency 2");
    let mut systems = Vec::new();
    for name in SYSTEMS {
        systems.push(start(name, fast).await?);
    }
    let (mut runs, mut ratio_rows) = (Vec::new(), Vec::new());
    let steal = StealMeter::start();
    for &size in &a.body_bytes {
        for (load, streams) in [("sequential", 1), ("concurrent", a.concurrency)] {
            let samples = measure(&systems, &a, size, streams).await?;
            let base = &samples[0];
            for (sys, s) in systems.iter().zip(&samples) {
                let r = row(sys.name, size, load, s, base);
                println!(
                    "  {size:>7} B {load:<10} {:<9} p50 {:>7} us p99 {:>7} us (added {:>6} / {:>6}); CPU {:>7} us/req (added {:>6}); added p50 per round {}",
                    sys.name, r["p50_us"], r["p99_us"], r["added_p50_us"], r["added_p99_us"],
                    r["cpu_us_per_req"], r["added_cpu_us_per_req"], r["added_p50_us_per_round"]
                );
                runs.push(r);
            }
            let q = ratios(&runs, size, load);
            println!("  {size:>7} B {load:<10} in-envoy/picker {}", q["in_envoy_over_picker"]);
            ratio_rows.push(q);
        }
    }
    let steal_pct = steal.percent().map(|p| (p * 10.0).round() / 10.0);
    let decision = decision_times(&systems).await;
    println!("  decision time over every size and load (µs): {decision}");
    let doc = json!({
        "scenario": "epp",
        "command": "cargo xtask bench epp",
        "systems": {
            "envoy": "plain Envoy 1.40 round-robin (the baseline)",
            "in-envoy": "Attaché's Wasm filter in Envoy (override_host), fed by the host",
            "picker": "the host's endpoint picker behind Envoy's ext_proc (FULL_DUPLEX_STREAMED), Istio's InferencePool shape (override_host on envoy.lb metadata), plaintext gRPC",
        },
        "cpu": "cpu_us_per_req: on-CPU µs per request of every process involved: Envoy for envoy; Envoy plus the host for in-envoy and picker",
        "config": {"body_bytes": a.body_bytes, "requests": a.requests, "concurrency": a.concurrency, "rounds": a.rounds, "envoy_concurrency": 2, "scheduler": scheduler()},
        "steal_pct": steal_pct,
        "decision_us": decision,
        "runs": runs,
        "ratios": ratio_rows,
    });
    write_results(&a.out, doc.clone())?;
    std::fs::write(a.out.with_extension("md"), markdown(&doc))?;
    std::fs::write(a.out.with_extension("svg"), svg(&doc))?;
    println!("wrote {} and {}", a.out.with_extension("md").display(), a.out.with_extension("svg").display());
    Ok(())
}

/// Each mode's own decision time over the whole run, p50 and p99 (µs): the filter's
/// `attache.decision_us` from Envoy (merged at its 5 s stats flush), the picker's
/// `attache_epp_decision_us` from the host, both interpolated within the same buckets.
async fn decision_times(systems: &[System]) -> Value {
    tokio::time::sleep(Duration::from_secs(6)).await;
    let mut out = serde_json::Map::new();
    for sys in systems {
        let (p50, p99) = match sys.name {
            "in-envoy" => {
                let stats = sys._stack.envoy_stats();
                let q = |p: &str| attache_e2e::stats::histogram_quantile(&stats, "wasmcustom.attache.decision_us", p);
                (q("P50"), q("P99"))
            }
            "picker" => {
                let page = attache_e2e::admin_http::http_get_blocking(sys._stack.host_admin_port, "/metrics");
                let buckets = prometheus_buckets(&page.unwrap_or_default(), "attache_epp_decision_us");
                (bucket_quantile(&buckets, 0.5), bucket_quantile(&buckets, 0.99))
            }
            _ => continue,
        };
        out.insert(sys.name.to_owned(), json!({"p50_us": p50.map(f64::round), "p99_us": p99.map(f64::round)}));
    }
    Value::Object(out)
}

/// A Prometheus histogram's cumulative buckets, `(upper bound, count)`, `+Inf` last.
fn prometheus_buckets(page: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    page.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, count.trim().parse().ok()?))
        })
        .collect()
}

/// The `q` quantile of cumulative buckets, interpolated linearly within its bucket (as Envoy
/// computes its own quantiles); `None` for an empty histogram or one past the last bound.
fn bucket_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let target = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, cum) in buckets {
        if cum >= target {
            if !le.is_finite() {
                return None;
            }
            let span = (cum - prev.1).max(1e-9);
            return Some(prev.0 + (le - prev.0) * (target - prev.1) / span);
        }
        prev = (le, cum);
    }
    None
}

/// A figure as a table shows it: whole numbers without a decimal point.
fn num(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x.fract() == 0.0 && x.abs() < 1e15 => format!("{}", x as i64),
        Some(x) => format!("{x}"),
        None => "n/a".into(),
    }
}

/// The results as a Markdown table (what the README and docs quote).
fn markdown(doc: &Value) -> String {
    let mut out = String::from(
        "| body | load | in-Envoy added p50 / p99 (µs) | picker added p50 / p99 (µs) | CPU µs/req: plain Envoy / in-Envoy / picker | in-Envoy ÷ picker: added p50, CPU |\n|---|---|---|---|---|---|\n",
    );
    let runs = doc["runs"].as_array().cloned().unwrap_or_default();
    for q in doc["ratios"].as_array().cloned().unwrap_or_default() {
        let get = |sys: &str| {
            runs.iter().find(|r| r["system"] == sys && r["body_bytes"] == q["body_bytes"] && r["load"] == q["load"])
        };
        let (Some(base), Some(f), Some(p)) = (get("envoy"), get("in-envoy"), get("picker")) else { continue };
        let kb = q["body_bytes"].as_u64().unwrap_or(0) / 1024;
        let r = &q["in_envoy_over_picker"];
        let _ = writeln!(
            out,
            "| {kb} KB | {} | {} / {} | {} / {} | {} / {} / {} | {}, {} |",
            q["load"].as_str().unwrap_or(""),
            num(&f["added_p50_us"]),
            num(&f["added_p99_us"]),
            num(&p["added_p50_us"]),
            num(&p["added_p99_us"]),
            num(&base["cpu_us_per_req"]),
            num(&f["cpu_us_per_req"]),
            num(&p["cpu_us_per_req"]),
            num(&r["added_p50"]),
            num(&r["cpu_per_req"]),
        );
    }
    out
}

/// Bars: the added p50 and the CPU per request of both modes, per size and load.
fn svg(doc: &Value) -> String {
    let runs = doc["runs"].as_array().cloned().unwrap_or_default();
    let groups: Vec<(u64, String)> = doc["ratios"]
        .as_array()
        .map(|q| {
            q.iter()
                .map(|r| (r["body_bytes"].as_u64().unwrap_or(0), r["load"].as_str().unwrap_or("").to_owned()))
                .collect()
        })
        .unwrap_or_default();
    let panels = [
        ("added p50 over plain Envoy (µs)", "added_p50_us"),
        ("CPU per request, all processes (µs)", "cpu_us_per_req"),
    ];
    let (pw, ph, top) = (520.0, 220.0, 40.0);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"18\" font-size=\"14\">In-Envoy filter (blue) vs endpoint picker (red), lower wins</text>\n",
        pw * 2.0 + 20.0,
        top + ph + 50.0
    );
    for (pi, (title, key)) in panels.iter().enumerate() {
        let ox = 10.0 + pi as f64 * pw;
        let value = |sys: &str, (size, load): &(u64, String)| {
            runs.iter()
                .find(|r| r["system"] == sys && r["body_bytes"] == *size && r["load"] == load.as_str())
                .and_then(|r| r[*key].as_f64())
                .unwrap_or(0.0)
                .max(0.0)
        };
        let max = groups.iter().flat_map(|g| [value("in-envoy", g), value("picker", g)]).fold(1e-9, f64::max);
        let _ = writeln!(out, "<text x=\"{}\" y=\"{top}\" font-weight=\"bold\">{title}</text>", ox + 10.0);
        let gw = (pw - 30.0) / groups.len().max(1) as f64;
        let base = top + ph;
        for (gi, g) in groups.iter().enumerate() {
            let gx = ox + 14.0 + gi as f64 * gw;
            for (bi, (sys, color)) in [("in-envoy", "#1f77b4"), ("picker", "#d62728")].iter().enumerate() {
                let v = value(sys, g);
                let h = (ph - 40.0) * v / max;
                let x = gx + bi as f64 * (gw / 2.0 - 2.0);
                let _ = writeln!(
                    out,
                    "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"{color}\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"9\">{v:.0}</text>",
                    base - h,
                    gw / 2.0 - 4.0,
                    x + gw / 4.0 - 2.0,
                    base - h - 3.0
                );
            }
            let label = format!("{} KB {}", g.0 / 1024, if g.1 == "sequential" { "seq" } else { "c64" });
            let _ = writeln!(
                out,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"9\">{label}</text>",
                gx + gw / 2.0 - 4.0,
                base + 14.0
            );
        }
        let _ = writeln!(
            out,
            "<line x1=\"{}\" y1=\"{base}\" x2=\"{}\" y2=\"{base}\" stroke=\"black\"/>",
            ox + 10.0,
            ox + pw - 20.0
        );
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(lat: &[f64], cpu_ns: u64, rounds: &[f64]) -> Samples {
        Samples { lat_us: lat.to_vec(), cpu_ns, round_p50_us: rounds.to_vec() }
    }

    #[test]
    fn quantiles_come_from_cumulative_buckets() {
        let page = "attache_epp_decision_us_bucket{le=\"10\"} 0\nattache_epp_decision_us_bucket{le=\"25\"} 50\n\
                    attache_epp_decision_us_bucket{le=\"50\"} 100\nattache_epp_decision_us_bucket{le=\"+Inf\"} 100\n";
        let b = prometheus_buckets(page, "attache_epp_decision_us");
        assert_eq!(b.len(), 4);
        assert_eq!(bucket_quantile(&b, 0.5), Some(25.0));
        assert_eq!(bucket_quantile(&b, 0.25).map(f64::round), Some(18.0));
        assert_eq!(bucket_quantile(&b, 0.99).map(f64::round), Some(50.0));
        assert_eq!(bucket_quantile(&[], 0.5), None);
    }

    #[test]
    fn rows_and_ratios_are_measured_against_the_baseline() {
        let base = samples(&[100.0; 10], 10_000_000, &[100.0, 100.0, 100.0]);
        let filter = samples(&[110.0; 10], 12_000_000, &[108.0, 110.0, 112.0]);
        let picker = samples(&[300.0; 10], 40_000_000, &[290.0, 300.0, 310.0]);
        let runs = vec![
            row("envoy", 4096, "sequential", &base, &base),
            row("in-envoy", 4096, "sequential", &filter, &base),
            row("picker", 4096, "sequential", &picker, &base),
        ];
        assert_eq!(runs[1]["added_p50_us"], 10.0);
        assert_eq!(runs[2]["added_cpu_us_per_req"], 3000.0);
        assert_eq!(runs[1]["added_p50_us_per_round"], json!({"min": 8.0, "median": 10.0, "max": 12.0}));
        let q = ratios(&runs, 4096, "sequential");
        assert_eq!(q["in_envoy_over_picker"]["added_p50"], 0.05);
        assert_eq!(q["in_envoy_over_picker"]["cpu_per_req"], 0.3);
        let doc = json!({"runs": runs, "ratios": [q]});
        let md = markdown(&doc);
        assert!(md.contains("| 4 KB | sequential | 10 / 10 | 200 / 200 | 1000 / 1200 / 4000 | 0.05, 0.3 |"), "{md}");
        let s = svg(&doc);
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>") && s.contains("4 KB seq"));
    }
}
