//! An OpenAI-style client for tests and benchmarks: sends a request, reads an SSE stream, and
//! measures time to first token. It also reads Anthropic's Messages streams (`event:` frames,
//! ending with `message_stop`) and vLLM's token-in `generate` streams (token ids, no text).

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::Value;

/// What one request produced.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub status: u16,
    /// Time to the first content chunk (streaming) or to the full response.
    pub ttft: Option<Duration>,
    pub total: Duration,
    /// Completion tokens, from the usage chunk or the response's `usage`.
    pub output_tokens: u64,
    /// The engine that served it (the simulator's `x-inference-port`).
    pub engine_port: Option<u16>,
    /// Its `host:port` (the simulator's `x-inference-address`).
    pub engine_address: Option<String>,
    /// The whole body (for errors and non-streaming responses).
    pub body: String,
    /// SSE `data:` payloads, in order (streaming only).
    pub events: Vec<String>,
    /// Whether the stream ended (`data: [DONE]`, or Anthropic's `message_stop`).
    pub done: bool,
    /// Transport error, if the request failed below HTTP.
    pub error: Option<String>,
    pub headers: Vec<(String, String)>,
}

impl Outcome {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.status == 200
    }

    /// A streamed Responses answer's response object (its `response.completed` event).
    pub fn completed_response(&self) -> Value {
        self.events
            .iter()
            .rev()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .find(|v| v["type"] == "response.completed")
            .map_or(Value::Null, |mut v| v["response"].take())
    }

    /// The assistant's text of a streamed chat response (its `delta.content` chunks, or a
    /// Messages stream's `text_delta`s).
    pub fn streamed_text(&self) -> String {
        self.events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter_map(|v| {
                v["choices"][0]["delta"]["content"].as_str().or_else(|| v["delta"]["text"].as_str()).map(str::to_owned)
            })
            .collect()
    }
}

/// POST `body` to `url` and read the whole response; SSE bodies are split into events.
pub async fn post(client: &reqwest::Client, url: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> Outcome {
    let start = Instant::now();
    let mut req = client.post(url).header("content-type", "application/json").body(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut out = Outcome::default();
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(e.to_string());
            out.total = start.elapsed();
            return out;
        }
    };
    out.status = resp.status().as_u16();
    out.headers = resp.headers().iter().map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string())).collect();
    out.engine_port = out.header("x-inference-port").and_then(|v| v.parse().ok());
    out.engine_address = out.header("x-inference-address").map(str::to_owned);
    let is_sse = out.header("content-type").is_some_and(|c| c.starts_with("text/event-stream"));
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(b) => {
                buf.extend_from_slice(&b);
                if is_sse {
                    while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
                        let ev: Vec<u8> = buf.drain(..pos + 2).collect();
                        let frame = String::from_utf8_lossy(&ev).trim().to_string();
                        out.body.push_str(&frame);
                        out.body.push_str("\n\n");
                        // A frame may name its event (`event: ...`) before its data line.
                        let Some(data) = frame.lines().find_map(|l| l.strip_prefix("data: ")) else { continue };
                        if data == "[DONE]" {
                            out.done = true;
                            continue;
                        }
                        if let Ok(v) = serde_json::from_str::<Value>(data) {
                            let nonempty = |x: &Value| x.as_str().is_some_and(|s| !s.is_empty());
                            let has_content = v["choices"].as_array().is_some_and(|c| {
                                c.iter().any(|c| {
                                    nonempty(&c["delta"]["content"])
                                        || nonempty(&c["text"])
                                        || c["token_ids"].as_array().is_some_and(|t| !t.is_empty())
                                })
                            }) || nonempty(&v["delta"]["text"])
                                || nonempty(&v["delta"]["partial_json"])
                                || (v["type"] == "response.output_text.delta" && nonempty(&v["delta"]));
                            if has_content && out.ttft.is_none() {
                                out.ttft = Some(start.elapsed());
                            }
                            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                                out.output_tokens = n;
                            }
                            if v["type"] == "message_delta" {
                                out.output_tokens = v["usage"]["output_tokens"].as_u64().unwrap_or(out.output_tokens);
                            }
                            if v["type"] == "response.completed" {
                                out.output_tokens = v["response"]["usage"]["output_tokens"].as_u64().unwrap_or(0);
                            }
                            out.done |= v["type"] == "message_stop" || v["type"] == "response.completed";
                        }
                        out.events.push(data.to_string());
                    }
                }
            }
            Err(e) => {
                out.error = Some(e.to_string());
                break;
            }
        }
    }
    if !is_sse {
        out.body = String::from_utf8_lossy(&buf).into_owned();
        if out.status == 200 {
            out.ttft = Some(start.elapsed());
            let v = out.json();
            out.output_tokens =
                v["usage"]["completion_tokens"].as_u64().or_else(|| v["usage"]["output_tokens"].as_u64()).unwrap_or(0);
        }
    }
    out.total = start.elapsed();
    out
}

/// A streaming chat request with usage reporting.
pub fn chat_body(model: &str, system: &str, user: &str, max_tokens: u64) -> Vec<u8> {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string()
    .into_bytes()
}
