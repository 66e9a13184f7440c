//! What Envoy Gateway sends its Envoy for the chart's Envoy Gateway mode: a `Gateway` listener
//! with the chart's `HTTPRoute` to the pool's `Service`, the chart's `EnvoyExtensionPolicy`,
//! `BackendTrafficPolicy` and `ClientTrafficPolicy`, then its `EnvoyPatchPolicy` applied.
//!
//! Followed at envoyproxy/gateway@d32f28294245e454d20f81d323d626a90e660c1e:
//! - `internal/gatewayapi/listener.go`: a port under 1024 is bound at port + 10000;
//!   `internal/gatewayapi/helpers.go`: listener `<ns>/<gateway>/<listener>`, route
//!   `httproute/<ns>/<name>/rule/<r>/match/<m>/*`, cluster `httproute/<ns>/<name>/rule/<r>`;
//! - `internal/xds/translator/wasm.go`: one Wasm filter per `spec.wasm[i]`, named
//!   `envoy.filters.http.wasm/envoyextensionpolicy/<ns>/<policy>/wasm/<i>`, `disabled: true` on
//!   the listener and enabled per route with `FilterConfig{config: {}}`; PluginConfig `name`,
//!   `root_id`, `configuration` (the JSON as a StringValue), `fail_open`, `vm_config{vm_id: the
//!   IR name, v8, remote code from Envoy Gateway's Wasm server with the sha256}`;
//!   `internal/xds/translator/httpfilters.go`: Wasm filters order 200+i, the router last;
//! - `internal/xds/translator/cluster.go`: `endpointOverride` → `override_host` with a header
//!   source and the `loadBalancer.type` as fallback; `route.go` `buildRetryPolicy`;
//!   `internal/xds/translator/listener.go`: `connection.bufferLimit` →
//!   `per_connection_buffer_limit_bytes`;
//! - `internal/xds/translator/jsonpatch.go`, `internal/utils/jsonpatch/jsonpathtopointer.go`:
//!   each JSON patch applies to the named resource, at the JSON pointers its `jsonPath` selects
//!   with `path` appended; `op: add` with an empty path adds a whole resource;
//! - `internal/wasm/cache.go`: the module is fetched, refused unless its sha256 matches, and
//!   served to Envoy (here: the local file).
//!
//! Envoy Gateway's own ready/stats listeners and its xDS and Wasm-server clusters are left out.

use serde_json::{json, Value};

use super::{access_log, fetch_checked, host_cluster_here, one, static_endpoints, DeriveError, Local};

/// `8Mi`, `32Ki`, `1024` → bytes.
fn quantity(q: &str) -> Option<u64> {
    let (n, mult) = match q {
        q if q.ends_with("Mi") => (&q[..q.len() - 2], 1 << 20),
        q if q.ends_with("Ki") => (&q[..q.len() - 2], 1 << 10),
        q if q.ends_with("Gi") => (&q[..q.len() - 2], 1 << 30),
        q => (q, 1),
    };
    n.parse::<u64>().ok().map(|n| n * mult)
}

/// The bootstrap Envoy would run with, as YAML. `host_fqdn` is the host Service's DNS name,
/// which the patched-in cluster resolves (here: `local.host_grpc`).
pub fn bootstrap(docs: &[Value], local: &Local, host_fqdn: &str) -> Result<String, DeriveError> {
    let route = one(docs, "HTTPRoute")?;
    let eep = one(docs, "EnvoyExtensionPolicy")?;
    let btp = one(docs, "BackendTrafficPolicy")?;
    let ctp = one(docs, "ClientTrafficPolicy")?;
    let ns = route["metadata"]["namespace"].as_str().unwrap_or("default");
    let route_name = route["metadata"]["name"].as_str().unwrap_or_default();
    let parent = &route["spec"]["parentRefs"][0];
    let gw_ns = parent["namespace"].as_str().unwrap_or(ns);
    let gw = parent["name"].as_str().unwrap_or_default();
    // The EnvoyPatchPolicy names the listener; the route attaches to it.
    let epp = one(docs, "EnvoyPatchPolicy")?;
    let listener_name = epp["spec"]["jsonPatches"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["type"] == "type.googleapis.com/envoy.config.listener.v3.Listener")
        .and_then(|p| p["name"].as_str())
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{gw_ns}/{gw}/http"));

    // Wasm filters (wasm.go), disabled on the listener, enabled on the route.
    let policy = eep["metadata"]["name"].as_str().unwrap_or_default();
    let policy_ns = eep["metadata"]["namespace"].as_str().unwrap_or(ns);
    let mut filters = Vec::new();
    let mut per_route = serde_json::Map::new();
    for (i, w) in eep["spec"]["wasm"].as_array().into_iter().flatten().enumerate() {
        let ir = format!("envoyextensionpolicy/{policy_ns}/{policy}/wasm/{i}");
        let name = format!("envoy.filters.http.wasm/{ir}");
        let code = &w["code"];
        let (url, sha) = match code["type"].as_str() {
            Some("HTTP") => (&code["http"]["url"], &code["http"]["sha256"]),
            Some("Image") => (&code["image"]["url"], &code["image"]["sha256"]),
            other => return Err(DeriveError::Unsupported(format!("Wasm code type {other:?}"))),
        };
        let local_code = fetch_checked(local, url.as_str().unwrap_or_default(), sha.as_str().unwrap_or_default())?;
        let mut config = json!({
            "name": w["name"].as_str().unwrap_or(&ir),
            "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                              "value": w.get("config").map(Value::to_string).unwrap_or_default()},
            "vm_config": {"vm_id": ir, "runtime": "envoy.wasm.runtime.v8", "code": local_code},
        });
        if let Some(root) = w["rootID"].as_str() {
            config["root_id"] = json!(root);
        }
        if w["failOpen"] == true {
            config["fail_open"] = json!(true);
        }
        filters.push(json!({"name": name, "disabled": true, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm", "config": config}}));
        per_route
            .insert(name, json!({"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}));
    }
    filters.push(json!({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router", "suppress_envoy_headers": true}}));

    // The route (route.go): "/" stays a prefix, others become path_separated_prefix.
    let rule = &route["spec"]["rules"][0];
    let prefix = rule["matches"][0]["path"]["value"].as_str().unwrap_or("/");
    let cluster = format!("httproute/{ns}/{route_name}/rule/0");
    let retry = &btp["spec"]["retry"];
    let triggers: Vec<&str> =
        retry["retryOn"]["triggers"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    let mut route_entry = json!({
        "name": format!("httproute/{ns}/{route_name}/rule/0/match/0/*"),
        "match": if prefix == "/" { json!({"prefix": "/"}) } else { json!({"path_separated_prefix": prefix}) },
        "route": {
            "cluster": cluster,
            "timeout": rule["timeouts"]["request"].as_str().unwrap_or("15s"),
            "retry_policy": {
                "retry_on": if triggers.is_empty() { "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes".to_owned() } else { triggers.join(",") },
                "retriable_status_codes": [503],
                "num_retries": retry["numRetries"].as_u64().unwrap_or(2),
                "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
                "host_selection_retry_max_attempts": 5
            }
        },
        "typed_per_filter_config": per_route,
    });
    if route_entry["typed_per_filter_config"].as_object().is_some_and(serde_json::Map::is_empty) {
        route_entry.as_object_mut().map(|m| m.remove("typed_per_filter_config"));
    }

    // The route's cluster (cluster.go): EDS of the Service's endpoints, override_host on the
    // header with the load balancer type as fallback.
    let lb = &btp["spec"]["loadBalancer"];
    let fallback = match lb["type"].as_str() {
        Some("RoundRobin") => ("envoy.load_balancing_policies.round_robin", "round_robin.v3.RoundRobin"),
        Some("Random") => ("envoy.load_balancing_policies.random", "random.v3.Random"),
        _ => ("envoy.load_balancing_policies.least_request", "least_request.v3.LeastRequest"),
    };
    let sources: Vec<Value> = lb["endpointOverride"]["extractFrom"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["header"].as_str().map(|h| json!({"header": h})))
        .collect();
    let mut pool = json!({
        "name": cluster, "type": "STATIC", "connect_timeout": "10s",
        "ignore_health_on_host_removal": true,
        "per_connection_buffer_limit_bytes": 32768,
        "circuit_breakers": {"thresholds": [{"max_retries": 1024}]},
        "load_assignment": static_endpoints(&cluster, &local.endpoints),
    });
    let fallback_policy = json!({"policies": [{"typed_extension_config": {"name": fallback.0, "typed_config": {
        "@type": format!("type.googleapis.com/envoy.extensions.load_balancing_policies.{}", fallback.1)}}}]});
    pool["load_balancing_policy"] = if sources.is_empty() {
        fallback_policy
    } else {
        json!({"policies": [{"typed_extension_config": {"name": "envoy.load_balancing_policies.override_host", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": sources, "fallback_policy": fallback_policy}}}]})
    };

    let buffer = ctp["spec"]["connection"]["bufferLimit"].as_str().and_then(quantity).unwrap_or(32768);
    let mut listener = json!({
        "name": listener_name,
        "address": {"socket_address": {"address": local.listen.ip().to_string(), "port_value": local.listen.port()}},
        "per_connection_buffer_limit_bytes": buffer,
        "default_filter_chain": {"name": listener_name, "filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "http-10080",
                "use_remote_address": true, "normalize_path": true, "merge_slashes": true,
                "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
                "common_http_protocol_options": {"headers_with_underscores_action": "REJECT_REQUEST"},
                "route_config": {"name": listener_name, "ignore_port_in_host_matching": true, "virtual_hosts": [{
                    "name": format!("{listener_name}/*"), "domains": ["*"], "routes": [route_entry]}]},
                "http_filters": filters,
                "access_log": access_log(&local.access_log),
            }
        }]}
    });
    let mut clusters = vec![pool];

    // The EnvoyPatchPolicy's patches, in order.
    for p in epp["spec"]["jsonPatches"].as_array().into_iter().flatten() {
        let op = &p["operation"];
        if op["op"] != "add" {
            return Err(DeriveError::Unsupported(format!("JSON patch op {}", op["op"])));
        }
        let target_name = p["name"].as_str().unwrap_or_default();
        match p["type"].as_str().unwrap_or_default() {
            "type.googleapis.com/envoy.config.listener.v3.Listener" if target_name == listener["name"] => {
                let path = op["jsonPath"]
                    .as_str()
                    .ok_or_else(|| DeriveError::Unsupported("a listener patch without jsonPath".into()))?;
                let mut targets = select(&mut listener, path)?;
                if targets.is_empty() {
                    // jsonpatch/patch.go: a jsonPath that matches nothing is an error.
                    return Err(DeriveError::Missing(format!("anything at {path}")));
                }
                let key = op["path"].as_str().unwrap_or_default().trim_start_matches('/');
                for t in &mut targets {
                    if let Some(obj) = t.as_object_mut() {
                        obj.insert(key.to_owned(), op["value"].clone());
                    }
                }
            }
            "type.googleapis.com/envoy.config.cluster.v3.Cluster" if op["path"] == "" => {
                clusters.push(host_cluster_here(&op["value"], host_fqdn, local));
            }
            other => return Err(DeriveError::Unsupported(format!("a patch of {other} {target_name}"))),
        }
    }

    let doc = json!({
        "node": {"id": format!("envoy-{gw_ns}-{gw}-0"), "cluster": format!("{gw_ns}/{gw}")},
        "admin": {"address": {"socket_address": {"address": local.admin.ip().to_string(), "port_value": local.admin.port()}}},
        "static_resources": {"listeners": [listener], "clusters": clusters}
    });
    serde_yaml::to_string(&doc).map_err(|e| DeriveError::Unsupported(format!("YAML: {e}")))
}

/// The values a JSONPath of the form EG's patches use selects:
/// `..<key>[?(@.name=='<value>')].<field>.<field>…` (recursive descent to every `<key>` list,
/// the items whose `name` is `<value>`, then plain fields).
fn select<'a>(doc: &'a mut Value, path: &str) -> Result<Vec<&'a mut Value>, DeriveError> {
    let unsupported = || DeriveError::Unsupported(format!("JSONPath {path}"));
    let rest = path.strip_prefix("..").ok_or_else(unsupported)?;
    let (key, rest) = rest.split_once("[?(@.name=='").ok_or_else(unsupported)?;
    let (want, rest) = rest.split_once("')]").ok_or_else(unsupported)?;
    let fields: Vec<&str> = rest.split('.').filter(|s| !s.is_empty()).collect();
    fn lists<'a>(v: &'a mut Value, key: &str, out: &mut Vec<&'a mut Value>) {
        match v {
            Value::Object(m) => {
                for (k, child) in m.iter_mut() {
                    if k == key && child.is_array() {
                        out.push(child);
                    } else {
                        lists(child, key, out);
                    }
                }
            }
            Value::Array(a) => a.iter_mut().for_each(|c| lists(c, key, out)),
            _ => {}
        }
    }
    let mut found = Vec::new();
    lists(doc, key, &mut found);
    let mut out = Vec::new();
    for list in found {
        for item in list.as_array_mut().into_iter().flatten().filter(|i| i["name"] == want) {
            let mut at = Some(item);
            for f in &fields {
                at = at.and_then(|v| v.get_mut(*f));
            }
            out.extend(at);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_jsonpath_subset_selects_filters_by_name() {
        let mut doc = json!({"a": {"http_filters": [{"name": "x", "typed_config": {"config": {}}}, {"name": "y"}]},
                             "b": [{"http_filters": [{"name": "x", "typed_config": {"config": {"k": 1}}}]}]});
        let found = select(&mut doc, "..http_filters[?(@.name=='x')].typed_config.config").unwrap();
        assert_eq!(found.len(), 2);
        assert!(select(&mut doc, "$.a").is_err());
        assert_eq!(quantity("8Mi"), Some(8 << 20));
    }
}
