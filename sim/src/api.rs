//! The OpenAI-compatible HTTP API of one simulated engine, shaped like vLLM 0.32's output.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use attache_policies::chat_template::ChatMessage;
use attache_policies::prompt_tokens::PromptTokenizer;
use attache_policies::request::{self, Api, Prompt};
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::engine::{Engine, SimRequest, TokenEvent, Usage};
use crate::metrics::{self, Gauges};
use crate::tokenizer;
use crate::wire::{error, sse_response};

const FINGERPRINT: &str = "vllm-0.32.0-attache-sim";

#[derive(Clone)]
pub struct AppState {
    pub engine: Engine,
    pub name: String,
    pub port: u16,
    /// `host:port` it listens on (engines on several loopback addresses share a port).
    pub address: String,
    /// The model's real tokenizer (and chat template), if given; else the byte-level fallback.
    pub tokenizer: Option<std::sync::Arc<std::sync::Mutex<PromptTokenizer>>>,
    /// This engine's Responses store: off unless `--responses-store` (vLLM's
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`), in the server's memory when on
    /// (crate::responses).
    pub responses: crate::responses::ResponseStore,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/responses", post(responses))
        .route(
            "/v1/responses/{id}",
            get(|State(st): State<AppState>, Path(id): Path<String>| async move {
                with_engine_headers(crate::responses::get(&st.responses, &id), &st)
            }),
        )
        .route(
            "/v1/responses/{id}/cancel",
            post(|State(st): State<AppState>, Path(id): Path<String>| async move {
                with_engine_headers(crate::responses::cancel(&st.responses, &id), &st)
            }),
        )
        .route("/v1/models", get(models))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/inference/v1/generate", post(generate))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        // vLLM answers 200 with no body; the engine headers say which engine answered.
        .route(
            "/health",
            get(|State(st): State<AppState>| async move { with_engine_headers(StatusCode::OK.into_response(), &st) }),
        )
        .route("/metrics", get(metrics_handler))
        .route("/metrics/", get(filtered_metrics_handler))
        .with_state(state)
}

pub(crate) fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn with_engine_headers(r: Response, st: &AppState) -> Response {
    identify(r, &st.port.to_string(), &st.name, &st.address)
}

/// The `x-inference-{port,pod,address}` headers that say which engine answered (both modes).
pub(crate) fn identify(mut r: Response, port: &str, pod: &str, address: &str) -> Response {
    let h = r.headers_mut();
    for (name, value) in [("x-inference-port", port), ("x-inference-pod", pod), ("x-inference-address", address)] {
        if let Ok(v) = HeaderValue::from_str(value) {
            h.insert(name, v);
        }
    }
    r
}

#[derive(Deserialize, Default)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    pub(crate) include_usage: Option<bool>,
}

/// The Responses fields only the simulator's answer echoes.
#[derive(Deserialize, Default)]
struct ResponsesExtra {
    #[serde(default)]
    instructions: Option<String>,
}

#[derive(Deserialize, Default)]
pub(crate) struct Extra {
    #[serde(default)]
    pub(crate) stream_options: Option<StreamOptions>,
    /// vLLM's P/D connector parameters (NIXL shape, `reference/engines.md` §6.4).
    #[serde(default)]
    kv_transfer_params: Option<Value>,
}

/// llm-d's P/D header, read by the decode pod's sidecar (emulated here).
const PREFILLER_HEADER: &str = "x-prefiller-host-port";

async fn completions(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let r = handle(&st, Api::Completions, &headers, &body).await;
    with_engine_headers(r, &st)
}

async fn chat(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let r = handle(&st, Api::ChatCompletions, &headers, &body).await;
    with_engine_headers(r, &st)
}

async fn responses(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let r = handle(&st, Api::Responses, &headers, &body).await;
    with_engine_headers(r, &st)
}

async fn messages(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let r = handle(&st, Api::Messages, &headers, &body).await;
    with_engine_headers(r, &st)
}

async fn generate(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let r = handle(&st, Api::Generate, &headers, &body).await;
    with_engine_headers(r, &st)
}

fn api_path(api: Api) -> &'static str {
    match api {
        Api::Completions => "/v1/completions",
        Api::ChatCompletions => "/v1/chat/completions",
        Api::Responses => "/v1/responses",
        Api::Messages => "/v1/messages",
        Api::CountTokens => "/v1/messages/count_tokens",
        Api::Generate => "/inference/v1/generate",
        Api::Tokenize => "/tokenize",
        Api::Detokenize => "/detokenize",
        Api::Render => "/v1/chat/completions/render",
    }
}

/// vLLM's error for `api`: Anthropic's envelope on the Messages routes, OpenAI's elsewhere.
fn api_error(api: Api, status: StatusCode, kind: &str, param: Option<&str>, message: &str) -> Response {
    match api {
        Api::Messages | Api::CountTokens => crate::messages::error(status, kind, message),
        _ => error(status, kind, param, message),
    }
}

/// The engine's ids for a parsed request: the real tokenizer's (the rules the filter uses,
/// `policies::prompt_tokens`), or the byte-level fallback's.
fn prompt_ids(st: &AppState, req: &request::InferenceRequest) -> Result<Vec<u32>, String> {
    match &st.tokenizer {
        Some(tk) => tk.lock().unwrap_or_else(|p| p.into_inner()).request(req, 0).map_err(|e| e.to_string()),
        None => Ok(match &req.prompt {
            Prompt::Text(t) => tokenizer::encode(t, true),
            Prompt::Tokens(t) => t.clone(),
        }),
    }
}

/// Anthropic's `count_tokens`: the rendered conversation's length, as vLLM counts it.
async fn count_tokens(State(st): State<AppState>, body: Bytes) -> Response {
    let req = match request::parse(Api::Messages, &body) {
        Ok(r) => r,
        Err(e) => return api_error(Api::CountTokens, StatusCode::BAD_REQUEST, "BadRequestError", None, &e.to_string()),
    };
    let cfg = st.engine.config();
    if req.model != cfg.model && !cfg.lora_adapters.contains(&req.model) {
        let msg = format!("The model `{}` does not exist.", req.model);
        return with_engine_headers(crate::messages::error(StatusCode::NOT_FOUND, "NotFoundError", &msg), &st);
    }
    let r = match prompt_ids(&st, &req) {
        Ok(ids) => crate::messages::count(ids.len()),
        Err(e) => api_error(Api::CountTokens, StatusCode::BAD_REQUEST, "BadRequestError", None, &e),
    };
    with_engine_headers(r, &st)
}

#[derive(Deserialize)]
struct DetokenizeBody {
    tokens: Vec<u32>,
}

/// vLLM's `/detokenize`: `{tokens}` → `{prompt}`.
async fn detokenize(State(st): State<AppState>, body: Bytes) -> Response {
    let b: DetokenizeBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, "BadRequestError", None, &format!("invalid body: {e}")),
    };
    let prompt: String = b.tokens.iter().map(|t| tokenizer::decode_token(*t)).collect();
    with_engine_headers(
        (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], json!({"prompt": prompt}).to_string())
            .into_response(),
        &st,
    )
}

/// The decode-side sidecar's prefill call (llm-d's `connector_nixlv2.go`): the original body
/// with `kv_transfer_params.do_remote_decode`, not streamed, one output token, sent to the
/// prefill engine. Returns the prompt tokens whose KV the prefill engine now holds, or why not.
async fn remote_prefill(prefiller: &str, api: Api, body: &[u8]) -> Result<usize, String> {
    let mut v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let obj = v.as_object_mut().ok_or("body is not an object")?;
    obj.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    obj.insert("stream".into(), json!(false));
    obj.remove("stream_options");
    if api == Api::Responses {
        obj.insert("max_output_tokens".into(), json!(1));
    } else if api == Api::Generate {
        if let Some(p) = obj.get_mut("sampling_params").and_then(Value::as_object_mut) {
            p.insert("max_tokens".into(), json!(1));
        }
    } else {
        obj.insert("max_tokens".into(), json!(1));
        if obj.contains_key("max_completion_tokens") {
            obj.insert("max_completion_tokens".into(), json!(1));
        }
    }
    let url = format!("http://{prefiller}{}", api_path(api));
    let http =
        reqwest::Client::builder().timeout(std::time::Duration::from_secs(120)).build().map_err(|e| e.to_string())?;
    let resp = http
        .post(&url)
        .header("content-type", "application/json")
        .header("x-request-id", format!("prefill-{}", crate::responses::hex16()))
        .body(v.to_string())
        .send()
        .await
        .map_err(|e| format!("prefill call to {url}: {e}"))?;
    if !resp.status().is_success() {
        return Err(format!("prefill call to {url}: status {}", resp.status()));
    }
    let r: Value = resp.json().await.map_err(|e| format!("prefill response: {e}"))?;
    let p = &r["kv_transfer_params"];
    let complete = ["remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port"]
        .iter()
        .all(|k| !p[*k].is_null());
    if p["do_remote_prefill"] != json!(true) || !complete {
        return Err(format!("prefill response without usable kv_transfer_params: {p}"));
    }
    p["remote_num_tokens"].as_u64().map(|n| n as usize).ok_or_else(|| "no remote_num_tokens".to_owned())
}

async fn models(State(st): State<AppState>) -> Response {
    let cfg = st.engine.config();
    let mut data = vec![json!({
        "id": cfg.model, "object": "model", "created": now_s(), "owned_by": "vllm",
        "root": cfg.model, "parent": null, "max_model_len": cfg.max_model_len,
    })];
    // LoRA modules are listed with the base model as parent, as vLLM does.
    data.extend(cfg.lora_adapters.iter().map(|a| {
        json!({"id": a, "object": "model", "created": now_s(), "owned_by": "vllm", "root": a,
               "parent": cfg.model, "max_model_len": cfg.max_model_len})
    }));
    let body = json!({"object": "list", "data": data});
    with_engine_headers(
        (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response(),
        &st,
    )
}

#[derive(Deserialize)]
struct LoraBody {
    lora_name: String,
    #[serde(default)]
    #[allow(dead_code)] // the path vLLM loads from; the simulator has no weights
    lora_path: Option<String>,
}

/// vLLM's runtime LoRA loading (with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): 200 with a plain-text
/// success line; 400 with vLLM's JSON error when the adapter is already loaded or the body is
/// wrong.
async fn load_lora_adapter(State(st): State<AppState>, body: axum::body::Bytes) -> Response {
    let Ok(b) = serde_json::from_slice::<LoraBody>(&body) else {
        return error(StatusCode::BAD_REQUEST, "BadRequestError", None, "lora_name and lora_path are required");
    };
    if !st.engine.load_lora(&b.lora_name) {
        let msg = format!("The lora adapter '{}' has already been loaded.", b.lora_name);
        return error(StatusCode::BAD_REQUEST, "InvalidUserInput", None, &msg);
    }
    (StatusCode::OK, format!("Success: LoRA adapter '{}' added successfully.", b.lora_name)).into_response()
}

async fn unload_lora_adapter(State(st): State<AppState>, body: axum::body::Bytes) -> Response {
    let Ok(b) = serde_json::from_slice::<LoraBody>(&body) else {
        return error(StatusCode::BAD_REQUEST, "BadRequestError", None, "lora_name is required");
    };
    if !st.engine.unload_lora(&b.lora_name) {
        let msg = format!("The lora adapter '{}' cannot be found.", b.lora_name);
        return error(StatusCode::NOT_FOUND, "NotFoundError", None, &msg);
    }
    (StatusCode::OK, format!("Success: LoRA adapter '{}' removed successfully.", b.lora_name)).into_response()
}

#[derive(Deserialize)]
struct TokenizeBody {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
}

/// vLLM's `/tokenize`: a text prompt (BOS added by default) or chat messages (rendered with the
/// chat template, no special tokens added by default).
async fn tokenize(State(st): State<AppState>, body: Bytes) -> Response {
    let b: TokenizeBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, "BadRequestError", None, &format!("invalid JSON: {e}")),
    };
    let cfg = st.engine.config();
    if let Some(m) = b.model.as_deref().filter(|m| *m != cfg.model) {
        return error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            Some("model"),
            &format!("The model `{m}` does not exist."),
        );
    }
    let ids = match (&b.prompt, &b.messages, &st.tokenizer) {
        (Some(p), None, Some(tk)) => {
            tk.lock().unwrap_or_else(|e| e.into_inner()).text(p, b.add_special_tokens.unwrap_or(true), 0)
        }
        (Some(p), None, None) => tokenizer::encode(p, b.add_special_tokens.unwrap_or(true)),
        (None, Some(ms), Some(tk)) => {
            match tk.lock().unwrap_or_else(|e| e.into_inner()).conversation(
                ms,
                b.add_generation_prompt.unwrap_or(true),
                0,
            ) {
                Ok(ids) => ids,
                Err(e) => return error(StatusCode::BAD_REQUEST, "BadRequestError", None, &e.to_string()),
            }
        }
        (None, Some(_), None) => {
            return error(StatusCode::BAD_REQUEST, "BadRequestError", None, "this engine has no chat template")
        }
        _ => return error(StatusCode::BAD_REQUEST, "BadRequestError", None, "give either `prompt` or `messages`"),
    };
    let body = json!({"count": ids.len(), "max_model_len": cfg.max_model_len, "tokens": ids, "token_strs": null});
    with_engine_headers(
        (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response(),
        &st,
    )
}

async fn metrics_handler(State(st): State<AppState>) -> Response {
    metrics_page(&st, None)
}

async fn filtered_metrics_handler(State(st): State<AppState>, RawQuery(q): RawQuery) -> Response {
    metrics_page(&st, q.as_deref())
}

fn metrics_page(st: &AppState, query: Option<&str>) -> Response {
    let text = {
        let s = st.engine.lock();
        let g = Gauges {
            running: s.num_running(),
            waiting: s.num_waiting(),
            kv_usage: s.pool.usage(),
            running_loras: s.active_loras(),
            waiting_loras: s.waiting_loras(),
        };
        metrics::render_query(&s.cfg, &s.stats, &g, query)
    };
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

async fn handle(st: &AppState, api: Api, headers: &HeaderMap, body: &[u8]) -> Response {
    let req = match request::parse(api, body) {
        Ok(r) => r,
        Err(e) => return api_error(api, StatusCode::BAD_REQUEST, "BadRequestError", None, &e.to_string()),
    };
    let extra: Extra = serde_json::from_slice(body).unwrap_or_default();
    let cfg = st.engine.config();
    if let Some(code) = cfg.fail_status {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return api_error(api, status, "InternalServerError", None, "injected fault (--fail-status)");
    }
    let lora = cfg.lora_adapters.iter().find(|a| **a == req.model).cloned();
    // `generate` may name no model: the base model serves it.
    let unnamed = req.model.is_empty() && api == Api::Generate;
    if req.model != cfg.model && lora.is_none() && !unnamed {
        return api_error(
            api,
            StatusCode::NOT_FOUND,
            "NotFoundError",
            Some("model"),
            &format!("The model `{}` does not exist.", req.model),
        );
    }
    let prompt = match prompt_ids(st, &req) {
        Ok(ids) => ids,
        Err(e) => return api_error(api, StatusCode::BAD_REQUEST, "BadRequestError", None, &e),
    };
    // Responses API: background needs the store; continue a conversation this engine stored,
    // as vLLM does (with the store off, every id is unknown).
    if api == Api::Responses {
        if let Some(refused) = crate::responses::check_background(&st.responses, req.background, req.store) {
            return refused;
        }
    }
    let prompt = match (&req.previous_response_id, api) {
        (Some(prev), Api::Responses) => match st.responses.tokens(prev) {
            Some(mut earlier) => {
                earlier.extend_from_slice(&prompt);
                earlier
            }
            None => return crate::responses::not_found(prev),
        },
        _ => prompt,
    };
    let max_tokens = req.max_tokens.unwrap_or(16) as usize;
    if prompt.len() + max_tokens > cfg.max_model_len {
        let msg = format!(
            "This model's maximum context length is {} tokens. However, your request has {} input tokens and requests {} output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value={})",
            cfg.max_model_len,
            prompt.len(),
            max_tokens,
            prompt.len()
        );
        return api_error(api, StatusCode::BAD_REQUEST, "BadRequestError", Some("input_tokens"), &msg);
    }
    // P/D, decode side: run the prefill on the named engine first, then pull its KV.
    let prefiller = headers.get(PREFILLER_HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let mut remote_tokens = 0;
    if let Some(p) = &prefiller {
        st.engine.lock().stats.remote_prefill_requests += 1;
        match remote_prefill(p, api, body).await {
            Ok(n) => remote_tokens = n,
            Err(e) => {
                // As llm-d's sidecar does on prefill errors: decode alone, prefilling here.
                tracing::warn!(prefiller = %p, error = %e, "remote prefill failed; prefilling locally");
                st.engine.lock().stats.remote_prefill_fallbacks += 1;
            }
        }
    }
    // P/D, prefill side: answer with the parameters a decode engine needs to pull the KV.
    let remote_decode = extra.kv_transfer_params.as_ref().is_some_and(|p| p["do_remote_decode"] == json!(true));
    let transfer = remote_decode.then(|| {
        st.engine.lock().stats.remote_decode_requests += 1;
        let bs = cfg.block_size.max(1);
        json!({"do_remote_prefill": true, "do_remote_decode": false,
               "remote_block_ids": [(0..prompt.len().div_ceil(bs)).collect::<Vec<usize>>()],
               "remote_engine_id": st.name, "remote_request_id": format!("cmpl-{}", crate::responses::hex16()),
               "remote_host": "127.0.0.1", "remote_port": st.port, "remote_num_tokens": prompt.len(),
               "tp_size": 1, "dcp_size": 1, "pp_size": 1})
    });
    let turn = (api == Api::Responses).then(|| crate::responses::Turn {
        id: format!("resp_{}", crate::responses::hex16()),
        model: if req.model.is_empty() { cfg.model.clone() } else { req.model.clone() },
        created: now_s(),
        instructions: serde_json::from_slice::<ResponsesExtra>(body).ok().and_then(|e| e.instructions),
        previous_response_id: req.previous_response_id.clone(),
        max_output_tokens: req.max_tokens.unwrap_or(16) as usize,
        background: req.background,
        store: req.store && st.responses.enabled(),
        prompt: prompt.clone(),
    });
    let prompt_tokens = prompt.len();
    let (tx, rx) = mpsc::unbounded_channel();
    st.engine.submit(SimRequest { prompt, max_tokens, tx, remote_tokens, lora });
    let include_usage = extra.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
    let model = if req.model.is_empty() { cfg.model.clone() } else { req.model.clone() };
    let streamed = req.stream && !remote_decode;
    let mut r = match (api, streamed) {
        (Api::Messages, _) => {
            let id = format!("chatcmpl-{}", crate::responses::hex16());
            let tool = serde_json::from_slice::<crate::messages::Extra>(body).unwrap_or_default().forced_tool();
            if streamed {
                crate::messages::stream(id, model, prompt_tokens, rx, tool)
            } else {
                crate::messages::full(id, model, rx, tool, transfer).await
            }
        }
        (Api::Generate, true) => {
            crate::generate::stream(format!("generate-tokens-{}", crate::responses::hex16()), rx, include_usage)
        }
        (Api::Generate, false) => {
            crate::generate::full(
                format!("generate-tokens-{}", crate::responses::hex16()),
                model,
                now_s(),
                rx,
                transfer,
            )
            .await
        }
        (Api::Responses, _) => match turn {
            Some(t) => crate::responses::respond(&st.responses, t, streamed, rx).await,
            None => non_stream(api, model, rx, transfer).await,
        },
        (_, false) => non_stream(api, model, rx, transfer).await,
        (_, true) => stream(api, model, rx, include_usage),
    };
    if let Some(v) = prefiller.and_then(|p| HeaderValue::from_str(&p).ok()) {
        // Lets tests see that this engine decoded for a remote prefill.
        r.headers_mut().insert("x-attache-sim-prefiller", v);
    }
    r
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "completion_tokens": u.completion_tokens,
        "prompt_tokens_details": if u.cached_tokens > 0 { json!({"cached_tokens": u.cached_tokens}) } else { Value::Null },
        "completion_tokens_details": null,
    })
}

pub(crate) async fn non_stream(
    api: Api,
    model: String,
    mut rx: mpsc::UnboundedReceiver<TokenEvent>,
    kv_transfer: Option<Value>,
) -> Response {
    let mut text = String::new();
    let mut usage = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            TokenEvent::Tokens(ts, _) => {
                ts.iter().for_each(|t| text.push_str(tokenizer::decode_token(*t)));
            }
            TokenEvent::Done(u) => {
                usage = Some(u);
                break;
            }
        }
    }
    let Some(u) = usage else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError", None, "engine dropped the request");
    };
    let created = now_s();
    let kv_transfer = kv_transfer.unwrap_or(Value::Null);
    let body = match api {
        // Messages and generate answer in their own shapes (crate::messages, crate::generate);
        // utility routes never generate.
        Api::Completions
        | Api::Messages
        | Api::CountTokens
        | Api::Generate
        | Api::Tokenize
        | Api::Detokenize
        | Api::Render
        | Api::Responses => json!({
            "id": format!("cmpl-{}", crate::responses::hex16()), "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": u.finish_reason, "stop_reason": null,
                         "token_ids": null, "prompt_logprobs": null, "prompt_token_ids": null, "routed_experts": null}],
            "service_tier": null, "system_fingerprint": FINGERPRINT, "usage": usage_json(&u),
            "kv_transfer_params": kv_transfer.clone(), "ec_transfer_params": null, "metrics": null,
        }),
        Api::ChatCompletions => json!({
            "id": format!("chatcmpl-{}", crate::responses::hex16()), "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": null, "annotations": null,
                         "audio": null, "function_call": null, "reasoning": null},
                         "logprobs": null, "finish_reason": u.finish_reason, "stop_reason": null, "token_ids": null, "routed_experts": null}],
            "service_tier": null, "system_fingerprint": FINGERPRINT, "usage": usage_json(&u),
            "prompt_logprobs": null, "prompt_token_ids": null, "prompt_text": null,
            "kv_transfer_params": kv_transfer.clone(), "ec_transfer_params": null, "metrics": null,
        }),
    };
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

fn sse(v: &Value) -> Result<Bytes, Infallible> {
    Ok(Bytes::from(format!("data: {v}\n\n")))
}

pub(crate) fn stream(
    api: Api,
    model: String,
    mut rx: mpsc::UnboundedReceiver<TokenEvent>,
    include_usage: bool,
) -> Response {
    let (out_tx, out_rx) = mpsc::channel::<Result<Bytes, Infallible>>(64);
    let created = now_s();
    let chat = api == Api::ChatCompletions;
    let id = if chat {
        format!("chatcmpl-{}", crate::responses::hex16())
    } else {
        format!("cmpl-{}", crate::responses::hex16())
    };
    tokio::spawn(async move {
        let object = if chat { "chat.completion.chunk" } else { "text_completion" };
        if chat {
            let first = json!({"id": id, "object": object, "created": created, "model": model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}],
                "prompt_token_ids": null, "prompt_text": null});
            if out_tx.send(sse(&first)).await.is_err() {
                return;
            }
        }
        let finish: &'static str = "length";
        let chunk = |text: &str, finish: Option<&str>| -> Value {
            if chat {
                let mut c = json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish, "token_ids": null});
                if finish.is_some() {
                    c["stop_reason"] = Value::Null;
                }
                json!({"id": id, "object": object, "created": created, "model": model, "choices": [c]})
            } else {
                json!({"id": id, "object": object, "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null,
                                 "prompt_token_ids": null, "token_ids": null}]})
            }
        };
        // One chunk per hand-off from the engine (a token, or a stream-interval batch).
        while let Some(ev) = rx.recv().await {
            match ev {
                TokenEvent::Tokens(ts, last) => {
                    let text: String = ts.into_iter().map(tokenizer::decode_token).collect();
                    // vLLM carries finish_reason on the last token's chunk.
                    if out_tx.send(sse(&chunk(&text, last.then_some(finish)))).await.is_err() {
                        return; // client went away; dropping rx aborts the request
                    }
                }
                TokenEvent::Done(u) => {
                    if include_usage {
                        let v = json!({"id": id, "object": object, "created": created, "model": model, "choices": [],
                            "usage": {"prompt_tokens": u.prompt_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens,
                                      "completion_tokens": u.completion_tokens}, "system_fingerprint": FINGERPRINT});
                        let _ = out_tx.send(sse(&v)).await;
                    }
                    let _ = out_tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
                    return;
                }
            }
        }
    });
    sse_response(out_rx)
}

/// A listener with Nagle's algorithm off on every connection it accepts, as vLLM's server has
/// it (uvicorn runs on asyncio, which sets `TCP_NODELAY` on its TCP transports). Without it, a
/// response written in pieces (headers, then the body's chunks) waits on the client's delayed
/// ACK, about 40 ms on Linux, on a reused connection.
pub struct NoDelay(pub tokio::net::TcpListener);

impl axum::serve::Listener for NoDelay {
    type Io = tokio::net::TcpStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, addr) = axum::serve::Listener::accept(&mut self.0).await;
        if let Err(e) = io.set_nodelay(true) {
            tracing::warn!("sim: could not set TCP_NODELAY: {e}");
        }
        (io, addr)
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        axum::serve::Listener::local_addr(&self.0)
    }
}
