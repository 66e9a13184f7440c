//! The chart's own gateway, run as it is rendered: `helm template` (the real helm) renders the
//! host's configuration, the gateway's Envoy bootstrap and its Deployment, and this test runs
//! them as processes, the host discovering simulated engines through the **stand-in Kubernetes
//! API server** (`attache_e2e::fake_kube`; no kube-apiserver can be installed here) from the
//! InferencePool the chart rendered, and two gateway replicas on the real Envoy 1.40 with the
//! arguments of the rendered Deployment.
//!
//! What a pod gives that one machine does not is mapped, and nothing else is changed: each
//! replica's ports (`0.0.0.0:8080` and the rest) become free loopback ports, the host Service's
//! DNS name becomes 127.0.0.1, files mounted into the pods (the module, the trusted keys, the
//! admin token, the service-account credentials) become files of the test, `$(POD_NAME)` is
//! the replica's name, and each Envoy gets its own `--base-id` (two on one machine).

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::client;
use attache_e2e::fake_kube::{self, FakeApiServer};
use attache_e2e::helm::{documents, of_kind, Helm};
use attache_e2e::ports::{free_port, port_open};
use attache_e2e::process::wait_until;
use attache_e2e::stats::stat_value;
use attache_e2e::Stack;
use common::*;
use serde_json::{json, Value};

const NS: &str = "ml";
const RELEASE: &str = "llama";
const TOKEN: &str = "chart-admin-token-0123456789";

/// One gateway replica: its name (the pod's) and its ports on this machine, by the chart's
/// port number.
struct Replica {
    name: String,
    ports: HashMap<u16, u16>,
}

impl Replica {
    fn new(name: &str, chart_ports: &[u16]) -> Self {
        Self { name: name.into(), ports: chart_ports.iter().map(|p| (*p, free_port())).collect() }
    }
    fn port(&self, chart_port: u16) -> u16 {
        self.ports[&chart_port]
    }
}

/// The rendered bootstrap as a pod of `replica` runs it, on this machine (see the module doc).
fn as_replica(bootstrap: &str, replica: &Replica, host_dns: &str, host_grpc: u16, wasm: &Path) -> String {
    fn walk(v: &mut Value, r: &Replica, host_dns: &str, host_grpc: u16) {
        match v {
            Value::Object(m) => {
                if let Some(Value::Object(sa)) = m.get_mut("socket_address") {
                    let address = sa.get("address").and_then(Value::as_str).unwrap_or_default().to_owned();
                    let port = sa.get("port_value").and_then(Value::as_u64).unwrap_or(0) as u16;
                    if address == host_dns {
                        sa.insert("address".into(), json!("127.0.0.1"));
                        sa.insert("port_value".into(), json!(host_grpc));
                    } else {
                        sa.insert("address".into(), json!("127.0.0.1"));
                        let mapped = r.ports.get(&port).copied().unwrap_or_else(|| panic!("an unmapped port {port}"));
                        sa.insert("port_value".into(), json!(mapped));
                    }
                }
                if let Some(p) = m.get_mut("attache.stats_port") {
                    let chart = p.as_u64().expect("a stats port") as u16;
                    *p = json!(r.port(chart));
                }
                m.values_mut().for_each(|x| walk(x, r, host_dns, host_grpc));
            }
            Value::Array(a) => a.iter_mut().for_each(|x| walk(x, r, host_dns, host_grpc)),
            _ => {}
        }
    }
    let mut v: Value = serde_yaml::from_str(bootstrap).expect("bootstrap YAML");
    walk(&mut v, replica, host_dns, host_grpc);
    serde_yaml::to_string(&v)
        .expect("YAML")
        .replace("/etc/attache/wasm/attache_scheduler.wasm", &wasm.display().to_string())
}

/// Reads the host's admin API with the chart's bearer token.
async fn admin(http: &reqwest::Client, port: u16, path: &str) -> Value {
    let r = http.get(format!("http://127.0.0.1:{port}{path}")).bearer_auth(TOKEN).send().await.expect("admin API");
    r.json().await.unwrap_or(Value::Null)
}

/// A request loop over both replicas, each request with a session id (the canary is per
/// session), recording which scorer arm served.
struct Loop {
    stop: Arc<AtomicBool>,
    served: Arc<Mutex<Vec<(u16, String)>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Loop {
    fn start(urls: Vec<String>, workers: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(Mutex::new(Vec::new()));
        let tasks = (0..workers)
            .map(|w| {
                let (stop, served, urls) = (stop.clone(), served.clone(), urls.clone());
                tokio::spawn(async move {
                    let http = reqwest::Client::new();
                    let mut n = w;
                    while !stop.load(Ordering::Relaxed) {
                        let sid = format!("session-{}", n % 200);
                        let url = &urls[n % urls.len()];
                        n += workers;
                        let body = client::chat_body(MODEL, &format!("prefix of {sid}"), "hello", 2);
                        let o = client::post(&http, url, body, &[("x-session-id", &sid)]).await;
                        let arm = o.header("x-attache-scorers").unwrap_or("").to_owned();
                        served.lock().unwrap().push((if o.ok() { o.status } else { 0 }, arm));
                    }
                })
            })
            .collect();
        Self { stop, served, tasks }
    }

    async fn finish(self) -> Vec<(u16, String)> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("loop task");
        }
        self.served.lock().unwrap().clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_gateway_schedules_falls_back_and_rolls_out_as_rendered() {
    let api = FakeApiServer::start().await.expect("stand-in API server");
    let mut s = Stack::new("chart-gateway").expect("stack");
    s.start_sim(small_pool()).expect("sim");
    let victim = s.start_extra_engine().expect("an engine in its own process");
    let engine_ports: Vec<u16> = s.engine_addrs().iter().filter_map(|a| a.rsplit(':').next()?.parse().ok()).collect();

    // The chart, rendered with the policy service (one slot, its state in the API server), two
    // gateway replicas and an InferencePool over the engines' ports.
    let ports_set =
        format!("pool.targetPorts={{{}}}", engine_ports.iter().map(u16::to_string).collect::<Vec<_>>().join(","));
    let sets = [
        "policy.enabled=true",
        "policy.trustedKeysConfigMap=keys",
        "policy.slots={slo}",
        "policy.auto.enabled=true",
        "policy.auto.promote=true",
        "policy.auto.interval_ms=200",
        "policy.auto.min_requests=40",
        "policy.auto.min_duration_ms=2000",
        "policy.auto.max_added_latency_ms=1000",
        "gateway.replicas=2",
        // Scrapes once a second, so a killed engine stays in the pool for a moment, as it does
        // in a cluster until the kubelet and a scrape notice: the test sees the fallback.
        "host.scrapeIntervalMs=1000",
        "host.unreadyAfterMs=5000",
        "pool.create=true",
        "pool.selector.app=vllm",
        &ports_set,
    ];
    let helm = Helm::new(&s.paths.root);
    let docs = documents(&helm.template(RELEASE, NS, None, &sets).expect("helm template"));
    let config_map = |key: &str| -> String {
        of_kind(&docs, "ConfigMap").iter().find_map(|c| c["data"][key].as_str()).expect(key).to_owned()
    };
    let deployment = |component: &str| -> Value {
        of_kind(&docs, "Deployment")
            .into_iter()
            .find(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == component)
            .cloned()
            .expect(component)
    };
    let gateway = deployment("gateway");
    assert_eq!(gateway["spec"]["replicas"], 2);

    // The stand-in API server holds the chart's InferencePool and one engine pod.
    let pool = of_kind(&docs, "InferencePool")[0].clone();
    api.apply(pool);
    api.apply(fake_kube::pod(NS, "vllm-0", &[("app", "vllm")], "127.0.0.1", true));

    // The host, from the rendered host.yaml.
    let keys = s.workdir.join("keys");
    let out = Command::new(&s.paths.host_bin).args(["policy", "keygen", "--out"]).arg(&keys).output().expect("keygen");
    assert!(out.status.success(), "keygen: {}", String::from_utf8_lossy(&out.stderr));
    let token_file = s.workdir.join("admin.token");
    std::fs::write(&token_file, TOKEN).expect("token");
    let mut host: Value = serde_yaml::from_str(&config_map("host.yaml")).expect("host.yaml");
    let (grpc, admin_port) = (s.host_grpc_port, s.host_admin_port);
    host["grpc_listen"] = json!(format!("127.0.0.1:{grpc}"));
    host["admin_listen"] = json!(format!("127.0.0.1:{admin_port}"));
    host["admin_token_file"] = json!(token_file);
    host["policy"]["admin_token_file"] = json!(token_file);
    host["policy"]["trust"] = json!(keys);
    host["policy"]["store_dir"] = json!(s.workdir.join("store"));
    host["kubernetes"]["kubeconfig"] = json!(api.kubeconfig(&s.workdir).expect("kubeconfig"));
    host["policy"]["kubernetes"]["kubeconfig"] = json!(api.kubeconfig(&s.workdir).expect("kubeconfig"));
    let host_file = s.workdir.join("host.yaml");
    std::fs::write(&host_file, host.to_string()).expect("host config");
    let p = s
        .spawn(
            "host",
            Command::new(&s.paths.host_bin)
                .args(["host", "--config"])
                .arg(&host_file)
                .env("RUST_LOG", "info")
                .env_remove("ATTACHE_ADMIN_TOKEN"),
        )
        .expect("host");
    s.host = Some(p);
    assert!(wait_until(Duration::from_secs(20), || port_open(grpc)), "the host did not listen");

    // Two gateway replicas, from the rendered bootstrap and the Deployment's arguments.
    let bootstrap = config_map("envoy.yaml");
    let chart_ports: Vec<u16> = {
        let v: Value = serde_yaml::from_str(&bootstrap).unwrap();
        let mut ports = BTreeSet::new();
        ports.insert(v["admin"]["address"]["socket_address"]["port_value"].as_u64().unwrap() as u16);
        for l in v["static_resources"]["listeners"].as_array().unwrap() {
            ports.insert(l["address"]["socket_address"]["port_value"].as_u64().unwrap() as u16);
        }
        ports.into_iter().collect()
    };
    let host_dns = format!("{RELEASE}-attache-host-peers.{NS}.svc.cluster.local");
    let container = &gateway["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<String> =
        container["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    let named_port = |name: &str| -> u16 {
        container["ports"].as_array().unwrap().iter().find(|p| p["name"] == name).unwrap()["containerPort"]
            .as_u64()
            .unwrap() as u16
    };
    let (http_port, metrics_port) = (named_port("http"), named_port("metrics"));
    let replicas: Vec<Replica> = ["llama-attache-gateway-7d9f-a", "llama-attache-gateway-7d9f-b"]
        .iter()
        .map(|n| Replica::new(n, &chart_ports))
        .collect();
    for r in &replicas {
        let file = s.workdir.join(format!("{}.yaml", r.name));
        std::fs::write(&file, as_replica(&bootstrap, r, &host_dns, grpc, &s.paths.wasm)).expect("bootstrap");
        let args: Vec<String> = args
            .iter()
            .map(|a| a.replace("/etc/envoy/envoy.yaml", &file.display().to_string()).replace("$(POD_NAME)", &r.name))
            .collect();
        let admin = r.port(9901);
        let p = s
            .spawn(
                &r.name,
                Command::new(&s.paths.envoy)
                    .args(&args)
                    .args(["--log-level", "warn", "--base-id"])
                    .arg(admin.to_string()),
            )
            .expect("envoy");
        s.extra_procs.push(p);
        assert!(
            wait_until(Duration::from_secs(30), || http_get_blocking(admin, "/ready")
                .is_some_and(|b| b.contains("LIVE"))),
            "replica {} not ready; see its log in {}",
            r.name,
            s.workdir.display()
        );
    }

    // Both replicas' filters hold a snapshot with every discovered engine, and their pools
    // (EDS from the host) list them.
    let http = reqwest::Client::new();
    let engines = engine_ports.len();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let snap = admin(&http, admin_port, "/v1/snapshot").await;
        let ready = snap["endpoints"].as_array().map_or(0, |a| a.iter().filter(|e| e["ready"] == true).count());
        let seen = replicas.iter().all(|r| {
            let stats = http_get_blocking(r.port(9901), "/stats").unwrap_or_default();
            stat_value(&stats, "wasmcustom.attache.snapshot.version") >= snap["version"].as_u64().unwrap_or(u64::MAX)
                && stat_value(&stats, "cluster.pool.membership_total") == engines as u64
        });
        if ready == engines && seen {
            break;
        }
        assert!(Instant::now() < deadline, "the replicas never held every engine: host snapshot {snap}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Scheduled requests route, through each replica; a shared prefix sticks to one engine.
    let fresh = fresh_client();
    for r in &replicas {
        let url = format!("http://127.0.0.1:{}/v1/chat/completions", r.port(http_port));
        let mut engines_seen = BTreeMap::<u16, usize>::new();
        for i in 0..8 {
            let o = client::post(&fresh, &url, chat(&long_prefix(&r.name), &format!("question {i}"), 2), &[]).await;
            assert_eq!(o.status, 200, "{}: {} {:?}", r.name, o.body, o.error);
            *engines_seen.entry(o.engine_port.expect("served by an engine")).or_default() += 1;
        }
        let top = engines_seen.values().max().copied().unwrap_or(0);
        assert!(top >= 7, "{}: a shared prefix should stick to one engine: {engines_seen:?}", r.name);
        let stats = http_get_blocking(r.port(9901), "/stats").unwrap_or_default();
        assert!(
            stat_value(&stats, "wasmcustom.attache.requests.scheduled") >= 1,
            "{}: the scheduler filter scheduled them",
            r.name
        );
    }

    // /v1/models is the filter's own answer, from the snapshot: the pool's models.
    let models = http
        .get(format!("http://127.0.0.1:{}/v1/models", replicas[0].port(http_port)))
        .send()
        .await
        .expect("GET /v1/models");
    assert_eq!(models.status(), 200);
    let models: Value = models.json().await.expect("model list");
    assert_eq!(models["data"][0]["id"], MODEL, "{models}");

    // A killed engine's requests fall back. A prefix that lives on the victim is picked for it
    // right after the kill, before any scrape notices; the connect failure moves the request to
    // the next endpoint of the header.
    let url0 = format!("http://127.0.0.1:{}/v1/chat/completions", replicas[0].port(http_port));
    let victim_port: u16 = victim.rsplit(':').next().unwrap().parse().unwrap();
    let on_victim = {
        let mut found = None;
        for t in 0..40 {
            let prefix = long_prefix(&format!("victim-{t}"));
            let o = client::post(&fresh, &url0, chat(&prefix, "warm", 2), &[]).await;
            if o.engine_port == Some(victim_port) {
                found = Some(prefix);
                break;
            }
        }
        found.expect("some prefix lands on the victim")
    };
    let retries_before = stat_value(
        &http_get_blocking(replicas[0].port(9901), "/stats").unwrap_or_default(),
        "cluster.pool.upstream_rq_retry",
    );
    s.kill_extra_engine(&victim);
    let mut statuses = Vec::new();
    for i in 0..16 {
        let prompt = if i % 2 == 0 { on_victim.clone() } else { format!("after the kill {i}") };
        let o = client::post(&fresh, &url0, chat(&prompt, &format!("q{i}"), 2), &[]).await;
        statuses.push((o.status, o.engine_port));
    }
    assert!(statuses.iter().all(|(st, port)| *st == 200 && *port != Some(victim_port)), "{statuses:?}");
    let retried = stat_value(
        &http_get_blocking(replicas[0].port(9901), "/stats").unwrap_or_default(),
        "cluster.pool.upstream_rq_retry",
    ) - retries_before;
    assert!(retried >= 1, "the victim's prefix was picked for the dead engine and retried on a fallback");
    println!("killed engine: 16/16 answered by the others, {retried} retried onto a fallback");

    // A scorer canary, rolled out through the host's API and promoted by its controller, which
    // finds both replicas through their ECDS streams and reads their stats on the chart's
    // stats port.
    let cli = |args: &[&str]| {
        let out = Command::new(&s.paths.host_bin)
            .arg("policy")
            .args(args)
            .args(["--server", &format!("http://127.0.0.1:{admin_port}")])
            .env("ATTACHE_ADMIN_TOKEN", TOKEN)
            .output()
            .expect("attache policy");
        assert!(out.status.success(), "attache policy {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let signed = s.workdir.join("slo.signed.wasm");
    let out = Command::new(&s.paths.host_bin)
        .args(["policy", "sign", "--key"])
        .arg(keys.join("attache.key"))
        .arg("--in")
        .arg(s.paths.module("attache_scorer_slo_ttft"))
        .arg("--out")
        .arg(&signed)
        .output()
        .expect("sign");
    assert!(out.status.success(), "sign: {}", String::from_utf8_lossy(&out.stderr));
    cli(&["upload", "--slot", "slo", "--version", "v1", "--in", signed.to_str().unwrap(), "--params", "{}"]);
    let urls: Vec<String> =
        replicas.iter().map(|r| format!("http://127.0.0.1:{}/v1/chat/completions", r.port(http_port))).collect();
    let load = Loop::start(urls, 4);
    cli(&["rollout", "--slot", "slo", "--module", "v1", "--canary", "30%"]);
    let deadline = Instant::now() + Duration::from_secs(40);
    let (promoted, status) = loop {
        let st = admin(&http, admin_port, "/v1/policy/status").await;
        let last = st["transitions"].as_array().and_then(|t| t.last()).cloned().unwrap_or_default();
        if last["action"] == "promote" {
            break (last, st);
        }
        assert!(last["action"] != "rollback", "a healthy canary was rolled back: {last}");
        assert!(Instant::now() < deadline, "no promotion by the controller: {st}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(promoted["by"], "controller", "{promoted}");
    let mut stats_from: Vec<String> =
        status["stats_from"].as_array().unwrap().iter().map(|u| u.as_str().unwrap().to_owned()).collect();
    stats_from.sort();
    let mut want: Vec<String> = replicas.iter().map(|r| format!("http://127.0.0.1:{}", r.port(metrics_port))).collect();
    want.sort();
    assert_eq!(stats_from, want, "the controller reads each replica's stats port");
    let served = load.finish().await;
    let failed = served.iter().filter(|(st, _)| *st != 200).count();
    let canary = served.iter().filter(|(_, arm)| arm.contains("canary")).count();
    assert_eq!(failed, 0, "no request failed during the rollout ({} sent)", served.len());
    assert!(canary > 0, "the canary served some sessions");

    // Each replica acknowledged the slot's filters under its own node id.
    let acks = &status["envoy"];
    for r in &replicas {
        let node = &acks[&r.name];
        assert!(
            node["attache.scorer.slo.canary"]["acked"].is_string() || node["attache.scorer.slo"]["acked"].is_string(),
            "{} acknowledged the slot under its own node id: {acks}",
            r.name
        );
    }
    assert!(acks.get("attache-gateway").is_none(), "no replica ACKs under the bootstrap's shared id: {acks}");
    println!(
        "chart gateway: {} requests during the rollout, {canary} on the canary, promoted: {}",
        served.len(),
        promoted["reason"]
    );
}
