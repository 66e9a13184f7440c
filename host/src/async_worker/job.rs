//! The job and result formats, and what each gateway answer means for a job.
//!
//! A job is llm-d-async's request shape: `{id, created, deadline, payload, metadata}`, with
//! `deadline` and `created` in Unix seconds, `payload` the OpenAI request body and `metadata`
//! string pairs (`tenant`, `objective`). Two optional fields: `endpoint`, the API path (default
//! `/v1/chat/completions`), and `headers`, extra request headers.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The API paths a job may name: what the gateway schedules.
pub const ENDPOINTS: &[&str] = &["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"];

/// Headers a job may not set: the worker sets these itself, and hop-by-hop ones are not a
/// request's to choose.
const RESERVED_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "upgrade",
    "x-attache-tenant",
    "x-attache-async-job",
    "x-llm-d-inference-objective",
];

fn header_value_ok(v: &str) -> bool {
    reqwest::header::HeaderValue::from_str(v).is_ok()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Job {
    pub id: String,
    #[serde(default)]
    pub created: Option<f64>,
    /// Unix seconds.
    pub deadline: f64,
    pub payload: serde_json::Map<String, Value>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub endpoint: Option<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

impl Job {
    /// Parse and check a job body; the error is the dead-letter reason.
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        let job: Job = serde_json::from_slice(body).map_err(|e| format!("malformed job: {e}"))?;
        if job.id.is_empty() || job.id.len() > 256 || !header_value_ok(&job.id) {
            return Err("malformed job: id must be 1 to 256 bytes with no control characters".into());
        }
        if !job.deadline.is_finite() || job.deadline <= 0.0 {
            return Err("malformed job: deadline must be a positive Unix time in seconds".into());
        }
        let endpoint = job.endpoint();
        if !ENDPOINTS.contains(&endpoint) {
            return Err(format!("malformed job: endpoint {endpoint:?} is not one of {ENDPOINTS:?}"));
        }
        for (name, value) in &job.headers {
            let lower = name.to_ascii_lowercase();
            let bad_name = reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_err();
            if RESERVED_HEADERS.contains(&lower.as_str()) || bad_name || !header_value_ok(value) {
                return Err(format!("malformed job: header {name:?} is reserved or invalid"));
            }
        }
        for key in ["tenant", "objective"] {
            if job.metadata.get(key).is_some_and(|v| v.is_empty() || !header_value_ok(v)) {
                return Err(format!("malformed job: metadata {key} must be a non-empty header value"));
            }
        }
        if !job.payload.contains_key("model") {
            return Err("malformed job: payload has no model".into());
        }
        Ok(job)
    }

    pub fn endpoint(&self) -> &str {
        self.endpoint.as_deref().unwrap_or(ENDPOINTS[0])
    }

    pub fn deadline_ms(&self) -> i64 {
        (self.deadline * 1000.0) as i64
    }
}

/// How a job ended, as written to the result store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Completed,
    Expired,
    DeadLettered,
    /// Stopped on request (`Queue::cancel`): before it ran, or while it ran.
    Cancelled,
}

/// The result record: `{id, status, status_code, body, error, attempts, finished}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobResult {
    pub id: String,
    pub status: Status,
    /// The gateway's last HTTP status; 0 when the job was never answered.
    pub status_code: u16,
    /// The gateway's answer (JSON when it was JSON, else the text).
    pub body: Value,
    pub error: Option<String>,
    pub attempts: u32,
    /// Unix seconds.
    pub finished: f64,
}

/// What to do with a job after one dispatch.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// 2xx: write the result.
    Done,
    /// The gateway shed it (429, 503): back off and try again without counting an attempt,
    /// because the job did nothing wrong; the pool was busy.
    Shed,
    /// A timeout, a 5xx or a broken connection: back off and count an attempt.
    Failed(String),
    /// A 4xx other than 408 and 429: the request itself is refused, so no retry can help.
    Refused(String),
}

/// Classify a gateway answer (`None`: no answer, `error` says why).
pub fn classify(status: Option<u16>, error: Option<&str>) -> Outcome {
    match status {
        Some(s) if (200..300).contains(&s) => Outcome::Done,
        Some(429 | 503) => Outcome::Shed,
        Some(408) => Outcome::Failed("gateway answered 408".into()),
        Some(s) if (400..500).contains(&s) => Outcome::Refused(format!("gateway refused the request with {s}")),
        Some(s) => Outcome::Failed(format!("gateway answered {s}")),
        None => Outcome::Failed(error.unwrap_or("no answer").to_string()),
    }
}

/// Exponential backoff with equal jitter: half of `base × 2^(attempt-1)` (capped at `max`) plus
/// a random share of the other half. `noise` is in [0, 1).
pub fn backoff(attempt: u32, base: Duration, max: Duration, noise: f64) -> Duration {
    let exp = base.saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
    let cap = exp.min(max);
    cap / 2 + cap.mul_f64(noise.clamp(0.0, 1.0) / 2.0)
}

/// The body of an answer as a result field: JSON when it parses, else text.
pub fn body_value(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_llm_d_async_jobs() {
        let j = Job::parse(
            br#"{"id":"a1","created":1.5,"deadline":2000000000,"payload":{"model":"m","messages":[]},
                "metadata":{"tenant":"acme","objective":"batch"}}"#,
        )
        .unwrap();
        assert_eq!(j.id, "a1");
        assert_eq!(j.endpoint(), "/v1/chat/completions");
        assert_eq!(j.deadline_ms(), 2_000_000_000_000);
        assert_eq!(j.metadata["tenant"], "acme");
    }

    #[test]
    fn refuses_bad_jobs_with_a_reason() {
        let cases: &[(&[u8], &str)] = &[
            (b"not json", "malformed job"),
            (br#"{"id":"","deadline":1,"payload":{"model":"m"}}"#, "id must be"),
            (br#"{"id":"x","deadline":-1,"payload":{"model":"m"}}"#, "deadline"),
            (br#"{"id":"x","deadline":1,"payload":{}}"#, "no model"),
            (br#"{"id":"x","deadline":1,"payload":"text"}"#, "malformed job"),
            (br#"{"id":"x","deadline":1,"payload":{"model":"m"},"endpoint":"/admin"}"#, "endpoint"),
            (br#"{"id":"x","deadline":1,"payload":{"model":"m"},"headers":{"Host":"a"}}"#, "reserved"),
            (br#"{"id":"x","deadline":1,"payload":{"model":"m"},"headers":{"x-a":"1\n2"}}"#, "reserved or invalid"),
            (br#"{"id":"x\n","deadline":1,"payload":{"model":"m"}}"#, "control characters"),
            (br#"{"id":"x","deadline":1,"payload":{"model":"m"},"metadata":{"tenant":"a\rb"}}"#, "metadata tenant"),
            (br#"{"id":"x","deadline":1,"payload":{"model":"m"},"surprise":1}"#, "unknown field"),
        ];
        for (body, want) in cases {
            let e = Job::parse(body).unwrap_err();
            assert!(e.contains(want), "{e} should mention {want}");
        }
    }

    #[test]
    fn classifies_answers() {
        assert_eq!(classify(Some(200), None), Outcome::Done);
        assert_eq!(classify(Some(429), None), Outcome::Shed);
        assert_eq!(classify(Some(503), None), Outcome::Shed);
        assert!(matches!(classify(Some(400), None), Outcome::Refused(_)));
        assert!(matches!(classify(Some(408), None), Outcome::Failed(_)));
        assert!(matches!(classify(Some(500), None), Outcome::Failed(_)));
        assert_eq!(classify(None, Some("reset")), Outcome::Failed("reset".into()));
    }

    #[test]
    fn backoff_doubles_to_the_cap_with_jitter_inside_it() {
        let (b, m) = (Duration::from_secs(2), Duration::from_secs(60));
        assert_eq!(backoff(1, b, m, 0.0), Duration::from_secs(1));
        assert_eq!(backoff(1, b, m, 0.999_999).as_millis(), 1999);
        assert_eq!(backoff(3, b, m, 0.0), Duration::from_secs(4));
        assert_eq!(backoff(10, b, m, 0.0), Duration::from_secs(30));
        assert!(backoff(40, b, m, 0.5) <= m);
    }

    #[test]
    fn body_is_json_when_it_parses() {
        assert_eq!(body_value(br#"{"a":1}"#)["a"], 1);
        assert_eq!(body_value(b"data: x"), Value::String("data: x".into()));
    }
}
