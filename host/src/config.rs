//! Host configuration (YAML). Durations are typed; every field has a default.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

#[derive(Debug, Clone, serde::Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HostConfig {
    /// gRPC listen address for the snapshot stream (Envoy's `attache_host` cluster).
    pub grpc_listen: SocketAddr,
    /// Admin HTTP listen address.
    pub admin_listen: SocketAddr,
    /// File holding the admin API's bearer token (else `$ATTACHE_ADMIN_TOKEN`): every `/v1/*`
    /// route except `/v1/policy/*` (which uses `policy.admin_token_file`) then requires it.
    /// Required when `admin_listen` is not a loopback address.
    pub admin_token_file: Option<PathBuf>,
    /// Static endpoint file (see `discovery`). Re-read when it changes.
    pub endpoints_file: Option<PathBuf>,
    /// How often each engine's `/metrics` is scraped while its metrics change.
    pub scrape_interval_ms: u64,
    /// The longest scrape interval: each scrape that finds an engine's metrics unchanged
    /// doubles its interval up to this; a change, a failure or a KV event from the engine
    /// brings it back to `scrape_interval_ms`. Equal to `scrape_interval_ms` (or 0): fixed.
    /// Must stay below `unready_after_ms`.
    pub scrape_max_interval_ms: u64,
    /// Per-scrape timeout.
    pub scrape_timeout_ms: u64,
    /// Ask each vLLM engine for only the samples the scheduler reads (`GET /metrics/?name[]=…`,
    /// a few hundred bytes instead of ~26 KB). An engine that cannot filter (multi-process
    /// vLLM answers an empty page, a server without the route a 4xx) is scraped whole from its
    /// first such answer, and counted in `attache_host_scrape_filter_fallbacks_total`; a 5xx
    /// fails that scrape only. SGLang is always scraped whole.
    pub scrape_metric_filter: bool,
    /// How often each engine's `GET /v1/models` is read, for the LoRA adapters it has loaded
    /// (also those loaded at run time); 0 never reads it.
    pub models_interval_ms: u64,
    /// Metrics older than this mark an endpoint as not ready in snapshots.
    pub unready_after_ms: u64,
    /// Minimum interval between two snapshot versions.
    pub publish_interval_ms: u64,
    /// Heartbeat interval on the snapshot stream.
    pub heartbeat_ms: u64,
    /// Bind a collector SUB socket here for engines that connect their KV-event publisher
    /// (vLLM's `tcp://host:port` form), e.g. `tcp://0.0.0.0:5557`.
    pub kv_events_bind: Option<String>,
    /// Most blocks the precise index holds (CLOCK eviction beyond).
    pub kv_index_capacity: usize,
    /// Flow control inputs pushed with each snapshot: the saturation detector and the
    /// InferenceObjective priority table.
    pub flow: crate::state::FlowInputs,
    /// Kubernetes discovery (InferencePools, their pods, InferenceObjectives). Exclusive with
    /// `endpoints_file`.
    pub kubernetes: Option<crate::kubernetes::KubernetesConfig>,
    /// Policy modules: store, trust store, admin token, rollout controller. Off when absent.
    pub policy: Option<crate::policy::service::PolicyConfig>,
    /// The endpoint picker for Gateway API Inference Extension gateways. Off when absent.
    pub epp: Option<crate::epp::EppConfig>,
    /// Fleet state: what each Envoy learns (bindings, prefix affinity, tenant usage), merged
    /// and sent to the others.
    pub fleet: crate::fleet::FleetConfig,
    /// Autoscaling signals in `/metrics` (`attache_pool_*`): the pool label and the latency
    /// objectives the SLO ratios divide by.
    pub autoscaling: crate::autoscaling::AutoscalingConfig,
    /// The gateway's Responses API store (`docs/responses.md`): its bounds and TTL.
    pub responses: crate::responses::ResponsesConfig,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            grpc_listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9190)),
            admin_token_file: None,
            endpoints_file: None,
            scrape_interval_ms: 50,
            scrape_timeout_ms: 500,
            scrape_metric_filter: true,
            scrape_max_interval_ms: 800,
            models_interval_ms: 2_000,
            unready_after_ms: 2_000,
            publish_interval_ms: 50,
            heartbeat_ms: 1_000,
            kv_events_bind: None,
            kv_index_capacity: 1_000_000,
            policy: None,
            epp: None,
            kubernetes: None,
            flow: crate::state::FlowInputs::default(),
            fleet: crate::fleet::FleetConfig::default(),
            autoscaling: crate::autoscaling::AutoscalingConfig::default(),
            responses: crate::responses::ResponsesConfig::default(),
        }
    }
}

impl HostConfig {
    pub fn scrape_interval(&self) -> Duration {
        ms(self.scrape_interval_ms)
    }
    /// The longest adaptive scrape interval (never below `scrape_interval_ms`).
    pub fn scrape_max_interval(&self) -> Duration {
        ms(self.scrape_max_interval_ms.max(self.scrape_interval_ms))
    }
    pub fn scrape_timeout(&self) -> Duration {
        ms(self.scrape_timeout_ms)
    }
    /// `None`: never read `/v1/models`.
    pub fn models_interval(&self) -> Option<Duration> {
        (self.models_interval_ms > 0).then(|| ms(self.models_interval_ms))
    }
    pub fn publish_interval(&self) -> Duration {
        ms(self.publish_interval_ms)
    }
    pub fn heartbeat(&self) -> Duration {
        ms(self.heartbeat_ms)
    }

    pub fn from_yaml(text: &str) -> anyhow::Result<Self> {
        let c: Self = serde_yaml::from_str(text)?;
        let adaptive = c.scrape_max_interval_ms > c.scrape_interval_ms;
        anyhow::ensure!(
            !adaptive || c.scrape_max_interval_ms < c.unready_after_ms,
            "scrape_max_interval_ms ({}) must stay below unready_after_ms ({}): an idle engine would turn unready between scrapes",
            c.scrape_max_interval_ms,
            c.unready_after_ms
        );
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(name: &str, value: &impl serde::Serialize) {
        let yaml = serde_yaml::to_string(value).unwrap();
        attache_fixtures::check_generated_block("docs/configuration.md", name, "yaml", &yaml).unwrap();
    }

    /// `docs/configuration.md` shows exactly the code's defaults, and they parse back.
    #[test]
    fn configuration_doc_shows_the_defaults() {
        check("host-defaults", &HostConfig::default());
        check("host-kubernetes-defaults", &crate::kubernetes::KubernetesConfig::default());
        check("host-policy-auto-defaults", &attache_policies::canary::AutoPolicy::default());
        let text = serde_yaml::to_string(&HostConfig::default()).unwrap();
        assert_eq!(HostConfig::from_yaml(&text).unwrap().grpc_listen, HostConfig::default().grpc_listen);
    }

    #[test]
    fn an_adaptive_interval_must_stay_below_unready_after() {
        let e = HostConfig::from_yaml("scrape_max_interval_ms: 3000").unwrap_err().to_string();
        assert!(e.contains("must stay below unready_after_ms (2000)"), "{e}");
        // A fixed interval is the operator's to choose, however long.
        let fixed = HostConfig::from_yaml("scrape_interval_ms: 3600000\nunready_after_ms: 3600000").unwrap();
        assert_eq!(fixed.scrape_max_interval(), Duration::from_secs(3600));
        assert!(HostConfig::from_yaml("scrape_max_interval_ms: 1500").is_ok());
    }
}
