//! `attache gateway` against simulated engines, through the real Envoy 1.40: the pool follows
//! the endpoints file over the host's EDS with no Envoy restart. And the host's own
//! Prometheus `/metrics`, checked against what an independent publisher (pyzmq) sent.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::collections::HashSet;
use std::process::Command;
use std::time::{Duration, Instant};

use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::client;
use attache_e2e::ports::free_port;
use attache_e2e::stack::ExternalEngine;
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use common::*;

/// The pid of `parent`'s child process named `name` (from /proc).
fn child_pid(parent: u32, name: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|d| {
        let pid: u32 = d.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(d.path().join("stat")).ok()?;
        // pid (comm) state ppid ...
        let (comm, rest) = stat.split_once(") ")?;
        let ppid: u32 = rest.split_whitespace().nth(1)?.parse().ok()?;
        (ppid == parent && comm.ends_with(name)).then_some(pid)
    })
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Send `n` requests with unrelated prompts (each goes to the best endpoint for a cold
/// prefix, which spreads them) and return the engine ports that served them.
async fn served(s: &Stack, http: &reqwest::Client, n: usize, tag: &str) -> Vec<u16> {
    let mut ports = Vec::new();
    for i in 0..n {
        let o = send(s, http, chat(&long_prefix(&format!("{tag}-{i}")), "hi", 2), &[]).await;
        assert!(o.ok(), "{tag} request {i}: {} {}", o.status, o.body);
        ports.push(o.engine_port.expect("x-inference-port"));
    }
    ports
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_follows_its_endpoints_file_without_restarting_envoy() {
    let mut s = Stack::new("gateway").expect("stack");
    s.start_sim(SimOpts { engines: 3, time_scale: 0.05, ..SimOpts::default() }).expect("sim");
    let all = s.engine_addrs();
    let port_of = |a: &str| -> u16 { a.rsplit(':').next().unwrap().parse().unwrap() };
    s.write_endpoints(&all[..2]).expect("two engines");
    // The stack's helpers (requests, stats, snapshot wait) follow the gateway's ports.
    s.host_grpc_port = free_port();
    let config = format!(
        "listen: 127.0.0.1:{}\nenvoy_admin: 127.0.0.1:{}\nendpoints_file: {}\nenvoy: {}\nwasm: {}\nconcurrency: 2\n\
         host: {{grpc_listen: 127.0.0.1:{}, admin_listen: 127.0.0.1:{}}}\n\
         scheduler: {{\"scheduler\": {{\"max_body_bytes\": 4194304}}}}\n",
        s.envoy_port,
        s.envoy_admin_port,
        s.endpoints_file.display(),
        s.paths.envoy.display(),
        s.paths.wasm.display(),
        s.host_grpc_port,
        s.host_admin_port,
    );
    let path = s.workdir.join("gateway.yaml");
    std::fs::write(&path, config).unwrap();
    let mut gateway =
        s.spawn("gateway", Command::new(&s.paths.host_bin).arg("gateway").arg("--config").arg(&path)).expect("gateway");
    s.wait_snapshot(2, Duration::from_secs(30)).expect("the filters see the file's two engines");
    let envoy = child_pid(gateway.pid(), "envoy").expect("Envoy runs as the gateway's child");
    let http = fresh_client();

    let before: HashSet<u16> = served(&s, &http, 12, "two").await.into_iter().collect();
    let listed: HashSet<u16> = all[..2].iter().map(|a| port_of(a)).collect();
    assert_eq!(before, listed, "requests reach exactly the listed engines");

    // A third engine joins the file: it is routed to within 2 s, and Envoy is the same process.
    s.write_endpoints(&all).expect("three engines");
    let added = port_of(&all[2]);
    let start = Instant::now();
    let mut reached = None;
    let mut i = 0;
    while start.elapsed() < Duration::from_secs(5) {
        let got = served(&s, &http, 3, &format!("join-{i}")).await;
        i += 1;
        if got.contains(&added) {
            reached = Some(start.elapsed());
            break;
        }
    }
    let reached = reached.expect("the added engine never received a request");
    println!("the added engine was first reached {} ms after the file changed", reached.as_millis());
    assert!(reached <= Duration::from_secs(2), "the added engine was first reached after {reached:?}");
    assert_eq!(child_pid(gateway.pid(), "envoy"), Some(envoy), "Envoy was restarted");
    assert!(alive(envoy));
    let clusters = http_get_blocking(s.envoy_admin_port, "/clusters").unwrap_or_default();
    assert!(clusters.contains(&format!("pool::{}::", all[2])), "EDS did not add {} to the pool:\n{clusters}", all[2]);

    // The first engine leaves the file: no request, scheduled or not, reaches it any more.
    let removed = port_of(&all[0]);
    s.write_endpoints(&all[1..]).expect("drop the first engine");
    let deadline = Instant::now() + Duration::from_secs(5);
    while http_get_blocking(s.envoy_admin_port, "/clusters")
        .unwrap_or_default()
        .contains(&format!("pool::{}::", all[0]))
    {
        assert!(Instant::now() < deadline, "EDS never removed {}", all[0]);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.wait_snapshot(2, Duration::from_secs(10)).expect("the filters drop the engine");
    let after = served(&s, &http, 16, "after").await;
    assert!(!after.contains(&removed), "a scheduled request reached the removed engine: {after:?}");
    let remaining: HashSet<u16> = all[1..].iter().map(|a| port_of(a)).collect();
    assert!(after.iter().all(|p| remaining.contains(p)), "{after:?}");
    // Unscheduled paths go to the pool's round-robin fallback: its members follow EDS too.
    for _ in 0..6 {
        let resp = http.get(s.url("/health")).send().await.expect("health");
        assert!(resp.status().is_success());
        let port: u16 = resp.headers()["x-inference-port"].to_str().unwrap().parse().unwrap();
        assert_ne!(port, removed, "an unscheduled request reached the removed engine");
    }
    assert_eq!(child_pid(gateway.pid(), "envoy"), Some(envoy), "Envoy was restarted");

    // SIGTERM (what systemd and Kubernetes send): the gateway stops Envoy and exits cleanly.
    let term = Command::new("kill").arg("-TERM").arg(gateway.pid().to_string()).status().unwrap();
    assert!(term.success());
    let deadline = Instant::now() + Duration::from_secs(15);
    while gateway.is_running() || alive(envoy) {
        assert!(Instant::now() < deadline, "the gateway or its Envoy still runs 15 s after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = std::fs::read_to_string(s.workdir.join("gateway.log")).unwrap_or_default();
    assert!(log.contains("shutting down") && !log.contains("Envoy exited"), "{log}");
}

#[test]
fn the_gateway_refuses_bad_configurations_with_a_clear_message() {
    let s = Stack::new("gateway-errors").expect("stack");
    let run = |yaml: &str| {
        let path = s.workdir.join("bad-gateway.yaml");
        std::fs::write(&path, yaml).unwrap();
        let out = Command::new(&s.paths.host_bin).arg("gateway").arg("--config").arg(&path).output().unwrap();
        assert!(!out.status.success(), "{yaml}: exited 0");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let eps = s.workdir.join("eps.yaml");
    std::fs::write(&eps, "endpoints:\n  - address: 127.0.0.1:1\n    models: [m]\n").unwrap();
    let e = run(&format!("endpoints_file: {}\nenvoy: /no/such/envoy\n", eps.display()));
    assert!(e.contains("Envoy not found: /no/such/envoy"), "{e}");
    let e = run("endpoints_file: /no/such/engines.yaml\n");
    assert!(e.contains("reading /no/such/engines.yaml"), "{e}");
    std::fs::write(&eps, "endpoints:\n  - address: vllm-0:8000\n    models: [m]\n").unwrap();
    let e = run(&format!("endpoints_file: {}\n", eps.display()));
    assert!(e.contains("`vllm-0:8000` is not ip:port"), "{e}");
    let missing = s.workdir.join("missing.yaml");
    let out = Command::new(&s.paths.host_bin).arg("gateway").arg("--config").arg(&missing).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.yaml"));
}

/// One sample of `name` with exactly these labels (`name{labels} value`), or of a bare name.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_serves_its_metrics_with_what_the_engines_published() {
    let mut s = Stack::new("host-metrics").expect("stack");
    s.start_sim(SimOpts { engines: 1, time_scale: 0.05, ..SimOpts::default() }).expect("sim");
    // An engine the test publishes KV events for itself with pyzmq (nothing serves HTTP at
    // 127.0.0.1:1, so its scrapes are refused and counted).
    let (pub_port, replay_port) = (free_port(), free_port());
    s.external.push(ExternalEngine {
        address: "127.0.0.1:1".into(),
        kv_publisher: Some(format!("tcp://127.0.0.1:{pub_port}")),
        kv_replay: Some(format!("tcp://127.0.0.1:{replay_port}")),
    });
    s.write_endpoints(&s.engine_addrs()).unwrap();
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2).expect("envoy");
    s.wait_snapshot(1, Duration::from_secs(20)).expect("snapshot");
    let engine = s.engine_addrs()[0].clone();

    let out = Command::new(s.paths.root.join(".venv/bin/python"))
        .arg(s.paths.root.join("host/tests/pyzmq_publisher.py"))
        .args(["bind", "map", &pub_port.to_string(), &replay_port.to_string()])
        .output()
        .expect("python publisher");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let published: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let events = published["events"].as_f64().expect("events published");
    assert!(events >= 5.0, "{published}");
    // Some traffic, so the host's snapshots carry load.
    let http = fresh_client();
    let o = client::post(&http, &s.url("/v1/chat/completions"), chat("metrics", "hi", 2), &[]).await;
    assert!(o.ok(), "{} {}", o.status, o.body);

    // The publisher has exited, so everything it sent is in flight or applied: wait until the
    // host shows it all (or 10 s pass and the assertions below say what is missing).
    let dead = "endpoint=\"127.0.0.1:1\"";
    let ingested = format!("attache_host_kv_events_ingested_total{{{dead}}}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = http_get_blocking(s.host_admin_port, "/metrics").expect("GET /metrics (no token needed)");
        let done = sample(&text, &ingested) == Some(events)
            && sample(&text, "attache_host_kv_events_dropped_total{reason=\"decode_error\"}") == Some(3.0)
            && sample(&text, "attache_host_scrape_age_seconds{endpoint=\"127.0.0.1:1\"}").is_some_and(|a| a >= 0.5);
        if done || Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let get = |series: &str| sample(&text, series).unwrap_or_else(|| panic!("no sample {series} in\n{text}"));
    assert_eq!(get(&ingested), events, "ingested = published");
    assert_eq!(
        get("attache_host_kv_events_dropped_total{reason=\"decode_error\"}"),
        3.0,
        "the three malformed messages"
    );
    assert_eq!(get("attache_host_kv_events_dropped_total{reason=\"unsupported_event\"}"), 1.0, "the unknown event");
    assert_eq!(get("attache_host_kv_sequence_gaps_total"), 1.0);
    assert!(get("attache_host_kv_index_blocks") >= 3.0);
    let live = format!("endpoint=\"{engine}\"");
    assert!(get(&format!("attache_host_scrape_duration_seconds_count{{{live}}}")) >= 5.0, "scraped every 50 ms");
    assert!(get(&format!("attache_host_scrape_age_seconds{{{live}}}")) < 1.0, "a live engine is fresh");
    assert!(get(&format!("attache_host_scrape_errors_total{{{dead},reason=\"refused\"}}")) >= 1.0);
    assert!(get(&format!("attache_host_scrape_age_seconds{{{dead}}}")) >= 0.5, "a dead engine goes stale");
    assert_eq!(get("attache_host_endpoints{state=\"ready\"}"), 1.0);
    assert_eq!(get("attache_host_endpoints{state=\"unready\"}"), 1.0);
    assert!(get("attache_host_snapshot_version") >= 1.0);
    assert!(get("attache_host_snapshots_published_total") >= 1.0);
    assert!(get("attache_host_snapshot_bytes_total{kind=\"full\"}") > 0.0);
    assert!(get("attache_host_subscribers") >= 1.0, "Envoy's snapshot agent is subscribed");
    assert!(text.contains("# TYPE attache_host_policy_transitions_total counter"), "{text}");
    // The text parses as Prometheus exposition, every line of it.
    assert_eq!(attache_kv::prom::parse(&text).bad_lines, 0, "{text}");
}

/// `cargo xtask up`'s launcher: it starts the stack, checks a request end to end, prints the
/// three URLs, and leaves no process behind when it stops.
#[test]
fn up_starts_the_stack_prints_its_urls_and_stops_everything() {
    let s = Stack::new("up-check").expect("stack");
    let bench = s.paths.host_bin.with_file_name("attache-bench");
    let (port, envoy_admin, host_admin) = (free_port(), free_port(), free_port());
    let out = Command::new(&bench)
        .current_dir(&s.paths.root)
        .args(["up", "--check", "--engines", "2", "--time-scale", "0.05"])
        .args(["--port", &port.to_string(), "--envoy-admin-port", &envoy_admin.to_string()])
        .args(["--host-admin-port", &host_admin.to_string()])
        .output()
        .expect("attache-bench up");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "up failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for url in [
        format!("http://127.0.0.1:{port}/v1"),
        format!("http://127.0.0.1:{envoy_admin}/stats/prometheus"),
        format!("http://127.0.0.1:{host_admin}"),
    ] {
        assert!(stdout.contains(&url), "{url} not printed:\n{stdout}");
    }
    for p in [port, envoy_admin, host_admin] {
        assert!(http_get_blocking(p, "/").is_none(), "port {p} still answers after up stopped");
    }
}
