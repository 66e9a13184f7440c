//! Responses API state in the gateway (`docs/responses.md`): the parts every host of the
//! scheduling logic shares.
//!
//! - A continuation (`previous_response_id`) is rewritten into the whole conversation before it
//!   is routed ([`continuation_body`]): any engine can serve it, and prefix routing sees the
//!   conversation, so the engine holding its cache wins.
//! - A stored response is captured from the answer ([`captured_response`]): the body, or a
//!   stream's `response.completed` event.
//! - Ids resolve per tenant ([`tenant_of`]), and a worker keeps the conversations it saw last
//!   ([`ConversationCache`]) so the next turn through it needs no call to the host.

use serde_json::value::RawValue;
use serde_json::Value;

/// Where Responses API state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// The gateway keeps it (the host's store): vLLM's default, which stores nothing.
    #[default]
    Gateway,
    /// The engines keep it (vLLM with `VLLM_ENABLE_RESPONSES_API_STORE=1`): a continuation,
    /// `GET` and `cancel` go to the engine that produced the response.
    Engine,
    /// Neither: requests pass as they are.
    Off,
}

/// `responses:` in the filter configuration.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ResponsesConfig {
    pub mode: Mode,
    /// Envoy cluster of the host's gRPC server (the store).
    pub cluster: String,
    /// The longest a continuation waits for the host to resolve its `previous_response_id`
    /// (the host waits this long for a response another replica is storing).
    pub resolve_wait_ms: u64,
    /// Bytes of conversations each worker keeps for continuations through it (least recently
    /// used first; 0 asks the host every time).
    pub cache_bytes: usize,
    /// The largest answer captured for the store; a larger one is passed through unstored and
    /// counted (`attache.responses.capture_dropped`).
    pub capture_max_bytes: usize,
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Gateway,
            cluster: "attache_host".into(),
            resolve_wait_ms: 500,
            cache_bytes: 8 << 20,
            capture_max_bytes: 8 << 20,
        }
    }
}

/// Why a continuation could not be rewritten.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RewriteError {
    #[error("the request body is not a JSON object: {0}")]
    Body(String),
    #[error("`input` must be a string or a list of items")]
    Input,
    #[error("the stored conversation is not a JSON array")]
    History,
}

/// The tenant a Responses id belongs to: a digest of the tenant header's value, else of the
/// API key, else the anonymous tenant (""). Never the key itself.
pub fn tenant_of(tenant_header: Option<&str>, api_key: Option<&str>) -> String {
    let digest = |kind: &str, v: &str| format!("{kind}-{:016x}", xxhash_rust::xxh64::xxh64(v.as_bytes(), 0x7e5_9075));
    match crate::flow::principal(tenant_header, api_key) {
        crate::flow::Principal::Tenant(t) => digest("t", t),
        crate::flow::Principal::ApiKey(k) => digest("key", k),
        crate::flow::Principal::Anonymous => String::new(),
    }
}

/// This turn's input items, a JSON array: a string `input` as one user message.
pub fn turn_items(input: &Value) -> Result<String, RewriteError> {
    match input {
        Value::String(s) => Ok(serde_json::json!([{"role": "user", "content": s}]).to_string()),
        Value::Array(_) => Ok(input.to_string()),
        _ => Err(RewriteError::Input),
    }
}

/// A request body's turn items ([`turn_items`]), reading `input` as it is written: no DOM of
/// the body is built, and an item list is kept byte for byte.
pub fn body_turn_items(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Input<'a> {
        #[serde(borrow)]
        input: &'a RawValue,
    }
    let raw = serde_json::from_slice::<Input<'_>>(body).ok()?.input.get().trim();
    match raw.as_bytes().first()? {
        b'[' => Some(raw.to_owned()),
        b'"' => turn_items(&serde_json::from_str(raw).ok()?).ok(),
        _ => None,
    }
}

/// The inner text of a JSON array's text (`[a,b]` → `a,b`).
fn inner(array: &str) -> Option<&str> {
    array.trim().strip_prefix('[')?.strip_suffix(']').map(str::trim)
}

/// A rewritten continuation.
#[derive(Debug)]
pub struct Continuation {
    /// The body to send upstream: `input` is the conversation, then this turn's items, and
    /// `previous_response_id` is gone.
    pub body: Vec<u8>,
    /// This turn's input items (a JSON array), for the store.
    pub turn: String,
    /// The conversation the body carries (a JSON array): the history, then this turn.
    pub conversation: String,
}

/// Rewrite a continuation's `body` with the conversation `history` (a JSON array, oldest
/// first) in place of its `previous_response_id`.
pub fn continuation_body(body: &[u8], history: &str) -> Result<Continuation, RewriteError> {
    let mut fields: serde_json::Map<String, Value> =
        serde_json::from_slice(body).map_err(|e| RewriteError::Body(e.to_string()))?;
    let input = fields.remove("input").ok_or(RewriteError::Input)?;
    fields.remove("previous_response_id");
    let turn = turn_items(&input)?;
    let conversation = join_arrays(history, &turn).ok_or(RewriteError::History)?;
    let raw = RawValue::from_string(conversation.clone()).map_err(|_| RewriteError::History)?;
    let mut out = serde_json::to_vec(&fields).map_err(|e| RewriteError::Body(e.to_string()))?;
    // Splice `"input": <conversation>` in before the closing brace (no re-parse of the
    // history).
    out.pop();
    if out.len() > 1 {
        out.push(b',');
    }
    out.extend_from_slice(b"\"input\":");
    out.extend_from_slice(raw.get().as_bytes());
    out.push(b'}');
    Ok(Continuation { body: out, turn, conversation })
}

/// Two JSON arrays' texts joined into one.
pub fn join_arrays(a: &str, b: &str) -> Option<String> {
    let (a, b) = (inner(a)?, inner(b)?);
    let mut out = String::with_capacity(a.len() + b.len() + 3);
    out.push('[');
    out.push_str(a);
    if !a.is_empty() && !b.is_empty() {
        out.push(',');
    }
    out.push_str(b);
    out.push(']');
    Some(out)
}

/// Why a `background: true` request cannot be queued in gateway mode, if it cannot: without
/// `store` there is nothing to poll (vLLM's own refusal), and a streamed background response
/// is not kept by the gateway (poll `GET` instead).
pub fn background_refusal(req: &crate::request::InferenceRequest) -> Option<crate::error::ErrorResponse> {
    let (reason, message) = if !req.store {
        ("background_needs_store", "background can only be used when `store` is true (parameter=background)")
    } else if req.stream {
        (
            "background_stream_unsupported",
            "The gateway does not stream background responses: send `stream: false` and poll GET /v1/responses/{id}.",
        )
    } else {
        return None;
    };
    Some(crate::error::ErrorResponse::new(400, reason, "invalid_request_error", Some("background"), message))
}

/// A key naming a conversation on every one of its turns: its tenant and its first input item.
/// Gateway mode binds it as a session, so a chain stays on the engine holding its cache, as a
/// session does. Reads only the first item of `conversation` (a JSON array), in its compact
/// form, so the key is the same whether the item comes as the client wrote it or as the store
/// keeps it.
pub fn conversation_key(tenant: &str, conversation: &str) -> Option<u64> {
    use serde::Deserialize;
    let rest = conversation.trim_start().strip_prefix('[')?;
    let mut de = serde_json::Deserializer::from_str(rest);
    let first = Value::deserialize(&mut de).ok()?.to_string();
    let mut key = String::with_capacity(tenant.len() + 1 + first.len());
    key.push_str(tenant);
    key.push('\0');
    key.push_str(&first);
    Some(xxhash_rust::xxh64::xxh64(key.as_bytes(), 0xc0_4e55))
}

/// A finished response taken from its answer: the object, its id and its output items.
#[derive(Debug, PartialEq, Eq)]
pub struct Captured {
    /// The response object, JSON.
    pub response: String,
    pub id: String,
    /// Its output items, a JSON array.
    pub output: String,
}

/// The response object to store from an answer (the body, or a stream's `response.completed`
/// event), parsed once: `None` unless it finished (completed, or cut short by its token limit:
/// a failed, cancelled or still queued one is not stored) with an id and an output array.
pub fn captured_response(body: &[u8], streamed: bool) -> Option<Captured> {
    let take = |v: Value| {
        let finished = ["completed", "incomplete"].contains(&v["status"].as_str().unwrap_or_default());
        let output = v.get("output").filter(|o| o.is_array() && finished)?.to_string();
        let id = v["id"].as_str()?.to_owned();
        Some(Captured { response: v.to_string(), id, output })
    };
    if !streamed {
        return take(serde_json::from_slice(body).ok()?);
    }
    let text = std::str::from_utf8(body).ok()?;
    text.split('\n').rev().filter_map(|line| line.strip_prefix("data:")).map(str::trim).find_map(|data| {
        if !data.contains("response.completed") {
            return None;
        }
        let mut v: Value = serde_json::from_str(data).ok()?;
        (v["type"] == "response.completed").then(|| take(v["response"].take())).flatten()
    })
}

/// The conversations a worker saw last, by response id: a continuation through the same
/// worker resolves here without a call to the host. Bounded by bytes, least recently used
/// first.
pub struct ConversationCache {
    entries: lru::LruCache<String, (String, String)>,
    bytes: usize,
    max_bytes: usize,
}

impl ConversationCache {
    pub fn new(max_bytes: usize) -> Self {
        Self { entries: lru::LruCache::unbounded(), bytes: 0, max_bytes }
    }

    /// The conversation ending with `id`'s output, for `tenant` only.
    pub fn get(&mut self, tenant: &str, id: &str) -> Option<&str> {
        self.entries.get(id).filter(|(t, _)| t == tenant).map(|(_, c)| c.as_str())
    }

    pub fn put(&mut self, tenant: &str, id: &str, conversation: String) {
        let size = conversation.len() + id.len() + tenant.len();
        if size > self.max_bytes {
            return;
        }
        if let Some((t, c)) = self.entries.put(id.to_owned(), (tenant.to_owned(), conversation)) {
            self.bytes -= c.len() + id.len() + t.len();
        }
        self.bytes += size;
        while self.bytes > self.max_bytes {
            let Some((k, (t, c))) = self.entries.pop_lru() else { break };
            self.bytes -= c.len() + k.len() + t.len();
        }
    }

    pub fn remove(&mut self, id: &str) {
        if let Some((t, c)) = self.entries.pop(id) {
            self.bytes -= c.len() + id.len() + t.len();
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_continuation_becomes_the_whole_conversation_without_its_previous_id() {
        let history = json!([{"role": "user", "content": "one"},
                             {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                              "content": [{"type": "output_text", "text": "two", "annotations": []}]}])
        .to_string();
        let body = json!({"model": "m", "input": "three", "previous_response_id": "resp_1", "stream": true});
        let c = continuation_body(body.to_string().as_bytes(), &history).unwrap();
        let sent: Value = serde_json::from_slice(&c.body).unwrap();
        assert!(sent.get("previous_response_id").is_none());
        assert_eq!((sent["model"].as_str(), sent["stream"].as_bool()), (Some("m"), Some(true)));
        let input = sent["input"].as_array().unwrap();
        assert_eq!(input.len(), 3);
        assert_eq!(input[2], json!({"role": "user", "content": "three"}));
        assert_eq!(c.turn, json!([{"role": "user", "content": "three"}]).to_string());
        assert_eq!(serde_json::from_str::<Value>(&c.conversation).unwrap(), sent["input"]);
        // A list input is kept item for item; an empty history adds nothing.
        let body = json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]});
        let c = continuation_body(body.to_string().as_bytes(), "[]").unwrap();
        let sent: Value = serde_json::from_slice(&c.body).unwrap();
        assert_eq!(sent["input"], body["input"]);
        // Refusals.
        assert_eq!(continuation_body(br#"{"model":"m"}"#, "[]").unwrap_err(), RewriteError::Input);
        assert_eq!(continuation_body(br#"{"input":3}"#, "[]").unwrap_err(), RewriteError::Input);
        assert!(matches!(continuation_body(b"[1]", "[]"), Err(RewriteError::Body(_))));
        assert_eq!(continuation_body(br#"{"input":"x"}"#, "{}").unwrap_err(), RewriteError::History);
    }

    #[test]
    fn a_bodys_turn_items_are_read_without_a_dom() {
        let items = body_turn_items(br#"{"model":"m","input":[{"role":"user","content":"a"}],"x":1}"#).unwrap();
        assert_eq!(items, r#"[{"role":"user","content":"a"}]"#);
        let one = body_turn_items(br#"{"input":"hi \"there\"","model":"m"}"#).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&one).unwrap(), json!([{"role": "user", "content": "hi \"there\""}]));
        assert_eq!(body_turn_items(br#"{"input":3}"#), None);
        assert_eq!(body_turn_items(br#"{"model":"m"}"#), None);
        assert_eq!(body_turn_items(b"not json"), None);
    }

    #[test]
    fn the_completed_response_is_captured_from_a_body_or_a_stream() {
        let resp = json!({"id": "resp_1", "object": "response", "status": "completed",
                          "output": [{"type": "message", "id": "msg_1", "role": "assistant",
                                      "content": [{"type": "output_text", "text": "hi"}]}]});
        let got = captured_response(resp.to_string().as_bytes(), false).unwrap();
        assert_eq!(got.id, "resp_1");
        assert_eq!(serde_json::from_str::<Value>(&got.output).unwrap(), resp["output"]);
        let failed = json!({"id": "resp_2", "status": "failed", "output": []});
        assert_eq!(captured_response(failed.to_string().as_bytes(), false), None);
        let cut_short = json!({"id": "resp_3", "status": "incomplete", "output": []});
        assert!(captured_response(cut_short.to_string().as_bytes(), false).is_some(), "stopped by its token limit");
        let created = json!({"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1", "status": "in_progress", "output": []}});
        let delta = json!({"type": "response.output_text.delta", "sequence_number": 4, "delta": "hi"});
        let done = json!({"type": "response.completed", "sequence_number": 9, "response": resp});
        let sse = format!(
            "event: response.created\ndata: {created}\n\nevent: response.output_text.delta\ndata: {delta}\n\nevent: response.completed\ndata: {done}\n\n"
        );
        let got = captured_response(sse.as_bytes(), true).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&got.response).unwrap(), resp);
        assert_eq!(
            captured_response(format!("data: {created}\n\n").as_bytes(), true),
            None,
            "cut off before it completed"
        );
    }

    #[test]
    fn a_conversation_keeps_its_key_from_turn_to_turn() {
        let first = json!([{"role": "user", "content": "one"}]).to_string();
        let later =
            join_arrays(&first, &json!([{"type": "message", "role": "assistant", "content": "two"}]).to_string())
                .unwrap();
        let key = conversation_key("t", &first);
        assert!(key.is_some());
        assert_eq!(key, conversation_key("t", &later));
        let spaced = r#"[ {"role": "user",  "content": "one"} ]"#;
        assert_eq!(conversation_key("t", &first), conversation_key("t", spaced), "the item, not its spacing");
        assert_ne!(key, conversation_key("u", &first), "per tenant");
        assert_ne!(key, conversation_key("t", &json!([{"role": "user", "content": "other"}]).to_string()));
        assert_eq!(conversation_key("t", "[]"), None);
        assert_eq!(conversation_key("t", "{}"), None);
    }

    #[test]
    fn tenants_are_digests_and_the_cache_is_bounded_per_tenant() {
        let a = tenant_of(Some("acme"), Some("Bearer k"));
        assert!(a.starts_with("t-") && !a.contains("acme"));
        assert!(tenant_of(None, Some("Bearer k")).starts_with("key-"));
        assert_eq!(tenant_of(Some(" "), None), "");
        let mut c = ConversationCache::new(100);
        c.put("a", "r1", "x".repeat(40));
        c.put("a", "r2", "y".repeat(40));
        assert_eq!(c.get("b", "r2"), None, "another tenant");
        assert_eq!(c.get("a", "r1").map(str::len), Some(40));
        c.put("a", "r3", "z".repeat(40));
        assert!(c.get("a", "r2").is_none(), "least recently used evicted");
        assert!(c.bytes() <= 100 && c.len() == 2);
        c.remove("r1");
        c.remove("r3");
        assert_eq!((c.bytes(), c.is_empty()), (0, true));
    }
}
