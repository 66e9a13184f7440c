//! The snapshot stream: `attache.v1.SnapshotService/Subscribe` and `Exchange` over tonic.
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
use tracing::{debug, info, warn};

use crate::fleet::FleetFeed;
use crate::policy::decisions::DecisionLog;
use crate::state::PoolState;
use attache_kv::index::{Delta, KvIndex};

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

fn full(s: &v1::Snapshot) -> v1::Update {
    let u = v1::Update { kind: Some(update::Kind::Full(s.clone())), sent_unix_ns: now_ns() };
    crate::telemetry::metrics().snapshot_sent("full", prost::Message::encoded_len(&u));
    u
}

fn delta(d: &v1::SnapshotDelta) -> v1::Update {
    let u = v1::Update { kind: Some(update::Kind::Delta(d.clone())), sent_unix_ns: now_ns() };
    crate::telemetry::metrics().snapshot_sent("delta", prost::Message::encoded_len(&u));
    u
}

/// One published snapshot version: the whole snapshot, and what changed from the version
/// before it (`None` for the first).
#[derive(Debug, Default)]
pub struct PublishedSnapshot {
    pub snapshot: v1::Snapshot,
    pub delta: Option<v1::SnapshotDelta>,
}

impl std::ops::Deref for PublishedSnapshot {
    type Target = v1::Snapshot;
    fn deref(&self) -> &v1::Snapshot {
        &self.snapshot
    }
}

impl From<v1::Snapshot> for PublishedSnapshot {
    fn from(snapshot: v1::Snapshot) -> Self {
        Self { snapshot, delta: None }
    }
}

/// The newest published snapshot, for subscribers, the endpoint picker and the admin API.
pub type SnapshotRx = watch::Receiver<Arc<PublishedSnapshot>>;

/// The update that brings a subscriber from `sent` (what it last got) to `now`: the published
/// delta when it follows on, else the whole snapshot (a subscriber that fell behind more than
/// one version, or a new host epoch).
fn next_update(sent: Option<(u64, u64)>, now: &PublishedSnapshot) -> v1::Update {
    match (&now.delta, sent) {
        (Some(d), Some((epoch, version))) if d.host_epoch == epoch && d.base_version == version => delta(d),
        _ => full(&now.snapshot),
    }
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
) -> SnapshotRx {
    let initial = v1::Snapshot { version: 0, host_epoch: epoch, ..Default::default() };
    let mut prev = Arc::new(PublishedSnapshot { snapshot: initial, delta: None });
    let (tx, rx) = watch::channel(prev.clone());
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
            let d = attache_proto::delta::diff(&prev.snapshot, &snap);
            debug!(
                version,
                endpoints = snap.endpoints.len(),
                changed = d.as_ref().map(|d| d.upserts.len() + d.removed.len()),
                "publishing snapshot"
            );
            crate::telemetry::metrics().snapshot_published(version);
            // The next diff's base is the published value itself: no copy of the pool.
            prev = Arc::new(PublishedSnapshot { snapshot: snap, delta: d });
            if tx.send(prev.clone()).is_err() {
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
            let mut last_push: Option<tokio::time::Instant> = None;
            loop {
                let _ = tokio::time::timeout(interval, changed.notified()).await;
                // Gather a burst's changes only inside a burst: after a quiet spell the first
                // change goes at once, and the pause bounds the rate under load.
                if last_push.is_some_and(|t| t.elapsed() < coalesce * 5) {
                    tokio::time::sleep(coalesce).await;
                }
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
                last_push = Some(tokio::time::Instant::now());
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
    rx: SnapshotRx,
    heartbeat: Duration,
    index: Option<IndexFeed>,
    fleet: Option<FleetFeed>,
    decisions: Option<Arc<DecisionLog>>,
}

impl Snapshots {
    pub fn new(rx: SnapshotRx, heartbeat: Duration) -> Self {
        Self { rx, heartbeat, index: None, fleet: None, decisions: None }
    }

    /// Keep the decisions pickers share (`Report.decisions`) in the policy service's log.
    pub fn with_decisions(mut self, log: Arc<DecisionLog>) -> Self {
        self.decisions = Some(log);
        self
    }

    /// Also stream the precise index.
    pub fn with_index(mut self, feed: IndexFeed) -> Self {
        self.index = Some(feed);
        self
    }

    /// Also merge and redistribute fleet state on `Exchange` streams.
    pub fn with_fleet(mut self, feed: FleetFeed) -> Self {
        self.fleet = Some(feed);
        self
    }

    pub fn into_server(self) -> SnapshotServiceServer<Self> {
        SnapshotServiceServer::new(self)
    }

    /// Start the task that feeds one subscriber, and return its stream.
    fn start(&self, node: String, fleet: Option<(FleetFeed, String)>) -> UpdateStream {
        let (tx, out) = mpsc::channel(16);
        let feeds = Feeds { rx: self.rx.clone(), heartbeat: self.heartbeat, index: self.index.clone(), fleet };
        tokio::spawn(feeds.run(node, tx));
        Box::pin(ReceiverStream::new(out))
    }
}

type UpdateStream = Pin<Box<dyn Stream<Item = Result<v1::Update, Status>> + Send>>;
type Tx = mpsc::Sender<Result<v1::Update, Status>>;

fn index_msg(d: v1::IndexDelta) -> v1::Update {
    v1::Update { kind: Some(update::Kind::Index(d)), sent_unix_ns: now_ns() }
}

fn fleet_msg(f: &FleetFeed, d: v1::FleetDelta) -> v1::Update {
    f.counters.sent(prost::Message::encoded_len(&d));
    v1::Update { kind: Some(update::Kind::Fleet(d)), sent_unix_ns: now_ns() }
}

/// Send every message, or say the subscriber is gone.
async fn send_all(tx: &Tx, msgs: impl IntoIterator<Item = v1::Update>) -> bool {
    for m in msgs {
        if tx.send(Ok(m)).await.is_err() {
            return false;
        }
    }
    true
}

/// What one subscriber is fed: snapshots, index deltas, fleet deltas (on `Exchange`), heartbeats.
struct Feeds {
    rx: SnapshotRx,
    heartbeat: Duration,
    index: Option<IndexFeed>,
    /// The fleet and the subscriber's Envoy.
    fleet: Option<(FleetFeed, String)>,
}

/// Wait on an optional broadcast receiver (forever when there is none).
async fn recv_opt<T: Clone>(r: &mut Option<broadcast::Receiver<T>>) -> Result<T, broadcast::error::RecvError> {
    match r.as_mut() {
        Some(r) => r.recv().await,
        None => std::future::pending().await,
    }
}

impl Feeds {
    fn index_dump(&self) -> (Vec<v1::Update>, u64) {
        match &self.index {
            Some(f) => {
                let (msgs, seq) = f.dump();
                (msgs.into_iter().map(index_msg).collect(), seq)
            }
            None => (Vec::new(), 0),
        }
    }

    fn fleet_dump(&self) -> (Vec<v1::Update>, u64) {
        match &self.fleet {
            Some((f, envoy)) => {
                let (msgs, seq) = f.lock().dump(envoy, crate::fleet::now_ms());
                (msgs.into_iter().map(|m| fleet_msg(f, m)).collect(), seq)
            }
            None => (Vec::new(), 0),
        }
    }

    async fn run(mut self, node: String, tx: Tx) {
        let _subscribed = Subscribed::new();
        // Subscribe to live deltas before taking the full resends, so nothing falls between the
        // two; deltas the resends already cover are skipped by seq.
        let mut idx_rx = self.index.as_ref().map(|f| f.tx.subscribe());
        let mut fleet_rx = self.fleet.as_ref().map(|(f, _)| f.tx.subscribe());
        let first = self.rx.borrow_and_update().clone();
        if tx.send(Ok(full(&first.snapshot))).await.is_err() {
            return;
        }
        let mut sent = Some((first.host_epoch, first.version));
        let (msgs, mut idx_seq) = self.index_dump();
        if !send_all(&tx, msgs).await {
            return;
        }
        let (msgs, mut fleet_seq) = self.fleet_dump();
        if !send_all(&tx, msgs).await {
            return;
        }
        let mut hb = tokio::time::interval(self.heartbeat);
        hb.tick().await;
        loop {
            let ok = tokio::select! {
                changed = self.rx.changed() => {
                    if changed.is_err() { break; }
                    let s = self.rx.borrow_and_update().clone();
                    let u = next_update(sent, &s);
                    sent = Some((s.host_epoch, s.version));
                    tx.send(Ok(u)).await.is_ok()
                }
                d = recv_opt(&mut idx_rx) => match d {
                    Ok(d) if d.seq > idx_seq => {
                        idx_seq = d.seq;
                        tx.send(Ok(index_msg((*d).clone()))).await.is_ok()
                    }
                    Ok(_) => true,
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        // Too slow for the live deltas: start over with a full resend.
                        info!(%node, lagged = n, "index subscriber lagged; resending the index");
                        let (msgs, seq) = self.index_dump();
                        idx_seq = seq;
                        send_all(&tx, msgs).await
                    }
                    Err(broadcast::error::RecvError::Closed) => false,
                },
                b = recv_opt(&mut fleet_rx) => match (b, &self.fleet) {
                    (Ok(b), Some((f, envoy))) if b.seq > fleet_seq => {
                        fleet_seq = b.seq;
                        let (max, half_life) = { let g = f.lock(); (g.config().max_delta_entries, g.config().usage_half_life_ms) };
                        send_all(&tx, b.for_envoy(envoy, max, half_life).into_iter().map(|m| fleet_msg(f, m))).await
                    }
                    (Ok(_), _) => true,
                    (Err(broadcast::error::RecvError::Lagged(n)), _) => {
                        info!(%node, lagged = n, "fleet subscriber lagged; resending the fleet state");
                        let (msgs, seq) = self.fleet_dump();
                        fleet_seq = seq;
                        send_all(&tx, msgs).await
                    }
                    (Err(broadcast::error::RecvError::Closed), _) => false,
                },
                _ = hb.tick() => {
                    let version = self.rx.borrow().version;
                    let u = v1::Update { kind: Some(update::Kind::Heartbeat(v1::Heartbeat { version })), sent_unix_ns: now_ns() };
                    tx.send(Ok(u)).await.is_ok()
                }
            };
            if !ok {
                break;
            }
        }
        info!(%node, "subscriber gone");
    }
}

/// Most keys one lookup may ask for, and the longest it may wait.
const MAX_LOOKUP_KEYS: usize = 64;
const MAX_LOOKUP_WAIT_MS: u64 = 2_000;

/// How long the host waits for an `Exchange` stream's first report (which names it).
const FIRST_REPORT: Duration = Duration::from_secs(10);

#[tonic::async_trait]
impl SnapshotService for Snapshots {
    type SubscribeStream = UpdateStream;
    type ExchangeStream = UpdateStream;

    async fn subscribe(&self, req: Request<v1::SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
        let node = req.into_inner().node;
        info!(%node, "subscriber connected");
        Ok(Response::new(self.start(node, None)))
    }

    async fn lookup(&self, req: Request<v1::LookupRequest>) -> Result<Response<v1::LookupResponse>, Status> {
        let req = req.into_inner();
        if req.keys.len() > MAX_LOOKUP_KEYS {
            return Err(Status::invalid_argument(format!("at most {MAX_LOOKUP_KEYS} keys per lookup")));
        }
        let Some(f) = &self.fleet else {
            return Ok(Response::new(v1::LookupResponse::default()));
        };
        let wait = Duration::from_millis(u64::from(req.wait_ms).min(MAX_LOOKUP_WAIT_MS));
        let bindings = f.lookup(&req.keys, wait).await;
        Ok(Response::new(v1::LookupResponse { bindings }))
    }

    async fn share(&self, req: Request<v1::Report>) -> Result<Response<v1::ShareResponse>, Status> {
        let r = req.into_inner();
        if r.envoy.is_empty() {
            return Err(Status::invalid_argument("a shared report must name its envoy"));
        }
        if !r.decisions.is_empty() {
            let kept = match &self.decisions {
                Some(log) => log.append(&r.decisions).unwrap_or_else(|e| {
                    warn!(envoy = %r.envoy, error = %e, "writing the decision log");
                    0
                }),
                None => 0,
            };
            let m = crate::telemetry::metrics();
            m.policy_decisions("logged", kept);
            m.policy_decisions("refused", r.decisions.len() - kept);
        }
        if let Some(f) = &self.fleet {
            f.report(&r.envoy, &r);
        }
        Ok(Response::new(v1::ShareResponse {}))
    }

    async fn exchange(
        &self,
        req: Request<tonic::Streaming<v1::Report>>,
    ) -> Result<Response<Self::ExchangeStream>, Status> {
        let mut reports = req.into_inner();
        let first = match tokio::time::timeout(FIRST_REPORT, reports.message()).await {
            Ok(Ok(Some(r))) => r,
            Ok(Ok(None)) => return Err(Status::invalid_argument("the stream ended before its first report")),
            Ok(Err(s)) => return Err(s),
            Err(_) => return Err(Status::deadline_exceeded("no first report within 10 s")),
        };
        if first.node.is_empty() || first.envoy.is_empty() {
            return Err(Status::invalid_argument("the first report must name its node and envoy"));
        }
        let (node, envoy) = (first.node.clone(), first.envoy.clone());
        info!(%node, %envoy, resync = first.resync, "fleet member connected");
        let fleet = self.fleet.clone();
        if let Some(f) = &fleet {
            f.report(&envoy, &first);
            // Later reports are merged as they come, until the member closes its side.
            let (f, envoy, node) = (f.clone(), envoy.clone(), node.clone());
            tokio::spawn(async move {
                loop {
                    match reports.message().await {
                        Ok(Some(r)) => f.report(&envoy, &r),
                        Ok(None) => break,
                        Err(e) => {
                            debug!(%node, error = %e, "fleet report stream ended");
                            break;
                        }
                    }
                }
            });
        }
        Ok(Response::new(self.start(node, fleet.map(|f| (f, envoy)))))
    }
}
