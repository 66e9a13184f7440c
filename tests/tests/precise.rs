//! End-to-end precise prefix routing: simulated engines publish KV events over ZMQ, the host
//! indexes them and streams the index to the filters, and the filter in the real Envoy 1.40
//! routes a request to the engine that actually holds its prefix, with no routing history.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::time::Duration;

use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::client;
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use common::*;
use serde_json::{json, Value};

fn precise_config() -> Value {
    json!({"role": "scheduler", "scheduler": {"precise": {"enabled": true}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_to_the_engine_that_holds_their_blocks() {
    let mut s = Stack::new("precise").expect("stack");
    s.start_sim(SimOpts { engines: 4, time_scale: 0.05, kv_events: true, ..SimOpts::default() }).expect("sim");
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &precise_config(), 2).expect("envoy");
    s.wait_snapshot(4, Duration::from_secs(20)).expect("snapshot");
    let http = fresh_client();
    let engines = s.engine_addrs();

    // Three long token prompts, each cached directly on a different engine (bypassing Envoy, so
    // Attaché's approximate index has never seen them).
    let prompts: Vec<(Vec<u32>, usize)> =
        (0..3u32).map(|g| ((0..640u32).map(|t| 1000 + g * 10_000 + t).collect(), (g as usize + 1) % 4)).collect();
    for (tokens, engine) in &prompts {
        let body = json!({"model": MODEL, "prompt": tokens, "max_tokens": 1}).to_string();
        let o =
            client::post(&http, &format!("http://{}/v1/completions", engines[*engine]), body.into_bytes(), &[]).await;
        assert!(o.ok(), "{}", o.body);
        wait_indexed(&s, tokens, 40).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await; // index deltas reach the filters

    for (tokens, engine) in &prompts {
        let want: u16 = engines[*engine].rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
        for variant in 0..3u32 {
            // The cached prompt plus a different suffix each time.
            let mut t = tokens.clone();
            t.extend((0..20).map(|i| 50_000 + variant * 100 + i));
            let body = json!({"model": MODEL, "prompt": t, "max_tokens": 2}).to_string();
            let o = client::post(&http, &s.url("/v1/completions"), body.into_bytes(), &[]).await;
            assert!(o.ok(), "{}", o.body);
            assert_eq!(o.engine_port, Some(want), "prefix cached on :{want} was routed elsewhere");
            // The engine confirms it reused the cache.
            assert!(o.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() >= Some(600), "{}", o.body);
        }
    }
    let stats = s.envoy_stats();
    assert!(
        attache_e2e::stats::stat_value(&stats, "wasmcustom.attache.precise.index_entries_applied") >= 120,
        "{stats}"
    );
    let kv = http_get_blocking(s.host_admin_port, "/v1/kv").unwrap_or_default();
    let kv: Value = serde_json::from_str(&kv).unwrap_or(Value::Null);
    assert_eq!(kv["subscribers"]["decode_errors"], 0, "{kv}");
}

fn text_prompt(g: usize) -> String {
    format!("Document {g}. ")
        + &"The scheduler routes each request to the engine that already holds its prefix. ".repeat(30)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_prompts_are_tokenized_in_the_filter_like_the_engine_does() {
    let s = text_stack("precise-text", true).await;
    let http = fresh_client();
    let engines = s.engine_addrs();
    let json = std::fs::read_to_string(reference("model/tokenizer.json")).unwrap();
    let mut tk = attache_policies::tokenizer::Tokenizer::from_json(json.as_bytes()).unwrap();
    for g in 0..3 {
        let text = text_prompt(g);
        let body = json!({"model": MODEL, "prompt": text, "max_tokens": 1}).to_string();
        let o = client::post(&http, &format!("http://{}/v1/completions", engines[g + 1]), body.into_bytes(), &[]).await;
        assert!(o.ok(), "{}", o.body);
        let ids = tk.encode(&text, true, 0);
        wait_indexed(&s, &ids, (ids.len() / 16) as u64).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for g in 0..3 {
        let want: u16 = engines[g + 1].rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
        for q in 0..2 {
            let body = json!({"model": MODEL, "prompt": format!("{} Question {q}?", text_prompt(g)), "max_tokens": 2});
            let o = client::post(&http, &s.url("/v1/completions"), body.to_string().into_bytes(), &[]).await;
            assert!(o.ok(), "{}", o.body);
            assert_eq!(o.engine_port, Some(want), "text prompt {g} cached on :{want} was routed elsewhere");
        }
    }
    assert_eq!(s.envoy_stat("wasmcustom.attache.precise.tokenizer_unusable"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenizer_that_disagrees_with_the_engine_is_not_used() {
    let s = text_stack("precise-badtok", false).await;
    assert!(s.envoy_stat("wasmcustom.attache.precise.tokenizer_unusable") >= 1, "the failed check must be counted");
    // Requests are still served (routed without precise scores for text).
    let o = client::post(
        &fresh_client(),
        &s.url("/v1/completions"),
        json!({"model": MODEL, "prompt": text_prompt(9), "max_tokens": 2}).to_string().into_bytes(),
        &[],
    )
    .await;
    assert!(o.ok(), "{}", o.body);
}

/// Chat requests: the filter renders the model's chat template and tokenizes the result as vLLM
/// does, so a conversation whose rendered prefix an engine holds goes to that engine. The
/// simulator's `/tokenize` of the captured chat messages equals the real vLLM's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_prompts_are_rendered_with_the_chat_template_like_the_engine_does() {
    let s = text_stack("precise-chat", true).await;
    let http = fresh_client();
    let engines = s.engine_addrs();

    let cap: Value =
        serde_json::from_str(&std::fs::read_to_string(reference("http/chat-prompt-tokenized.json")).unwrap()).unwrap();
    let body = json!({"model": MODEL, "messages": cap["messages"]}).to_string();
    let o = client::post(&http, &format!("http://{}/tokenize", engines[0]), body.into_bytes(), &[]).await;
    assert!(o.ok(), "{}", o.body);
    assert_eq!(o.json()["tokens"], cap["tokenize_response"]["tokens"], "simulator /tokenize differs from vLLM's");

    let conversation = |g: usize, q: &str| {
        json!([
            {"role": "system", "content": text_prompt(g)},
            {"role": "user", "content": q},
        ])
    };
    for g in 0..3 {
        let body = json!({"model": MODEL, "messages": conversation(g, "First?"), "max_tokens": 1}).to_string();
        let url = format!("http://{}/v1/chat/completions", engines[g + 1]);
        let o = client::post(&http, &url, body.into_bytes(), &[]).await;
        assert!(o.ok(), "{}", o.body);
        let tok = json!({"model": MODEL, "messages": conversation(g, "First?")}).to_string();
        let ids = client::post(&http, &format!("http://{}/tokenize", engines[0]), tok.into_bytes(), &[]).await.json()
            ["tokens"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_u64().map(|x| x as u32)).collect::<Vec<_>>())
            .unwrap_or_default();
        assert!(ids.len() > 300, "rendered conversation too short: {}", ids.len());
        wait_indexed(&s, &ids, (ids.len() / 16) as u64).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for g in 0..3 {
        let want: u16 = engines[g + 1].rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
        for q in ["Second?", "And a third, longer question?"] {
            let body = json!({"model": MODEL, "messages": conversation(g, q), "max_tokens": 2}).to_string();
            let o = client::post(&http, &s.url("/v1/chat/completions"), body.into_bytes(), &[]).await;
            assert!(o.ok(), "{}", o.body);
            assert_eq!(o.engine_port, Some(want), "conversation {g} cached on :{want} was routed elsewhere");
            assert!(o.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() >= Some(300), "{}", o.body);
        }
    }
    assert_eq!(s.envoy_stat("wasmcustom.attache.precise.tokenizer_unusable"), 0);
    assert_eq!(s.envoy_stat("wasmcustom.attache.precise.prompt_untokenized"), 0);
}

/// Tier awareness: engine X's GPU cache is flushed by other work so the prefix survives only in
/// X's CPU-offload tier (the host's index shows it there and nowhere else); a request with that
/// prefix still goes to X, which reloads the blocks instead of recomputing them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_held_only_in_a_cpu_tier_is_routed_to_that_engine() {
    let mut s = Stack::new("precise-cpu").expect("stack");
    let opts = SimOpts {
        engines: 4,
        time_scale: 0.05,
        kv_events: true,
        num_gpu_blocks: 96,
        num_cpu_blocks: 1024,
        ..SimOpts::default()
    };
    s.start_sim(opts).expect("sim");
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &precise_config(), 2).expect("envoy");
    s.wait_snapshot(4, Duration::from_secs(20)).expect("snapshot");
    let http = fresh_client();
    let engines = s.engine_addrs();
    let x = 2;
    let direct = |e: usize, tokens: &[u32]| {
        let body = json!({"model": MODEL, "prompt": tokens, "max_tokens": 1}).to_string();
        let url = format!("http://{}/v1/completions", engines[e]);
        let http = http.clone();
        async move { client::post(&http, &url, body.into_bytes(), &[]).await }
    };
    let prefix: Vec<u32> = (0..640u32).map(|t| 7000 + t).collect();
    assert!(direct(x, &prefix).await.ok());
    wait_indexed(&s, &prefix, 40).await;
    // Other work on X reuses every GPU block: the prefix moves to X's CPU tier.
    for g in 0..4u32 {
        let other: Vec<u32> = (0..1200u32).map(|t| 20_000 + g * 2000 + t).collect();
        assert!(direct(x, &other).await.ok());
    }
    let url = format!("http://127.0.0.1:{}/v1/kv/match", s.host_admin_port);
    let body = json!({"model": MODEL, "token_ids": prefix, "block_size": 16}).to_string();
    let mut m = Value::Null;
    for _ in 0..100 {
        m = client::post(&s.http, &url, body.clone().into_bytes(), &[]).await.json();
        let eps = m["endpoints"].as_array().cloned().unwrap_or_default();
        let cpu_only = eps.len() == 1
            && eps[0]["matched_blocks"].as_u64() == Some(40)
            && eps[0]["tiers"].as_array().is_some_and(|t| t.iter().all(|b| b == 2));
        if cpu_only {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let eps = m["endpoints"].as_array().cloned().unwrap_or_default();
    assert_eq!(eps.len(), 1, "only X may hold the prefix: {m}");
    assert_eq!(eps[0]["address"], json!(engines[x]), "{m}");
    assert!(eps[0]["tiers"].as_array().is_some_and(|t| t.len() == 40 && t.iter().all(|b| b == 2)), "not CPU-only: {m}");
    tokio::time::sleep(Duration::from_millis(200)).await; // index deltas reach the filters

    let want: u16 = engines[x].rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    let mut t = prefix.clone();
    t.extend(60_000..60_020);
    let body = json!({"model": MODEL, "prompt": t, "max_tokens": 2}).to_string();
    let o = client::post(&http, &s.url("/v1/completions"), body.into_bytes(), &[]).await;
    assert!(o.ok(), "{}", o.body);
    assert_eq!(o.engine_port, Some(want), "prefix held in X's CPU tier was routed elsewhere");
    assert!(o.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() >= Some(624), "{}", o.body);
    // The engine reloaded the blocks from its CPU tier (vLLM counts connector hits as external).
    let metrics = http_get_blocking(want, "/metrics").unwrap_or_default();
    let reloaded = metrics
        .lines()
        .find(|l| l.starts_with("vllm:external_prefix_cache_hits_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(reloaded >= 624.0, "no CPU reload on X: {reloaded}");
}
