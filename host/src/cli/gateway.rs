//! `attache gateway`: Attaché in front of real engines without Kubernetes. Renders Envoy's
//! bootstrap from `gateway.yaml` and runs the host and Envoy together.

use std::path::PathBuf;

use attache_host::Host;
use tracing::info;

#[derive(clap::Args)]
pub struct GatewayArgs {
    /// Gateway configuration (YAML): listener, endpoints file, host and scheduler settings.
    #[arg(long)]
    config: PathBuf,
    /// Print the rendered Envoy bootstrap and exit.
    #[arg(long)]
    print_bootstrap: bool,
}

/// `attache gateway`: check everything, render the bootstrap, then run the host in this
/// process and Envoy as a child until either stops or the gateway is told to.
pub async fn run(args: GatewayArgs) -> anyhow::Result<()> {
    let (config, print_bootstrap) = (args.config.as_path(), args.print_bootstrap);
    let gw = attache_host::gateway::Gateway::load(config)?;
    let yaml = gw.bootstrap()?;
    if print_bootstrap {
        print!("{yaml}");
        return Ok(());
    }
    let envoy_bin = gw.envoy()?;
    // Listen for Ctrl-C and SIGTERM before anything starts, so none is missed.
    let mut shutdown = Box::pin(super::shutdown_signal()?);
    let run_dir = attache_host::gateway::RunDir::create()?;
    let bootstrap = run_dir.write("envoy.yaml", &yaml)?;

    // The host first, so Envoy's first EDS and snapshot requests find it listening.
    let host = Host::build(gw.host.clone()).await?;
    let mut envoy = attache_host::gateway::EnvoyProcess::spawn(
        &envoy_bin,
        &bootstrap,
        gw.config.concurrency,
        // A base id of its own, so several gateways (or a gateway and another Envoy) can run on
        // one machine: Envoy's hot-restart shared memory is keyed by it.
        std::process::id(),
    )?;
    info!(
        listen = %gw.config.listen,
        envoy_admin = %gw.config.envoy_admin,
        host_admin = %gw.host.admin_listen,
        endpoints_file = %gw.config.endpoints_file.display(),
        envoy_pid = envoy.pid(),
        bootstrap = %bootstrap.display(),
        "attache gateway running"
    );
    let result = tokio::select! {
        biased;
        _ = &mut shutdown => { info!("shutting down"); Ok(()) }
        st = envoy.wait() => Err(anyhow::anyhow!("Envoy exited ({}); its messages are above", st?)),
        r = host.run() => r.and_then(|()| Err(anyhow::anyhow!("the host stopped"))),
    };
    envoy.stop(std::time::Duration::from_secs(10)).await;
    result
}
