//! Closed-loop load for throughput: a fixed number of clients, each sending its next turn as
//! soon as the last one finished, for a fixed (simulated) time.
//!
//! The open-loop ladder measures latency at offered rates; it cannot resolve small throughput
//! gaps, because every system is offered the same work and finishes it. Here the clients keep
//! the pool full and each system's output is what the engines generate in the window. Clients
//! take the scenario's sessions in plan order, run their turns back to back (no tool pause: a
//! paused client would leave capacity idle), and stop at the deadline.
//!
//! Output is read from the engines' own counter (`vllm:generation_tokens_total`, summed over
//! the pool) at the end of a warm-up fifth of the window and at its end. Long turns would
//! otherwise make a count of completed turns coarse: a turn still streaming at the deadline has
//! generated tokens that a completion count drops.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use attache_e2e::client;
use serde::Serialize;

use crate::conversation::Conversation;
use crate::scenario::{ApiKind, ClosedLoop, SessionPlan};

/// What a closed-loop run completed (simulated time).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Throughput {
    pub concurrency: usize,
    pub seconds: f64,
    /// Turns that completed within the window.
    pub requests: usize,
    /// Tokens the engines generated after the warm-up fifth of the window.
    pub output_tokens: u64,
    pub output_tok_per_s: f64,
    /// Turns that failed within the window (a failed turn ends its session).
    pub errors: usize,
    /// Sessions started; the plan ran out when this equals its length.
    pub sessions: usize,
    /// The engines' prefix-cache hit rate over the counted window (hits over queried tokens).
    pub prefix_hit_rate: Option<f64>,
}

/// What the engines at `engines` (`host:port`) have counted, summed over the pool: output
/// tokens generated, prefix-cache hits and queries (tokens).
async fn counters(http: &reqwest::Client, engines: &[String]) -> [f64; 3] {
    let mut total = [0.0; 3];
    for e in engines {
        let Ok(r) = http.get(format!("http://{e}/metrics")).send().await else { continue };
        let text = r.text().await.unwrap_or_default();
        let sum = |name: &str| {
            text.lines()
                .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>()
        };
        for (t, name) in total.iter_mut().zip([
            "vllm:generation_tokens_total",
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total",
        ]) {
            *t += sum(name);
        }
    }
    total
}

/// The share of the window before output is counted.
const WARM_UP: f64 = 0.2;

/// Run `cl` against `url`, whose pool is `engines`. Times scale by `time_scale` (real =
/// simulated × scale).
pub async fn drive(
    url: &str,
    engines: &[String],
    api: ApiKind,
    plan: Arc<Vec<SessionPlan>>,
    cl: ClosedLoop,
    time_scale: f64,
    timeout_s: f64,
) -> Throughput {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .timeout(Duration::from_secs_f64(timeout_s * time_scale))
        .build()
        .unwrap_or_default();
    let window = Duration::from_secs_f64(cl.seconds * time_scale);
    let start = tokio::time::Instant::now();
    let deadline = start + window;
    let next = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::with_capacity(cl.concurrency);
    for _ in 0..cl.concurrency {
        let (http, url, plan, next) = (http.clone(), url.to_string(), plan.clone(), next.clone());
        clients.push(tokio::spawn(async move {
            let (mut requests, mut errors) = (0usize, 0usize);
            'sessions: loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = plan.get(i) else { break };
                let sid = format!("session-{}", p.id);
                let mut convo = Conversation::new(api, p);
                for (k, user) in p.users.iter().enumerate() {
                    let body = convo.turn(p, k, user).to_string().into_bytes();
                    let headers: Vec<(&str, &str)> = if p.session_header && api == ApiKind::Chat {
                        vec![("x-session-id", sid.as_str())]
                    } else {
                        vec![]
                    };
                    let sent = client::post(&http, &url, body, &headers);
                    let Ok(o) = tokio::time::timeout_at(deadline, sent).await else { break 'sessions };
                    if !(o.ok() && o.done) {
                        errors += 1;
                        continue 'sessions;
                    }
                    requests += 1;
                    convo.answered(o.streamed_text());
                }
            }
            (requests, errors)
        }));
    }
    tokio::time::sleep_until(start + window.mul_f64(WARM_UP)).await;
    let [g0, h0, q0] = counters(&http, engines).await;
    tokio::time::sleep_until(deadline).await;
    let [g1, h1, q1] = counters(&http, engines).await;
    let mut out = Throughput { concurrency: cl.concurrency, seconds: cl.seconds, ..Throughput::default() };
    for c in clients {
        if let Ok((r, e)) = c.await {
            out.requests += r;
            out.errors += e;
        }
    }
    out.sessions = next.load(Ordering::Relaxed).min(plan.len());
    out.output_tokens = (g1 - g0).max(0.0) as u64;
    out.prefix_hit_rate = (q1 > q0).then(|| crate::run::round2((h1 - h0) / (q1 - q0) * 100.0) / 100.0);
    out.output_tok_per_s = crate::run::round2(out.output_tokens as f64 / (cl.seconds * (1.0 - WARM_UP)));
    out
}
