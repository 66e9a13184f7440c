//! Rendering Envoy's bootstrap from the templates in `envoy/`.
//!
//! One renderer for every launcher: `attache gateway` renders `envoy/attache.yaml` (built into
//! the binary) with an EDS-fed pool, and the test and benchmark launcher renders the same file
//! and its variants with a static pool. Placeholders are `{{NAME}}`; a placeholder left
//! unfilled is an error rather than a bootstrap Envoy would refuse with a less clear message.

use std::net::SocketAddr;
use std::path::Path;

/// `envoy/attache.yaml`: the recommended bootstrap (snapshot agent, scheduler, `override_host`).
pub const ATTACHE_TEMPLATE: &str = include_str!("../../envoy/attache.yaml");
/// `envoy/scorer-slot.yaml`: one custom-scorer slot filter.
pub const SCORER_SLOT_TEMPLATE: &str = include_str!("../../envoy/scorer-slot.yaml");
/// `envoy/picker.yaml`: the picker after the last scorer slot.
pub const PICKER_TEMPLATE: &str = include_str!("../../envoy/picker.yaml");

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
    /// The host's gRPC server (snapshots, ECDS, EDS).
    pub host_grpc: SocketAddr,
    /// The scheduler filter module.
    pub wasm: &'a Path,
    /// The scheduler filter's configuration (JSON).
    pub scheduler_config: &'a serde_json::Value,
    pub pool: &'a Pool,
    /// Custom scorer slots, each with a stable and a canary arm, then the picker.
    pub scorer_slots: &'a [String],
}

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("endpoint `{0}` is not ip:port")]
    BadEndpoint(String),
    #[error("this template lists the pool's endpoints itself; it cannot take them from EDS")]
    NoEds,
    #[error("unknown placeholder {0}")]
    Unknown(String),
    #[error("the scheduler configuration must be a JSON object")]
    SchedulerNotObject,
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

/// The scorer-slot filters and the picker (`{{SCORER_FILTERS}}`), without the templates'
/// comment lines.
fn scorer_filters(slots: &[String]) -> String {
    if slots.is_empty() {
        return String::new();
    }
    let body = |t: &str| -> String { t.lines().filter(|l| !l.starts_with('#')).map(|l| format!("{l}\n")).collect() };
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
    "POOL_DISCOVERY",
    "POOL_ENDPOINTS",
    "ADMIN_ADDRESS",
    "ADMIN_PORT",
    "LISTEN_ADDRESS",
    "LISTEN_PORT",
    "HOST_GRPC_ADDRESS",
    "HOST_GRPC_PORT",
    "WASM",
    "SCHEDULER_CONFIG_SINGLE",
    "SCHEDULER_CONFIG_PER_WORKER",
    "SCHEDULER_CONFIG",
];

/// The first `{{NAME}}` in `template` (upper case and `_`) that is not a known placeholder.
/// Checked on the template, before any value goes in: a value may hold braces of its own (a
/// Jinja chat template in the scheduler configuration does).
fn unknown_placeholder(template: &str) -> Option<String> {
    let mut rest = template;
    while let Some(i) = rest.find("{{") {
        rest = &rest[i + 2..];
        let name: String = rest.chars().take_while(|c| c.is_ascii_uppercase() || *c == '_').collect();
        if !name.is_empty() && rest[name.len()..].starts_with("}}") && !PLACEHOLDERS.contains(&name.as_str()) {
            return Some(format!("{{{{{name}}}}}"));
        }
    }
    None
}

/// Fill `template`'s placeholders. The scheduler configuration goes in last, so nothing in it
/// is taken for a placeholder.
pub fn render(template: &str, p: &Params<'_>) -> Result<String, BootstrapError> {
    if let Some(name) = unknown_placeholder(template) {
        return Err(BootstrapError::Unknown(name));
    }
    if !p.scheduler_config.is_object() {
        return Err(BootstrapError::SchedulerNotObject);
    }
    let mut scheduler = p.scheduler_config.clone();
    if !p.scorer_slots.is_empty() {
        scheduler["scoring"]["context"] = serde_json::json!(true);
    }
    // Variants: one destination only (ORIGINAL_DST), or a stream per worker (no singleton).
    let mut single = scheduler.clone();
    single["scheduler"]["max_endpoints"] = serde_json::json!(1);
    let mut per_worker = scheduler.clone();
    per_worker["subscribe"] = serde_json::json!({"cluster": "attache_host"});
    let mut out = template.replace("{{SCORER_FILTERS}}\n", &scorer_filters(p.scorer_slots));
    if out.contains("{{POOL_DISCOVERY}}") {
        out = out.replace("{{POOL_DISCOVERY}}\n", &pool_discovery(p.pool)?);
    }
    if out.contains("{{POOL_ENDPOINTS}}") {
        let Pool::Static(addresses) = p.pool else { return Err(BootstrapError::NoEds) };
        out = out.replace("{{POOL_ENDPOINTS}}\n", &lb_endpoints(addresses)?);
    }
    Ok(out
        .replace("{{ADMIN_ADDRESS}}", &p.admin.ip().to_string())
        .replace("{{ADMIN_PORT}}", &p.admin.port().to_string())
        .replace("{{LISTEN_ADDRESS}}", &p.listen.ip().to_string())
        .replace("{{LISTEN_PORT}}", &p.listen.port().to_string())
        .replace("{{HOST_GRPC_ADDRESS}}", &p.host_grpc.ip().to_string())
        .replace("{{HOST_GRPC_PORT}}", &p.host_grpc.port().to_string())
        // Inside a double-quoted YAML scalar.
        .replace("{{WASM}}", &p.wasm.display().to_string().replace('\\', "\\\\").replace('"', "\\\""))
        .replace("{{SCHEDULER_CONFIG_SINGLE}}", &quoted(&single))
        .replace("{{SCHEDULER_CONFIG_PER_WORKER}}", &quoted(&per_worker))
        .replace("{{SCHEDULER_CONFIG}}", &quoted(&scheduler)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params<'a>(pool: &'a Pool, cfg: &'a serde_json::Value, slots: &'a [String]) -> Params<'a> {
        Params {
            admin: "127.0.0.1:9901".parse().unwrap(),
            listen: "0.0.0.0:8080".parse().unwrap(),
            host_grpc: "127.0.0.1:50051".parse().unwrap(),
            wasm: Path::new("/opt/attache/attache_scheduler_filter.wasm"),
            scheduler_config: cfg,
            pool,
            scorer_slots: slots,
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
        let _: serde_yaml::Value = serde_yaml::from_str(&y).unwrap();
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
        let list = serde_json::json!([1]);
        assert!(matches!(
            render(ATTACHE_TEMPLATE, &params(&Pool::Eds, &list, &[])),
            Err(BootstrapError::SchedulerNotObject)
        ));
    }
}
