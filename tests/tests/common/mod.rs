//! Helpers shared by the end-to-end test files.

#![allow(dead_code)]

use std::time::Duration;

use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::client::{self, Outcome};
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use serde_json::{json, Value};

pub const MODEL: &str = "tinyllama";

/// Simulator, host and Envoy (Attaché, override_host) on fresh ports, with the filters holding
/// a snapshot in which every engine is ready.
pub fn attache_stack(name: &str, opts: SimOpts) -> Stack {
    let mut s = Stack::new(name).expect("stack");
    start_attache(&mut s, opts);
    s
}

/// Start the simulator, the host and Envoy with Attaché on a stack the caller has configured
/// (host policy, scorer slots, labels), and wait until the filters have every engine.
pub fn start_attache(s: &mut Stack, opts: SimOpts) {
    let engines = usize::from(opts.engines);
    s.start_sim(opts).expect("sim");
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2).expect("envoy");
    s.wait_snapshot(engines, Duration::from_secs(20)).expect("snapshot");
}

pub fn small_pool() -> SimOpts {
    SimOpts { engines: 4, time_scale: 0.05, ..SimOpts::default() }
}

/// A client that opens a new connection per request, so requests spread over Envoy's workers.
pub fn fresh_client() -> reqwest::Client {
    reqwest::Client::builder().pool_max_idle_per_host(0).build().expect("client")
}

pub fn chat(system: &str, user: &str, max_tokens: u64) -> Vec<u8> {
    client::chat_body(MODEL, system, user, max_tokens)
}

pub async fn send(s: &Stack, http: &reqwest::Client, body: Vec<u8>, headers: &[(&str, &str)]) -> Outcome {
    client::post(http, &s.url("/v1/chat/completions"), body, headers).await
}

/// A long shared prefix (about 2,000 pseudo-tokens).
pub fn long_prefix(tag: &str) -> String {
    format!("{tag}: ").to_string() + &"You are a careful assistant. Follow the operating manual exactly. ".repeat(120)
}

/// Poll the host's snapshot (every 50 ms, up to 10 s) until the engine on `port` reports at
/// least `at_least` waiting requests; returns the last figure seen.
pub async fn wait_for_queue(s: &Stack, port: u16, at_least: f64) -> f64 {
    wait_for_queue_at(s, &format!("127.0.0.1:{port}"), at_least).await
}

/// [`wait_for_queue`] for the engine at `address` (`ip:port`).
pub async fn wait_for_queue_at(s: &Stack, address: &str, at_least: f64) -> f64 {
    let mut waiting = 0.0;
    for _ in 0..200 {
        if let Some(b) = http_get_blocking(s.host_admin_port, "/v1/snapshot") {
            let v: serde_json::Value = serde_json::from_str(&b).unwrap_or(serde_json::Value::Null);
            waiting = v["endpoints"]
                .as_array()
                .and_then(|a| a.iter().find(|e| e["address"] == address))
                .and_then(|e| e["waiting"].as_f64())
                .unwrap_or(0.0);
            if waiting >= at_least {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    waiting
}

/// Wait until Envoy's filter has the host's current snapshot (or 5 s pass), then one worker
/// refresh more: what the host shows is then what the next request is routed on.
pub async fn wait_for_filter_snapshot(s: &Stack) {
    let Some(version) = http_get_blocking(s.host_admin_port, "/v1/snapshot")
        .and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok())
        .and_then(|v| v["version"].as_u64())
    else {
        return;
    };
    for _ in 0..100 {
        if s.envoy_stat("wasmcustom.attache.snapshot.version") >= version {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Workers take a newer snapshot at their next tick (20 ms) or request (after 40 ms).
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Send `n` completions of `max_tokens` each straight to the engine on `port` (bypassing
/// Envoy), to give it running and waiting requests; abort the handles to end them.
pub fn load_engine(
    http: &reqwest::Client,
    port: u16,
    n: usize,
    max_tokens: u64,
) -> Vec<tokio::task::JoinHandle<Outcome>> {
    load_engine_at(http, &format!("127.0.0.1:{port}"), n, max_tokens)
}

/// [`load_engine`] for the engine at `address` (`ip:port`).
pub fn load_engine_at(
    http: &reqwest::Client,
    address: &str,
    n: usize,
    max_tokens: u64,
) -> Vec<tokio::task::JoinHandle<Outcome>> {
    let url = format!("http://{address}/v1/completions");
    (0..n)
        .map(|i| {
            let (http, url) = (http.clone(), url.clone());
            let body = serde_json::json!({"model": MODEL, "prompt": format!("load {i}"), "max_tokens": max_tokens});
            tokio::spawn(async move { client::post(&http, &url, body.to_string().into_bytes(), &[]).await })
        })
        .collect()
}

/// Wait until the host's index says some endpoint holds `blocks` blocks of `tokens`.
pub async fn wait_indexed(s: &Stack, tokens: &[u32], blocks: u64) {
    let url = format!("http://127.0.0.1:{}/v1/kv/match", s.host_admin_port);
    let body = json!({"model": MODEL, "token_ids": tokens, "block_size": 16}).to_string();
    for _ in 0..100 {
        let o = client::post(&s.http, &url, body.clone().into_bytes(), &[]).await;
        let v = o.json();
        if v["endpoints"].as_array().is_some_and(|a| a.iter().any(|e| e["matched_blocks"].as_u64() >= Some(blocks))) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the host never indexed the blocks");
}

pub fn reference(path: &str) -> std::path::PathBuf {
    attache_fixtures::vllm(path)
}

/// Filter configuration with the reference model's tokenizer and one start-up check taken
/// from the real vLLM's `/tokenize` capture (or a wrong one, to see it refused).
pub fn tokenizer_config(correct_check: bool) -> Value {
    let json = std::fs::read_to_string(reference("model/tokenizer.json")).expect("reference tokenizer");
    let caps: Value =
        serde_json::from_str(&std::fs::read_to_string(reference("http/prompts-tokenized.json")).unwrap()).unwrap();
    let cap = &caps["shared_0"];
    let mut ids = cap["tokenize_response"]["tokens"].clone();
    if !correct_check {
        ids[3] = json!(7);
    }
    let chat: Value =
        serde_json::from_str(&std::fs::read_to_string(reference("http/chat-prompt-tokenized.json")).unwrap()).unwrap();
    json!({"role": "scheduler", "scheduler": {"precise": {
        "enabled": true,
        "tokenizer_json": json,
        "chat_template": std::fs::read_to_string(reference("model/chat_template.jinja")).unwrap(),
        "bos_token": "<s>",
        "eos_token": "</s>",
        "tokenizer_check": [
            {"text": cap["prompt"], "ids": ids},
            {"messages": chat["messages"], "ids": chat["tokenize_response"]["tokens"]},
        ],
    }}})
}

/// Four engines with KV events and the reference tokenizer and chat template; the filter
/// tokenizes with the same (`correct_check`: its start-up check matches the engine).
pub async fn text_stack(name: &str, correct_check: bool) -> Stack {
    let mut s = Stack::new(name).expect("stack");
    let opts = SimOpts {
        engines: 4,
        time_scale: 0.05,
        kv_events: true,
        tokenizer: Some(reference("model/tokenizer.json")),
        chat_template: Some(reference("model/chat_template.jinja")),
        ..SimOpts::default()
    };
    s.start_sim(opts).expect("sim");
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &tokenizer_config(correct_check), 2).expect("envoy");
    s.wait_snapshot(4, Duration::from_secs(20)).expect("snapshot");
    s
}
