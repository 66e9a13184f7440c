//! Flow control through the real Envoy 1.40 (two workers): request classes, unknown
//! objectives, sheddable requests, queueing while the pool is saturated (priority order across
//! workers, TTL, queue bounds, disconnects, an emptied pool) and fairness between tenants.
//!
//! Every test counts what it sent and asserts that each request was served, answered 429 or
//! answered 503 — nothing lost — and that the queue gauges are back to zero.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::client::Outcome;
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use common::*;
use serde_json::{json, Value};

/// A stack whose host pushes `saturation_cfg` and objectives {interactive: 10, batch: -1}, and
/// whose filter runs flow control with `flow` merged into `{"enabled": true}`.
fn flow_stack(name: &str, opts: SimOpts, saturation_cfg: Value, flow: Value) -> Stack {
    let mut s = Stack::new(name).expect("stack");
    s.host_flow = Some(json!({"saturation": saturation_cfg, "objectives": {"interactive": 10, "batch": -1}}));
    let engines = usize::from(opts.engines);
    s.start_sim(opts).expect("sim");
    s.start_host().expect("host");
    let mut cfg = Stack::default_scheduler_config();
    let mut f = json!({"enabled": true});
    if let (Some(f), Some(extra)) = (f.as_object_mut(), flow.as_object()) {
        f.extend(extra.clone());
    }
    cfg["flow"] = f;
    s.start_envoy(EnvoyKind::Attache, &cfg, 2).expect("envoy");
    s.wait_snapshot(engines, Duration::from_secs(20)).expect("snapshot");
    s
}

/// stale_ms 0: every endpoint's metrics count as stale, so the detector reports the pool fully
/// saturated (1.0) for as long as the test runs, and nothing non-sheddable is dispatched.
fn always_saturated() -> Value {
    json!({"stale_ms": 0})
}

async fn snapshot(s: &Stack) -> Value {
    let url = format!("http://127.0.0.1:{}/v1/snapshot", s.host_admin_port);
    reqwest::get(url).await.expect("admin").json().await.expect("json")
}

/// Served, 429 (by reason) and 503 counts; panics on anything else.
#[derive(Debug, Default)]
struct Tally {
    served: usize,
    too_many: BTreeMap<String, usize>,
    unavailable: BTreeMap<String, usize>,
}

impl Tally {
    fn add(&mut self, o: &Outcome) {
        match o.status {
            200 if o.error.is_none() => self.served += 1,
            429 | 503 => {
                let reason = o.header("x-attache-dropped-reason").unwrap_or("<none>").to_owned();
                assert!(o.header("retry-after").is_some(), "{} without Retry-After: {}", o.status, o.body);
                let msg = o.json()["error"]["message"].as_str().unwrap_or("").to_owned();
                assert!(!msg.is_empty(), "{} without a JSON error message: {}", o.status, o.body);
                let m = if o.status == 429 { &mut self.too_many } else { &mut self.unavailable };
                *m.entry(reason).or_default() += 1;
            }
            _ => panic!("request lost or failed: status {} error {:?} body {}", o.status, o.error, o.body),
        }
    }

    fn total(&self) -> usize {
        self.served + self.too_many.values().sum::<usize>() + self.unavailable.values().sum::<usize>()
    }

    fn n429(&self, reason: &str) -> usize {
        self.too_many.get(reason).copied().unwrap_or(0)
    }
}

fn queued_gauge(s: &Stack) -> u64 {
    s.envoy_stat("wasmcustom.attache.flow.queued")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_objectives_get_a_clear_400_and_known_ones_pass() {
    let s = flow_stack("flow-objectives", small_pool(), json!({}), json!({}));
    let http = fresh_client();
    for (objective, want) in [("interactive", 200), ("batch", 200), ("no-such-objective", 400)] {
        let o = send(&s, &http, chat("system", "hi", 2), &[("x-llm-d-inference-objective", objective)]).await;
        assert_eq!(o.status, want, "{objective}: {}", o.body);
        if want == 400 {
            assert_eq!(o.header("x-attache-dropped-reason"), Some("unknown_objective"));
            let msg = o.json()["error"]["message"].as_str().unwrap_or("").to_owned();
            assert!(msg.contains("no-such-objective"), "{msg}");
        }
    }
    // The proxy keeps serving, and nothing stayed queued.
    assert!(send(&s, &http, chat("system", "hi", 2), &[]).await.ok());
    assert_eq!(queued_gauge(&s), 0);
    assert_eq!(s.envoy_stat("wasmcustom.attache.flow.dispatched"), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sheddable_429_queue_bound_and_ttl_expiry_while_saturated() {
    // Each worker queues at most 2 requests; a queued request waits 1.5 s at most.
    let ttl = Duration::from_millis(1500);
    let s = flow_stack("flow-shed", small_pool(), always_saturated(), json!({"ttl_ms": 1500, "max_requests": 2}));
    let snap = snapshot(&s).await;
    assert!(snap["saturation"].as_f64().unwrap_or(0.0) >= 1.0, "{snap}");
    let http = fresh_client();
    let mut tally = Tally::default();
    // Sheddable: the objective says -1, or the body's priority is negative. 429 at once.
    for i in 0..4 {
        let (headers, body): (Vec<(&str, &str)>, Vec<u8>) = if i % 2 == 0 {
            (vec![("x-llm-d-inference-objective", "batch")], chat("s", "hi", 2))
        } else {
            let b = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -3});
            (vec![], serde_json::to_vec(&b).unwrap())
        };
        let o = send(&s, &http, body, &headers).await;
        assert_eq!((o.status, o.header("x-attache-dropped-reason")), (429, Some("sheddable")), "{}", o.body);
        assert!(o.json()["error"]["message"].as_str().unwrap_or("").contains("saturated"));
        tally.add(&o);
    }
    // Ten interactive requests at once: at most 2 per worker wait, the rest are refused at once
    // (queue_full); those that waited expire after the TTL (ttl_expired).
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..10 {
        let (s_url, http) = (s.url("/v1/chat/completions"), http.clone());
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let body = chat("s", &format!("question {i}"), 2);
            let o =
                attache_e2e::client::post(&http, &s_url, body, &[("x-llm-d-inference-objective", "interactive")]).await;
            (o, t.elapsed())
        }));
    }
    let mut expired = 0;
    let mut full = 0;
    for t in tasks {
        let (o, took) = t.await.expect("task");
        tally.add(&o);
        match o.header("x-attache-dropped-reason") {
            Some("queue_full") => {
                assert!(took < ttl, "queue_full is answered at once, took {took:?}");
                full += 1;
            }
            Some("ttl_expired") => {
                assert!(took >= ttl - Duration::from_millis(50), "expired before its TTL: {took:?}");
                assert!(took < ttl + Duration::from_secs(2), "expired late: {took:?}");
                expired += 1;
            }
            other => panic!("unexpected outcome {} {other:?}: {}", o.status, o.body),
        }
    }
    assert!(started.elapsed() >= ttl);
    assert!((2..=4).contains(&expired), "2 per worker at most, at least one worker queued: {expired}");
    assert_eq!(full, 10 - expired);
    // Nothing lost: 14 sent, 14 answered 429, and Envoy's counters agree with the client's.
    assert_eq!((tally.total(), tally.served, tally.n429("sheddable")), (14, 0, 4), "{tally:?}");
    assert_eq!(s.envoy_stat("wasmcustom.attache.flow.shed.sheddable"), 4);
    assert_eq!(s.envoy_stat("wasmcustom.attache.flow.shed.queue_full") as usize, full);
    assert_eq!(s.envoy_stat("wasmcustom.attache.flow.shed.ttl_expired") as usize, expired);
    assert_eq!(s.envoy_stat("wasmcustom.attache.flow.enqueued") as usize, expired);
    assert_eq!(queued_gauge(&s), 0, "no request left queued");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnected_clients_leave_no_queued_state() {
    let s = flow_stack("flow-disconnect", small_pool(), always_saturated(), json!({"ttl_ms": 60000}));
    // Clients that give up after 1.5 s, while their requests wait.
    let http =
        reqwest::Client::builder().pool_max_idle_per_host(0).timeout(Duration::from_millis(1500)).build().unwrap();
    let mut tasks = Vec::new();
    for i in 0..6 {
        let (url, http) = (s.url("/v1/chat/completions"), http.clone());
        tasks.push(tokio::spawn(async move {
            let body = chat("s", &format!("q{i}"), 2);
            attache_e2e::client::post(&http, &url, body, &[("x-attache-tenant", "acme")]).await
        }));
    }
    // All six wait: the queue gauges show them, per band and per tenant, summed over workers.
    let deadline = Instant::now() + Duration::from_millis(1200);
    while queued_gauge(&s) < 6 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(queued_gauge(&s), 6);
    assert_eq!(s.envoy_stat("wasmcustom.attache.flow.band.0.queued"), 6);
    assert_eq!(s.envoy_stat("wasmcustom.attache.flow.tenant.acme.queued"), 6);
    let prom = http_get_blocking(s.envoy_admin_port, "/stats/prometheus").unwrap_or_default();
    assert!(prom.contains("attache_flow_tenant_queued{attache_tenant=\"acme\"} 6"), "tenant label in Prometheus");
    for t in tasks {
        let o = t.await.expect("task");
        assert!(o.error.is_some(), "the client gave up: {} {}", o.status, o.body);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.envoy_stat("wasmcustom.attache.flow.disconnected") < 6 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(s.envoy_stat("wasmcustom.attache.flow.disconnected"), 6);
    assert_eq!(queued_gauge(&s), 0);
    assert_eq!(s.envoy_stat("wasmcustom.attache.flow.tenant.acme.queued"), 0);
    assert_eq!(s.envoy_stat("wasmcustom.attache.flow.dispatched"), 0);
    // The proxy keeps serving: a sheddable request is still answered 429 at once.
    let o = send(&s, &fresh_client(), chat("s", "hi", 2), &[("x-llm-d-inference-objective", "batch")]).await;
    assert_eq!(o.status, 429);
}

/// The host's `attache_pool_queue_depth{pool}` and `attache_pool_saturation` (what an
/// autoscaler reads).
fn host_pool_signals(s: &Stack) -> (Option<f64>, f64) {
    let text = http_get_blocking(s.host_admin_port, "/metrics").unwrap_or_default();
    let sample = |name: &str| {
        let prefix = format!("{name}{{pool=\"default\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|v| v.parse::<f64>().ok())
    };
    (sample("attache_pool_queue_depth"), sample("attache_pool_saturation").unwrap_or(-1.0))
}

/// Wait up to `within` for the host's queue depth to equal `want`; the time it took.
async fn host_queue_reaches(s: &Stack, want: f64, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < within {
        if host_pool_signals(s).0 == Some(want) {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread")]
async fn autoscaling_signals_on_the_host_match_the_filters_gauges() {
    let s = flow_stack("flow-autoscaling", small_pool(), always_saturated(), json!({"ttl_ms": 60000}));
    // Nothing waits yet: each Envoy worker reports an empty queue within its usage period.
    assert!(host_queue_reaches(&s, 0.0, Duration::from_secs(3)).await.is_some(), "{:?}", host_pool_signals(&s));
    let http =
        reqwest::Client::builder().pool_max_idle_per_host(0).timeout(Duration::from_millis(4000)).build().unwrap();
    let mut tasks = Vec::new();
    for i in 0..7 {
        let (url, http) = (s.url("/v1/chat/completions"), http.clone());
        tasks.push(tokio::spawn(async move {
            let body = chat("s", &format!("q{i}"), 2);
            attache_e2e::client::post(&http, &url, body, &[("x-attache-tenant", "acme")]).await
        }));
    }
    let deadline = Instant::now() + Duration::from_millis(2000);
    while queued_gauge(&s) < 7 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(queued_gauge(&s), 7, "the filters' own gauge");
    // The host's figure follows within a second: well inside one autoscaler scrape (15-30 s).
    let lag = host_queue_reaches(&s, 7.0, Duration::from_secs(1)).await;
    assert!(lag.is_some(), "host {:?} vs filters 7", host_pool_signals(&s));
    let (_, saturation) = host_pool_signals(&s);
    let gate = s.envoy_stat("wasmcustom.attache.flow.saturation_permille") as f64 / 1000.0;
    assert_eq!(saturation, 1.0, "the detector's figure");
    assert!((gate - saturation).abs() < 0.05, "the filters' gate {gate} and the host {saturation}");
    println!("queue depth reached the host {lag:?} after the filters' gauge");
    for t in tasks {
        let o = t.await.expect("task");
        assert!(o.error.is_some(), "the client gave up: {} {}", o.status, o.body);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while queued_gauge(&s) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(queued_gauge(&s), 0);
    assert!(host_queue_reaches(&s, 0.0, Duration::from_secs(1)).await.is_some(), "{:?}", host_pool_signals(&s));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn higher_priority_waiting_requests_go_first_across_workers() {
    // One engine running one sequence at a time; the pool is saturated as soon as one request
    // waits on it (queue_threshold 1). Completion order is then dispatch order.
    let opts = SimOpts { engines: 1, max_num_seqs: 1, time_scale: 1.0, ..SimOpts::default() };
    let sat = json!({"queue_threshold": 1.0, "kv_threshold": 1.0, "stale_ms": 1000});
    let s = flow_stack("flow-priority", opts, sat, json!({}));
    let url = s.url("/v1/chat/completions");
    let spawn = |tag: String, max_tokens: u64, headers: Vec<(&'static str, &'static str)>| {
        let url = url.clone();
        tokio::spawn(async move {
            let http = fresh_client();
            let o = attache_e2e::client::post(&http, &url, chat("s", &tag, max_tokens), &headers).await;
            (tag, o, Instant::now())
        })
    };
    // Two blockers: one runs, one waits on the engine, and the host reports saturation. The
    // first runs about 2.4 s (400 tokens at ~6 ms), long enough to cover an idle engine's
    // stretched scrape interval (up to 800 ms) before the host sees the second one waiting,
    // plus the eight requests below: they must all be queued before it ends.
    let started = Instant::now();
    let mut tasks = vec![spawn("blocker-1".into(), 400, vec![])];
    tokio::time::sleep(Duration::from_millis(150)).await;
    tasks.push(spawn("blocker-2".into(), 400, vec![]));
    let deadline = Instant::now() + Duration::from_secs(3);
    while snapshot(&s).await["saturation"].as_f64().unwrap_or(0.0) < 1.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(snapshot(&s).await["saturation"].as_f64().unwrap_or(0.0) >= 1.0, "the pool saturates");
    // The host knows; the filters learn it from the next push. Wait until a worker's tick
    // reports it, then one more flow tick so that both workers have it: a request sent before
    // that is dispatched to the engine, not queued, and the order below would test the race.
    while s.envoy_stat("wasmcustom.attache.flow.saturation_permille") < 1000 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    let saturated_after = started.elapsed();
    // Low priority first, then high priority, each on its own connection (both workers).
    for i in 0..4 {
        tasks.push(spawn(format!("low-{i}"), 15, vec![("x-attache-tenant", "batchy")]));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    for i in 0..4 {
        tasks.push(spawn(format!("high-{i}"), 15, vec![("x-llm-d-inference-objective", "interactive")]));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let mut tally = Tally::default();
    let mut done: Vec<(String, Instant)> = Vec::new();
    for t in tasks {
        let (tag, o, at) = t.await.expect("task");
        tally.add(&o);
        done.push((tag, at));
    }
    assert_eq!((tally.total(), tally.served), (10, 10), "{tally:?}");
    done.sort_by_key(|(_, at)| *at);
    let order: Vec<&str> = done.iter().map(|(t, _)| t.as_str()).collect();
    let last_high = order.iter().rposition(|t| t.starts_with("high")).unwrap();
    let first_low = order.iter().position(|t| t.starts_with("low")).unwrap();
    let queued_by = saturated_after + Duration::from_millis(240);
    assert!(
        last_high < first_low,
        "every high-priority request before any low one: {order:?} (saturated after {saturated_after:?}, all queued by {queued_by:?}, blocker-1 done after {:?})",
        done.iter().find(|(t, _)| t == "blocker-1").map(|(_, at)| at.duration_since(started))
    );
    assert!(s.envoy_stat("wasmcustom.attache.flow.enqueued") >= 8, "they waited in the filters");
    assert_eq!(queued_gauge(&s), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_pool_answers_503_now_and_to_waiting_requests_at_their_ttl() {
    let mut s = flow_stack("flow-empty", small_pool(), always_saturated(), json!({"ttl_ms": 4000}));
    let url = s.url("/v1/chat/completions");
    let mut tasks = Vec::new();
    for i in 0..2 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            attache_e2e::client::post(&fresh_client(), &url, chat("s", &format!("w{i}"), 2), &[]).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(queued_gauge(&s), 2, "both wait for the saturated pool");
    // Every engine dies; the host marks them unready.
    if let Some(sim) = s.sim.as_mut() {
        sim.kill();
    }
    s.wait_snapshot(0, Duration::from_secs(10)).expect("no ready endpoint");
    let mut tally = Tally::default();
    let o = send(&s, &fresh_client(), chat("s", "now", 2), &[]).await;
    assert_eq!((o.status, o.header("x-attache-dropped-reason")), (503, Some("no_endpoints")), "{}", o.body);
    tally.add(&o);
    for t in tasks {
        let o = t.await.expect("task");
        assert_eq!((o.status, o.header("x-attache-dropped-reason")), (503, Some("no_endpoints")), "{}", o.body);
        tally.add(&o);
    }
    assert_eq!((tally.total(), tally.unavailable.get("no_endpoints").copied()), (3, Some(3)));
    assert_eq!(s.envoy_stat("wasmcustom.attache.flow.shed.no_endpoints"), 3);
    assert_eq!(queued_gauge(&s), 0);
}

/// Four tenants with unequal appetites (12, 6, 3 and 3 closed-loop clients) oversubscribe a
/// pool that runs 8 sequences 3×. Served alone in arrival order they would split it by
/// appetite (Jain about 0.73); flow control splits it by tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_tenants_oversubscribing_3x_share_tokens_fairly() {
    let opts = SimOpts { engines: 2, max_num_seqs: 4, time_scale: 0.5, ..SimOpts::default() };
    let sat = json!({"queue_threshold": 1.0, "kv_threshold": 0.8, "stale_ms": 1000});
    let s = flow_stack("flow-fairness", opts, sat, json!({}));
    let (stats, tally) = attache_e2e::load::tenants_closed_loop(
        &s.url("/v1/chat/completions"),
        &[12, 6, 3, 3],
        Duration::from_secs(3),
        Duration::from_secs(12),
        24,
    )
    .await;
    let jain = attache_e2e::load::jain(&stats);
    eprintln!("Jain {jain:.3} over window tokens: {stats:#?}");
    let sent: usize = stats.iter().map(|t| t.sent).sum();
    assert_eq!(tally.lost, 0, "{tally:?}");
    assert_eq!(tally.served + tally.shed, sent, "every request accounted for: {tally:?}");
    assert!(stats.iter().all(|t| t.window_tokens > 0), "{stats:?}");
    assert!(jain >= 0.95, "Jain's index over served tokens {jain:.3}: {stats:?}");
    assert_eq!(queued_gauge(&s), 0);
}
