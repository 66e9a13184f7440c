//! Publishing KV events exactly as vLLM does (`reference/engines.md` §2, `tests/fixtures/vllm-0.32/`):
//! a ZMQ PUB socket sending `[topic, seq (8 bytes BE), msgpack [ts, events, dp_rank]]`, one
//! message per engine step with events, and a ROUTER socket that replays buffered messages
//! from a requested sequence number, then an end marker. Events are tagged maps (vLLM ≥ 0.26)
//! or tagged arrays (older), by configuration.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::{info, warn};

use crate::kv::KvEvent;
#[cfg(test)]
use crate::kv::Medium;

/// Event encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// `{"type": "BlockStored", ...}` (vLLM ≥ 0.26; what vLLM 0.32 sends).
    Map,
    /// `["BlockStored", ...]` (vLLM ≤ 0.23).
    Array,
}

// --- a minimal msgpack writer ---

fn head(out: &mut Vec<u8>, fix: u8, fix_max: u64, m16: u8, m32: u8, n: u64) {
    if n <= fix_max {
        out.push(fix | n as u8);
    } else if n <= 0xffff {
        out.push(m16);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(m32);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

fn array(out: &mut Vec<u8>, n: usize) {
    head(out, 0x90, 15, 0xdc, 0xdd, n as u64);
}

fn map(out: &mut Vec<u8>, n: usize) {
    head(out, 0x80, 15, 0xde, 0xdf, n as u64);
}

fn string(out: &mut Vec<u8>, s: &str) {
    let n = s.len() as u64;
    if n <= 31 {
        out.push(0xa0 | n as u8);
    } else if n <= 0xff {
        out.extend_from_slice(&[0xd9, n as u8]);
    } else {
        head(out, 0, 0, 0xda, 0xdb, n);
    }
    out.extend_from_slice(s.as_bytes());
}

fn uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else if v <= 0xff {
        out.extend_from_slice(&[0xcc, v as u8]);
    } else if v <= 0xffff {
        out.push(0xcd);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= 0xffff_ffff {
        out.push(0xce);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

fn nil(out: &mut Vec<u8>) {
    out.push(0xc0);
}

fn opt_uint(out: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(v) => uint(out, v),
        None => nil(out),
    }
}

fn uints(out: &mut Vec<u8>, vs: impl ExactSizeIterator<Item = u64>) {
    array(out, vs.len());
    for v in vs {
        uint(out, v);
    }
}

/// Encode one batch payload: `[ts, events, data_parallel_rank]`. Pass map-encoded batches
/// through [`split_removed`] first: vLLM ≥ 0.26 sends one `BlockRemoved` per block.
pub fn encode_batch(ts: f64, events: &[KvEvent], encoding: Encoding) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    array(&mut out, 3);
    out.push(0xcb);
    out.extend_from_slice(&ts.to_bits().to_be_bytes());
    array(&mut out, events.len());
    for e in events {
        match (e, encoding) {
            (KvEvent::Stored { hashes, parent, tokens, block_size, medium }, Encoding::Map) => {
                map(&mut out, 11);
                string(&mut out, "type");
                string(&mut out, "BlockStored");
                string(&mut out, "block_hashes");
                uints(&mut out, hashes.iter().copied());
                string(&mut out, "parent_block_hash");
                opt_uint(&mut out, *parent);
                string(&mut out, "token_ids");
                uints(&mut out, tokens.iter().map(|t| u64::from(*t)));
                string(&mut out, "block_size");
                uint(&mut out, u64::from(*block_size));
                string(&mut out, "lora_id");
                nil(&mut out);
                string(&mut out, "medium");
                string(&mut out, medium.as_str());
                string(&mut out, "lora_name");
                nil(&mut out);
                string(&mut out, "extra_keys");
                array(&mut out, hashes.len());
                (0..hashes.len()).for_each(|_| nil(&mut out));
                string(&mut out, "group_idx");
                uint(&mut out, 0);
                string(&mut out, "kv_cache_spec_kind");
                string(&mut out, "full_attention");
            }
            (KvEvent::Stored { hashes, parent, tokens, block_size, medium }, Encoding::Array) => {
                array(&mut out, 12);
                string(&mut out, "BlockStored");
                uints(&mut out, hashes.iter().copied());
                opt_uint(&mut out, *parent);
                uints(&mut out, tokens.iter().map(|t| u64::from(*t)));
                uint(&mut out, u64::from(*block_size));
                nil(&mut out); // lora_id
                string(&mut out, medium.as_str());
                nil(&mut out); // lora_name
                array(&mut out, hashes.len());
                (0..hashes.len()).for_each(|_| nil(&mut out));
                uint(&mut out, 0); // group_idx
                string(&mut out, "full_attention");
                nil(&mut out); // kv_cache_spec_sliding_window
            }
            (KvEvent::Removed { hashes, medium }, Encoding::Map) => {
                map(&mut out, 4);
                string(&mut out, "type");
                string(&mut out, "BlockRemoved");
                string(&mut out, "block_hashes");
                uints(&mut out, hashes.iter().copied());
                string(&mut out, "medium");
                string(&mut out, medium.as_str());
                string(&mut out, "group_idx");
                uint(&mut out, 0);
            }
            (KvEvent::Removed { hashes, medium }, Encoding::Array) => {
                array(&mut out, 4);
                string(&mut out, "BlockRemoved");
                uints(&mut out, hashes.iter().copied());
                string(&mut out, medium.as_str());
                uint(&mut out, 0);
            }
            (KvEvent::Cleared, Encoding::Map) => {
                map(&mut out, 1);
                string(&mut out, "type");
                string(&mut out, "AllBlocksCleared");
            }
            (KvEvent::Cleared, Encoding::Array) => {
                array(&mut out, 1);
                string(&mut out, "AllBlocksCleared");
            }
        }
    }
    uint(&mut out, 0); // data_parallel_rank
    out
}

/// One BlockRemoved per block, as vLLM emits them.
pub fn split_removed(events: Vec<KvEvent>) -> Vec<KvEvent> {
    let mut out = Vec::with_capacity(events.len());
    for e in events {
        match e {
            KvEvent::Removed { hashes, medium } => {
                out.extend(hashes.into_iter().map(|h| KvEvent::Removed { hashes: vec![h], medium }))
            }
            e => out.push(e),
        }
    }
    out
}

/// End-of-replay marker: seq -1.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// Where and how an engine publishes.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// `tcp://*:5557` binds (as vLLM does for `*`); `tcp://127.0.0.1:5557` connects.
    pub endpoint: String,
    /// ROUTER replay endpoint (always bound), if any.
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub encoding: Encoding,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub buffer_steps: usize,
}

/// vLLM binds only for `*`, `::`, `ipc://` and `inproc://` endpoints, else connects.
pub fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// Run the publisher of one engine on its own thread (libzmq sockets are not `Send`-safe to
/// share), until the engine's event channel closes. Returns once the sockets are set up.
pub fn spawn(cfg: PublisherConfig, rx: std::sync::mpsc::Receiver<Vec<KvEvent>>) -> anyhow::Result<()> {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB)?;
    publisher.set_sndhwm(100_000)?;
    publisher.set_linger(0)?;
    if binds(&cfg.endpoint) {
        publisher.bind(&cfg.endpoint)?;
    } else {
        publisher.connect(&cfg.endpoint)?;
    }
    let router = match &cfg.replay_endpoint {
        Some(ep) => {
            let r = ctx.socket(zmq::ROUTER)?;
            r.set_linger(0)?;
            r.bind(ep)?;
            Some(r)
        }
        None => None,
    };
    info!(endpoint = %cfg.endpoint, replay = ?cfg.replay_endpoint, topic = %cfg.topic, "kv events: publishing");
    std::thread::Builder::new().name("kv-publisher".into()).spawn(move || {
        let _ctx = ctx;
        let mut replay: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
        let topic = cfg.topic.as_bytes().to_vec();
        let mut seq: u64 = 0;
        loop {
            match rx.recv_timeout(std::time::Duration::from_millis(5)) {
                Ok(events) => {
                    let ts = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
                    let events = if cfg.encoding == Encoding::Map { split_removed(events) } else { events };
                    let payload = encode_batch(ts, &events, cfg.encoding);
                    // Like vLLM, a message published with no subscriber connected is dropped.
                    let frames: [&[u8]; 3] = [&topic, &seq.to_be_bytes(), &payload];
                    if let Err(e) = publisher.send_multipart(frames, 0) {
                        warn!(error = %e, "kv events: send failed");
                    }
                    replay.push_back((seq, payload));
                    while replay.len() > cfg.buffer_steps.max(1) {
                        replay.pop_front();
                    }
                    seq += 1;
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
            }
            if let Some(router) = &router {
                while let Ok(req) = router.recv_multipart(zmq::DONTWAIT) {
                    serve_replay(router, &req, &replay, &topic);
                }
            }
        }
    })?;
    Ok(())
}

/// The replay socket: a request is `[identity, "", start_seq]`; the answer is every buffered
/// `[identity, "", topic, seq, payload]` with seq ≥ start, then `[identity, "", "", END, ""]`.
fn serve_replay(router: &zmq::Socket, req: &[Vec<u8>], replay: &VecDeque<(u64, Vec<u8>)>, topic: &[u8]) {
    let [id, delim, start] = req else {
        warn!(frames = req.len(), "kv events: malformed replay request dropped");
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(start.as_slice()).map(u64::from_be_bytes) else { return };
    if !delim.is_empty() {
        return;
    }
    for (s, payload) in replay.iter().filter(|(s, _)| *s >= start) {
        let frames: [&[u8]; 5] = [id, b"", topic, &s.to_be_bytes(), payload];
        if router.send_multipart(frames, 0).is_err() {
            return;
        }
    }
    let end: [&[u8]; 5] = [id, b"", b"", &END_SEQ, b""];
    let _ = router.send_multipart(end, 0);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    /// The first message of the real vLLM 0.32 capture, re-encoded from its decoded events,
    /// is byte-for-byte the captured payload (same ts).
    #[test]
    fn map_encoding_is_byte_identical_to_real_vllm() {
        let frames = attache_fixtures::read_vllm("kv-events.jsonl").unwrap();
        let decoded = attache_fixtures::read_vllm("kv-events.decoded.jsonl").unwrap();
        let mut checked = 0;
        for (fl, dl) in frames.lines().zip(decoded.lines()) {
            let f: serde_json::Value = serde_json::from_str(fl).unwrap();
            let d: serde_json::Value = serde_json::from_str(dl).unwrap();
            let want = hex(f["frames_hex"][2].as_str().unwrap());
            let ts = f64::from_bits(u64::from_be_bytes(want[2..10].try_into().unwrap()));
            let events: Vec<KvEvent> = d["payload"][1]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| {
                    let u = |v: &serde_json::Value| v.as_u64().unwrap();
                    match e["type"].as_str().unwrap() {
                        "BlockStored" => KvEvent::Stored {
                            hashes: e["block_hashes"].as_array().unwrap().iter().map(u).collect(),
                            parent: e["parent_block_hash"].as_u64(),
                            tokens: e["token_ids"].as_array().unwrap().iter().map(|t| u(t) as u32).collect(),
                            block_size: u(&e["block_size"]) as u32,
                            medium: Medium::Gpu,
                        },
                        "BlockRemoved" => KvEvent::Removed {
                            hashes: e["block_hashes"].as_array().unwrap().iter().map(u).collect(),
                            medium: Medium::Gpu,
                        },
                        _ => KvEvent::Cleared,
                    }
                })
                .collect();
            assert_eq!(encode_batch(ts, &events, Encoding::Map), want, "message {checked}");
            checked += 1;
        }
        assert!(checked > 10);
    }

    #[test]
    fn array_encoding_matches_the_reference_test_vector() {
        // reference/engines.md §3.5 (msgspec, legacy array encoding): BlockStored, BlockRemoved,
        // AllBlocksCleared.
        let want = hex("93cb3ff8000000000000939cab426c6f636b53746f72656491cfb0147556276afc9cc0940001020304c0a3475055c091c000ae66756c6c5f617474656e74696f6ec094ac426c6f636b52656d6f76656491cfb0147556276afc9ca34750550091b0416c6c426c6f636b73436c656172656400");
        let h = 12687895063098490012;
        let events = [
            KvEvent::Stored {
                hashes: vec![h],
                parent: None,
                tokens: vec![0, 1, 2, 3],
                block_size: 4,
                medium: Medium::Gpu,
            },
            KvEvent::Removed { hashes: vec![h], medium: Medium::Gpu },
            KvEvent::Cleared,
        ];
        assert_eq!(encode_batch(1.5, &events, Encoding::Array), want);
    }

    #[test]
    fn bind_or_connect_like_vllm() {
        assert!(binds("tcp://*:5557"));
        assert!(binds("ipc:///tmp/x"));
        assert!(!binds("tcp://127.0.0.1:5557"));
    }
}
