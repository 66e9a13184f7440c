//! Builders for role tests: snapshots of N endpoints, configured roots, requests, and the
//! exchange of one request through the real HTTP context, callback by callback.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use attache_policies::plan::DESTINATION_HEADER;
use attache_proto::v1;
use proxy_wasm::traits::{HttpContext, RootContext};
use proxy_wasm::types::Action;

use super::{now_ms, with, LocalResponse, Stream};
use crate::root::AttacheRoot;
use crate::worker::Worker;

/// The model every test endpoint serves.
pub const MODEL: &str = "m";
/// A filter configuration with the engines keeping Responses state (`responses.mode: engine`).
pub const ENGINE_MODE: &str = r#"{"responses":{"mode":"engine"}}"#;

/// The address of test endpoint `i`.
pub fn address(i: usize) -> String {
    format!("10.0.0.{i}:8000")
}

/// Endpoint `i`: ready, idle, fresh metrics, serving [`MODEL`].
pub fn endpoint(i: usize) -> v1::Endpoint {
    v1::Endpoint {
        id: i as u32,
        address: address(i),
        models: vec![MODEL.into()],
        block_size: 16,
        ready: true,
        has_metrics: true,
        ..Default::default()
    }
}

/// A snapshot of `n` ready, idle endpoints, observed now.
pub fn snapshot(n: usize) -> v1::Snapshot {
    v1::Snapshot {
        version: 1,
        host_epoch: 1,
        endpoints: (0..n).map(endpoint).collect(),
        observed_unix_ms: now_ms(),
        ..Default::default()
    }
}

/// Write `s` into shared data, as the agent does.
pub fn publish(s: &v1::Snapshot) {
    assert!(crate::shared::snapshot::publish(s), "snapshot written");
}

/// A completions body for [`MODEL`].
pub fn prompt(text: &str) -> String {
    serde_json::json!({ "model": MODEL, "prompt": text }).to_string()
}

/// A request as it reaches the filter.
#[derive(Debug, Clone)]
pub struct Request {
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// `POST path` with `body` and its `content-length`.
    pub fn post(path: &str, body: &str) -> Self {
        let len = body.len().to_string();
        Self { headers: Vec::new(), body: body.as_bytes().to_vec() }
            .header(":method", "POST")
            .header(":path", path)
            .header("content-length", &len)
    }

    /// `POST /v1/completions` with `body`.
    pub fn completion(body: &str) -> Self {
        Self::post("/v1/completions", body)
    }

    /// `GET path`, no body.
    pub fn get(path: &str) -> Self {
        Self { headers: Vec::new(), body: Vec::new() }.header(":method", "GET").header(":path", path)
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.retain(|(k, _)| k != name);
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// The body without a `content-length` (chunked).
    pub fn chunked(mut self) -> Self {
        self.headers.retain(|(k, _)| k != "content-length");
        self
    }
}

/// The root context id of [`Filter`]s.
pub const ROOT_ID: u32 = 1;

thread_local! {
    static NEXT_STREAM: Cell<u32> = const { Cell::new(100) };
}

/// A configured root context, as Envoy holds one per worker.
pub struct Filter {
    pub id: u32,
    pub root: AttacheRoot,
}

impl Filter {
    /// A root context `id` given `config`; whether it accepted it.
    pub fn try_configure_as(id: u32, config: &str) -> (Self, bool) {
        with(|h| {
            h.plugin_config = config.as_bytes().to_vec();
            h.roots.insert(id);
            h.current = id;
        });
        let mut root = AttacheRoot::new(id);
        let ok = root.on_configure(config.len());
        (Self { id, root }, ok)
    }

    /// The root context given `config`, which it must accept.
    pub fn configure(config: &str) -> Self {
        let (f, ok) = Self::try_configure_as(ROOT_ID, config);
        assert!(ok, "configuration refused: {config}");
        f
    }

    /// The worker's state.
    pub fn worker(&self) -> Rc<RefCell<Worker>> {
        self.root.worker().expect("a scheduler's root has a worker")
    }

    /// Requests in flight on this worker to `endpoint`.
    pub fn inflight(&self, endpoint: &str) -> u32 {
        self.worker().borrow().inflight.get(endpoint).copied().unwrap_or(0)
    }

    /// Run the root's tick.
    pub fn tick(&mut self) {
        with(|h| h.current = self.id);
        self.root.on_tick();
    }

    /// Send `req` through a new HTTP context: its headers, then (unless the filter answered
    /// already) its whole body.
    pub fn send(&self, req: Request) -> Exchange {
        let id = NEXT_STREAM.with(|n| n.replace(n.get() + 1));
        let (headers, body) = (req.headers, req.body);
        let count = headers.len();
        let stream = Stream {
            request_headers: headers.into_iter().map(|(k, v)| (k, v.into_bytes())).collect(),
            request_body: body.clone(),
            ..Stream::default()
        };
        with(|h| {
            h.streams.insert(id, stream);
            h.current = id;
        });
        let mut http = self.root.create_http_context(id).expect("an HTTP context");
        let on_headers = http.on_http_request_headers(count, body.is_empty());
        let mut ex = Exchange { id, http, on_headers, on_body: None };
        if !body.is_empty() && ex.local_response().is_none() {
            ex.enter();
            ex.on_body = Some(ex.http.on_http_request_body(body.len(), true));
        }
        ex
    }
}

/// One request through its HTTP context.
pub struct Exchange {
    pub id: u32,
    pub http: Box<dyn HttpContext>,
    /// What the request headers callback returned.
    pub on_headers: Action,
    /// What the body callback returned (None: not called).
    pub on_body: Option<Action>,
}

impl Exchange {
    /// Make this stream the effective context, as Envoy does before each of its callbacks.
    fn enter(&self) {
        with(|h| h.current = self.id);
    }

    pub fn request_header(&self, name: &str) -> Option<String> {
        with(|h| h.request_header(self.id, name))
    }

    pub fn response_header(&self, name: &str) -> Option<String> {
        with(|h| h.response_header(self.id, name))
    }

    /// The destination header: the primary, then the fallbacks.
    pub fn destinations(&self) -> Vec<String> {
        self.request_header(DESTINATION_HEADER).map(|v| v.split(',').map(str::to_owned).collect()).unwrap_or_default()
    }

    /// The endpoint the request is routed to.
    pub fn primary(&self) -> Option<String> {
        self.destinations().into_iter().next()
    }

    pub fn local_response(&self) -> Option<LocalResponse> {
        with(|h| h.streams.get(&self.id).and_then(|s| s.local_response.clone()))
    }

    /// The filter's own answer, which the request must have got.
    pub fn refused(&self) -> LocalResponse {
        self.local_response().expect("the filter answered the request")
    }

    /// How many times the filter resumed the request.
    pub fn resumed(&self) -> u32 {
        with(|h| h.streams.get(&self.id).map_or(0, |s| s.resumed))
    }

    /// The upstream answers with `status` and `headers`.
    pub fn respond(&mut self, status: u16, headers: &[(&str, &str)]) -> Action {
        let mut all = vec![(":status".to_owned(), status.to_string().into_bytes())];
        all.extend(headers.iter().map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec())));
        let count = all.len();
        with(|h| {
            if let Some(s) = h.streams.get_mut(&self.id) {
                s.response_headers = all;
            }
        });
        self.enter();
        self.http.on_http_response_headers(count, false)
    }

    /// The response body arrives, whole.
    pub fn respond_body(&mut self, body: &str) -> Action {
        with(|h| {
            if let Some(s) = h.streams.get_mut(&self.id) {
                s.response_body = body.as_bytes().to_vec();
            }
        });
        self.enter();
        self.http.on_http_response_body(body.len(), true)
    }

    /// One chunk of the response body arrives (the filter sees only this chunk).
    pub fn respond_chunk(&mut self, chunk: &str, end_of_stream: bool) -> Action {
        with(|h| {
            if let Some(s) = h.streams.get_mut(&self.id) {
                s.response_body = chunk.as_bytes().to_vec();
            }
        });
        self.enter();
        self.http.on_http_response_body(chunk.len(), end_of_stream)
    }

    /// The request body as it goes upstream (after any rewrite).
    pub fn upstream_body(&self) -> Vec<u8> {
        with(|h| h.streams.get(&self.id).map(|s| s.request_body.clone()).unwrap_or_default())
    }

    /// The stream ends (Envoy's access-log callback).
    pub fn finish(mut self) {
        self.enter();
        self.http.on_log();
    }
}

/// The one open gRPC stream (the agent's, or a per-worker scheduler's).
pub fn open_stream() -> crate::testing::GrpcStream {
    let open: Vec<_> = with(|h| h.grpc_streams.iter().filter(|s| !s.closed).cloned().collect());
    assert_eq!(open.len(), 1, "{open:?}");
    open.into_iter().next().expect("one")
}

/// The host sends `update` on the open stream of `f`.
pub fn deliver(f: &mut Filter, update: v1::update::Kind) {
    use prost::Message;
    let bytes = v1::Update { kind: Some(update), sent_unix_ns: 0 }.encode_to_vec();
    let token = open_stream().token;
    with(|h| {
        h.grpc_receive = bytes.clone();
        h.current = f.id;
    });
    proxy_wasm::traits::Context::on_grpc_stream_message(&mut f.root, token, bytes.len());
}
