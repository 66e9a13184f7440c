//! The client side of the host's snapshot stream, driven from a root context's callbacks: the
//! agent's (one per Envoy), or every scheduler's in per-worker mode.

use attache_proto::v1;
use prost::Message;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel};

use crate::config::SubscribeConfig;
use crate::hostcalls as host;
use crate::shared::snapshot::heard;

const SERVICE: &str = "attache.v1.SnapshotService";
const SUBSCRIBE: &str = "Subscribe";
const EXCHANGE: &str = "Exchange";

/// The client side of the host's snapshot stream, driven from a root context's callbacks.
pub struct Subscriber {
    cfg: SubscribeConfig,
    token: Option<u32>,
    last_message_ms: u64,
    pub received: u64,
    /// When the host sent the last update (its clock, 0 = not said).
    pub last_sent_unix_ns: u64,
    pub reconnects: u64,
}

impl Subscriber {
    pub fn new(cfg: SubscribeConfig) -> Self {
        Self { cfg, token: None, last_message_ms: 0, received: 0, last_sent_unix_ns: 0, reconnects: 0 }
    }

    pub fn tick_ms(&self) -> u64 {
        self.cfg.tick_ms.max(50)
    }

    /// Open the stream if it is not open, and reopen it if the host went silent. With `hello`
    /// (a fleet member's first report) the stream is `Exchange` and stays open both ways;
    /// without, it is `Subscribe`. `hello` is called only when a stream is opened. Returns
    /// whether one was.
    pub fn ensure_open(&mut self, node: &str, now_ms: u64, hello: Option<&mut dyn FnMut() -> v1::Report>) -> bool {
        if let Some(t) = self.token {
            if now_ms.saturating_sub(self.last_message_ms) <= self.cfg.idle_timeout_ms {
                return false;
            }
            host::log(LogLevel::Warn, "attache: snapshot stream silent, reopening");
            let _ = hostcalls::cancel_grpc_stream(t);
            self.token = None;
        }
        let (method, req, end) = match hello {
            Some(h) => (EXCHANGE, h().encode_to_vec(), false),
            // tonic runs a server-streaming handler only after the client half-closes.
            None => (SUBSCRIBE, v1::SubscribeRequest { node: node.to_owned() }.encode_to_vec(), true),
        };
        match hostcalls::open_grpc_stream(&self.cfg.cluster, SERVICE, method, vec![]) {
            Ok(t) => {
                if hostcalls::send_grpc_stream_message(t, Some(&req), end).is_err() {
                    let _ = hostcalls::cancel_grpc_stream(t);
                    return false;
                }
                self.token = Some(t);
                self.last_message_ms = now_ms;
                self.reconnects += 1;
                true
            }
            Err(s) => {
                host::log(LogLevel::Warn, &format!("attache: open_grpc_stream({}) failed: {s:?}", self.cfg.cluster));
                false
            }
        }
    }

    /// Send a report on an open `Exchange` stream. False if there is none or it failed (the
    /// report is lost; the next resync covers it).
    pub fn send(&mut self, report: &v1::Report) -> bool {
        let Some(t) = self.token else { return false };
        hostcalls::send_grpc_stream_message(t, Some(&report.encode_to_vec()), false).is_ok()
    }

    /// Handle one stream message; returns what it carried (heartbeats are consumed here).
    pub fn on_message(&mut self, token: u32, size: usize, now_ms: u64) -> Option<v1::update::Kind> {
        if self.token != Some(token) {
            return None;
        }
        self.last_message_ms = now_ms;
        heard(now_ms);
        let bytes = hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, size).ok().flatten()?;
        match v1::Update::decode(bytes.as_slice()) {
            Ok(u) => {
                self.received += 1;
                self.last_sent_unix_ns = u.sent_unix_ns;
                match u.kind {
                    Some(v1::update::Kind::Heartbeat(_)) | None => None,
                    k => k,
                }
            }
            Err(e) => {
                host::log(LogLevel::Warn, &format!("attache: undecodable update ignored: {e}"));
                None
            }
        }
    }

    /// Drop the stream (the next tick opens a new one, which starts with a full snapshot).
    pub fn restart(&mut self) {
        if let Some(t) = self.token.take() {
            let _ = hostcalls::cancel_grpc_stream(t);
        }
    }

    pub fn on_close(&mut self, token: u32) {
        if self.token == Some(token) {
            let (code, msg) = hostcalls::get_grpc_status().unwrap_or((0, None));
            host::log(
                LogLevel::Info,
                &format!("attache: snapshot stream closed (grpc {code}: {}); will reopen", msg.unwrap_or_default()),
            );
            self.token = None;
        }
    }
}
