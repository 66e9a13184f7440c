//! `epp:` in the host configuration: the endpoint picker's listeners, TLS and scheduler
//! configuration.

use std::net::SocketAddr;
use std::path::PathBuf;

use attache_policies::plugin_config::FilterConfig;
use serde::{Deserialize, Serialize};

/// The endpoint picker (GIE's endpoint-picker protocol over Envoy's `ext_proc`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EppConfig {
    /// The `envoy.service.ext_proc.v3.ExternalProcessor` listener (GIE's default port is 9002).
    pub listen: SocketAddr,
    /// A plaintext listener for the gRPC health service alone (Kubernetes gRPC probes cannot
    /// speak TLS). The health service is served on `listen` too.
    #[serde(default)]
    pub health_listen: Option<SocketAddr>,
    /// Serve `listen` over TLS with this certificate (PEM). Gateways built on Envoy (Envoy AI
    /// Gateway, GIE's reference configuration) connect with TLS and accept any certificate;
    /// without it the listener speaks plaintext HTTP/2 (agentgateway, local tests).
    #[serde(default)]
    pub tls: Option<TlsFiles>,
    /// The scheduler: the same document as the scheduler filter's plugin configuration
    /// (`role` and `subscribe` are ignored). `scheduler.max_endpoints` is how many endpoints the
    /// picker names: 1 for gateways that route with an `ORIGINAL_DST` cluster (they take one
    /// `ip:port`), more for `override_host` gateways (Istio), which walk the list on retries.
    #[serde(default = "default_config")]
    pub config: FilterConfig,
}

/// A certificate and its private key, PEM files.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

/// The filter's defaults, naming one endpoint (an `ORIGINAL_DST` gateway takes one).
fn default_config() -> FilterConfig {
    let mut c = FilterConfig::default();
    c.scheduler.max_endpoints = 1;
    c
}
