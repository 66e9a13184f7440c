//! A deployment of Attaché on loopback: the simulated engines, the host and Envoy, each a real
//! process on fresh ports, started and stopped by one [`Stack`]. Each part's methods live in
//! its own module: [`engines`] (the simulator, extra and external engines, the endpoints file),
//! [`host`] and [`envoy`] (bootstrap, start, stats). [`epp_envoy`] starts a second Envoy beside
//! them, configured as gateways configure it for an endpoint picker.

use std::path::PathBuf;
use std::process::Command;

use anyhow::Context;

use crate::paths::Paths;
use crate::ports::free_port;
use crate::process::Proc;

mod engines;
mod envoy;
mod epp_envoy;
mod host;
mod replicas;

pub use engines::{CheapOpts, ExternalEngine, SimOpts};
pub use envoy::EnvoyKind;
pub use epp_envoy::{validate_bootstrap, EppEnvoy, EppEnvoyOpts};
pub use host::MoreHost;
pub use replicas::Replica;

/// A running deployment: simulator, host and Envoy, on fresh ports.
pub struct Stack {
    pub paths: Paths,
    pub workdir: PathBuf,
    pub sim: Option<Proc>,
    pub host: Option<Proc>,
    /// Host replicas beside `host` ([`Stack::start_more_host`]).
    pub more_hosts: Vec<MoreHost>,
    pub envoy: Option<Proc>,
    pub sim_opts: SimOpts,
    pub sim_base_port: u16,
    /// First KV-event port: engine i publishes on base+2i, replays on base+2i+1.
    pub kv_base_port: u16,
    pub host_grpc_port: u16,
    pub host_admin_port: u16,
    pub envoy_port: u16,
    pub envoy_admin_port: u16,
    /// Envoy's `--log-level` (`warn` keeps test logs short; Envoy's own default is `info`).
    pub envoy_log_level: String,
    pub endpoints_file: PathBuf,
    pub http: reqwest::Client,
    /// Engines not run by this stack (a live vLLM), listed after the simulated ones.
    pub external: Vec<ExternalEngine>,
    /// Processes started next to the stack (killed with it).
    pub extra_procs: Vec<Proc>,
    /// Custom scorer slots in Envoy's chain (each a stable and a canary ECDS filter, then the
    /// picker). Empty: the scheduler routes alone.
    pub scorer_slots: Vec<String>,
    /// The host's `policy:` configuration (JSON), if the policy service should run.
    pub host_policy: Option<serde_json::Value>,
    /// The host's `flow:` configuration (JSON): saturation detector and objectives.
    pub host_flow: Option<serde_json::Value>,
    /// The host's `kubernetes:` configuration (JSON): discovery from an API server instead of
    /// the endpoints file.
    pub host_kubernetes: Option<serde_json::Value>,
    /// The host's `epp:` configuration (JSON): the endpoint picker, listening on
    /// [`Stack::host_epp_port`] unless it names its own `listen`.
    pub host_epp: Option<serde_json::Value>,
    /// Other top-level host settings (JSON object), e.g. `scrape_interval_ms`.
    pub host_extra: Option<serde_json::Value>,
    pub host_epp_port: u16,
    /// Pod labels per engine (by index in `engine_addrs`), written to the endpoints file.
    pub endpoint_labels: Vec<Vec<(String, String)>>,
    /// `llm-d.ai/role` per engine (`prefill`, `decode`, `both`); engines not listed are `both`.
    pub endpoint_roles: Vec<String>,
    /// An Envoy template to render instead of `envoy/<kind>.yaml` (same placeholders): what a
    /// benchmark variant uses to measure an edited route or cluster.
    pub envoy_template: Option<PathBuf>,
}

impl Stack {
    /// A stack with nothing started yet; `name` names its work directory.
    pub fn new(name: &str) -> anyhow::Result<Self> {
        let paths = Paths::discover()?;
        let workdir = paths.target.join("attache-e2e").join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&workdir).with_context(|| format!("creating {}", workdir.display()))?;
        Ok(Self {
            endpoints_file: workdir.join("endpoints.yaml"),
            paths,
            workdir,
            sim: None,
            host: None,
            more_hosts: Vec::new(),
            envoy: None,
            sim_opts: SimOpts::default(),
            sim_base_port: 0,
            kv_base_port: 0,
            host_grpc_port: free_port(),
            host_admin_port: free_port(),
            envoy_port: free_port(),
            envoy_admin_port: free_port(),
            envoy_log_level: "warn".into(),
            http: reqwest::Client::builder().pool_max_idle_per_host(64).build()?,
            external: Vec::new(),
            extra_procs: Vec::new(),
            scorer_slots: Vec::new(),
            host_policy: None,
            host_flow: None,
            host_kubernetes: None,
            host_epp: None,
            host_extra: None,
            host_epp_port: free_port(),
            endpoint_labels: Vec::new(),
            endpoint_roles: Vec::new(),
            envoy_template: None,
        })
    }

    /// Start a process whose output goes to `<workdir>/<name>.log`.
    pub fn spawn(&self, name: &str, cmd: &mut Command) -> anyhow::Result<Proc> {
        Proc::spawn(&self.workdir, name, cmd)
    }
}
