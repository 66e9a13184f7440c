//! The Envoy configuration that a gateway controller would send for the chart's objects, derived
//! by following the controller's own translation source at a cited commit: istiod
//! ([`istio`]) and Envoy Gateway ([`envoy_gateway`]). Neither controller can be installed here,
//! so the tests run what these functions derive on the real Envoy 1.40 and carry traffic
//! through it.
//!
//! A derived configuration is a static bootstrap, which forces a few stand-ins, the same for both:
//! what the controller streams over xDS (routes, EDS) is written inline, and ECDS resources are
//! served from files (`path_config_source`) instead of ADS, so the filters keep their
//! `config_discovery` as the controller sends them; an EDS cluster
//! lists the endpoints the controller would send (the model servers' `ip:port`); remote Wasm code
//! becomes the local file the controller's fetcher would produce, after the same sha256 check
//! (istio-agent's or Envoy Gateway's cache); and ports are this machine's. Nothing else is added,
//! except an access log the tests read (which endpoint each request named and which served it).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde_json::{json, Value};

pub mod envoy_gateway;
pub mod istio;

/// What a derived bootstrap needs from this machine.
#[derive(Debug, Clone)]
pub struct Local {
    /// The gateway listener's address here.
    pub listen: SocketAddr,
    /// Envoy's admin listener.
    pub admin: SocketAddr,
    /// The pool's members as the controller's EDS would list them (`ip:port`).
    pub endpoints: Vec<SocketAddr>,
    /// The host's gRPC server, where the host Service's DNS name points.
    pub host_grpc: SocketAddr,
    /// The host's endpoint picker, where the pool's `endpointPickerRef` points (its gRPC port
    /// when there is none).
    pub epp: Option<SocketAddr>,
    /// The module each URL in the rendered objects fetches (what the controller's fetcher
    /// would download from it).
    pub modules: BTreeMap<String, PathBuf>,
    /// Where the access log goes.
    pub access_log: PathBuf,
    /// Where ECDS resources are written, one file each, for Envoy to read.
    pub ecds_dir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum DeriveError {
    #[error("the rendered objects have no {0}")]
    Missing(String),
    #[error("no module is given for {0}")]
    NoModule(String),
    #[error("{url}: the module's sha256 is {actual}, the object pins {pinned}")]
    Sha256 { url: String, pinned: String, actual: String },
    #[error("{0} is not supported by this derivation")]
    Unsupported(String),
    #[error("reading {0}: {1}")]
    Io(String, std::io::Error),
}

/// The fetcher's step (istio-agent's `pkg/wasm`, Envoy Gateway's `internal/wasm`): fetch the
/// module for `url`, refuse it unless its sha256 is `pinned`, and hand Envoy the local file.
pub fn fetch_checked(local: &Local, url: &str, pinned: &str) -> Result<Value, DeriveError> {
    use sha2::{Digest, Sha256};
    let path = local.modules.get(url).ok_or_else(|| DeriveError::NoModule(url.to_owned()))?;
    let bytes = std::fs::read(path).map_err(|e| DeriveError::Io(path.display().to_string(), e))?;
    let actual = format!("{:x}", Sha256::digest(&bytes));
    if actual != pinned {
        return Err(DeriveError::Sha256 { url: url.to_owned(), pinned: pinned.to_owned(), actual });
    }
    Ok(json!({"local": {"filename": path.display().to_string()}}))
}

/// A STATIC cluster's `load_assignment` listing `endpoints` (the stand-in for EDS).
pub fn static_endpoints(cluster: &str, endpoints: &[SocketAddr]) -> Value {
    let lb: Vec<Value> = endpoints
        .iter()
        .map(|a| json!({"endpoint": {"address": {"socket_address": {"address": a.ip().to_string(), "port_value": a.port()}}}}))
        .collect();
    json!({"cluster_name": cluster, "endpoints": [{"lb_endpoints": lb}]})
}

/// The tests' access log: per request, the endpoints the scheduler named, what the pool read
/// from `envoy.lb` (Istio), the host that served, and the response code.
pub fn access_log(path: &std::path::Path) -> Value {
    json!([{
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": path.display().to_string(),
            "log_format": {"json_format": {
                "picked": "%REQ(X-GATEWAY-DESTINATION-ENDPOINT)%",
                "metadata": "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%",
                "served": "%UPSTREAM_HOST%",
                "code": "%RESPONSE_CODE%",
                "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%"
            }}
        }
    }])
}

/// A cluster the rendered objects add, pointed here: where its one endpoint is the host
/// Service's DNS name `host_fqdn`, it becomes `local.host_grpc`.
pub fn host_cluster_here(cluster: &Value, host_fqdn: &str, local: &Local) -> Value {
    let mut c = cluster.clone();
    if let Some(sa) = c.pointer_mut("/load_assignment/endpoints/0/lb_endpoints/0/endpoint/address/socket_address") {
        if sa["address"] == host_fqdn {
            sa["address"] = json!(local.host_grpc.ip().to_string());
            sa["port_value"] = json!(local.host_grpc.port());
        }
    }
    c
}

/// Objects of `kind` among rendered documents.
pub fn objects<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// The one object of `kind`.
pub fn one<'a>(docs: &'a [Value], kind: &str) -> Result<&'a Value, DeriveError> {
    objects(docs, kind).into_iter().next().ok_or_else(|| DeriveError::Missing(kind.to_owned()))
}

/// The module's URL and pinned sha256 of a Wasm filter config whose code is `remote`, replaced
/// by the fetched local file.
pub fn localize_wasm(local: &Local, wasm_config: &mut Value) -> Result<(), DeriveError> {
    let code = &mut wasm_config["vm_config"]["code"];
    let Some(remote) = code.get("remote").cloned() else {
        return Err(DeriveError::Unsupported("Wasm code that is not remote".into()));
    };
    let url = remote["http_uri"]["uri"].as_str().unwrap_or_default();
    let pinned = remote["sha256"].as_str().unwrap_or_default();
    *code = fetch_checked(local, url, pinned)?;
    Ok(())
}
