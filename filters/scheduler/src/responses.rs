//! Responses API state in the gateway (policies::responses, `docs/responses.md`): the host
//! calls the scheduler makes for it.
//!
//! - [`serve`]: `GET`/`DELETE /v1/responses/{id}`, `input_items` and `cancel` are answered
//!   from the host's store; the request pauses for the answer.
//! - [`resolve`]: a continuation whose conversation this worker has not seen asks the host.
//! - [`store`]: a captured response goes to the host from the worker's root context, so the
//!   call outlives the request.
//! - [`submit`]: a `background: true` request is handed to the host, which queues it for the
//!   async worker and answers the queued response object.

use std::time::Duration;

use attache_policies::intake::StoreRoute;
use attache_policies::responses::ResponsesConfig;
use attache_proto::v1;
use prost::Message;
use proxy_wasm::hostcalls;
use proxy_wasm::types::BufferType;

use crate::hostcalls as host;

const SERVICE: &str = "attache.v1.ResponsesService";
/// Added to a call's own wait for its timeout.
const SLACK_MS: u64 = 200;

/// Ask the host to answer a store route. `None`: the call could not be made.
pub fn serve(cfg: &ResponsesConfig, route: &StoreRoute) -> Option<u32> {
    let msg = v1::ServeRequest { tenant: route.tenant.clone(), method: route.method.clone(), path: route.path.clone() }
        .encode_to_vec();
    let timeout = Duration::from_millis(1_000 + SLACK_MS);
    hostcalls::dispatch_grpc_call(&cfg.cluster, SERVICE, "Serve", vec![], Some(&msg), timeout).ok()
}

/// The host's answer to [`serve`]; `None` if the call failed.
pub fn served(status: u32, size: usize) -> Option<(u16, String)> {
    let reply: v1::ServeReply = reply(status, size)?;
    Some((u16::try_from(reply.status).ok()?, reply.body))
}

/// Ask the host for the conversation ending with `id`'s output.
pub fn resolve(cfg: &ResponsesConfig, tenant: &str, id: &str) -> Option<u32> {
    let wait = u32::try_from(cfg.resolve_wait_ms).unwrap_or(u32::MAX);
    let msg = v1::ResolveRequest { tenant: tenant.to_owned(), id: id.to_owned(), wait_ms: wait }.encode_to_vec();
    let timeout = Duration::from_millis(cfg.resolve_wait_ms.saturating_add(SLACK_MS));
    hostcalls::dispatch_grpc_call(&cfg.cluster, SERVICE, "Resolve", vec![], Some(&msg), timeout).ok()
}

/// Hand a background request to the host; its answer comes back as [`served`]'s.
pub fn submit(cfg: &ResponsesConfig, req: &v1::SubmitRequest) -> Option<u32> {
    let msg = req.encode_to_vec();
    let timeout = Duration::from_millis(2_000 + SLACK_MS);
    hostcalls::dispatch_grpc_call(&cfg.cluster, SERVICE, "Submit", vec![], Some(&msg), timeout).ok()
}

/// What [`resolve`] found.
pub enum Resolution {
    /// The conversation's items, a JSON array.
    Found(String),
    NotFound,
    Evicted,
    /// A background response still queued or running.
    Pending,
    /// The host could not be asked or did not answer.
    Failed,
}

pub fn resolved(status: u32, size: usize) -> Resolution {
    let Some(r) = reply::<v1::ResolveReply>(status, size) else { return Resolution::Failed };
    match r.outcome() {
        v1::resolve_reply::Outcome::Found => Resolution::Found(r.items),
        v1::resolve_reply::Outcome::NotFound => Resolution::NotFound,
        v1::resolve_reply::Outcome::Evicted => Resolution::Evicted,
        v1::resolve_reply::Outcome::Pending => Resolution::Pending,
        v1::resolve_reply::Outcome::Unspecified | v1::resolve_reply::Outcome::Unavailable => Resolution::Failed,
    }
}

/// Send a captured response to the host, from `root`'s context (the request's may end before
/// the answer). False if the call could not be made.
pub fn store(cfg: &ResponsesConfig, root: u32, current: u32, req: &v1::StoreRequest) -> bool {
    let msg = req.encode_to_vec();
    let switched = root != 0 && host::set_effective_context(root);
    let sent =
        hostcalls::dispatch_grpc_call(&cfg.cluster, SERVICE, "Store", vec![], Some(&msg), Duration::from_secs(5))
            .is_ok();
    if switched {
        host::set_effective_context(current);
    }
    sent
}

fn reply<M: Message + Default>(status: u32, size: usize) -> Option<M> {
    if status != 0 {
        return None;
    }
    let bytes = hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, size).ok().flatten().unwrap_or_default();
    M::decode(bytes.as_slice()).ok()
}

/// A stored response being captured from its answer.
#[derive(Debug, Default)]
pub struct Capture {
    pub tenant: String,
    pub previous_id: String,
    /// This turn's input items (a JSON array).
    pub turn: String,
    /// The conversation the engine was sent (a JSON array), for this worker's cache.
    pub conversation: String,
    pub streamed: bool,
    /// The answer so far.
    pub body: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use proxy_wasm::types::Action;
    use serde_json::{json, Value};

    use super::*;
    use crate::shared::snapshot::heard;
    use crate::testing::harness::{publish, snapshot, Exchange, Filter, Request, MODEL};
    use crate::testing::{metric, now_ms, with, GrpcCall};

    fn calls(method: &str) -> Vec<GrpcCall> {
        with(|h| h.grpc_calls.iter().filter(|c| c.service == SERVICE && c.method == method).cloned().collect())
    }

    fn turn(input: Value, prev: Option<&str>, tenant: &str) -> Request {
        let mut body = json!({"model": MODEL, "input": input});
        if let Some(p) = prev {
            body["previous_response_id"] = json!(p);
        }
        Request::post("/v1/responses", &body.to_string()).header("x-attache-tenant", tenant)
    }

    fn answer(id: &str, text: &str) -> String {
        json!({"id": id, "object": "response", "status": "completed", "model": MODEL,
               "output": [{"type": "message", "id": format!("msg_{id}"), "role": "assistant", "status": "completed",
                           "content": [{"type": "output_text", "text": text, "annotations": []}]}]})
        .to_string()
    }

    /// The host answers the pending call `call` with `reply` (status 0) or fails it.
    fn reply_to(ex: &mut Exchange, call: &GrpcCall, status: u32, reply: &impl Message) {
        let bytes = reply.encode_to_vec();
        with(|h| {
            h.grpc_receive = bytes.clone();
            h.current = ex.id;
        });
        ex.http.on_grpc_call_response(call.token, status, bytes.len());
    }

    fn input_of(ex: &Exchange) -> Vec<Value> {
        let body: Value = serde_json::from_slice(&ex.upstream_body()).expect("JSON upstream");
        assert!(body.get("previous_response_id").is_none(), "{body}");
        body["input"].as_array().cloned().expect("an input list")
    }

    #[test]
    fn a_stored_answer_goes_to_the_host_and_the_next_turn_through_this_worker_resolves_here() {
        publish(&snapshot(3));
        heard(now_ms());
        let f = Filter::configure("");
        let mut first = f.send(turn(json!("hello"), None, "acme"));
        assert_eq!(first.on_body, Some(Action::Continue));
        let first_home = first.primary();
        assert!(first_home.is_some());
        first.respond(200, &[("content-type", "application/json")]);
        first.respond_body(&answer("resp_1", "hi there"));
        first.finish();
        let stored = calls("Store");
        assert_eq!(stored.len(), 1);
        let s = v1::StoreRequest::decode(stored[0].message.as_slice()).unwrap();
        assert_eq!((s.id.as_str(), s.previous_id.as_str()), ("resp_1", ""));
        assert!(s.tenant.starts_with("t-") && !s.tenant.contains("acme"), "a digest: {}", s.tenant);
        assert_eq!(
            serde_json::from_str::<Value>(&s.input_items).unwrap(),
            json!([{"role": "user", "content": "hello"}])
        );
        assert_eq!(metric("attache.responses.captured"), Some(1));

        // The next turn: rewritten here into the whole conversation, no call to the host.
        let second = f.send(turn(json!("and then?"), Some("resp_1"), "acme"));
        assert_eq!(second.on_body, Some(Action::Continue));
        assert!(calls("Resolve").is_empty());
        let input = input_of(&second);
        assert_eq!(input.len(), 3);
        assert_eq!(input[1]["content"][0]["text"], "hi there");
        assert_eq!(input[2], json!({"role": "user", "content": "and then?"}));
        let len = second.request_header("content-length").unwrap();
        assert_eq!(len, second.upstream_body().len().to_string());
        assert_eq!(second.primary(), first_home, "the chain is a session: it stays on its engine");
        assert_eq!(
            (metric("attache.responses.resolved.local"), metric("attache.responses.rewrites")),
            (Some(1), Some(1))
        );

        // Another tenant's request for the same id is not served from this worker's cache.
        let other = f.send(turn(json!("x"), Some("resp_1"), "intruder"));
        assert_eq!(other.on_body, Some(Action::Pause), "asks the host, which knows the tenant");
        assert_eq!(calls("Resolve").len(), 1);
    }

    #[test]
    fn a_continuation_waits_for_the_host_and_is_refused_clearly_when_the_id_is_unknown() {
        publish(&snapshot(3));
        heard(now_ms());
        let f = Filter::configure("");
        let mut ex = f.send(turn(json!("next"), Some("resp_elsewhere"), "acme"));
        assert_eq!(ex.on_body, Some(Action::Pause));
        let call = calls("Resolve").pop().unwrap();
        let asked = v1::ResolveRequest::decode(call.message.as_slice()).unwrap();
        assert_eq!((asked.id.as_str(), asked.wait_ms), ("resp_elsewhere", 500));
        let history = json!([{"role": "user", "content": "first"}]).to_string();
        let found = v1::ResolveReply { outcome: v1::resolve_reply::Outcome::Found.into(), items: history };
        reply_to(&mut ex, &call, 0, &found);
        assert_eq!(ex.resumed(), 1);
        assert_eq!(input_of(&ex).len(), 2);
        assert!(ex.primary().is_some());
        assert_eq!(metric("attache.responses.resolved.host"), Some(1));

        for (outcome, status, reason) in [
            (v1::resolve_reply::Outcome::NotFound, 0, "previous_response_not_found"),
            (v1::resolve_reply::Outcome::Evicted, 0, "previous_response_not_found"),
            (v1::resolve_reply::Outcome::Found, 14, "responses_store_unavailable"),
        ] {
            let mut ex = f.send(turn(json!("next"), Some("resp_gone"), "acme"));
            let call = calls("Resolve").pop().unwrap();
            reply_to(&mut ex, &call, status, &v1::ResolveReply { outcome: outcome.into(), items: String::new() });
            let r = ex.refused();
            assert_eq!(r.header(attache_policies::intake::ERROR_HEADER), Some(reason));
            let body: Value = serde_json::from_slice(&r.body).unwrap();
            if status == 0 {
                assert_eq!((r.status, body["error"]["param"].as_str()), (404, Some("previous_response_id")));
                let evicted = outcome == v1::resolve_reply::Outcome::Evicted;
                assert_eq!(body["error"]["message"].as_str().unwrap().contains("evicted"), evicted, "{body}");
            } else {
                assert_eq!(r.status, 503);
            }
        }
        assert_eq!(metric("attache.responses.resolved.evicted"), Some(1));
        assert_eq!(metric("attache.responses.resolved.failed"), Some(1));
        // The host cannot be called at all: 503 at once, counted.
        with(|h| h.grpc_unavailable = true);
        let ex = f.send(turn(json!("next"), Some("resp_z"), "acme"));
        assert_eq!(ex.refused().status, 503);
        assert_eq!(metric("attache.responses.resolved.failed"), Some(2));
    }

    #[test]
    fn a_streamed_answer_is_captured_from_its_completed_event_without_holding_the_stream() {
        publish(&snapshot(3));
        heard(now_ms());
        let f = Filter::configure("");
        let mut req = json!({"model": MODEL, "input": [{"role": "user", "content": "stream it"}], "stream": true});
        let mut ex = f.send(Request::post("/v1/responses", &req.to_string()));
        ex.respond(200, &[("content-type", "text/event-stream")]);
        let created = json!({"type": "response.created", "sequence_number": 0,
                             "response": {"id": "resp_s", "status": "in_progress", "output": []}});
        let done = json!({"type": "response.completed", "sequence_number": 9, "response": serde_json::from_str::<Value>(&answer("resp_s", "streamed")).unwrap()});
        let events = format!("event: response.created\ndata: {created}\n\nevent: response.completed\ndata: {done}\n\n");
        let (a, b) = events.split_at(events.len() / 2);
        assert_eq!(ex.respond_chunk(a, false), Action::Continue);
        assert!(calls("Store").is_empty());
        assert_eq!(ex.respond_chunk(b, false), Action::Continue);
        assert_eq!(ex.respond_chunk("", true), Action::Continue);
        let s = v1::StoreRequest::decode(calls("Store")[0].message.as_slice()).unwrap();
        assert_eq!(s.id, "resp_s");
        assert_eq!(s.tenant, "", "no tenant header or key: the anonymous tenant");
        ex.finish();
        assert_eq!(calls("Store").len(), 1, "stored once");

        // `store: false` stores nothing; a failed answer neither.
        req["store"] = json!(false);
        let mut ex = f.send(Request::post("/v1/responses", &req.to_string()));
        ex.respond(200, &[]);
        ex.respond_body(&answer("resp_n", "x"));
        ex.finish();
        let mut ex = f.send(turn(json!("x"), None, "acme"));
        ex.respond(500, &[]);
        ex.respond_body(r#"{"error":{}}"#);
        ex.finish();
        assert_eq!(calls("Store").len(), 1);
    }

    #[test]
    fn a_background_request_is_queued_by_the_host_with_its_conversation_resolved() {
        publish(&snapshot(3));
        heard(now_ms());
        let f = Filter::configure("");
        let mut first = f.send(turn(json!("hello"), None, "acme"));
        first.respond(200, &[]);
        first.respond_body(&answer("resp_1", "hi there"));
        first.finish();

        let body =
            json!({"model": MODEL, "input": "summarise it", "previous_response_id": "resp_1", "background": true});
        let mut ex = f.send(Request::post("/v1/responses", &body.to_string()).header("x-attache-tenant", "acme"));
        assert_eq!(ex.on_body, Some(Action::Pause), "answered by the host, not routed");
        assert!(ex.primary().is_none());
        let call = calls("Submit").pop().expect("submitted");
        let asked = v1::SubmitRequest::decode(call.message.as_slice()).unwrap();
        assert_eq!(asked.previous_id, "resp_1");
        assert!(asked.tenant.starts_with("t-"));
        assert_eq!(
            serde_json::from_str::<Value>(&asked.input_items).unwrap(),
            json!([{"role": "user", "content": "summarise it"}])
        );
        let run: Value = serde_json::from_str(&asked.request).unwrap();
        assert!(run.get("previous_response_id").is_none());
        assert_eq!(run["input"].as_array().map(Vec::len), Some(3), "the whole conversation: {run}");
        let queued =
            json!({"id": "resp_bg", "object": "response", "status": "queued", "background": true, "output": []});
        reply_to(&mut ex, &call, 0, &v1::ServeReply { status: 200, body: queued.to_string() });
        let r = ex.refused();
        assert_eq!(r.status, 200);
        assert_eq!(serde_json::from_slice::<Value>(&r.body).unwrap()["status"], "queued");
        assert_eq!(metric("attache.responses.background"), Some(1));
        assert!(calls("Store").len() == 1, "the queued answer is not captured as a response");

        // Refused before anything is asked: no store, or streamed.
        for (extra, reason) in [
            (json!({"store": false}), "background_needs_store"),
            (json!({"stream": true}), "background_stream_unsupported"),
        ] {
            let mut b = json!({"model": MODEL, "input": "x", "background": true});
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            let r = f.send(Request::post("/v1/responses", &b.to_string())).refused();
            assert_eq!((r.status, r.header(attache_policies::intake::ERROR_HEADER)), (400, Some(reason)));
        }
        assert_eq!(calls("Submit").len(), 1);

        // A continuation of a background response that has not ended: 400, said so.
        let mut ex = f.send(turn(json!("next"), Some("resp_bg"), "acme"));
        let call = calls("Resolve").pop().unwrap();
        let pending = v1::ResolveReply { outcome: v1::resolve_reply::Outcome::Pending.into(), items: String::new() };
        reply_to(&mut ex, &call, 0, &pending);
        let r = ex.refused();
        assert_eq!(
            (r.status, r.header(attache_policies::intake::ERROR_HEADER)),
            (400, Some("previous_response_pending"))
        );
    }

    #[test]
    fn the_apis_own_routes_are_answered_from_the_host() {
        publish(&snapshot(3));
        heard(now_ms());
        let f = Filter::configure("");
        let mut ex =
            f.send(Request::get("/v1/responses/resp_1/input_items?limit=2").header("authorization", "Bearer k"));
        assert_eq!(ex.on_headers, Action::Pause);
        let call = calls("Serve").pop().unwrap();
        let asked = v1::ServeRequest::decode(call.message.as_slice()).unwrap();
        assert_eq!((asked.method.as_str(), asked.path.as_str()), ("GET", "/v1/responses/resp_1/input_items?limit=2"));
        assert!(asked.tenant.starts_with("key-"));
        let reply = v1::ServeReply {
            status: 404,
            body: r#"{"error":{"message":"Response with id 'resp_1' not found."}}"#.into(),
        };
        reply_to(&mut ex, &call, 0, &reply);
        let r = ex.refused();
        assert_eq!(r.status, 404);
        assert_eq!(metric("attache.responses.served"), Some(1));
        // Not the store's: passed through.
        let other = f.send(Request::get("/v1/responses/resp_1/other"));
        assert_eq!(other.on_headers, Action::Continue);
        // The host cannot be called: 503.
        with(|h| h.grpc_unavailable = true);
        let ex = f.send(Request::get("/v1/responses/resp_1"));
        assert_eq!(ex.refused().status, 503);
    }
}
