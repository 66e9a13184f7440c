//! The chart's Istio modes (the scheduler filter in the gateway; Istio's own InferencePool support
//! calling the host's endpoint picker) and its Envoy Gateway mode, on the real Envoy 1.40.
//! Neither istiod nor Envoy
//! Gateway can be installed here, so each test renders the chart with `helm template`, derives
//! the Envoy configuration that controller would send for the rendered objects by following its
//! translation source (`attache_e2e::controllers`, which names the files, at
//! istio/istio@86c9f01fd735fb01d8192f5bcaf0d424afb7f14c and
//! envoyproxy/gateway@d32f28294245e454d20f81d323d626a90e660c1e), runs it on Envoy against
//! simulated engines and the host, and carries traffic through it:
//! - shared prefixes stick to one engine, and a saturated engine is avoided;
//! - the endpoint the scheduler named is the one that served (the access log);
//! - nothing hangs: every request answers within its timeout, and `/v1/models` is answered
//!   from the snapshot (by the filter, or by the picker);
//! - the module Envoy runs is the one whose sha256 the objects pin (the derivation refuses
//!   another, as istio-agent and Envoy Gateway's cache do);
//! - with Istio's picker mode, the chart's EnvoyFilter is what makes it work: without it, Envoy
//!   sends Istio's cluster name (`outbound|9002||…`) as the gRPC authority and the picker's
//!   HTTP/2 server refuses the stream.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::controllers::{envoy_gateway, istio, Local};
use attache_e2e::helm::{documents, Helm};
use attache_e2e::ports::free_port;
use attache_e2e::process::wait_until;
use attache_e2e::stats::stat_value;
use attache_e2e::{client, SimOpts, Stack};
use common::*;
use serde_json::Value;
use sha2::{Digest, Sha256};

const NS: &str = "ml";
const HOST_FQDN: &str = "llama-attache-host.ml.svc.cluster.local";
const MODULE_URL: &str = "https://releases.example.com/attache/attache_scheduler.wasm";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// The scheduler filter in an Istio gateway (EnvoyFilter).
    Istio,
    /// Istio's own InferencePool support calling the host's endpoint picker.
    IstioPicker,
    /// The scheduler filter in Envoy Gateway (EnvoyExtensionPolicy + EnvoyPatchPolicy).
    EnvoyGateway,
}

/// The chart rendered for `mode`, its module pinned to `pin`.
fn render(s: &Stack, mode: Mode, pin: &str) -> Vec<Value> {
    let ports: std::collections::BTreeSet<u16> =
        s.engine_addrs().iter().filter_map(|a| a.rsplit(':').next()?.parse().ok()).collect();
    let mut sets = vec![
        "gatewayApi.enabled=true".to_owned(),
        "gatewayApi.parentRef.name=inference-gateway".to_owned(),
        "gatewayApi.pathPrefix=/v1".to_owned(),
        "pool.create=true".to_owned(),
        "pool.selector.app=vllm".to_owned(),
        format!("pool.targetPorts={{{}}}", ports.iter().map(u16::to_string).collect::<Vec<_>>().join(",")),
    ];
    match mode {
        Mode::Istio | Mode::EnvoyGateway => {
            let key = if mode == Mode::Istio { "istio" } else { "envoyGateway" };
            sets.extend([
                format!("{key}.enabled=true"),
                format!("{key}.scheduler.url={MODULE_URL}"),
                format!("{key}.scheduler.sha256={pin}"),
            ]);
        }
        Mode::IstioPicker => sets.extend(["istio.enabled=true".to_owned(), "istio.mode=picker".to_owned()]),
    }
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    documents(&Helm::new(&s.paths.root).template("llama", NS, None, &sets).expect("helm template"))
}

/// The host, with the endpoint picker of the rendered host.yaml when it has one (its
/// certificate files replaced by a self-signed pair, its listeners by free ports).
fn start_host(s: &mut Stack, docs: &[Value]) {
    let host_yaml = docs.iter().find_map(|d| d["data"]["host.yaml"].as_str()).expect("host.yaml");
    let host: Value = serde_yaml::from_str(host_yaml).expect("host.yaml");
    if let Some(epp) = host.get("epp") {
        let mut epp = epp.clone();
        epp.as_object_mut().unwrap().remove("listen");
        epp["health_listen"] = serde_json::json!(format!("127.0.0.1:{}", free_port()));
        if epp.get("tls").is_some() {
            let (cert, key) = (s.workdir.join("epp.crt"), s.workdir.join("epp.key"));
            let ok = Command::new("openssl")
                .args([
                    "req",
                    "-x509",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:prime256v1",
                    "-nodes",
                    "-days",
                    "1",
                ])
                .args(["-subj", "/CN=attache-epp", "-keyout"])
                .arg(&key)
                .arg("-out")
                .arg(&cert)
                .stderr(std::process::Stdio::null())
                .status()
                .expect("openssl")
                .success();
            assert!(ok, "openssl req");
            epp["tls"] = serde_json::json!({"cert_file": cert, "key_file": key});
        }
        s.host_epp = Some(epp);
    }
    s.start_host().expect("host");
}

/// Derive the controller's Envoy configuration for `docs` and start Envoy on it.
fn start_envoy(
    s: &mut Stack,
    mode: Mode,
    docs: &[Value],
    name: &str,
) -> Result<(u16, u16, std::path::PathBuf), String> {
    let (listen, admin) = (free_port(), free_port());
    let local = Local {
        listen: SocketAddr::from(([127, 0, 0, 1], listen)),
        admin: SocketAddr::from(([127, 0, 0, 1], admin)),
        // What the controllers' EDS would list: each engine a pod of the InferencePool (Istio)
        // or of the Service (Envoy Gateway). Here they share one IP and differ by port.
        endpoints: s.engine_addrs().iter().map(|a| a.parse().unwrap()).collect(),
        host_grpc: SocketAddr::from(([127, 0, 0, 1], s.host_grpc_port)),
        epp: s.host_epp.as_ref().map(|_| SocketAddr::from(([127, 0, 0, 1], s.host_epp_port))),
        modules: BTreeMap::from([(MODULE_URL.to_owned(), s.paths.wasm.clone())]),
        access_log: s.workdir.join(format!("{name}-access.log")),
        ecds_dir: {
            let d = s.workdir.join(format!("{name}-ecds"));
            std::fs::create_dir_all(&d).expect("ECDS dir");
            d
        },
    };
    let yaml = match mode {
        Mode::Istio | Mode::IstioPicker => istio::bootstrap(docs, &local, HOST_FQDN),
        Mode::EnvoyGateway => envoy_gateway::bootstrap(docs, &local, HOST_FQDN),
    }
    .map_err(|e| e.to_string())?;
    let file = s.workdir.join(format!("{name}.yaml"));
    std::fs::write(&file, yaml).expect("bootstrap");
    let p = s
        .spawn(
            &format!("envoy-{name}"),
            Command::new(&s.paths.envoy)
                .arg("-c")
                .arg(&file)
                .args(["--concurrency", "2", "--log-level", "warn", "--component-log-level", "wasm:info", "--base-id"])
                .arg(admin.to_string()),
        )
        .expect("envoy");
    s.extra_procs.push(p);
    let ready =
        wait_until(Duration::from_secs(30), || http_get_blocking(admin, "/ready").is_some_and(|b| b.contains("LIVE")));
    assert!(ready, "Envoy did not start on the derived {name} configuration; see {}", s.workdir.display());
    Ok((listen, admin, local.access_log))
}

/// A host metric's value summed over its series (0 when absent).
fn host_metric(s: &Stack, name: &str) -> f64 {
    let text = http_get_blocking(s.host_admin_port, "/metrics").unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Requests through the mode's gateway: stickiness, saturation, picked == served, no hang.
async fn carries_traffic(mode: Mode) {
    let mut s = Stack::new(&format!("{mode:?}").to_lowercase()).expect("stack");
    // Three engines as a Service's pods: one address each, one port (the chart's modes that run
    // the filter take one target port, as Istio's and Envoy Gateway's pool clusters do).
    s.sim_opts = SimOpts { engines: 0, max_num_seqs: 2, time_scale: 1.0, ..SimOpts::default() };
    s.start_engine_pods(3).expect("engine pods");
    let pin = format!("{:x}", Sha256::digest(std::fs::read(&s.paths.wasm).expect("the scheduler module")));
    let docs = render(&s, mode, &pin);
    start_host(&mut s, &docs);
    wait_ready_engines(&s, 3).await;

    let (listen, admin, log) = if mode == Mode::IstioPicker {
        // Without the chart's EnvoyFilter, Istio's cluster name reaches the picker as the gRPC
        // authority, and the picker's HTTP/2 server refuses the stream before any request.
        let bare: Vec<Value> = docs.iter().filter(|d| d["kind"] != "EnvoyFilter").cloned().collect();
        let (listen, _, _) = start_envoy(&mut s, mode, &bare, "istio-bare").expect("derived configuration");
        let before = host_metric(&s, "attache_epp_requests_total");
        let o = client::post(
            &fresh_client(),
            &format!("http://127.0.0.1:{listen}/v1/chat/completions"),
            chat("x", "y", 2),
            &[],
        )
        .await;
        assert_eq!(o.status, 500, "the picker refuses Istio's cluster name as authority: {}", o.body);
        assert_eq!(host_metric(&s, "attache_epp_requests_total"), before, "no request reached the picker");
        println!("IstioPicker without the authority patch: {} {}", o.status, o.body);
        let (listen, admin, log) = start_envoy(&mut s, mode, &docs, "istio-picker").expect("derived configuration");
        (listen, admin, log)
    } else {
        // The fetcher refuses a module whose sha256 is not the pinned one.
        let wrong = format!("{:x}", Sha256::digest(b"another module"));
        let other = render(&s, mode, &wrong);
        let refused = start_envoy(&mut s, mode, &other, "refused").expect_err("another sha256 is refused");
        assert!(refused.contains("sha256"), "{refused}");
        let (listen, admin, log) =
            start_envoy(&mut s, mode, &docs, &format!("{mode:?}")).expect("derived configuration");
        // Every worker's scheduler streams snapshots (no bootstrap singleton): Envoy's main
        // thread and both workers hold a stream, and the filters have the host's snapshot.
        let streams = wait_until(Duration::from_secs(10), || host_metric(&s, "attache_host_subscribers") >= 3.0);
        assert!(streams, "one snapshot stream per worker: {}", host_metric(&s, "attache_host_subscribers"));
        let host_version = || {
            let b = http_get_blocking(s.host_admin_port, "/v1/snapshot").unwrap_or_default();
            serde_json::from_str::<Value>(&b).ok().and_then(|v| v["version"].as_u64()).unwrap_or(u64::MAX)
        };
        let seen = wait_until(Duration::from_secs(20), || {
            let stats = http_get_blocking(admin, "/stats").unwrap_or_default();
            stat_value(&stats, "wasmcustom.attache.snapshot.version") >= host_version()
        });
        assert!(seen, "the filters never received the host's snapshot (host at version {})", host_version());
        (listen, admin, log)
    };

    let url = format!("http://127.0.0.1:{listen}/v1/chat/completions");
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).timeout(Duration::from_secs(20)).build().unwrap();
    let mut sent = 0;

    // Shared prefixes stick.
    let mut homes = Vec::new();
    for g in 0..2 {
        let prefix = long_prefix(&format!("{mode:?}-tenant-{g}"));
        let mut engines = BTreeMap::<String, usize>::new();
        for q in 0..6 {
            let o = client::post(&http, &url, chat(&prefix, &format!("q{q}"), 2), &[]).await;
            sent += 1;
            assert_eq!(o.status, 200, "{mode:?}: {} {:?}", o.body, o.error);
            *engines.entry(o.engine_address.clone().unwrap()).or_default() += 1;
        }
        assert_eq!(engines.len(), 1, "{mode:?}: prefix {g} should stick to one engine: {engines:?}");
        homes.push(engines.keys().next().unwrap().clone());
    }

    // A saturated engine is avoided, even by the prefix it holds.
    let hot = homes[0].clone();
    let flood = load_engine_at(&http, &hot, 10, 3000);
    let waiting = wait_for_queue_at(&s, &hot, 5.0).await;
    assert!(waiting >= 5.0, "the flood did not build a queue (waiting {waiting})");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let prefix = long_prefix(&format!("{mode:?}-tenant-0"));
    for q in 0..5 {
        let o = client::post(&http, &url, chat(&prefix, &format!("busy {q}"), 2), &[]).await;
        sent += 1;
        assert_eq!(o.status, 200, "{mode:?}: {}", o.body);
        assert_ne!(
            o.engine_address.as_deref(),
            Some(hot.as_str()),
            "{mode:?}: request {q} went to the saturated engine"
        );
    }
    for f in flood {
        f.abort();
    }

    // /v1/models is answered from the snapshot, by the filter or the picker: the pool's model.
    let models = http.get(format!("http://127.0.0.1:{listen}/v1/models")).send().await.expect("GET /v1/models");
    assert_eq!(models.status(), 200);
    let list: Value = models.json().await.expect("model list");
    assert_eq!(list["data"][0]["id"], MODEL, "{mode:?}: {list}");
    sent += 1;

    // Concurrent requests: every one answers within its timeout (nothing hangs in the filter).
    let started = Instant::now();
    let batch: Vec<_> = (0..24)
        .map(|i| {
            let (http, url) = (http.clone(), url.clone());
            tokio::spawn(async move { client::post(&http, &url, chat(&format!("burst {i}"), "hi", 2), &[]).await })
        })
        .collect();
    for b in batch {
        let o = b.await.unwrap();
        sent += 1;
        assert!(o.ok(), "{mode:?}: {} {:?}", o.status, o.error);
    }
    let burst = started.elapsed();

    // In the filter mode, the route's endpoint-picker call is off: no ext_proc stream started
    // (in the picker mode, every request started one: the stat is the right one).
    let ext_proc = stat_value(
        &http_get_blocking(admin, "/stats").unwrap_or_default(),
        "http.outbound_0.0.0.0_80.ext_proc.streams_started",
    );
    match mode {
        Mode::Istio => assert_eq!(ext_proc, 0, "the route's ext_proc call is disabled"),
        Mode::IstioPicker => assert!(ext_proc as usize >= sent - 1, "every request asked the picker: {ext_proc}"),
        Mode::EnvoyGateway => {}
    }

    // The endpoint the scheduler named is the one that served (Istio: also what the pool read
    // from envoy.lb).
    let lines = wait_lines(&log, sent);
    let mut scheduled = 0;
    for l in &lines {
        let v: Value = serde_json::from_str(l).expect("access log JSON");
        let picked = v["picked"].as_str().unwrap_or("-");
        if picked == "-" {
            continue; // GET /v1/models, answered by the gateway
        }
        scheduled += 1;
        let first = picked.split(',').next().unwrap();
        assert_eq!(v["served"], first, "{mode:?}: named {picked}, served {}", v["served"]);
        if matches!(mode, Mode::Istio | Mode::IstioPicker) {
            assert_eq!(v["metadata"], picked, "{mode:?}: the pool reads the pick from envoy.lb");
        }
    }
    // Every POST was scheduled; GET /v1/models was answered by the gateway itself.
    assert_eq!(scheduled, sent - 1, "{mode:?}: every POST was scheduled: {lines:#?}");
    println!("{mode:?}: {sent} requests answered, {scheduled} scheduled, each served where named; 24 concurrent in {burst:?}");
}

/// Wait until the host's snapshot has `n` ready engines.
async fn wait_ready_engines(s: &Stack, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let b = http_get_blocking(s.host_admin_port, "/v1/snapshot").unwrap_or_default();
        let v: Value = serde_json::from_str(&b).unwrap_or(Value::Null);
        let ready = v["endpoints"].as_array().map_or(0, |a| a.iter().filter(|e| e["ready"] == true).count());
        if ready == n {
            return;
        }
        assert!(Instant::now() < deadline, "the host never had {n} ready engines: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The access log's lines once it has `n` (Envoy flushes it every second), or what it has after 10 s.
fn wait_lines(path: &std::path::Path, n: usize) -> Vec<String> {
    let read = || std::fs::read_to_string(path).unwrap_or_default().lines().map(str::to_owned).collect::<Vec<_>>();
    let deadline = Instant::now() + Duration::from_secs(10);
    while read().len() < n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    read()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_mode_schedules_through_the_configuration_istiod_would_send() {
    carries_traffic(Mode::Istio).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_picker_mode_schedules_through_istios_inference_pool_and_the_hosts_picker() {
    carries_traffic(Mode::IstioPicker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gateway_mode_schedules_through_the_configuration_envoy_gateway_would_send() {
    carries_traffic(Mode::EnvoyGateway).await;
}
