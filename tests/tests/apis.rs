//! Every inference API vLLM serves, scheduled through the real Envoy 1.40 with Attaché:
//! - Anthropic's Messages API, with the official `anthropic` Python client (plain, streamed,
//!   a tool-use round trip, `count_tokens`, refusals in Anthropic's error shape);
//! - precise routing of Messages conversations: for random conversations (system blocks with
//!   Claude Code's billing header, tools, tool use and results, multi-byte text) the ids the
//!   filter computes are the engine's, block for block;
//! - token-in `/inference/v1/generate`: a group's samples land on the prompt's holder, with no
//!   tokenizer in the filter;
//! - utility routes (`/tokenize`, `/detokenize`, `count_tokens`) go by load alone, counted per
//!   route.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use attache_e2e::client;
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use attache_policies::prompt_tokens::PromptTokenizer;
use attache_policies::request::{self, Api};
use attache_policies::rng::SplitMix64;
use common::*;
use serde_json::{json, Value};

/// An approximate-mode stack whose Messages sessions are keyed by `metadata.user_id`, with a
/// small body limit (to see a 413 in Anthropic's shape).
fn messages_stack(name: &str) -> Stack {
    let mut s = Stack::new(name).expect("stack");
    s.start_sim(small_pool()).expect("sim");
    s.start_host().expect("host");
    let cfg = json!({"role": "scheduler", "scheduler": {"max_body_bytes": 65_536},
                     "sessions": {"messages_user_id": true}});
    s.start_envoy(EnvoyKind::Attache, &cfg, 2).expect("envoy");
    s.wait_snapshot(4, Duration::from_secs(20)).expect("snapshot");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_anthropic_client_works_through_the_gateway() {
    let s = messages_stack("anthropic");
    let py = s.paths.root.join(".venv/bin/python");
    let script = r##"
import json, sys
import anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="unused", max_retries=0)
system = [{"type": "text", "text": "You are a coding agent. " + "Follow the repository's conventions. " * 40}]
tools = [{"name": "read_file", "description": "Read a file", "input_schema": {"type": "object",
          "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
out = {}
raw = c.messages.with_raw_response.create(model="tinyllama", max_tokens=6, system=system,
        messages=[{"role": "user", "content": "Say hi"}], metadata={"user_id": "user-7"})
m = raw.parse()
out["plain"] = {"type": m.type, "role": m.role, "text": m.content[0].text, "stop": m.stop_reason,
                "output": m.usage.output_tokens, "engine": raw.headers.get("x-inference-port")}
with c.messages.stream(model="tinyllama", max_tokens=5, system=system,
                       messages=[{"role": "user", "content": "Stream please"}]) as st:
    text = "".join(st.text_stream)
    final = st.get_final_message()
out["stream"] = {"text": text, "stop": final.stop_reason, "output": final.usage.output_tokens}
raw = c.messages.with_raw_response.create(model="tinyllama", max_tokens=8, system=system, tools=tools,
        tool_choice={"type": "tool", "name": "read_file"}, metadata={"user_id": "user-9"},
        messages=[{"role": "user", "content": "Open the README"}])
first = raw.parse()
call = first.content[0]
raw2 = c.messages.with_raw_response.create(model="tinyllama", max_tokens=6, system=system, tools=tools,
        metadata={"user_id": "user-9"},
        messages=[{"role": "user", "content": "Open the README"},
                  {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": "# Attaché\nAn inference scheduler."}]}])
second = raw2.parse()
out["tools"] = {"first_type": call.type, "name": call.name, "stop": first.stop_reason,
                "second_type": second.content[0].type, "second_stop": second.stop_reason,
                "engines": [raw.headers.get("x-inference-port"), raw2.headers.get("x-inference-port")]}
n = c.messages.count_tokens(model="tinyllama", system=system, messages=[{"role": "user", "content": "Say hi"}])
out["count"] = n.input_tokens
for name, kwargs in [("unknown_model", {"model": "nope"}), ("no_messages", {"model": "tinyllama", "messages": []})]:
    try:
        args = {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
        args.update(kwargs)
        c.messages.create(**args)
        out[name] = None
    except anthropic.APIStatusError as e:
        out[name] = {"class": type(e).__name__, "status": e.status_code, "body": e.body}
print(json.dumps(out))
"##;
    let out = std::process::Command::new(py).arg("-c").arg(script).arg(s.url("")).output().expect("python");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    println!("anthropic client: {v}");
    let plain = &v["plain"];
    assert_eq!((plain["type"].as_str(), plain["role"].as_str()), (Some("message"), Some("assistant")));
    assert_eq!(plain["output"], 6);
    assert_eq!(plain["stop"], "max_tokens");
    assert!(plain["text"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(plain["engine"].is_string(), "served by an engine: {plain}");
    assert_eq!(v["stream"]["output"], 5);
    assert!(v["stream"]["text"].as_str().is_some_and(|t| !t.is_empty()), "{}", v["stream"]);
    let tools = &v["tools"];
    assert_eq!((tools["first_type"].as_str(), tools["name"].as_str()), (Some("tool_use"), Some("read_file")));
    assert_eq!(tools["stop"], "tool_use");
    assert_eq!(tools["second_type"], "text");
    let engines = tools["engines"].as_array().unwrap();
    assert_eq!(engines[0], engines[1], "the tool result went to the engine holding the conversation");
    assert!(v["count"].as_u64().is_some_and(|n| n > 100), "count_tokens: {}", v["count"]);
    let unknown = &v["unknown_model"];
    assert_eq!((unknown["class"].as_str(), unknown["status"].as_u64()), (Some("NotFoundError"), Some(404)));
    assert_eq!(unknown["body"]["type"], "error", "Anthropic's error shape: {unknown}");
    assert_eq!(unknown["body"]["error"]["type"], "not_found_error");
    let bad = &v["no_messages"];
    assert_eq!((bad["class"].as_str(), bad["status"].as_u64()), (Some("BadRequestError"), Some(400)));
    assert_eq!(bad["body"]["error"]["type"], "invalid_request_error", "{bad}");
    assert!(bad["body"]["error"]["message"].as_str().is_some_and(|m| m.contains("messages")), "{bad}");

    // Every refusal on the Messages routes has Anthropic's shape, its status and its reason.
    let http = fresh_client();
    let url = s.url("/v1/messages");
    let big = json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x".repeat(70_000)}]});
    for (body, status, kind, reason) in [
        (b"{not json".to_vec(), 400, "invalid_request_error", "malformed_body"),
        (big.to_string().into_bytes(), 413, "request_too_large", "body_too_large"),
        (
            json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "robot", "content": "x"}]})
                .to_string()
                .into_bytes(),
            400,
            "invalid_request_error",
            "invalid_field",
        ),
    ] {
        let o = client::post(&http, &url, body, &[]).await;
        assert_eq!((o.status, o.header("x-attache-error")), (status, Some(reason)), "{}", o.body);
        let e = o.json();
        assert_eq!((e["type"].as_str(), e["error"]["type"].as_str()), (Some("error"), Some(kind)), "{}", o.body);
    }
    assert!(s.envoy_stat("wasmcustom.attache.requests.api.messages") >= 5);
    assert!(s.envoy_stat("wasmcustom.attache.requests.api.count_tokens") >= 1);
}

/// Words for random conversations, with multi-byte UTF-8.
const WORDS: [&str; 16] = [
    "cache", "engine", "é", "中文", "🎉", "naïve", "Grüße", "Ωmega", "route", "block", "tool", "patch", "diff",
    "header", "token", "prefix",
];

fn words(rng: &mut SplitMix64, n: usize) -> String {
    (0..n).map(|_| WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]).collect::<Vec<_>>().join(" ")
}

fn pick(rng: &mut SplitMix64, n: u64) -> u64 {
    rng.next_u64() % n
}

/// A random Messages conversation: system as a string or blocks (sometimes led by Claude
/// Code's billing header), 0-2 tools, turns with text blocks (some empty), tool use and tool
/// results (string or list content, sometimes followed by text), ending on a user turn.
fn random_conversation(rng: &mut SplitMix64, tag: usize) -> Value {
    let head = format!("Conversation {tag}. {}", words(rng, 120));
    let system = if pick(rng, 2) == 0 {
        json!(head)
    } else {
        let mut blocks = Vec::new();
        if pick(rng, 2) == 0 {
            blocks.push(
                json!({"type": "text", "text": format!("x-anthropic-billing-header: cc_version=2; cch={tag:x}")}),
            );
        }
        blocks.push(json!({"type": "text", "text": head}));
        blocks.push(
            json!({"type": "text", "text": format!(" {}", words(rng, 10)), "cache_control": {"type": "ephemeral"}}),
        );
        json!(blocks)
    };
    let tools: Vec<Value> = (0..pick(rng, 3))
        .map(|i| {
            json!({"name": format!("tool_{i}"), "description": words(rng, 6),
                        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}})
        })
        .collect();
    let mut messages = vec![json!({"role": "user", "content": words(rng, 20)})];
    for t in 0..pick(rng, 3) {
        let id = format!("toolu_{tag}_{t}");
        let mut assistant = vec![json!({"type": "text", "text": words(rng, 8)})];
        assistant
            .push(json!({"type": "tool_use", "id": id, "name": "tool_0", "input": {"path": words(rng, 2), "n": t}}));
        messages.push(json!({"role": "assistant", "content": assistant}));
        let result = if pick(rng, 2) == 0 {
            json!(words(rng, 30))
        } else {
            json!([{"type": "text", "text": words(rng, 15)}, {"type": "text", "text": words(rng, 15)}])
        };
        let mut user = vec![json!({"type": "tool_result", "tool_use_id": id, "content": result})];
        if pick(rng, 2) == 0 {
            user.push(json!({"type": "text", "text": ""}));
            user.push(json!({"type": "text", "text": words(rng, 5)}));
        }
        messages.push(json!({"role": "user", "content": user}));
    }
    let mut body = json!({"model": MODEL, "max_tokens": 1, "system": system, "messages": messages});
    if !tools.is_empty() {
        body["tools"] = json!(tools);
    }
    body
}

/// Property: for random Messages conversations, the filter's precise block keys are the
/// engine's. Each conversation is first sent straight to one engine (Attaché never sees it);
/// the host indexes the engine's KV events; the ids this crate's request path computes (the
/// code the filter runs) must match every full block the engine stored, and the same
/// conversation through Envoy must go to that engine and find its prompt cached there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precise_messages_hashes_equal_the_engines_for_random_conversations() {
    let s = text_stack("messages-precise", true).await;
    let http = fresh_client();
    let engines = s.engine_addrs();
    let cfg: attache_policies::plugin_config::FilterConfig = serde_json::from_value(tokenizer_config(true)).unwrap();
    let (mut tk, failed) = PromptTokenizer::load_checked(&cfg.scheduler.precise).unwrap();
    assert_eq!(failed, 0);
    let mut rng = SplitMix64::new(36);
    let cases = 16;
    for i in 0..cases {
        let body = random_conversation(&mut rng, i);
        let e = i % engines.len();
        let o = client::post(&http, &format!("http://{}/v1/messages", engines[e]), body.to_string().into_bytes(), &[])
            .await;
        assert!(o.ok(), "conversation {i}: {}", o.body);
        let req = request::parse(Api::Messages, body.to_string().as_bytes()).unwrap();
        let ids = tk.request(&req, 0).unwrap();
        assert!(ids.len() >= 160, "conversation {i} is {} tokens", ids.len());
        wait_indexed(&s, &ids, (ids.len() / 16) as u64).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await; // index deltas reach the filters
    let mut rng = SplitMix64::new(36);
    for i in 0..cases {
        let body = random_conversation(&mut rng, i);
        let o = client::post(&http, &s.url("/v1/messages"), body.to_string().into_bytes(), &[]).await;
        assert!(o.ok(), "conversation {i}: {}", o.body);
        let want = engines[i % engines.len()].as_str();
        assert_eq!(o.engine_address.as_deref(), Some(want), "conversation {i} went elsewhere");
        let req = request::parse(Api::Messages, body.to_string().as_bytes()).unwrap();
        let full = tk.request(&req, 0).unwrap().len() / 16 * 16;
        let cached = o.json()["usage"]["cache_read_input_tokens"].as_u64().unwrap_or(0);
        assert!(cached as usize >= full.saturating_sub(16), "conversation {i}: {cached} of {full} tokens cached");
    }
    assert_eq!(s.envoy_stat("wasmcustom.attache.precise.prompt_untokenized"), 0);
    assert_eq!(s.envoy_stat("wasmcustom.attache.requests.api.messages"), cases as u64);
}

/// RL rollouts on `/inference/v1/generate`: groups of samples of one prompt, given as token
/// ids. In precise mode with no tokenizer configured, a group's samples go to the engine that
/// holds the prompt, and nothing is tokenized.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_samples_of_a_prompt_go_to_its_holder_with_no_tokenizer() {
    let mut s = Stack::new("generate").expect("stack");
    s.start_sim(SimOpts { engines: 4, time_scale: 0.05, kv_events: true, ..SimOpts::default() }).expect("sim");
    s.start_host().expect("host");
    let cfg = json!({"role": "scheduler", "scheduler": {"precise": {"enabled": true}}});
    s.start_envoy(EnvoyKind::Attache, &cfg, 2).expect("envoy");
    s.wait_snapshot(4, Duration::from_secs(20)).expect("snapshot");
    let http = fresh_client();
    let url = s.url("/inference/v1/generate");
    let mut per_group: Vec<HashSet<String>> = Vec::new();
    for g in 0..4u32 {
        let prompt: Vec<u32> = (0..480).map(|t| 3 + (g * 7919 + t * 31) % 2000).collect();
        let body = json!({"token_ids": prompt, "sampling_params": {"max_tokens": 2, "temperature": 1.0}});
        let first = client::post(&http, &url, body.to_string().into_bytes(), &[]).await;
        assert!(first.ok(), "{}", first.body);
        let v = first.json();
        assert!(v["request_id"].as_str().is_some_and(|id| id.starts_with("generate-tokens-")), "{v}");
        assert_eq!(v["choices"][0]["token_ids"].as_array().map(Vec::len), Some(2), "{v}");
        wait_indexed(&s, &prompt, 30).await;
        // The index delta reaches the filters, and the other Envoy worker learns the first
        // sample's placement from the affinity log (two ticks).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let samples: Vec<_> = (0..6)
            .map(|_| {
                let (http, url, body) = (http.clone(), url.clone(), body.to_string().into_bytes());
                tokio::spawn(async move { client::post(&http, &url, body, &[]).await })
            })
            .collect();
        let mut engines = HashSet::from([first.engine_address.clone().unwrap_or_default()]);
        for h in samples {
            let o = h.await.unwrap();
            assert!(o.ok(), "{}", o.body);
            assert!(
                o.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() >= Some(448),
                "group {g}: first on {:?}, this sample on {:?}: {}",
                first.engine_address,
                o.engine_address,
                o.body
            );
            engines.insert(o.engine_address.unwrap_or_default());
        }
        per_group.push(engines);
    }
    assert!(per_group.iter().all(|e| e.len() == 1), "a group's samples spread: {per_group:?}");
    // Streamed, as rollout workers read it: token ids per chunk, then [DONE].
    let body = json!({"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}, "stream": true});
    let o = client::post(&http, &url, body.to_string().into_bytes(), &[]).await;
    assert!(o.ok() && o.done && o.ttft.is_some(), "{}", o.body);
    assert_eq!(s.envoy_stat("wasmcustom.attache.precise.prompt_untokenized"), 0, "nothing needed a tokenizer");
    assert_eq!(s.envoy_stat("wasmcustom.attache.requests.api.generate"), 4 * 7 + 1);
}

/// Utility routes generate nothing: they go to the least-loaded engine, never the busy one,
/// and each route is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn utility_routes_go_by_load_alone_and_are_counted() {
    let s = attache_stack("utility", SimOpts { engines: 3, time_scale: 0.2, max_num_seqs: 2, ..SimOpts::default() });
    let http = fresh_client();
    let busy = s.engine_addrs()[0].clone();
    // Long enough to outlast the utility calls on a slow machine; aborted at the end.
    let load = load_engine_at(&http, &busy, 8, 4_000);
    let waiting = wait_for_queue_at(&s, &busy, 4.0).await;
    assert!(waiting >= 4.0, "the busy engine never queued: {waiting} waiting");
    // The host sees the queue; the filter sees it a snapshot push later.
    wait_for_filter_snapshot(&s).await;
    let mut seen: HashMap<&str, HashSet<String>> = HashMap::new();
    let messages = json!({"model": MODEL, "messages": [{"role": "user", "content": "count me"}]});
    for (path, body) in [
        ("/tokenize", json!({"model": MODEL, "prompt": "hello there"})),
        ("/detokenize", json!({"model": MODEL, "tokens": [0, 104, 105]})),
        ("/v1/messages/count_tokens", messages),
    ] {
        for _ in 0..6 {
            let o = client::post(&http, &s.url(path), body.to_string().into_bytes(), &[]).await;
            assert!(o.ok(), "{path}: {} {}", o.status, o.body);
            seen.entry(path).or_default().insert(o.engine_address.unwrap_or_default());
        }
    }
    let still = wait_for_queue_at(&s, &busy, 1.0).await;
    assert!(still >= 1.0, "the busy engine drained before the last utility call: {still} waiting");
    for (path, engines) in &seen {
        assert!(!engines.contains(&busy), "{path} went to the busy engine: {engines:?}");
    }
    for l in load {
        l.abort();
    }
    for api in ["tokenize", "detokenize", "count_tokens"] {
        assert_eq!(s.envoy_stat(&format!("wasmcustom.attache.requests.api.{api}")), 6, "{api}");
    }
    println!("utility routes: {seen:?} (busy: {busy})");
}
