//! Flow control in the filter. While the pool is saturated, requests wait in this worker's
//! queue, paused; they are dispatched (routed, then resumed) when the pool has room: on
//! arrival, when a request ends, and from the root context's tick, which also sheds expired
//! requests and shares fairness state with the other workers (the board).

use attache_policies::flow::Refusal;
use proxy_wasm::types::LogLevel;

use crate::dispatch::{answer, refuse, route};
use crate::flow_state::FlowState;
use crate::hostcalls as host;
use crate::worker::Worker;

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
                answer(w, target, &e);
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
        let refusal = Refusal::expired(has_ready, w.config.flow.ttl_ms);
        if host::set_effective_context(id) {
            refuse(w, id, &refusal);
        } else if let Some(shed) = refusal.shed {
            w.metrics.flow_shed(shed);
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
