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

/// Background responses: create them, poll them, cancel some. Modes by argv[2]:
/// - `create N TOKENS`: create N background responses; prints their ids and first statuses;
/// - `poll IDS`: poll each id until it ends; prints every status each was seen in, and its last;
/// - `cancel ID`: cancel; prints the answer's status and a GET's after it.
const BACKGROUND: &str = r#"
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
import openai
from openai import OpenAI

c = OpenAI(base_url=sys.argv[1], api_key="tenant-a", max_retries=0)
other = OpenAI(base_url=sys.argv[1], api_key="tenant-b", max_retries=0)
MODEL = "tinyllama"
mode = sys.argv[2]
if mode == "create":
    n, tokens = int(sys.argv[3]), int(sys.argv[4])
    def create(i):
        r = c.responses.create(model=MODEL, input=f"background job {i}: summarise the report.",
                               max_output_tokens=tokens, background=True)
        return r.id, r.status, r.background
    with ThreadPoolExecutor(max_workers=8) as pool:
        made = list(pool.map(create, range(n)))
    print(json.dumps({"ids": [m[0] for m in made], "statuses": sorted({m[1] for m in made}),
                      "background": all(m[2] for m in made)}))
elif mode == "poll":
    ids = sys.argv[3].split(",")
    def poll(i):
        seen, deadline = [], time.time() + 120
        while time.time() < deadline:
            r = c.responses.retrieve(i)
            if not seen or seen[-1] != r.status:
                seen.append(r.status)
            if r.status not in ("queued", "in_progress"):
                return {"id": i, "seen": seen, "text": r.output_text, "tokens": r.usage.output_tokens if r.usage else 0}
            time.sleep(0.05)
        return {"id": i, "seen": seen, "text": "", "tokens": 0}
    with ThreadPoolExecutor(max_workers=8) as pool:
        print(json.dumps(list(pool.map(poll, ids))))
elif mode == "cancel":
    i = sys.argv[3]
    r = c.responses.cancel(i)
    try:
        other.responses.cancel(i)
        intruder = 200
    except openai.APIStatusError as e:
        intruder = e.status_code
    print(json.dumps({"cancelled": r.status, "get": c.responses.retrieve(i).status, "other_tenant": intruder}))
elif mode == "continue":
    r = c.responses.create(model=MODEL, input="and the conclusion?", previous_response_id=sys.argv[3],
                           max_output_tokens=2)
    print(json.dumps({"status": r.status, "input_tokens": r.usage.input_tokens}))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_responses_run_on_the_async_worker_poll_cancel_and_survive_its_death() {
    use attache_e2e::async_worker::AsyncWorker;
    use attache_host::async_worker::job::Status;
    use attache_host::async_worker::queue::Queue;

    let mut s = Stack::new("responses-background").expect("stack");
    let redis = Redis::start(&s).expect("redis-server (cargo xtask installs it from Debian)");
    s.host_extra = Some(json!({"responses": {"redis": redis.addr().to_string(),
        "background": {"enabled": true, "poll_ms": 50}}}));
    // Background jobs travel as the sheddable band: objective `batch` at a negative priority.
    s.host_flow = Some(json!({"objectives": {"interactive": 10, "batch": -1}}));
    s.start_sim(SimOpts { engines: 2, time_scale: 1.0, ..SimOpts::default() }).expect("sim");
    s.start_host().expect("host");
    let mut cfg = Stack::default_scheduler_config();
    cfg["flow"] = json!({"enabled": true});
    s.start_envoy(EnvoyKind::Attache, &cfg, 2).expect("envoy");
    s.wait_snapshot(2, Duration::from_secs(20)).expect("snapshot");
    let url = s.url("/v1");
    let q = Queue::new(redis.addr(), "attache:async", Duration::from_secs(5));
    let worker_args = ["--lease-ms", "1500", "--gate-interval-ms", "50", "--concurrency", "8"];

    // No worker yet: a background response stays queued, and is cancelled while queued.
    let made = python(&s, BACKGROUND, &[url.clone(), "create".into(), "1".into(), "8".into()]);
    assert_eq!((made["statuses"].clone(), made["background"].clone()), (json!(["queued"]), json!(true)), "{made}");
    let queued_id = made["ids"][0].as_str().unwrap().to_owned();
    let c = python(&s, BACKGROUND, &[url.clone(), "cancel".into(), queued_id.clone()]);
    assert_eq!(c, json!({"cancelled": "cancelled", "get": "cancelled", "other_tenant": 404}));

    // 100 background responses; the worker is killed mid-run and another takes over.
    let made = python(&s, BACKGROUND, &[url.clone(), "create".into(), "100".into(), "24".into()]);
    let ids: Vec<String> = made["ids"].as_array().unwrap().iter().map(|i| i.as_str().unwrap().to_owned()).collect();
    assert_eq!(ids.len(), 100);
    let poller = {
        let (s_root, url, joined) = (s.paths.root.clone(), url.clone(), ids.join(","));
        std::thread::spawn(move || {
            let py = s_root.join(".venv/bin/python");
            let out = std::process::Command::new(py).args(["-c", BACKGROUND, &url, "poll", &joined]).output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            serde_json::from_str::<Value>(stdout.lines().last().unwrap_or_default()).unwrap()
        })
    };
    assert_eq!(made["statuses"], json!(["queued"]));
    // The poller's first reads see them queued: the worker starts after it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut w = AsyncWorker::start(&s, &redis, &worker_args).expect("attache async");
    let count = || async { q.depths().await.map(|d| d.results).unwrap_or(0) };
    let end = std::time::Instant::now() + Duration::from_secs(60);
    while count().await < 21 && std::time::Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(w.metric("attache_async_inflight") >= 1.0, "the kill should land while jobs run");
    w.proc.kill(); // SIGKILL: its leases lapse and their jobs go back to pending
    let at_kill = count().await;
    assert!(at_kill < 101, "the kill landed mid-run ({at_kill} results)");
    let w = AsyncWorker::start(&s, &redis, &worker_args).expect("attache async");
    let polled = tokio::task::spawn_blocking(move || poller.join().unwrap()).await.unwrap();
    let polled = polled.as_array().unwrap();
    assert_eq!(polled.len(), 100);
    let mut seen_any = std::collections::BTreeSet::new();
    for p in polled {
        let seen: Vec<&str> = p["seen"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
        assert_eq!(seen.last(), Some(&"incomplete"), "{p}: ends once, with its whole output");
        assert!(!p["text"].as_str().unwrap_or_default().is_empty(), "{p}");
        assert_eq!(p["tokens"], 24, "{p}");
        // Never back to queued once running, never running again once ended.
        let mut sorted = seen.clone();
        sorted.dedup();
        assert_eq!(sorted, seen, "{p}");
        seen_any.extend(seen);
    }
    assert!(seen_any.contains("queued") && seen_any.contains("in_progress"), "polling saw {seen_any:?}");
    // Exactly once: one result per id issued (and the one cancelled), all completed.
    let got = q.results().await.unwrap();
    let mut by_id: std::collections::BTreeMap<String, Status> = std::collections::BTreeMap::new();
    for r in got {
        assert!(by_id.insert(r.id.clone(), r.status).is_none(), "{} has two results", r.id);
    }
    let mut want: std::collections::BTreeSet<String> = ids.iter().cloned().collect();
    want.insert(queued_id.clone());
    assert_eq!(by_id.keys().cloned().collect::<std::collections::BTreeSet<_>>(), want, "exactly the ids issued");
    assert_eq!(by_id[&queued_id], Status::Cancelled);
    assert_eq!(by_id.values().filter(|st| **st == Status::Completed).count(), 100);
    let lapsed = q.redis().cmd(&["HGET", &q.key("stats"), "lapsed"]).await.unwrap().as_int().unwrap_or(0);
    assert!(lapsed >= 1, "the killed worker's jobs went back to pending and ran again");
    println!("killed the worker at {at_kill} results; {lapsed} leases lapsed; polling saw {seen_any:?}");
    let bg = |e: &str| host_metric(&s, &format!("attache_responses_background_total{{event=\"{e}\"}}"));
    assert_eq!((bg("submitted"), bg("completed"), bg("cancelled")), (101.0, 100.0, 1.0));

    // A completed background response continues like any other: its output is in the prompt.
    let first = &ids[0];
    let cont = python(&s, BACKGROUND, &[url.clone(), "continue".into(), first.clone()]);
    assert_eq!(cont["status"], "incomplete");
    assert!(cont["input_tokens"].as_u64().unwrap() > 24 + 8, "{cont}");

    // Cancel while running: a long job, cancelled once GET shows it in progress.
    let made = python(&s, BACKGROUND, &[url.clone(), "create".into(), "1".into(), "4000".into()]);
    let long = made["ids"][0].as_str().unwrap().to_owned();
    let end = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let st = http_get_json(&s, &format!("/v1/responses/{long}"));
        if st["status"] == "in_progress" || std::time::Instant::now() > end {
            assert_eq!(st["status"], "in_progress", "{st}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c = python(&s, BACKGROUND, &[url.clone(), "cancel".into(), long.clone()]);
    assert_eq!((c["cancelled"].as_str(), c["get"].as_str()), (Some("cancelled"), Some("cancelled")), "{c}");
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while w.metric("attache_async_cancelled_total") < 1.0 && std::time::Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(w.metric("attache_async_cancelled_total"), 1.0, "the worker stopped the running job");
    let r = q.results_of(&[long.as_str()]).await.unwrap();
    assert_eq!(r[0].as_ref().map(|r| r.status), Some(Status::Cancelled));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(http_get_json(&s, &format!("/v1/responses/{long}"))["status"], "cancelled", "stays cancelled");
    let running: f64 = s
        .engine_addrs()
        .iter()
        .filter_map(|a| a.rsplit(':').next()?.parse::<u16>().ok())
        .map(|port| {
            http_get_blocking(port, "/metrics").map(|t| stat_line(&t, "vllm:num_requests_running")).unwrap_or(-1.0)
        })
        .sum();
    assert_eq!(running, 0.0, "the engines stopped generating");
    assert_eq!(bg("cancelled"), 2.0);
}

fn http_get_json(s: &Stack, path: &str) -> Value {
    let out = std::process::Command::new("curl")
        .args(["-s", "-H", "authorization: Bearer tenant-a", &s.url(path)])
        .output()
        .expect("curl");
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

/// Engine mode: responses created (half streamed) and a background one, then each retrieved and
/// cancelled through the gateway. Every engine but the one that stored a response answers 404.
const ENGINE_ROUTES: &str = r#"
import json, sys, time
import openai
from openai import OpenAI

c = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
MODEL = "tinyllama"
out = {"created": 0, "retrieved": 0, "failures": [], "cancel_sync": [], "background": None}
ids = []
for i in range(12):
    args = dict(model=MODEL, input=f"engine-held response {i}", max_output_tokens=4)
    if i % 2:
        r = None
        for ev in c.responses.create(stream=True, **args):
            if ev.type == "response.completed":
                r = ev.response
    else:
        r = c.responses.create(**args)
    ids.append(r.id)
    out["created"] += 1
for i in ids:
    try:
        got = c.responses.retrieve(i)
        assert got.id == i
        out["retrieved"] += 1
    except openai.APIStatusError as e:
        out["failures"].append(f"GET {i}: {e.status_code}")
    try:
        c.responses.cancel(i)
        out["cancel_sync"].append(200)
    except openai.APIStatusError as e:
        out["cancel_sync"].append(e.status_code)
bg = c.responses.create(model=MODEL, input="a long background job", max_output_tokens=2000, background=True)
got = c.responses.retrieve(bg.id)
cancelled = c.responses.cancel(bg.id)
out["background"] = [bg.status, got.status, cancelled.status]
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_engine_mode_get_and_cancel_reach_the_engine_that_holds_the_response() {
    let mut s = Stack::new("responses-engine-routes").expect("stack");
    s.start_sim(SimOpts { engines: 3, time_scale: 0.2, responses_store: true, ..SimOpts::default() }).expect("sim");
    s.start_host().expect("host");
    let mut cfg = Stack::default_scheduler_config();
    cfg["responses"] = json!({"mode": "engine"});
    s.start_envoy(EnvoyKind::Attache, &cfg, 2).expect("envoy");
    s.wait_snapshot(3, Duration::from_secs(20)).expect("snapshot");
    let got = python(&s, ENGINE_ROUTES, &[s.url("/v1")]);
    println!("engine mode: {got}");
    assert_eq!((got["created"].as_u64(), got["retrieved"].as_u64()), (Some(12), Some(12)), "{got}");
    // vLLM refuses to cancel a response that is not a background one: 400, from the engine that
    // holds it (another would say 404).
    assert_eq!(got["cancel_sync"], json!(vec![400; 12]), "{got}");
    assert_eq!(got["background"], json!(["queued", "queued", "cancelled"]), "{got}");
    let stats = http_get_blocking(s.envoy_admin_port, "/stats").unwrap_or_default();
    // Two routes for each of the 12, and the background response's GET and cancel.
    assert_eq!(stat_value(&stats, "wasmcustom.attache.responses.engine.routed"), 12 * 2 + 2);
    assert_eq!(stat_value(&stats, "wasmcustom.attache.responses.engine.unbound"), 0);
}
