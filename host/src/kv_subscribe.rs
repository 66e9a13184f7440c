//! Following engines' KV events over ZMQ (libzmq, the library vLLM's publisher uses).
//!
//! vLLM's PUB socket binds for `tcp://*:port` and connects otherwise, so the host does both:
//! a SUB per engine that connects to engines that bind, and one collector SUB that binds and
//! that engines connect to (the topic `kv@<ip:port>@<model>` says which engine sent it).
//! A sequence gap is filled from the engine's replay ROUTER; a sequence that goes backwards is
//! an engine restart, which clears that engine's entries. Undecodable messages are counted and
//! skipped. Each subscriber runs on its own thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use attache_kv::engine::Engine;
use attache_kv::events::{self, BatchInfo, EventBatch, EventRef, KvEventError, Medium};
use attache_kv::KvIndex;

use crate::telemetry::KvCounters;

/// Where one engine's events come from.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineSource {
    pub endpoint_id: u16,
    /// The engine's `ip:port` (as in the topic).
    pub address: String,
    pub model: String,
    /// Its profile, which says how its events are encoded.
    pub engine: Engine,
    /// The engine's PUB endpoint to connect to (`None` when it connects to the collector).
    pub publisher: Option<String>,
    /// The engine's replay ROUTER, if it has one.
    pub replay: Option<String>,
}

/// Per-engine sequence tracking.
#[derive(Default)]
struct SeqState {
    last: Option<u64>,
    /// The timestamp of batch `last`: with the sequence number it tells the publisher that sent
    /// it from a restarted one that has since reached the same number.
    last_ts_bits: u64,
    /// Live messages up to this sequence were already applied from a replay.
    replayed_through: Option<u64>,
}

/// Monitor endpoints must be unique per socket in a context.
static MONITORS: AtomicU64 = AtomicU64::new(0);

/// Shared state of all subscribers.
pub struct KvSubscribers {
    pub index: Arc<Mutex<KvIndex>>,
    /// Woken after every applied batch, so index deltas go out without waiting for a tick.
    changed: Arc<tokio::sync::Notify>,
    pub counters: Arc<KvCounters>,
    ctx: zmq::Context,
    /// Engines by address, for the collector's topic lookup.
    sources: Arc<RwLock<HashMap<String, EngineSource>>>,
    seqs: Arc<Mutex<HashMap<u16, SeqState>>>,
    running: HashMap<String, Arc<AtomicBool>>,
    /// Wakes an engine's scraper when its events arrive.
    activity: crate::activity::Activity,
}

/// Forgets what a dead engine held. Its KV cache died with its process; its event sequence
/// restarts with the next process. Called by the scraper when an engine refuses connections,
/// which catches restarts whose first events were missed (a SUB socket that reconnects drops
/// what was published before it did).
#[derive(Clone)]
pub struct EngineGone {
    index: Arc<Mutex<KvIndex>>,
    seqs: Arc<Mutex<HashMap<u16, SeqState>>>,
    counters: Arc<KvCounters>,
    changed: Arc<tokio::sync::Notify>,
}

impl EngineGone {
    pub fn clear(&self, endpoint_id: u16) {
        let had_seq = self.seqs.lock().unwrap_or_else(|p| p.into_inner()).remove(&endpoint_id).is_some();
        self.index.lock().unwrap_or_else(|p| p.into_inner()).clear_endpoint(endpoint_id);
        if had_seq {
            self.counters.restarts.fetch_add(1, Ordering::Relaxed);
        }
        self.changed.notify_one();
    }
}

impl KvSubscribers {
    /// The handle the scrapers use to report a dead engine.
    pub fn engine_gone(&self) -> EngineGone {
        EngineGone {
            index: self.index.clone(),
            seqs: self.seqs.clone(),
            counters: self.counters.clone(),
            changed: self.changed.clone(),
        }
    }

    pub fn new(index: Arc<Mutex<KvIndex>>, changed: Arc<tokio::sync::Notify>) -> Self {
        Self {
            index,
            changed,
            counters: Arc::new(KvCounters::default()),
            ctx: zmq::Context::new(),
            sources: Arc::default(),
            seqs: Arc::default(),
            running: HashMap::new(),
            activity: crate::activity::Activity::default(),
        }
    }

    /// Wake each engine's scraper when its events arrive (its metrics are about to change).
    pub fn with_activity(mut self, activity: crate::activity::Activity) -> Self {
        self.activity = activity;
        self
    }

    /// Follow exactly `sources`: start subscribers for new engines, stop those of engines that
    /// left (and drop their index entries).
    pub fn apply(&mut self, sources: Vec<EngineSource>) {
        let wanted: HashMap<String, EngineSource> = sources.into_iter().map(|s| (s.address.clone(), s)).collect();
        let old = std::mem::replace(&mut *self.sources.write().unwrap_or_else(|p| p.into_inner()), wanted.clone());
        for (addr, src) in &old {
            if wanted.get(addr) != Some(src) {
                if let Some(stop) = self.running.remove(addr) {
                    stop.store(true, Ordering::Relaxed);
                }
                self.index.lock().unwrap_or_else(|p| p.into_inner()).clear_endpoint(src.endpoint_id);
                self.seqs.lock().unwrap_or_else(|p| p.into_inner()).remove(&src.endpoint_id);
            }
        }
        for (addr, src) in wanted {
            if self.running.contains_key(&addr) {
                continue;
            }
            let Some(publisher) = src.publisher.clone() else { continue };
            let stop = Arc::new(AtomicBool::new(false));
            self.running.insert(addr.clone(), stop.clone());
            let worker = self.worker();
            let spawned = std::thread::Builder::new().name(format!("kv-sub-{addr}")).spawn(move || {
                if let Err(e) = worker.follow_publisher(&publisher, &src, &stop) {
                    warn!(engine = %src.address, error = %e, "kv events: subscriber stopped");
                }
            });
            if let Err(e) = spawned {
                warn!(error = %e, "kv events: could not start a subscriber thread");
            }
        }
    }

    fn worker(&self) -> Worker {
        Worker {
            ctx: self.ctx.clone(),
            index: self.index.clone(),
            changed: self.changed.clone(),
            counters: self.counters.clone(),
            sources: self.sources.clone(),
            seqs: self.seqs.clone(),
            activity: self.activity.clone(),
        }
    }

    /// Bind a collector SUB socket that engines connect to (vLLM's `tcp://host:port` form).
    pub fn bind_collector(&self, endpoint: &str) -> anyhow::Result<()> {
        let sock = self.ctx.socket(zmq::SUB)?;
        sock.set_rcvhwm(100_000)?;
        // Every topic: a topic that names no known engine (vLLM's default `""`, the chart's
        // `kv-events`) is counted, not dropped unseen by ZMQ's prefix filter.
        sock.set_subscribe(b"")?;
        sock.bind(endpoint)?;
        let worker = self.worker();
        info!(%endpoint, "kv events: collector bound");
        std::thread::Builder::new().name("kv-collector".into()).spawn(move || loop {
            match sock.recv_multipart(0) {
                Ok(frames) => {
                    let topic = frames.first().map(|t| String::from_utf8_lossy(t).into_owned()).unwrap_or_default();
                    // kv@<ip:port>@<model>
                    let addr = topic.split('@').nth(1).unwrap_or("").to_owned();
                    let src = worker.sources.read().unwrap_or_else(|p| p.into_inner()).get(&addr).cloned();
                    match src {
                        Some(src) => worker.handle(&frames, &src),
                        None => {
                            worker.counters.unknown_topics.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                Err(e) => {
                    warn!(error = %e, "kv events: collector stopped");
                    return;
                }
            }
        })?;
        Ok(())
    }
}

#[derive(Clone)]
struct Worker {
    ctx: zmq::Context,
    index: Arc<Mutex<KvIndex>>,
    changed: Arc<tokio::sync::Notify>,
    counters: Arc<KvCounters>,
    sources: Arc<RwLock<HashMap<String, EngineSource>>>,
    seqs: Arc<Mutex<HashMap<u16, SeqState>>>,
    activity: crate::activity::Activity,
}

impl Worker {
    fn follow_publisher(&self, publisher: &str, src: &EngineSource, stop: &AtomicBool) -> anyhow::Result<()> {
        let sock = self.ctx.socket(zmq::SUB)?;
        sock.set_rcvhwm(100_000)?;
        // This socket is the engine's own publisher: every topic is its, whatever it is named
        // (vLLM's default is `""`).
        sock.set_subscribe(b"")?;
        // Every reconnection is followed by a resync from the replay socket: a SUB socket
        // silently drops what was published while it was disconnected, and a restarted engine
        // publishes its first batches before the SUB has reconnected. (The first connection
        // catches up lazily: the first message's sequence says what was missed.)
        let monitor = format!("inproc://kv-monitor-{}", MONITORS.fetch_add(1, Ordering::Relaxed));
        sock.monitor(&monitor, zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32)?;
        let events = self.ctx.socket(zmq::PAIR)?;
        events.connect(&monitor)?;
        sock.connect(publisher)?;
        info!(engine = %src.address, %publisher, "kv events: subscribed");
        let mut connections = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let mut items = [sock.as_poll_item(zmq::POLLIN), events.as_poll_item(zmq::POLLIN)];
            zmq::poll(&mut items, 200)?;
            let (data, connected) = (items[0].is_readable(), items[1].is_readable());
            if connected {
                while events.recv_multipart(zmq::DONTWAIT).is_ok() {
                    connections += 1;
                }
                if connections > 1 {
                    self.resync(src);
                }
            }
            if data {
                loop {
                    match sock.recv_multipart(zmq::DONTWAIT) {
                        Ok(frames) => self.handle(&frames, src),
                        Err(zmq::Error::EAGAIN) => break,
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
        Ok(())
    }

    /// After a (re)connection: fetch what the publisher buffered since the last batch seen and
    /// apply it. If the publisher no longer has that batch as we saw it (same sequence number,
    /// same timestamp), it is a new process: its engine's old blocks are dropped and its whole
    /// buffer is applied from sequence 0.
    fn resync(&self, src: &EngineSource) {
        if src.replay.is_none() {
            return;
        }
        let (last, ts_bits) = {
            let seqs = self.seqs.lock().unwrap_or_else(|p| p.into_inner());
            seqs.get(&src.endpoint_id).map_or((None, 0), |s| (s.last, s.last_ts_bits))
        };
        let batches = match last {
            None => self.fetch(src, 0),
            Some(l) => {
                let got = self.fetch(src, l);
                let same = got.first().is_some_and(|(seq, b)| *seq == l && b.ts.to_bits() == ts_bits);
                let rolled = got.first().is_some_and(|(seq, _)| *seq > l);
                if same {
                    got.into_iter().skip(1).collect()
                } else if rolled {
                    // Disconnected longer than the publisher's buffer: apply what is left.
                    self.counters.gaps.fetch_add(1, Ordering::Relaxed);
                    got
                } else {
                    info!(engine = %src.address, last = l, "kv events: publisher restarted while disconnected");
                    self.counters.restarts.fetch_add(1, Ordering::Relaxed);
                    self.index.lock().unwrap_or_else(|p| p.into_inner()).clear_endpoint(src.endpoint_id);
                    self.fetch(src, 0)
                }
            }
        };
        let n = batches.len();
        for (_, b) in &batches {
            self.apply_owned(src, b);
        }
        if let Some((seq, b)) = batches.last() {
            let mut seqs = self.seqs.lock().unwrap_or_else(|p| p.into_inner());
            let st = seqs.entry(src.endpoint_id).or_default();
            st.last = Some(*seq);
            st.last_ts_bits = b.ts.to_bits();
            st.replayed_through = Some(*seq);
        }
        self.counters.replayed_batches.fetch_add(n as u64, Ordering::Relaxed);
        debug!(engine = %src.address, n, "kv events: resynced after connecting");
    }

    /// Handle one published message from `src`.
    fn handle(&self, frames: &[Vec<u8>], src: &EngineSource) {
        self.counters.messages.fetch_add(1, Ordering::Relaxed);
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        let msg = match events::split_frames(&refs) {
            Ok(m) => m,
            Err(e) => {
                self.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
                debug!(engine = %src.address, error = %e, "kv events: malformed message skipped");
                return;
            }
        };
        let seq = msg.seq;
        let (last, replayed_through) = {
            let mut seqs = self.seqs.lock().unwrap_or_else(|p| p.into_inner());
            let st = seqs.entry(src.endpoint_id).or_default();
            (st.last, st.replayed_through.take())
        };
        if let Some(r) = replayed_through {
            if seq <= r {
                // Published while the resync ran: already applied from the replay.
                self.seqs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(src.endpoint_id)
                    .or_default()
                    .replayed_through = Some(r);
                return;
            }
        }
        match last {
            // A SUB socket never sees a message twice, so a sequence that does not advance means
            // a new publisher: the engine restarted (even one that had sent a single batch, 0).
            Some(l) if seq <= l => {
                info!(engine = %src.address, seq, last = l, "kv events: sequence went back; engine restarted");
                self.counters.restarts.fetch_add(1, Ordering::Relaxed);
                self.index.lock().unwrap_or_else(|p| p.into_inner()).clear_endpoint(src.endpoint_id);
            }
            Some(l) if seq > l + 1 => {
                self.counters.gaps.fetch_add(1, Ordering::Relaxed);
                self.replay(src, l + 1, seq);
            }
            None if seq > 0 => self.replay(src, 0, seq), // catch up on what the engine already holds
            _ => {}
        }
        // The sequence advances even if the payload is garbage: replaying it would not help.
        self.seqs.lock().unwrap_or_else(|p| p.into_inner()).entry(src.endpoint_id).or_default().last = Some(seq);
        match self.apply(src, |visit| src.engine.event_format().visit(msg.payload, visit)) {
            Ok(info) => {
                self.seqs.lock().unwrap_or_else(|p| p.into_inner()).entry(src.endpoint_id).or_default().last_ts_bits =
                    info.ts.to_bits();
            }
            Err(e) => {
                // The events before the malformed one were complete and are applied.
                self.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
                debug!(engine = %src.address, seq, error = %e, "kv events: malformed payload; the rest of it skipped");
            }
        }
    }

    /// Apply one batch's events under one hold of the index lock, as `read` hands them over
    /// (read in place from a payload, or from a replayed batch).
    fn apply<'a>(
        &self,
        src: &EngineSource,
        read: impl FnOnce(&mut dyn FnMut(EventRef<'a>)) -> Result<BatchInfo, KvEventError>,
    ) -> Result<BatchInfo, KvEventError> {
        let (mut n, mut other) = (0u64, 0u64);
        let mut ix = self.index.lock().unwrap_or_else(|p| p.into_inner());
        let res = read(&mut |e| {
            n += 1;
            other += u64::from(e.medium() == Some(Medium::Other));
            ix.apply_ref(src.endpoint_id, &src.model, e);
        });
        if let Ok(info) = &res {
            if info.ts.is_finite() && info.ts > 0.0 {
                ix.note_event_time((info.ts * 1e6) as u64);
            }
            self.counters.skipped_events.fetch_add(info.skipped as u64, Ordering::Relaxed);
        }
        drop(ix);
        self.counters.events.fetch_add(n, Ordering::Relaxed);
        crate::telemetry::metrics().kv_ingested(&src.address, n);
        self.counters.unknown_media.fetch_add(other, Ordering::Relaxed);
        self.changed.notify_one();
        self.activity.wake(&src.address);
        res
    }

    fn apply_owned(&self, src: &EngineSource, b: &EventBatch) {
        let _ = self.apply(src, |visit| {
            b.events.iter().for_each(|e| visit(e.as_ref()));
            Ok(BatchInfo {
                ts: b.ts,
                data_parallel_rank: b.data_parallel_rank,
                events: b.events.len(),
                skipped: b.skipped,
            })
        });
    }

    /// Fetch batches `from..until` from the engine's replay socket and apply them in order.
    fn replay(&self, src: &EngineSource, from: u64, until: u64) {
        let batches = self.fetch(src, from);
        let mut n = 0;
        for (_, b) in batches.iter().filter(|(seq, _)| *seq < until) {
            self.apply_owned(src, b);
            n += 1;
        }
        self.counters.replayed_batches.fetch_add(n, Ordering::Relaxed);
        debug!(engine = %src.address, from, until, n, "kv events: replayed");
    }

    /// Every batch the engine's replay socket holds from sequence `from`, in order.
    fn fetch(&self, src: &EngineSource, from: u64) -> Vec<(u64, EventBatch)> {
        let Some(ep) = &src.replay else { return Vec::new() };
        let run = || -> anyhow::Result<Vec<(u64, EventBatch)>> {
            let d = self.ctx.socket(zmq::DEALER)?;
            d.set_linger(0)?;
            d.set_rcvtimeo(1000)?;
            d.connect(ep)?;
            d.send_multipart([&b""[..], &from.to_be_bytes()], 0)?;
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut out = Vec::new();
            while Instant::now() < deadline {
                let f = d.recv_multipart(0)?;
                // ["", topic, seq, payload] (vLLM >= 0.26) or ["", seq, payload] (older); end: seq = -1.
                let frames: Vec<&[u8]> = f.iter().map(Vec::as_slice).skip(1).collect();
                let (seq, payload) = match frames.as_slice() {
                    [_, s, p] | [s, p] => (*s, *p),
                    _ => continue,
                };
                if seq == kv_events_end() {
                    break;
                }
                let Ok(seq) = <[u8; 8]>::try_from(seq).map(u64::from_be_bytes) else { continue };
                if seq < from {
                    continue;
                }
                match src.engine.event_format().decode(payload) {
                    Ok(b) => out.push((seq, b)),
                    Err(_) => {
                        self.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Ok(out)
        };
        run().unwrap_or_else(|e| {
            warn!(engine = %src.address, error = %e, "kv events: replay failed; continuing");
            Vec::new()
        })
    }
}

fn kv_events_end() -> &'static [u8] {
    &[0xff; 8]
}
