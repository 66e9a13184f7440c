//! Native unit tests of the role modules: a mock of the proxy-wasm host ABI ([`abi`]), the
//! state it keeps ([`MockHost`]), and builders that drive the real root and HTTP contexts
//! through it ([`harness`]).
//!
//! The SDK's `proxy_wasm::hostcalls` import `proxy_*` functions from the host; in a native test
//! binary [`abi`] defines them, over one [`MockHost`] per thread. libtest runs every test on a
//! thread of its own, so each test starts from an empty host.

pub mod abi;
pub mod harness;

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use proxy_wasm::types::{LogLevel, MetricType};

/// Headers as Envoy holds them: names lower-case, values as bytes, in order.
pub type Headers = Vec<(String, Vec<u8>)>;

/// One HTTP stream: what Envoy holds for it, and what the filter did to it.
#[derive(Debug, Default)]
pub struct Stream {
    pub request_headers: Headers,
    pub response_headers: Headers,
    pub request_body: Vec<u8>,
    pub response_body: Vec<u8>,
    /// Filter state set on this stream (by path).
    pub properties: HashMap<Vec<String>, Vec<u8>>,
    /// The response the filter sent itself (`send_local_response`).
    pub local_response: Option<LocalResponse>,
    /// How many times the filter resumed the paused request (`continue_stream`).
    pub resumed: u32,
}

/// A response the filter sent itself.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalResponse {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl LocalResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The body as JSON (`Null` if it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_default()
    }
}

/// A metric the filter defined.
#[derive(Debug, Clone, PartialEq)]
pub struct Metric {
    pub name: String,
    pub kind: MetricType,
    /// Counter or gauge value; a histogram's last sample.
    pub value: i64,
    /// A histogram's samples, in order.
    pub samples: Vec<u64>,
}

/// A unary gRPC call the filter made.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpcCall {
    pub token: u32,
    pub cluster: String,
    pub service: String,
    pub method: String,
    pub message: Vec<u8>,
    pub timeout_ms: u32,
}

/// A gRPC stream the filter opened.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpcStream {
    pub token: u32,
    pub cluster: String,
    pub service: String,
    pub method: String,
    /// Messages sent, and whether each ended the stream.
    pub sent: Vec<(Vec<u8>, bool)>,
    /// Cancelled by the filter, or closed by the host.
    pub closed: bool,
}

/// What the mock host knows: one Envoy, as far as one worker's VM can see it.
#[derive(Debug)]
pub struct MockHost {
    /// The host's clock, ns since the Unix epoch.
    pub now_ns: u64,
    /// Each clock reading moves the clock on by this much (0: it stands still between
    /// [`advance_ms`] calls), for tests that time what the filter does.
    pub clock_step_ns: u64,
    /// Envoy's log level for the filter.
    pub log_level: LogLevel,
    pub logs: Vec<(LogLevel, String)>,
    pub plugin_config: Vec<u8>,
    /// Properties of the plugin and the VM (e.g. `plugin_name`), by path.
    pub properties: HashMap<Vec<String>, Vec<u8>>,
    /// Shared data: value and CAS token per key.
    pub shared: HashMap<String, (Vec<u8>, u32)>,
    last_cas: u32,
    /// Metric id `i + 1` is `metrics[i]`.
    pub metrics: Vec<Metric>,
    pub tick_period_ms: Option<u32>,
    /// Root context ids (valid effective contexts that are not streams).
    pub roots: BTreeSet<u32>,
    pub streams: BTreeMap<u32, Stream>,
    /// The effective context: the one host calls act on.
    pub current: u32,
    pub grpc_streams: Vec<GrpcStream>,
    /// Unary gRPC calls made (answered by the test).
    pub grpc_calls: Vec<GrpcCall>,
    /// Make `open_grpc_stream` fail, as when the cluster is unknown.
    pub grpc_unavailable: bool,
    /// The gRPC receive buffer (the message being delivered).
    pub grpc_receive: Vec<u8>,
    /// The status `get_grpc_status` reports.
    pub grpc_status: (u32, Option<String>),
}

/// The mock clock's start: 2023-11-14, in ms since the epoch.
pub const START_MS: u64 = 1_700_000_000_000;

impl Default for MockHost {
    fn default() -> Self {
        Self {
            now_ns: START_MS * 1_000_000,
            clock_step_ns: 0,
            // Trace, so every debug line's formatting runs too.
            log_level: LogLevel::Trace,
            logs: Vec::new(),
            plugin_config: Vec::new(),
            properties: HashMap::new(),
            shared: HashMap::new(),
            last_cas: 0,
            metrics: Vec::new(),
            tick_period_ms: None,
            roots: BTreeSet::new(),
            streams: BTreeMap::new(),
            current: 0,
            grpc_streams: Vec::new(),
            grpc_calls: Vec::new(),
            grpc_unavailable: false,
            grpc_receive: Vec::new(),
            grpc_status: (0, None),
        }
    }
}

thread_local! {
    static HOST: RefCell<MockHost> = RefCell::new(MockHost::default());
}

/// Run `f` on this thread's mock host. Do not call into the filter from `f`: its host calls
/// need the host too.
pub fn with<R>(f: impl FnOnce(&mut MockHost) -> R) -> R {
    HOST.with(|h| f(&mut h.borrow_mut()))
}

/// Like [`with`], for the ABI functions: `None` instead of a panic if the host is in use (a
/// panic cannot unwind out of an `extern "C"` function).
fn try_with<R>(f: impl FnOnce(&mut MockHost) -> R) -> Option<R> {
    HOST.with(|h| match h.try_borrow_mut() {
        Ok(mut h) => Some(f(&mut h)),
        Err(_) => {
            eprintln!("mock host: a host call ran while a test held the host (testing::with)");
            None
        }
    })
}

/// The value of metric `name` (None: never defined).
pub fn metric(name: &str) -> Option<i64> {
    with(|h| h.metric(name))
}

pub fn now_ms() -> u64 {
    with(|h| h.now_ns / 1_000_000)
}

/// Move the clock on by `ms`.
pub fn advance_ms(ms: u64) {
    with(|h| h.now_ns += ms * 1_000_000);
}

fn find<'a>(headers: &'a Headers, name: &str) -> Option<&'a [u8]> {
    headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
}

impl MockHost {
    /// The stream host calls act on now, if the effective context is one.
    fn stream(&mut self) -> Option<&mut Stream> {
        self.streams.get_mut(&self.current)
    }

    fn next_cas(&mut self) -> u32 {
        // Envoy's CAS tokens are never 0 (0 means "no CAS").
        self.last_cas = self.last_cas.wrapping_add(1).max(1);
        self.last_cas
    }

    /// Shared data as Envoy's `setSharedData`: a CAS of 0 always writes; another must match
    /// the key's current token, if the key exists.
    fn set_shared(&mut self, key: String, value: Vec<u8>, cas: u32) -> bool {
        if let Some((_, current)) = self.shared.get(&key) {
            if cas != 0 && cas != *current {
                return false;
            }
        }
        let next = self.next_cas();
        self.shared.insert(key, (value, next));
        true
    }

    /// A request header of stream `id`, as text.
    pub fn request_header(&self, id: u32, name: &str) -> Option<String> {
        let s = self.streams.get(&id)?;
        find(&s.request_headers, name).map(|v| String::from_utf8_lossy(v).into_owned())
    }

    /// A response header of stream `id`, as text.
    pub fn response_header(&self, id: u32, name: &str) -> Option<String> {
        let s = self.streams.get(&id)?;
        find(&s.response_headers, name).map(|v| String::from_utf8_lossy(v).into_owned())
    }

    /// The value of metric `name` (None: never defined).
    pub fn metric(&self, name: &str) -> Option<i64> {
        self.metrics.iter().find(|m| m.name == name).map(|m| m.value)
    }

    /// The names of the metrics defined so far.
    pub fn metric_names(&self) -> impl Iterator<Item = &str> {
        self.metrics.iter().map(|m| m.name.as_str())
    }

    /// Whether a line at `level` containing `needle` was logged.
    pub fn logged(&self, level: LogLevel, needle: &str) -> bool {
        self.logs.iter().any(|(l, m)| *l == level && m.contains(needle))
    }
}
