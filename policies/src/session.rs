//! Agent-aware routing: keep a session, or a Responses API conversation, on the endpoint that
//! holds its context.
//!
//! - A session is named by a request header (`x-session-id`, or llm-d's `x-session-token`,
//!   which carries the endpoint itself, base64-encoded, so it needs no table).
//! - A Responses API request's `previous_response_id` names the response it continues; the
//!   endpoint that produced that response is learned from responses passing through the proxy.
//!
//! Both map a key to an endpoint in a [`StickyStore`]: a bounded table of slots (shared data in
//! the filter, so every Envoy worker sees what the others learned), each holding one key, its
//! endpoint and an expiry. The scheduler then prefers the sticky endpoint while it is a
//! candidate — ready, serving the model, not saturated — and routes normally otherwise
//! (the new endpoint becomes the sticky one).

use serde::{Deserialize, Serialize};

/// Session settings (the scheduler filter's `sessions` section).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SessionConfig {
    pub enabled: bool,
    /// Headers naming a session, first present wins.
    pub headers: Vec<String>,
    /// llm-d's stateless session header: base64 of the endpoint, set on responses.
    pub token_header: String,
    /// How long a session or response id stays bound to its endpoint after its last use.
    pub ttl_ms: u64,
    /// Slots of the shared table (one key each; a colliding key overwrites).
    pub slots: u64,
    /// Within a tenant, a later turn of a session already seen goes ahead of the first turn of
    /// a new one (flow control orders it one step up inside its band).
    pub turn_priority: bool,
    /// An Anthropic Messages request with no session header is keyed by its
    /// `metadata.user_id` (Claude Code sends one per user and session).
    pub messages_user_id: bool,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            headers: vec!["x-session-id".into()],
            token_header: "x-session-token".into(),
            ttl_ms: 600_000,
            slots: 65_536,
            turn_priority: true,
            messages_user_id: false,
        }
    }
}

/// A slot of the sticky table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sticky {
    pub key: u64,
    pub endpoint: String,
    pub expires_ms: u64,
}

/// Where sticky bindings live (shared data in the filter, a map in tests and the simulator).
pub trait StickyStore {
    fn load(&mut self, slot: u64) -> Option<Sticky>;
    fn store(&mut self, slot: u64, entry: &Sticky);
}

/// Table key of a session id.
pub fn session_key(id: &str) -> u64 {
    xxhash_rust::xxh64::xxh64(id.as_bytes(), 0x5e55_1011)
}

/// Table key of a Responses API response id.
pub fn response_key(id: &str) -> u64 {
    xxhash_rust::xxh64::xxh64(id.as_bytes(), 0x7e59_0115)
}

/// The endpoint bound to `key`, if the binding has not expired.
pub fn lookup(store: &mut dyn StickyStore, slots: u64, key: u64, now_ms: u64) -> Option<String> {
    store.load(key % slots.max(1)).filter(|s| s.key == key && s.expires_ms > now_ms).map(|s| s.endpoint)
}

/// The endpoint a request's session or conversation is bound to, by precedence: the session
/// token's own endpoint (llm-d's stateless header), then the session header's binding, then the
/// endpoint that produced `previous_response_id`. `None` when sessions are off.
pub fn resolve(
    cfg: &SessionConfig,
    store: &mut dyn StickyStore,
    token_endpoint: Option<String>,
    session_key: Option<u64>,
    previous_response_id: Option<&str>,
    now_ms: u64,
) -> Option<String> {
    if !cfg.enabled {
        return None;
    }
    token_endpoint
        .or_else(|| session_key.and_then(|k| lookup(store, cfg.slots, k, now_ms)))
        .or_else(|| previous_response_id.and_then(|id| lookup(store, cfg.slots, response_key(id), now_ms)))
}

/// Bind `key` to `endpoint` for `ttl_ms`.
pub fn bind(store: &mut dyn StickyStore, slots: u64, key: u64, endpoint: &str, now_ms: u64, ttl_ms: u64) {
    let entry = Sticky { key, endpoint: endpoint.to_owned(), expires_ms: now_ms.saturating_add(ttl_ms) };
    store.store(key % slots.max(1), &entry);
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// `x-session-token` for an endpoint: unpadded base64url of `ip:port`.
pub fn token_for(endpoint: &str) -> String {
    let b = endpoint.as_bytes();
    let mut out = String::with_capacity(b.len().div_ceil(3) * 4);
    for c in b.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(c.get(1).copied().unwrap_or(0)) << 8)
            | u32::from(c.get(2).copied().unwrap_or(0));
        for i in 0..=c.len() {
            out.push(char::from(B64[((n >> (18 - 6 * i)) & 63) as usize]));
        }
    }
    out
}

/// The endpoint an `x-session-token` names (standard or url-safe base64, padded or not).
pub fn endpoint_of_token(token: &str) -> Option<String> {
    let mut bits = 0u32;
    let mut n = 0;
    let mut out = Vec::with_capacity(token.len() * 3 / 4);
    for ch in token.trim().trim_end_matches('=').bytes() {
        let v = match ch {
            b'A'..=b'Z' => ch - b'A',
            b'a'..=b'z' => ch - b'a' + 26,
            b'0'..=b'9' => ch - b'0' + 52,
            b'-' | b'+' => 62,
            b'_' | b'/' => 63,
            _ => return None,
        };
        bits = (bits << 6) | u32::from(v);
        n += 6;
        if n >= 8 {
            n -= 8;
            out.push((bits >> n) as u8);
            bits &= (1 << n) - 1;
        }
    }
    let s = String::from_utf8(out).ok()?;
    // Only an address can come out of a token (it is client input).
    let valid = !s.is_empty() && s.len() <= 64 && s.bytes().all(|c| c.is_ascii_alphanumeric() || b".:[]-".contains(&c));
    valid.then_some(s)
}

/// The response id at the start of a Responses API body (`{"id":"resp_…"` non-streamed, or the
/// `response.created` event streamed), if the first bytes carry one.
pub fn response_id(first_bytes: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(first_bytes.get(..first_bytes.len().min(4096))?).ok()?;
    let at = text.find("\"resp_")? + 1;
    let id: String =
        text.get(at..)?.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-').take(128).collect();
    (id.len() > 5).then_some(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[derive(Default)]
    struct Mem(HashMap<u64, Sticky>);
    #[test]
    fn finds_response_ids_in_plain_and_streamed_bodies() {
        let plain = br#"{"id":"resp_abc123","object":"response","output":[]}"#;
        assert_eq!(response_id(plain).as_deref(), Some("resp_abc123"));
        let sse = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_9f-x\",\"object\":\"response\"}}\n\n";
        assert_eq!(response_id(sse).as_deref(), Some("resp_9f-x"));
        assert_eq!(response_id(b"{\"id\":\"chatcmpl-1\"}"), None);
        assert_eq!(response_id(&[0xff, 0xfe]), None);
    }

    #[test]
    fn the_token_wins_then_the_session_then_the_previous_response() {
        let cfg = SessionConfig::default();
        let mut m = Mem::default();
        bind(&mut m, cfg.slots, session_key("s1"), "10.0.0.1:8000", 0, 1_000);
        bind(&mut m, cfg.slots, response_key("resp_1"), "10.0.0.2:8000", 0, 1_000);
        let r = |token: Option<&str>, session: Option<&str>, prev: Option<&str>, m: &mut Mem| {
            resolve(&cfg, m, token.map(str::to_owned), session.map(session_key), prev, 10)
        };
        assert_eq!(r(Some("10.0.0.9:1"), Some("s1"), Some("resp_1"), &mut m).as_deref(), Some("10.0.0.9:1"));
        assert_eq!(r(None, Some("s1"), Some("resp_1"), &mut m).as_deref(), Some("10.0.0.1:8000"));
        assert_eq!(r(None, Some("unknown"), Some("resp_1"), &mut m).as_deref(), Some("10.0.0.2:8000"));
        assert_eq!(r(None, None, None, &mut m), None);
        let off = SessionConfig { enabled: false, ..SessionConfig::default() };
        assert_eq!(resolve(&off, &mut m, Some("10.0.0.9:1".into()), None, None, 10), None, "sessions off");
    }

    impl StickyStore for Mem {
        fn load(&mut self, slot: u64) -> Option<Sticky> {
            self.0.get(&slot).cloned()
        }
        fn store(&mut self, slot: u64, entry: &Sticky) {
            self.0.insert(slot, entry.clone());
        }
    }

    #[test]
    fn bindings_expire_and_collisions_do_not_cross() {
        let mut m = Mem::default();
        let (a, b) = (session_key("agent-1"), session_key("agent-2"));
        bind(&mut m, 1 << 16, a, "10.0.0.1:8000", 1000, 500);
        assert_eq!(lookup(&mut m, 1 << 16, a, 1200).as_deref(), Some("10.0.0.1:8000"));
        assert_eq!(lookup(&mut m, 1 << 16, a, 1500), None, "expired");
        assert_eq!(lookup(&mut m, 1 << 16, b, 1200), None);
        // One slot: b overwrites a, and a no longer resolves (never to b's endpoint).
        bind(&mut m, 1, a, "10.0.0.1:8000", 0, 1000);
        bind(&mut m, 1, b, "10.0.0.2:8000", 0, 1000);
        assert_eq!(lookup(&mut m, 1, a, 10), None);
        assert_eq!(lookup(&mut m, 1, b, 10).as_deref(), Some("10.0.0.2:8000"));
        assert_ne!(session_key("x"), response_key("x"));
    }

    #[test]
    fn tokens_round_trip_and_reject_junk() {
        for ep in ["10.0.0.1:8000", "127.0.0.1:12345", "[::1]:80", "a:1"] {
            assert_eq!(endpoint_of_token(&token_for(ep)).as_deref(), Some(ep), "{ep}");
        }
        // Standard, padded base64 of "10.1.2.3:80" as another client might send it.
        assert_eq!(endpoint_of_token("MTAuMS4yLjM6ODA=").as_deref(), Some("10.1.2.3:80"));
        assert_eq!(endpoint_of_token("not base64!"), None);
        assert_eq!(endpoint_of_token(&token_for("evil\nheader")), None);
        assert_eq!(endpoint_of_token(""), None);
    }
}
