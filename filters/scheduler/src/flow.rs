//! Flow control in the filter. While the pool is saturated, requests wait in this worker's
//! queue (policies::flow), paused; they are dispatched — routed, then resumed — when the pool
//! has room: on arrival, when a request ends, and from the root context's tick, which also
//! sheds expired requests and shares fairness state with the other workers (the board).

use std::collections::BTreeMap;

use attache_policies::flow::{Board, FlowConfig, FlowQueue, Gate, Shed};
use attache_policies::PoolState;
use proxy_wasm::types::LogLevel;

use crate::host;
use crate::http::{answer, shed_response, SharedRequest};
use crate::root::Worker;
use crate::route::route;

/// Shared-data key of the per-Envoy fairness board.
const BOARD_KEY: &str = "attache.flow.board";
/// Shared-data key of the counter that names workers on the board.
const WORKER_SEQ_KEY: &str = "attache.flow.workers";
/// A worker re-posts unchanged demand this often, so it does not look silent.
const REPOST_MS: u64 = 100;

/// This worker's flow-control state.
pub struct FlowState {
    pub queue: FlowQueue<SharedRequest>,
    pub gate: Gate,
    /// Estimated tokens dispatched per tenant since the last board merge.
    pending: BTreeMap<String, f64>,
    /// The board as last read.
    board: Board,
    board_cas: Option<u32>,
    worker_id: String,
    last_post_ms: u64,
    last_posted: Vec<(i32, String, u32)>,
}

/// What a pump did with the request whose callback ran it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pumped {
    /// Still waiting (or no current request).
    Waiting,
    /// Routed: the callback lets it continue.
    Dispatched,
    /// Answered with an error.
    Answered,
}

/// A name for this worker on the board, unique within the Envoy (a shared counter).
fn next_worker_id() -> String {
    for _ in 0..16 {
        let (v, cas) = host::shared_data_cas(WORKER_SEQ_KEY);
        let n = v.and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok()).map(u64::from_be_bytes).unwrap_or(0) + 1;
        if host::set_shared_data_cas(WORKER_SEQ_KEY, &n.to_be_bytes(), cas) {
            return format!("w{n}");
        }
    }
    format!("w{}", host::now_us())
}

impl FlowState {
    pub fn new(enabled: bool) -> Self {
        Self {
            queue: FlowQueue::default(),
            gate: Gate::default(),
            pending: BTreeMap::new(),
            board: Board::default(),
            board_cas: None,
            worker_id: if enabled { next_worker_id() } else { String::new() },
            last_post_ms: 0,
            last_posted: Vec::new(),
        }
    }

    /// Estimated pool saturation now: the host's figure plus this worker's dispatches it has
    /// not seen yet. `None` when the pool has no endpoints.
    pub fn estimate(&mut self, pool: &PoolState) -> Option<f64> {
        pool.saturation.map(|s| self.gate.estimate(s, pool.observed_ms, pool.dispatch_cost))
    }

    fn usage(board: &Board, pending: &BTreeMap<String, f64>, tenant: &str) -> f64 {
        board.usage(tenant) + pending.get(tenant).copied().unwrap_or(0.0)
    }

    /// Fold this worker's dispatched tokens and waiting requests into the board (CAS; on a
    /// lost race, the next tick retries with the newer board).
    fn sync_board(&mut self, cfg: &FlowConfig, now_ms: u64) {
        let (bytes, cas) = host::shared_data_cas(BOARD_KEY);
        if cas != self.board_cas || bytes.is_none() {
            self.board = bytes.as_deref().and_then(Board::decode).unwrap_or_default();
            self.board_cas = cas;
        }
        let waiting: Vec<(i32, String, u32)> =
            self.queue.depths().into_iter().map(|(p, t, n)| (p, t, n.min(u32::MAX as usize) as u32)).collect();
        let changed = !self.pending.is_empty() || waiting != self.last_posted;
        let due = !waiting.is_empty() && now_ms.saturating_sub(self.last_post_ms) >= REPOST_MS;
        if !changed && !due {
            return;
        }
        let mut next = self.board.clone();
        next.merge(&self.worker_id, now_ms, &self.pending, waiting.clone(), cfg);
        if host::set_shared_data_cas(BOARD_KEY, &next.encode(), cas) {
            self.board = next;
            // Our write bumped the CAS; read it back next tick only if someone else writes.
            self.board_cas = host::shared_data_cas(BOARD_KEY).1;
            self.pending.clear();
            self.last_posted = waiting;
            self.last_post_ms = now_ms;
        }
    }
}

/// Dispatch what may go now, in flow-control order. `current` is the stream whose callback
/// runs this (it is routed in place, not resumed); any other dispatched request is made the
/// effective context, routed and resumed, or answered if routing fails.
pub fn pump(w: &mut Worker, current: Option<u32>) -> Pumped {
    let now = host::now_ms();
    w.cache.refresh(now);
    let mut outcome = Pumped::Waiting;
    if !w.cache.pool.has_ready() {
        // Requests wait for endpoints until their TTL (then 503).
        return outcome;
    }
    let config = std::rc::Rc::clone(&w.config);
    let cfg = &config.flow;
    let rivals = w.flow.board.rivals(&w.flow.worker_id, now, cfg.board_stale_ms);
    let mut switched = false;
    for _ in 0..cfg.dispatch_per_tick.max(1) {
        let Some(saturation) = w.flow.estimate(&w.cache.pool) else {
            break;
        };
        let f = &mut w.flow;
        let (board, pending) = (&f.board, &f.pending);
        let usage = |t: &str| FlowState::usage(board, pending, t);
        let Some(p) =
            f.queue.pop(usage, &rivals, cfg.quantum_tokens as f64, |prio| saturation < cfg.band(prio).ceiling)
        else {
            break;
        };
        w.metrics.flow_left(p.priority, &p.tenant);
        let is_current = current.is_some_and(|c| u64::from(c) == p.id);
        let target = if is_current { current } else { u32::try_from(p.id).ok() };
        let Some(target) = target else {
            continue;
        };
        if (!is_current || switched) && !host::set_effective_context(target) {
            // The stream is gone (its on_log removes it; this is a race with it).
            continue;
        }
        switched = !is_current;
        let Ok(mut st) = p.value.try_borrow_mut() else {
            continue;
        };
        let Some(parked) = st.parked.take() else {
            continue;
        };
        match route(w, &mut st, &parked.req, parked.body_len, now) {
            Ok(()) => {
                w.flow.gate.dispatched(now);
                *w.flow.pending.entry(p.tenant.clone()).or_default() += p.tokens as f64;
                w.metrics.flow_dispatched(now.saturating_sub(p.enqueued_ms));
                if is_current {
                    outcome = Pumped::Dispatched;
                } else if !host::resume_request() {
                    host::log(LogLevel::Warn, &format!("attache[{}]: could not resume a queued request", p.id));
                }
            }
            Err(e) => {
                st.answered = true;
                answer(Some(w), target, &e, &[]);
                if is_current {
                    outcome = Pumped::Answered;
                }
            }
        }
    }
    if switched {
        if let Some(c) = current {
            host::set_effective_context(c);
        }
    }
    outcome
}

/// The worker's flow-control tick: shed expired requests, sync the board, dispatch.
pub fn tick(w: &mut Worker) {
    let now = host::now_ms();
    w.cache.refresh(now);
    let expired = w.flow.queue.expire(now);
    let has_ready = w.cache.pool.has_ready();
    for p in expired {
        w.metrics.flow_left(p.priority, &p.tenant);
        let Ok(id) = u32::try_from(p.id) else {
            continue;
        };
        if let Ok(mut st) = p.value.try_borrow_mut() {
            st.parked = None;
            st.answered = true;
        }
        let (shed, detail) = if has_ready {
            (
                Shed::Expired,
                format!("waited {} ms for the saturated pool, the limit; retry later", w.config.flow.ttl_ms),
            )
        } else {
            (Shed::NoEndpoints, "no ready endpoint in the inference pool within the queue TTL; retry later".into())
        };
        w.metrics.flow_shed(shed);
        if host::set_effective_context(id) {
            let (err, extra) = shed_response(shed, &detail);
            host::send_json(err.status, err.reason, &err.body, &extra);
        }
    }
    let config = std::rc::Rc::clone(&w.config);
    w.flow.sync_board(&config.flow, now);
    let saturation = w.flow.estimate(&w.cache.pool);
    w.metrics.flow_saturation(saturation);
    if !w.flow.queue.is_empty() {
        pump(w, None);
    }
}
