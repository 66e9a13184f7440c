//! A fleet of gateway replicas: three real Envoy 1.40 processes (two workers each) on one host
//! and one simulated pool, with a client that sends each turn to a different replica, as an L4
//! balancer in front of a Deployment does. What one replica learns (session and Responses-id
//! bindings, prefix affinity, tenant usage) reaches the others through the host.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::stats::histogram_quantile;
use attache_e2e::{EnvoyKind, Replica, SimOpts, Stack};
use common::*;
use serde_json::{json, Value};

fn fleet_stack(name: &str, opts: SimOpts, cfg: &Value) -> (Stack, Vec<Replica>) {
    let mut s = Stack::new(name).expect("stack");
    let engines = usize::from(opts.engines);
    s.start_sim(opts).expect("sim");
    s.start_host().expect("host");
    let replicas = s.start_replicas(3, EnvoyKind::Attache, cfg, 2).expect("replicas");
    s.wait_replicas(&replicas, engines, Duration::from_secs(20)).expect("snapshot");
    (s, replicas)
}

/// The default filter, except that no engine counts as saturated: a session then leaves its
/// engine only if the replica it reaches does not know the binding (what these tests look
/// for), never because its engine's queue grew (sessions.rs covers that).
fn never_saturated() -> Value {
    let mut cfg = Stack::default_scheduler_config();
    cfg["scheduler"]["saturation"] = json!({"queue_threshold": 1.0e9, "kv_threshold": 2.0});
    cfg
}

/// The largest of the replicas' cumulative `quantile` (`"P99"`) of histogram `name`.
fn fleet_quantile(replicas: &[Replica], name: &str, quantile: &str) -> Option<f64> {
    replicas.iter().filter_map(|r| histogram_quantile(&r.stats(), name, quantile)).reduce(f64::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_and_responses_follow_their_engine_across_three_replicas() {
    // Engine mode: the engines keep Responses state, and the fleet carries the bindings.
    let opts = SimOpts { engines: 4, time_scale: 0.5, responses_store: true, ..SimOpts::default() };
    let mut cfg = never_saturated();
    cfg["responses"] = json!({"mode": "engine"});
    let (_s, replicas) = fleet_stack("fleet-sessions", opts, &cfg);
    let urls: Vec<String> = replicas.iter().map(|r| r.url("")).collect();
    let urls = Arc::new(urls);

    // 12 sessions and 12 Responses chains, 6 turns each, all at once; turn t of conversation i
    // goes to replica (i + t) % 3. A Responses continuation goes straight after the previous
    // answer (the read-through waits for its binding); a session turn 100 ms after it, an
    // agent's tool call: a session binding reaches the other replicas within the fleet's
    // binding lag (p99 about 70 ms here), and a turn sent sooner may not find it.
    let mut tasks = Vec::new();
    for i in 0..12usize {
        let session_urls = urls.clone();
        tasks.push(tokio::spawn(async move {
            let urls = session_urls;
            let http = fresh_client();
            let id = format!("fleet-session-{i}");
            let mut home = None;
            let mut wrong = 0;
            let mut shortest = Duration::MAX;
            for t in 0..6 {
                let url = format!("{}/v1/chat/completions", urls[(i + t) % 3]);
                let body = chat(&format!("agent {i}"), &format!("turn {t} of task {i} {}", "x".repeat(t * 9)), 8);
                let o = attache_e2e::client::post(&http, &url, body, &[("x-session-id", &id)]).await;
                assert!(o.ok(), "session {i} turn {t}: {} {}", o.status, o.body);
                shortest = shortest.min(o.total);
                match home {
                    None => home = o.engine_port,
                    Some(h) => wrong += usize::from(o.engine_port != Some(h)),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            ("session", wrong, 0, shortest)
        }));
        let urls = urls.clone();
        tasks.push(tokio::spawn(async move {
            let http = fresh_client();
            let mut prev: Option<String> = None;
            let mut home = None;
            let (mut wrong, mut missing) = (0, 0);
            for t in 0..6 {
                let url = format!("{}/v1/responses", urls[(i + t) % 3]);
                let mut b = json!({"model": MODEL, "input": format!("step {t} of job {i}"),
                    "instructions": "You are a coding agent.", "max_output_tokens": 8});
                if let Some(p) = &prev {
                    b["previous_response_id"] = json!(p);
                }
                let o = attache_e2e::client::post(&http, &url, b.to_string().into_bytes(), &[]).await;
                if o.status == 404 {
                    missing += 1;
                    break;
                }
                assert!(o.ok(), "chain {i} turn {t}: {} {}", o.status, o.body);
                match home {
                    None => home = o.engine_port,
                    Some(h) => wrong += usize::from(o.engine_port != Some(h)),
                }
                prev = o.json()["id"].as_str().map(str::to_owned);
            }
            ("responses", wrong, missing, Duration::MAX)
        }));
    }
    let (mut wrong_sessions, mut wrong_chains, mut not_found) = (0, 0, 0);
    let mut shortest = Duration::MAX;
    for t in tasks {
        match t.await.expect("task") {
            ("session", w, _, d) => {
                wrong_sessions += w;
                shortest = shortest.min(d);
            }
            (_, w, m, _) => {
                wrong_chains += w;
                not_found += m;
            }
        }
    }
    // Envoy merges histograms at its stats flush (every 5 s).
    tokio::time::sleep(Duration::from_millis(5_500)).await;
    let lag = |q| fleet_quantile(&replicas, "wasmcustom.attache.fleet.binding_lag_ms", q);
    eprintln!("binding learned on one replica -> usable on another: p50 {:?} ms, p99 {:?} ms", lag("P50"), lag("P99"));
    eprintln!("wrong session turns {wrong_sessions}, shortest turn {:?}", shortest);
    let stat = |n: &str| replicas.iter().map(|r| r.stat(n)).sum::<u64>();
    eprintln!(
        "bindings applied from the fleet {}, read-through lookups found {} missed {} failed {}",
        stat("wasmcustom.attache.fleet.applied.bindings"),
        stat("wasmcustom.attache.fleet.lookups.found"),
        stat("wasmcustom.attache.fleet.lookups.missed"),
        stat("wasmcustom.attache.fleet.lookups.failed"),
    );
    assert_eq!(wrong_sessions, 0, "every session turn reaches its session's engine");
    assert_eq!((not_found, wrong_chains), (0, 0), "every continuation finds its response: 0 404s");
    assert!(stat("wasmcustom.attache.fleet.applied.bindings") > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_replica_fails_only_the_requests_in_flight_on_it() {
    let opts = SimOpts { engines: 4, time_scale: 0.5, ..SimOpts::default() };
    let (_s, mut replicas) = fleet_stack("fleet-kill", opts, &never_saturated());
    let urls: Arc<Vec<String>> = Arc::new(replicas.iter().map(|r| r.url("/v1/chat/completions")).collect());
    let dead = Arc::new(AtomicBool::new(false));
    // Requests on replica 1 now, as the clients count them.
    let on_1 = Arc::new(AtomicUsize::new(0));
    // 12 sessions loop over the replicas (skipping replica 1 once it is dead) for 4 s; replica 1
    // is killed at 1.5 s.
    let mut tasks = Vec::new();
    for i in 0..12usize {
        let (urls, dead, on_1) = (urls.clone(), dead.clone(), on_1.clone());
        tasks.push(tokio::spawn(async move {
            let http = fresh_client();
            let id = format!("kill-session-{i}");
            let (mut home, mut wrong) = (None, 0);
            let (mut failed_on_1, mut failed_elsewhere) = (0, 0);
            let mut seq: Vec<String> = Vec::new();
            let until = Instant::now() + Duration::from_secs(4);
            let mut t = 0;
            while Instant::now() < until {
                let mut r = (i + t) % 3;
                if r == 1 {
                    // Counted before the check, so the killer's count includes every request
                    // that passed it.
                    on_1.fetch_add(1, Ordering::SeqCst);
                    if dead.load(Ordering::SeqCst) {
                        on_1.fetch_sub(1, Ordering::SeqCst);
                        r = 2;
                    }
                }
                let body = chat(&format!("agent {i}"), &format!("turn {t}"), 8);
                let o = attache_e2e::client::post(&http, &urls[r], body, &[("x-session-id", &id)]).await;
                if r == 1 {
                    on_1.fetch_sub(1, Ordering::SeqCst);
                }
                t += 1;
                if !o.ok() {
                    if r == 1 {
                        failed_on_1 += 1;
                    } else {
                        failed_elsewhere += 1;
                    }
                    continue;
                }
                seq.push(format!("{r}:{}", o.engine_port.unwrap_or(0)));
                match home {
                    None => home = o.engine_port,
                    Some(h) => wrong += usize::from(o.engine_port != Some(h)),
                }
            }
            if wrong > 0 {
                eprintln!("session {i}: {wrong} of {t} turns off engine {home:?}: {}", seq.join(" "));
            }
            (failed_on_1, failed_elsewhere, wrong, t)
        }));
    }
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    dead.store(true, Ordering::SeqCst);
    let inflight = on_1.load(Ordering::SeqCst);
    let envoy_active = replicas[1].stat("http.inference.downstream_rq_active");
    replicas[1].kill();
    let (mut failed_1, mut failed_else, mut wrong, mut sent) = (0, 0, 0, 0);
    for t in tasks {
        let (a, b, c, d) = t.await.expect("task");
        failed_1 += a;
        failed_else += b;
        wrong += c;
        sent += d;
    }
    eprintln!(
        "{sent} requests; {inflight} in flight on replica 1 when it was killed (Envoy: {envoy_active}), \
         {failed_1} failed there, {failed_else} elsewhere; {wrong} turns off their session's engine"
    );
    assert_eq!(failed_else, 0, "no request on a live replica fails");
    assert!(failed_1 <= inflight, "only requests in flight on the killed replica fail");
    assert_eq!(wrong, 0, "sessions keep their engine on the surviving replicas");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_split_unevenly_over_replicas_are_served_fairly() {
    // Tenant 0 has clients on every replica; tenants 1-3 each on one. Each replica alone would
    // split its share evenly between its two tenants (tenant 0 would get half the pool).
    let opts = SimOpts { engines: 2, max_num_seqs: 4, time_scale: 0.5, ..SimOpts::default() };
    let mut s = Stack::new("fleet-fairness").expect("stack");
    s.host_flow = Some(json!({"saturation": {"queue_threshold": 1.0, "kv_threshold": 0.8, "stale_ms": 1000}}));
    s.start_sim(opts).expect("sim");
    s.start_host().expect("host");
    let mut cfg = Stack::default_scheduler_config();
    cfg["flow"] = json!({"enabled": true});
    let replicas = s.start_replicas(3, EnvoyKind::Attache, &cfg, 2).expect("replicas");
    s.wait_replicas(&replicas, 2, Duration::from_secs(20)).expect("snapshot");
    let url = |r: usize| replicas[r].url("/v1/chat/completions");
    let placement: Vec<Vec<String>> =
        vec![(0..3).flat_map(|r| vec![url(r); 4]).collect(), vec![url(0); 4], vec![url(1); 4], vec![url(2); 4]];
    let (stats, tally) =
        attache_e2e::load::tenants_closed_loop_on(&placement, Duration::from_secs(3), Duration::from_secs(12), 24)
            .await;
    let jain = attache_e2e::load::jain(&stats);
    eprintln!("Jain {jain:.3} over window tokens: {stats:#?}");
    assert_eq!(tally.lost, 0, "{tally:?}");
    assert!(stats.iter().all(|t| t.window_tokens > 0), "{stats:?}");
    assert!(jain >= 0.95, "Jain's index over served tokens {jain:.3}: {stats:?}");
}

/// A host's Prometheus sample `line` prefix (`name` or `name{labels}`), 0 if absent.
fn host_metric(admin_port: u16, line: &str) -> f64 {
    let text = http_get_blocking(admin_port, "/metrics").unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(line) && l[line.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// The host replica (index into `admin_ports`) that `n` subscribers are connected to, waiting
/// up to 10 s for them to connect.
fn subscribed_host(admin_ports: &[u16], n: f64) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let counts: Vec<f64> = admin_ports.iter().map(|p| host_metric(*p, "attache_host_subscribers")).collect();
        if let Some(i) = counts.iter().position(|c| *c >= n) {
            return i;
        }
        assert!(Instant::now() < deadline, "no host has the Envoy's stream: {counts:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Wait until the host on `admin_port` indexes `blocks` blocks of `tokens` on some engine.
async fn wait_indexed_on(admin_port: u16, tokens: &[u32], blocks: u64) {
    let url = format!("http://127.0.0.1:{admin_port}/v1/kv/match");
    let body = json!({"model": MODEL, "token_ids": tokens, "block_size": 16}).to_string();
    let http = fresh_client();
    for _ in 0..100 {
        let v = attache_e2e::client::post(&http, &url, body.clone().into_bytes(), &[]).await.json();
        if v["endpoints"].as_array().is_some_and(|a| a.iter().any(|e| e["matched_blocks"].as_u64() >= Some(blocks))) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the host never indexed the blocks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_host_takes_over_when_the_one_envoy_follows_dies() {
    let mut s = Stack::new("fleet-host-ha").expect("stack");
    s.start_sim(SimOpts { engines: 4, time_scale: 0.05, kv_events: true, ..SimOpts::default() }).expect("sim");
    s.start_more_host().expect("second host");
    s.start_host().expect("host");
    let precise = json!({"role": "scheduler", "scheduler": {"precise": {"enabled": true}}});
    s.start_envoy(EnvoyKind::Attache, &precise, 2).expect("envoy");
    let admins = s.host_admin_ports();
    let on = subscribed_host(&admins, 1.0);
    // First the host must see every engine ready; then the Envoy must reach that snapshot's
    // version. The target is fixed once read: the host's version moves on with every scrape,
    // so comparing against a fresh read each time races the push.
    let deadline = Instant::now() + Duration::from_secs(30);
    let version = loop {
        let snap: Value = http_get_blocking(admins[on], "/v1/snapshot")
            .and_then(|b| serde_json::from_str(&b).ok())
            .unwrap_or_default();
        let ready = snap["endpoints"].as_array().map_or(0, |a| a.iter().filter(|e| e["ready"] == true).count());
        if let (4, Some(version)) = (ready, snap["version"].as_u64()) {
            break version;
        }
        assert!(Instant::now() < deadline, "the host never saw every engine ready: {snap}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    loop {
        let seen = s.envoy_stat("wasmcustom.attache.snapshot.version");
        if seen >= version {
            break;
        }
        assert!(Instant::now() < deadline, "the Envoy never reached snapshot {version} (it has {seen})");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let engines = s.engine_addrs();
    let port_of = |a: &str| a.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());

    // Sessions bound before the kill (the surviving host hears them through its peer).
    let http = fresh_client();
    for i in 0..6 {
        let o = send(&s, &http, chat("ha", &format!("before {i}"), 4), &[("x-session-id", &format!("ha-{i}"))]).await;
        assert!(o.ok(), "{}", o.body);
    }
    // A request loop through Envoy for the whole test: none may fail.
    let stop = Arc::new(AtomicBool::new(false));
    let mut loops = Vec::new();
    for c in 0..4 {
        let (stop, url) = (stop.clone(), s.url("/v1/chat/completions"));
        loops.push(tokio::spawn(async move {
            let http = fresh_client();
            let (mut sent, mut failed) = (0, Vec::new());
            while !stop.load(Ordering::SeqCst) {
                let o = attache_e2e::client::post(&http, &url, chat("loop", &format!("{c} {sent}"), 4), &[]).await;
                sent += 1;
                if !o.ok() {
                    failed.push(format!("{} {:?} {}", o.status, o.error, o.body));
                }
            }
            (sent, failed)
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Kill the host the Envoy follows.
    if on == 0 {
        s.kill_host();
    } else {
        s.kill_more_host(on - 1);
    }
    let killed_at = Instant::now();
    let survivor = admins[1 - on];
    // A prompt cached on engine 2 directly after the kill: only the surviving host's KV-event
    // index knows it, so routing it there is precise routing through the new host.
    let tokens: Vec<u32> = (0..640u32).map(|t| 7_000 + t).collect();
    let body = json!({"model": MODEL, "prompt": tokens, "max_tokens": 1}).to_string();
    let o = attache_e2e::client::post(&http, &format!("http://{}/v1/completions", engines[2]), body.into_bytes(), &[])
        .await;
    assert!(o.ok(), "{}", o.body);
    wait_indexed_on(survivor, &tokens, 40).await;
    let mut routed_after = None;
    for variant in 0..200u32 {
        let mut t = tokens.clone();
        t.extend((0..20).map(|i| 50_000 + variant * 100 + i));
        let body = json!({"model": MODEL, "prompt": t, "max_tokens": 2}).to_string();
        let o = attache_e2e::client::post(&http, &s.url("/v1/completions"), body.into_bytes(), &[]).await;
        assert!(o.ok(), "{}", o.body);
        if o.engine_port == port_of(&engines[2]) {
            routed_after = Some(killed_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let routed_after = routed_after.expect("the held prefix was never routed to its holder after the kill");
    eprintln!("held prefix routed to its holder {routed_after:?} after the host was killed");
    assert!(routed_after <= Duration::from_secs(1), "precise routing resumed after {routed_after:?}");
    // The agent's stream is on the survivor (read for up to a heartbeat: a stream reopened
    // meanwhile is counted once it is open again).
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut followers = host_metric(survivor, "attache_host_subscribers");
    while followers < 1.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        followers = host_metric(survivor, "attache_host_subscribers");
    }
    assert!(followers >= 1.0, "the Envoy follows the survivor: {followers} subscribers, on={on}");
    // The sessions bound before the kill are still known to the fleet.
    assert!(host_metric(survivor, "attache_host_fleet_entries{kind=\"binding\"}") >= 6.0);

    // The killed host comes back: it rejoins, and relearns the fleet from its peer.
    if on == 0 {
        s.start_host().expect("restart");
    } else {
        s.restart_more_host(on - 1).expect("restart");
    }
    let back = admins[on];
    let deadline = Instant::now() + Duration::from_secs(10);
    while host_metric(back, "attache_host_fleet_entries{kind=\"binding\"}") < 6.0 {
        assert!(Instant::now() < deadline, "the restarted host never relearned the fleet's bindings");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let (mut sent, mut failed) = (0, Vec::new());
    for l in loops {
        let (n, f) = l.await.expect("loop");
        sent += n;
        failed.extend(f);
    }
    eprintln!("{sent} requests through the host's death and return, {} failed", failed.len());
    assert!(failed.is_empty(), "{failed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_models_behind_one_gateway_each_reach_only_their_engines() {
    // 100 base models of 2 engines each (the simulator gives engine i model i mod 100), one host
    // and one Envoy, no process per model.
    let models: Vec<String> = (0..100).map(|i| format!("model-{i:03}")).collect();
    let mut s = Stack::new("fleet-models").expect("stack");
    s.host_extra = Some(json!({"scrape_interval_ms": 1000, "unready_after_ms": 10000, "models_interval_ms": 0}));
    s.start_sim(SimOpts { engines: 200, model: models.join(","), time_scale: 0.05, ..SimOpts::default() })
        .expect("sim");
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2).expect("envoy");
    s.wait_snapshot(200, Duration::from_secs(60)).expect("snapshot");
    let engines = s.engine_addrs();
    let model_of = |port: u16| {
        let i = engines.iter().position(|e| e.ends_with(&format!(":{port}")))?;
        models.get(i % models.len()).cloned()
    };
    // The pool-wide model list names every model.
    let list: Value = reqwest::get(s.url("/v1/models")).await.expect("models").json().await.expect("json");
    assert_eq!(list["data"].as_array().map(Vec::len), Some(100), "{list}");
    let http = fresh_client();
    let mut wrong = Vec::new();
    for m in &models {
        for k in 0..2 {
            let body =
                attache_e2e::client::chat_body(m, "You are a helpful assistant.", &format!("{m} question {k}"), 4);
            let o = send(&s, &http, body, &[]).await;
            assert!(o.ok(), "{m}: {} {}", o.status, o.body);
            let served = o.engine_port.and_then(model_of);
            if served.as_deref() != Some(m.as_str()) {
                wrong.push((m.clone(), served));
            }
        }
    }
    assert!(wrong.is_empty(), "requests served by another model's engine: {wrong:?}");
    // A model no engine serves is refused with a reason, not sent anywhere.
    let o = send(&s, &http, attache_e2e::client::chat_body("model-999", "s", "q", 4), &[]).await;
    assert_eq!(o.status, 404, "{}", o.body);
    assert!(o.body.contains("model-999"), "{}", o.body);
}
