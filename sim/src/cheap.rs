//! Cheap mode (`--cheap`): thousands of engines (up to 65,536) from one process.
//!
//! Why: benchmarks of pools with thousands of endpoints measure the host's side — the cost of
//! scraping every engine's `/metrics`, the snapshot deltas it publishes when some engines'
//! load changes and others' does not, and the filter's decision time over a large pool. The
//! normal mode runs a full simulated engine per endpoint (its own run task, TCP port, KV block
//! table and KV-event publisher thread), which does not scale to 10,000 engines. Here every
//! engine is a few atomics (about 50 bytes) and the whole pool shares one listener, one churn
//! task and one KV-event publisher thread.
//!
//! What it serves, per engine:
//! * Addressing: engine `i` is [`cheap_address`] — `127.1.{i / 256}.{i % 256}`, all on one port.
//!   One listener on `0.0.0.0:port` tells the engines apart by the local (dialed) address of
//!   each connection (Linux routes all of 127.0.0.0/8 to `lo`).
//! * `/metrics`: the normal mode's vLLM exposition ([`crate::metrics::render`]); below
//!   `/metrics/`, only the samples `name[]` asks for, as vLLM answers there. A fraction of
//!   the engines is *busy* ([`CheapPool::is_busy`]): one background task walks their waiting,
//!   running and KV-usage gauges every churn period; the idle engines' gauges never change.
//! * `/v1/models`, `/health`, and `/v1/completions` and `/v1/chat/completions` (streamed or
//!   not), answered at once with a few tokens, with the normal mode's response shapes and
//!   `x-inference-*` headers; the token and request counters count them.
//! * KV events ([`spawn_kv_publisher`]): one ZMQ PUB socket connected to a collector sends, for
//!   the busy engines, `BlockStored` (and now and then `BlockRemoved`) batches in the normal
//!   mode's wire format, topic `kv@{ip:port}@{model}` per engine, each engine with its own
//!   contiguous sequence numbers.
//!
//! What it does not simulate: no token timing (answers are instant), no scheduling or queueing
//! (the gauges are a pseudo-random walk, unrelated to the requests served), no KV capacity or
//! prefix cache (the KV events name pseudo-random blocks; a request's prompt is never cached),
//! no replay socket, no P/D, no Responses/Messages/generate routes, no real tokenizer.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use attache_policies::request::{self, Api, Prompt};
use axum::body::Bytes;
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::IncomingStream;
use axum::Router;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::api::NoDelay;
use crate::config::EngineConfig;
use crate::engine::{TokenEvent, Usage};
use crate::kv::{KvEvent, Medium};
use crate::kv_publish::{self, Encoding};
use crate::metrics::{self, Gauges, Stats};
use crate::wire::error;

/// Engine `i`'s address in cheap mode: `127.1.{i / 256}.{i % 256}:{port}`. Engines are numbered
/// below 65,536 (the simulator's `--engines` is a `u16`).
pub fn cheap_address(i: usize, port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::new(127, 1, (i >> 8) as u8, i as u8), port))
}

/// The engine number of a cheap-mode IP (the inverse of [`cheap_address`]).
pub fn cheap_index(ip: IpAddr) -> Option<usize> {
    let v4 = match ip {
        IpAddr::V4(v4) => v4,
        IpAddr::V6(v6) => v6.to_ipv4_mapped()?,
    };
    match v4.octets() {
        [127, 1, hi, lo] => Some(usize::from(hi) << 8 | usize::from(lo)),
        _ => None,
    }
}

/// A pool's configuration.
#[derive(Debug, Clone)]
pub struct CheapConfig {
    pub engines: usize,
    /// The port every engine listens on.
    pub port: u16,
    /// Served models; engine `i` serves `models[i % len]`.
    pub models: Vec<String>,
    /// LoRA adapters every engine serves.
    pub lora_adapters: Vec<String>,
    pub max_loras: usize,
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    /// Fraction of the engines whose gauges change (0..=1).
    pub busy_fraction: f64,
}

/// One engine: its gauges and counters (48 bytes).
#[derive(Default)]
struct Slot {
    waiting: AtomicU32,
    running: AtomicU32,
    kv_usage: AtomicU64, // f64 bits
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    success_stop: AtomicU64,
    success_length: AtomicU64,
}

pub const MAX_WAITING: u32 = 8;
pub const MAX_RUNNING: u32 = 64;

/// Every engine of the pool.
pub struct CheapPool {
    cfg: CheapConfig,
    /// One engine configuration per model, shared by the engines that serve it.
    configs: Vec<EngineConfig>,
    engines: Vec<Slot>,
    busy: Vec<u32>,
    tick: AtomicU64,
    /// `_created` of every counter: fixed, so an idle engine's page never changes.
    created: f64,
}

/// SplitMix64: a cheap, well-mixed, deterministic hash of `x`.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const SEED_BUSY: u64 = 0xb05e_0000_0000_0001;
const SEED_INIT: u64 = 0x1417_0000_0000_0002;
const SEED_CHURN: u64 = 0xc4a2_0000_0000_0003;
const SEED_KV: u64 = 0x4b56_0000_0000_0004;

impl CheapPool {
    pub fn new(cfg: CheapConfig) -> anyhow::Result<Arc<Self>> {
        anyhow::ensure!(!cfg.models.is_empty(), "cheap mode: no model");
        anyhow::ensure!(cfg.engines <= 1 << 16, "cheap mode: at most 65,536 engines (127.1.0.0/16)");
        anyhow::ensure!((0.0..=1.0).contains(&cfg.busy_fraction), "--cheap-busy must be within 0..=1");
        let configs = cfg
            .models
            .iter()
            .map(|m| EngineConfig {
                model: m.clone(),
                block_size: cfg.block_size,
                num_gpu_blocks: cfg.num_gpu_blocks,
                max_num_seqs: MAX_RUNNING as usize,
                max_num_batched_tokens: 2048,
                max_model_len: cfg.max_model_len,
                time_scale: 1.0,
                enable_prefix_caching: cfg.enable_prefix_caching,
                num_cpu_blocks: 0,
                cpu_reload_cost: 0.0,
                kv_transfer_cost: 0.0,
                prefill_scale: 1.0,
                decode_scale: 1.0,
                stream_interval: 1,
                lora_adapters: cfg.lora_adapters.clone(),
                max_loras: cfg.max_loras.max(1),
                fail_status: None,
            })
            .collect();
        let engines: Vec<Slot> = (0..cfg.engines)
            .map(|i| {
                let h = mix(SEED_INIT ^ i as u64);
                let s = Slot::default();
                s.waiting.store((h % u64::from(MAX_WAITING + 1)) as u32, Ordering::Relaxed);
                s.running.store(((h >> 8) % u64::from(MAX_RUNNING + 1)) as u32, Ordering::Relaxed);
                s.kv_usage.store((((h >> 16) % 1001) as f64 / 1000.0).to_bits(), Ordering::Relaxed);
                s
            })
            .collect();
        // Exactly round(fraction × engines) busy engines, spread over the pool by a hash (so a
        // pool of 10,000 at 0.0001 has one, not "about one").
        let want = (cfg.busy_fraction * cfg.engines as f64).round() as usize;
        let mut ranked: Vec<(u64, u32)> = (0..cfg.engines).map(|i| (mix(SEED_BUSY ^ i as u64), i as u32)).collect();
        ranked.sort_unstable();
        let mut busy: Vec<u32> = ranked.into_iter().take(want).map(|(_, i)| i).collect();
        busy.sort_unstable();
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        Ok(Arc::new(Self { cfg, configs, engines, busy, tick: AtomicU64::new(0), created }))
    }

    pub fn len(&self) -> usize {
        self.engines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.engines.is_empty()
    }

    pub fn config(&self) -> &CheapConfig {
        &self.cfg
    }

    /// Whether engine `i`'s gauges change (a deterministic pseudo-random choice, about
    /// `busy_fraction` of the engines).
    pub fn is_busy(&self, i: usize) -> bool {
        self.busy.binary_search(&(i as u32)).is_ok()
    }

    /// The busy engines, ascending.
    pub fn busy(&self) -> &[u32] {
        &self.busy
    }

    /// The model engine `i` serves.
    pub fn model(&self, i: usize) -> &str {
        &self.cfg.models[i % self.cfg.models.len()]
    }

    pub fn address(&self, i: usize) -> SocketAddr {
        cheap_address(i, self.cfg.port)
    }

    /// Engine `i`'s (waiting, running, kv_usage).
    pub fn gauges(&self, i: usize) -> Option<(u32, u32, f64)> {
        let s = self.engines.get(i)?;
        Some((
            s.waiting.load(Ordering::Relaxed),
            s.running.load(Ordering::Relaxed),
            f64::from_bits(s.kv_usage.load(Ordering::Relaxed)),
        ))
    }

    /// Set engine `i`'s gauges (the churn task overwrites them if it is busy).
    pub fn set_gauges(&self, i: usize, waiting: u32, running: u32, kv_usage: f64) {
        if let Some(s) = self.engines.get(i) {
            s.waiting.store(waiting, Ordering::Relaxed);
            s.running.store(running, Ordering::Relaxed);
            s.kv_usage.store(kv_usage.clamp(0.0, 1.0).to_bits(), Ordering::Relaxed);
        }
    }

    /// One churn tick: a pseudo-random walk step of every busy engine's gauges (waiting in
    /// 0..=8, running in 0..=64, kv_usage in 0..=1; kv_usage always moves).
    pub fn churn(&self) {
        let tick = self.tick.fetch_add(1, Ordering::Relaxed);
        for &i in &self.busy {
            let Some(s) = self.engines.get(i as usize) else { continue };
            let h = mix(SEED_CHURN ^ (u64::from(i) << 32) ^ tick);
            let w = s.waiting.load(Ordering::Relaxed);
            let w = (w + (h % 3) as u32).saturating_sub(1).min(MAX_WAITING);
            let r = s.running.load(Ordering::Relaxed);
            let r = (r + ((h >> 8) % 9) as u32).saturating_sub(4).min(MAX_RUNNING);
            let kv = f64::from_bits(s.kv_usage.load(Ordering::Relaxed));
            let step = (10 + (h >> 16) % 40) as f64 / 1000.0;
            let up = (h >> 32) & 1 == 1;
            let kv = match (up, kv + step <= 1.0, kv - step >= 0.0) {
                (true, true, _) | (false, true, false) => kv + step,
                _ => kv - step,
            };
            s.waiting.store(w, Ordering::Relaxed);
            s.running.store(r, Ordering::Relaxed);
            s.kv_usage.store(kv.clamp(0.0, 1.0).to_bits(), Ordering::Relaxed);
        }
    }

    /// Engine `i`'s `/metrics` page, in the normal mode's exposition; with a `name[]`
    /// `query`, only those samples (`GET /metrics/?…`).
    pub fn render(&self, i: usize, query: Option<&str>) -> Option<String> {
        let s = self.engines.get(i)?;
        let cfg = &self.configs[i % self.configs.len()];
        let mut st = Stats::new();
        st.created = self.created;
        st.prompt_tokens = s.prompt_tokens.load(Ordering::Relaxed);
        st.generation_tokens = s.generation_tokens.load(Ordering::Relaxed);
        let stop = s.success_stop.load(Ordering::Relaxed);
        let length = s.success_length.load(Ordering::Relaxed);
        for (reason, n) in &mut st.finished {
            match *reason {
                "stop" => *n = stop,
                "length" => *n = length,
                _ => {}
            }
        }
        // Answers are instant: every request's first token at 1 ms.
        st.ttft.observe_n(0.001, stop + length);
        let (waiting, running, kv_usage) = self.gauges(i)?;
        let g = Gauges {
            running: running as usize,
            waiting: waiting as usize,
            kv_usage,
            running_loras: Vec::new(),
            waiting_loras: Vec::new(),
        };
        Some(metrics::render_query(cfg, &st, &g, query))
    }

    /// The engine a connection reached: the one whose address it dialed.
    fn engine_at(&self, local: SocketAddr) -> Option<usize> {
        cheap_index(local.ip()).filter(|i| *i < self.engines.len())
    }

    /// The HTTP routes of every engine; serve with [`serve`] (it needs [`LocalAddr`]).
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat))
            .route("/v1/models", get(models))
            .route("/metrics", get(metrics_handler))
            .route("/metrics/", get(filtered_metrics_handler))
            .route("/health", get(health))
            .with_state(self.clone())
    }
}

/// The local address of a connection: the engine address the client dialed.
#[derive(Debug, Clone, Copy)]
pub struct LocalAddr(pub SocketAddr);

impl Connected<IncomingStream<'_, NoDelay>> for LocalAddr {
    fn connect_info(stream: IncomingStream<'_, NoDelay>) -> Self {
        LocalAddr(stream.io().local_addr().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0))))
    }
}

/// Serve every engine of `pool` on `listener` (bound on `0.0.0.0:port`).
pub async fn serve(pool: Arc<CheapPool>, listener: TcpListener) -> std::io::Result<()> {
    let app = pool.router().into_make_service_with_connect_info::<LocalAddr>();
    axum::serve(NoDelay(listener), app).await
}

/// Run the churn task: [`CheapPool::churn`] every `period`.
pub fn spawn_churn(pool: Arc<CheapPool>, period: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut t = tokio::time::interval(period.max(Duration::from_millis(1)));
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t.tick().await;
        loop {
            t.tick().await;
            pool.churn();
        }
    })
}

type St = State<Arc<CheapPool>>;
type Local = ConnectInfo<LocalAddr>;

fn no_engine(local: SocketAddr) -> Response {
    let msg = format!("no cheap-mode engine at {local} (engines are 127.1.x.y)");
    error(StatusCode::NOT_FOUND, "NotFoundError", None, &msg)
}

/// The normal mode's `x-inference-*` headers, with engine `i`'s address.
fn with_engine_headers(r: Response, pool: &CheapPool, i: usize) -> Response {
    let addr = pool.address(i);
    crate::api::identify(r, &addr.port().to_string(), &format!("sim-{addr}"), &addr.to_string())
}

async fn health(State(pool): St, ConnectInfo(LocalAddr(local)): Local) -> Response {
    match pool.engine_at(local) {
        Some(i) => with_engine_headers(StatusCode::OK.into_response(), &pool, i),
        None => no_engine(local),
    }
}

async fn metrics_handler(State(pool): St, ConnectInfo(LocalAddr(local)): Local) -> Response {
    metrics_page(&pool, local, None)
}

async fn filtered_metrics_handler(
    State(pool): St,
    ConnectInfo(LocalAddr(local)): Local,
    RawQuery(q): RawQuery,
) -> Response {
    metrics_page(&pool, local, q.as_deref())
}

fn metrics_page(pool: &CheapPool, local: SocketAddr, query: Option<&str>) -> Response {
    match pool.engine_at(local).and_then(|i| pool.render(i, query)) {
        Some(text) => {
            (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
        }
        None => no_engine(local),
    }
}

async fn models(State(pool): St, ConnectInfo(LocalAddr(local)): Local) -> Response {
    let Some(i) = pool.engine_at(local) else { return no_engine(local) };
    let model = pool.model(i);
    let cfg = pool.config();
    let now = crate::api::now_s();
    let mut data = vec![json!({
        "id": model, "object": "model", "created": now, "owned_by": "vllm",
        "root": model, "parent": null, "max_model_len": cfg.max_model_len,
    })];
    data.extend(cfg.lora_adapters.iter().map(|a| {
        json!({"id": a, "object": "model", "created": now, "owned_by": "vllm", "root": a,
               "parent": model, "max_model_len": cfg.max_model_len})
    }));
    let body = json!({"object": "list", "data": data});
    let r = (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response();
    with_engine_headers(r, &pool, i)
}

async fn completions(State(pool): St, ConnectInfo(LocalAddr(local)): Local, body: Bytes) -> Response {
    infer(&pool, local, Api::Completions, &body).await
}

async fn chat(State(pool): St, ConnectInfo(LocalAddr(local)): Local, body: Bytes) -> Response {
    infer(&pool, local, Api::ChatCompletions, &body).await
}

/// Tokens a cheap engine generates at most per request.
const MAX_OUTPUT: usize = 4;

async fn infer(pool: &CheapPool, local: SocketAddr, api: Api, body: &[u8]) -> Response {
    let Some(i) = pool.engine_at(local) else { return no_engine(local) };
    let r = answer(pool, i, api, body).await;
    with_engine_headers(r, pool, i)
}

async fn answer(pool: &CheapPool, i: usize, api: Api, body: &[u8]) -> Response {
    let req = match request::parse(api, body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, "BadRequestError", None, &e.to_string()),
    };
    if req.model != pool.model(i) && !pool.cfg.lora_adapters.contains(&req.model) {
        let msg = format!("The model `{}` does not exist.", req.model);
        return error(StatusCode::NOT_FOUND, "NotFoundError", Some("model"), &msg);
    }
    // The byte-level tokenizer's count (BOS, then a token per 4 bytes) without tokenizing.
    let prompt_tokens = match &req.prompt {
        Prompt::Text(t) => t.len().div_ceil(4) + 1,
        Prompt::Tokens(t) => t.len(),
    };
    let max_tokens = req.max_tokens.map_or(16, |m| usize::try_from(m).unwrap_or(usize::MAX));
    let n = max_tokens.min(MAX_OUTPUT);
    let finish_reason = if n == max_tokens { "length" } else { "stop" };
    let Some(s) = pool.engines.get(i) else { return error(StatusCode::NOT_FOUND, "NotFoundError", None, "") };
    s.prompt_tokens.fetch_add(prompt_tokens as u64, Ordering::Relaxed);
    s.generation_tokens.fetch_add(n as u64, Ordering::Relaxed);
    let success = if n == max_tokens { &s.success_length } else { &s.success_stop };
    success.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::unbounded_channel();
    for t in 0..n {
        let _ = tx.send(TokenEvent::Tokens(vec![4 + t as u32], t + 1 == n));
    }
    let usage = Usage { prompt_tokens, completion_tokens: n, cached_tokens: 0, finish_reason };
    let _ = tx.send(TokenEvent::Done(usage));
    drop(tx);
    if req.stream {
        let extra: crate::api::Extra = serde_json::from_slice(body).unwrap_or_default();
        let include_usage = extra.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        crate::api::stream(api, req.model, rx, include_usage)
    } else {
        crate::api::non_stream(api, req.model, rx, None).await
    }
}

// --- KV events ---

/// Blocks per `BlockStored` event.
const BLOCKS_PER_EVENT: u64 = 4;

/// The engine hash of engine `i`'s `n`-th stored block: pseudo-random, and recomputable, so a
/// `BlockRemoved` names blocks stored before without a block table.
fn block_hash(i: u32, n: u64) -> u64 {
    mix(SEED_KV ^ mix(u64::from(i)) ^ n)
}

/// One busy engine's event stream: its sequence number, and blocks stored and removed so far
/// (the live blocks are `removed..stored`).
#[derive(Default, Clone, Copy)]
struct KvStream {
    seq: u64,
    stored: u64,
    removed: u64,
}

/// The KV-event publisher thread; dropping it stops the thread.
pub struct KvPublisher {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for KvPublisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Publish KV events for the busy engines of `pool` on one PUB socket connected to `endpoint`
/// (a collector; an endpoint with `*` binds, as vLLM does), `events_per_s` events a second in
/// all, round-robin over the busy engines. Returns once the socket is set up.
pub fn spawn_kv_publisher(
    pool: Arc<CheapPool>,
    endpoint: &str,
    events_per_s: f64,
    encoding: Encoding,
) -> anyhow::Result<KvPublisher> {
    anyhow::ensure!(events_per_s.is_finite() && events_per_s >= 0.0, "--cheap-kv-events-per-s must be >= 0");
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB)?;
    publisher.set_sndhwm(100_000)?;
    publisher.set_linger(0)?;
    if kv_publish::binds(endpoint) {
        publisher.bind(endpoint)?;
    } else {
        publisher.connect(endpoint)?;
    }
    info!(%endpoint, busy = pool.busy().len(), events_per_s, "kv events: cheap mode publishing");
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let thread = std::thread::Builder::new().name("kv-publisher-cheap".into()).spawn(move || {
        let _ctx = ctx;
        let mut streams = vec![KvStream::default(); pool.busy().len()];
        let start = Instant::now();
        let (mut sent, mut next) = (0u64, 0usize);
        while !stopped.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(10));
            if streams.is_empty() {
                continue;
            }
            let due = (events_per_s * start.elapsed().as_secs_f64()) as u64;
            // After a stall, at most a second's worth at once.
            let burst = (events_per_s as u64).max(1);
            if due.saturating_sub(sent) > burst {
                sent = due - burst;
            }
            while sent < due && !stopped.load(Ordering::Relaxed) {
                let k = next % streams.len();
                next = k + 1;
                sent += publish_one(&pool, &publisher, pool.busy()[k], &mut streams[k], encoding);
            }
        }
    })?;
    Ok(KvPublisher { stop, thread: Some(thread) })
}

/// Publish one batch for engine `i`; returns the events it held.
fn publish_one(pool: &CheapPool, publisher: &zmq::Socket, i: u32, st: &mut KvStream, encoding: Encoding) -> u64 {
    let events = kv_batch(pool, i, st);
    let events = if encoding == Encoding::Map { kv_publish::split_removed(events) } else { events };
    let n = events.len() as u64;
    let ts = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    let payload = kv_publish::encode_batch(ts, &events, encoding);
    let topic = format!("kv@{}@{}", pool.address(i as usize), pool.model(i as usize));
    let frames: [&[u8]; 3] = [topic.as_bytes(), &st.seq.to_be_bytes(), &payload];
    if let Err(e) = publisher.send_multipart(frames, 0) {
        warn!(error = %e, "kv events: send failed");
    }
    st.seq += 1;
    n.max(1)
}

/// Engine `i`'s next batch: `BLOCKS_PER_EVENT` new blocks (a chain from the root, pseudo-random
/// tokens), or, one time in eight and whenever the engine's capacity would overflow, its
/// oldest live blocks removed.
fn kv_batch(pool: &CheapPool, i: u32, st: &mut KvStream) -> Vec<KvEvent> {
    let h = mix(SEED_KV ^ (u64::from(i) << 32) ^ st.seq);
    let live = st.stored - st.removed;
    let full = live + BLOCKS_PER_EVENT > pool.cfg.num_gpu_blocks as u64;
    if live > 0 && (h.is_multiple_of(8) || full) {
        let n = live.min(BLOCKS_PER_EVENT);
        let hashes = (st.removed..st.removed + n).map(|b| block_hash(i, b)).collect();
        st.removed += n;
        return vec![KvEvent::Removed { hashes, medium: Medium::Gpu }];
    }
    let bs = pool.cfg.block_size.max(1);
    let hashes: Vec<u64> = (st.stored..st.stored + BLOCKS_PER_EVENT).map(|b| block_hash(i, b)).collect();
    let tokens = hashes
        .iter()
        .flat_map(|bh| (0..bs as u64).map(move |t| 3 + (mix(bh ^ t) % u64::from(crate::tokenizer::VOCAB - 3)) as u32))
        .collect();
    st.stored += BLOCKS_PER_EVENT;
    vec![KvEvent::Stored { hashes, parent: None, tokens, block_size: bs as u32, medium: Medium::Gpu }]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(engines: usize, port: u16, busy: f64) -> CheapConfig {
        CheapConfig {
            engines,
            port,
            models: vec!["m0".into(), "m1".into(), "m2".into()],
            lora_adapters: Vec::new(),
            max_loras: 1,
            block_size: 16,
            num_gpu_blocks: 2048,
            max_model_len: 32768,
            enable_prefix_caching: true,
            busy_fraction: busy,
        }
    }

    #[test]
    fn addresses_round_trip() {
        assert_eq!(cheap_address(0, 9000).to_string(), "127.1.0.0:9000");
        assert_eq!(cheap_address(5, 9000).to_string(), "127.1.0.5:9000");
        assert_eq!(cheap_address(19_999, 9000).to_string(), "127.1.78.31:9000");
        for i in [0, 1, 255, 256, 19_999, 65_535] {
            assert_eq!(cheap_index(cheap_address(i, 1).ip()), Some(i));
        }
        assert_eq!(cheap_index("127.0.0.1".parse().unwrap()), None);
    }

    #[test]
    fn a_cheap_page_parses_into_the_metrics_the_host_reads() {
        let pool = CheapPool::new(config(10, 9000, 0.5)).unwrap();
        pool.set_gauges(4, 3, 17, 0.625);
        let page = pool.render(4, None).unwrap();
        let m = attache_kv::prom::engine_metrics(&page, attache_kv::Engine::Vllm).unwrap();
        assert_eq!(m.waiting, 3.0);
        assert_eq!(m.running, 17.0);
        assert_eq!(m.kv_usage, 0.625);
        assert_eq!(m.block_size, Some(16));
        assert_eq!(m.num_gpu_blocks, Some(2048));
        assert_eq!(m.models, vec!["m1".to_owned()]);
        assert_eq!(m.ttft_count, 0.0);
        for name in ["vllm:num_requests_waiting", "vllm:cache_config_info", "vllm:time_to_first_token_seconds_sum"] {
            assert!(page.contains(name), "{name}");
        }
        // What the host asks for below /metrics/: the same metrics from a page a tenth the size.
        let path = attache_kv::Engine::Vllm.filtered_metrics_path("/metrics", true).unwrap();
        let small = pool.render(4, path.split_once('?').map(|(_, q)| q)).unwrap();
        assert_eq!(attache_kv::prom::engine_metrics(&small, attache_kv::Engine::Vllm).unwrap(), m);
        assert!(small.len() * 10 < page.len(), "{} of {} bytes:\n{small}", small.len(), page.len());
    }

    #[test]
    fn busy_engines_change_and_idle_ones_do_not() {
        let pool = CheapPool::new(config(2000, 9000, 0.1)).unwrap();
        let busy = pool.busy().len();
        assert!((120..=280).contains(&busy), "about 10% busy: {busy}");
        let before: Vec<String> = (0..pool.len()).map(|i| pool.render(i, None).unwrap()).collect();
        let gauges: Vec<_> = (0..pool.len()).map(|i| pool.gauges(i).unwrap()).collect();
        pool.churn();
        for (i, (page, g)) in before.iter().zip(&gauges).enumerate() {
            let now = pool.gauges(i).unwrap();
            if pool.is_busy(i) {
                assert_ne!(now.2, g.2, "busy engine {i}'s kv usage moved");
                assert!(now.0 <= MAX_WAITING && now.1 <= MAX_RUNNING && (0.0..=1.0).contains(&now.2));
                let m =
                    attache_kv::prom::engine_metrics(&pool.render(i, None).unwrap(), attache_kv::Engine::Vllm).unwrap();
                assert_eq!((m.waiting, m.running, m.kv_usage), (f64::from(now.0), f64::from(now.1), now.2));
            } else {
                assert_eq!(&now, g);
                assert_eq!(&pool.render(i, None).unwrap(), page, "idle engine {i}'s page is constant");
            }
        }
        // A long walk stays in range.
        for _ in 0..500 {
            pool.churn();
        }
        for &i in pool.busy() {
            let (w, r, kv) = pool.gauges(i as usize).unwrap();
            assert!(w <= MAX_WAITING && r <= MAX_RUNNING && (0.0..=1.0).contains(&kv));
        }
    }

    async fn start(engines: usize, busy: f64) -> (Arc<CheapPool>, u16) {
        let listener = TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let pool = CheapPool::new(config(engines, port, busy)).unwrap();
        tokio::spawn(serve(pool.clone(), listener));
        (pool, port)
    }

    #[tokio::test]
    async fn a_request_to_127_1_0_5_reaches_engine_5() {
        let (pool, port) = start(300, 0.1).await;
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let base = format!("http://127.1.0.5:{port}");
        let body = json!({"model": "m2", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3});
        let r = http.post(format!("{base}/v1/chat/completions")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-inference-address"], format!("127.1.0.5:{port}").as_str());
        assert_eq!(r.headers()["x-inference-port"], port.to_string().as_str());
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["model"], "m2");
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["usage"]["completion_tokens"], 3);
        assert_eq!(v["choices"][0]["finish_reason"], "length");

        // Its counters, and only its, counted the request.
        let page = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(page.contains("vllm:generation_tokens_total{engine=\"0\",model_name=\"m2\"} 3.0"), "{page}");
        assert!(page.contains("vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m2\"} 1.0"));
        assert!(pool
            .render(6, None)
            .unwrap()
            .contains("vllm:generation_tokens_total{engine=\"0\",model_name=\"m0\"} 0.0"));

        // Streaming completions on engine 256 (127.1.1.0), which serves m1.
        let other = format!("http://127.1.1.0:{port}");
        let body = json!({"model": "m1", "prompt": "abc", "stream": true, "stream_options": {"include_usage": true}});
        let r = http.post(format!("{other}/v1/completions")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-inference-address"], format!("127.1.1.0:{port}").as_str());
        let text = r.text().await.unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        assert_eq!(text.matches("\"text_completion\"").count(), 5, "4 tokens and a usage chunk: {text}");

        // A model the engine does not serve: 404, OpenAI-shaped, with the engine's headers.
        let body = json!({"model": "m0", "prompt": "abc"});
        let r = http.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 404);
        assert_eq!(r.headers()["x-inference-address"], format!("127.1.0.5:{port}").as_str());
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], "NotFoundError");

        let v: serde_json::Value = http.get(format!("{base}/v1/models")).send().await.unwrap().json().await.unwrap();
        assert_eq!(v["data"][0]["id"], "m2");

        // Outside the pool: no engine.
        let r = http.get(format!("http://127.1.1.44:{port}/metrics")).send().await.unwrap();
        assert_eq!(r.status(), 404);
    }

    #[tokio::test]
    async fn kv_batches_decode_with_their_engine_topic() {
        let pool = CheapPool::new(config(50, 9000, 0.2)).unwrap();
        assert!(!pool.busy().is_empty());
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.set_rcvtimeo(5000).unwrap();
        sub.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = sub.get_last_endpoint().unwrap().unwrap();
        let _publisher = spawn_kv_publisher(pool.clone(), &endpoint, 2000.0, Encoding::Map).unwrap();
        let (mut stored, mut removed) = (0, 0);
        let mut seqs = std::collections::HashMap::new();
        for _ in 0..400 {
            let frames = sub.recv_multipart(0).unwrap();
            assert_eq!(frames.len(), 3);
            let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
            let msg = attache_kv::events::split_frames(&refs).unwrap();
            let topic = std::str::from_utf8(msg.topic).unwrap();
            let mut parts = topic.split('@');
            assert_eq!(parts.next(), Some("kv"));
            let addr: SocketAddr = parts.next().unwrap().parse().unwrap();
            let i = cheap_index(addr.ip()).unwrap();
            assert_eq!(addr.port(), 9000);
            assert!(pool.is_busy(i), "engine {i} is busy");
            assert_eq!(parts.next(), Some(pool.model(i)));
            // Each engine's sequence is its own and contiguous.
            if let Some(last) = seqs.insert(i, msg.seq) {
                assert_eq!(msg.seq, last + 1, "engine {i}");
            }
            let batch = attache_kv::events::decode_batch(msg.payload).unwrap();
            for e in &batch.events {
                match e {
                    attache_kv::KvEvent::BlockStored { block_hashes, token_ids, block_size, .. } => {
                        assert_eq!(token_ids.len(), block_hashes.len() * *block_size as usize);
                        stored += 1;
                    }
                    attache_kv::KvEvent::BlockRemoved { block_hashes, .. } => {
                        assert_eq!(block_hashes.len(), 1, "one BlockRemoved per block, as vLLM");
                        removed += 1;
                    }
                    attache_kv::KvEvent::AllBlocksCleared => panic!("no clears"),
                }
            }
        }
        assert!(stored > 0 && removed > 0, "stored {stored}, removed {removed}");
    }

    /// Removed blocks are ones the engine stored earlier, oldest first.
    #[test]
    fn removals_name_stored_blocks() {
        let pool = CheapPool::new(config(4, 9000, 1.0)).unwrap();
        let mut st = KvStream::default();
        let mut live = std::collections::VecDeque::new();
        for _ in 0..200 {
            for e in kv_batch(&pool, 2, &mut st) {
                match e {
                    KvEvent::Stored { hashes, .. } => live.extend(hashes),
                    KvEvent::Removed { hashes, .. } => {
                        for h in hashes {
                            assert_eq!(live.pop_front(), Some(h));
                        }
                    }
                    KvEvent::Cleared => unreachable!(),
                }
            }
            st.seq += 1;
        }
        assert_eq!(live.len() as u64, st.stored - st.removed);
    }
}
