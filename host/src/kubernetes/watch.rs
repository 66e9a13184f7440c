//! The watch loop: one `kube` watcher per kind feeding a reflector store, restarted with a
//! fresh list every `resync_s`, backed off on errors; every change recomputes the endpoint list
//! and the objective table and publishes them when they differ.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::{self, store::Writer, Store};
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::{watch as tokio_watch, Notify};
use tracing::{debug, info, warn, Instrument};

use super::crds::{objective_of, InferencePool};
use super::endpoints::{endpoints, objective_table};
use super::KubernetesConfig;
use crate::endpoints::StaticEndpoint;

/// What discovery publishes. Receivers see the newest value; the first arrives once pools and
/// pods are both listed.
#[derive(Clone)]
pub struct Discovered {
    pub endpoints: tokio_watch::Receiver<Vec<StaticEndpoint>>,
    pub objectives: tokio_watch::Receiver<BTreeMap<String, i32>>,
    pub stats: Arc<WatchStats>,
}

/// Counters for the admin API and tests.
#[derive(Debug, Default)]
pub struct WatchStats {
    /// Watch events applied, all kinds.
    pub events: AtomicU64,
    /// Watch or list errors (each followed by a backed-off retry).
    pub errors: AtomicU64,
    /// Times a full list was (re)started: at start, after a 410 Gone, and at each resync.
    pub relists: AtomicU64,
    /// Endpoint lists published.
    pub publishes: AtomicU64,
}

async fn client(cfg: &KubernetesConfig) -> anyhow::Result<Client> {
    super::client(cfg.kubeconfig.as_deref()).await
}

/// A client from `kubeconfig`, else the pod's service account, `$KUBECONFIG` or
/// `~/.kube/config`.
pub async fn client_from(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context("no in-cluster service account and no usable kubeconfig")?,
    };
    Client::try_from(config).context("building the Kubernetes client")
}

fn typed<K>(client: &Client, ns: Option<&str>) -> Api<K>
where
    K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>,
{
    match ns {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Follow one kind forever: watch into `writer`, notify on every change, restart the watch
/// (with a fresh list) every `resync`.
async fn follow<K>(
    api: Api<K>,
    mut writer: Writer<K>,
    changed: Arc<Notify>,
    resync: Option<Duration>,
    stats: Arc<WatchStats>,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    loop {
        let mut stream = pin!(watcher(api.clone(), watcher::Config::default()).default_backoff());
        let deadline = async {
            match resync {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        let mut deadline = pin!(deadline);
        loop {
            tokio::select! {
                ev = stream.next() => match ev {
                    Some(Ok(ev)) => {
                        stats.events.fetch_add(1, Ordering::Relaxed);
                        if matches!(ev, Event::Init) {
                            stats.relists.fetch_add(1, Ordering::Relaxed);
                            debug!("listing");
                        }
                        writer.apply_watcher_event(&ev);
                        // The store swaps in a new list only at InitDone.
                        if matches!(ev, Event::Apply(_) | Event::Delete(_) | Event::InitDone) {
                            changed.notify_one();
                        }
                    }
                    Some(Err(e)) => {
                        stats.errors.fetch_add(1, Ordering::Relaxed);
                        warn!(error = %e, "watch failed; retrying with backoff (for InferenceObjective: is the CRD installed?)");
                    }
                    None => break,
                },
                _ = &mut deadline => {
                    debug!("resync: restarting the watch with a fresh list");
                    break;
                }
            }
        }
    }
}

/// Start discovery. Fails only on configuration errors (no cluster credentials, a bad
/// `objectives_api`); an unreachable API server is retried with backoff.
pub async fn spawn(cfg: KubernetesConfig) -> anyhow::Result<Discovered> {
    let client = client(&cfg).await?;
    let ns = cfg.namespace.as_deref();
    let resync = (cfg.resync_s > 0).then(|| Duration::from_secs(cfg.resync_s));
    let stats = Arc::new(WatchStats::default());
    let changed = Arc::new(Notify::new());

    let (pools, pools_w) = reflector::store::<InferencePool>();
    let (pods, pods_w) = reflector::store::<Pod>();
    tokio::spawn(
        follow(typed::<InferencePool>(&client, ns), pools_w, changed.clone(), resync, stats.clone())
            .instrument(tracing::info_span!("watch", kind = "InferencePool")),
    );
    tokio::spawn(
        follow(typed::<Pod>(&client, ns), pods_w, changed.clone(), resync, stats.clone())
            .instrument(tracing::info_span!("watch", kind = "Pod")),
    );
    let objectives = watch_objectives(&cfg, &client, &changed, resync, &stats)?;

    let (ep_tx, ep_rx) = tokio_watch::channel(Vec::new());
    let (obj_tx, obj_rx) = tokio_watch::channel(BTreeMap::new());
    let stores = Stores { pools, pods, objectives };
    tokio::spawn(
        publish(stores, cfg.pools.clone(), ep_tx, obj_tx, changed, stats.clone())
            .instrument(tracing::info_span!("discovery")),
    );
    Ok(Discovered { endpoints: ep_rx, objectives: obj_rx, stats })
}

/// Watch `InferenceObjective`s of `cfg.objectives_api` (none when it is empty).
fn watch_objectives(
    cfg: &KubernetesConfig,
    client: &Client,
    changed: &Arc<Notify>,
    resync: Option<Duration>,
    stats: &Arc<WatchStats>,
) -> anyhow::Result<Option<Store<DynamicObject>>> {
    if cfg.objectives_api.trim().is_empty() {
        return Ok(None);
    }
    let (group, version) = cfg
        .objectives_api
        .trim()
        .split_once('/')
        .with_context(|| format!("objectives_api {:?}: expected group/version", cfg.objectives_api))?;
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(group, version, "InferenceObjective"),
        "inferenceobjectives",
    );
    let writer = Writer::new(ar.clone());
    let reader = writer.as_reader();
    let api = match cfg.namespace.as_deref() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    tokio::spawn(
        follow(api, writer, changed.clone(), resync, stats.clone())
            .instrument(tracing::info_span!("watch", kind = "InferenceObjective")),
    );
    Ok(Some(reader))
}

/// The reflector stores discovery reads.
struct Stores {
    pools: Store<InferencePool>,
    pods: Store<Pod>,
    objectives: Option<Store<DynamicObject>>,
}

/// After every change (a burst coalesced), recompute the endpoint list and the objective table
/// and publish what differs. Publishes nothing until both pools and pods have been listed
/// once: an empty list before then would not be the cluster's state.
async fn publish(
    stores: Stores,
    names: Vec<String>,
    ep_tx: tokio_watch::Sender<Vec<StaticEndpoint>>,
    obj_tx: tokio_watch::Sender<BTreeMap<String, i32>>,
    changed: Arc<Notify>,
    stats: Arc<WatchStats>,
) {
    let Stores { pools, pods, objectives } = stores;
    let (a, b) = tokio::join!(pools.wait_until_ready(), pods.wait_until_ready());
    if a.is_err() || b.is_err() {
        return;
    }
    info!("discovery: InferencePools and Pods listed");
    let mut first = true;
    loop {
        let pool_list = pools.state();
        let pod_list = pods.state();
        let eps = endpoints(pool_list.iter().map(|p| p.as_ref()), pod_list.iter().map(|p| p.as_ref()), &names);
        if first || *ep_tx.borrow() != eps {
            info!(endpoints = eps.len(), pools = pool_list.len(), "discovery: endpoints changed");
            stats.publishes.fetch_add(1, Ordering::Relaxed);
            if ep_tx.send(eps).is_err() {
                return;
            }
            first = false;
        }
        if let Some(store) = &objectives {
            let objs = store
                .state()
                .iter()
                .filter_map(|o| match objective_of(o) {
                    Ok(v) => Some(v),
                    Err(e) => {
                        warn!(error = %e, "skipping an unreadable InferenceObjective");
                        None
                    }
                })
                .collect::<Vec<_>>();
            let table = objective_table(objs, pool_list.iter().map(|p| p.as_ref()), &names);
            if *obj_tx.borrow() != table {
                info!(objectives = table.len(), "discovery: priority table changed");
                let _ = obj_tx.send(table);
            }
        }
        changed.notified().await;
        // Coalesce a burst of events (a rollout touches many pods at once).
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
