//! The endpoint list discovery produces, and its static-file form (for use outside
//! Kubernetes):
//!
//! ```yaml
//! endpoints:
//!   - address: 127.0.0.1:18001
//!     models: [tinyllama]
//!     role: both            # both | prefill | decode (llm-d.ai/role)
//!     engine: vllm          # vllm | sglang (llm-d.ai/engine-type)
//!     labels: {attache.io/accelerator: l4}   # optional, for scorers
//!     metrics_path: /metrics
//!     kv_events:            # optional: follow the engine's KV events
//!       publisher: tcp://127.0.0.1:5557   # the engine's PUB socket (it binds `tcp://*:5557`)
//!       replay: tcp://127.0.0.1:5558      # its replay ROUTER
//! ```
//! Engines that *connect* to the host's collector (`kv_events_bind` in the host config) give
//! only `replay` (or nothing); their messages are matched by topic `kv@<address>@<model>`.

use std::path::Path;

use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticEndpoint {
    pub address: String,
    pub models: Vec<String>,
    #[serde(default = "default_role")]
    pub role: String,
    #[serde(default = "default_engine")]
    pub engine: String,
    #[serde(default = "default_metrics_path")]
    pub metrics_path: String,
    #[serde(default)]
    pub kv_events: Option<KvEventsSpec>,
    /// Pod labels (in Kubernetes, the pod's own); scorers read them, e.g.
    /// `attache.io/accelerator: l4`.
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
}

/// Where an engine's KV events can be read.
#[derive(Debug, Clone, PartialEq, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct KvEventsSpec {
    /// The engine's PUB endpoint, when the engine binds.
    #[serde(default)]
    pub publisher: Option<String>,
    /// The engine's replay ROUTER endpoint.
    #[serde(default)]
    pub replay: Option<String>,
}

fn default_role() -> String {
    "both".into()
}
fn default_engine() -> String {
    "vllm".into()
}
fn default_metrics_path() -> String {
    "/metrics".into()
}

#[derive(Debug, Clone, PartialEq, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct StaticEndpoints {
    #[serde(default)]
    pub endpoints: Vec<StaticEndpoint>,
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("reading {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("parsing {path}: {source}")]
    Parse { path: String, source: serde_yaml::Error },
    #[error("{path}: endpoint `{address}` is not ip:port")]
    BadAddress { path: String, address: String },
}

impl StaticEndpoints {
    pub fn parse(path: &str, text: &str) -> Result<Self, DiscoveryError> {
        let eps: StaticEndpoints =
            serde_yaml::from_str(text).map_err(|source| DiscoveryError::Parse { path: path.into(), source })?;
        for e in &eps.endpoints {
            if e.address.parse::<std::net::SocketAddr>().is_err() {
                return Err(DiscoveryError::BadAddress { path: path.into(), address: e.address.clone() });
            }
        }
        Ok(eps)
    }

    pub fn load(path: &Path) -> Result<Self, DiscoveryError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| DiscoveryError::Read { path: p.clone(), source })?;
        Self::parse(&p, &text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_with_defaults_and_rejects_bad_addresses() {
        let e = StaticEndpoints::parse("f", "endpoints:\n  - address: 127.0.0.1:1\n    models: [m]\n").unwrap();
        assert_eq!(e.endpoints[0].role, "both");
        assert_eq!(e.endpoints[0].engine, "vllm");
        assert_eq!(e.endpoints[0].metrics_path, "/metrics");
        assert!(matches!(
            StaticEndpoints::parse("f", "endpoints:\n  - address: nope\n    models: [m]\n"),
            Err(DiscoveryError::BadAddress { .. })
        ));
        assert!(matches!(StaticEndpoints::parse("f", "endpoints: 3"), Err(DiscoveryError::Parse { .. })));
    }
}
