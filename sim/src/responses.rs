//! `/v1/responses` as vLLM 0.32 serves it (vLLM 5df63a720,
//! `vllm/entrypoints/openai/responses/{serving,streaming_events,api_router,protocol}.py`;
//! `docs/responses.md` has the details):
//!
//! - The store is off unless `--responses-store` is given (vLLM's
//!   `VLLM_ENABLE_RESPONSES_API_STORE=1`): `store: true` is then silently ignored, every
//!   `previous_response_id`, `GET` and `cancel` is 404 `Response with id '…' not found.`, and
//!   `background: true` is 400.
//! - With the store on, a response is kept when it finishes (in memory, never evicted in vLLM;
//!   here the most recent 4,096), a continuation prepends its conversation, `background: true`
//!   answers `queued` at once and runs on, and `cancel` cancels a queued one.
//! - `stream: true` sends vLLM's event sequence: `event:` and `data:` lines, `sequence_number`
//!   from 0, no `[DONE]`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::engine::{TokenEvent, Usage};
use crate::tokenizer;
use crate::wire::{error, sse_response};

/// Responses kept with the store on.
const STORE_CAPACITY: usize = 4096;

/// One stored response: the conversation's tokens (for a continuation) and the object `GET`
/// returns.
struct Stored {
    tokens: Vec<u32>,
    object: Value,
}

/// The engine's Responses store (vLLM's `response_store`), and its running background jobs.
#[derive(Clone)]
pub struct ResponseStore {
    enabled: bool,
    stored: Arc<Mutex<lru::LruCache<String, Stored>>>,
    running: Arc<Mutex<HashMap<String, tokio::task::AbortHandle>>>,
}

impl ResponseStore {
    pub fn new(enabled: bool) -> Self {
        let cap = std::num::NonZeroUsize::new(STORE_CAPACITY).unwrap_or(std::num::NonZeroUsize::MIN);
        Self { enabled, stored: Arc::new(Mutex::new(lru::LruCache::new(cap))), running: Arc::default() }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, lru::LruCache<String, Stored>> {
        self.stored.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The conversation's tokens up to and including `id`'s output.
    pub fn tokens(&self, id: &str) -> Option<Vec<u32>> {
        self.lock().get(id).map(|s| s.tokens.clone())
    }

    fn put(&self, id: &str, tokens: Vec<u32>, object: Value) {
        self.lock().put(id.to_owned(), Stored { tokens, object });
    }
}

/// vLLM's 404 for an id its store does not hold.
pub fn not_found(id: &str) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        Some("response_id"),
        &format!("Response with id '{id}' not found."),
    )
}

/// vLLM's refusals of `background: true`, checked before anything else runs.
pub fn check_background(store: &ResponseStore, background: bool, store_requested: bool) -> Option<Response> {
    if !background {
        return None;
    }
    if !store_requested {
        return Some(error(
            StatusCode::BAD_REQUEST,
            "BadRequestError",
            Some("background"),
            "background can only be used when `store` is true (parameter=background)",
        ));
    }
    (!store.enabled()).then(|| {
        error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("background"),
            "This vLLM engine does not support `store=True` and therefore does not support the background mode. To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
        )
    })
}

/// What a Responses request asked for, as the answer echoes it.
pub struct Turn {
    pub id: String,
    pub model: String,
    pub created: u64,
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    pub max_output_tokens: usize,
    pub background: bool,
    /// Kept in the store when it finishes (`store` and the store on).
    pub store: bool,
    /// The prompt's tokens (with a continuation's conversation before them).
    pub prompt: Vec<u32>,
}

fn message_item(id: &str, text: &str, done: bool) -> Value {
    let content = if text.is_empty() {
        json!([])
    } else {
        json!([{"annotations": [], "text": text, "type": "output_text", "logprobs": null}])
    };
    json!({"id": id, "content": content, "role": "assistant", "status": if done { "completed" } else { "in_progress" },
           "type": "message", "phase": null})
}

fn usage_json(u: &Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens,
           "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0,
                                    "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
           "output_tokens": u.completion_tokens,
           "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                     "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
           "total_tokens": u.prompt_tokens + u.completion_tokens})
}

/// vLLM's `ResponsesResponse` (its fields; `null` where the simulator has nothing to say).
fn object(t: &Turn, status: &str, output: Value, usage: Option<&Usage>) -> Value {
    let incomplete = usage.filter(|u| u.finish_reason == "length").map(|_| json!({"reason": "max_output_tokens"}));
    let status = if status == "completed" && incomplete.is_some() { "incomplete" } else { status };
    json!({
        "id": t.id, "created_at": t.created, "incomplete_details": incomplete, "instructions": t.instructions,
        "metadata": null, "model": t.model, "object": "response", "output": output, "parallel_tool_calls": true,
        "temperature": 1.0, "tool_choice": "none", "tools": [], "top_p": 1.0, "background": t.background,
        "max_output_tokens": t.max_output_tokens, "max_tool_calls": null, "previous_response_id": t.previous_response_id,
        "prompt": null, "reasoning": null, "service_tier": "auto", "status": status, "text": null, "top_logprobs": null,
        "truncation": "disabled", "usage": usage.map(usage_json), "user": null, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "kv_transfer_params": null, "ec_transfer_params": null, "input_messages": null,
        "output_messages": null,
    })
}

fn json_response(v: &Value) -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// Collect the engine's tokens: the text, the output token ids and the usage.
async fn collect(mut rx: mpsc::UnboundedReceiver<TokenEvent>) -> Option<(String, Vec<u32>, Usage)> {
    let (mut text, mut ids) = (String::new(), Vec::new());
    while let Some(ev) = rx.recv().await {
        match ev {
            TokenEvent::Tokens(ts, _) => {
                ts.iter().for_each(|t| text.push_str(tokenizer::decode_token(*t)));
                ids.extend(ts);
            }
            TokenEvent::Done(u) => return Some((text, ids, u)),
        }
    }
    None
}

/// Answer a Responses request whose generation was submitted (`rx`).
pub async fn respond(
    responses: &ResponseStore,
    t: Turn,
    stream: bool,
    rx: mpsc::UnboundedReceiver<TokenEvent>,
) -> Response {
    let store = responses.clone();
    if t.background {
        // Answered at once as queued; the stored object stays `queued` until it finishes (vLLM
        // 0.32 never stores `in_progress`).
        let queued = object(&t, "queued", json!([]), None);
        store.put(&t.id, t.prompt.clone(), queued.clone());
        let id = t.id.clone();
        let running = store.running.clone();
        let task = tokio::spawn(async move {
            let done = collect(rx).await;
            let mut tokens = t.prompt.clone();
            let final_object = match done {
                Some((text, ids, u)) => {
                    tokens.extend(ids);
                    object(&t, "completed", json!([message_item(&format!("msg_{}", hex16()), &text, true)]), Some(&u))
                }
                None => object(&t, "failed", json!([]), None),
            };
            let cancelled = store.lock().peek(&t.id).is_some_and(|s| s.object["status"] == "cancelled");
            if !cancelled {
                store.put(&t.id, tokens, final_object);
            }
            running.lock().unwrap_or_else(|p| p.into_inner()).remove(&t.id);
        });
        responses.running.lock().unwrap_or_else(|p| p.into_inner()).insert(id, task.abort_handle());
        return json_response(&queued);
    }
    if stream {
        return stream_events(store, t, rx);
    }
    let Some((text, ids, u)) = collect(rx).await else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError", None, "engine dropped the request");
    };
    let output =
        if text.is_empty() { json!([]) } else { json!([message_item(&format!("msg_{}", hex16()), &text, true)]) };
    let v = object(&t, "completed", output, Some(&u));
    if t.store {
        let mut tokens = t.prompt.clone();
        tokens.extend(ids);
        store.put(&t.id, tokens, v.clone());
    }
    json_response(&v)
}

fn event(kind: &str, mut data: Value, seq: &mut u64) -> Result<Bytes, Infallible> {
    data["sequence_number"] = json!(*seq);
    data["type"] = json!(kind);
    *seq += 1;
    Ok(Bytes::from(format!("event: {kind}\ndata: {data}\n\n")))
}

/// vLLM's event sequence for a plain text answer (`serving.py::responses_stream_generator`,
/// `streaming_events.py::emit_simple_content_*`).
fn stream_events(store: ResponseStore, t: Turn, mut rx: mpsc::UnboundedReceiver<TokenEvent>) -> Response {
    let (tx, out) = mpsc::channel::<Result<Bytes, Infallible>>(64);
    tokio::spawn(async move {
        let mut seq = 0u64;
        let start = object(&t, "in_progress", json!([]), None);
        for kind in ["response.created", "response.in_progress"] {
            if tx.send(event(kind, json!({"response": start}), &mut seq)).await.is_err() {
                return;
            }
        }
        let msg_id = format!("msg_{}", hex16());
        let (mut text, mut ids, mut opened) = (String::new(), Vec::new(), false);
        let mut usage = None;
        while let Some(ev) = rx.recv().await {
            match ev {
                TokenEvent::Tokens(ts, _) => {
                    let delta: String = ts.iter().map(|t| tokenizer::decode_token(*t)).collect();
                    ids.extend(ts);
                    if delta.is_empty() {
                        continue;
                    }
                    if !opened {
                        opened = true;
                        let added = json!({"item": message_item(&msg_id, "", false), "output_index": 0});
                        let part = json!({"content_index": 0, "item_id": msg_id, "output_index": 0,
                                          "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []}});
                        for (kind, data) in
                            [("response.output_item.added", added), ("response.content_part.added", part)]
                        {
                            if tx.send(event(kind, data, &mut seq)).await.is_err() {
                                return;
                            }
                        }
                    }
                    text.push_str(&delta);
                    let d = json!({"content_index": 0, "delta": delta, "item_id": msg_id, "logprobs": [], "output_index": 0});
                    if tx.send(event("response.output_text.delta", d, &mut seq)).await.is_err() {
                        return; // the client went away; dropping rx aborts the request
                    }
                }
                TokenEvent::Done(u) => {
                    usage = Some(u);
                    break;
                }
            }
        }
        let Some(u) = usage else { return };
        let mut output = json!([]);
        if opened {
            let item = message_item(&msg_id, &text, true);
            let done = [
                (
                    "response.output_text.done",
                    json!({"content_index": 0, "item_id": msg_id, "logprobs": [], "output_index": 0, "text": text}),
                ),
                (
                    "response.content_part.done",
                    json!({"content_index": 0, "item_id": msg_id, "output_index": 0,
                        "part": {"annotations": [], "text": text, "type": "output_text", "logprobs": null}}),
                ),
                ("response.output_item.done", json!({"item": item, "output_index": 0})),
            ];
            for (kind, data) in done {
                if tx.send(event(kind, data, &mut seq)).await.is_err() {
                    return;
                }
            }
            output = json!([item]);
        }
        let completed = object(&t, "completed", output, Some(&u));
        if t.store {
            let mut tokens = t.prompt.clone();
            tokens.extend(ids);
            store.put(&t.id, tokens, completed.clone());
        }
        let _ = tx.send(event("response.completed", json!({"response": completed}), &mut seq)).await;
    });
    sse_response(out)
}

/// `GET /v1/responses/{id}`.
pub fn get(store: &ResponseStore, id: &str) -> Response {
    let found = store.lock().get(id).map(|s| s.object.clone());
    found.map_or_else(|| not_found(id), |v| json_response(&v))
}

/// `POST /v1/responses/{id}/cancel`: a queued background response is cancelled; any other
/// stored one is 400.
pub fn cancel(store: &ResponseStore, id: &str) -> Response {
    let mut guard = store.lock();
    let Some(s) = guard.get_mut(id) else {
        return not_found(id);
    };
    let status = s.object["status"].as_str().unwrap_or_default();
    if status != "queued" && status != "in_progress" {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("response_id"),
            "Cannot cancel a synchronous response.",
        );
    }
    s.object["status"] = json!("cancelled");
    let v = s.object.clone();
    drop(guard);
    if let Some(task) = store.running.lock().unwrap_or_else(|p| p.into_inner()).remove(id) {
        task.abort();
    }
    json_response(&v)
}

/// 16 lowercase hex characters, as vLLM's `random_uuid()`, unique to this process (the clock
/// and a sequence, hashed): the ids the simulator gives its answers.
pub fn hex16() -> String {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let x = xxhash_rust::xxh64::xxh64(
        &[n.to_le_bytes().as_slice(), &seq.to_le_bytes()].concat(),
        u64::from(std::process::id()),
    );
    format!("{x:016x}")
}
