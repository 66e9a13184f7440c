//! What istiod sends an Istio gateway for the chart's Istio mode: a Gateway API `Gateway` with
//! the chart's `HTTPRoute` to its `InferencePool`, and the chart's `EnvoyFilter`.
//!
//! Followed at istio/istio@86c9f01fd735fb01d8192f5bcaf0d424afb7f14c:
//! - `pilot/pkg/xds/filters/filters.go` (`InferencePoolExtProc`): the listener's ext_proc filter,
//!   added when the Gateway routes to an InferencePool (`pilot/pkg/networking/core/
//!   listener_builder.go`);
//! - `pilot/pkg/networking/core/route/route.go`: the route's `ExtProcPerRoute` override naming
//!   the pool's endpoint picker; `route/retry/retry.go`: Istio's default retry policy;
//! - `pilot/pkg/config/kube/gateway/inferencepool_collection.go` (`InferencePoolServiceName`):
//!   the pool's shadow Service `<pool>-ip-<sha256(pool)[:8]>`, its ports from 54321;
//! - `pilot/pkg/networking/core/cluster_builder.go` (`applyOverrideHostPolicy`): the pool
//!   cluster routes on `envoy.lb/x-gateway-destination-endpoint` with `override_host`, reports
//!   the served host in `envoy.lb/x-gateway-destination-endpoint-served`, round-robin fallback;
//! - `pilot/pkg/networking/core/envoyfilter/{extension_configuration_patch.go,listener_patch.go,
//!   rc_patch.go,cluster_patch.go}`: EXTENSION_CONFIG ADD, HTTP_FILTER INSERT_BEFORE, HTTP_ROUTE
//!   MERGE, CLUSTER ADD, LISTENER MERGE (the listener of `portNumber` 80, the Gateway's port);
//! - `pkg/wasm/convert.go`: istio-agent fetches every ECDS Wasm resource's remote code, checks
//!   its sha256, and gives Envoy the local file.
//!
//! Istio-only filters that do not touch routing (`istio.metadata_exchange`, `istio.alpn`,
//! `istio.stats`, grpc_stats, fault, cors) and mTLS are left out.

use std::collections::BTreeMap;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::{access_log, host_cluster_here, localize_wasm, one, static_endpoints, DeriveError, Local};

/// The InferencePool's shadow Service name (`InferencePoolServiceName`).
pub fn shadow_service(pool: &str) -> String {
    let hash = format!("{:x}", Sha256::digest(pool.as_bytes()));
    let base = if pool.len() + 4 + 8 > 63 { &pool[..63 - 4 - 8] } else { pool };
    format!("{base}-ip-{}", &hash[..8])
}

/// `outbound|<port>||<fqdn>`, Istio's name for a Service port's cluster.
pub fn outbound(port: u64, fqdn: &str) -> String {
    format!("outbound|{port}||{fqdn}")
}

fn h2(cluster: &str, at: std::net::SocketAddr) -> Value {
    json!({
        "name": cluster, "type": "STATIC", "connect_timeout": "10s",
        "load_assignment": static_endpoints(cluster, &[at]),
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    })
}

/// The bootstrap Envoy would run with, as YAML. `host_fqdn` is the host Service's DNS name
/// (its clusters point at `local.host_grpc`).
pub fn bootstrap(docs: &[Value], local: &Local, host_fqdn: &str) -> Result<String, DeriveError> {
    let route = one(docs, "HTTPRoute")?;
    let pool = one(docs, "InferencePool")?;
    let ns = route["metadata"]["namespace"].as_str().unwrap_or("default");
    let pool_name = pool["metadata"]["name"].as_str().unwrap_or_default();
    let pool_cluster = outbound(54321, &format!("{}.{ns}.svc.cluster.local", shadow_service(pool_name)));

    // The pool cluster (cluster_builder.go applyOverrideHostPolicy; EDS listed statically).
    let mut clusters = vec![json!({
        "name": pool_cluster, "type": "STATIC", "connect_timeout": "10s",
        "circuit_breakers": {"thresholds": [{"max_connections": 4294967295u64, "max_pending_requests": 4294967295u64,
                                             "max_requests": 4294967295u64, "max_retries": 4294967295u64, "track_remaining": true}]},
        "lb_policy": "CLUSTER_PROVIDED",
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}],
                "selected_host_key": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint-served"}]},
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"}}}]}
            }}}]},
        "load_assignment": static_endpoints(&pool_cluster, &local.endpoints),
    })];

    // The endpoint picker the pool names (route.go's per-route override points at it).
    let epp = &pool["spec"]["endpointPickerRef"];
    let epp_cluster = outbound(
        epp["port"]["number"].as_u64().unwrap_or(9002),
        &format!("{}.{ns}.svc.cluster.local", epp["name"].as_str().unwrap_or_default()),
    );
    let failure_open = epp["failureMode"] == "FailOpen";
    // Istio's Service clusters for the picker and the host (HTTP/2 from appProtocol / grpc port).
    // The picker's points at the host too: the chart's pool names the host Service.
    let mut picker = h2(&epp_cluster, local.epp.unwrap_or(local.host_grpc));
    // A DestinationRule's TLS for the picker's port (cluster_tls.go constructUpstreamTLS; SIMPLE
    // with insecureSkipVerify: no validation context), ALPN h2 for the HTTP/2 upstream.
    let epp_host = format!("{}.{ns}.svc.cluster.local", epp["name"].as_str().unwrap_or_default());
    let epp_port = epp["port"]["number"].as_u64().unwrap_or(9002);
    for dr in super::objects(docs, "DestinationRule").into_iter().filter(|d| d["spec"]["host"] == epp_host.as_str()) {
        let tls = dr["spec"]["trafficPolicy"]["portLevelSettings"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["port"]["number"].as_u64() == Some(epp_port))
            .map(|p| &p["tls"]);
        match tls {
            Some(t) if t["mode"] == "SIMPLE" && t["insecureSkipVerify"] == true => {
                picker["transport_socket"] = json!({"name": "envoy.transport_sockets.tls", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                    "common_tls_context": {"alpn_protocols": ["h2"]}}});
            }
            Some(t) => return Err(DeriveError::Unsupported(format!("DestinationRule TLS {t}"))),
            None => {}
        }
    }
    clusters.push(picker);

    // The route (route.go) for the HTTPRoute's one rule; a PathPrefix other than "/" becomes
    // path_separated_prefix (route.go L1099-1102, conversion.go L1633-1640).
    let rule = &route["spec"]["rules"][0];
    let prefix = rule["matches"][0]["path"]["value"].as_str().unwrap_or("/");
    let timeout = rule["timeouts"]["request"].as_str().unwrap_or("0s");
    let mut route_entry = json!({
        "name": format!("{ns}.{}.0", route["metadata"]["name"].as_str().unwrap_or_default()),
        "match": {"path_separated_prefix": prefix},
        "route": {
            "cluster": pool_cluster, "timeout": timeout,
            "retry_policy": {
                "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
                "num_retries": 2, "host_selection_retry_max_attempts": 5,
                "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}]
            }
        },
        "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {
                "failure_mode_allow": failure_open,
                "grpc_service": {"envoy_grpc": {"cluster_name": epp_cluster}},
                "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
                    "request_trailer_mode": "SEND", "response_header_mode": "SEND",
                    "response_body_mode": "FULL_DUPLEX_STREAMED", "response_trailer_mode": "SEND"}
            }
        }}
    });
    if prefix == "/" {
        route_entry["match"] = json!({"prefix": "/"});
    }

    // The listener's filters (filters.go InferencePoolExtProc, then the router).
    let mut filters = vec![
        json!({"name": "envoy.filters.http.ext_proc", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "dummy"}, "timeout": "10s"},
            "failure_mode_allow": true,
            "processing_mode": {"request_header_mode": "SKIP", "response_header_mode": "SKIP"},
            "message_timeout": "1000s",
            "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]},
                                 "forwarding_namespaces": {"untyped": ["envoy.lb"]}}
        }}),
        json!({"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}),
    ];
    let mut routes = vec![route_entry];

    // The EnvoyFilter's patches, in order.
    let mut ecds: BTreeMap<String, Value> = BTreeMap::new();
    let mut listener_fields = json!({});
    for ef in super::objects(docs, "EnvoyFilter") {
        for patch in ef["spec"]["configPatches"].as_array().into_iter().flatten() {
            let op = patch["patch"]["operation"].as_str().unwrap_or_default();
            let value = &patch["patch"]["value"];
            match (patch["applyTo"].as_str().unwrap_or_default(), op) {
                ("EXTENSION_CONFIG", "ADD") => {
                    let mut typed = value["typed_config"].clone();
                    // istio-agent: remote code → the local file, after the sha256 check.
                    localize_wasm(local, &mut typed["config"])?;
                    ecds.insert(value["name"].as_str().unwrap_or_default().to_owned(), typed);
                }
                ("HTTP_FILTER", "INSERT_BEFORE") => {
                    let before = patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
                        .as_str()
                        .unwrap_or_default();
                    let at = filters
                        .iter()
                        .position(|f| f["name"] == before)
                        .ok_or_else(|| DeriveError::Missing(format!("filter {before}")))?;
                    let name = value["name"].as_str().unwrap_or_default();
                    // A config_discovery filter gets its ECDS resource: istiod serves it over ADS;
                    // here from a file, the filter otherwise as the patch wrote it.
                    let mut filter = value.clone();
                    if value.get("config_discovery").is_some() {
                        let typed =
                            ecds.get(name).ok_or_else(|| DeriveError::Missing(format!("ECDS resource {name}")))?;
                        let path = local.ecds_dir.join(format!("{name}.yaml"));
                        let resource = json!({"resources": [{
                            "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
                            "name": name, "typed_config": typed}]});
                        let text = serde_yaml::to_string(&resource)
                            .map_err(|e| DeriveError::Unsupported(format!("YAML: {e}")))?;
                        std::fs::write(&path, text).map_err(|e| DeriveError::Io(path.display().to_string(), e))?;
                        filter["config_discovery"]["config_source"] = json!({
                            "path_config_source": {"path": path.display().to_string()},
                            "initial_fetch_timeout": "0s",
                            "resource_api_version": "V3"});
                    }
                    filters.insert(at, filter);
                }
                ("CLUSTER", "ADD") => clusters.push(host_cluster_here(value, host_fqdn, local)),
                ("HTTP_ROUTE", "MERGE") => {
                    let name = patch["match"]["routeConfiguration"]["vhost"]["route"]["name"].as_str();
                    let mut matched = 0;
                    for r in routes.iter_mut().filter(|r| name.is_none_or(|n| r["name"] == n)) {
                        merge(r, value);
                        matched += 1;
                    }
                    // istiod applies a patch that matches nothing silently; here it is an error,
                    // so a wrong route name cannot pass unnoticed.
                    if matched == 0 {
                        return Err(DeriveError::Missing(format!("the route {name:?} that an HTTP_ROUTE patch names")));
                    }
                }
                ("LISTENER", "MERGE") => {
                    // The gateway's listener for the Gateway's port 80 (here: `local.listen`).
                    let port = patch["match"]["listener"]["portNumber"].as_u64();
                    if port.is_some_and(|p| p != 80) {
                        return Err(DeriveError::Missing(format!("a gateway listener on port {port:?}")));
                    }
                    merge(&mut listener_fields, value);
                }
                (what, op) => return Err(DeriveError::Unsupported(format!("EnvoyFilter {what} {op}"))),
            }
        }
    }

    let hcm = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "outbound_0.0.0.0_80",
        "route_config": {"name": "http.80", "virtual_hosts": [{"name": "*:80", "domains": ["*"], "routes": routes}]},
        "http_filters": filters,
        "access_log": access_log(&local.access_log),
    });
    let mut listener = json!({
        "name": "0.0.0.0_80",
        "address": {"socket_address": {"address": local.listen.ip().to_string(), "port_value": local.listen.port()}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]
    });
    merge(&mut listener, &listener_fields);
    let doc = json!({
        "node": {"id": "inference-gateway-istio-0.gateways", "cluster": "inference-gateway-istio.gateways"},
        "admin": {"address": {"socket_address": {"address": local.admin.ip().to_string(), "port_value": local.admin.port()}}},
        "static_resources": {
            "listeners": [listener],
            "clusters": clusters
        }
    });
    serde_yaml::to_string(&doc).map_err(|e| DeriveError::Unsupported(format!("YAML: {e}")))
}

/// Istio's MERGE (proto merge): objects merge key by key, a map entry or scalar is replaced.
fn merge(into: &mut Value, from: &Value) {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                // A typed_per_filter_config entry is an Any: replaced whole.
                if k.starts_with("envoy.filters.") || v.get("@type").is_some() {
                    a.insert(k.clone(), v.clone());
                } else {
                    merge(a.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (slot, v) => *slot = v.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shadow_service_names_match_istios_golden_file() {
        // pilot/pkg/config/kube/gateway/testdata/http.yaml.golden names the shadow Service of
        // pool `infpool-gen` this way.
        assert_eq!(shadow_service("infpool-gen"), "infpool-gen-ip-6580eb2c");
    }
}
