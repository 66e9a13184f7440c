//! Renders Envoy's bootstrap from the templates beside this crate (`envoy/`): its one job.
//!
//! One template, one renderer: `attache gateway` renders `envoy/attache.yaml` (built into the
//! binary) with an EDS-fed pool, and the test and benchmark launcher renders the same file with
//! a static pool, as written or as one of its [`Variant`]s. A variant is the template with a
//! few structural edits made here (docs/architecture.md, "Envoy bootstraps"), so the variants
//! cannot drift from it. Placeholders are `{{NAME}}`; a placeholder left unfilled is an error
//! rather than a bootstrap Envoy would refuse with a less clear message. Its dependencies stay
//! few (YAML, JSON), so the launcher renders a bootstrap without building the host.
//!
//! Beside them, two bootstraps that are not Attaché's gateway: Envoy configured the way GIE
//! gateways configure it for an endpoint picker, in their two shapes ([`EppShape`]:
//! `epp-gie.yaml`, `epp-istio.yaml`, rendered by [`render_epp`]), so the host's picker is tested
//! behind the real Envoy as those gateways run it.

use std::net::SocketAddr;
use std::path::Path;

use serde_yaml::{Mapping, Value};

mod epp;
pub use epp::{
    render_epp, render_epp_template, EppParams, EppShape, EPP_ORIGINAL_DST_TEMPLATE, EPP_OVERRIDE_HOST_TEMPLATE,
    SUBSET_HINT_HEADER,
};

/// `envoy/attache.yaml`: the recommended bootstrap (snapshot agent, scheduler, `override_host`).
pub const ATTACHE_TEMPLATE: &str = include_str!("../attache.yaml");
/// `envoy/scorer-slot.yaml`: one custom-scorer slot filter.
pub const SCORER_SLOT_TEMPLATE: &str = include_str!("../scorer-slot.yaml");
/// `envoy/scheduler-canary.yaml`: the canary scheduler filter, before the scheduler.
pub const SCHEDULER_CANARY_TEMPLATE: &str = include_str!("../scheduler-canary.yaml");
/// `envoy/picker.yaml`: the picker after the last scorer slot.
pub const PICKER_TEMPLATE: &str = include_str!("../picker.yaml");

/// The header the scheduler names its endpoints in, which the pool routes on.
const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";

/// Which shape of `envoy/attache.yaml` to render. Each variant differs from the template as
/// written by exactly the edits listed here, and nothing else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Variant {
    /// The template as written (for any template: `round-robin.yaml` is only ever rendered so).
    #[default]
    AsWritten,
    /// The `pool` cluster is `ORIGINAL_DST`, routed by the first `ip:port` of the destination
    /// header: its discovery and `load_balancing_policy` give way to `type: ORIGINAL_DST`,
    /// `lb_policy: CLUSTER_PROVIDED` and `original_dst_lb_config`. Envoy reads that header as one
    /// address, so the scheduler names one endpoint (`scheduler.max_endpoints: 1`): no
    /// fallbacks. The chart's gateway is this variant for Kubernetes.
    OriginalDst,
    /// No bootstrap singleton: `bootstrap_extensions` (the snapshot agent) is dropped and each
    /// worker's scheduler subscribes itself (`subscribe: {cluster: attache_host}`), the shape
    /// Istio's WasmPlugin can express. One snapshot stream per worker plus one, instead of one.
    PerWorker,
}

/// Where Envoy's `pool` cluster learns its members.
#[derive(Debug, Clone, PartialEq)]
pub enum Pool {
    /// Listed in the bootstrap (`ip:port` each).
    Static(Vec<String>),
    /// From the host's EDS on the `attache_host` cluster: the engines are listed once, in
    /// the host's discovery, and changes need no Envoy restart.
    Eds,
}

/// What fills the placeholders.
#[derive(Debug, Clone)]
pub struct Params<'a> {
    /// Envoy's admin listener.
    pub admin: SocketAddr,
    /// The inference listener.
    pub listen: SocketAddr,
    /// The host replicas' gRPC servers (snapshots, ECDS, EDS): the `attache_host` cluster's
    /// members. The snapshot agent fails over between them.
    pub host_grpc: &'a [SocketAddr],
    /// The scheduler filter module.
    pub wasm: &'a Path,
    /// The scheduler filter's configuration (JSON).
    pub scheduler_config: &'a serde_json::Value,
    pub pool: &'a Pool,
    /// Custom scorer slots, each with a stable and a canary arm, then the picker.
    pub scorer_slots: &'a [String],
    pub variant: Variant,
}

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("endpoint `{0}` is not ip:port")]
    BadEndpoint(String),
    #[error("unknown placeholder {0}")]
    Unknown(String),
    #[error("this template lists the pool's endpoints itself; it cannot take them from EDS")]
    NoEds,
    #[error("the scheduler configuration must be a JSON object")]
    SchedulerNotObject,
    #[error("the rendered template is not YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("the {variant:?} variant needs {missing} in the template")]
    NotAttache { variant: Variant, missing: &'static str },
    #[error("the {0:?} endpoint-picker bootstrap lists the pool's members, and none were given")]
    NoPoolEndpoints(EppShape),
}

/// The static `lb_endpoints` entries, one line each.
fn lb_endpoints(addresses: &[String]) -> Result<String, BootstrapError> {
    let mut out = String::new();
    for a in addresses {
        let sa: SocketAddr = a.parse().map_err(|_| BootstrapError::BadEndpoint(a.clone()))?;
        out.push_str(&format!(
            "        - endpoint: {{address: {{socket_address: {{address: \"{}\", port_value: {}}}}}}}\n",
            sa.ip(),
            sa.port()
        ));
    }
    Ok(out)
}

/// The `pool` cluster's discovery lines (`{{POOL_DISCOVERY}}`).
fn pool_discovery(pool: &Pool) -> Result<String, BootstrapError> {
    Ok(match pool {
        Pool::Static(addresses) => format!(
            "    type: STATIC\n    load_assignment:\n      cluster_name: pool\n      endpoints:\n      - lb_endpoints:\n{}",
            lb_endpoints(addresses)?
        ),
        Pool::Eds => "    # Members come from the host's EDS (state of the world): engines are listed once, in the\n    \
             # host's discovery, and join or leave the pool with no Envoy restart.\n    \
             type: EDS\n    \
             eds_cluster_config:\n      \
             eds_config:\n        \
             resource_api_version: V3\n        \
             api_config_source:\n          \
             api_type: GRPC\n          \
             transport_api_version: V3\n          \
             grpc_services:\n          \
             - envoy_grpc: {cluster_name: attache_host}\n"
            .to_owned(),
    })
}

/// The picker's configuration: the scheduler configuration's `scoring` section (the response
/// header, the decision log's rate) and its `fleet.lookup_cluster` (where decisions go).
fn picker_config(scheduler: &serde_json::Value) -> serde_json::Value {
    let mut picker = serde_json::json!({"role": "picker"});
    if let Some(s) = scheduler.get("scoring").filter(|s| s.is_object()) {
        picker["scoring"] = s.clone();
    }
    if let Some(c) = scheduler.get("fleet").and_then(|f| f.get("lookup_cluster")) {
        picker["fleet"] = serde_json::json!({"lookup_cluster": c});
    }
    picker
}

/// A filter template without its comment lines.
fn uncommented(t: &str) -> String {
    t.lines().filter(|l| !l.starts_with('#')).map(|l| format!("{l}\n")).collect()
}

/// The scorer-slot filters and the picker (`{{SCORER_FILTERS}}`), without the templates'
/// comment lines.
fn scorer_filters(slots: &[String]) -> String {
    if slots.is_empty() {
        return String::new();
    }
    let body = uncommented;
    let slot = body(SCORER_SLOT_TEMPLATE);
    let mut out = String::new();
    for s in slots {
        for suffix in ["", ".canary"] {
            out.push_str(&slot.replace("{{SLOT}}", s).replace("{{ARM_SUFFIX}}", suffix));
        }
    }
    out.push_str(&body(PICKER_TEMPLATE));
    out
}

/// JSON inside a single-quoted YAML scalar, where a quote is written twice.
fn quoted(v: &serde_json::Value) -> String {
    v.to_string().replace('\'', "''")
}

/// Every placeholder a template may hold.
const PLACEHOLDERS: &[&str] = &[
    "SCORER_FILTERS",
    "SCHEDULER_CANARY",
    "PICKER_CONFIG",
    "POOL_DISCOVERY",
    "POOL_ENDPOINTS",
    "ADMIN_ADDRESS",
    "ADMIN_PORT",
    "LISTEN_ADDRESS",
    "LISTEN_PORT",
    "HOST_GRPC_ENDPOINTS",
    "WASM",
    "SCHEDULER_CONFIG",
];

/// The first `{{NAME}}` in `template` (upper case and `_`) that is not in `known`. Checked on
/// the template, before any value goes in: a value may hold braces of its own (a Jinja chat
/// template in the scheduler configuration does).
fn unknown_placeholder(template: &str, known: &[&str]) -> Option<String> {
    let mut rest = template;
    while let Some(i) = rest.find("{{") {
        rest = &rest[i + 2..];
        let name: String = rest.chars().take_while(|c| c.is_ascii_uppercase() || *c == '_').collect();
        if !name.is_empty() && rest[name.len()..].starts_with("}}") && !known.contains(&name.as_str()) {
            return Some(format!("{{{{{name}}}}}"));
        }
    }
    None
}

/// The scheduler filter's configuration as the variant needs it: the scorers' context on when
/// there are scorer slots, one endpoint for `ORIGINAL_DST`, its own stream per worker.
fn scheduler_config(p: &Params<'_>) -> Result<serde_json::Value, BootstrapError> {
    if !p.scheduler_config.is_object() {
        return Err(BootstrapError::SchedulerNotObject);
    }
    let mut scheduler = p.scheduler_config.clone();
    if !p.scorer_slots.is_empty() {
        scheduler["scoring"]["context"] = serde_json::json!(true);
        // The stable arm of scheduler rollouts: it lets pass what the canary scheduled.
        if scheduler.get("rollout").is_none_or(serde_json::Value::is_null) {
            scheduler["rollout"] = serde_json::json!({"arm": "stable", "version": "bootstrap"});
        }
    }
    match p.variant {
        Variant::AsWritten => {}
        Variant::OriginalDst => scheduler["scheduler"]["max_endpoints"] = serde_json::json!(1),
        Variant::PerWorker => scheduler["subscribe"] = serde_json::json!({"cluster": "attache_host"}),
    }
    Ok(scheduler)
}

/// Fill `template`'s placeholders, then make the variant's edits. The scheduler configuration
/// goes in last, so nothing in it is taken for a placeholder.
pub fn render(template: &str, p: &Params<'_>) -> Result<String, BootstrapError> {
    if let Some(name) = unknown_placeholder(template, PLACEHOLDERS) {
        return Err(BootstrapError::Unknown(name));
    }
    let scheduler = scheduler_config(p)?;
    let canary = if p.scorer_slots.is_empty() { String::new() } else { uncommented(SCHEDULER_CANARY_TEMPLATE) };
    let mut out = template
        .replace("{{SCORER_FILTERS}}\n", &scorer_filters(p.scorer_slots))
        .replace("{{SCHEDULER_CANARY}}\n", &canary);
    if out.contains("{{POOL_DISCOVERY}}") {
        out = out.replace("{{POOL_DISCOVERY}}\n", &pool_discovery(p.pool)?);
    }
    if out.contains("{{POOL_ENDPOINTS}}") {
        let Pool::Static(addresses) = p.pool else { return Err(BootstrapError::NoEds) };
        out = out.replace("{{POOL_ENDPOINTS}}\n", &lb_endpoints(addresses)?);
    }
    let out = out
        .replace("{{ADMIN_ADDRESS}}", &p.admin.ip().to_string())
        .replace("{{ADMIN_PORT}}", &p.admin.port().to_string())
        .replace("{{LISTEN_ADDRESS}}", &p.listen.ip().to_string())
        .replace("{{LISTEN_PORT}}", &p.listen.port().to_string())
        .replace(
            "{{HOST_GRPC_ENDPOINTS}}\n",
            &lb_endpoints(&p.host_grpc.iter().map(ToString::to_string).collect::<Vec<_>>())?,
        )
        // Inside a double-quoted YAML scalar.
        .replace("{{WASM}}", &p.wasm.display().to_string().replace('\\', "\\\\").replace('"', "\\\""))
        .replace("{{PICKER_CONFIG}}", &quoted(&picker_config(&scheduler)))
        .replace("{{SCHEDULER_CONFIG}}", &quoted(&scheduler));
    match p.variant {
        // As written, comments and all.
        Variant::AsWritten => Ok(out),
        variant => reshape(&out, variant),
    }
}

/// The variant's structural edits on a rendered bootstrap (the scheduler configuration is
/// already the variant's). The result is YAML without the template's comments.
fn reshape(rendered: &str, variant: Variant) -> Result<String, BootstrapError> {
    let missing = |missing| BootstrapError::NotAttache { variant, missing };
    let mut doc: Value = serde_yaml::from_str(rendered)?;
    match variant {
        Variant::AsWritten => {}
        Variant::OriginalDst => {
            let pool = doc["static_resources"]["clusters"]
                .as_sequence_mut()
                .and_then(|clusters| clusters.iter_mut().find(|c| c["name"] == "pool"))
                .and_then(Value::as_mapping_mut)
                .ok_or_else(|| missing("a `pool` cluster"))?;
            original_dst(pool);
        }
        Variant::PerWorker => {
            let top = doc.as_mapping_mut().ok_or_else(|| missing("a mapping at the top"))?;
            top.remove("bootstrap_extensions").ok_or_else(|| missing("the snapshot agent (`bootstrap_extensions`)"))?;
        }
    }
    Ok(serde_yaml::to_string(&doc)?)
}

/// The `pool` cluster as `ORIGINAL_DST` on the destination header: Envoy creates a host for the
/// `ip:port` the header names, so neither a member list nor a load-balancing policy remains.
fn original_dst(pool: &mut Mapping) {
    for key in ["type", "load_assignment", "eds_cluster_config", "load_balancing_policy"] {
        pool.remove(key);
    }
    pool.insert("type".into(), "ORIGINAL_DST".into());
    pool.insert("lb_policy".into(), "CLUSTER_PROVIDED".into());
    let mut lb = Mapping::new();
    lb.insert("use_http_header".into(), true.into());
    lb.insert("http_header_name".into(), DESTINATION_HEADER.into());
    pool.insert("original_dst_lb_config".into(), Value::Mapping(lb));
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST_GRPC: [SocketAddr; 1] =
        [SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 1)), 50051)];

    fn params<'a>(pool: &'a Pool, cfg: &'a serde_json::Value, slots: &'a [String]) -> Params<'a> {
        Params {
            admin: "127.0.0.1:9901".parse().unwrap(),
            listen: "0.0.0.0:8080".parse().unwrap(),
            host_grpc: &HOST_GRPC,
            wasm: Path::new("/opt/attache/attache_scheduler_filter.wasm"),
            scheduler_config: cfg,
            pool,
            scorer_slots: slots,
            variant: Variant::AsWritten,
        }
    }

    #[test]
    fn eds_and_static_pools_render_to_yaml_with_every_placeholder_filled() {
        let cfg = serde_json::json!({"scheduler": {"max_body_bytes": 1000}, "note": "it's"});
        for pool in [Pool::Eds, Pool::Static(vec!["10.0.0.7:8000".into(), "[fd00::1]:8000".into()])] {
            let y = render(ATTACHE_TEMPLATE, &params(&pool, &cfg, &[])).unwrap();
            let doc: serde_yaml::Value = serde_yaml::from_str(&y).unwrap();
            let clusters = doc["static_resources"]["clusters"].as_sequence().unwrap();
            let pool_cluster = clusters.iter().find(|c| c["name"] == "pool").unwrap();
            let listener = &doc["static_resources"]["listeners"][0]["address"]["socket_address"];
            assert_eq!(listener["address"], "0.0.0.0");
            assert_eq!(listener["port_value"], 8080);
            match &pool {
                Pool::Eds => {
                    assert_eq!(pool_cluster["type"], "EDS");
                    let src = &pool_cluster["eds_cluster_config"]["eds_config"]["api_config_source"];
                    assert_eq!(src["grpc_services"][0]["envoy_grpc"]["cluster_name"], "attache_host");
                }
                Pool::Static(_) => {
                    assert_eq!(pool_cluster["type"], "STATIC");
                    let eps = pool_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"].as_sequence().unwrap();
                    assert_eq!(eps[1]["endpoint"]["address"]["socket_address"]["address"], "fd00::1");
                }
            }
            // The JSON configuration survives the YAML quoting.
            assert!(y.contains(r#""note":"it''s""#), "{y}");
        }
    }

    #[test]
    fn scorer_slots_add_both_arms_and_the_picker_and_turn_on_the_context() {
        let cfg = serde_json::json!({});
        let slots = vec!["cost".to_owned()];
        let y = render(ATTACHE_TEMPLATE, &params(&Pool::Eds, &cfg, &slots)).unwrap();
        assert!(y.contains("attache.scorer.cost\n") || y.contains("attache.scorer.cost"), "{y}");
        assert!(y.contains(".canary"), "{y}");
        assert!(y.contains(r#""context":true"#), "{y}");
        let doc: serde_yaml::Value = serde_yaml::from_str(&y).unwrap();
        // The canary scheduler goes first, and the scheduler is the rollout's stable arm.
        let hcm = &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
        let names: Vec<&str> =
            hcm["http_filters"].as_sequence().unwrap().iter().map(|f| f["name"].as_str().unwrap()).collect();
        assert_eq!(&names[..3], ["attache.scheduler.canary", "attache.scheduler", "attache.scorer.cost"], "{y}");
        assert!(y.contains(r#""rollout":{"arm":"stable","version":"bootstrap"}"#), "{y}");
        // Without slots, neither.
        let y = render(ATTACHE_TEMPLATE, &params(&Pool::Eds, &cfg, &[])).unwrap();
        assert!(!y.contains("attache.scheduler.canary") && !y.contains("rollout"), "{y}");
    }

    #[test]
    fn bad_endpoints_and_unfilled_placeholders_are_errors() {
        let cfg = serde_json::json!({});
        let bad = Pool::Static(vec!["engine-1:8000".into()]);
        assert!(matches!(render(ATTACHE_TEMPLATE, &params(&bad, &cfg, &[])), Err(BootstrapError::BadEndpoint(_))));
        let e = render("a: {{NOPE}}\n", &params(&Pool::Eds, &cfg, &[])).unwrap_err();
        assert_eq!(e.to_string(), "unknown placeholder {{NOPE}}");
        // Braces inside a value are the value's own: a Jinja chat template passes through.
        let jinja = serde_json::json!({"chat_template": "{{ m['role'] }} {{WASM}} {{POOL_DISCOVERY}}"});
        let y = render(ATTACHE_TEMPLATE, &params(&Pool::Eds, &jinja, &[])).unwrap();
        assert!(y.contains("{{ m[''role''] }} {{WASM}} {{POOL_DISCOVERY}}"), "{y}");
        let e = render("eps:\n{{POOL_ENDPOINTS}}\n", &params(&Pool::Eds, &cfg, &[])).unwrap_err();
        assert!(matches!(e, BootstrapError::NoEds));
        // A variant needs what it edits.
        let plain = render(
            "static_resources: {clusters: []}\n",
            &Params { variant: Variant::OriginalDst, ..params(&Pool::Eds, &cfg, &[]) },
        );
        assert!(matches!(plain, Err(BootstrapError::NotAttache { variant: Variant::OriginalDst, .. })), "{plain:?}");
        let plain = render("admin: {}\n", &Params { variant: Variant::PerWorker, ..params(&Pool::Eds, &cfg, &[]) });
        assert!(matches!(plain, Err(BootstrapError::NotAttache { variant: Variant::PerWorker, .. })), "{plain:?}");
        let list = serde_json::json!([1]);
        assert!(matches!(
            render(ATTACHE_TEMPLATE, &params(&Pool::Eds, &list, &[])),
            Err(BootstrapError::SchedulerNotObject)
        ));
    }

    /// `envoy/attache.yaml` rendered as `variant` with a static pool: the document, and the
    /// scheduler's configuration parsed out of it.
    fn rendered(variant: Variant) -> (serde_yaml::Value, serde_json::Value) {
        let cfg = serde_json::json!({"role": "scheduler", "scheduler": {"max_body_bytes": 1000}});
        let pool = Pool::Static(vec!["10.0.0.7:8000".into(), "10.0.0.8:8000".into()]);
        let y = render(ATTACHE_TEMPLATE, &Params { variant, ..params(&pool, &cfg, &[]) }).unwrap();
        let doc: serde_yaml::Value = serde_yaml::from_str(&y).unwrap();
        let filters = &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0];
        let scheduler = &filters["typed_config"]["http_filters"][0]["config_discovery"]["default_config"]["config"];
        let json = serde_json::from_str(scheduler["configuration"]["value"].as_str().unwrap()).unwrap();
        (doc, json)
    }

    /// `doc` without what a variant may change: the pool cluster, the snapshot agent and the
    /// scheduler's configuration string.
    fn outside_the_variants_edits(mut doc: serde_yaml::Value) -> serde_yaml::Value {
        let clusters = doc["static_resources"]["clusters"].as_sequence_mut().unwrap();
        clusters.retain(|c| c["name"] != "pool");
        doc.as_mapping_mut().unwrap().remove("bootstrap_extensions");
        let filters = &mut doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0];
        let scheduler = &mut filters["typed_config"]["http_filters"][0]["config_discovery"]["default_config"]["config"];
        scheduler["configuration"]["value"] = "(the scheduler's configuration)".into();
        doc
    }

    #[test]
    fn each_variant_differs_from_the_template_only_by_its_documented_edits() {
        let (base, base_cfg) = rendered(Variant::AsWritten);
        let pool = |doc: &serde_yaml::Value| {
            doc["static_resources"]["clusters"].as_sequence().unwrap().iter().find(|c| c["name"] == "pool").cloned()
        };
        let base_pool = pool(&base).unwrap();
        assert_eq!(base_pool["type"], "STATIC");
        assert!(base["bootstrap_extensions"].is_sequence(), "the snapshot agent");

        let (odst, odst_cfg) = rendered(Variant::OriginalDst);
        let odst_pool = pool(&odst).unwrap();
        assert_eq!(odst_pool["type"], "ORIGINAL_DST");
        assert_eq!(odst_pool["lb_policy"], "CLUSTER_PROVIDED");
        assert_eq!(odst_pool["original_dst_lb_config"]["http_header_name"], DESTINATION_HEADER);
        assert_eq!(odst_pool["original_dst_lb_config"]["use_http_header"], true);
        for gone in ["load_assignment", "load_balancing_policy", "eds_cluster_config"] {
            assert!(odst_pool.get(gone).is_none(), "{gone}");
        }
        // The pool's other settings (circuit breakers, timeouts) are the template's.
        for kept in ["circuit_breakers", "connect_timeout", "name"] {
            assert_eq!(odst_pool[kept], base_pool[kept], "{kept}");
        }
        let mut want = base_cfg.clone();
        want["scheduler"]["max_endpoints"] = 1.into();
        assert_eq!(odst_cfg, want, "one endpoint: Envoy reads the header as one address");
        assert!(odst["bootstrap_extensions"].is_sequence());

        let (per_worker, per_worker_cfg) = rendered(Variant::PerWorker);
        assert!(per_worker.get("bootstrap_extensions").is_none(), "no singleton");
        assert_eq!(pool(&per_worker), Some(base_pool.clone()));
        let mut want = base_cfg.clone();
        want["subscribe"] = serde_json::json!({"cluster": "attache_host"});
        assert_eq!(per_worker_cfg, want, "each worker subscribes itself");

        // And nothing else differs.
        let rest = outside_the_variants_edits(base);
        assert_eq!(outside_the_variants_edits(odst), rest);
        assert_eq!(outside_the_variants_edits(per_worker), rest);
    }
}
