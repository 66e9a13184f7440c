//! LoRA affinity through the real Envoy 1.40: engines report their adapters in
//! `vllm:lora_requests_info` (simulated: one active adapter per engine), the host pushes them,
//! and the scheduler prefers llm-d's tiers: adapter running > free slot > adapter waiting > none.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::time::Duration;

use attache_e2e::{EnvoyKind, SimOpts, Stack};
use common::*;
use serde_json::json;

fn body(model: &str, text: &str, max_tokens: u64) -> Vec<u8> {
    json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
        .to_string()
        .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_prefer_engines_with_their_adapter_then_a_free_slot() {
    let mut s = Stack::new("lora-tiers").expect("stack");
    let opts = SimOpts {
        engines: 3,
        time_scale: 1.0,
        lora_modules: vec!["sql".into(), "tweet".into(), "chat".into()],
        max_loras: 1,
        ..SimOpts::default()
    };
    s.start_sim(opts).expect("sim");
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2).expect("envoy");
    s.wait_snapshot(3, Duration::from_secs(20)).expect("snapshot");
    let addrs = s.engine_addrs();
    let port = |i: usize| addrs[i].rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
    // Engine 0 runs `sql`, engine 1 runs `tweet` (long requests sent straight to them), engine 2
    // has its one adapter slot free.
    let mut load = Vec::new();
    for (i, adapter) in [(0usize, "sql"), (1, "tweet")] {
        let url = format!("http://{}/v1/chat/completions", addrs[i]);
        load.push(tokio::spawn(async move {
            attache_e2e::client::post(&fresh_client(), &url, body(adapter, "a long job", 3000), &[]).await
        }));
    }
    let url = format!("http://127.0.0.1:{}/v1/snapshot", s.host_admin_port);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let snap: serde_json::Value = reqwest::get(&url).await.unwrap().json().await.unwrap();
        let running: Vec<String> = snap["endpoints"]
            .as_array()
            .map(|a| a.iter().map(|e| e["lora_running"].to_string()).collect())
            .unwrap_or_default();
        if running.iter().filter(|r| r.contains("sql") || r.contains("tweet")).count() == 2 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the host never saw the adapters: {snap}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.wait_snapshot(3, Duration::from_secs(5)).expect("the filters have that snapshot");
    let http = fresh_client();
    for k in 0..4 {
        // Running adapter: 1.0 on its engine, 0.8 on the free one, 0 on the full one.
        let o = send(&s, &http, body("sql", &format!("query {k}"), 4), &[]).await;
        assert!(o.ok(), "{}", o.body);
        assert_eq!(o.engine_port, port(0), "sql goes where sql runs");
        let o = send(&s, &http, body("tweet", &format!("tweet {k}"), 4), &[]).await;
        assert_eq!(o.engine_port, port(1), "tweet goes where tweet runs");
        // Not running anywhere: the engine with a free slot, not the two whose slot is taken
        // (they would make it wait).
        let o = send(&s, &http, body("chat", &format!("hello {k}"), 4), &[]).await;
        assert!(o.ok(), "{}", o.body);
        assert_eq!(o.engine_port, port(2), "chat goes to the free slot");
    }
    for l in load {
        l.abort();
    }
}

/// An adapter loaded at run time (vLLM's `POST /v1/load_lora_adapter`) appears in that engine's
/// `GET /v1/models` with its base model as `parent`; the host reads the list, and requests for
/// the adapter route to that engine instead of 404; unloaded, it is refused again. Declared models (the endpoints file, here
/// only the base model) are what Kubernetes discovery knows; the adapter is not among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_loaded_at_run_time_routes_to_its_engine() {
    let mut s = Stack::new("lora-runtime").expect("stack");
    s.host_extra = Some(json!({"models_interval_ms": 200}));
    s.start_sim(SimOpts { engines: 3, ..SimOpts::default() }).expect("sim");
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2).expect("envoy");
    s.wait_snapshot(3, Duration::from_secs(20)).expect("snapshot");
    let http = fresh_client();

    let o = send(&s, &http, body("sql-lora", "select 1", 4), &[]).await;
    assert_eq!(o.status, 404, "no engine has the adapter yet: {}", o.body);
    assert_eq!(o.header("x-attache-error"), Some("unknown_model"), "refused by the scheduler: {}", o.body);

    let addrs = s.engine_addrs();
    let engine = &addrs[1];
    let loaded = http
        .post(format!("http://{engine}/v1/load_lora_adapter"))
        .json(&json!({"lora_name": "sql-lora", "lora_path": "/adapters/sql"}))
        .send()
        .await
        .expect("load_lora_adapter");
    assert_eq!(loaded.status(), 200);
    let listed: serde_json::Value =
        http.get(format!("http://{engine}/v1/models")).send().await.unwrap().json().await.unwrap();
    assert!(
        listed["data"].as_array().unwrap().iter().any(|m| m["id"] == "sql-lora" && m["parent"] == MODEL),
        "{listed}"
    );

    // The host's next read of the list reaches the filters.
    let url = format!("http://127.0.0.1:{}/v1/snapshot", s.host_admin_port);
    let started = std::time::Instant::now();
    loop {
        let snap: serde_json::Value = reqwest::get(&url).await.unwrap().json().await.unwrap();
        let serving: Vec<String> = snap["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["models"].as_array().is_some_and(|m| m.iter().any(|x| x == "sql-lora")))
            .map(|e| e["address"].as_str().unwrap_or_default().to_owned())
            .collect();
        if !serving.is_empty() {
            assert_eq!(serving, std::slice::from_ref(engine), "only the engine that loaded it serves it");
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "the host never listed the adapter: {snap}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.wait_snapshot(3, Duration::from_secs(5)).expect("the filters have that snapshot");
    let port = engine.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
    for k in 0..6 {
        let o = send(&s, &http, body("sql-lora", &format!("query {k}"), 4), &[]).await;
        assert!(o.ok(), "{} {}", o.status, o.body);
        assert_eq!(o.engine_port, port, "the adapter's requests go to the engine that loaded it");
    }
    // The gateway's own /v1/models is the pool's union, from the snapshot: the base model and
    // the adapter (with its parent), though only one engine has the adapter.
    let listed: serde_json::Value = http.get(s.url("/v1/models")).send().await.unwrap().json().await.unwrap();
    let ids: Vec<(&str, &serde_json::Value)> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap_or_default(), &m["parent"]))
        .collect();
    assert_eq!(ids, [(MODEL, &json!(null)), ("sql-lora", &json!(MODEL))], "{listed}");
    assert!(s.envoy_stat("wasmcustom.attache.requests.model_list") >= 1, "answered by the filter");
    // Unloaded, it is gone from the list, and its requests are refused again (404), not sent to
    // an engine that no longer has it.
    let unloaded = http
        .post(format!("http://{engine}/v1/unload_lora_adapter"))
        .json(&json!({"lora_name": "sql-lora"}))
        .send()
        .await
        .expect("unload_lora_adapter");
    assert_eq!(unloaded.status(), 200);
    // Until the host's next read of the list, the engine itself answers 404.
    let started_unload = std::time::Instant::now();
    let mut engine_404 = 0;
    loop {
        let o = send(&s, &http, body("sql-lora", "select 2", 4), &[]).await;
        assert_eq!(o.status, 404, "{}", o.body);
        if o.header("x-attache-error") == Some("unknown_model") {
            break;
        }
        engine_404 += 1;
        assert!(started_unload.elapsed() < Duration::from_secs(10), "the unloaded adapter is still routed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "unloaded adapter: refused by the scheduler after {:?} ({engine_404} engine 404s before)",
        started_unload.elapsed()
    );
    let listed: serde_json::Value = http.get(s.url("/v1/models")).send().await.unwrap().json().await.unwrap();
    assert_eq!(listed["data"].as_array().map(Vec::len), Some(1), "the unloaded adapter is no longer listed: {listed}");
    let metrics = attache_e2e::admin_http::http_get_blocking(s.host_admin_port, "/metrics").unwrap_or_default();
    assert!(metrics.contains("attache_host_model_list_reads_total{outcome=\"ok\"}"), "model-list reads are counted");
    println!("runtime adapter: listed by the host {:?} after loading; 6/6 routed to its engine", started.elapsed());
}
