//! The snapshot stream: `attache.v1.SnapshotService/Subscribe` over tonic.
//!
//! A publisher task turns pool-state changes into versioned snapshots on a `watch` channel.
//! Each subscriber gets the current full snapshot first, then every newer version (a slow
//! subscriber skips intermediate versions rather than queueing them), and a heartbeat every
//! `heartbeat` so it can detect a silent host.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use attache_proto::v1::snapshot_service_server::{SnapshotService, SnapshotServiceServer};
use attache_proto::v1::{self, update};
use futures::Stream;
use tokio::sync::{mpsc, watch, RwLock};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::{debug, info};

use crate::state::PoolState;

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

fn full(s: &v1::Snapshot) -> v1::Update {
    v1::Update { kind: Some(update::Kind::Full(s.clone())), sent_unix_ns: now_ns() }
}

/// Publish a new snapshot version whenever the pool state changes, at most once per
/// `interval`. Returns the receiver side that subscribers clone.
pub fn spawn_publisher(
    state: Arc<RwLock<PoolState>>,
    epoch: u64,
    interval: Duration,
    unready_after: Duration,
) -> watch::Receiver<Arc<v1::Snapshot>> {
    let initial = Arc::new(v1::Snapshot { version: 0, host_epoch: epoch, ..Default::default() });
    let (tx, rx) = watch::channel(initial);
    tokio::spawn(async move {
        let mut version = 0u64;
        let mut seen_generation = u64::MAX;
        let mut last_ready: Vec<bool> = Vec::new();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let st = state.read().await;
            let snap = st.snapshot(version + 1, epoch, Instant::now(), unready_after);
            let ready: Vec<bool> = snap.endpoints.iter().map(|e| e.ready).collect();
            // Readiness can change with time alone (metrics age out), so compare it too.
            if st.generation == seen_generation && ready == last_ready {
                continue;
            }
            seen_generation = st.generation;
            drop(st);
            last_ready = ready;
            version += 1;
            debug!(version, endpoints = snap.endpoints.len(), "publishing snapshot");
            if tx.send(Arc::new(snap)).is_err() {
                break;
            }
        }
    });
    rx
}

/// The tonic service.
pub struct Snapshots {
    rx: watch::Receiver<Arc<v1::Snapshot>>,
    heartbeat: Duration,
}

impl Snapshots {
    pub fn new(rx: watch::Receiver<Arc<v1::Snapshot>>, heartbeat: Duration) -> Self {
        Self { rx, heartbeat }
    }

    pub fn into_server(self) -> SnapshotServiceServer<Self> {
        SnapshotServiceServer::new(self)
    }
}

type UpdateStream = Pin<Box<dyn Stream<Item = Result<v1::Update, Status>> + Send>>;

#[tonic::async_trait]
impl SnapshotService for Snapshots {
    type SubscribeStream = UpdateStream;

    async fn subscribe(&self, req: Request<v1::SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
        let node = req.into_inner().node;
        info!(%node, "subscriber connected");
        let mut rx = self.rx.clone();
        let heartbeat = self.heartbeat;
        let (tx, out) = mpsc::channel(2);
        tokio::spawn(async move {
            let first = rx.borrow_and_update().clone();
            if tx.send(Ok(full(&first))).await.is_err() {
                return;
            }
            let mut hb = tokio::time::interval(heartbeat);
            hb.tick().await;
            loop {
                tokio::select! {
                    changed = rx.changed() => {
                        if changed.is_err() { break; }
                        let s = rx.borrow_and_update().clone();
                        if tx.send(Ok(full(&s))).await.is_err() { break; }
                    }
                    _ = hb.tick() => {
                        let version = rx.borrow().version;
                        let u = v1::Update { kind: Some(update::Kind::Heartbeat(v1::Heartbeat { version })), sent_unix_ns: now_ns() };
                        if tx.send(Ok(u)).await.is_err() { break; }
                    }
                }
            }
            info!(%node, "subscriber gone");
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }
}
