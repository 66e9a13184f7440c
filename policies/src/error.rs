//! Typed errors, and the one place where an error becomes an HTTP status and a JSON body.
//!
//! Bodies follow OpenAI's error shape, as vLLM returns it:
//! `{"error": {"message": .., "type": .., "param": .., "code": <status>}}`.

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
        Self { status, reason, body }
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
}
