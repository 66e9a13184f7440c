//! From watched objects to the endpoint list: which pods of which pools are endpoints, at which
//! addresses, with which role, engine and models. Pure functions over the reflector stores, so
//! the rules are unit-tested without an API server.
//!
//! Rules (documented in `docs/kubernetes.md`):
//! - a pod belongs to a pool when it is in the pool's namespace and carries every label of the
//!   pool's `selector.matchLabels` (an empty selector selects nothing, not the namespace);
//! - it is an endpoint only while it has a pod IP, its `Ready` condition is `True` and it is not
//!   terminating (no `deletionTimestamp`);
//! - each of the pool's `targetPorts` is its own endpoint `podIP:port` (data-parallel ranks);
//! - role from `llm-d.ai/role` (`prefill`, `decode`, `both`; `prefill-decode` reads as `both`),
//!   engine from `llm-d.ai/engine-type` (`vllm` default, `sglang`);
//! - models from the pod's `attache.io/models` annotation (comma-separated), else the pool's,
//!   else what the engine's metrics say it serves;
//! - KV events: `attache.io/kv-events-port` (the engine's PUB port) and
//!   `attache.io/kv-replay-port` annotations; without them, engines publish to the host's
//!   collector.

use std::collections::{BTreeMap, BTreeSet};

use attache_kv::engine::Engine;
use k8s_openapi::api::core::v1::Pod;

use super::crds::{InferencePool, ObjectiveSpec};
use crate::endpoints::{KvEventsSpec, StaticEndpoint};

pub const ROLE_LABEL: &str = "llm-d.ai/role";
pub const ENGINE_LABEL: &str = "llm-d.ai/engine-type";
pub const MODELS_ANNOTATION: &str = "attache.io/models";
pub const KV_EVENTS_PORT_ANNOTATION: &str = "attache.io/kv-events-port";
pub const KV_REPLAY_PORT_ANNOTATION: &str = "attache.io/kv-replay-port";
/// Set on every endpoint: the pool it came from, `namespace/name`.
pub const POOL_LABEL: &str = "attache.io/pool";

/// Whether the pool is one this host serves (`names` empty: every pool in scope).
pub fn pool_selected(pool: &InferencePool, names: &[String]) -> bool {
    names.is_empty() || pool.metadata.name.as_ref().is_some_and(|n| names.iter().any(|w| w == n))
}

fn is_ready(pod: &Pod) -> bool {
    if pod.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let Some(st) = &pod.status else { return false };
    st.pod_ip.as_deref().is_some_and(|ip| !ip.is_empty())
        && st.conditions.as_ref().is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn selects(pool: &InferencePool, pod: &Pod) -> bool {
    let want = &pool.spec.selector.match_labels;
    if want.is_empty() || pool.metadata.namespace != pod.metadata.namespace {
        return false;
    }
    let labels = pod.metadata.labels.as_ref();
    want.iter().all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
}

fn role_of(pod: &Pod) -> String {
    match pod.metadata.labels.as_ref().and_then(|l| l.get(ROLE_LABEL)).map(String::as_str) {
        Some("prefill") => "prefill".into(),
        Some("decode") => "decode".into(),
        _ => "both".into(),
    }
}

fn annotation<'a>(meta: &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta, key: &str) -> Option<&'a str> {
    meta.annotations.as_ref().and_then(|a| a.get(key)).map(String::as_str).filter(|v| !v.trim().is_empty())
}

fn split_models(v: &str) -> Vec<String> {
    v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect()
}

fn host_port(ip: &str, port: i32) -> String {
    if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    }
}

/// The endpoints of the selected pools, sorted by address; an address selected by two pools
/// appears once (the first pool by namespace/name wins).
pub fn endpoints<'a>(
    pools: impl IntoIterator<Item = &'a InferencePool>,
    pods: impl IntoIterator<Item = &'a Pod> + Clone,
    names: &[String],
) -> Vec<StaticEndpoint> {
    let mut pools: Vec<&InferencePool> = pools.into_iter().filter(|p| pool_selected(p, names)).collect();
    pools.sort_by(|a, b| (&a.metadata.namespace, &a.metadata.name).cmp(&(&b.metadata.namespace, &b.metadata.name)));
    let mut out: BTreeMap<String, StaticEndpoint> = BTreeMap::new();
    for pool in pools {
        let pool_id = format!(
            "{}/{}",
            pool.metadata.namespace.as_deref().unwrap_or(""),
            pool.metadata.name.as_deref().unwrap_or("")
        );
        let ports: BTreeSet<i32> =
            pool.spec.target_ports.iter().map(|p| p.number).filter(|n| (1..=65535).contains(n)).collect();
        for pod in pods.clone().into_iter().filter(|p| selects(pool, p) && is_ready(p)) {
            let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()) else { continue };
            let models = annotation(&pod.metadata, MODELS_ANNOTATION)
                .or_else(|| annotation(&pool.metadata, MODELS_ANNOTATION))
                .map(split_models)
                .unwrap_or_default();
            let label = pod.metadata.labels.as_ref().and_then(|l| l.get(ENGINE_LABEL));
            let engine = Engine::from_name(label.map_or("", String::as_str)).name();
            let port_annotation = |key| annotation(&pod.metadata, key).and_then(|v| v.trim().parse::<u16>().ok());
            let kv_events =
                match (port_annotation(KV_EVENTS_PORT_ANNOTATION), port_annotation(KV_REPLAY_PORT_ANNOTATION)) {
                    (None, None) => None,
                    (publisher, replay) => Some(KvEventsSpec {
                        publisher: publisher.map(|p| format!("tcp://{}", host_port(ip, p.into()))),
                        replay: replay.map(|p| format!("tcp://{}", host_port(ip, p.into()))),
                    }),
                };
            let mut labels: BTreeMap<String, String> = pod.metadata.labels.clone().unwrap_or_default();
            labels.insert(POOL_LABEL.into(), pool_id.clone());
            for port in &ports {
                let address = host_port(ip, *port);
                out.entry(address.clone()).or_insert_with(|| StaticEndpoint {
                    address,
                    models: models.clone(),
                    role: role_of(pod),
                    engine: engine.into(),
                    metrics_path: "/metrics".into(),
                    kv_events: kv_events.clone(),
                    labels: labels.clone(),
                });
            }
        }
    }
    out.into_values().collect()
}

/// The priority table from `InferenceObjective`s that reference a served pool, keyed by the
/// objective's name (the `x-llm-d-inference-objective` header's value). Two objectives of the
/// same name in different namespaces: the higher priority wins, so a name never loses
/// protection because of another namespace.
pub fn objective_table<'a>(
    objectives: impl IntoIterator<Item = (String, String, ObjectiveSpec)>,
    pools: impl IntoIterator<Item = &'a InferencePool>,
    names: &[String],
) -> BTreeMap<String, i32> {
    let served: BTreeSet<(String, String)> = pools
        .into_iter()
        .filter(|p| pool_selected(p, names))
        .map(|p| (p.metadata.namespace.clone().unwrap_or_default(), p.metadata.name.clone().unwrap_or_default()))
        .collect();
    let mut out: BTreeMap<String, i32> = BTreeMap::new();
    for (name, ns, spec) in objectives {
        let pool = spec.pool_ref.as_ref().map(|r| r.name.clone()).unwrap_or_default();
        if name.is_empty() || !served.contains(&(ns, pool)) {
            continue;
        }
        let prio = spec.priority.unwrap_or(0);
        out.entry(name).and_modify(|p| *p = (*p).max(prio)).or_insert(prio);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubernetes::crds::{InferencePoolSpec, PoolRef, PoolSelector, TargetPort};
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    fn pool(ns: &str, name: &str, app: &str, ports: &[i32]) -> InferencePool {
        InferencePool {
            metadata: ObjectMeta { name: Some(name.into()), namespace: Some(ns.into()), ..Default::default() },
            spec: InferencePoolSpec {
                selector: PoolSelector { match_labels: [("app".to_string(), app.to_string())].into() },
                target_ports: ports.iter().map(|&number| TargetPort { number }).collect(),
                endpoint_picker_ref: None,
            },
        }
    }

    fn pod(ns: &str, name: &str, labels: &[(&str, &str)], ip: &str, ready: bool) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
                ..Default::default()
            },
            spec: None,
            status: Some(PodStatus {
                pod_ip: (!ip.is_empty()).then(|| ip.to_string()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn ports_roles_engines_and_membership() {
        let pools = [pool("ml", "llama", "vllm", &[8000, 8001])];
        let mut terminating = pod("ml", "d", &[("app", "vllm")], "10.0.0.4", true);
        terminating.metadata.deletion_timestamp = Some(Time(Default::default()));
        let pods = [
            pod("ml", "a", &[("app", "vllm"), (ROLE_LABEL, "prefill"), (ENGINE_LABEL, "sglang")], "10.0.0.1", true),
            pod("ml", "b", &[("app", "vllm"), (ROLE_LABEL, "decode")], "10.0.0.2", true),
            pod("ml", "c", &[("app", "vllm")], "10.0.0.3", false),
            terminating,
            pod("ml", "e", &[("app", "other")], "10.0.0.5", true),
            pod("other-ns", "f", &[("app", "vllm")], "10.0.0.6", true),
            pod("ml", "g", &[("app", "vllm")], "", true),
            pod("ml", "h", &[("app", "vllm"), (ROLE_LABEL, "prefill-decode")], "fd00::7", true),
        ];
        let eps = endpoints(&pools, &pods, &[]);
        let addrs: Vec<&str> = eps.iter().map(|e| e.address.as_str()).collect();
        assert_eq!(
            addrs,
            ["10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000", "10.0.0.2:8001", "[fd00::7]:8000", "[fd00::7]:8001"]
        );
        assert_eq!((eps[0].role.as_str(), eps[0].engine.as_str()), ("prefill", "sglang"));
        assert_eq!((eps[2].role.as_str(), eps[2].engine.as_str()), ("decode", "vllm"));
        assert_eq!(eps[4].role, "both");
        assert_eq!(eps[0].labels.get(POOL_LABEL).map(String::as_str), Some("ml/llama"));
        assert!(eps.iter().all(|e| e.address.parse::<std::net::SocketAddr>().is_ok()));
        // Pool filter by name.
        assert!(endpoints(&pools, &pods, &["another".into()]).is_empty());
        // An empty selector selects nothing.
        let mut open = pools[0].clone();
        open.spec.selector.match_labels.clear();
        assert!(endpoints(&[open], &pods, &[]).is_empty());
    }

    #[test]
    fn models_and_kv_annotations() {
        let mut p = pool("ml", "llama", "vllm", &[8000]);
        p.metadata.annotations = Some([(MODELS_ANNOTATION.to_string(), "base, base-sql".to_string())].into());
        let mut own = pod("ml", "a", &[("app", "vllm")], "10.0.0.1", true);
        own.metadata.annotations = Some(
            [
                (MODELS_ANNOTATION.to_string(), "x".to_string()),
                (KV_EVENTS_PORT_ANNOTATION.to_string(), "5557".to_string()),
                (KV_REPLAY_PORT_ANNOTATION.to_string(), "nope".to_string()),
            ]
            .into(),
        );
        let pods = [own, pod("ml", "b", &[("app", "vllm")], "10.0.0.2", true)];
        let eps = endpoints(&[p.clone()], &pods, &[]);
        assert_eq!(eps[0].models, vec!["x"]);
        let kv = eps[0].kv_events.clone().unwrap();
        assert_eq!((kv.publisher.as_deref(), kv.replay.as_deref()), (Some("tcp://10.0.0.1:5557"), None));
        assert_eq!(eps[1].models, vec!["base", "base-sql"]);
        assert!(eps[1].kv_events.is_none());
        p.metadata.annotations = None;
        assert!(endpoints(&[p], &pods[1..], &[])[0].models.is_empty(), "learned from metrics instead");
    }

    #[test]
    fn objectives_of_served_pools_only() {
        let pools = [pool("ml", "llama", "vllm", &[8000]), pool("ml", "other", "x", &[8000])];
        let spec = |prio: Option<i32>, pool: &str| ObjectiveSpec {
            priority: prio,
            pool_ref: Some(PoolRef { name: pool.into() }),
        };
        let objs = vec![
            ("chat".to_string(), "ml".to_string(), spec(Some(10), "llama")),
            ("batch".to_string(), "ml".to_string(), spec(Some(-1), "llama")),
            ("plain".to_string(), "ml".to_string(), spec(None, "llama")),
            ("elsewhere".to_string(), "other-ns".to_string(), spec(Some(5), "llama")),
            ("chat".to_string(), "ml".to_string(), spec(Some(3), "other")),
        ];
        let t = objective_table(objs.clone(), &pools, &[]);
        assert_eq!(t, BTreeMap::from([("batch".into(), -1), ("chat".into(), 10), ("plain".into(), 0)]));
        let only_other = objective_table(objs, &pools, &["other".into()]);
        assert_eq!(only_other, BTreeMap::from([("chat".into(), 3)]));
    }
}
