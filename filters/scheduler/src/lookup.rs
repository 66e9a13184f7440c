//! Fleet bindings that cannot wait for the stream's next report: [`share`] sends a worker's new
//! binding to the host at once, and [`dispatch`] reads one through.
//!
//! Read-through: a Responses continuation whose `previous_response_id` no
//! worker of this Envoy has bound reached it before the fleet state did (the client continued
//! the moment the other replica answered). The request pauses while the host is asked, and the
//! host waits up to `fleet.lookup_wait_ms` for the binding to be reported. Found: bound here and
//! routed to it. Not found, or the host is unreachable: routed as a new conversation.

use std::time::Duration;

use attache_policies::plugin_config::FleetConfig;
use attache_policies::session::{self, StickyStore};
use attache_proto::v1;
use prost::Message;
use proxy_wasm::hostcalls;
use proxy_wasm::types::BufferType;

use crate::shared::sessions::SharedSticky;

const SERVICE: &str = "attache.v1.SnapshotService";
const METHOD: &str = "Lookup";
/// Added to the host's wait for the call's own timeout.
const SLACK_MS: u64 = 100;

/// Send a new binding to the host at once (fire and forget: the stream's reports carry it
/// too). False if the call could not be made.
pub fn share(cfg: &FleetConfig, envoy: &str, key: u64, endpoint: &str, expires_ms: u64) -> bool {
    let b = v1::Binding { key, endpoint: endpoint.to_owned(), expires_unix_ms: expires_ms };
    let msg = v1::Report { envoy: envoy.to_owned(), bindings: vec![b], ..Default::default() }.encode_to_vec();
    let timeout = Duration::from_millis(1_000);
    hostcalls::dispatch_grpc_call(&cfg.lookup_cluster, SERVICE, "Share", vec![], Some(&msg), timeout).is_ok()
}

/// Ask the host for `key`'s binding. `None`: the call could not be made.
pub fn dispatch(cfg: &FleetConfig, key: u64) -> Option<u32> {
    let wait = u32::try_from(cfg.lookup_wait_ms).unwrap_or(u32::MAX);
    let msg = v1::LookupRequest { keys: vec![key], wait_ms: wait }.encode_to_vec();
    let timeout = Duration::from_millis(cfg.lookup_wait_ms.saturating_add(SLACK_MS));
    hostcalls::dispatch_grpc_call(&cfg.lookup_cluster, SERVICE, METHOD, vec![], Some(&msg), timeout).ok()
}

/// The host's answer: the endpoint bound to `key`, bound here too (unless a later use of the
/// key is bound here already, which then wins). `None`: not found, or the call failed.
pub fn answer(key: u64, status: u32, size: usize, slots: u64) -> Option<String> {
    if status != 0 {
        return None;
    }
    let bytes = hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, size).ok().flatten()?;
    let b = v1::LookupResponse::decode(bytes.as_slice()).ok()?.bindings.into_iter().find(|b| b.key == key)?;
    if b.endpoint.is_empty() {
        return None;
    }
    let slot = key % slots.max(1);
    match SharedSticky.load(slot).filter(|s| s.key == key) {
        Some(held) if held.expires_ms >= b.expires_unix_ms => Some(held.endpoint),
        _ => {
            SharedSticky
                .store(slot, &session::Sticky { key, endpoint: b.endpoint.clone(), expires_ms: b.expires_unix_ms });
            Some(b.endpoint)
        }
    }
}

#[cfg(test)]
mod tests {
    use proxy_wasm::types::Action;

    use super::*;
    use crate::shared::snapshot::heard;
    use crate::testing::harness::{address, publish, snapshot, Exchange, Filter, Request};
    use crate::testing::{metric, now_ms, with};

    fn continuation(prev: &str) -> Request {
        let body = serde_json::json!({"model": crate::testing::harness::MODEL, "input": "go on", "previous_response_id": prev});
        Request::post("/v1/responses", &body.to_string())
    }

    /// The host answers the one pending call with `bindings` (status 0) or fails it.
    fn answer_call(ex: &mut Exchange, status: u32, bindings: Vec<v1::Binding>) {
        let call = with(|h| h.grpc_calls.last().cloned()).expect("a lookup call");
        assert_eq!(
            (call.cluster.as_str(), call.service.as_str(), call.method.as_str()),
            ("attache_host", SERVICE, METHOD)
        );
        let asked = v1::LookupRequest::decode(call.message.as_slice()).expect("a lookup request");
        assert_eq!((asked.keys.len(), asked.wait_ms, call.timeout_ms), (1, 150, 250));
        let bytes = v1::LookupResponse { bindings }.encode_to_vec();
        with(|h| {
            h.grpc_receive = bytes.clone();
            h.current = ex.id;
        });
        ex.http.on_grpc_call_response(call.token, status, bytes.len());
    }

    #[test]
    fn an_unknown_continuation_waits_for_the_host_and_goes_where_the_conversation_is() {
        publish(&snapshot(4));
        heard(now_ms());
        let f = Filter::configure(crate::testing::harness::ENGINE_MODE);
        let key = session::response_key("resp_elsewhere");
        let mut ex = f.send(continuation("resp_elsewhere"));
        assert_eq!(ex.on_body, Some(Action::Pause), "paused for the lookup");
        assert!(ex.primary().is_none());
        let b = v1::Binding { key, endpoint: address(3), expires_unix_ms: now_ms() + 60_000 };
        answer_call(&mut ex, 0, vec![b]);
        assert_eq!((ex.primary(), ex.resumed()), (Some(address(3)), 1));
        assert_eq!(metric("attache.fleet.lookups.found"), Some(1));
        // Bound here now: the next turn needs no lookup.
        let calls = with(|h| h.grpc_calls.len());
        let next = f.send(continuation("resp_elsewhere"));
        assert_eq!((next.on_body, next.primary()), (Some(Action::Continue), Some(address(3))));
        assert_eq!(with(|h| h.grpc_calls.len()), calls);
    }

    #[test]
    fn a_lookup_that_finds_nothing_or_fails_routes_as_a_new_conversation() {
        publish(&snapshot(4));
        heard(now_ms());
        let f = Filter::configure(crate::testing::harness::ENGINE_MODE);
        let mut ex = f.send(continuation("resp_nobody"));
        answer_call(&mut ex, 0, vec![]);
        assert!(ex.primary().is_some() && ex.resumed() == 1);
        let mut ex = f.send(continuation("resp_nobody_2"));
        answer_call(&mut ex, 14, vec![]);
        assert!(ex.primary().is_some() && ex.resumed() == 1);
        assert_eq!(
            (metric("attache.fleet.lookups.missed"), metric("attache.fleet.lookups.failed")),
            (Some(1), Some(1))
        );
        // The host cannot be called at all: routed at once, counted.
        with(|h| h.grpc_unavailable = true);
        let ex = f.send(continuation("resp_nobody_3"));
        assert!(ex.on_body == Some(Action::Continue) && ex.primary().is_some());
        assert_eq!(metric("attache.fleet.lookups.failed"), Some(2));
    }

    #[test]
    fn no_lookup_without_a_fleet_or_with_a_silent_host() {
        publish(&snapshot(4));
        let f = Filter::configure(r#"{"fleet":{"lookup_wait_ms":0},"responses":{"mode":"engine"}}"#);
        heard(now_ms());
        assert_eq!(f.send(continuation("resp_x")).on_body, Some(Action::Continue));
        let f = Filter::configure(crate::testing::harness::ENGINE_MODE);
        crate::testing::advance_ms(10_000);
        assert_eq!(f.send(continuation("resp_y")).on_body, Some(Action::Continue), "the host is silent");
        assert!(with(|h| h.grpc_calls.is_empty()));
    }
}
