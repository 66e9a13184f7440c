//! Faults with real processes, through the real Envoy 1.40: an engine killed mid-stream, an
//! engine restarted with its KV-event sequence reset, a host that goes silent (stopped with
//! SIGSTOP: its connections stay open and nothing arrives, as in a partition), and Envoy
//! draining. Each test counts its requests and asserts which ones may fail and that no other
//! was lost. (Killing the host mid-load is `foundation::killing_the_host_fails_no_request_...`.)

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::time::{Duration, Instant};

use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::client::{self, Outcome};
use attache_e2e::stats::stat_value;
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use common::*;
use serde_json::{json, Value};

fn port_of(address: &str) -> Option<u16> {
    address.rsplit(':').next().and_then(|p| p.parse().ok())
}

fn signal(pid: u32, sig: &str) {
    let st = std::process::Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status();
    assert!(st.is_ok_and(|s| s.success()), "kill -{sig} {pid}");
}

/// Is `address` ready in the snapshot the filters hold? (Host view, checked against the filters'
/// version by `wait_snapshot`.)
fn ready_in_host_snapshot(s: &Stack, address: &str) -> Option<bool> {
    let body = http_get_blocking(s.host_admin_port, "/v1/snapshot")?;
    let v: Value = serde_json::from_str(&body).ok()?;
    v["endpoints"].as_array()?.iter().find(|e| e["address"] == address).and_then(|e| e["ready"].as_bool())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_killed_mid_stream_loses_only_its_own_streams() {
    let mut s = Stack::new("engine-kill").expect("stack");
    s.start_sim(SimOpts { engines: 2, time_scale: 1.0, ..SimOpts::default() }).expect("sim");
    let victim = s.start_extra_engine().expect("extra engine");
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2).expect("envoy");
    s.wait_snapshot(3, Duration::from_secs(20)).expect("snapshot");
    let victim_port = port_of(&victim);
    let http = fresh_client();
    let url = s.url("/v1/chat/completions");

    // 18 long streams (about 1.5 s of decoding each) spread over the three engines.
    let mut streams = Vec::new();
    for i in 0..18 {
        let (http, url) = (http.clone(), url.clone());
        streams.push(tokio::spawn(async move {
            client::post(&http, &url, chat(&format!("stream {i} of a long story"), "go on", 300), &[]).await
        }));
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    s.kill_extra_engine(&victim);
    let killed = Instant::now();

    // Requests sent at once, before any scrape has noticed: a pick of the dead engine must be
    // retried on the fallbacks of x-gateway-destination-endpoint (connect-failure).
    let mut early = Vec::new();
    for i in 0..12 {
        let (http, url) = (http.clone(), url.clone());
        early.push(tokio::spawn(async move {
            client::post(&http, &url, chat(&format!("right after the kill {i}"), "hi", 3), &[]).await
        }));
    }
    let mut early_ok = 0;
    for e in early {
        let o: Outcome = e.await.expect("task");
        assert!(o.ok() && o.done, "a request not yet sent was lost: {} {:?} {}", o.status, o.error, o.body);
        assert_ne!(o.engine_port, victim_port, "served by a dead engine?");
        early_ok += 1;
    }
    assert_eq!(early_ok, 12);

    // The host marks it unready on its first refused scrape (interval 50 ms) and the filters get
    // that snapshot: allow one scrape interval plus the push, with margin for a busy machine.
    let mut unready_after = None;
    while killed.elapsed() < Duration::from_secs(5) {
        if ready_in_host_snapshot(&s, &victim) == Some(false) {
            unready_after = Some(killed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let unready_after = unready_after.expect("the dead engine never left the snapshot");
    assert!(unready_after < Duration::from_millis(1_000), "took {unready_after:?}, not one scrape interval");
    s.wait_snapshot(2, Duration::from_secs(5)).expect("the filters hold the snapshot without it");
    let retries_before = s.envoy_stat("cluster.pool.upstream_rq_retry");
    for i in 0..20 {
        let o = send(&s, &http, chat(&format!("later {i}"), "hi", 3), &[]).await;
        assert!(o.ok(), "{}", o.body);
        assert_ne!(o.engine_port, victim_port, "routed to the dead engine after its snapshot");
    }
    assert_eq!(
        s.envoy_stat("cluster.pool.upstream_rq_retry"),
        retries_before,
        "later requests were picked for the dead engine and needed retries"
    );

    // The streams: those on the dead engine end early (nothing can save a stream whose KV
    // died with its engine); every other one completes.
    let (mut cut, mut completed) = (0, 0);
    for st in streams {
        let o = st.await.expect("task");
        if o.engine_port == victim_port {
            cut += usize::from(!o.done);
            completed += usize::from(o.done);
        } else {
            assert!(o.ok() && o.done, "a stream on a live engine failed: {} {:?}", o.status, o.error);
            completed += 1;
        }
    }
    assert_eq!(cut + completed, 18);
    assert!(cut > 0, "no stream was on the killed engine; the test proved nothing");
    eprintln!("engine kill: {cut} streams cut on the dead engine, {completed} completed, 12/12 early requests ok, unready after {unready_after:?}");
}

/// The most blocks of `tokens` any engine holds, by the host's index.
async fn matched_blocks(s: &Stack, tokens: &[u32]) -> u64 {
    let url = format!("http://127.0.0.1:{}/v1/kv/match", s.host_admin_port);
    let body = json!({"model": MODEL, "token_ids": tokens, "block_size": 16}).to_string();
    let o = client::post(&s.http, &url, body.into_bytes(), &[]).await;
    o.json()["endpoints"]
        .as_array()
        .and_then(|a| a.iter().filter_map(|e| e["matched_blocks"].as_u64()).max())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_with_a_reset_sequence_drops_its_stale_blocks() {
    let mut s = Stack::new("engine-restart").expect("stack");
    let opts = SimOpts { engines: 2, time_scale: 0.05, kv_events: true, ..SimOpts::default() };
    s.start_sim(opts.clone()).expect("sim");
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &json!({"role": "scheduler", "scheduler": {"precise": {"enabled": true}}}), 2)
        .expect("envoy");
    s.wait_snapshot(2, Duration::from_secs(20)).expect("snapshot");
    let http = fresh_client();
    let engines = s.engine_addrs();
    let tokens: Vec<u32> = (0..640u32).map(|t| 7_000 + t).collect();
    let matched = |s: &Stack| {
        let url = format!("http://127.0.0.1:{}/v1/kv/match", s.host_admin_port);
        let body = json!({"model": MODEL, "token_ids": tokens, "block_size": 16}).to_string();
        let http = s.http.clone();
        async move {
            let o = client::post(&http, &url, body.into_bytes(), &[]).await;
            o.json()["endpoints"].as_array().map(|a| a.iter().filter_map(|e| e["matched_blocks"].as_u64()).max())
        }
    };
    let body = json!({"model": MODEL, "prompt": tokens, "max_tokens": 1}).to_string();
    let o = client::post(&http, &format!("http://{}/v1/completions", engines[1]), body.into_bytes(), &[]).await;
    assert!(o.ok(), "{}", o.body);
    let deadline = Instant::now() + Duration::from_secs(10);
    while matched(&s).await.flatten().unwrap_or(0) < 40 {
        assert!(Instant::now() < deadline, "the blocks were never indexed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Restart every engine on the same ports: cold caches, publishers counting from 0 again.
    // The engines are down for a moment (a scrape finds nothing listening), which drops their
    // blocks.
    let kv = |s: &Stack| -> Value {
        serde_json::from_str(&http_get_blocking(s.host_admin_port, "/v1/kv").unwrap_or_default()).unwrap_or(Value::Null)
    };
    let restarts_before = kv(&s)["subscribers"]["restarts"].as_u64().unwrap_or(0);
    if let Some(mut sim) = s.sim.take() {
        sim.kill();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while ready_in_host_snapshot(&s, &engines[1]) != Some(false) {
        assert!(Instant::now() < deadline, "the host never saw the engine go");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s.start_sim(opts.clone()).expect("sim restart");
    // The restarted engine publishes again (sequence 0) on its next request.
    let other: Vec<u32> = (0..64u32).map(|t| 90_000 + t).collect();
    let body = json!({"model": MODEL, "prompt": other, "max_tokens": 1}).to_string();
    let o = client::post(&http, &format!("http://{}/v1/completions", engines[1]), body.into_bytes(), &[]).await;
    assert!(o.ok(), "{}", o.body);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let restarts = kv(&s)["subscribers"]["restarts"].as_u64().unwrap_or(0);
        let held = matched(&s).await.flatten().unwrap_or(0);
        if restarts > restarts_before && held == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "stale blocks kept: restarts {restarts}, still matched {held} blocks");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The restarted engine's own blocks are indexed: the subscriber resyncs from the new
    // publisher's replay buffer when its SUB socket reconnects, so the batches published before
    // the reconnect are not lost.
    let deadline = Instant::now() + Duration::from_secs(10);
    while matched_blocks(&s, &other).await < 4 {
        assert!(Instant::now() < deadline, "the restarted engine's blocks were never indexed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A restart faster than a scrape: kill and start again at once. The reconnect's resync sees
    // that the publisher's batch at the last sequence is not the one seen (timestamps differ, or
    // it has none), drops the stale blocks and applies the new publisher's buffer.
    let restarts_before = kv(&s)["subscribers"]["restarts"].as_u64().unwrap_or(0);
    if let Some(mut sim) = s.sim.take() {
        sim.kill();
    }
    s.start_sim(opts.clone()).expect("sim fast restart");
    let fresh: Vec<u32> = (0..64u32).map(|t| 120_000 + t).collect();
    let body = json!({"model": MODEL, "prompt": fresh, "max_tokens": 1}).to_string();
    let o = client::post(&http, &format!("http://{}/v1/completions", engines[1]), body.into_bytes(), &[]).await;
    assert!(o.ok(), "{}", o.body);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let restarts = kv(&s)["subscribers"]["restarts"].as_u64().unwrap_or(0);
        let (stale, new) = (matched_blocks(&s, &other).await, matched_blocks(&s, &fresh).await);
        if restarts > restarts_before && stale == 0 && new >= 4 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after a fast restart: restarts {restarts} (before {restarts_before}), stale blocks {stale}, new blocks {new}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The restarted pool serves the old prefix through Envoy, cold (the engines' own answer).
    // This does not show the filters' view; the index check above does.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut t = tokens.clone();
    t.extend(1..=8);
    let body = json!({"model": MODEL, "prompt": t, "max_tokens": 1}).to_string();
    let o = client::post(&http, &s.url("/v1/completions"), body.into_bytes(), &[]).await;
    assert!(o.ok(), "{}", o.body);
    assert_eq!(o.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0), 0, "{}", o.body);
    assert!(s.envoy_stat("wasmcustom.attache.precise.index_entries_applied") > 0, "the filters never had the index");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_host_turns_scoring_load_only_with_a_metric_and_loses_nothing() {
    let mut s = Stack::new("host-silent").expect("stack");
    s.start_sim(SimOpts { engines: 4, time_scale: 1.0, ..SimOpts::default() }).expect("sim");
    s.start_host().expect("host");
    // Heartbeats come every second; 2.5 s of silence is a host in trouble.
    let cfg = json!({"role": "scheduler", "scheduler": {"host_stale_ms": 2500}});
    s.start_envoy(EnvoyKind::Attache, &cfg, 2).expect("envoy");
    s.wait_snapshot(4, Duration::from_secs(20)).expect("snapshot");
    let http = fresh_client();
    let load_only = |s: &Stack| s.envoy_stat("wasmcustom.attache.host.load_only_decisions");
    let prefix = long_prefix("silent-host");

    let mut sent = 0;
    let mut ok = 0;
    let mut before = Vec::new();
    for i in 0..6 {
        let o = send(&s, &http, chat(&prefix, &format!("before {i}"), 2), &[]).await;
        sent += 1;
        ok += usize::from(o.ok());
        before.push(o.engine_port);
    }
    assert_eq!(load_only(&s), 0, "the host is heard: no load-only decision");

    // Partition: the host process stops; its connections stay open and carry nothing.
    let pid = s.host.as_ref().expect("host").pid();
    signal(pid, "STOP");
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    // Concurrent, so this scheduler's own in-flight counts differ between engines.
    let mut tasks = Vec::new();
    for i in 0..12 {
        let (http, url) = (http.clone(), s.url("/v1/chat/completions"));
        let body = chat(&prefix, &format!("during {i}"), 30);
        tasks.push(tokio::spawn(async move { client::post(&http, &url, body, &[]).await }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut during = Vec::new();
    for t in tasks {
        let o: Outcome = t.await.expect("task");
        sent += 1;
        ok += usize::from(o.ok());
        assert!(o.ok(), "request failed while the host was silent: {}", o.body);
        during.push(o.engine_port);
    }
    let stats = s.envoy_stats();
    let decided = load_only(&s);
    let silent_ms = stat_value(&stats, "wasmcustom.attache.host.silent_ms");
    signal(pid, "CONT");
    assert_eq!(decided, 12, "every decision while the host was silent is load-only:\n{stats}");
    assert!(silent_ms >= 2_500, "the silence gauge says {silent_ms} ms");
    // Load-only spreads by in-flight counts; the shared prefix no longer pins one engine.
    let distinct: std::collections::HashSet<_> = during.iter().collect();
    assert!(distinct.len() >= 2, "load-only decisions all went to one engine: {during:?}");

    // Heard again: prefix-aware decisions resume and the counter stops.
    let deadline = Instant::now() + Duration::from_secs(10);
    while ready_in_host_snapshot(&s, &s.engine_addrs()[0]) != Some(true) {
        assert!(Instant::now() < deadline, "the host did not come back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.wait_snapshot(4, Duration::from_secs(10)).expect("snapshot after the partition");
    // The filters' own view: the silence gauge falls once a heartbeat reaches them.
    while stat_value(&s.envoy_stats(), "wasmcustom.attache.host.silent_ms") >= 2_500 {
        assert!(Instant::now() < deadline, "the filters never heard the host again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = load_only(&s);
    let mut ports = Vec::new();
    for i in 0..6 {
        let o = send(&s, &http, chat(&prefix, &format!("after {i}"), 2), &[]).await;
        sent += 1;
        ok += usize::from(o.ok());
        ports.push(o.engine_port);
    }
    assert_eq!(load_only(&s), after, "decisions after the host came back are not load-only");
    // Prefix scoring is back: only engines that already served this prefix are picked.
    let holders: std::collections::HashSet<_> = before.iter().chain(during.iter()).collect();
    assert!(ports.iter().all(|p| holders.contains(p)), "a cold engine was picked: {ports:?} vs {holders:?}");
    assert_eq!((sent, ok), (24, 24), "requests lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_envoy_completes_every_accepted_request() {
    let mut s = Stack::new("envoy-drain").expect("stack");
    s.start_sim(SimOpts { engines: 2, time_scale: 1.0, ..SimOpts::default() }).expect("sim");
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2).expect("envoy");
    s.wait_snapshot(2, Duration::from_secs(20)).expect("snapshot");
    let http = fresh_client();
    let url = s.url("/v1/chat/completions");
    let mut streams = Vec::new();
    for i in 0..16 {
        let (http, url) = (http.clone(), url.clone());
        streams.push(tokio::spawn(async move {
            client::post(&http, &url, chat(&format!("drain {i}"), "a long answer please", 200), &[]).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // What the chart's preStop does: fail health checks, then drain the listeners gracefully.
    let admin = s.envoy_admin_port;
    let post = |path: &str| {
        let url = format!("http://127.0.0.1:{admin}{path}");
        async move { reqwest::Client::new().post(url).send().await.map(|r| r.status().as_u16()) }
    };
    assert_eq!(post("/healthcheck/fail").await.ok(), Some(200));
    assert_eq!(post("/drain_listeners?graceful&inboundonly").await.ok(), Some(200));
    let mut done = 0;
    for st in streams {
        let o = st.await.expect("task");
        assert!(o.ok() && o.done, "an accepted stream was cut by the drain: {} {:?}", o.status, o.error);
        assert_eq!(o.output_tokens, 200, "stream ended early");
        done += 1;
    }
    assert_eq!(done, 16);
    // Envoy really was draining while they completed.
    let ready = reqwest::get(format!("http://127.0.0.1:{admin}/ready")).await.expect("admin");
    assert_eq!(ready.status().as_u16(), 503);
    assert_eq!(ready.text().await.unwrap_or_default().trim(), "DRAINING");
}
