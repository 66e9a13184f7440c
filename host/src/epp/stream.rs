//! One ext_proc stream: one HTTP request through the gateway. The request headers are read
//! (and refused, or routed at once when the request is not an inference call); the body is
//! buffered; at its end the request is parsed, admitted and planned, and the picker sends the
//! destination (header and `envoy.lb` metadata) with the body back. On the response it learns
//! the endpoint that served, names it in the session token, learns Responses ids, and passes
//! the body through unchanged.

use std::sync::Arc;
use std::time::Instant;

use attache_policies::error::ErrorShape;
use attache_policies::filters::subset::Subset;
use attache_policies::intake::{self, Head};
use attache_policies::plan::{Plan, PlanRequest, DESTINATION_HEADER, ROUTING_HEADERS};
use attache_policies::request;
use attache_policies::session;
use attache_policies::ErrorResponse;
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{processing_request, ProcessingRequest, ProcessingResponse};
use tracing::debug;

use super::metrics::Outcome;
use super::picker::{Answer, Picker};
use super::wire;

/// Where the request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the request headers.
    Start,
    /// An inference call: buffering its body.
    Buffering,
    /// Routed (a plan, or round robin): the rest passes through.
    Routed,
    /// Answered by the picker: nothing more is sent for the request.
    Answered,
}

/// A planned request, until it ends.
struct Planned {
    plan: Plan,
    /// A Responses API call: learn its id from the response body.
    learn_response: bool,
    /// The endpoint that served, once the gateway said (else the primary).
    served: Option<String>,
    /// Its uncached prompt tokens were released: the answer started, so the engine prefilled.
    prefilled: bool,
    /// Its in-flight count was released.
    released: bool,
}

/// One stream's state.
pub struct Stream {
    picker: Arc<Picker>,
    id: u32,
    phase: Phase,
    /// The gateway streams request bodies (`FULL_DUPLEX_STREAMED`): bodies go back as they came,
    /// and the destination goes with the headers, after the body. Otherwise (buffered modes)
    /// the headers are answered at once and the destination rides on the body's answer.
    duplex: bool,
    response_duplex: bool,
    headers: Vec<(String, String)>,
    head: Head,
    body: Vec<u8>,
    subset: Option<Subset>,
    planned: Option<Planned>,
    outcome: Option<Outcome>,
    /// The request carried an authorized debug header: explain its decision.
    explain: bool,
    /// The explanation, for the response's header.
    explanation: Option<String>,
}

impl Stream {
    pub fn new(picker: Arc<Picker>) -> Self {
        let id = picker.next_id();
        picker.metrics.stream_opened();
        Self {
            picker,
            id,
            phase: Phase::Start,
            duplex: true,
            response_duplex: true,
            headers: Vec::new(),
            head: Head::default(),
            body: Vec::new(),
            subset: None,
            planned: None,
            outcome: None,
            explain: false,
            explanation: None,
        }
    }

    /// Answer one message from the gateway.
    pub async fn on_message(&mut self, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
        use processing_request::Request as R;
        if let Some(pc) = &msg.protocol_config {
            self.duplex = pc.request_body_mode == BodySendMode::FullDuplexStreamed as i32;
            self.response_duplex = pc.response_body_mode == BodySendMode::FullDuplexStreamed as i32;
        }
        let md = msg.metadata_context.as_ref();
        match msg.request {
            Some(R::RequestHeaders(h)) => {
                self.on_request_headers(wire::headers_of(h.headers.as_ref()), h.end_of_stream, md)
            }
            Some(R::RequestBody(b)) => self.on_request_body(b.body, b.end_of_stream, md).await,
            Some(R::RequestTrailers(_)) => {
                let mut out = if self.phase == Phase::Buffering { self.decide(md).await } else { Vec::new() };
                if self.phase != Phase::Answered {
                    out.push(wire::trailers(true));
                }
                out
            }
            Some(R::ResponseHeaders(h)) => {
                let out = self.on_response_headers(&wire::headers_of(h.headers.as_ref()), md);
                if h.end_of_stream {
                    self.release();
                }
                vec![out]
            }
            Some(R::ResponseBody(b)) => {
                self.prefilled();
                self.learn_response_id(&b.body);
                if b.end_of_stream {
                    self.release();
                }
                vec![wire::body(false, self.response_duplex, b.body, b.end_of_stream)]
            }
            Some(R::ResponseTrailers(_)) => {
                self.release();
                vec![wire::trailers(false)]
            }
            None => {
                self.picker.metrics.protocol_error("empty_request");
                Vec::new()
            }
        }
    }

    fn answer(&mut self, a: &Answer) -> Vec<ProcessingResponse> {
        let a = a.clone().shaped(self.head.api.map_or(ErrorShape::OpenAi, attache_policies::Api::error_shape));
        self.phase = Phase::Answered;
        self.outcome = Some(Outcome::Answered);
        self.picker.metrics.answered(a.status, a.reason);
        debug!(id = self.id, status = a.status, reason = a.reason, "answered");
        vec![wire::immediate(a.status, a.reason, &a.body, &a.headers)]
    }

    /// Client-sent routing headers and gateway-only headers, to remove (those the picker sets
    /// are overwritten instead).
    fn removals(&self, setting: &[(&str, String)]) -> Vec<String> {
        // The debug header never goes upstream, whatever its token.
        let debug = self.picker.config().debug.header.as_str();
        ROUTING_HEADERS
            .iter()
            .chain(wire::GATEWAY_HEADERS.iter())
            .copied()
            .chain(std::iter::once(debug))
            .filter(|n| self.headers.iter().any(|(k, _)| k == n) && !setting.iter().any(|(s, _)| s == n))
            .map(str::to_owned)
            .collect()
    }

    fn on_request_headers(
        &mut self,
        headers: Vec<(String, String)>,
        end_of_stream: bool,
        md: Option<&Metadata>,
    ) -> Vec<ProcessingResponse> {
        self.headers = headers;
        self.subset = wire::subset_hint(md).map(Subset::new);
        let header = |n: &str| self.headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
        let debug = &self.picker.config().debug;
        if let Some(token) = header(&debug.header) {
            self.explain = debug.authorized(token);
            if !self.explain && debug.enabled() {
                self.picker.metrics.debug_refused();
            }
        }
        if attache_policies::model_list::is_model_list(header(":method"), header(":path")) {
            if let Some(body) = self.picker.model_list() {
                self.phase = Phase::Answered;
                self.outcome = Some(Outcome::ModelList);
                return vec![wire::ok_json(&body)];
            }
        }
        let head = match self.picker.intake(&self.headers, end_of_stream) {
            Ok(h) => h,
            Err(a) => return self.answer(&a),
        };
        if head.api.is_some() {
            self.head = head;
            self.phase = Phase::Buffering;
            // Buffered modes wait for this answer before they send the body.
            return if self.duplex { Vec::new() } else { vec![wire::request_headers(None, None)] };
        }
        // Not an inference call: any ready endpoint serves it.
        match self.picker.anywhere(self.subset.as_ref()) {
            Ok(endpoint) => {
                self.phase = Phase::Routed;
                self.outcome = Some(Outcome::Passthrough);
                let set = [(DESTINATION_HEADER, endpoint.clone())];
                let remove = self.removals(&set);
                vec![wire::request_headers(wire::mutation(&set, remove), Some(&endpoint))]
            }
            Err(a) => self.answer(&a),
        }
    }

    async fn on_request_body(
        &mut self,
        chunk: Vec<u8>,
        end_of_stream: bool,
        md: Option<&Metadata>,
    ) -> Vec<ProcessingResponse> {
        match self.phase {
            Phase::Answered => Vec::new(),
            Phase::Start | Phase::Routed => {
                if self.phase == Phase::Start {
                    self.picker.metrics.protocol_error("body_before_headers");
                }
                vec![wire::body(true, self.duplex, chunk, end_of_stream)]
            }
            Phase::Buffering => {
                self.body.extend_from_slice(&chunk);
                if let Err(e) = intake::check_size(self.body.len(), self.picker.config().scheduler.max_body_bytes) {
                    return self.answer(&Answer::from(e));
                }
                if !end_of_stream {
                    // Streamed chunks are sent back with the destination; buffered modes send one.
                    return if self.duplex { Vec::new() } else { vec![wire::body(true, false, Vec::new(), false)] };
                }
                self.decide(md).await
            }
        }
    }

    /// The body is complete: parse, resolve the session, admit, plan, and send the destination
    /// and the body.
    async fn decide(&mut self, md: Option<&Metadata>) -> Vec<ProcessingResponse> {
        if let Some(s) = wire::subset_hint(md) {
            self.subset = Some(Subset::new(s));
        }
        let Some(api) = self.head.api else {
            return self.answer(&Answer::from(ErrorResponse::from(&attache_policies::RequestError::EmptyBody)));
        };
        let req = match request::parse(api, &self.body) {
            Ok(r) => r,
            Err(e) => return self.answer(&Answer::from(ErrorResponse::from(&e))),
        };
        self.picker.metrics.api(api);
        let sticky = self.picker.sticky(&self.head, &req);
        let continuing = sticky.is_some() || req.previous_response_id.is_some();
        let priority = match self.picker.admit(self.id, &self.head, &req, self.body.len(), continuing).await {
            Ok(p) => p,
            Err(a) => return self.answer(&a),
        };
        let started = Instant::now();
        let request = PlanRequest {
            id: self.id,
            req: &req,
            body_len: self.body.len(),
            prompt_ids: None,
            sticky: sticky.as_deref(),
            session_key: intake::body_session_key(self.picker.config(), self.head.session_key, &req),
            rollout_session: self.head.rollout_session.as_deref(),
            subset: self.subset.as_ref(),
            now_ms: super::picker::now_ms(),
            sheddable: priority.is_some_and(|p| p < 0),
        };
        let plan = match self.picker.plan(&request) {
            Ok(p) => p,
            Err(a) => return self.answer(&a),
        };
        let out = self.route(&plan);
        self.picker.metrics.decision(started.elapsed().as_secs_f64() * 1e6);
        if self.explain {
            self.explanation = Some(self.picker.explain(&plan, &req.model));
        }
        let learn_response = intake::learns_response(self.picker.config(), api);
        self.planned = Some(Planned { plan, learn_response, served: None, prefilled: false, released: false });
        self.outcome = Some(Outcome::Scheduled);
        out
    }

    /// The destination header and metadata (the same list), the plan's other headers, the
    /// body's length, then the body.
    fn route(&mut self, plan: &Plan) -> Vec<ProcessingResponse> {
        self.phase = Phase::Routed;
        let destination = plan.decision.header_value();
        let mut set: Vec<(&str, String)> = plan.headers.iter().map(|(k, v)| (*k, v.clone())).collect();
        set.push(("content-length", self.body.len().to_string()));
        let remove = self.removals(&set);
        let m = wire::mutation(&set, remove);
        if !self.duplex {
            return vec![wire::request_body_decided(m, &destination)];
        }
        let mut out = vec![wire::request_headers(m, Some(&destination))];
        out.extend(wire::request_body_chunks(std::mem::take(&mut self.body)));
        out
    }

    fn on_response_headers(&mut self, headers: &[(String, String)], md: Option<&Metadata>) -> ProcessingResponse {
        let Some(planned) = self.planned.as_mut() else {
            return wire::response_headers(None);
        };
        let ok = headers.iter().any(|(k, v)| k == ":status" && v == "200");
        let mut token_endpoint = planned.plan.session_token.clone();
        if let Some(served) = wire::served(md) {
            if let Some(corrected) = self.picker.served(&planned.plan, &served) {
                token_endpoint.clone_from(&corrected.session_token);
                planned.plan = corrected;
            }
            planned.served = Some(served);
        }
        planned.learn_response &= ok;
        let config = self.picker.config();
        let name = &config.sessions.token_header;
        let mut set: Vec<(&str, String)> = match token_endpoint {
            Some(ep) if !name.is_empty() => vec![(name.as_str(), session::token_for(&ep))],
            _ => Vec::new(),
        };
        if let Some(x) = self.explanation.take() {
            set.push((config.debug.response_header.as_str(), x));
        }
        wire::response_headers(wire::mutation(&set, Vec::new()))
    }

    /// Learn `previous_response_id` → endpoint from the first bytes of a Responses body.
    fn learn_response_id(&mut self, chunk: &[u8]) {
        let Some(p) = self.planned.as_mut().filter(|p| p.learn_response) else { return };
        p.learn_response = false;
        if let Some(id) = session::response_id(&chunk[..chunk.len().min(4096)]) {
            let served = p.served.clone().unwrap_or_else(|| p.plan.dispatch.endpoint.clone());
            self.picker.learn_response(&id, &served);
        }
    }
}

impl Stream {
    /// The response ended (its last body chunk or its trailers passed), or the stream did:
    /// release the request's in-flight count, once.
    fn release(&mut self) {
        if let Some(p) = self.planned.as_mut().filter(|p| !p.released) {
            p.released = true;
            let tokens = if p.prefilled { 0 } else { p.plan.dispatch.uncached_tokens };
            self.picker.release(self.head.api, &p.plan.dispatch.endpoint, tokens);
        }
    }

    /// The answer's first bytes passed: the engine has prefilled the prompt, so its uncached
    /// tokens no longer queue ahead of the next request's. Once; the request stays in flight.
    fn prefilled(&mut self) {
        if let Some(p) = self.planned.as_mut().filter(|p| !p.prefilled && !p.released) {
            p.prefilled = true;
            self.picker.prefilled(&p.plan.dispatch.endpoint, p.plan.dispatch.uncached_tokens);
        }
    }
}

impl Drop for Stream {
    /// The stream ended (the request completed, or the gateway or client went away): release
    /// its in-flight count, drop it from the flow-control queue, count its outcome.
    fn drop(&mut self) {
        self.release();
        if self.phase == Phase::Buffering {
            self.picker.abandon(self.id);
            self.outcome = Some(Outcome::Abandoned);
        }
        self.picker.metrics.stream_closed(self.outcome.or(Some(Outcome::Abandoned)));
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use attache_kv::KvIndex;
    use attache_policies::plugin_config::FilterConfig;
    use attache_proto::v1;
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        body_mutation, processing_response, HttpBody, HttpHeaders, ProtocolConfiguration,
    };
    use envoy_types::pb::google::protobuf::{value, ListValue, Struct, Value};
    use tokio::sync::watch;

    use super::*;
    use crate::epp::metrics::EppMetrics;

    fn snapshot(n: usize) -> v1::Snapshot {
        let endpoints = (0..n)
            .map(|i| v1::Endpoint {
                id: i as u32,
                address: format!("10.0.0.{i}:8000"),
                models: vec!["m".into()],
                ready: true,
                has_metrics: true,
                block_size: 16,
                ..Default::default()
            })
            .collect();
        v1::Snapshot { version: 1, host_epoch: 1, endpoints, saturation: Some(0.0), ..Default::default() }
    }

    fn picker_with(
        cfg: FilterConfig,
        snap: v1::Snapshot,
    ) -> (Arc<Picker>, watch::Sender<Arc<crate::push::PublishedSnapshot>>) {
        let (tx, rx) = watch::channel(Arc::new(snap.into()));
        let kv = Arc::new(std::sync::Mutex::new(KvIndex::new(1024)));
        let p = Picker::new(cfg, rx, kv, Arc::new(EppMetrics::default())).unwrap();
        (Arc::new(p), tx)
    }

    fn picker(n: usize) -> Arc<Picker> {
        let mut cfg = FilterConfig::default();
        cfg.scheduler.max_endpoints = 2;
        picker_with(cfg, snapshot(n)).0
    }

    fn headers_msg(method: &str, path: &str, extra: &[(&str, &str)], eos: bool) -> ProcessingRequest {
        let mut headers = vec![
            HeaderValue { key: ":method".into(), raw_value: method.into(), ..Default::default() },
            HeaderValue { key: ":path".into(), raw_value: path.into(), ..Default::default() },
        ];
        for (k, v) in extra {
            headers.push(HeaderValue { key: (*k).into(), raw_value: v.as_bytes().to_vec(), ..Default::default() });
        }
        let h = HttpHeaders { headers: Some(HeaderMap { headers }), end_of_stream: eos, ..Default::default() };
        ProcessingRequest { request: Some(processing_request::Request::RequestHeaders(h)), ..Default::default() }
    }

    fn body_msg(body: &[u8], eos: bool) -> ProcessingRequest {
        let b = HttpBody { body: body.to_vec(), end_of_stream: eos, ..Default::default() };
        ProcessingRequest { request: Some(processing_request::Request::RequestBody(b)), ..Default::default() }
    }

    fn with_subset(mut m: ProcessingRequest, list: &[&str]) -> ProcessingRequest {
        let values = list.iter().map(|s| Value { kind: Some(value::Kind::StringValue((*s).into())) }).collect();
        let v = Value { kind: Some(value::Kind::ListValue(ListValue { values })) };
        let inner = Struct { fields: HashMap::from([(wire::SUBSET_KEY.to_owned(), v)]) };
        m.metadata_context = Some(Metadata {
            filter_metadata: HashMap::from([(wire::SUBSET_NAMESPACE.to_owned(), inner)]),
            ..Default::default()
        });
        m
    }

    /// What one request got: its destination (header and metadata), the headers removed, the
    /// body sent back, or the status of an immediate answer.
    #[derive(Debug, Default)]
    struct Got {
        header: Option<String>,
        metadata: Option<String>,
        removed: Vec<String>,
        content_length: Option<String>,
        body: Vec<u8>,
        status: Option<i32>,
    }

    fn read(out: &[ProcessingResponse]) -> Got {
        use processing_response::Response as R;
        let mut g = Got::default();
        for r in out {
            if let Some(md) = &r.dynamic_metadata {
                if let Some(value::Kind::StructValue(lb)) = &md.fields[wire::LB_NAMESPACE].kind {
                    if let Some(value::Kind::StringValue(s)) = &lb.fields[wire::DESTINATION_KEY].kind {
                        g.metadata = Some(s.clone());
                    }
                }
            }
            let common = match &r.response {
                Some(R::RequestHeaders(h)) | Some(R::ResponseHeaders(h)) => h.response.as_ref(),
                Some(R::RequestBody(b)) | Some(R::ResponseBody(b)) => b.response.as_ref(),
                Some(R::ImmediateResponse(i)) => {
                    g.status = i.status.as_ref().map(|s| s.code);
                    None
                }
                _ => None,
            };
            let Some(c) = common else { continue };
            if let Some(m) = &c.header_mutation {
                for h in m.set_headers.iter().filter_map(|h| h.header.as_ref()) {
                    let v = String::from_utf8_lossy(&h.raw_value).into_owned();
                    match h.key.as_str() {
                        DESTINATION_HEADER => g.header = Some(v),
                        "content-length" => g.content_length = Some(v),
                        _ => {}
                    }
                }
                g.removed.extend(m.remove_headers.iter().cloned());
            }
            if let Some(body_mutation::Mutation::StreamedResponse(s)) =
                c.body_mutation.as_ref().and_then(|b| b.mutation.as_ref())
            {
                g.body.extend_from_slice(&s.body);
            }
        }
        g
    }

    async fn send(p: &Arc<Picker>, msgs: Vec<ProcessingRequest>) -> (Got, Stream) {
        let mut s = Stream::new(p.clone());
        let mut out = Vec::new();
        for m in msgs {
            out.extend(s.on_message(m).await);
        }
        (read(&out), s)
    }

    fn chat(prompt: &str) -> Vec<u8> {
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{prompt}"}}]}}"#).into_bytes()
    }

    async fn route(p: &Arc<Picker>, body: &[u8]) -> Got {
        let h = headers_msg("POST", "/v1/chat/completions", &[], false);
        send(p, vec![h, body_msg(body, true)]).await.0
    }

    #[tokio::test]
    async fn the_destination_goes_as_header_and_metadata_with_the_body_back() {
        let p = picker(3);
        let body = chat("hello there");
        let h = headers_msg(
            "POST",
            "/v1/chat/completions",
            &[(DESTINATION_HEADER, "6.6.6.6:1"), (wire::SERVED_KEY, "x")],
            false,
        );
        let (first, second) = body.split_at(10);
        let (g, _s) = send(&p, vec![h, body_msg(first, false), body_msg(second, true)]).await;
        let dest = g.header.clone().unwrap();
        assert_eq!(g.metadata.as_deref(), Some(dest.as_str()), "header and metadata agree");
        assert_eq!(dest.split(',').count(), 2, "primary and a fallback: {dest}");
        assert!(!dest.contains("6.6.6.6"), "a client's destination is never honoured");
        assert_eq!(g.removed, vec![wire::SERVED_KEY.to_owned()], "the destination is overwritten, -served removed");
        assert_eq!(g.body, body);
        assert_eq!(g.content_length, Some(body.len().to_string()));
        assert_eq!(p.metrics.decisions(), 1);
        let (inflight, _) = p.load();
        assert_eq!(inflight.values().sum::<u32>(), 1);
        drop(_s);
        assert_eq!(p.load().0.values().sum::<u32>(), 0, "released when the stream ends");
    }

    #[tokio::test]
    async fn shared_prefixes_stick_and_refusals_are_answers() {
        let p = picker(4);
        let prompt = "a long shared system prompt ".repeat(40);
        let first = route(&p, &chat(&format!("{prompt} one"))).await.header.unwrap();
        for i in 0..5 {
            let again = route(&p, &chat(&format!("{prompt} turn {i}"))).await.header.unwrap();
            assert_eq!(again.split(',').next(), first.split(',').next(), "turn {i}");
        }
        assert_eq!(route(&p, b"{not json").await.status, Some(400));
        assert_eq!(
            route(&p, br#"{"model":"nope","messages":[{"role":"user","content":"x"}]}"#).await.status,
            Some(404)
        );
        let big = headers_msg("POST", "/v1/chat/completions", &[("content-length", "99999999")], false);
        assert_eq!(send(&p, vec![big]).await.0.status, Some(413));
        let huge = vec![b' '; p.config().scheduler.max_body_bytes + 1];
        assert_eq!(route(&p, &huge).await.status, Some(413), "a body over the limit without a length");
        let empty = picker_with(FilterConfig::default(), v1::Snapshot { version: 1, ..Default::default() }).0;
        assert_eq!(route(&empty, &chat("x")).await.status, Some(503));
        assert_eq!(send(&empty, vec![headers_msg("GET", "/v1/models", &[], true)]).await.0.status, Some(503));
    }

    #[tokio::test]
    async fn a_subset_hint_restricts_and_an_empty_one_is_503() {
        let p = picker(4);
        for i in 0..8 {
            let h =
                with_subset(headers_msg("POST", "/v1/chat/completions", &[], false), &["10.0.0.2:8000", "10.0.0.3"]);
            let g = send(&p, vec![h, body_msg(&chat(&format!("q{i}")), true)]).await.0;
            let dest = g.header.unwrap();
            assert!(dest.split(',').all(|e| e == "10.0.0.2:8000" || e == "10.0.0.3:8000"), "{dest}");
        }
        let h = with_subset(headers_msg("POST", "/v1/chat/completions", &[], false), &[]);
        assert_eq!(send(&p, vec![h, body_msg(&chat("x"), true)]).await.0.status, Some(503));
        let g = with_subset(headers_msg("GET", "/health", &[], true), &["10.0.0.1:8000"]);
        assert_eq!(send(&p, vec![g]).await.0.header.as_deref(), Some("10.0.0.1:8000"));
    }

    #[tokio::test]
    async fn other_requests_go_round_robin_and_buffered_gateways_get_the_decision_on_the_body() {
        let p = picker(2);
        let a = send(&p, vec![headers_msg("GET", "/version", &[], true)]).await.0.header.unwrap();
        let b = send(&p, vec![headers_msg("GET", "/health", &[], true)]).await.0.header.unwrap();
        assert_ne!(a, b);
        // The model list is the picker's own answer, from the snapshot.
        let list = send(&p, vec![headers_msg("GET", "/v1/models", &[], true)]).await.0;
        assert_eq!((list.status, list.header), (Some(200), None));
        let mut h = headers_msg("POST", "/v1/chat/completions", &[], false);
        h.protocol_config = Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            response_body_mode: BodySendMode::None as i32,
            ..Default::default()
        });
        let mut s = Stream::new(p.clone());
        let at_headers = s.on_message(h).await;
        assert_eq!(at_headers.len(), 1);
        assert!(read(&at_headers).header.is_none(), "buffered: headers continue at once");
        let g = read(&s.on_message(body_msg(&chat("hi"), true)).await);
        assert!(g.header.is_some() && g.header == g.metadata, "{g:?}");
        assert!(g.body.is_empty(), "a buffered body continues unchanged");
    }

    #[tokio::test]
    async fn a_fallback_that_served_is_learned() {
        let p = picker(4);
        let prompt = "a prompt the primary never got ".repeat(40);
        let (g, mut s) =
            send(&p, vec![headers_msg("POST", "/v1/chat/completions", &[], false), body_msg(&chat(&prompt), true)])
                .await;
        let dest = g.header.unwrap();
        let primary = dest.split(',').next().unwrap().to_owned();
        let other = (0..4).map(|i| format!("10.0.0.{i}:8000")).find(|a| *a != primary).unwrap();
        let inner = Struct {
            fields: HashMap::from([(
                wire::SERVED_KEY.to_owned(),
                Value { kind: Some(value::Kind::StringValue(other.clone())) },
            )]),
        };
        let md =
            Metadata { filter_metadata: HashMap::from([(wire::LB_NAMESPACE.to_owned(), inner)]), ..Default::default() };
        let resp = HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![HeaderValue { key: ":status".into(), raw_value: b"200".to_vec(), ..Default::default() }],
            }),
            ..Default::default()
        };
        let msg = ProcessingRequest {
            request: Some(processing_request::Request::ResponseHeaders(resp)),
            metadata_context: Some(md),
            ..Default::default()
        };
        let out = s.on_message(msg).await;
        let Some(processing_response::Response::ResponseHeaders(h)) = &out[0].response else { panic!("{out:?}") };
        let token =
            h.response.as_ref().unwrap().header_mutation.as_ref().unwrap().set_headers[0].header.clone().unwrap();
        assert_eq!(
            String::from_utf8(token.raw_value).unwrap(),
            session::token_for(&other),
            "the token names who served"
        );
        assert_eq!(p.load().0, [(other.clone(), 1)].into(), "in flight moved to the endpoint that served");
        assert!(p.queued_tokens(&other) > 0 && p.queued_tokens(&primary) == 0, "its prompt queues there too");
        let first = HttpBody { body: b"data: {}\n\n".to_vec(), end_of_stream: false, ..Default::default() };
        s.on_message(ProcessingRequest {
            request: Some(processing_request::Request::ResponseBody(first)),
            ..Default::default()
        })
        .await;
        assert_eq!(p.queued_tokens(&other), 0, "the answer started: the engine prefilled it");
        assert_eq!(p.load().0, [(other.clone(), 1)].into(), "the request stays in flight");
        let last = HttpBody { body: b"data: [DONE]\n\n".to_vec(), end_of_stream: true, ..Default::default() };
        let out = s
            .on_message(ProcessingRequest {
                request: Some(processing_request::Request::ResponseBody(last)),
                ..Default::default()
            })
            .await;
        assert!(matches!(&out[0].response, Some(processing_response::Response::ResponseBody(_))));
        assert!(p.load().0.is_empty(), "released when the response ends, before the stream closes");
        drop(s);
        assert!(p.load().0.is_empty(), "released once");
        let next = route(&p, &chat(&prompt)).await.header.unwrap();
        assert_eq!(next.split(',').next(), Some(other.as_str()), "the next request follows the cache, not the primary");
    }

    #[tokio::test]
    async fn sheddable_requests_on_a_saturated_pool_get_429_with_retry_after() {
        let mut cfg = FilterConfig::default();
        cfg.flow.enabled = true;
        let snap =
            v1::Snapshot { saturation: Some(2.0), observed_unix_ms: super::super::picker::now_ms(), ..snapshot(2) };
        let (p, _tx) = picker_with(cfg, snap);
        let h = headers_msg("POST", "/v1/chat/completions", &[], false);
        let body = br#"{"model":"m","priority":-1,"messages":[{"role":"user","content":"x"}]}"#;
        let mut s = Stream::new(p.clone());
        s.on_message(h).await;
        let out = s.on_message(body_msg(body, true)).await;
        let Some(processing_response::Response::ImmediateResponse(i)) = &out[0].response else { panic!("{out:?}") };
        assert_eq!(i.status.as_ref().unwrap().code, 429);
        let names: Vec<&str> =
            i.headers.as_ref().unwrap().set_headers.iter().map(|h| h.header.as_ref().unwrap().key.as_str()).collect();
        assert!(names.contains(&"retry-after"), "{names:?}");
        let body: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
        assert_eq!(body["error"]["code"], 429);
    }
}
