//! The synthetic requests admission runs a module on: representative API requests, and
//! the scheduling contexts a custom scorer sees, with the check that it scored them.

use super::{AdmissionError, AdmissionReport};

/// A sample request to run the module on.
#[derive(Debug, Clone)]
pub struct SampleRequest {
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Filter state present when the module sees the request (`wasm.<name>` → value), e.g.
    /// the scheduling context a custom scorer reads.
    pub properties: Vec<(String, Vec<u8>)>,
    /// The engine's answer, run through the response-path callbacks.
    pub response_headers: Vec<(String, String)>,
    pub response_body: Vec<u8>,
}

/// The answer every sample gets: a one-choice chat completion with its usage.
const RESPONSE_BODY: &str = r#"{"id":"chatcmpl-admission","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13}}"#;

impl SampleRequest {
    /// A POST to `path` with a JSON body.
    pub fn post(path: &str, body: &str) -> Self {
        Self {
            headers: vec![
                (":method".into(), "POST".into()),
                (":path".into(), path.into()),
                (":authority".into(), "gateway".into()),
                ("content-type".into(), "application/json".into()),
                ("content-length".into(), body.len().to_string()),
            ],
            body: body.as_bytes().to_vec(),
            properties: Vec::new(),
            response_headers: vec![
                (":status".into(), "200".into()),
                ("content-type".into(), "application/json".into()),
                ("content-length".into(), RESPONSE_BODY.len().to_string()),
            ],
            response_body: RESPONSE_BODY.as_bytes().to_vec(),
        }
    }
}

/// A few representative requests: completions (text and token ids), chat, Responses,
/// malformed JSON and an empty body.
pub fn default_samples() -> Vec<SampleRequest> {
    let long = "The scheduler routes each request to the engine that already holds its prefix. ".repeat(40);
    vec![
        SampleRequest::post("/v1/completions", &format!(r#"{{"model":"m","prompt":"{long}","max_tokens":8}}"#)),
        SampleRequest::post("/v1/completions", r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10],"max_tokens":4}"#),
        SampleRequest::post(
            "/v1/chat/completions",
            &format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"{long}"}},{{"role":"user","content":"hi"}}],"stream":true}}"#
            ),
        ),
        SampleRequest::post("/v1/responses", r#"{"model":"m","input":"hello","instructions":"be brief"}"#),
        SampleRequest::post("/v1/completions", r#"{"model":"m","prompt":"#),
        SampleRequest::post("/v1/completions", ""),
    ]
}

/// Synthetic scheduling contexts for a custom scorer: the filter state the scheduler leaves
/// (1, 4 and 16 candidates; labelled and unlabelled; idle, queued and cold endpoints).
pub fn scorer_samples() -> Vec<SampleRequest> {
    use attache_policies::scoring::{Candidate, ScoringContext};
    let classes = ["l4", "a100", "h100", ""];
    let ctx = |n: usize, prompt_tokens: u32, seed: u64| ScoringContext {
        bucket: (seed % 10_000) as u16,
        seed,
        max_endpoints: 3,
        model: "m".into(),
        prompt_tokens,
        max_tokens: 128,
        stream: seed.is_multiple_of(2),
        candidates: (0..n)
            .map(|i| Candidate {
                address: format!("10.0.{}.{}:8000", i / 250, i % 250),
                labels: match classes[i % classes.len()] {
                    "" => Vec::new(),
                    c => vec![("attache.io/accelerator".into(), c.into())],
                },
                waiting: (i % 5) as f32,
                running: (i % 7) as f32,
                kv_usage: (i % 10) as f32 / 10.0,
                ttft_ms: [0.0, 35.0, 250.0, 2400.0][i % 4],
                prefix_hit: [0.0, 0.5, 1.0][i % 3],
                score: 1.0 + i as f64 / 10.0,
            })
            .collect(),
    };
    [ctx(1, 12, 1), ctx(4, 6000, 2), ctx(16, 900, 3), ctx(16, 0, 9_999)].iter().map(context_sample).collect()
}

/// A sample request carrying a scoring context, as a scorer sees one (a synthetic one, or one
/// recorded in the decision log).
pub fn context_sample(ctx: &attache_policies::scoring::ScoringContext) -> SampleRequest {
    SampleRequest {
        properties: vec![(attache_policies::scoring::CONTEXT_PROPERTY.into(), ctx.encode())],
        ..SampleRequest::post("/v1/chat/completions", "")
    }
}

/// Check that a scorer scored every sample: a decodable score sheet with one finite score per
/// candidate.
pub fn check_scorer_outputs(samples: &[SampleRequest], report: &AdmissionReport) -> Result<(), AdmissionError> {
    use attache_policies::scoring::{ScoreSheet, ScoringContext, CONTEXT_PROPERTY, SCORES_PROPERTY};
    for (k, (sample, outcome)) in samples.iter().zip(&report.outcomes).enumerate() {
        let no = |reason: String| AdmissionError::NoScores { sample: k, reason };
        let ctx = sample
            .properties
            .iter()
            .find(|(p, _)| p == CONTEXT_PROPERTY)
            .and_then(|(_, v)| ScoringContext::decode(v).ok())
            .ok_or_else(|| no("sample has no scoring context".into()))?;
        let sheet = outcome
            .properties
            .iter()
            .find(|(p, _)| p == SCORES_PROPERTY)
            .ok_or_else(|| no("the module wrote no score sheet (is it built with the scorer SDK?)".into()))?;
        let sheet = ScoreSheet::decode(&sheet.1).map_err(|e| no(format!("score sheet does not decode: {e}")))?;
        let entry = sheet.entries.first().ok_or_else(|| no("score sheet is empty".into()))?;
        if entry.scores.len() != ctx.candidates.len() {
            return Err(no(format!("{} scores for {} candidates", entry.scores.len(), ctx.candidates.len())));
        }
        if let Some(s) = entry.scores.iter().find(|s| !s.is_finite()) {
            return Err(no(format!("non-finite score {s}")));
        }
        if let Some((i, _)) = entry.removed.iter().find(|(i, _)| usize::from(*i) >= ctx.candidates.len()) {
            return Err(no(format!("removed candidate {i} of {}", ctx.candidates.len())));
        }
        if entry.removed.iter().any(|(_, reason)| reason.is_empty()) {
            return Err(no("a removal without a reason".into()));
        }
    }
    Ok(())
}

/// The pool a scheduler module is admitted on: four ready endpoints of model `m`, idle to
/// busy, two of them labelled l4 and two h100.
pub fn scheduler_pool() -> attache_proto::v1::Snapshot {
    use attache_proto::v1::{Endpoint, Snapshot};
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    Snapshot {
        version: 1,
        host_epoch: 1,
        generated_unix_ms: now,
        observed_unix_ms: now,
        saturation: Some(0.1),
        dispatch_cost: 0.01,
        endpoints: (0..4u32)
            .map(|i| Endpoint {
                address: format!("10.0.0.{}:8000", i + 1),
                models: vec!["m".into()],
                role: "both".into(),
                ready: true,
                has_metrics: true,
                waiting: f64::from(i % 2),
                running: f64::from(i),
                kv_usage: f64::from(i) / 10.0,
                block_size: 16,
                num_gpu_blocks: 4096,
                engine: "vllm".into(),
                id: i + 1,
                labels: [("attache.io/accelerator".to_owned(), if i < 2 { "l4" } else { "h100" }.to_owned())]
                    .into_iter()
                    .collect(),
                ..Endpoint::default()
            })
            .collect(),
        ..Snapshot::default()
    }
}

/// Check that a scheduler routed every well-formed sample to an endpoint of the pool it was
/// given ([`scheduler_pool`]) and answered each malformed one itself with a 4xx.
pub fn check_scheduler_outputs(samples: &[SampleRequest], report: &AdmissionReport) -> Result<(), AdmissionError> {
    let pool: Vec<String> = scheduler_pool().endpoints.into_iter().map(|e| e.address).collect();
    for (k, (sample, outcome)) in samples.iter().zip(&report.outcomes).enumerate() {
        let bad = |reason: String| AdmissionError::NotScheduled { sample: k, reason };
        let well_formed = serde_json::from_slice::<serde_json::Value>(&sample.body).is_ok();
        let destination = outcome
            .headers
            .iter()
            .find(|(n, _)| n == attache_policies::plan::DESTINATION_HEADER)
            .map(|(_, v)| v.as_str());
        match (well_formed, destination, outcome.local_response) {
            (true, Some(d), None) => {
                let primary = d.split(',').next().unwrap_or_default();
                if !pool.iter().any(|a| a == primary) {
                    return Err(bad(format!("routed to {primary:?}, which is not in the pool")));
                }
            }
            (true, _, Some(status)) => return Err(bad(format!("answered {status} itself"))),
            (true, None, None) => return Err(bad("set no destination".into())),
            (false, _, Some(status)) if (400..500).contains(&status) => {}
            (false, _, status) => return Err(bad(format!("malformed body, answered {status:?} (want a 4xx)"))),
        }
    }
    Ok(())
}
