//! End-to-end tests of the foundation: the real Envoy 1.40 binary with the Attaché filter, the
//! host and simulated vLLM engines, all real processes on loopback.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::client;
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use common::*;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefix_sticks_and_unrelated_prefixes_spread() {
    let s = attache_stack("sticky", small_pool());
    let http = fresh_client();
    let prefix = long_prefix("group-a");
    let mut ports = HashSet::new();
    for q in 0..8 {
        let o = send(&s, &http, chat(&prefix, &format!("question {q}"), 4), &[]).await;
        assert!(o.ok() && o.done, "request {q} failed: {} {}", o.status, o.body);
        ports.insert(o.engine_port.expect("engine port header"));
    }
    assert_eq!(ports.len(), 1, "a shared long prefix must stay on one engine, got {ports:?}");

    // Sixteen unrelated prefixes over new connections (both Envoy workers): the whole pool.
    let mut spread = HashMap::new();
    for g in 0..16 {
        let o = send(&s, &http, chat(&long_prefix(&format!("unrelated-{g}")), "hi", 2), &[]).await;
        assert!(o.ok(), "{} {}", o.status, o.body);
        *spread.entry(o.engine_port.expect("engine port")).or_insert(0) += 1;
    }
    assert_eq!(spread.len(), 4, "unrelated prefixes should use every engine: {spread:?}");
}

/// The affinity gate (`prefix.affinity_threshold`, 0.8): sessions that share only a short
/// system preamble (about 40% of each prompt) are spread over the pool instead of following
/// the preamble to the engine that holds it, and each session's next turn, which shares
/// nearly all of its prompt, still goes back to that session's engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_shared_preamble_does_not_pull_new_sessions_onto_one_engine() {
    let s = attache_stack("preamble-gate", small_pool());
    let http = fresh_client();
    let preamble = "Tools: read_file(path), write_file(path, text), run_tests(), search(query). ".repeat(50);
    let context =
        |k: usize| format!("Repository {k}: ") + &format!("src/module_{k}.rs holds parser code. ").repeat(160);
    let mut first = Vec::new();
    for k in 0..8 {
        let o = send(&s, &http, chat(&preamble, &context(k), 2), &[]).await;
        assert!(o.ok() && o.done, "session {k}: {} {}", o.status, o.body);
        first.push(o.engine_port.expect("engine port"));
    }
    let used: HashSet<_> = first.iter().collect();
    assert!(used.len() >= 3, "new sessions piled onto the preamble's holder: {first:?}");
    // Let both Envoy workers learn every decision (the cross-worker table's flush).
    tokio::time::sleep(Duration::from_millis(100)).await;
    for (k, port) in first.iter().enumerate() {
        let o = send(&s, &http, chat(&preamble, &format!("{} Next step?", context(k)), 2), &[]).await;
        assert!(o.ok(), "{} {}", o.status, o.body);
        assert_eq!(o.engine_port, Some(*port), "session {k}'s next turn left its engine");
    }
}

/// Envoy's two workers share their decisions through the affinity log: a prefix one worker
/// routed is learned by the other from its tick (`attache.affinity.learned`), so a repeat that
/// lands on either worker follows it. Every request opens a new connection, so the repeats
/// reach both workers; a worker that had not learned the prefix would route it cold, by its own
/// least-recently-used order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_routed_by_one_worker_is_followed_by_the_other() {
    let s = attache_stack("cross-worker", small_pool());
    let http = fresh_client();
    let mut first = Vec::new();
    for g in 0..8 {
        let o = send(&s, &http, chat(&long_prefix(&format!("tenant-{g}")), "start", 2), &[]).await;
        assert!(o.ok(), "{} {}", o.status, o.body);
        first.push(o.engine_port.expect("engine port"));
    }
    let learned = || s.envoy_stat("wasmcustom.attache.affinity.learned");
    for _ in 0..100 {
        if learned() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(learned() > 0, "no worker learned another's decisions");
    // Until the workers have learned all there is: the count holds still for 200 ms (ten flush
    // periods; a fixed 100 ms was too short on a loaded 2-core CI machine), or 5 s pass.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut last = learned();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = learned();
        if now == last || std::time::Instant::now() > deadline {
            break;
        }
        last = now;
    }
    for round in 0..3 {
        for (g, port) in first.iter().enumerate() {
            let o = send(&s, &http, chat(&long_prefix(&format!("tenant-{g}")), &format!("step {round}"), 2), &[]).await;
            assert!(o.ok(), "{} {}", o.status, o.body);
            assert_eq!(o.engine_port, Some(*port), "prefix {g}, repeat {round} left its engine");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_engine_is_avoided() {
    // Two running sequences per engine, and slow steps, so a queue builds up for real.
    let s = attache_stack("saturated", SimOpts { engines: 3, max_num_seqs: 2, time_scale: 1.0, ..SimOpts::default() });
    let http = fresh_client();
    let prefix = long_prefix("hot");
    let first = send(&s, &http, chat(&prefix, "q0", 2), &[]).await;
    assert!(first.ok(), "{}", first.body);
    let hot = first.engine_port.expect("port");

    // Flood the hot engine directly (bypassing Envoy) with long requests.
    let flood = load_engine(&http, hot, 10, 3000);
    // Wait until the host reports the queue.
    let waiting = wait_for_queue(&s, hot, 5.0).await;
    assert!(waiting >= 5.0, "flood did not build a queue (waiting {waiting})");
    tokio::time::sleep(Duration::from_millis(300)).await; // let the snapshot reach the filters

    for q in 1..6 {
        let o = send(&s, &http, chat(&prefix, &format!("q{q}"), 2), &[]).await;
        assert!(o.ok(), "{}", o.body);
        assert_ne!(o.engine_port, Some(hot), "request {q} went to the saturated engine despite its cached prefix");
    }
    for f in flood {
        f.abort();
    }
}

/// The affinity filter (`prefix.affinity_filter`) through the real Envoy: an engine that holds
/// a prompt but has a queue (below saturation) keeps the prompt's next request, where scores
/// alone send it to an idle engine. The prefix weight is 1 here so that the two outcomes
/// differ: the holder scores 1 x its share + 0 (worst queue) + KV, an idle engine 2 + 2 + KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_affinity_filter_keeps_a_busy_holder_that_scores_alone_would_leave() {
    async fn next_request_goes_to_holder(name: &str, filter: bool) -> bool {
        let mut s = Stack::new(name).expect("stack");
        let opts = SimOpts { engines: 3, max_num_seqs: 2, time_scale: 1.0, ..SimOpts::default() };
        s.start_sim(opts).expect("sim");
        s.start_host().expect("host");
        let mut profiles = attache_policies::profiles::ProfilesConfig::default();
        let prefix_scorer = profiles.decode.plugins.iter_mut().find(|p| p.kind == "prefix-cache-scorer");
        prefix_scorer.expect("the default profile has the prefix scorer").weight = Some(1.0);
        let config = serde_json::json!({"role": "scheduler", "scheduler": {"max_body_bytes": 4_194_304,
            "profiles": profiles, "prefix": {"affinity_filter": {"enabled": filter}}}});
        s.start_envoy(EnvoyKind::Attache, &config, 2).expect("envoy");
        s.wait_snapshot(3, Duration::from_secs(20)).expect("snapshot");
        let http = fresh_client();
        let prefix = long_prefix("busy-holder");
        let first = send(&s, &http, chat(&prefix, "q0", 2), &[]).await;
        assert!(first.ok(), "{}", first.body);
        let holder = first.engine_port.expect("port");
        // Four short-lived requests straight to the holder: two run, the others wait (under
        // the saturation threshold of five).
        let load = load_engine(&http, holder, 4, 300);
        let waiting = wait_for_queue(&s, holder, 1.0).await;
        assert!((1.0..5.0).contains(&waiting), "the holder should have a queue below saturation (waiting {waiting})");
        tokio::time::sleep(Duration::from_millis(300)).await; // let the snapshot reach the filters
        let o = send(&s, &http, chat(&prefix, "q1", 2), &[]).await;
        assert!(o.ok(), "{}", o.body);
        for l in load {
            l.abort();
        }
        o.engine_port == Some(holder)
    }
    assert!(next_request_goes_to_holder("affinity-filter-on", true).await, "the filter left the holder");
    assert!(!next_request_goes_to_holder("affinity-filter-off", false).await, "scores alone kept the holder");
}

/// The approximate index models each engine's evictions ([`attache_policies::index::KvClock`]):
/// a prefix stops pulling once its engine has written a cache's worth of other prompts, which
/// evicted it. Engines of 256 blocks of 16 tokens (4,096 tokens); the prefix is about 2,000.
/// With `cache_share` 0 (no model, llm-d's approximate mode) the index still claims the evicted
/// prefix, and the engine then reports the match it claimed as a miss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_its_engine_has_evicted_no_longer_counts_as_held() {
    /// (prefix blocks the filter matched, prompt tokens the holder's cache hit) for a repeat
    /// of a prefix after its holder wrote 8,000 tokens of other prompts.
    async fn repeat_after_eviction(name: &str, cache_share: f64) -> (u64, f64) {
        let mut s = Stack::new(name).expect("stack");
        s.start_sim(SimOpts { engines: 2, num_gpu_blocks: 256, time_scale: 0.05, ..SimOpts::default() }).expect("sim");
        s.start_host().expect("host");
        let config = serde_json::json!({"role": "scheduler", "scheduler": {"max_body_bytes": 4_194_304,
            "prefix": {"cache_share": cache_share}}});
        s.start_envoy(EnvoyKind::Attache, &config, 1).expect("envoy");
        s.wait_snapshot(2, Duration::from_secs(20)).expect("snapshot");
        let http = fresh_client();
        let prefix = long_prefix("evicted");
        let first = send(&s, &http, chat(&prefix, "q0", 1), &[]).await;
        assert!(first.ok(), "{}", first.body);
        let holder = first.engine_port.expect("port");
        let again = send(&s, &http, chat(&prefix, "q1", 1), &[]).await;
        assert_eq!(again.engine_port, Some(holder), "the held prefix pulls its repeat");
        // Eight unique 1,000-token prompts straight to the holder: its cache turns over twice.
        for i in 0..8 {
            let body =
                serde_json::json!({"model": MODEL, "prompt": format!("other {i} ").repeat(500), "max_tokens": 1});
            let o = client::post(
                &http,
                &format!("http://127.0.0.1:{holder}/v1/completions"),
                body.to_string().into_bytes(),
                &[],
            )
            .await;
            assert!(o.ok(), "{}", o.body);
        }
        // The holder's write clock reaches the host with its next scrape (an idle engine's
        // scrapes are up to 800 ms apart), then the filter from its next tick.
        let address = format!("127.0.0.1:{holder}");
        let written = || {
            let body = http_get_blocking(s.host_admin_port, "/v1/snapshot").unwrap_or_default();
            let snapshot: Value = serde_json::from_str(&body).unwrap_or_default();
            let endpoints = snapshot["endpoints"].as_array().cloned().unwrap_or_default();
            let e = endpoints.into_iter().find(|e| e["address"] == address.as_str());
            e.and_then(|e| e["kv_written_tokens"].as_u64()).unwrap_or(0)
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while written() < 8_000 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(written() >= 8_000, "the host should see the holder's writes: {}", written());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let matched = |s: &Stack| s.envoy_stat("wasmcustom.attache.prefix.blocks_matched");
        let hits = |port: u16| async move {
            let page = reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await.unwrap().text().await.unwrap();
            attache_kv::prom::engine_metrics(&page, attache_kv::Engine::Vllm).unwrap().prefix_cache_hits
        };
        let (matched_before, hits_before) = (matched(&s), hits(holder).await);
        let o = send(&s, &http, chat(&prefix, "q2", 1), &[]).await;
        assert!(o.ok(), "{}", o.body);
        // The worker adds its matched blocks to the counter from its tick.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let served_hits = if o.engine_port == Some(holder) { hits(holder).await - hits_before } else { 0.0 };
        (matched(&s) - matched_before, served_hits)
    }
    let (modelled, hits) = repeat_after_eviction("evicted-modelled", 0.9).await;
    assert_eq!(modelled, 0, "the index should know the holder evicted the prefix");
    assert!(hits < 200.0, "and the engine agrees: it hit {hits} tokens");
    let (unmodelled, hits) = repeat_after_eviction("evicted-unmodelled", 0.0).await;
    assert!(unmodelled > 0, "without the model the index still claims the prefix");
    assert!(hits < 200.0, "which the engine no longer holds: it hit {hits} tokens");
}

/// The expected hit is calibrated against the engine's own prefix-cache counters
/// ([`attache_policies::calibration`]): prompts a client warmed on the engine directly, out of
/// the gateway's sight, are believed cold yet hit. Over the second half of the run the filter's
/// calibrated expectation tracks the hit rate the engine reports, while its belief stays near 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expected_hit_is_calibrated_against_the_engines_counters() {
    let mut s = Stack::new("calibrated").expect("stack");
    s.start_sim(SimOpts { engines: 1, time_scale: 0.05, ..SimOpts::default() }).expect("sim");
    s.start_host().expect("host");
    let config = serde_json::json!({"role": "scheduler", "scheduler": {"max_body_bytes": 4_194_304}});
    s.start_envoy(EnvoyKind::Attache, &config, 1).expect("envoy");
    s.wait_snapshot(1, Duration::from_secs(20)).expect("snapshot");
    let http = fresh_client();
    let completion = |i: usize| {
        serde_json::json!({"model": MODEL, "prompt": format!("warmed {i} ").repeat(300), "max_tokens": 1})
            .to_string()
            .into_bytes()
    };
    let gateway = s.url("/v1/completions");
    let probe = client::post(&http, &gateway, completion(usize::MAX), &[]).await;
    assert!(probe.ok(), "{}", probe.body);
    let engine = format!("http://127.0.0.1:{}", probe.engine_port.expect("port"));
    let engine_counters = || async {
        let page = reqwest::get(format!("{engine}/metrics")).await.unwrap().text().await.unwrap();
        let m = attache_kv::prom::engine_metrics(&page, attache_kv::Engine::Vllm).unwrap();
        (m.prefix_cache_queries, m.prefix_cache_hits)
    };
    let filter = |s: &Stack| {
        let stats = s.envoy_stats();
        let get = |n: &str| attache_e2e::stats::stat_value(&stats, &format!("wasmcustom.attache.prefix.{n}")) as f64;
        (get("prompt_tokens"), get("believed_tokens"), get("expected_tokens"))
    };
    let mut marks = Vec::new();
    for i in 0..20 {
        if i == 10 {
            // The filter adds its sums from its tick.
            tokio::time::sleep(Duration::from_millis(300)).await;
            marks.push((filter(&s), engine_counters().await));
        }
        let warm = client::post(&http, &format!("{engine}/v1/completions"), completion(i), &[]).await;
        assert!(warm.ok(), "{}", warm.body);
        // The engine's counters reach the filter with its next scrape and snapshot.
        tokio::time::sleep(Duration::from_millis(250)).await;
        let o = client::post(&http, &gateway, completion(i), &[]).await;
        assert!(o.ok(), "{}", o.body);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    marks.push((filter(&s), engine_counters().await));
    let (((p0, b0, e0), (q0, h0)), ((p1, b1, e1), (q1, h1))) = (marks[0], marks[1]);
    let (prompt, believed, expected) = (p1 - p0, b1 - b0, e1 - e0);
    let engine_rate = (h1 - h0) / (q1 - q0);
    let (belief, calibrated) = (believed / prompt, expected / prompt);
    println!(
        "second half: engine hit rate {engine_rate:.3}, calibrated expectation {calibrated:.3}, belief {belief:.3}"
    );
    assert!(prompt > 5_000.0, "ten requests of about 1,000 tokens: {prompt}");
    assert!(belief < 0.05, "the gateway never saw the warm-up: {belief}");
    assert!(engine_rate > 0.3, "the warmed prompts hit: {engine_rate}");
    assert!((calibrated - engine_rate).abs() < 0.1, "calibrated {calibrated} against the engine's {engine_rate}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_destination_headers_are_ignored() {
    let s = attache_stack("spoof", small_pool());
    let http = fresh_client();
    let prefix = long_prefix("spoof");
    let first = send(&s, &http, chat(&prefix, "q", 2), &[]).await;
    let chosen = first.engine_port.expect("port");
    for other in s.engine_addrs().into_iter().filter(|a| !a.ends_with(&format!(":{chosen}"))) {
        let o = send(&s, &http, chat(&prefix, "q again", 2), &[("x-gateway-destination-endpoint", &other)]).await;
        assert!(o.ok(), "{}", o.body);
        assert_eq!(o.engine_port, Some(chosen), "a client header naming {other} must not steer the request");
    }
    let o = send(&s, &http, chat(&prefix, "q3", 2), &[("x-gateway-destination-endpoint", "10.9.9.9:80")]).await;
    assert_eq!((o.status, o.engine_port), (200, Some(chosen)));

    // A request the scheduler does not schedule (GET /health) still has the header stripped:
    // override_host then falls back to round-robin instead of obeying the client.
    let pinned = s.engine_addrs()[0].clone();
    let mut seen = HashSet::new();
    for _ in 0..8 {
        let r = http.get(s.url("/health")).header("x-gateway-destination-endpoint", &pinned).send().await.expect("get");
        assert_eq!(r.status(), 200);
        seen.insert(r.headers().get("x-inference-port").and_then(|v| v.to_str().ok()).unwrap_or("").to_string());
    }
    assert!(seen.len() > 1, "passthrough requests were pinned by the client header: {seen:?}");
}

fn assert_json_error(o: &attache_e2e::client::Outcome, status: u16, kind: &str) -> Value {
    assert_eq!(o.status, status, "body: {}", o.body);
    assert_eq!(o.header("content-type"), Some("application/json"));
    let v = o.json();
    assert_eq!(v["error"]["type"], kind, "body: {}", o.body);
    assert_eq!(v["error"]["code"], status);
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert!(o.header("x-attache-error").is_some(), "missing x-attache-error");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bodies_get_clear_errors_and_the_proxy_keeps_serving() {
    let s = attache_stack("badinput", small_pool());
    let http = fresh_client();
    let url = s.url("/v1/chat/completions");
    for body in [&b"{not json"[..], b"hello world", b"[1,2,3]", b"{\"model\": 5}"] {
        let o = client::post(&http, &url, body.to_vec(), &[]).await;
        assert_json_error(&o, 400, "BadRequestError");
    }
    let empty = client::post(&http, &url, Vec::new(), &[]).await;
    assert_json_error(&empty, 400, "BadRequestError");

    // Unknown model: 404 in OpenAI's error shape.
    let o = client::post(&http, &url, client::chat_body("no-such-model", "s", "u", 2), &[]).await;
    let v = assert_json_error(&o, 404, "NotFoundError");
    assert_eq!(v["error"]["param"], "model");
    assert!(v["error"]["message"].as_str().unwrap_or("").contains("no-such-model"));

    // Over the configured limit (4 MiB): 413, with content-length and with a chunked body.
    let big = serde_json::json!({"model": MODEL, "prompt": "x".repeat(5 << 20)}).to_string().into_bytes();
    let o = client::post(&http, &s.url("/v1/completions"), big.clone(), &[]).await;
    assert_json_error(&o, 413, "RequestEntityTooLargeError");
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = big.chunks(256 << 10).map(|c| Ok(c.to_vec())).collect();
    let r = http
        .post(s.url("/v1/completions"))
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await
        .expect("chunked post");
    assert_eq!(r.status(), 413);

    // And the proxy still serves good requests.
    let ok = send(&s, &http, chat("sys", "still fine?", 3), &[]).await;
    assert!(ok.ok() && ok.done, "{}", ok.body);
    let stats = s.envoy_stats();
    assert!(attache_e2e::stats::stat_value(&stats, "wasmcustom.attache.errors.malformed_body") >= 4, "{stats}");
    assert_eq!(
        attache_e2e::stats::stat_value(&stats, "wasm.attache_scheduler.vm_reload"),
        0,
        "the filter must never trap"
    );
}

/// Header values with bytes that are not UTF-8 (HTTP allows obs-text, 0x80-0xFF) in the headers
/// the filter reads: the SDK's text getter would trap the worker's VM on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_bytes_that_are_not_utf8_are_served_without_a_trap() {
    let s = attache_stack("odd-headers", small_pool());
    let http = fresh_client();
    let odd = reqwest::header::HeaderValue::from_bytes(b"agent-\xff\xfe-1").expect("obs-text is a valid value");
    let mut served = 0;
    for i in 0..6 {
        let r = http
            .post(s.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("x-session-id", odd.clone())
            .header("x-session-token", odd.clone())
            .body(chat(&long_prefix("odd"), &format!("turn {i}"), 2))
            .send()
            .await
            .expect("request");
        assert_eq!(r.status(), 200, "turn {i}: {:?}", r.text().await);
        served += 1;
    }
    assert_eq!(served, 6);
    // Scheduled by the filter (not passed through a reloaded VM), and no VM reloaded.
    let stats = s.envoy_stats_when("wasmcustom.attache.requests.scheduled", 6, Duration::from_secs(2));
    assert_eq!(attache_e2e::stats::stat_value(&stats, "wasmcustom.attache.requests.scheduled"), 6, "{stats}");
    let reloads: Vec<&str> = stats.lines().filter(|l| l.contains("attache_scheduler.vm_reload")).collect();
    assert!(!reloads.is_empty(), "Envoy shows the scheduler's reload counters:\n{stats}");
    assert!(reloads.iter().all(|l| l.ends_with(": 0")), "the filter trapped: {reloads:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_streams_pass_through_intact() {
    let s = attache_stack("sse", small_pool());
    let http = fresh_client();
    let o = send(&s, &http, chat("system", "stream please", 12), &[]).await;
    assert!(o.ok() && o.done, "{}", o.body);
    assert_eq!(o.header("content-type"), Some("text/event-stream; charset=utf-8"));
    let events: Vec<Value> = o.events.iter().map(|e| serde_json::from_str(e).expect("every event is JSON")).collect();
    // role chunk + 12 token chunks + usage chunk, then [DONE].
    assert_eq!(events.len(), 14, "{:#?}", o.events);
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(events[12]["choices"][0]["finish_reason"], "length");
    assert_eq!(events[13]["choices"], Value::Array(vec![]));
    assert_eq!(events[13]["usage"]["completion_tokens"], 12);
    assert_eq!(o.output_tokens, 12);
    let ids: HashSet<&str> = events.iter().filter_map(|e| e["id"].as_str()).collect();
    assert_eq!(ids.len(), 1);

    // The same request sent straight to that engine produces the same event shapes.
    let direct = client::post(
        &http,
        &format!("http://127.0.0.1:{}/v1/chat/completions", o.engine_port.expect("port")),
        chat("system", "stream please", 12),
        &[],
    )
    .await;
    assert_eq!(direct.events.len(), o.events.len());

    // Completions stream too.
    let body = serde_json::json!({"model": MODEL, "prompt": "abc", "max_tokens": 5, "stream": true}).to_string();
    let c = client::post(&http, &s.url("/v1/completions"), body.into_bytes(), &[]).await;
    assert!(c.ok() && c.done);
    assert_eq!(c.events.len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_streams_through_envoy() {
    // An independent wire check: the official `openai` client (installed in .venv by xtask).
    let s = attache_stack("openai", small_pool());
    let py = s.paths.root.join(".venv/bin/python");
    let script = r#"
import json, sys
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1], api_key="unused")
chunks = list(c.chat.completions.create(model="tinyllama", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=6, stream=True, stream_options={"include_usage": True}))
text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
r = c.completions.create(model="tinyllama", prompt="hello", max_tokens=3)
try:
    c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    err = None
except Exception as e:
    err = type(e).__name__
print(json.dumps({"chunks": len(chunks), "text": text, "usage": chunks[-1].usage.completion_tokens,
                  "completion": r.usage.completion_tokens, "unknown_model": err}))
"#;
    let out = std::process::Command::new(py).arg("-c").arg(script).arg(s.url("/v1")).output().expect("python");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["usage"], 6);
    assert_eq!(v["completion"], 3);
    assert!(v["text"].as_str().is_some_and(|t| !t.is_empty()));
    assert_eq!(v["unknown_model"], "NotFoundError");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_host_fails_no_request_and_a_restart_resumes_updates() {
    let mut s = attache_stack("failstatic", small_pool());
    let http = fresh_client();
    let url = s.url("/v1/chat/completions");
    // A bounded load loop: 4 workers x 60 requests, about 1.5 s, with the host killed early on.
    let mut load = Vec::new();
    for w in 0..4 {
        let http = http.clone();
        let url = url.clone();
        load.push(tokio::spawn(async move {
            let mut results = Vec::new();
            for i in 0..60 {
                let body = client::chat_body(MODEL, &format!("worker {w} context"), &format!("turn {i}"), 3);
                results.push((std::time::Instant::now(), client::post(&http, &url, body, &[]).await));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            results
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    s.kill_host();
    let killed_at = std::time::Instant::now();
    let (mut total, mut after_kill) = (0, 0);
    for l in load {
        for (sent, o) in l.await.expect("load task") {
            total += 1;
            after_kill += usize::from(sent > killed_at);
            assert!(
                o.ok() && o.done,
                "a request failed while the host was down: {} {:?} {}",
                o.status,
                o.error,
                o.body
            );
        }
    }
    assert_eq!(total, 240);
    assert!(after_kill > 100, "only {after_kill} requests were sent after the host died");

    // Restart the host with one engine removed; the filters must pick that up.
    let updates_before = s.envoy_stat("wasmcustom.attache.snapshot.updates");
    let addrs = s.engine_addrs();
    let (removed, kept) = addrs.split_last().expect("engines");
    s.write_endpoints(kept).expect("endpoints");
    s.start_host().expect("host restart");
    s.wait_snapshot(kept.len(), Duration::from_secs(20)).expect("snapshot after restart");
    let updates_after = s.envoy_stat("wasmcustom.attache.snapshot.updates");
    assert!(
        updates_after > updates_before,
        "snapshot updates {updates_before} -> {updates_after}:\n{}",
        s.envoy_stats().lines().filter(|l| l.contains("attache")).collect::<Vec<_>>().join("\n")
    );
    let removed_port: u16 = removed.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    for g in 0..12 {
        let o = send(&s, &http, chat(&long_prefix(&format!("after-restart-{g}")), "q", 2), &[]).await;
        assert!(o.ok(), "{}", o.body);
        assert_ne!(o.engine_port, Some(removed_port), "routed to an endpoint the restarted host removed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn original_dst_variant_routes_by_the_same_decisions() {
    let mut s = Stack::new("origdst").expect("stack");
    s.start_sim(small_pool()).expect("sim");
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::AttacheOriginalDst, &Stack::default_scheduler_config(), 2).expect("envoy");
    s.wait_snapshot(4, Duration::from_secs(20)).expect("snapshot");
    let http = fresh_client();
    let prefix = long_prefix("odst");
    let mut ports = HashSet::new();
    for q in 0..5 {
        let o = send(&s, &http, chat(&prefix, &format!("q{q}"), 2), &[]).await;
        assert!(o.ok(), "{}", o.body);
        ports.insert(o.engine_port);
    }
    assert_eq!(ports.len(), 1);
    let o = client::post(&http, &s.url("/v1/completions"), b"{oops".to_vec(), &[]).await;
    assert_eq!(o.status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_are_counted_in_envoy_prometheus_stats() {
    let s = attache_stack("stats", small_pool());
    let http = fresh_client();
    for g in 0..6 {
        let o = send(&s, &http, chat(&long_prefix(&format!("m{g}")), "q", 2), &[]).await;
        assert!(o.ok());
    }
    let _ = client::post(&http, &s.url("/v1/completions"), b"nope".to_vec(), &[]).await;
    // Per-request counters are added from the filters' tick.
    let _ = s.envoy_stats_when("wasmcustom.attache.requests.scheduled", 6, Duration::from_secs(2));
    let prom = http_get_blocking(s.envoy_admin_port, "/stats/prometheus").unwrap_or_default();
    let scheduled = prom
        .lines()
        .find(|l| l.starts_with("attache_requests_scheduled"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<u64>().ok());
    assert_eq!(scheduled, Some(6), "{prom}");
    let picks: u64 = prom
        .lines()
        .filter(|l| l.starts_with("attache_endpoint_picks{attache_endpoint="))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<u64>().ok()))
        .sum();
    assert_eq!(picks, 6, "per-endpoint pick counters with an endpoint label:\n{prom}");
    assert!(prom.contains("attache_errors_malformed_body"), "{prom}");
    assert!(prom.contains("attache_scorer_prefix_score_milli_bucket"), "per-scorer histograms");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_worker_streams_work_without_the_bootstrap_singleton() {
    let mut s = Stack::new("perworker").expect("stack");
    s.start_sim(small_pool()).expect("sim");
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::AttachePerWorker, &Stack::default_scheduler_config(), 2).expect("envoy");
    s.wait_snapshot(4, Duration::from_secs(20)).expect("snapshot");
    // Envoy's main thread plus its two workers each hold a snapshot stream (counted by the
    // host as open streams). A worker opens its stream at its first tick, which can come after
    // another worker's snapshot already reached the filters.
    let subscribers = || {
        http_get_blocking(s.host_admin_port, "/metrics")
            .and_then(|m| m.lines().find_map(|l| l.strip_prefix("attache_host_subscribers ")?.parse::<u64>().ok()))
            .unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while subscribers() < 3 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(subscribers(), 3, "one snapshot stream per worker plus the main thread");
    let http = fresh_client();
    let prefix = long_prefix("per-worker");
    let mut ports = HashSet::new();
    for q in 0..6 {
        let o = send(&s, &http, chat(&prefix, &format!("q{q}"), 2), &[]).await;
        assert!(o.ok(), "{}", o.body);
        ports.insert(o.engine_port);
    }
    assert_eq!(ports.len(), 1);
    // Fail-static holds in this mode too.
    s.kill_host();
    for q in 0..6 {
        let o = send(&s, &http, chat(&prefix, &format!("after {q}"), 2), &[]).await;
        assert!(o.ok(), "{}", o.body);
    }
}
