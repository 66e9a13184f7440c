//! Flow control in the filter. While the pool is saturated, requests wait in this worker's
//! queue, paused; they are dispatched (routed, then resumed) when the pool has room: on
//! arrival, when a request ends, and from the root context's tick, which also sheds expired
//! requests and shares fairness state with the other workers (the board).

use attache_policies::flow::Refusal;
use proxy_wasm::types::LogLevel;

use crate::dispatch::{answer, refuse, route, shape_of};
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
        let Some(p) = f.queue.dispatch(cfg, saturation, usage, &rivals) else {
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
                answer(w, target, shape_of(st.api), &e);
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
        let mut api = None;
        if let Ok(mut st) = p.value.try_borrow_mut() {
            st.parked = None;
            st.answered = true;
            api = st.api;
        }
        let refusal = Refusal::expired(has_ready, w.config.flow.ttl_ms);
        if host::set_effective_context(id) {
            refuse(w, id, shape_of(api), &refusal);
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

#[cfg(test)]
mod tests {
    use attache_policies::flow::{Refusal, Shed, DROPPED_REASON_HEADER};
    use attache_policies::plan::DESTINATION_HEADER;
    use attache_proto::v1;
    use proxy_wasm::types::Action;

    use crate::testing::harness::{publish, snapshot, Filter, Request, MODEL};
    use crate::testing::{advance_ms, metric, now_ms, with};

    /// A scheduler with flow control on, and `flow` settings beyond `enabled`.
    fn flow_filter(flow: &str) -> Filter {
        let sep = if flow.is_empty() { "" } else { "," };
        Filter::configure(&format!(r#"{{"flow":{{"enabled":true{sep}{flow}}}}}"#))
    }

    /// Two endpoints at `saturation`, each dispatch adding `cost`, observed now.
    fn pool_at(version: u64, saturation: f64, cost: f64) -> v1::Snapshot {
        v1::Snapshot {
            version,
            saturation: Some(saturation),
            dispatch_cost: cost,
            observed_unix_ms: now_ms(),
            ..snapshot(2)
        }
    }

    /// A completion with `priority` in its body.
    fn request(priority: i64) -> Request {
        let body = serde_json::json!({ "model": MODEL, "prompt": "hello", "priority": priority });
        Request::completion(&body.to_string())
    }

    fn queued(f: &Filter) -> usize {
        f.worker().borrow().flow.queue.len()
    }

    #[test]
    fn flow_control_ticks_at_its_own_period() {
        let _f = flow_filter(r#""tick_ms":5"#);
        assert_eq!(with(|h| h.tick_period_ms), Some(5));
    }

    #[test]
    fn a_sheddable_request_on_a_saturated_pool_is_429_with_retry_after() {
        publish(&pool_at(1, 1.2, 0.0));
        let f = flow_filter("");
        let ex = f.send(request(-1));
        let r = ex.refused();
        assert_eq!((r.status, ex.on_body), (429, Some(Action::Pause)));
        assert_eq!((r.header("retry-after"), r.header(DROPPED_REASON_HEADER)), (Some("1"), Some("sheddable")));
        assert_eq!(metric("attache.flow.shed.sheddable"), Some(1));
        assert_eq!(queued(&f), 0);
        let ex = f.send(request(0));
        assert!(ex.local_response().is_none(), "priority 0 is not sheddable: it waits");
        assert_eq!(queued(&f), 1);
    }

    #[test]
    fn an_unknown_objective_is_400() {
        publish(&pool_at(1, 0.0, 0.0));
        let f = flow_filter("");
        let ex = f.send(request(0).header("x-llm-d-inference-objective", "nope"));
        let r = ex.refused();
        assert_eq!((r.status, r.header(DROPPED_REASON_HEADER)), (400, Some("unknown_objective")));
    }

    #[test]
    fn a_request_with_room_is_routed_in_place() {
        publish(&pool_at(1, 0.2, 0.1));
        let f = flow_filter("");
        let ex = f.send(request(0));
        assert_eq!(ex.on_body, Some(Action::Continue));
        assert!(ex.primary().is_some() && ex.resumed() == 0, "routed by its own callback, not resumed");
        assert_eq!((queued(&f), metric("attache.flow.dispatched")), (0, Some(1)));
        let endpoint = ex.primary().unwrap_or_default();
        ex.finish();
        assert_eq!(f.inflight(&endpoint), 0);
    }

    #[test]
    fn a_queued_request_is_dispatched_by_the_tick_once_the_pool_has_room() {
        publish(&pool_at(1, 1.0, 0.1));
        let mut f = flow_filter("");
        let ex = f.send(request(0));
        assert_eq!(ex.on_body, Some(Action::Pause), "waits, paused");
        assert!(ex.local_response().is_none() && ex.request_header(DESTINATION_HEADER).is_none());
        assert_eq!((queued(&f), metric("attache.flow.enqueued"), metric("attache.flow.queued")), (1, Some(1), Some(1)));
        advance_ms(10);
        f.tick();
        assert_eq!((queued(&f), ex.resumed()), (1, 0), "still saturated");

        publish(&pool_at(2, 0.5, 0.1));
        advance_ms(10);
        f.tick();
        assert_eq!((queued(&f), ex.resumed()), (0, 1), "routed, then resumed");
        assert!(ex.primary().is_some(), "routed on its own stream");
        assert_eq!((metric("attache.flow.dispatched"), metric("attache.flow.queued")), (Some(1), Some(0)));
        let waited = with(|h| h.metrics.iter().find(|m| m.name == "attache.flow.wait_ms").map(|m| m.samples.clone()));
        assert_eq!(waited, Some(vec![20]));
    }

    #[test]
    fn an_arriving_request_lets_the_older_waiting_one_go_first() {
        publish(&pool_at(1, 1.0, 0.1));
        let f = flow_filter("");
        let older = f.send(request(0));
        publish(&pool_at(2, 0.2, 0.1));
        advance_ms(1);
        // No tick yet: the next arrival dispatches both, the older one by resuming it.
        let newer = f.send(request(0));
        assert_eq!((older.resumed(), newer.resumed(), newer.on_body), (1, 0, Some(Action::Continue)));
        assert!(older.primary().is_some() && newer.primary().is_some(), "each routed on its own stream");
        assert_eq!(with(|h| h.current), newer.id, "the arrival's stream is the effective context again");
    }

    #[test]
    fn the_tick_dispatches_the_higher_priority_first() {
        publish(&pool_at(1, 1.0, 0.3));
        let mut f = flow_filter(r#""objectives":{"urgent":5}"#);
        let low = f.send(request(0));
        let high = f.send(request(0).header("x-llm-d-inference-objective", "urgent"));
        assert_eq!(queued(&f), 2);
        // Room for one: 0.8 now, 1.1 after one dispatch.
        publish(&pool_at(2, 0.8, 0.3));
        advance_ms(1);
        f.tick();
        assert_eq!((high.resumed(), low.resumed()), (1, 0));
        // A request ends: the pool has room for the next.
        high.finish();
        assert_eq!(low.resumed(), 1);
        assert_eq!(queued(&f), 0);
    }

    #[test]
    fn a_request_that_waits_past_its_ttl_is_shed() {
        publish(&pool_at(1, 1.0, 0.1));
        let mut f = flow_filter(r#""ttl_ms":100"#);
        let ex = f.send(request(0));
        advance_ms(150);
        f.tick();
        let (want, reason) = (Refusal::expired(true, 100), Shed::Expired.reason());
        let r = ex.refused();
        assert_eq!((r.status, r.header(DROPPED_REASON_HEADER)), (u32::from(want.response.status), Some(reason)));
        assert_eq!((queued(&f), metric(&format!("attache.flow.shed.{reason}"))), (0, Some(1)));

        // Endpoints gone while it waited: 503.
        let ex = f.send(request(0));
        let mut gone = pool_at(2, 1.0, 0.1);
        gone.endpoints.iter_mut().for_each(|e| e.ready = false);
        publish(&gone);
        advance_ms(150);
        f.tick();
        assert_eq!(ex.refused().status, u32::from(Shed::NoEndpoints.status()));
    }

    #[test]
    fn a_client_that_leaves_while_queued_is_dropped_from_the_queue() {
        publish(&pool_at(1, 1.0, 0.1));
        let f = flow_filter("");
        let ex = f.send(request(0));
        assert_eq!(queued(&f), 1);
        ex.finish();
        assert_eq!(
            (queued(&f), metric("attache.flow.disconnected"), metric("attache.flow.queued")),
            (0, Some(1), Some(0))
        );
    }
}
