//! Response shapes every route of the simulator shares: vLLM's (OpenAI-shaped) error body and
//! a server-sent-events response.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tokio::sync::mpsc;

/// vLLM's error body.
pub fn error(status: StatusCode, kind: &str, param: Option<&str>, message: &str) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": param, "code": status.as_u16()}});
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// A 200 `text/event-stream` response whose frames come from `rx`.
pub fn sse_response(rx: mpsc::Receiver<Result<Bytes, Infallible>>) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .body(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
