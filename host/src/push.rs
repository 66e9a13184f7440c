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
use tokio::sync::{broadcast, mpsc, watch, RwLock};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::{debug, info};

use crate::state::PoolState;
use attache_kv::index::{Delta, KvIndex};

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

fn full(s: &v1::Snapshot) -> v1::Update {
    crate::telemetry::metrics().snapshot_sent(prost::Message::encoded_len(s));
    v1::Update { kind: Some(update::Kind::Full(s.clone())), sent_unix_ns: now_ns() }
}

/// Counts an open snapshot stream for as long as it lives.
struct Subscribed;

impl Subscribed {
    fn new() -> Self {
        crate::telemetry::metrics().subscribers_add(1);
        Self
    }
}

impl Drop for Subscribed {
    fn drop(&mut self) {
        crate::telemetry::metrics().subscribers_add(-1);
    }
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
            let mut ready: Vec<bool> = snap.endpoints.iter().map(|e| e.ready).collect();
            ready.push(snap.saturation.is_some_and(|s| s >= 1.0));
            // Readiness and saturation can change with time alone (metrics age out), so
            // compare them too.
            if st.generation == seen_generation && ready == last_ready {
                continue;
            }
            seen_generation = st.generation;
            drop(st);
            last_ready = ready;
            version += 1;
            debug!(version, endpoints = snap.endpoints.len(), "publishing snapshot");
            crate::telemetry::metrics().snapshot_published(version);
            if tx.send(Arc::new(snap)).is_err() {
                break;
            }
        }
    });
    rx
}

/// Index entries per message of a full resend (about 13 bytes each on the wire).
const DUMP_CHUNK: usize = 65_536;

/// The precise index as a stream: live deltas on a broadcast channel, and full resends.
#[derive(Clone)]
pub struct IndexFeed {
    index: Arc<std::sync::Mutex<KvIndex>>,
    tx: broadcast::Sender<Arc<v1::IndexDelta>>,
}

fn to_message(deltas: &[Delta], seq: u64, reset: bool, oldest_event_unix_us: u64) -> v1::IndexDelta {
    v1::IndexDelta {
        reset,
        keys: deltas.iter().map(|d| d.key).collect(),
        endpoints: deltas.iter().map(|d| u32::from(d.endpoint)).collect(),
        tiers: deltas.iter().map(|d| u32::from(d.tiers)).collect(),
        seq,
        oldest_event_unix_us,
    }
}

impl IndexFeed {
    /// Take the index's changes every `interval` and broadcast them.
    /// Sends as soon as `changed` is notified (after a `coalesce` pause that batches a burst),
    /// and at least every `interval`.
    pub fn spawn(
        index: Arc<std::sync::Mutex<KvIndex>>,
        changed: Arc<tokio::sync::Notify>,
        interval: Duration,
        coalesce: Duration,
    ) -> Self {
        let (tx, _) = broadcast::channel(1024);
        let feed = Self { index, tx };
        let f = feed.clone();
        tokio::spawn(async move {
            loop {
                let _ = tokio::time::timeout(interval, changed.notified()).await;
                tokio::time::sleep(coalesce).await;
                let msg = {
                    let mut ix = f.index.lock().unwrap_or_else(|p| p.into_inner());
                    if !ix.has_deltas() {
                        continue;
                    }
                    let d = ix.take_deltas();
                    let ts = ix.take_event_time();
                    to_message(&d, ix.delta_seq(), false, ts)
                };
                // No subscriber is fine: each new one starts from a full resend.
                let _ = f.tx.send(Arc::new(msg));
            }
        });
        feed
    }

    /// A full resend, in chunks, and the sequence it brings a subscriber to.
    fn dump(&self) -> (Vec<v1::IndexDelta>, u64) {
        let (all, seq) = self.index.lock().unwrap_or_else(|p| p.into_inner()).dump();
        let mut msgs: Vec<v1::IndexDelta> =
            all.chunks(DUMP_CHUNK).enumerate().map(|(i, c)| to_message(c, seq, i == 0, 0)).collect();
        if msgs.is_empty() {
            msgs.push(to_message(&[], seq, true, 0));
        }
        (msgs, seq)
    }
}

/// The tonic service.
pub struct Snapshots {
    rx: watch::Receiver<Arc<v1::Snapshot>>,
    heartbeat: Duration,
    index: Option<IndexFeed>,
}

impl Snapshots {
    pub fn new(rx: watch::Receiver<Arc<v1::Snapshot>>, heartbeat: Duration) -> Self {
        Self { rx, heartbeat, index: None }
    }

    /// Also stream the precise index.
    pub fn with_index(mut self, feed: IndexFeed) -> Self {
        self.index = Some(feed);
        self
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
        let feed = self.index.clone();
        let (tx, out) = mpsc::channel(4);
        tokio::spawn(async move {
            let _subscribed = Subscribed::new();
            let index_msg =
                |d: v1::IndexDelta| v1::Update { kind: Some(update::Kind::Index(d)), sent_unix_ns: now_ns() };
            // Subscribe to live index deltas before taking the full resend, so nothing falls
            // between the two; deltas already covered by the resend are skipped by seq.
            let mut idx_rx = feed.as_ref().map(|f| f.tx.subscribe());
            let first = rx.borrow_and_update().clone();
            if tx.send(Ok(full(&first))).await.is_err() {
                return;
            }
            let mut idx_seq = 0;
            if let Some(f) = &feed {
                let (msgs, seq) = f.dump();
                idx_seq = seq;
                for m in msgs {
                    if tx.send(Ok(index_msg(m))).await.is_err() {
                        return;
                    }
                }
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
                    d = async { match idx_rx.as_mut() { Some(r) => r.recv().await, None => std::future::pending().await } } => {
                        match d {
                            Ok(d) if d.seq > idx_seq => {
                                idx_seq = d.seq;
                                if tx.send(Ok(index_msg((*d).clone()))).await.is_err() { break; }
                            }
                            Ok(_) => {}
                            Err(broadcast::error::RecvError::Lagged(n)) => {
                                // Too slow for the live deltas: start over with a full resend.
                                info!(%node, lagged = n, "index subscriber lagged; resending the index");
                                let Some(f) = &feed else { break };
                                let (msgs, seq) = f.dump();
                                idx_seq = seq;
                                let mut ok = true;
                                for m in msgs {
                                    if tx.send(Ok(index_msg(m))).await.is_err() { ok = false; break; }
                                }
                                if !ok { break; }
                            }
                            Err(broadcast::error::RecvError::Closed) => break,
                        }
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
