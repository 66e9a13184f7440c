//! Typed errors, and the one place where an error becomes an HTTP status and a JSON body.
//!
//! Bodies follow OpenAI's error shape, as vLLM returns it:
//! `{"error": {"message": .., "type": .., "param": .., "code": <status>}}`; on Anthropic's
//! Messages routes, Anthropic's shape (`{"type": "error", "error": {"type": .., "message": ..}}`),
//! because Anthropic's clients parse that one ([`ErrorResponse::shaped`]).

use thiserror::Error;

/// The request body could not be turned into request features.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum RequestError {
    #[error("request body is not valid JSON: {0}")]
    MalformedJson(String),
    #[error("request body must be a JSON object")]
    NotAnObject,
    #[error("request body is empty")]
    EmptyBody,
    #[error("field `model` is required and must be a non-empty string")]
    MissingModel,
    #[error("field `{0}` is required")]
    MissingField(&'static str),
    #[error("field `{field}` has an invalid value: {detail}")]
    InvalidField { field: &'static str, detail: String },
    #[error("request body is {size} bytes, over the limit of {limit} bytes")]
    BodyTooLarge { size: usize, limit: usize },
}

/// Check that a body is a JSON object, with a typed error for what it is instead.
pub(crate) fn check_object(body: &[u8]) -> Result<(), RequestError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(RequestError::EmptyBody);
    }
    let first = body.iter().find(|b| !b.is_ascii_whitespace()).copied();
    if first != Some(b'{') {
        // Distinguish "not JSON at all" from "JSON but not an object" for a clearer message.
        return match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            Ok(_) => Err(RequestError::NotAnObject),
            Err(e) => Err(RequestError::MalformedJson(e.to_string())),
        };
    }
    Ok(())
}

/// A serde error as a typed request error: the wrong type somewhere, or not JSON.
pub(crate) fn body_error(e: &serde_json::Error) -> RequestError {
    if e.is_data() {
        RequestError::InvalidField { field: "body", detail: e.to_string() }
    } else {
        RequestError::MalformedJson(e.to_string())
    }
}

/// No endpoint could be chosen.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ScheduleError {
    #[error("The model `{0}` does not exist.")]
    UnknownModel(String),
    #[error("no ready endpoint in the inference pool")]
    NoEndpoints,
    #[error("no endpoint the gateway allows (x-gateway-destination-endpoint-subset) can serve the request")]
    NoneInSubset,
}

/// What the filter sends back when it answers a request itself.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorResponse {
    pub status: u16,
    /// A short machine-readable reason, also sent as `x-attache-error`.
    pub reason: &'static str,
    /// The JSON body.
    pub body: String,
    /// The human-readable message the body carries.
    pub message: String,
}

/// Which API family's error body a client expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErrorShape {
    /// OpenAI's (and vLLM's): `{"error": {"message", "type", "param", "code"}}`.
    #[default]
    OpenAi,
    /// Anthropic's: `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
}

/// Anthropic's error type for an HTTP status (its API's documented errors).
pub fn anthropic_error_type(status: u16) -> &'static str {
    match status {
        400 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

impl ErrorResponse {
    pub fn new(status: u16, reason: &'static str, kind: &str, param: Option<&str>, message: &str) -> Self {
        let body = serde_json::json!({
            "error": {
                "message": message,
                "type": kind,
                "param": param,
                "code": status,
            }
        })
        .to_string();
        Self { status, reason, body, message: message.to_owned() }
    }

    /// The same refusal in `shape`: status, reason and message kept, the body rewritten.
    #[must_use]
    pub fn shaped(self, shape: ErrorShape) -> Self {
        match shape {
            ErrorShape::OpenAi => self,
            ErrorShape::Anthropic => {
                let body = serde_json::json!({
                    "type": "error",
                    "error": {"type": anthropic_error_type(self.status), "message": self.message},
                })
                .to_string();
                Self { body, ..self }
            }
        }
    }
}

impl From<&RequestError> for ErrorResponse {
    fn from(e: &RequestError) -> Self {
        let msg = e.to_string();
        match e {
            RequestError::BodyTooLarge { .. } => {
                ErrorResponse::new(413, "body_too_large", "RequestEntityTooLargeError", None, &msg)
            }
            RequestError::MalformedJson(_) | RequestError::NotAnObject | RequestError::EmptyBody => {
                ErrorResponse::new(400, "malformed_body", "BadRequestError", None, &msg)
            }
            RequestError::MissingModel => {
                ErrorResponse::new(400, "missing_model", "BadRequestError", Some("model"), &msg)
            }
            RequestError::MissingField(f) | RequestError::InvalidField { field: f, .. } => {
                ErrorResponse::new(400, "invalid_field", "BadRequestError", Some(f), &msg)
            }
        }
    }
}

impl From<&ScheduleError> for ErrorResponse {
    fn from(e: &ScheduleError) -> Self {
        let msg = e.to_string();
        match e {
            ScheduleError::UnknownModel(_) => {
                ErrorResponse::new(404, "unknown_model", "NotFoundError", Some("model"), &msg)
            }
            ScheduleError::NoEndpoints => {
                ErrorResponse::new(503, "no_endpoints", "ServiceUnavailableError", None, &msg)
            }
            ScheduleError::NoneInSubset => {
                ErrorResponse::new(503, "no_endpoint_in_subset", "ServiceUnavailableError", None, &msg)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_openai_shape() {
        let r = ErrorResponse::from(&ScheduleError::UnknownModel("nope".into()));
        assert_eq!(r.status, 404);
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
        assert_eq!(v["error"]["type"], "NotFoundError");
        assert_eq!(v["error"]["code"], 404);
        assert_eq!(v["error"]["param"], "model");
        assert!(v["error"]["message"].as_str().unwrap_or("").contains("nope"));

        assert_eq!(ErrorResponse::from(&RequestError::MalformedJson("x".into())).status, 400);
        assert_eq!(ErrorResponse::from(&RequestError::BodyTooLarge { size: 2, limit: 1 }).status, 413);
        assert_eq!(ErrorResponse::from(&ScheduleError::NoEndpoints).status, 503);
    }

    #[test]
    fn anthropic_shape_keeps_status_reason_and_message() {
        for (e, status, kind) in [
            (ErrorResponse::from(&RequestError::MissingModel), 400, "invalid_request_error"),
            (ErrorResponse::from(&ScheduleError::UnknownModel("nope".into())), 404, "not_found_error"),
            (ErrorResponse::from(&RequestError::BodyTooLarge { size: 2, limit: 1 }), 413, "request_too_large"),
            (ErrorResponse::new(429, "shed", "rate_limit_error", None, "slow down"), 429, "rate_limit_error"),
            (ErrorResponse::from(&ScheduleError::NoEndpoints), 503, "overloaded_error"),
        ] {
            let (reason, message) = (e.reason, e.message.clone());
            let a = e.shaped(ErrorShape::Anthropic);
            assert_eq!((a.status, a.reason), (status, reason));
            let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
            assert_eq!(v["type"], "error");
            assert_eq!(v["error"]["type"], kind, "{status}");
            assert_eq!(v["error"]["message"], message.as_str());
            assert!(v.get("code").is_none() && v["error"].get("param").is_none());
        }
    }
}
