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
