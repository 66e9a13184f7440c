//! `attache host`: the host service, from its configuration file and flag overrides, until
//! Ctrl-C or SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use attache_host::{Host, HostConfig};
use tracing::info;

#[derive(clap::Args)]
pub struct HostArgs {
    /// Host configuration (YAML).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Static endpoints file (overrides `endpoints_file` in the config).
    #[arg(long)]
    endpoints: Option<PathBuf>,
    /// gRPC listen address (overrides the config).
    #[arg(long)]
    grpc_listen: Option<SocketAddr>,
    /// Admin listen address (overrides the config).
    #[arg(long)]
    admin_listen: Option<SocketAddr>,
}

impl HostArgs {
    /// The configuration file (or the defaults) with the flags laid over it.
    fn config(self) -> anyhow::Result<HostConfig> {
        let mut cfg = match self.config {
            Some(p) => {
                HostConfig::from_yaml(&std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?)
                    .with_context(|| format!("parsing {}", p.display()))?
            }
            None => HostConfig::default(),
        };
        if self.endpoints.is_some() {
            cfg.endpoints_file = self.endpoints;
        }
        if let Some(a) = self.grpc_listen {
            cfg.grpc_listen = a;
        }
        if let Some(a) = self.admin_listen {
            cfg.admin_listen = a;
        }
        Ok(cfg)
    }
}

pub async fn run(args: HostArgs) -> anyhow::Result<()> {
    let cfg = args.config()?;
    let shutdown = super::shutdown_signal()?;
    let host = Host::build(cfg).await?;
    tokio::select! {
        biased;
        _ = shutdown => { info!("shutting down"); Ok(()) }
        r = host.run() => r,
    }
}
