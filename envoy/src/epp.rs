//! Bootstraps for Attaché's endpoint picker (EPP): Envoy configured the way gateways configure
//! it for a Gateway API Inference Extension `InferencePool`, an `ext_proc` filter that calls the
//! picker, in the two shapes they use ([`EppShape`]). Attaché's own gateway is
//! `envoy/attache.yaml`; these exist so the picker is tested behind the real Envoy as gateways
//! run it. Where each part comes from is cited at the top of each template and in
//! docs/gateway-api.md.

use std::net::SocketAddr;

use super::{lb_endpoints, unknown_placeholder, BootstrapError};

/// `envoy/epp-gie.yaml`: [`EppShape::OriginalDst`].
pub const EPP_ORIGINAL_DST_TEMPLATE: &str = include_str!("../epp-gie.yaml");
/// `envoy/epp-istio.yaml`: [`EppShape::OverrideHost`].
pub const EPP_OVERRIDE_HOST_TEMPLATE: &str = include_str!("../epp-istio.yaml");

/// The request header that turns the test-only subset hint on: `x-test-subset: on`.
pub const SUBSET_HINT_HEADER: &str = "x-test-subset";

/// How the gateway routes on the picker's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EppShape {
    /// GIE's reference configuration (and Envoy AI Gateway's): the listener's `ext_proc` filter
    /// sends headers and streams both bodies (`FULL_DUPLEX_STREAMED`); the route goes to an
    /// `ORIGINAL_DST` cluster that connects to the one `ip:port` in
    /// `x-gateway-destination-endpoint`. No fallback list, no served endpoint.
    OriginalDst,
    /// Istio's: a listener `ext_proc` filter that processes nothing, turned on per route by
    /// `ExtProcPerRoute` overrides; the pool cluster routes with `override_host` on the dynamic
    /// metadata `envoy.lb/x-gateway-destination-endpoint` (a list: retries walk it), writes
    /// `envoy.lb/x-gateway-destination-endpoint-served`, and falls back to round-robin.
    OverrideHost,
}

impl EppShape {
    /// The built-in template of this shape.
    pub fn template(self) -> &'static str {
        match self {
            Self::OriginalDst => EPP_ORIGINAL_DST_TEMPLATE,
            Self::OverrideHost => EPP_OVERRIDE_HOST_TEMPLATE,
        }
    }

    /// The template's file name in `envoy/`.
    pub fn file(self) -> &'static str {
        match self {
            Self::OriginalDst => "epp-gie.yaml",
            Self::OverrideHost => "epp-istio.yaml",
        }
    }
}

/// What fills an EPP template's placeholders.
#[derive(Debug, Clone, PartialEq)]
pub struct EppParams {
    /// Envoy's admin listener.
    pub admin: SocketAddr,
    /// The inference listener.
    pub listen: SocketAddr,
    /// The picker's `ext_proc` gRPC server.
    pub epp: SocketAddr,
    /// Connect to the picker over TLS, accepting any certificate (as Envoy AI Gateway and GIE's
    /// reference do); plaintext HTTP/2 otherwise.
    pub epp_tls: bool,
    /// `failure_mode_allow` for the picker's calls: the InferencePool's `failureMode`
    /// (`FailOpen`: true; GIE's default is `FailClose`).
    pub failure_mode_allow: bool,
    /// The pool's members, `ip:port` each: [`EppShape::OverrideHost`]'s `STATIC` cluster (at
    /// least one). [`EppShape::OriginalDst`] has no member list and ignores them.
    pub pool: Vec<String>,
    /// Test only: a subset hint, `envoy.lb.subset_hint/x-gateway-destination-endpoint-subset`
    /// set to this list (GIE: `ip:port` strings, written as given) for requests that carry
    /// `x-test-subset: on` ([`SUBSET_HINT_HEADER`]), by an `envoy.filters.http.set_metadata`
    /// filter before `ext_proc` that Envoy skips for every other request. The override-host
    /// shape then forwards `envoy.lb.subset_hint` too, which Istio does not.
    pub subset_hint: Option<Vec<String>>,
    /// Test only: stand in for Kubernetes taking a picker that fails its readiness probe out of
    /// its Service's endpoints (which is how Istio's EDS, and so the gateway, learns it): the
    /// picker cluster checks the picker's gRPC `readiness` every 200 ms and, with no healthy
    /// member, selects none (`healthy_panic_threshold` 0). A picker stream then fails when it
    /// opens, before any body is sent, so `FailOpen` can let the request through.
    pub picker_readiness: bool,
}

/// Every placeholder an EPP template may hold.
const EPP_PLACEHOLDERS: &[&str] = &[
    "ADMIN_ADDRESS",
    "ADMIN_PORT",
    "LISTEN_ADDRESS",
    "LISTEN_PORT",
    "EPP_ADDRESS",
    "EPP_PORT",
    "EPP_TLS",
    "EPP_READINESS",
    "FAILURE_MODE_ALLOW",
    "SUBSET_HINT",
    "FORWARDING_NAMESPACES",
    "POOL_ENDPOINTS",
];

/// The picker cluster's transport socket (`{{EPP_TLS}}`): TLS with an empty validation context,
/// which accepts any certificate, exactly as Envoy AI Gateway builds it (no SNI, no ALPN).
const EPP_TLS_SOCKET: &str = "    # TLS that accepts any certificate (an empty validation context), as Envoy AI Gateway
    # and GIE's reference configuration connect to the picker.
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context: {validation_context: {}}
";

/// The picker's readiness as Kubernetes applies it (`{{EPP_READINESS}}`, see
/// [`EppParams::picker_readiness`]).
const EPP_READINESS_CHECK: &str =
    "    # Test only: the picker's readiness as Kubernetes applies it. A pod that fails its gRPC
    # readiness probe leaves the Service's endpoints, and the gateway's cluster with them.
    health_checks:
    - timeout: 0.2s
      interval: 0.2s
      # A cluster only ext_proc streams use counts as one without traffic: without these,
      # Envoy checks it once a minute.
      no_traffic_interval: 0.2s
      no_traffic_healthy_interval: 0.2s
      unhealthy_threshold: 1
      healthy_threshold: 1
      grpc_health_check: {service_name: readiness}
      tls_options: {alpn_protocols: [\"h2\"]}
    common_lb_config: {healthy_panic_threshold: {value: 0}}
";

/// The test-only subset-hint filter (`{{SUBSET_HINT}}`); `{{LIST}}` is the hint, a YAML flow
/// sequence. `set_metadata` has no condition of its own, so it is wrapped in an
/// `ExtensionWithMatcher` whose matcher skips it unless the request has `x-test-subset: on`
/// (checked with Envoy 1.40: the metadata is there with the header and absent without).
const SUBSET_HINT_FILTER: &str =
    "          # Test only: GIE's subset hint, for requests with `x-test-subset: on`; Envoy skips the
          # filter for every other request. Before ext_proc, which forwards it to the picker.
          - name: envoy.filters.http.set_metadata
            typed_config:
              \"@type\": type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher
              extension_config:
                name: envoy.filters.http.set_metadata
                typed_config:
                  \"@type\": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config
                  metadata:
                  - metadata_namespace: envoy.lb.subset_hint
                    value: {x-gateway-destination-endpoint-subset: {{LIST}}}
              xds_matcher:
                matcher_list:
                  matchers:
                  - predicate:
                      not_matcher:
                        single_predicate:
                          input:
                            name: x-test-subset
                            typed_config:
                              \"@type\": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput
                              header_name: x-test-subset
                          value_match: {exact: \"on\"}
                    on_match:
                      action:
                        name: skip
                        typed_config:
                          \"@type\": type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3.SkipFilter
";

/// Render `shape`'s built-in template (`envoy/epp-gie.yaml` or `envoy/epp-istio.yaml`).
pub fn render_epp(shape: EppShape, p: &EppParams) -> Result<String, BootstrapError> {
    render_epp_template(shape.template(), shape, p)
}

/// Render an EPP template (`shape`'s, or an edited copy of it) with `p`. The result keeps the
/// template's comments; a placeholder that is not an EPP placeholder is an error.
pub fn render_epp_template(template: &str, shape: EppShape, p: &EppParams) -> Result<String, BootstrapError> {
    if let Some(name) = unknown_placeholder(template, EPP_PLACEHOLDERS) {
        return Err(BootstrapError::Unknown(name));
    }
    let mut out = template.to_owned();
    if out.contains("{{POOL_ENDPOINTS}}") {
        if p.pool.is_empty() {
            return Err(BootstrapError::NoPoolEndpoints(shape));
        }
        out = out.replace("{{POOL_ENDPOINTS}}\n", &lb_endpoints(&p.pool)?);
    }
    let tls = if p.epp_tls { EPP_TLS_SOCKET } else { "" };
    let readiness = if p.picker_readiness { EPP_READINESS_CHECK } else { "" };
    let forwarding =
        if p.subset_hint.is_some() { r#"["envoy.lb", "envoy.lb.subset_hint"]"# } else { r#"["envoy.lb"]"# };
    let out = out
        .replace("{{EPP_TLS}}\n", tls)
        .replace("{{EPP_READINESS}}\n", readiness)
        .replace("{{FORWARDING_NAMESPACES}}", forwarding)
        .replace("{{FAILURE_MODE_ALLOW}}", if p.failure_mode_allow { "true" } else { "false" })
        .replace("{{ADMIN_ADDRESS}}", &p.admin.ip().to_string())
        .replace("{{ADMIN_PORT}}", &p.admin.port().to_string())
        .replace("{{LISTEN_ADDRESS}}", &p.listen.ip().to_string())
        .replace("{{LISTEN_PORT}}", &p.listen.port().to_string())
        .replace("{{EPP_ADDRESS}}", &p.epp.ip().to_string())
        .replace("{{EPP_PORT}}", &p.epp.port().to_string());
    // The hint goes in last, so nothing in it is taken for a placeholder.
    let hint = match &p.subset_hint {
        // A JSON array of strings is a YAML flow sequence.
        Some(list) => SUBSET_HINT_FILTER.replace("{{LIST}}", &serde_json::Value::from(list.clone()).to_string()),
        None => String::new(),
    };
    Ok(out.replace("{{SUBSET_HINT}}\n", &hint))
}

#[cfg(test)]
mod tests {
    use serde_yaml::Value;

    use super::*;

    fn params(tls: bool, fail_open: bool, hint: Option<Vec<String>>) -> EppParams {
        EppParams {
            admin: "127.0.0.1:9901".parse().unwrap(),
            listen: "0.0.0.0:8081".parse().unwrap(),
            epp: "127.0.0.1:9002".parse().unwrap(),
            epp_tls: tls,
            failure_mode_allow: fail_open,
            pool: vec!["10.0.0.7:8000".into(), "[fd00::1]:8000".into()],
            subset_hint: hint,
            picker_readiness: false,
        }
    }

    fn rendered(shape: EppShape, p: &EppParams) -> Value {
        serde_yaml::from_str(&render_epp(shape, p).unwrap()).unwrap()
    }

    fn http_filters(doc: &Value) -> &Vec<Value> {
        let hcm = &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
        hcm["http_filters"].as_sequence().unwrap()
    }

    fn filter<'a>(doc: &'a Value, name: &str) -> &'a Value {
        &http_filters(doc).iter().find(|f| f["name"] == name).unwrap()["typed_config"]
    }

    fn route(doc: &Value) -> &Value {
        let hcm = &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
        &hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    }

    fn cluster<'a>(doc: &'a Value, name: &str) -> &'a Value {
        doc["static_resources"]["clusters"].as_sequence().unwrap().iter().find(|c| c["name"] == name).unwrap()
    }

    fn strings(v: &Value) -> Vec<&str> {
        v.as_sequence().unwrap().iter().map(|s| s.as_str().unwrap()).collect()
    }

    /// The picker cluster: HTTP/2, a short connect timeout, the picker's address, and TLS that
    /// accepts any certificate exactly when asked for.
    fn assert_epp_cluster(doc: &Value, tls: bool) {
        let epp = cluster(doc, "epp");
        assert_eq!(epp["connect_timeout"], "1s");
        let opts = &epp["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
        assert!(opts["explicit_http_config"]["http2_protocol_options"].is_mapping(), "HTTP/2");
        let addr = &epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
        assert_eq!(addr["address"], "127.0.0.1");
        assert_eq!(addr["port_value"], 9002);
        if tls {
            let socket = &epp["transport_socket"];
            assert_eq!(socket["name"], "envoy.transport_sockets.tls");
            let ctx = &socket["typed_config"]["common_tls_context"];
            assert_eq!(ctx["validation_context"], Value::Mapping(Default::default()), "any certificate");
        } else {
            assert!(epp.get("transport_socket").is_none(), "plaintext");
        }
    }

    fn assert_full_duplex(mode: &Value) {
        for (k, v) in [
            ("request_header_mode", "SEND"),
            ("response_header_mode", "SEND"),
            ("request_body_mode", "FULL_DUPLEX_STREAMED"),
            ("response_body_mode", "FULL_DUPLEX_STREAMED"),
            ("request_trailer_mode", "SEND"),
            ("response_trailer_mode", "SEND"),
        ] {
            assert_eq!(mode[k], v, "{k}");
        }
    }

    #[test]
    fn original_dst_shape_streams_to_the_picker_and_routes_on_its_header() {
        for (tls, fail_open) in [(false, false), (true, true), (true, false), (false, true)] {
            let doc = rendered(EppShape::OriginalDst, &params(tls, fail_open, None));
            assert_eq!(doc["admin"]["address"]["socket_address"]["port_value"], 9901);
            let listener = &doc["static_resources"]["listeners"][0];
            assert_eq!(listener["address"]["socket_address"]["address"], "0.0.0.0");
            assert_eq!(listener["address"]["socket_address"]["port_value"], 8081);
            let names: Vec<_> = http_filters(&doc).iter().map(|f| f["name"].as_str().unwrap()).collect();
            assert_eq!(names, ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]);

            let ext_proc = filter(&doc, "envoy.filters.http.ext_proc");
            assert_eq!(ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"], "epp");
            assert_full_duplex(&ext_proc["processing_mode"]);
            assert_eq!(ext_proc["message_timeout"], "1000s");
            assert_eq!(ext_proc["failure_mode_allow"], fail_open);
            let meta = &ext_proc["metadata_options"];
            assert_eq!(strings(&meta["receiving_namespaces"]["untyped"]), ["envoy.lb"]);
            assert_eq!(strings(&meta["forwarding_namespaces"]["untyped"]), ["envoy.lb", "envoy.lb.subset_hint"]);

            let r = &route(&doc)["route"];
            assert_eq!(r["cluster"], "pool");
            assert_eq!(r["timeout"], "86400s");
            let pool = cluster(&doc, "pool");
            assert_eq!(pool["type"], "ORIGINAL_DST");
            assert_eq!(pool["lb_policy"], "CLUSTER_PROVIDED");
            assert_eq!(pool["original_dst_lb_config"]["use_http_header"], true);
            assert_eq!(pool["original_dst_lb_config"]["http_header_name"], "x-gateway-destination-endpoint");
            assert!(pool.get("load_assignment").is_none(), "no member list: ORIGINAL_DST ignores the pool");
            assert_epp_cluster(&doc, tls);
        }
    }

    #[test]
    fn override_host_shape_is_istios_listener_filter_route_override_and_pool() {
        for (tls, fail_open) in [(false, false), (true, true), (true, false), (false, true)] {
            let doc = rendered(EppShape::OverrideHost, &params(tls, fail_open, None));
            let names: Vec<_> = http_filters(&doc).iter().map(|f| f["name"].as_str().unwrap()).collect();
            assert_eq!(names, ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]);

            // The listener filter: nothing processed, fail-open, envoy.lb both ways (no hint).
            let ext_proc = filter(&doc, "envoy.filters.http.ext_proc");
            assert_eq!(ext_proc["failure_mode_allow"], true);
            assert_eq!(ext_proc["processing_mode"]["request_header_mode"], "SKIP");
            assert_eq!(ext_proc["processing_mode"]["response_header_mode"], "SKIP");
            let meta = &ext_proc["metadata_options"];
            assert_eq!(strings(&meta["receiving_namespaces"]["untyped"]), ["envoy.lb"]);
            assert_eq!(strings(&meta["forwarding_namespaces"]["untyped"]), ["envoy.lb"]);

            // The route's override: the picker, the protocol's modes, the pool's failure mode.
            let r = route(&doc);
            let over = &r["typed_per_filter_config"]["envoy.filters.http.ext_proc"];
            assert_eq!(over["@type"], "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute");
            let over = &over["overrides"];
            assert_eq!(over["failure_mode_allow"], fail_open);
            assert_eq!(over["grpc_service"]["envoy_grpc"]["cluster_name"], "epp");
            assert_full_duplex(&over["processing_mode"]);
            // Istio's default retry policy: a refused connection moves down the picker's list.
            let retry = &r["route"]["retry_policy"];
            assert!(retry["retry_on"].as_str().unwrap().split(',').any(|c| c == "connect-failure"));
            assert!(retry["num_retries"].as_u64().unwrap() >= 2);
            assert_eq!(retry["retry_host_predicate"][0]["name"], "envoy.retry_host_predicates.previous_hosts");

            let pool = cluster(&doc, "pool");
            assert_eq!(pool["type"], "STATIC");
            assert_eq!(pool["lb_policy"], "CLUSTER_PROVIDED");
            let lb = &pool["load_balancing_policy"]["policies"][0]["typed_extension_config"];
            assert_eq!(lb["name"], "envoy.load_balancing_policies.override_host");
            let lb = &lb["typed_config"];
            let source = &lb["override_host_sources"][0]["metadata"];
            assert_eq!(source["key"], "envoy.lb");
            assert_eq!(source["path"][0]["key"], "x-gateway-destination-endpoint");
            assert_eq!(lb["selected_host_key"]["key"], "envoy.lb");
            assert_eq!(lb["selected_host_key"]["path"][0]["key"], "x-gateway-destination-endpoint-served");
            let fallback = &lb["fallback_policy"]["policies"][0]["typed_extension_config"]["name"];
            assert_eq!(fallback, "envoy.load_balancing_policies.round_robin");
            let eps = pool["load_assignment"]["endpoints"][0]["lb_endpoints"].as_sequence().unwrap();
            let addr = |i: usize| &eps[i]["endpoint"]["address"]["socket_address"];
            assert_eq!((&addr(0)["address"], &addr(0)["port_value"]), (&"10.0.0.7".into(), &8000.into()));
            assert_eq!(addr(1)["address"], "fd00::1");
            assert_epp_cluster(&doc, tls);
        }
    }

    #[test]
    fn the_subset_hint_is_a_skippable_filter_before_ext_proc_in_both_shapes() {
        let hint = vec!["127.0.0.1:18091".to_owned(), "it's \"{{EPP_PORT}}\"".to_owned()];
        for shape in [EppShape::OriginalDst, EppShape::OverrideHost] {
            let doc = rendered(shape, &params(false, false, Some(hint.clone())));
            let names: Vec<_> = http_filters(&doc).iter().map(|f| f["name"].as_str().unwrap()).collect();
            assert_eq!(
                names,
                ["envoy.filters.http.set_metadata", "envoy.filters.http.ext_proc", "envoy.filters.http.router"]
            );
            let wrapped = filter(&doc, "envoy.filters.http.set_metadata");
            let set = &wrapped["extension_config"]["typed_config"]["metadata"][0];
            assert_eq!(set["metadata_namespace"], "envoy.lb.subset_hint");
            // Written as given, placeholders and quotes included.
            assert_eq!(strings(&set["value"]["x-gateway-destination-endpoint-subset"]), hint);
            let m = &wrapped["xds_matcher"]["matcher_list"]["matchers"][0];
            let pred = &m["predicate"]["not_matcher"]["single_predicate"];
            assert_eq!(pred["input"]["typed_config"]["header_name"], SUBSET_HINT_HEADER);
            assert_eq!(pred["value_match"]["exact"], "on");
            let skip = &m["on_match"]["action"]["typed_config"]["@type"];
            assert_eq!(skip, "type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3.SkipFilter");
            // The picker gets the hint.
            let meta = &filter(&doc, "envoy.filters.http.ext_proc")["metadata_options"];
            assert_eq!(strings(&meta["forwarding_namespaces"]["untyped"]), ["envoy.lb", "envoy.lb.subset_hint"]);
        }
        // An empty hint is a hint: the picker must then refuse (GIE: 503).
        let doc = rendered(EppShape::OverrideHost, &params(false, false, Some(Vec::new())));
        let set = &filter(&doc, "envoy.filters.http.set_metadata")["extension_config"]["typed_config"]["metadata"][0];
        assert_eq!(set["value"]["x-gateway-destination-endpoint-subset"], Value::Sequence(Vec::new()));
    }

    #[test]
    fn pool_errors_and_unknown_placeholders() {
        let mut p = params(false, false, None);
        p.pool.clear();
        assert!(matches!(
            render_epp(EppShape::OverrideHost, &p),
            Err(BootstrapError::NoPoolEndpoints(EppShape::OverrideHost))
        ));
        // ORIGINAL_DST has no member list to fill.
        assert!(render_epp(EppShape::OriginalDst, &p).is_ok());
        p.pool = vec!["engine-1:8000".into()];
        assert!(matches!(render_epp(EppShape::OverrideHost, &p), Err(BootstrapError::BadEndpoint(_))));
        // Only the EPP placeholders: the Attaché template's are unknown here.
        let e = render_epp_template("a: {{WASM}}\n", EppShape::OriginalDst, &params(false, false, None)).unwrap_err();
        assert_eq!(e.to_string(), "unknown placeholder {{WASM}}");
        for shape in [EppShape::OriginalDst, EppShape::OverrideHost] {
            for hint in [None, Some(vec!["10.0.0.7:8000".to_owned()])] {
                let y = render_epp(shape, &params(true, true, hint)).unwrap();
                assert!(!y.contains("{{"), "{shape:?} left a placeholder:\n{y}");
            }
        }
    }
}
