//! Responses API state in the gateway, on engines that store nothing (vLLM as shipped: the
//! simulator without `--responses-store`): three real Envoy 1.40 replicas and the official
//! `openai` client chain, stream, retrieve, list and delete; an engine dies mid-chain; a
//! bounded store evicts and says so.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::time::Duration;

use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::redis::Redis;
use attache_e2e::stats::{stat_line, stat_value};
use attache_e2e::{client, EnvoyKind, Replica, SimOpts, Stack};
use common::*;
use serde_json::{json, Value};

fn replicas_stack(name: &str, opts: SimOpts) -> (Stack, Vec<Replica>) {
    let mut s = Stack::new(name).expect("stack");
    let engines = usize::from(opts.engines);
    s.start_sim(opts).expect("sim");
    s.start_host().expect("host");
    let replicas = s.start_replicas(3, EnvoyKind::Attache, &Stack::default_scheduler_config(), 2).expect("replicas");
    s.wait_replicas(&replicas, engines, Duration::from_secs(20)).expect("snapshot");
    (s, replicas)
}

fn host_metric(s: &Stack, name: &str) -> f64 {
    http_get_blocking(s.host_admin_port, "/metrics").map(|t| stat_line(&t, name)).unwrap_or(0.0)
}

/// Run `script` with the stack's Python (the official `openai` client) and `args`; its last
/// line of output is JSON.
fn python(s: &Stack, script: &str, args: &[String]) -> Value {
    let py = s.paths.root.join(".venv/bin/python");
    let out = std::process::Command::new(py).arg("-c").arg(script).args(args).output().expect("python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).expect("JSON on the last line")
}

/// 20 chains of 10 turns, turn t of chain i through replica (i + t) % 3, even chains streamed.
/// Each turn is checked against the same conversation sent whole, straight to an engine: the
/// engine saw the whole conversation, token for token.
const CHAINS: &str = r#"
import json, sys
from concurrent.futures import ThreadPoolExecutor
from openai import OpenAI

replicas = [OpenAI(base_url=u, api_key="tenant-a", max_retries=0) for u in sys.argv[1].split(",")]
engine = OpenAI(base_url=sys.argv[2], api_key="unused", max_retries=0)
MODEL = "tinyllama"

def item(o):
    return o.model_dump(exclude_none=True)

def chain(i):
    streamed = i % 2 == 0
    prev, history, turns, failures, mismatches, events = None, [], 0, [], [], 0
    for t in range(10):
        c = replicas[(i + t) % 3]
        text = f"chain {i} turn {t}: " + " ".join(["tool output"] * (5 + 3 * t))
        args = dict(model=MODEL, input=text, max_output_tokens=6)
        if t == 0:
            args["instructions"] = "You are a coding agent."
        if prev:
            args["previous_response_id"] = prev
        try:
            if streamed:
                seq, kinds, r = [], [], None
                for ev in c.responses.create(stream=True, **args):
                    seq.append(ev.sequence_number)
                    kinds.append(ev.type)
                    if ev.type == "response.completed":
                        r = ev.response
                assert r is not None, "no response.completed"
                assert seq == list(range(len(seq))), seq
                assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
                events += len(kinds)
            else:
                r = c.responses.create(**args)
        except Exception as e:
            failures.append(f"chain {i} turn {t}: {type(e).__name__}: {e}")
            break
        history.append({"role": "user", "content": text})
        whole = engine.responses.create(model=MODEL, input=history, max_output_tokens=1, store=False,
                                        **({"instructions": "You are a coding agent."} if t == 0 else {}))
        if whole.usage.input_tokens != r.usage.input_tokens:
            mismatches.append((i, t, r.usage.input_tokens, whole.usage.input_tokens))
        history.extend(item(o) for o in r.output)
        prev, turns = r.id, turns + 1
    return {"turns": turns, "failures": failures, "mismatches": mismatches, "events": events}

with ThreadPoolExecutor(max_workers=4) as pool:
    results = list(pool.map(chain, range(20)))
print(json.dumps({
    "turns": sum(r["turns"] for r in results),
    "failures": [f for r in results for f in r["failures"]],
    "mismatches": [m for r in results for m in r["mismatches"]],
    "streamed_events": sum(r["events"] for r in results),
}))
"#;

/// The API: GET, input_items and DELETE through different replicas; another tenant gets 404;
/// `store: false` can be neither retrieved nor continued.
const API: &str = r#"
import json, sys
import openai
from openai import OpenAI

urls = sys.argv[1].split(",")
a = [OpenAI(base_url=u, api_key="tenant-a", max_retries=0) for u in urls]
b = OpenAI(base_url=urls[1], api_key="tenant-b", max_retries=0)
MODEL = "tinyllama"
out = {}

def status(f):
    try:
        f()
        return 200
    except openai.APIStatusError as e:
        return e.status_code

r = a[0].responses.create(model=MODEL, input="api check", max_output_tokens=4)
got = a[1].responses.retrieve(r.id)
out["retrieved"] = got.id == r.id and got.output_text == r.output_text and got.status == r.status
items = a[2].responses.input_items.list(r.id)
out["input_items"] = [p.text for i in items.data for p in i.content]
out["other_tenant_get"] = status(lambda: b.responses.retrieve(r.id))
out["other_tenant_continue"] = status(lambda: b.responses.create(model=MODEL, input="x", previous_response_id=r.id))
n = a[0].responses.create(model=MODEL, input="not stored", max_output_tokens=2, store=False)
out["unstored_get"] = status(lambda: a[1].responses.retrieve(n.id))
out["unstored_continue"] = status(lambda: a[2].responses.create(model=MODEL, input="x", previous_response_id=n.id))
a[0].responses.delete(r.id)
out["deleted_get"] = status(lambda: a[1].responses.retrieve(r.id))
out["deleted_continue"] = status(lambda: a[2].responses.create(model=MODEL, input="x", previous_response_id=r.id))
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chains_continue_through_any_replica_on_engines_that_store_nothing() {
    let opts = SimOpts { engines: 4, time_scale: 0.05, ..SimOpts::default() };
    let (s, replicas) = replicas_stack("responses-chains", opts);
    let urls: Vec<String> = replicas.iter().map(|r| r.url("/v1")).collect();
    let engine = format!("http://{}/v1", s.engine_addrs()[0]);

    // The engines store nothing: a continuation sent straight to one is a 404, as on vLLM.
    let http = fresh_client();
    let direct = format!("http://{}/v1/responses", s.engine_addrs()[0]);
    let first =
        client::post(&http, &direct, json!({"model": MODEL, "input": "hi"}).to_string().into_bytes(), &[]).await;
    let id = first.json()["id"].as_str().unwrap().to_owned();
    let again = json!({"model": MODEL, "input": "more", "previous_response_id": id}).to_string().into_bytes();
    assert_eq!(client::post(&http, &direct, again, &[]).await.status, 404);

    let v = python(&s, CHAINS, &[urls.join(","), engine]);
    println!("chains: {v}");
    assert_eq!(v["failures"], json!([]), "{v}");
    assert_eq!(v["turns"], 200);
    assert_eq!(v["mismatches"], json!([]), "each turn's prompt is the whole conversation's: {v}");
    assert!(v["streamed_events"].as_u64().unwrap() >= 100 * 9, "{v}");
    // Every turn was stored at the host; most continuations were resolved there (the next
    // replica had not seen the conversation), none failed.
    assert!(host_metric(&s, "attache_responses_stores_total{outcome=\"stored\"}") >= 200.0);
    let stats = replicas.iter().map(Replica::stats).collect::<Vec<_>>();
    let sum = |name: &str| stats.iter().map(|t| stat_value(t, name) as f64).sum::<f64>();
    let (host_hits, local_hits) =
        (sum("wasmcustom.attache.responses.resolved.host"), sum("wasmcustom.attache.responses.resolved.local"));
    println!("continuations resolved at the host {host_hits}, in the worker {local_hits}");
    assert_eq!(host_hits + local_hits, 180.0);
    assert_eq!(sum("wasmcustom.attache.responses.rewrites"), 180.0);
    assert_eq!(sum("wasmcustom.attache.responses.resolved.not_found"), 0.0);

    let api = python(&s, API, &[urls.join(",")]);
    println!("api: {api}");
    assert_eq!(api["retrieved"], true, "{api}");
    assert_eq!(api["input_items"], json!(["api check"]), "{api}");
    for key in [
        "other_tenant_get",
        "other_tenant_continue",
        "unstored_get",
        "unstored_continue",
        "deleted_get",
        "deleted_continue",
    ] {
        assert_eq!(api[key], 404, "{key}: {api}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_survives_the_engine_that_served_it() {
    let mut s = Stack::new("responses-engine-loss").expect("stack");
    s.start_sim(SimOpts { engines: 2, time_scale: 0.05, ..SimOpts::default() }).expect("sim");
    let extras = [s.start_extra_engine().expect("extra"), s.start_extra_engine().expect("extra")];
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2).expect("envoy");
    s.wait_snapshot(4, Duration::from_secs(20)).expect("snapshot");
    let http = fresh_client();
    let url = s.url("/v1/responses");
    let turn = |i: usize, t: usize, prev: Option<&str>| {
        let mut b = json!({"model": MODEL, "input": format!("job {i} step {t} {}", "context ".repeat(40)), "max_output_tokens": 4});
        if let Some(p) = prev {
            b["previous_response_id"] = json!(p);
        }
        b.to_string().into_bytes()
    };
    // Twelve chains of five turns; then one whose fifth turn an extra engine served loses it.
    let mut chains = Vec::new();
    for i in 0..12 {
        let mut prev: Option<String> = None;
        let mut served = None;
        for t in 0..5 {
            let o = client::post(&http, &url, turn(i, t, prev.as_deref()), &[]).await;
            assert!(o.ok(), "chain {i} turn {t}: {} {}", o.status, o.body);
            prev = o.json()["id"].as_str().map(str::to_owned);
            served = o.engine_port;
        }
        chains.push((i, prev.unwrap(), served));
    }
    let port = |a: &str| a.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
    let (i, prev, dead) = chains
        .iter()
        .find(|(_, _, served)| extras.iter().any(|e| port(e) == *served))
        .cloned()
        .expect("an extra engine served some chain's fifth turn");
    let dead_addr = extras.iter().find(|e| port(e) == dead).unwrap().clone();
    s.kill_extra_engine(&dead_addr);
    let o = client::post(&http, &url, turn(i, 5, Some(&prev)), &[]).await;
    assert!(o.ok(), "turn 6 after its engine died: {} {}", o.status, o.body);
    assert_ne!(o.engine_port, dead, "served by another engine");
    // And the chain goes on from there.
    let next = o.json()["id"].as_str().unwrap().to_owned();
    let o = client::post(&http, &url, turn(i, 6, Some(&next)), &[]).await;
    assert!(o.ok(), "{} {}", o.status, o.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_store_evicts_the_least_recently_used_and_says_so() {
    let mut s = Stack::new("responses-bounded").expect("stack");
    s.start_sim(SimOpts { engines: 2, time_scale: 0.02, ..SimOpts::default() }).expect("sim");
    let limit = 1usize << 20;
    s.host_extra = Some(json!({"responses": {"max_bytes": limit}}));
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2).expect("envoy");
    s.wait_snapshot(2, Duration::from_secs(20)).expect("snapshot");
    let rss = |s: &Stack| -> f64 {
        let pid = s.host.as_ref().map(attache_e2e::process::Proc::pid).unwrap();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0.0)
            * 1024.0
    };
    let http = fresh_client();
    let url = s.url("/v1/responses");
    // Ten times the bound, twice: 2 x 200 responses of about 50 KB each. The first round brings
    // the host's allocator to its working size; over the second, a store that kept what it
    // evicts would grow by another 10 MB.
    let body = |i: usize| json!({"model": MODEL, "input": format!("doc {i} {}", "word ".repeat(10_000)), "max_output_tokens": 2});
    let mut ids = Vec::new();
    let mut rounds = Vec::new();
    for i in 0..400 {
        let o = client::post(&http, &url, body(i).to_string().into_bytes(), &[]).await;
        assert!(o.ok(), "{} {}", o.status, o.body);
        ids.push(o.json()["id"].as_str().unwrap().to_owned());
        if i == 199 || i == 399 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            rounds.push(rss(&s));
        }
    }
    let (bytes, evicted) = (
        host_metric(&s, "attache_responses_bytes"),
        host_metric(&s, "attache_responses_evictions_total{reason=\"bytes\"}"),
    );
    let grown = rounds[1] - rounds[0];
    println!(
        "store {bytes} bytes (bound {limit}), {evicted} evicted; host RSS {:.1} MB after 10 MB sent, {:.1} MB after 20 MB",
        rounds[0] / 1e6,
        rounds[1] / 1e6
    );
    assert!(bytes > 0.0 && bytes <= limit as f64, "{bytes}");
    assert!(evicted >= 350.0, "{evicted}");
    assert!(grown < 4.0 * limit as f64, "the host's memory grew {grown} bytes over the second 10 MB");
    // The oldest is gone and its continuation says why; the newest continues.
    let cont =
        |id: &str| json!({"model": MODEL, "input": "go on", "previous_response_id": id}).to_string().into_bytes();
    let o = client::post(&http, &url, cont(&ids[0]), &[]).await;
    assert_eq!(o.status, 404, "{}", o.body);
    let err = &o.json()["error"];
    assert_eq!(err["param"], "previous_response_id");
    assert!(err["message"].as_str().unwrap().contains("evicted"), "{err}");
    let o = client::post(&http, &url, cont(ids.last().unwrap()), &[]).await;
    assert!(o.ok(), "{} {}", o.status, o.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_behind_it_a_restarted_host_continues_the_chains() {
    let mut s = Stack::new("responses-redis").expect("stack");
    let mut redis = Redis::start(&s).expect("redis-server (cargo xtask installs it from Debian)");
    s.start_sim(SimOpts { engines: 2, time_scale: 0.02, ..SimOpts::default() }).expect("sim");
    s.host_extra = Some(json!({"responses": {"redis": redis.addr().to_string()}}));
    s.start_host().expect("host");
    // No per-worker cache: every continuation is resolved by the host.
    let mut cfg = Stack::default_scheduler_config();
    cfg["responses"] = json!({"cache_bytes": 0});
    s.start_envoy(EnvoyKind::Attache, &cfg, 2).expect("envoy");
    s.wait_snapshot(2, Duration::from_secs(20)).expect("snapshot");
    let http = fresh_client();
    let url = s.url("/v1/responses");
    let turn = |i: usize, t: usize, prev: Option<&str>| {
        let mut b = json!({"model": MODEL, "input": format!("job {i} step {t}"), "max_output_tokens": 3});
        if let Some(p) = prev {
            b["previous_response_id"] = json!(p);
        }
        b.to_string().into_bytes()
    };
    let mut chains: Vec<(String, u64)> = Vec::new();
    for i in 0..5 {
        let mut prev: Option<String> = None;
        let mut tokens = 0;
        for t in 0..3 {
            let o = client::post(&http, &url, turn(i, t, prev.as_deref()), &[]).await;
            assert!(o.ok(), "chain {i} turn {t}: {} {}", o.status, o.body);
            prev = o.json()["id"].as_str().map(str::to_owned);
            tokens = o.json()["usage"]["input_tokens"].as_u64().unwrap();
        }
        chains.push((prev.unwrap(), tokens));
    }
    // Every capture has reached the host (each is sent as its answer ends, off the request
    // path: one still in flight when the host dies is lost with it).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while host_metric(&s, "attache_responses_stores_total{outcome=\"stored\"}") < 15.0 {
        assert!(std::time::Instant::now() < deadline, "the host did not store the 15 responses");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The host restarts with nothing in memory; the chains go on, each turn's prompt longer than
    // the last (the whole conversation, read back from Redis).
    s.start_host().expect("host restarts");
    s.wait_snapshot(2, Duration::from_secs(20)).expect("snapshot");
    for (i, (prev, tokens)) in chains.iter().enumerate() {
        let o = client::post(&http, &url, turn(i, 3, Some(prev)), &[]).await;
        assert!(o.ok(), "chain {i} after the restart: {} {}", o.status, o.body);
        let now = o.json()["usage"]["input_tokens"].as_u64().unwrap();
        assert!(now > *tokens, "chain {i}: {now} prompt tokens after {tokens}: the conversation came back");
    }
    assert_eq!(host_metric(&s, "attache_responses_redis_loads_total"), 5.0);
    assert_eq!(host_metric(&s, "attache_responses_redis_errors_total"), 0.0);
    // Redis gone and the chain not in this host's memory: 503 with a reason, counted.
    redis.kill();
    s.start_host().expect("host restarts");
    s.wait_snapshot(2, Duration::from_secs(20)).expect("snapshot");
    let o = client::post(&http, &url, turn(0, 4, Some(&chains[1].0)), &[]).await;
    assert_eq!(o.status, 503, "{}", o.body);
    assert_eq!(o.header("x-attache-error"), Some("responses_store_unavailable"));
    assert!(host_metric(&s, "attache_responses_resolutions_total{outcome=\"unavailable\"}") >= 1.0);
}
