//! Background responses (`background: true`) in gateway mode: the store keeps a queued
//! response at once, and the async worker (`attache async`, `docs/async.md`) runs the request
//! through the gateway as a sheddable job. The host watches the job's result and writes it
//! into the response, so `GET` shows `queued`, `in_progress`, then `completed`, `incomplete`,
//! `failed` or `cancelled`.
//!
//! - **The job.** Its id is the response's id, its payload the request with its conversation
//!   already resolved (no `previous_response_id`), `background` removed and `store: false` (the
//!   gateway keeps the background response itself, not the answer to the job), on
//!   `/v1/responses` with the configured objective.
//! - **Its state.** Waiting or backing off in the queue: `queued`; held by a worker:
//!   `in_progress`; a result: the engine's answer, or `failed` with the queue's reason
//!   (dead-lettered, expired), or `cancelled`. The host reads these in one round trip for
//!   every response it submitted, each `poll_ms`, and on demand for a response it did not
//!   submit (another host replica's, or one from before a restart).
//! - **Cancel.** `Queue::cancel`: a job not yet running ends at once; a running one is
//!   stopped by its worker, whose request (and the engine's work) is dropped.

use std::io::Read as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hashbrown::HashMap;
use serde_json::{json, Map, Value};

use crate::async_worker::job::{JobResult, Status};
use crate::async_worker::queue::{CancelVerdict, Queue};
use crate::async_worker::resp::RedisError;

/// `responses.background` in the host configuration.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BackgroundConfig {
    /// Accept `background: true` and run it on the async worker. Needs `responses.redis`, which
    /// the worker's queue shares (`attache async --redis` the same server).
    pub enabled: bool,
    /// The async queue's key prefix (`attache async --prefix`).
    pub prefix: String,
    /// The objective the jobs carry (`x-llm-d-inference-objective`): give it a negative
    /// priority in `flow.objectives`, so that background work is the sheddable band.
    pub objective: String,
    /// A job not answered this long after it was accepted ends `failed` (the queue's deadline).
    pub deadline_ms: u64,
    /// How often the host reads the state of the background responses it submitted.
    pub poll_ms: u64,
}

impl Default for BackgroundConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            prefix: "attache:async".into(),
            objective: "batch".into(),
            deadline_ms: 3_600_000,
            poll_ms: 200,
        }
    }
}

/// Counters of background responses.
#[derive(Default, Debug)]
pub struct Counters {
    pub submitted: AtomicU64,
    pub submit_failed: AtomicU64,
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    pub cancelled: AtomicU64,
}

/// The queue side of background responses.
pub struct Background {
    pub queue: Queue,
    pub config: BackgroundConfig,
    /// Responses this host submitted that have not ended: id → tenant.
    pending: Mutex<HashMap<String, String>>,
    pub counters: Counters,
}

/// What the queue says about one background response.
#[derive(Debug)]
pub enum JobState {
    Queued,
    Running,
    Ended(Box<JobResult>),
}

impl Background {
    pub fn new(redis: SocketAddr, config: BackgroundConfig) -> Self {
        Self {
            queue: Queue::new(redis, &config.prefix, Duration::from_secs(2)),
            config,
            pending: Mutex::default(),
            counters: Counters::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn track(&self, id: &str, tenant: &str) {
        self.lock().insert(id.to_owned(), tenant.to_owned());
    }

    /// Stop watching `id`; false if this host was not watching it.
    pub fn untrack(&self, id: &str) -> bool {
        self.lock().remove(id).is_some()
    }

    /// Up to `max` of the responses this host is watching: (id, tenant).
    pub fn watched(&self, max: usize) -> Vec<(String, String)> {
        self.lock().iter().take(max).map(|(i, t)| (i.clone(), t.clone())).collect()
    }

    pub fn watching(&self) -> usize {
        self.lock().len()
    }

    /// The queue's state of each of `ids`, in two round trips.
    pub async fn states(&self, ids: &[&str]) -> Result<Vec<JobState>, RedisError> {
        let results = self.queue.results_of(ids).await?;
        let running = self.queue.running(ids).await?;
        Ok(results
            .into_iter()
            .zip(running)
            .map(|(r, run)| match r {
                Some(r) => JobState::Ended(Box::new(r)),
                None if run => JobState::Running,
                None => JobState::Queued,
            })
            .collect())
    }

    pub async fn submit(&self, job: &[u8]) -> Result<(), RedisError> {
        self.queue.submit(&[job.to_vec()]).await
    }

    pub async fn cancel(&self, id: &str) -> Result<CancelVerdict, RedisError> {
        self.queue.cancel(id, "cancelled by the client").await
    }

    pub fn count_end(&self, status: &str) {
        let c = &self.counters;
        let counter = match status {
            "cancelled" => &c.cancelled,
            "failed" => &c.failed,
            _ => &c.completed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A new response id: `resp_` and 32 hex digits from the OS's randomness.
pub fn new_id() -> std::io::Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("resp_{hex}"))
}

pub fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// The queued response object for `request` (vLLM 0.32's response fields).
pub fn queued_object(id: &str, request: &Map<String, Value>, previous_id: Option<&str>, created: u64) -> Value {
    let get = |k: &str| request.get(k).cloned().unwrap_or(Value::Null);
    let or = |k: &str, d: Value| request.get(k).cloned().unwrap_or(d);
    json!({
        "id": id, "object": "response", "created_at": created, "status": "queued", "background": true,
        "model": get("model"), "instructions": get("instructions"), "metadata": get("metadata"),
        "max_output_tokens": get("max_output_tokens"), "previous_response_id": previous_id,
        "temperature": get("temperature"), "top_p": get("top_p"), "tools": or("tools", json!([])),
        "tool_choice": or("tool_choice", json!("auto")), "parallel_tool_calls": or("parallel_tool_calls", json!(true)),
        "truncation": or("truncation", json!("disabled")), "service_tier": "auto", "user": get("user"),
        "error": null, "incomplete_details": null, "usage": null, "output": [],
    })
}

/// The job that runs `request` for background response `id`.
pub fn job(id: &str, tenant: &str, mut request: Map<String, Value>, cfg: &BackgroundConfig) -> Value {
    request.remove("background");
    request.remove("previous_response_id");
    request.insert("store".into(), json!(false));
    request.insert("stream".into(), json!(false));
    let now = unix_now();
    let mut metadata = json!({"objective": cfg.objective});
    if !tenant.is_empty() {
        metadata["tenant"] = json!(tenant);
    }
    json!({
        "id": id, "created": now, "deadline": now + cfg.deadline_ms as f64 / 1000.0,
        "payload": request, "endpoint": "/v1/responses", "metadata": metadata,
    })
}

/// The response object once its job ended: `meta` is the queued object (without `output`).
/// Returns the new object without `output`, and the output items (the inner text of the
/// array).
pub fn ended_object(meta: &str, result: &JobResult) -> (String, String) {
    let mut obj: Map<String, Value> = serde_json::from_str(meta).unwrap_or_default();
    let mut output = Vec::new();
    match result.status {
        Status::Completed => match result.body.as_object() {
            Some(answer) => {
                let status = answer.get("status").and_then(Value::as_str).unwrap_or("completed");
                obj.insert("status".into(), json!(status));
                for k in ["usage", "incomplete_details", "error", "model"] {
                    if let Some(v) = answer.get(k) {
                        obj.insert(k.into(), v.clone());
                    }
                }
                output = answer.get("output").and_then(Value::as_array).cloned().unwrap_or_default();
            }
            None => fail(&mut obj, "server_error", "the engine's answer was not a response object"),
        },
        Status::Cancelled => {
            obj.insert("status".into(), json!("cancelled"));
        }
        Status::Expired => fail(&mut obj, "server_error", result.error.as_deref().unwrap_or("deadline passed")),
        Status::DeadLettered => {
            // A refusal's own message (the gateway's 4xx body), else the queue's reason.
            let said = result.body.pointer("/error/message").and_then(Value::as_str);
            fail(&mut obj, "server_error", said.or(result.error.as_deref()).unwrap_or("the request failed"));
        }
    }
    let output = serde_json::to_string(&output).unwrap_or_else(|_| "[]".into());
    (Value::Object(obj).to_string(), output[1..output.len() - 1].to_owned())
}

fn fail(obj: &mut Map<String, Value>, code: &str, message: &str) {
    obj.insert("status".into(), json!("failed"));
    obj.insert("error".into(), json!({"code": code, "message": message}));
}

/// The object once cancelled (before its job ended).
pub fn cancelled_object(meta: &str) -> String {
    let mut obj: Map<String, Value> = serde_json::from_str(meta).unwrap_or_default();
    obj.insert("status".into(), json!("cancelled"));
    Value::Object(obj).to_string()
}

/// The object marked running.
pub fn running_object(meta: &str) -> String {
    let mut obj: Map<String, Value> = serde_json::from_str(meta).unwrap_or_default();
    obj.insert("status".into(), json!("in_progress"));
    Value::Object(obj).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(status: Status, body: Value, error: Option<&str>) -> JobResult {
        JobResult {
            id: "resp_b".into(),
            status,
            status_code: 200,
            body,
            error: error.map(str::to_owned),
            attempts: 1,
            finished: 1.0,
        }
    }

    #[test]
    fn a_job_runs_the_resolved_request_unstored_on_the_sheddable_objective() {
        let req: Map<String, Value> = serde_json::from_value(json!({"model": "m", "input": [{"role": "user",
            "content": "hi"}], "background": true, "stream": true, "previous_response_id": "resp_a"}))
        .unwrap();
        let j = job("resp_b", "t-1", req, &BackgroundConfig::default());
        assert_eq!(
            j["payload"],
            json!({"model": "m", "input": [{"role": "user", "content": "hi"}], "store": false,
            "stream": false})
        );
        assert_eq!(j["metadata"], json!({"objective": "batch", "tenant": "t-1"}));
        assert_eq!(j["endpoint"], "/v1/responses");
        let left = j["deadline"].as_f64().unwrap() - j["created"].as_f64().unwrap();
        assert!((left - 3600.0).abs() < 1e-6);
        assert!(job("x", "", Map::new(), &BackgroundConfig::default())["metadata"].get("tenant").is_none());
    }

    #[test]
    fn the_queued_object_echoes_the_request_and_ends_as_its_result_says() {
        let req: Map<String, Value> =
            serde_json::from_value(json!({"model": "m", "instructions": "be brief", "max_output_tokens": 9})).unwrap();
        let q = queued_object("resp_b", &req, Some("resp_a"), 7);
        assert_eq!((q["status"].as_str(), q["background"].as_bool()), (Some("queued"), Some(true)));
        assert_eq!(
            (q["instructions"].as_str(), q["previous_response_id"].as_str()),
            (Some("be brief"), Some("resp_a"))
        );
        let mut meta = q.clone();
        meta.as_object_mut().unwrap().remove("output");
        let meta = meta.to_string();

        let answer = json!({"id": "resp_engine", "status": "completed", "usage": {"input_tokens": 3},
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "done"}]}]});
        let (obj, output) = ended_object(&meta, &result(Status::Completed, answer, None));
        let obj: Value = serde_json::from_str(&obj).unwrap();
        assert_eq!((obj["id"].as_str(), obj["status"].as_str()), (Some("resp_b"), Some("completed")));
        assert_eq!((obj["usage"]["input_tokens"].as_u64(), obj["created_at"].as_u64()), (Some(3), Some(7)));
        assert!(output.contains("\"done\"") && !output.starts_with('['), "{output}");

        let refused = json!({"error": {"message": "model 'x' not found"}});
        let (obj, output) = ended_object(&meta, &result(Status::DeadLettered, refused, Some("refused with 404")));
        let obj: Value = serde_json::from_str(&obj).unwrap();
        assert_eq!(
            (obj["status"].as_str(), obj["error"]["message"].as_str()),
            (Some("failed"), Some("model 'x' not found"))
        );
        assert_eq!(output, "");
        let (obj, _) = ended_object(&meta, &result(Status::Expired, Value::Null, Some("deadline passed")));
        assert!(obj.contains("\"failed\"") && obj.contains("deadline passed"));
        let (obj, _) = ended_object(&meta, &result(Status::Cancelled, Value::Null, None));
        assert!(obj.contains("\"cancelled\""));
        assert!(cancelled_object(&meta).contains("\"cancelled\""));
        assert!(running_object(&meta).contains("\"in_progress\""));
    }

    #[test]
    fn ids_are_random() {
        let (a, b) = (new_id().unwrap(), new_id().unwrap());
        assert!(a.starts_with("resp_") && a.len() == 37 && a != b, "{a} {b}");
    }
}
