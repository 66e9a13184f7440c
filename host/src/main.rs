//! `attache`: the Attaché host service and CLI.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use attache_host::discovery::StaticEndpoints;
use attache_host::kv_subscribe::{EngineSource, KvSubscribers};
use attache_host::policy::service::PolicyService;
use attache_host::state::PoolState;
use attache_host::{admin, eds, policy, push, scrape, HostConfig};
use attache_kv::engine::Engine;
use attache_kv::KvIndex;
use clap::{Parser, Subcommand};
use tokio::sync::RwLock;
use tracing::{error, info, warn};

#[derive(Parser)]
#[command(name = "attache", about = "Attaché: an inference scheduler inside Envoy", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the host service: discovery, metrics scraping, snapshot stream, admin API.
    Host {
        /// Host configuration (YAML).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Static endpoints file (overrides `endpoints_file` in the config).
        #[arg(long)]
        endpoints: Option<PathBuf>,
        /// gRPC listen address (overrides the config).
        #[arg(long)]
        grpc_listen: Option<std::net::SocketAddr>,
        /// Admin listen address (overrides the config).
        #[arg(long)]
        admin_listen: Option<std::net::SocketAddr>,
    },
    /// Attaché in front of real engines without Kubernetes: render Envoy's bootstrap from
    /// `gateway.yaml` and run the host and Envoy together, the pool fed by the host's EDS.
    Gateway {
        /// Gateway configuration (YAML): listener, endpoints file, host and scheduler settings.
        #[arg(long)]
        config: PathBuf,
        /// Print the rendered Envoy bootstrap and exit.
        #[arg(long)]
        print_bootstrap: bool,
    },
    /// Policy modules: keys, signatures, upload and rollout.
    Policy {
        #[command(subcommand)]
        cmd: PolicyCmd,
    },
}

#[derive(Subcommand)]
enum PolicyCmd {
    /// Write a new Ed25519 signing key pair: DIR/attache.key (private, mode 0600) and
    /// DIR/attache.pub.
    Keygen {
        #[arg(long)]
        out: PathBuf,
    },
    /// Sign a Wasm module (WebAssembly tool-conventions signature section, as wasmsign2).
    Sign {
        #[arg(long)]
        key: PathBuf,
        #[arg(long = "in")]
        input: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
    /// Verify a signed module against a public key (or a directory of `*.pub` keys); exits 0
    /// only on a valid signature by that key.
    Verify {
        #[arg(long)]
        pubkey: PathBuf,
        #[arg(long = "in")]
        input: PathBuf,
    },
    /// Upload a signed scorer module for a slot (verified and admitted by the host).
    Upload {
        #[command(flatten)]
        server: Server,
        #[arg(long)]
        slot: String,
        /// Version label, e.g. v3 or a git sha.
        #[arg(long)]
        version: String,
        #[arg(long = "in")]
        input: PathBuf,
        /// The scorer's own configuration (JSON), checked by admission.
        #[arg(long)]
        params: Option<String>,
    },
    /// List uploaded modules.
    List {
        #[command(flatten)]
        server: Server,
        #[arg(long)]
        slot: Option<String>,
    },
    /// Start a canary: the module (sha256 or version) acts on `--canary` percent of sessions.
    Rollout {
        #[command(flatten)]
        server: Server,
        #[arg(long)]
        slot: String,
        #[arg(long)]
        module: String,
        /// e.g. 5% or 5
        #[arg(long, default_value = "5%")]
        canary: String,
        /// Weight the picker gives the scorer's 0..1 scores.
        #[arg(long, default_value_t = 1.0)]
        weight: f64,
    },
    /// Make the slot's canary its stable version.
    Promote(SlotAction),
    /// Drop the slot's canary (or, without one, return to the previous stable version).
    Rollback(SlotAction),
    /// Versions, canary counters, controller verdicts, Envoy ACKs and transitions.
    Status {
        #[command(flatten)]
        server: Server,
    },
}

#[derive(clap::Args)]
struct SlotAction {
    #[command(flatten)]
    server: Server,
    #[arg(long)]
    slot: String,
    /// Recorded in the transition log.
    #[arg(long, default_value = "")]
    reason: String,
}

#[derive(clap::Args)]
struct Server {
    /// The host's admin address.
    #[arg(long, default_value = "http://127.0.0.1:9190")]
    server: String,
    /// Bearer token (default: $ATTACHE_ADMIN_TOKEN).
    #[arg(long, env = "ATTACHE_ADMIN_TOKEN", hide_env_values = true)]
    token: String,
}

impl Server {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.server.trim_end_matches('/'))
    }
}

/// Send an admin API request; print the JSON answer; fail with the API's message.
async fn api(server: &Server, req: reqwest::RequestBuilder) -> anyhow::Result<()> {
    let resp = req.bearer_auth(&server.token).send().await.with_context(|| format!("contacting {}", server.server))?;
    let status = resp.status();
    let body: serde_json::Value = resp.json().await.unwrap_or(serde_json::Value::Null);
    if !status.is_success() {
        anyhow::bail!(
            "{} ({}): {}",
            status,
            body["error"].as_str().unwrap_or("error"),
            body["message"].as_str().unwrap_or("no message")
        );
    }
    println!("{}", serde_json::to_string_pretty(&body)?);
    Ok(())
}

/// `promote` or `rollback` a slot.
async fn transition(a: &SlotAction, action: &str) -> anyhow::Result<()> {
    let req = reqwest::Client::new()
        .post(a.server.url(&format!("/v1/policy/slots/{}/{action}", a.slot)))
        .json(&serde_json::json!({"reason": a.reason}));
    api(&a.server, req).await
}

async fn policy(cmd: PolicyCmd) -> anyhow::Result<()> {
    use attache_host::policy::signing;
    let read = |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));

    match cmd {
        PolicyCmd::Keygen { out } => {
            let (key, public, fp) = signing::keygen(&out)?;
            println!("wrote {} and {} (key {fp})", key.display(), public.display());
        }
        PolicyCmd::Sign { key, input, out } => {
            let signed = signing::sign(&read(&key)?, &read(&input)?)?;
            std::fs::write(&out, &signed).with_context(|| format!("writing {}", out.display()))?;
            println!("signed {} -> {} (sha256 {})", input.display(), out.display(), signing::sha256_hex(&signed));
        }
        PolicyCmd::Verify { pubkey, input } => {
            let store = signing::TrustStore::load(&pubkey)?;
            let v = store.verify(&read(&input)?).map_err(|e| anyhow::anyhow!("{}: {e}", input.display()))?;
            println!("{}: valid signature by {} (sha256 {})", input.display(), v.signers.join(", "), v.sha256);
        }
        PolicyCmd::Upload { server, slot, version, input, params } => {
            let mut query = vec![("slot", slot), ("version", version)];
            if let Some(p) = params {
                query.push(("params", p));
            }
            let req = reqwest::Client::new().post(server.url("/v1/policy/modules")).query(&query).body(read(&input)?);
            api(&server, req).await?;
        }
        PolicyCmd::List { server, slot } => {
            let mut req = reqwest::Client::new().get(server.url("/v1/policy/modules"));
            if let Some(s) = slot {
                req = req.query(&[("slot", s)]);
            }
            api(&server, req).await?;
        }
        PolicyCmd::Rollout { server, slot, module, canary, weight } => {
            let percent: f64 = canary
                .trim()
                .trim_end_matches('%')
                .parse()
                .with_context(|| format!("--canary {canary:?}: expected a percentage like 5%"))?;
            let body = serde_json::json!({"module": module, "canary_percent": percent, "weight": weight});
            let req = reqwest::Client::new().post(server.url(&format!("/v1/policy/slots/{slot}/rollout"))).json(&body);
            api(&server, req).await?;
        }
        PolicyCmd::Promote(a) => transition(&a, "promote").await?,
        PolicyCmd::Rollback(a) => transition(&a, "rollback").await?,
        PolicyCmd::Status { server } => {
            api(&server, reqwest::Client::new().get(server.url("/v1/policy/status"))).await?;
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    match Cli::parse().cmd {
        Cmd::Policy { cmd } => policy(cmd).await,
        Cmd::Gateway { config, print_bootstrap } => gateway(&config, print_bootstrap).await,
        Cmd::Host { config, endpoints, grpc_listen, admin_listen } => {
            let mut cfg = match config {
                Some(p) => HostConfig::from_yaml(
                    &std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?,
                )
                .with_context(|| format!("parsing {}", p.display()))?,
                None => HostConfig::default(),
            };
            if endpoints.is_some() {
                cfg.endpoints_file = endpoints;
            }
            if let Some(a) = grpc_listen {
                cfg.grpc_listen = a;
            }
            if let Some(a) = admin_listen {
                cfg.admin_listen = a;
            }
            run_host(cfg).await
        }
    }
}

/// `attache gateway`: check everything, render the bootstrap, then run the host in this
/// process and Envoy as a child until either stops or the gateway is told to.
async fn gateway(config: &std::path::Path, print_bootstrap: bool) -> anyhow::Result<()> {
    let gw = attache_host::gateway::Gateway::load(config)?;
    let yaml = gw.bootstrap()?;
    if print_bootstrap {
        print!("{yaml}");
        return Ok(());
    }
    let envoy_bin = gw.envoy()?;
    // Listen for Ctrl-C and SIGTERM before anything starts, so none is missed.
    let mut shutdown = Box::pin(shutdown_signal()?);
    let run_dir = attache_host::gateway::RunDir::create()?;
    let bootstrap = run_dir.write("envoy.yaml", &yaml)?;

    // The host first, so Envoy's first EDS and snapshot requests find it listening.
    let host = Host::start(gw.host.clone()).await?;
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

/// Resolves on Ctrl-C or SIGTERM (what Kubernetes and systemd send). The handlers are
/// installed when this is called, not when the future is first polled.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
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

/// Apply a discovery result: Envoy's pool (EDS), scrapers, pool state, and KV-event subscribers.
async fn apply_discovery(
    eps: StaticEndpoints,
    scrapers: &mut scrape::Scrapers,
    kv: &mut KvSubscribers,
    state: &Arc<RwLock<PoolState>>,
    collector: bool,
    members: &eds::Members,
) {
    members.set(eps.endpoints.iter().map(|e| e.address.clone()).collect());
    attache_host::telemetry::metrics().track(eps.endpoints.iter().map(|e| e.address.as_str()));
    scrapers.apply(eps.endpoints.clone()).await;
    let mut st = state.write().await;
    let sources = eps
        .endpoints
        .iter()
        .filter(|e| e.kv_events.is_some() || collector)
        .map(|e| {
            let spec = e.kv_events.clone().unwrap_or_default();
            EngineSource {
                endpoint_id: st.id_of(&e.address),
                address: e.address.clone(),
                model: e.models.first().cloned().unwrap_or_default(),
                engine: Engine::from_name(&e.engine),
                publisher: spec.publisher,
                replay: spec.replay,
            }
        })
        .collect();
    drop(st);
    kv.apply(sources);
}

async fn run_host(cfg: HostConfig) -> anyhow::Result<()> {
    let shutdown = shutdown_signal()?;
    let host = Host::start(cfg).await?;
    tokio::select! {
        biased;
        _ = shutdown => { info!("shutting down"); Ok(()) }
        r = host.run() => r,
    }
}

/// A started host: its listeners are bound and discovery runs; [`Host::run`] serves.
struct Host {
    serve: std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + Send>>,
}

impl Host {
    fn run(self) -> std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + Send>> {
        self.serve
    }

    async fn start(cfg: HostConfig) -> anyhow::Result<Host> {
        let epoch = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
        let mut pool = PoolState::default();
        pool.flow = cfg.flow.clone();
        let state = Arc::new(RwLock::new(pool));
        let client = reqwest::Client::builder().pool_max_idle_per_host(2).build()?;

        let admin_token = attache_host::admin_auth::BearerToken::load(cfg.admin_token_file.as_deref())
            .context("the admin API's bearer token")?;
        attache_host::admin_auth::check_exposure(cfg.admin_listen, admin_token.as_ref())?;
        if cfg.endpoints_file.is_some() && cfg.kubernetes.is_some() {
            anyhow::bail!("endpoints_file and kubernetes are exclusive: pick one discovery source");
        }
        // Validate the endpoints file (or reach the cluster's credentials) before binding any port.
        let kube = match cfg.kubernetes.clone() {
            Some(k) => Some(attache_host::kubernetes::spawn(k).await.context("starting Kubernetes discovery")?),
            None => None,
        };
        let initial = match &cfg.endpoints_file {
            Some(p) => StaticEndpoints::load(p)?,
            None => StaticEndpoints::default(),
        };

        let rx = push::spawn_publisher(
            state.clone(),
            epoch,
            cfg.publish_interval(),
            std::time::Duration::from_millis(cfg.unready_after_ms),
        );
        let kv_index = Arc::new(Mutex::new(KvIndex::new(cfg.kv_index_capacity)));
        // Policy modules: refuse to start on a bad trust store or token rather than run without.
        let policy = match cfg.policy.clone() {
            Some(p) => Some(PolicyService::open(p).context("starting the policy service")?),
            None => None,
        };
        let kv_changed = Arc::new(tokio::sync::Notify::new());
        // Envoy's pool members, served over EDS (`attache gateway`; any Envoy may subscribe).
        let members = eds::Members::default();
        // ECDS is always served, so Envoy's scorer and scheduler slots keep their defaults quietly
        // when no policy service is configured (the sender lives as long as the host).
        let (_no_policy_tx, no_policy_rx) = tokio::sync::watch::channel(Arc::new(policy::ecds::Published::default()));
        let ecds = match &policy {
            Some(p) => policy::ecds::EcdsServer::new(p.subscribe(), p.acks.clone()),
            None => policy::ecds::EcdsServer::new(no_policy_rx, Arc::new(policy::ecds::Acks::default())),
        };
        let grpc = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(std::time::Duration::from_secs(2)))
            .add_service(
                push::Snapshots::new(rx.clone(), cfg.heartbeat())
                    .with_index(push::IndexFeed::spawn(
                        kv_index.clone(),
                        kv_changed.clone(),
                        std::time::Duration::from_millis(100),
                        std::time::Duration::from_millis(2),
                    ))
                    .into_server(),
            )
            .add_service(ecds.into_server())
            .add_service(eds::EdsServer::new(&members).into_server());
        let grpc_listener = tokio::net::TcpListener::bind(cfg.grpc_listen)
            .await
            .with_context(|| format!("binding {}", cfg.grpc_listen))?;
        let admin_listener = tokio::net::TcpListener::bind(cfg.admin_listen)
            .await
            .with_context(|| format!("binding {}", cfg.admin_listen))?;
        info!(grpc = %cfg.grpc_listen, admin = %cfg.admin_listen, epoch, "attache host listening");

        // The precise index, fed by the engines' KV events.
        let mut kv = KvSubscribers::new(kv_index.clone(), kv_changed.clone());
        let collector = cfg.kv_events_bind.is_some();
        if let Some(b) = &cfg.kv_events_bind {
            kv.bind_collector(b).with_context(|| format!("binding the KV-event collector on {b}"))?;
        }
        let kv_counters = kv.counters.clone();

        // Discovery: apply the file now and re-read it when it changes.
        let mut scrapers = scrape::Scrapers::new(client, state.clone(), cfg.scrape_interval(), cfg.scrape_timeout())
            .with_engine_gone(kv.engine_gone());
        info!(endpoints = initial.endpoints.len(), "discovery: static file loaded");
        apply_discovery(initial, &mut scrapers, &mut kv, &state, collector, &members).await;
        if let Some(mut d) = kube {
            let (state, static_objectives, members) = (state.clone(), cfg.flow.objectives.clone(), members.clone());
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        r = d.endpoints.changed() => {
                            if r.is_err() { break; }
                            let endpoints = d.endpoints.borrow_and_update().clone();
                            apply_discovery(StaticEndpoints { endpoints }, &mut scrapers, &mut kv, &state, collector, &members).await;
                        }
                        r = d.objectives.changed() => {
                            if r.is_err() { break; }
                            // The cluster's objectives over the static table.
                            let mut table = static_objectives.clone();
                            table.extend(d.objectives.borrow_and_update().iter().map(|(k, v)| (k.clone(), *v)));
                            let mut st = state.write().await;
                            st.flow.objectives = table;
                            st.generation += 1;
                        }
                    }
                }
            });
        } else if let Some(path) = cfg.endpoints_file.clone() {
            let members = members.clone();
            tokio::spawn(async move {
                let mut last = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
                loop {
                    // A stat(2) every 200 ms: an edited file takes effect within a fifth of a second.
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    let now = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
                    if now == last {
                        continue;
                    }
                    last = now;
                    match StaticEndpoints::load(&path) {
                        Ok(eps) => {
                            info!(endpoints = eps.endpoints.len(), "discovery: static file reloaded");
                            apply_discovery(eps, &mut scrapers, &mut kv, &state, collector, &members).await;
                        }
                        Err(e) => warn!(error = %e, "discovery: keeping the previous endpoints"),
                    }
                }
            });
        }

        let mut admin_router = admin::router(admin::AdminState { snapshots: rx, kv_index, kv_counters });
        if let Some(t) = admin_token {
            admin_router =
                admin_router.route_layer(axum::middleware::from_fn_with_state(t, attache_host::admin_auth::require));
        }
        if let Some(p) = &policy {
            p.spawn_controller();
            admin_router = admin_router.merge(policy::api::router(p.clone()));
        }
        let admin = std::future::IntoFuture::into_future(axum::serve(admin_listener, admin_router));
        let grpc = grpc.serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(grpc_listener));
        let serve = async move {
            // Alive as long as the servers: ECDS streams end when their sender is gone, and
            // EDS streams when the membership's is.
            let _keep = (_no_policy_tx, members);
            tokio::select! {
                r = grpc => { if let Err(e) = r { error!(error = %e, "grpc server stopped"); } }
                r = admin => { if let Err(e) = r { error!(error = %e, "admin server stopped"); } }
            }
            Ok(())
        };
        Ok(Host { serve: Box::pin(serve) })
    }
}
