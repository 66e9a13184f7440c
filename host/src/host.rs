//! The host service wired together: pool state, discovery, scrapers, KV-event subscribers, the
//! snapshot, ECDS and EDS gRPC services, the policy service and the admin API.
//! [`Host::build`] checks the configuration, binds the listeners and starts discovery;
//! [`Host::run`] serves.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use attache_kv::KvIndex;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify, RwLock};
use tracing::{error, info};

use crate::discovery::{self, Sink, StaticEndpoints};
use crate::kv_subscribe::KvSubscribers;
use crate::policy::ecds::{self, Published};
use crate::policy::service::PolicyService;
use crate::scrape::Scrapers;
use crate::state::PoolState;
use crate::{admin, admin_auth, eds, epp, kubernetes, policy, push, HostConfig};

type Serve = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// A built host: its listeners are bound and discovery runs; [`Host::run`] serves.
pub struct Host {
    serve: Serve,
}

/// The discovery source: Kubernetes, or the endpoints file's first reading.
struct Source {
    kube: Option<kubernetes::Discovered>,
    initial: StaticEndpoints,
}

impl Host {
    /// Serve gRPC and the admin API until either server stops.
    pub fn run(self) -> Serve {
        self.serve
    }

    /// Check the configuration, start every service and bind the listeners.
    pub async fn build(cfg: HostConfig) -> anyhow::Result<Host> {
        let epoch = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
        let mut pool = PoolState::default();
        pool.flow = cfg.flow.clone();
        let state = Arc::new(RwLock::new(pool));
        let client = reqwest::Client::builder().pool_max_idle_per_host(2).build()?;

        let admin_token =
            admin_auth::BearerToken::load(cfg.admin_token_file.as_deref()).context("the admin API's bearer token")?;
        admin_auth::check_exposure(cfg.admin_listen, admin_token.as_ref())?;
        let source = discovery_source(&cfg).await?;

        let rx = push::spawn_publisher(
            state.clone(),
            epoch,
            cfg.publish_interval(),
            Duration::from_millis(cfg.unready_after_ms),
        );
        let kv_index = Arc::new(Mutex::new(KvIndex::new(cfg.kv_index_capacity)));
        // Policy modules: refuse to start on a bad trust store or token rather than run without.
        let policy = match cfg.policy.clone() {
            Some(p) => {
                Some(PolicyService::open(p, &host_name(&cfg, epoch)).await.context("starting the policy service")?)
            }
            None => None,
        };
        let kv_changed = Arc::new(Notify::new());
        // Envoy's pool members, served over EDS (`attache gateway`; any Envoy may subscribe).
        let members = eds::Members::default();
        let fleet = crate::fleet::FleetFeed::spawn(cfg.fleet.clone());
        crate::peers::spawn(fleet.clone(), host_name(&cfg, epoch), own_addresses(&cfg));
        let responses = crate::responses::Responses::start(cfg.responses.clone()).await?;
        let (no_policy_tx, grpc) =
            grpc_services(&cfg, policy.as_ref(), rx.clone(), &kv_index, &kv_changed, &members, &fleet);
        let grpc = grpc.add_service(responses.clone().into_server());
        let grpc_listener = bind(cfg.grpc_listen).await?;
        let admin_listener = bind(cfg.admin_listen).await?;
        info!(grpc = %cfg.grpc_listen, admin = %cfg.admin_listen, epoch, "attache host listening");

        // The precise index, fed by the engines' KV events.
        let activity = crate::activity::Activity::default();
        let kv = KvSubscribers::new(kv_index.clone(), kv_changed.clone()).with_activity(activity.clone());
        if let Some(b) = &cfg.kv_events_bind {
            kv.bind_collector(b).with_context(|| format!("binding the KV-event collector on {b}"))?;
        }
        let kv_counters = kv.counters.clone();
        start_discovery(&cfg, source, client, state, kv, activity, members.clone()).await;
        let (picker, epp) = match &cfg.epp {
            Some(e) => {
                let metrics = Arc::new(epp::metrics::EppMetrics::default());
                let p = Arc::new(epp::Picker::new(e.config.clone(), rx.clone(), kv_index.clone(), metrics)?);
                (Some(p.clone()), Some(epp::service::serve(e, p).await?))
            }
            None => (None, None),
        };

        let admin_state = admin::AdminState {
            snapshots: rx,
            kv_index,
            kv_counters,
            picker,
            fleet: Some(fleet),
            autoscaling: cfg.autoscaling.clone(),
            responses: Some(responses),
        };
        let admin_router = admin_router(admin_state, admin_token, policy);
        let admin = std::future::IntoFuture::into_future(axum::serve(admin_listener, admin_router));
        let grpc = grpc.serve_with_incoming(crate::tcp::no_delay(grpc_listener));
        let serve = async move {
            // Alive as long as the servers: ECDS streams end when their sender is gone, and
            // EDS streams when the membership's is.
            let _keep = (no_policy_tx, members);
            let epp = async move {
                match epp {
                    Some(f) => f.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = grpc => { if let Err(e) = r { error!(error = %e, "grpc server stopped"); } }
                r = admin => { if let Err(e) = r { error!(error = %e, "admin server stopped"); } }
                r = epp => { if let Err(e) = r { error!(error = %e, "endpoint picker stopped"); } }
            }
            Ok(())
        };
        Ok(Host { serve: Box::pin(serve) })
    }
}

/// This host's name among its peers: the pod's name (or the gRPC address) and the start time.
fn host_name(cfg: &HostConfig, epoch: u64) -> String {
    let base = std::env::var("POD_NAME").unwrap_or_else(|_| cfg.grpc_listen.to_string());
    format!("{base}-{epoch}")
}

/// The addresses other hosts reach this one's gRPC server at (left out of the peer list).
fn own_addresses(cfg: &HostConfig) -> std::collections::BTreeSet<String> {
    let mut own = std::collections::BTreeSet::from([cfg.grpc_listen.to_string()]);
    if let Ok(ip) = std::env::var("POD_IP") {
        own.insert(format!("{ip}:{}", cfg.grpc_listen.port()));
    }
    own
}

/// Validate the endpoints file (or reach the cluster's credentials) before any port is bound.
async fn discovery_source(cfg: &HostConfig) -> anyhow::Result<Source> {
    if cfg.endpoints_file.is_some() && cfg.kubernetes.is_some() {
        anyhow::bail!("endpoints_file and kubernetes are exclusive: pick one discovery source");
    }
    let kube = match cfg.kubernetes.clone() {
        Some(k) => Some(kubernetes::spawn(k).await.context("starting Kubernetes discovery")?),
        None => None,
    };
    let initial = match &cfg.endpoints_file {
        Some(p) => StaticEndpoints::load(p)?,
        None => StaticEndpoints::default(),
    };
    Ok(Source { kube, initial })
}

/// The gRPC services: snapshots with the index feed, ECDS, EDS. Also returns the sender that
/// keeps ECDS's default resources alive when no policy service is configured.
fn grpc_services(
    cfg: &HostConfig,
    policy: Option<&Arc<PolicyService>>,
    rx: push::SnapshotRx,
    kv_index: &Arc<Mutex<KvIndex>>,
    kv_changed: &Arc<Notify>,
    members: &eds::Members,
    fleet: &crate::fleet::FleetFeed,
) -> (watch::Sender<Arc<Published>>, tonic::transport::server::Router) {
    // ECDS is always served, so Envoy's scorer and scheduler slots keep their defaults quietly
    // when no policy service is configured (the sender lives as long as the host).
    let (no_policy_tx, no_policy_rx) = watch::channel(Arc::new(Published::default()));
    let ecds = match policy {
        Some(p) => ecds::EcdsServer::new(p.subscribe(), p.acks.clone(), p.envoys.clone()),
        None => ecds::EcdsServer::new(no_policy_rx, Arc::new(ecds::Acks::default()), Arc::default()),
    };
    let index_feed = push::IndexFeed::spawn(
        kv_index.clone(),
        kv_changed.clone(),
        Duration::from_millis(100),
        Duration::from_millis(2),
    );
    let grpc = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(2)))
        .add_service({
            let snapshots = push::Snapshots::new(rx, cfg.heartbeat()).with_index(index_feed).with_fleet(fleet.clone());
            match policy {
                Some(p) => snapshots.with_decisions(p.decisions.clone()),
                None => snapshots,
            }
            .into_server()
        })
        .add_service(ecds.into_server())
        .add_service(eds::EdsServer::new(members).into_server());
    (no_policy_tx, grpc)
}

async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))
}

/// Scrapers and KV subscribers follow discovery: apply the first endpoint list now, then
/// follow Kubernetes or the endpoints file.
async fn start_discovery(
    cfg: &HostConfig,
    source: Source,
    client: reqwest::Client,
    state: Arc<RwLock<PoolState>>,
    kv: KvSubscribers,
    activity: crate::activity::Activity,
    members: eds::Members,
) {
    let scrapers = Scrapers::new(client, state.clone(), cfg.scrape_interval(), cfg.scrape_timeout())
        .adaptive(cfg.scrape_max_interval(), activity)
        .with_model_lists(cfg.models_interval())
        .with_metric_filter(cfg.scrape_metric_filter)
        .with_engine_gone(kv.engine_gone());
    let mut sink = Sink::new(scrapers, kv, state.clone(), cfg.kv_events_bind.is_some(), members);
    info!(endpoints = source.initial.endpoints.len(), "discovery: static file loaded");
    sink.apply(source.initial).await;
    if let Some(d) = source.kube {
        kubernetes::sync::spawn(d, sink, state, cfg.flow.objectives.clone());
    } else if let Some(path) = cfg.endpoints_file.clone() {
        discovery::static_file::spawn_watch(path, sink);
    }
}

/// The admin API, behind the bearer token when there is one, with the policy API merged in
/// (which starts the rollout controller).
fn admin_router(
    st: admin::AdminState,
    token: Option<admin_auth::BearerToken>,
    policy: Option<Arc<PolicyService>>,
) -> axum::Router {
    let mut router = admin::router(st);
    if let Some(t) = token {
        router = router.route_layer(axum::middleware::from_fn_with_state(t, admin_auth::require));
    }
    if let Some(p) = &policy {
        p.spawn_controller();
        router = router.merge(policy::api::router(p.clone()));
    }
    router
}
