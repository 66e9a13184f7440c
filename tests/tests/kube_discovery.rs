//! Kubernetes discovery against a **stand-in API server** (`attache_e2e::fake_kube`): no real
//! kube-apiserver can be installed on this machine, so these tests run the host's real `kube`
//! client and watchers against a server that speaks the list/watch wire format, and check what
//! the host derives. They cover list then watch, adds and deletes, readiness flips, several
//! target ports, role labels, a broken watch that resumes, an expired resourceVersion that
//! forces a new list, and the InferenceObjective priority table. The last test runs the host
//! binary itself, discovering simulated engines and routing requests to them through Envoy.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use attache_e2e::client;
use attache_e2e::fake_kube::{self, FakeApiServer};
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use attache_host::discovery::StaticEndpoint;
use attache_host::kubernetes::{self, KubernetesConfig};
use serde_json::json;
use tokio::sync::watch;

const NS: &str = "ml";

fn workdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("attache-kube-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

async fn discover(api: &FakeApiServer, name: &str, namespace: Option<&str>) -> kubernetes::Discovered {
    let cfg = KubernetesConfig {
        kubeconfig: Some(api.kubeconfig(&workdir(name)).expect("kubeconfig")),
        namespace: namespace.map(str::to_owned),
        ..KubernetesConfig::default()
    };
    kubernetes::spawn(cfg).await.expect("discovery starts")
}

/// Wait until the published endpoints satisfy `f`; returns how long it took.
async fn until<F: Fn(&[StaticEndpoint]) -> bool>(
    rx: &mut watch::Receiver<Vec<StaticEndpoint>>,
    what: &str,
    f: F,
) -> Duration {
    let start = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|v| f(v))).await.is_ok_and(|r| r.is_ok());
    let current: Vec<String> = rx.borrow().iter().map(|e| format!("{} ({})", e.address, e.role)).collect();
    assert!(r, "timed out waiting for {what}; endpoints now {current:?}");
    start.elapsed()
}

fn addrs(eps: &[StaticEndpoint]) -> Vec<String> {
    eps.iter().map(|e| e.address.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_then_follows_adds_deletes_ports_and_roles() {
    let api = FakeApiServer::start().await.expect("stand-in API server");
    api.apply(fake_kube::pool(NS, "llama", "vllm", &[8000, 8001]));
    api.apply(fake_kube::pod(NS, "p0", &[("app", "vllm"), ("llm-d.ai/role", "prefill")], "10.0.0.1", true));
    api.apply(fake_kube::pod(NS, "d0", &[("app", "vllm"), ("llm-d.ai/role", "decode")], "10.0.0.2", true));
    api.apply(fake_kube::pod(NS, "web", &[("app", "web")], "10.0.0.9", true));
    api.apply(fake_kube::pod("other", "x", &[("app", "vllm")], "10.0.9.1", true));
    let mut d = discover(&api, "follow", Some(NS)).await;

    // The initial list: two pods x two target ports, roles from the label.
    until(&mut d.endpoints, "the listed pods", |e| e.len() == 4).await;
    let eps = d.endpoints.borrow().clone();
    assert_eq!(addrs(&eps), ["10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000", "10.0.0.2:8001"]);
    let roles: Vec<&str> = eps.iter().map(|e| e.role.as_str()).collect();
    assert_eq!(roles, ["prefill", "prefill", "decode", "decode"]);
    assert!(eps.iter().all(|e| e.labels.get("attache.io/pool").map(String::as_str) == Some("ml/llama")));

    // Watched: an added pod, then a deleted one, then a pool gaining a port.
    api.apply(fake_kube::pod(NS, "b0", &[("app", "vllm")], "10.0.0.3", true));
    until(&mut d.endpoints, "the added pod", |e| addrs(e).contains(&"10.0.0.3:8001".to_string())).await;
    assert_eq!(
        d.endpoints.borrow().iter().find(|e| e.address == "10.0.0.3:8000").map(|e| e.role.clone()),
        Some("both".into())
    );
    api.delete("v1", "Pod", NS, "p0");
    until(&mut d.endpoints, "the deleted pod gone", |e| e.len() == 4 && !addrs(e).contains(&"10.0.0.1:8000".into()))
        .await;
    api.apply(fake_kube::pool(NS, "llama", "vllm", &[8000, 8001, 8002]));
    until(&mut d.endpoints, "the third port", |e| e.len() == 6).await;
    api.delete("inference.networking.k8s.io/v1", "InferencePool", NS, "llama");
    until(&mut d.endpoints, "no pool, no endpoints", |e| e.is_empty()).await;

    assert_eq!(api.lists("pods"), 1, "one list, then watch events only");
    assert_eq!(api.lists("inferencepools"), 1);
    assert!(api.watches("pods") >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_flips_move_endpoints_within_a_second() {
    let api = FakeApiServer::start().await.expect("stand-in API server");
    api.apply(fake_kube::pool(NS, "llama", "vllm", &[8000]));
    api.apply(fake_kube::pod(NS, "a", &[("app", "vllm")], "10.0.0.1", true));
    api.apply(fake_kube::pod(NS, "b", &[("app", "vllm")], "10.0.0.2", true));
    let mut d = discover(&api, "ready", None).await;
    until(&mut d.endpoints, "both pods", |e| e.len() == 2).await;

    api.apply(fake_kube::pod(NS, "a", &[("app", "vllm")], "10.0.0.1", false));
    let left = until(&mut d.endpoints, "the unready pod gone", |e| addrs(e) == ["10.0.0.2:8000"]).await;
    api.apply(fake_kube::pod(NS, "a", &[("app", "vllm")], "10.0.0.1", true));
    let back = until(&mut d.endpoints, "the pod ready again", |e| e.len() == 2).await;
    // A terminating pod leaves at once, before it is deleted.
    let mut terminating = fake_kube::pod(NS, "b", &[("app", "vllm")], "10.0.0.2", true);
    terminating["metadata"]["deletionTimestamp"] = json!("2026-11-30T00:00:00Z");
    api.apply(terminating);
    let term = until(&mut d.endpoints, "the terminating pod gone", |e| addrs(e) == ["10.0.0.1:8000"]).await;
    println!("unready -> gone in {left:?}, ready -> back in {back:?}, terminating -> gone in {term:?}");
    for t in [left, back, term] {
        assert!(t < Duration::from_secs(1), "the issue's bound: within a second ({t:?})");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_watch_resumes_without_listing_again() {
    let api = FakeApiServer::start().await.expect("stand-in API server");
    api.apply(fake_kube::pool(NS, "llama", "vllm", &[8000]));
    api.apply(fake_kube::pod(NS, "a", &[("app", "vllm")], "10.0.0.1", true));
    let mut d = discover(&api, "resume", Some(NS)).await;
    until(&mut d.endpoints, "the first pod", |e| e.len() == 1).await;
    let (lists, watches) = (api.lists("pods"), api.watches("pods"));

    for i in 2..5 {
        api.break_watches();
        api.apply(fake_kube::pod(NS, &format!("p{i}"), &[("app", "vllm")], &format!("10.0.0.{i}"), true));
        until(&mut d.endpoints, "the pod added across the break", |e| e.len() == i).await;
    }
    assert_eq!(api.lists("pods"), lists, "resumed from its resourceVersion, not re-listed");
    assert!(
        api.watches("pods") >= watches + 3,
        "a new watch after each break ({} -> {})",
        watches,
        api.watches("pods")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_resource_version_lists_again() {
    let api = FakeApiServer::start().await.expect("stand-in API server");
    api.apply(fake_kube::pool(NS, "llama", "vllm", &[8000]));
    api.apply(fake_kube::pod(NS, "a", &[("app", "vllm")], "10.0.0.1", true));
    api.apply(fake_kube::pod(NS, "b", &[("app", "vllm")], "10.0.0.2", true));
    let mut d = discover(&api, "expired", Some(NS)).await;
    until(&mut d.endpoints, "both pods", |e| e.len() == 2).await;
    let lists = api.lists("pods");

    // An outage during which a pod went away and another came, and history was compacted:
    // resuming from the old resourceVersion gets 410 Gone, so the host must list again.
    api.hold_watches();
    api.delete("v1", "Pod", NS, "a");
    api.apply(fake_kube::pod(NS, "c", &[("app", "vllm")], "10.0.0.3", true));
    api.compact();
    api.release_watches();
    until(&mut d.endpoints, "the state after the outage", |e| addrs(e) == ["10.0.0.2:8000", "10.0.0.3:8000"]).await;
    println!(
        "lists {lists} -> {}, watches {}, errors {}",
        api.lists("pods"),
        api.watches("pods"),
        d.stats.errors.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert!(api.lists("pods") > lists, "a 410 must lead to a new list");
    assert!(d.stats.errors.load(std::sync::atomic::Ordering::Relaxed) >= 1, "the 410 is counted as a watch error");

    // And it keeps following after the new list.
    api.delete("v1", "Pod", NS, "b");
    until(&mut d.endpoints, "a delete after the relist", |e| addrs(e) == ["10.0.0.3:8000"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objectives_become_the_priority_table() {
    let api = FakeApiServer::start().await.expect("stand-in API server");
    api.apply(fake_kube::pool(NS, "llama", "vllm", &[8000]));
    api.apply(fake_kube::objective(NS, "chat", "llama", 10));
    api.apply(fake_kube::objective(NS, "batch", "llama", -1));
    api.apply(fake_kube::objective(NS, "elsewhere", "not-served", 99));
    let mut d = discover(&api, "objectives", Some(NS)).await;
    let want = BTreeMap::from([("batch".to_string(), -1), ("chat".to_string(), 10)]);
    let got = tokio::time::timeout(Duration::from_secs(10), d.objectives.wait_for(|t| *t == want)).await.is_ok();
    assert!(got, "priority table {:?}", *d.objectives.borrow());
    api.delete("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective", NS, "batch");
    api.apply(fake_kube::objective(NS, "chat", "llama", 20));
    let want = BTreeMap::from([("chat".to_string(), 20)]);
    let got = tokio::time::timeout(Duration::from_secs(10), d.objectives.wait_for(|t| *t == want)).await.is_ok();
    assert!(got, "priority table {:?}", *d.objectives.borrow());
}

/// The host binary, configured with `kubernetes:`, discovers two simulated engines as two
/// target ports of one pod, learns their model from their metrics, and Envoy routes to them;
/// the pod turning unready empties the pool (503 no_endpoints), ready again serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_binary_discovers_engines_and_envoy_routes_to_them() {
    let api = FakeApiServer::start().await.expect("stand-in API server");
    let mut s = Stack::new("kube-discovery").expect("stack");
    s.start_sim(SimOpts { engines: 2, ..SimOpts::default() }).expect("sim");
    let ports: Vec<u16> = s.engine_addrs().iter().filter_map(|a| a.rsplit(':').next()?.parse().ok()).collect();
    api.apply(fake_kube::pool(NS, "llama", "vllm", &ports));
    api.apply(fake_kube::pod(NS, "engine-0", &[("app", "vllm")], "127.0.0.1", true));
    s.host_kubernetes = Some(json!({
        "kubeconfig": api.kubeconfig(&s.workdir).expect("kubeconfig"),
        "namespace": NS,
    }));
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2).expect("envoy");
    s.wait_snapshot(2, Duration::from_secs(20)).expect("two discovered engines, ready");

    let snap: serde_json::Value = serde_json::from_str(
        &attache_e2e::admin_http::http_get_blocking(s.host_admin_port, "/v1/snapshot").unwrap_or_default(),
    )
    .expect("snapshot JSON");
    let models: Vec<&serde_json::Value> =
        snap["endpoints"].as_array().map(|a| a.iter().map(|e| &e["models"]).collect()).unwrap_or_default();
    assert!(models.iter().all(|m| *m == &json!(["tinyllama"])), "models learned from metrics: {models:?}");

    let http = reqwest::Client::new();
    let url = s.url("/v1/chat/completions");
    let body = client::chat_body("tinyllama", "You are terse.", "hello", 4);
    let mut served = 0;
    for _ in 0..6 {
        let o = client::post(&http, &url, body.clone(), &[]).await;
        assert_eq!(o.status, 200, "routed to a discovered engine: {} {:?}", o.body, o.error);
        served += 1;
    }

    api.apply(fake_kube::pod(NS, "engine-0", &[("app", "vllm")], "127.0.0.1", false));
    s.wait_snapshot(0, Duration::from_secs(5)).expect("the unready pod's endpoints leave the snapshot");
    let o = client::post(&http, &url, body.clone(), &[]).await;
    assert_eq!(o.status, 503, "no endpoints while the only pod is unready");
    api.apply(fake_kube::pod(NS, "engine-0", &[("app", "vllm")], "127.0.0.1", true));
    s.wait_snapshot(2, Duration::from_secs(10)).expect("back when ready");
    let o = client::post(&http, &url, body, &[]).await;
    assert_eq!(o.status, 200);
    served += 1;
    assert_eq!(served, 7);
}
