//! The `attache` command line: `host`, `gateway`, `policy` and `async` subcommands.

mod async_cmd;
mod gateway;
mod host;
mod policy;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "attache", about = "Attaché: an inference scheduler inside Envoy", version)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the host service: discovery, metrics scraping, snapshot stream, admin API.
    Host(host::HostArgs),
    /// Attaché in front of real engines without Kubernetes: render Envoy's bootstrap from
    /// `gateway.yaml` and run the host and Envoy together, the pool fed by the host's EDS.
    Gateway(gateway::GatewayArgs),
    /// Policy modules: keys, signatures, upload and rollout.
    Policy {
        #[command(subcommand)]
        cmd: policy::PolicyCmd,
    },
    /// The batch worker: jobs from Redis into the pool's spare capacity, through the gateway.
    Async(Box<async_cmd::AsyncArgs>),
}

impl Cli {
    /// Run the subcommand.
    pub async fn run(self) -> anyhow::Result<()> {
        match self.cmd {
            Cmd::Policy { cmd } => policy::run(cmd).await,
            Cmd::Gateway(args) => gateway::run(args).await,
            Cmd::Host(args) => host::run(args).await,
            Cmd::Async(args) => async_cmd::run(*args).await,
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM (what Kubernetes and systemd send). The handlers are
/// installed when this is called, not when the future is first polled.
pub(crate) fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    })
}
