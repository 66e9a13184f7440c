//! `attache async` against a real `redis-server` (Debian's) and the real stack: simulator,
//! host and Envoy 1.40 with flow control. Every test submits jobs by id and checks that each
//! id ends exactly once in the result store — completed, expired or dead-lettered — with
//! nothing left behind in the queue.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::async_worker::AsyncWorker;
use attache_e2e::process::wait_until;
use attache_e2e::redis::Redis;
use attache_e2e::stats::stat_line;
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use attache_host::async_worker::job::{JobResult, Status};
use attache_host::async_worker::queue::Queue;
use common::MODEL;
use serde_json::{json, Value};

const PREFIX: &str = "attache:async";

/// A stack whose filters run flow control with objectives {interactive: 10, batch: -1}, so the
/// worker's jobs travel as a sheddable band; `saturation` is the host's detector.
fn stack(name: &str, saturation: Value, time_scale: f64) -> Stack {
    let mut s = Stack::new(name).expect("stack");
    s.host_flow = Some(json!({"saturation": saturation, "objectives": {"interactive": 10, "batch": -1}}));
    let opts = SimOpts { engines: 4, time_scale, ..SimOpts::default() };
    s.start_sim(opts).expect("sim");
    s.start_host().expect("host");
    let mut cfg = Stack::default_scheduler_config();
    cfg["flow"] = json!({"enabled": true});
    s.start_envoy(EnvoyKind::Attache, &cfg, 2).expect("envoy");
    s.wait_snapshot(4, Duration::from_secs(20)).expect("snapshot");
    s
}

fn queue(r: &Redis) -> Queue {
    Queue::new(r.addr(), PREFIX, Duration::from_secs(5))
}

/// The worker with the tests' settings: short leases and backoff, a fast gate.
fn start_worker(s: &Stack, redis: &Redis, extra: &[&str]) -> AsyncWorker {
    let mut args = vec!["--lease-ms", "1500", "--backoff-base-ms", "100", "--backoff-max-ms", "1000"];
    args.extend(["--gate-interval-ms", "50", "--concurrency", "16"]);
    args.extend(extra);
    AsyncWorker::start(s, redis, &args).expect("attache async")
}

fn sigterm(w: &AsyncWorker) {
    let ok = Command::new("kill").args(["-TERM", &w.proc.pid().to_string()]).status().unwrap();
    assert!(ok.success());
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

fn job(id: &str, deadline_in: f64, metadata: Value) -> Vec<u8> {
    job_of(id, deadline_in, metadata, 4)
}

fn job_of(id: &str, deadline_in: f64, metadata: Value, max_tokens: u64) -> Vec<u8> {
    let payload = json!({"model": MODEL, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": format!("Summarise document {id}.")}]});
    serde_json::to_vec(&json!({"id": id, "created": unix_now(), "deadline": unix_now() + deadline_in,
        "payload": payload, "metadata": metadata}))
    .unwrap()
}

async fn results(q: &Queue) -> BTreeMap<String, JobResult> {
    loop {
        match q.results().await {
            Ok(rs) => return rs.into_iter().map(|r| (r.id.clone(), r)).collect(),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Wait until at least `n` results are written (retrying through a Redis restart).
async fn wait_results(q: &Queue, n: usize, timeout: Duration) -> usize {
    let end = Instant::now() + timeout;
    let mut seen = 0;
    loop {
        if let Ok(d) = q.depths().await {
            seen = d.results as usize;
        }
        if seen >= n || Instant::now() >= end {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Nothing is waiting, running or backing off, and no job body is left behind.
async fn assert_drained(q: &Queue) {
    let d = q.depths().await.unwrap();
    assert_eq!((d.intake, d.pending, d.inflight, d.delayed), (0, 0, 0, 0), "{d:?}");
    let jobs = q.redis().cmd(&["HLEN", &q.key("jobs")]).await.unwrap();
    assert_eq!(jobs.as_int(), Some(0), "job bodies left in the store");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_worker_and_a_restarted_redis_lose_nothing() {
    // Requests of 24 tokens at a tenth of real time (~20 ms each): the kill below lands while
    // the worker holds leases.
    let s = stack("async-nothing-lost", json!({}), 0.1);
    let mut redis = Redis::start(&s).expect("redis-server (cargo xtask installs it from Debian)");
    let q = queue(&redis);
    // 1,000 jobs: 970 to complete, 10 already past their deadline, 10 the gateway refuses
    // (an objective it does not know: 400), 10 the worker refuses (no model).
    let mut want: BTreeMap<String, Status> = BTreeMap::new();
    let mut bodies = Vec::new();
    for i in 0..1000 {
        let id = format!("job-{i:04}");
        let (body, status) = match i % 100 {
            7 => (job(&id, -5.0, json!({})), Status::Expired),
            8 => (job(&id, 600.0, json!({"objective": "no-such-objective"})), Status::DeadLettered),
            9 => {
                let b = json!({"id": id, "deadline": unix_now() + 600.0, "payload": {"messages": []}});
                (serde_json::to_vec(&b).unwrap(), Status::DeadLettered)
            }
            _ => (job_of(&id, 600.0, json!({"tenant": format!("t{}", i % 3)}), 24), Status::Completed),
        };
        want.insert(id, status);
        bodies.push(body);
    }
    q.submit(&bodies).await.unwrap();

    let mut w = start_worker(&s, &redis, &[]);
    assert!(wait_results(&q, 250, Duration::from_secs(60)).await >= 250, "the worker made no progress");
    assert!(wait_until(Duration::from_secs(10), || w.metric("attache_async_inflight") >= 2.0));
    w.proc.kill(); // SIGKILL, mid-backlog: its leases lapse and their jobs go back to pending
    let after_kill = wait_results(&q, 0, Duration::ZERO).await;
    assert!(after_kill < 1000, "the kill should land mid-backlog");
    let w = start_worker(&s, &redis, &[]);
    assert!(wait_results(&q, after_kill + 250, Duration::from_secs(60)).await >= after_kill + 250);
    redis.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    redis.restart(&s).expect("redis restart");
    let done = wait_results(&q, 1000, Duration::from_secs(120)).await;
    assert_eq!(done, 1000, "every submitted job ends in the result store");

    let got = results(&q).await;
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "exactly the submitted ids");
    let mut by_status: BTreeMap<String, usize> = BTreeMap::new();
    for (id, r) in &got {
        assert_eq!(r.status, want[id], "{id}: {r:?}");
        *by_status.entry(format!("{:?}", r.status)).or_default() += 1;
        match r.status {
            Status::Completed => {
                assert_eq!(r.status_code, 200);
                assert!(r.body["choices"][0]["message"]["content"].is_string(), "{id}: {}", r.body);
            }
            Status::DeadLettered => assert!(r.error.as_deref().is_some_and(|e| !e.is_empty()), "{id} has no reason"),
            Status::Expired => assert!(r.error.as_deref().unwrap_or("").contains("deadline"), "{r:?}"),
            Status::Cancelled => panic!("{id}: nothing was cancelled: {r:?}"),
        }
    }
    println!("results by status: {by_status:?}");
    assert_drained(&q).await;
    // The pool served ~1,000 requests: the host's latency signals have figures, and the TTFT
    // ratio is TTFT over the default 1,000 ms objective.
    let host = http_get_blocking(s.host_admin_port, "/metrics").unwrap_or_default();
    let (ttft, tpot) = (stat_line(&host, "attache_pool_ttft_seconds"), stat_line(&host, "attache_pool_tpot_seconds"));
    assert!(ttft > 0.0 && tpot > 0.0, "TTFT {ttft} s, TPOT {tpot} s");
    assert!((stat_line(&host, "attache_pool_ttft_slo_ratio") - ttft).abs() < 1e-9);
    println!("host: TTFT {:.1} ms, TPOT {:.2} ms", ttft * 1e3, tpot * 1e3);
    let dead = q.redis().cmd(&["ZCARD", &q.key("dead")]).await.unwrap().as_int();
    assert_eq!(dead, Some(20), "the dead-letter set lists the 20 refused jobs");
    let lapsed = q.redis().cmd(&["HGET", &q.key("stats"), "lapsed"]).await.unwrap().as_int().unwrap_or(0);
    assert!(lapsed >= 1, "the killed worker's leases lapsed and their jobs ran again");
    println!(
        "lapsed leases {lapsed}, second worker: dispatched {} completed {} duplicates {}",
        w.metric("attache_async_dispatched_total"),
        w.metric("attache_async_completed_total"),
        w.metric("attache_async_duplicate_results_total")
    );
    assert!(w.metric("attache_async_redis_errors_total") >= 1.0, "the Redis restart was seen and survived");
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_jobs_are_dead_lettered_with_reasons_and_the_queue_keeps_draining() {
    let s = stack("async-bad-jobs", json!({}), 0.02);
    let redis = Redis::start(&s).expect("redis-server (cargo xtask installs it from Debian)");
    let q = queue(&redis);
    let far = unix_now() + 600.0;
    let bad: Vec<(Option<&str>, Vec<u8>, &str)> = vec![
        (None, b"{not json".to_vec(), "not JSON"),
        (None, br#"{"deadline": 1e12, "payload": {}}"#.to_vec(), "string id"),
        (Some("no-deadline"), br#"{"id": "no-deadline", "payload": {}}"#.to_vec(), "numeric deadline"),
        (
            Some("no-model"),
            serde_json::to_vec(&json!({"id": "no-model", "deadline": far, "payload": {}})).unwrap(),
            "no model",
        ),
        (
            Some("bad-endpoint"),
            serde_json::to_vec(
                &json!({"id": "bad-endpoint", "deadline": far, "payload": {"model": MODEL}, "endpoint": "/admin"}),
            )
            .unwrap(),
            "endpoint",
        ),
        (
            Some("unknown-objective"),
            job("unknown-objective", 600.0, json!({"objective": "gold-plated"})),
            "refused the request with 400",
        ),
        (
            Some("bad-messages"),
            serde_json::to_vec(
                &json!({"id": "bad-messages", "deadline": far, "payload": {"model": MODEL, "messages": "hi"}}),
            )
            .unwrap(),
            "refused the request with 400",
        ),
    ];
    let mut bodies = Vec::new();
    for (i, (_, body, _)) in bad.iter().enumerate() {
        bodies.push(body.clone());
        for k in 0..5 {
            bodies.push(job(&format!("good-{i}-{k}"), 600.0, json!({})));
        }
    }
    q.submit(&bodies).await.unwrap();
    let _w = start_worker(&s, &redis, &[]);
    assert_eq!(wait_results(&q, bodies.len(), Duration::from_secs(60)).await, bodies.len());
    let got = results(&q).await;
    for (id, _, reason) in &bad {
        let r = match id {
            Some(id) => &got[*id],
            // A body without a usable id is filed under a generated one.
            None => got
                .values()
                .find(|r| r.id.starts_with("malformed:") && r.error.as_deref().unwrap_or("").contains(reason))
                .unwrap_or_else(|| panic!("no dead letter mentions {reason:?}: {got:?}")),
        };
        assert_eq!(r.status, Status::DeadLettered, "{r:?}");
        let e = r.error.as_deref().unwrap_or("");
        assert!(e.contains(reason), "{:?}: reason {e:?} should say {reason:?}", r.id);
        println!("{:>18}: {e}", r.id);
    }
    let completed = got.values().filter(|r| r.status == Status::Completed).count();
    assert_eq!(completed, bad.len() * 5, "every good job behind a bad one completed");
    assert_drained(&q).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_saturated_pool_holds_the_work_back_and_a_stop_is_graceful() {
    // stale_ms 0: the host's detector reports the pool fully saturated all along.
    let mut s = stack("async-saturated", json!({"stale_ms": 0}), 0.02);
    let redis = Redis::start(&s).expect("redis-server (cargo xtask installs it from Debian)");
    let q = queue(&redis);
    let bodies: Vec<Vec<u8>> = (0..20).map(|i| job(&format!("held-{i}"), 600.0, json!({}))).collect();
    q.submit(&bodies).await.unwrap();
    let mut w = start_worker(&s, &redis, &["--ceiling", "0.8"]);
    assert!(
        wait_until(Duration::from_secs(10), || w.metric("attache_async_gate_closed_total{reason=\"saturated\"}")
            >= 20.0),
        "the gate should read the host's saturation (1.0) and stay shut"
    );
    assert_eq!(w.metric("attache_async_pool_saturation"), 1.0);
    assert_eq!(w.metric("attache_async_dispatched_total"), 0.0, "nothing goes out above the ceiling");
    assert_eq!(q.depths().await.unwrap().pending, 20);

    // The pool's saturation falls (the host restarts with its detector's defaults): the same
    // worker lets the held jobs out.
    s.host_flow = Some(json!({"objectives": {"interactive": 10, "batch": -1}}));
    s.start_host().expect("host");
    assert_eq!(wait_results(&q, 20, Duration::from_secs(30)).await, 20);
    assert!(wait_until(Duration::from_secs(5), || w.metric("attache_async_completed_total") == 20.0));
    assert!(w.metric("attache_async_pool_saturation") < 0.8);
    assert_drained(&q).await;
    sigterm(&w);
    assert!(wait_until(Duration::from_secs(10), || !w.proc.is_running()), "SIGTERM stops the worker");
    assert!(w.proc.child.wait().unwrap().success(), "a graceful stop exits 0");

    // The worker fails closed when it cannot read the host at all.
    let mut blind = start_worker(&s, &redis, &["--host-admin", "http://127.0.0.1:1"]);
    q.submit(&[job("blind", 600.0, json!({}))]).await.unwrap();
    assert!(wait_until(Duration::from_secs(10), || blind
        .metric("attache_async_gate_closed_total{reason=\"host_unreachable\"}")
        >= 30.0));
    let text = blind.metrics();
    assert!(text.contains("\nattache_async_dispatched_total 0\n"), "{text}");
    assert!(text.contains("\nattache_async_pool_saturation -1\n"), "{text}");
    assert_eq!(q.depths().await.unwrap().pending, 1, "the job waits");
    blind.proc.kill();
}

#[tokio::test(flavor = "multi_thread")]
async fn batch_work_goes_to_the_engines_interactive_traffic_leaves() {
    // Flow control with objectives {interactive: 10, batch: -1}; no worker: the requests are
    // sent straight through the gateway with each objective, each on a new connection, so both
    // Envoy workers (each learns from its own decisions) see both bands.
    let s = stack("async-spare-placement", json!({}), 0.2);
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let url = format!("http://127.0.0.1:{}/v1/chat/completions", s.envoy_port);
    let send = |body: Value, objective: &'static str| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let r = http
                .post(&url)
                .header("x-llm-d-inference-objective", objective)
                .json(&body)
                .send()
                .await
                .expect("an answer");
            assert!(r.status().is_success(), "{}", r.status());
            r.headers()["x-inference-port"].to_str().unwrap().to_owned()
        }
    };
    let system = "You are the support assistant. ".repeat(100);
    let mut interactive = BTreeMap::<String, u32>::new();
    for i in 0..16 {
        let body = json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "system", "content": system},
            {"role": "user", "content": format!("question {i}")}]});
        *interactive.entry(send(body, "interactive").await).or_default() += 1;
    }
    assert_eq!(interactive.len(), 1, "the shared system prompt keeps the chat on one engine: {interactive:?}");
    let home = interactive.keys().next().unwrap().clone();
    let mut batch = BTreeMap::<String, u32>::new();
    for i in 0..16 {
        let body = json!({"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": format!("Summarise document {i}: {}", "report ".repeat(20 + i))}]});
        *batch.entry(send(body, "batch").await).or_default() += 1;
    }
    println!("interactive {interactive:?}, batch {batch:?}");
    assert!(!batch.contains_key(&home), "batch jobs stay off the interactive engine {home}: {batch:?}");
    assert_eq!(batch.values().sum::<u32>(), 16);
}
