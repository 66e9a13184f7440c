//! Multi-turn agents, side by side in one run on the same 4 simulated engines (cold each run):
//! sessions of 10 turns whose context grows each turn. Systems:
//! - `round-robin`: plain Envoy, chat completions with the whole history;
//! - `attache-sessions`: Attaché, chat completions with the whole history and `x-session-id`;
//! - `attache-responses`: Attaché, Responses API, streamed, each turn sends only its new input,
//!   `previous_response_id` and the instructions (the gateway holds the conversation: the
//!   engines store nothing, as vLLM ships);
//! - `oracle`: the client sends each session straight to the engine that holds its context.
//!
//! The prefix hit rate is the engines' own `vllm:prefix_cache_hits_total / queries_total`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use attache_e2e::client::{self, Outcome};
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use attache_policies::rng::SplitMix64;
use serde_json::json;

use crate::run::{percentile, write_results};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    #[arg(long, default_value = "bench/results/agents.json")]
    out: PathBuf,
    #[arg(long, default_value_t = 32)]
    sessions: usize,
    #[arg(long, default_value_t = 10)]
    turns: usize,
    /// Tokens of each session's system prompt, and of each turn's new tool output.
    #[arg(long, default_value_t = 1000)]
    system_tokens: usize,
    #[arg(long, default_value_t = 300)]
    turn_tokens: usize,
    #[arg(long, default_value_t = 48)]
    max_tokens: u64,
    /// Simulated step times are multiplied by this.
    #[arg(long, default_value_t = 0.2)]
    time_scale: f64,
    #[arg(long, default_value_t = 5)]
    seed: u64,
}

/// One session: its system prompt and each turn's new input.
struct Session {
    system: String,
    turns: Vec<String>,
}

fn words(rng: &mut SplitMix64, tokens: usize) -> String {
    const W: [&str; 10] = ["fn", "test", "diff", "build", "error", "file", "line", "patch", "grep", "run"];
    let mut s = String::with_capacity(tokens * 4 + 8);
    while s.len() < tokens * 4 {
        s.push_str(W[(rng.next_u64() % W.len() as u64) as usize]);
        s.push(' ');
    }
    s
}

fn plan(a: &Args) -> Vec<Session> {
    let mut rng = SplitMix64::new(a.seed);
    (0..a.sessions)
        .map(|i| Session {
            system: format!("Agent {i}. Repository notes: {}", words(&mut rng, a.system_tokens)),
            turns: (0..a.turns).map(|t| format!("Tool output {t}: {}", words(&mut rng, a.turn_tokens))).collect(),
        })
        .collect()
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Chat { session_header: bool },
    Responses,
}

/// Run every session's turns back to back (sessions concurrently) against `url(session)`.
async fn drive(
    sessions: Arc<Vec<Session>>,
    mode: Mode,
    url: Arc<dyn Fn(usize) -> String + Send + Sync>,
    max_tokens: u64,
) -> Vec<Outcome> {
    let mut tasks = Vec::new();
    for i in 0..sessions.len() {
        let (sessions, url) = (sessions.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let s = &sessions[i];
            let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap_or_default();
            let sid = format!("session-{i}");
            let mut messages = vec![json!({"role": "system", "content": s.system})];
            let mut prev: Option<String> = None;
            let mut out = Vec::new();
            for turn in &s.turns {
                let o = match mode {
                    Mode::Chat { session_header } => {
                        messages.push(json!({"role": "user", "content": turn}));
                        let body = json!({"model": "tinyllama", "messages": messages, "max_tokens": max_tokens,
                                          "stream": true, "stream_options": {"include_usage": true}});
                        let headers: Vec<(&str, &str)> =
                            if session_header { vec![("x-session-id", sid.as_str())] } else { vec![] };
                        let o = client::post(&http, &url(i), body.to_string().into_bytes(), &headers).await;
                        let reply = o.streamed_text();
                        messages.push(json!({"role": "assistant", "content": reply}));
                        o
                    }
                    Mode::Responses => {
                        // Instructions are not carried from turn to turn (OpenAI's API, and
                        // vLLM's): an agent sends them with every turn.
                        let mut body = json!({"model": "tinyllama", "input": turn, "max_output_tokens": max_tokens,
                                              "instructions": s.system, "stream": true});
                        if let Some(p) = &prev {
                            body["previous_response_id"] = json!(p);
                        }
                        let o = client::post(&http, &url(i), body.to_string().into_bytes(), &[]).await;
                        prev = o.completed_response()["id"].as_str().map(str::to_owned);
                        o
                    }
                };
                let failed = !o.ok();
                out.push(o);
                if failed {
                    break;
                }
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap_or_default());
    }
    all
}

fn r4(v: f64) -> f64 {
    (v * 10_000.0).round() / 10_000.0
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let sessions = Arc::new(plan(&a));
    println!(
        "agents: {} sessions x {} turns ({}-token system prompt, +{} tokens a turn), 4 engines",
        a.sessions, a.turns, a.system_tokens, a.turn_tokens
    );
    let systems: [(&str, EnvoyKind, Mode); 4] = [
        ("round-robin", EnvoyKind::RoundRobin, Mode::Chat { session_header: false }),
        ("attache-sessions", EnvoyKind::Attache, Mode::Chat { session_header: true }),
        ("attache-responses", EnvoyKind::Attache, Mode::Responses),
        ("oracle", EnvoyKind::RoundRobin, Mode::Chat { session_header: false }),
    ];
    let mut runs = Vec::new();
    let mut hit = std::collections::BTreeMap::new();
    for (system, kind, mode) in systems {
        let mut s = Stack::new(&format!("agents-{system}"))?;
        s.start_sim(SimOpts { engines: 4, num_gpu_blocks: 4096, time_scale: a.time_scale, ..SimOpts::default() })?;
        if kind == EnvoyKind::Attache {
            s.start_host()?;
        }
        s.start_envoy(kind, &Stack::default_scheduler_config(), 2)?;
        if kind == EnvoyKind::Attache {
            s.wait_snapshot(4, Duration::from_secs(20))?;
        }
        let engines = s.engine_addrs();
        let gateway = s.url(if mode == Mode::Responses { "/v1/responses" } else { "/v1/chat/completions" });
        let url: Arc<dyn Fn(usize) -> String + Send + Sync> = if system == "oracle" {
            // Session i always goes to engine i mod 4, which therefore holds its context.
            Arc::new(move |i| format!("http://{}/v1/chat/completions", engines[i % engines.len()]))
        } else {
            Arc::new(move |_| gateway.clone())
        };
        let (q0, h0) = s.prefix_counters().await?;
        let start = Instant::now();
        let outcomes = drive(sessions.clone(), mode, url, a.max_tokens).await;
        let wall = start.elapsed().as_secs_f64();
        let (q1, h1) = s.prefix_counters().await?;
        let rate = if q1 > q0 { (h1 - h0) / (q1 - q0) } else { 0.0 };
        let mut ttft: Vec<f64> =
            outcomes.iter().filter(|o| o.ok()).filter_map(|o| o.ttft).map(|d| d.as_secs_f64() * 1000.0).collect();
        ttft.sort_by(f64::total_cmp);
        let tokens: u64 = outcomes.iter().filter(|o| o.ok()).map(|o| o.output_tokens).sum();
        let errors = outcomes.iter().filter(|o| !o.ok()).count();
        println!(
            "  {system:<18} prefix hit rate {rate:.4}; TTFT p50 {:>7.1} p95 {:>7.1} ms; {:>6.1} tok/s; {} requests, {errors} errors",
            percentile(&ttft, 50.0),
            percentile(&ttft, 95.0),
            tokens as f64 / wall,
            outcomes.len()
        );
        hit.insert(system, rate);
        runs.push(json!({
            "system": system, "requests": outcomes.len(), "errors": errors, "prefix_hit_rate": r4(rate),
            "ttft_p50_ms": r4(percentile(&ttft, 50.0)), "ttft_p95_ms": r4(percentile(&ttft, 95.0)),
            "output_tok_per_s": r4(tokens as f64 / wall), "wall_s": r4(wall),
            "sticky_hits": s.envoy_stat("wasmcustom.attache.session.sticky_hits"),
        }));
    }
    let oracle = hit.get("oracle").copied().unwrap_or(f64::NAN);
    let gap = |k: &str| r4((oracle - hit.get(k).copied().unwrap_or(f64::NAN)) * 100.0);
    println!(
        "\nhit-rate gap to the oracle: sessions {:.2} points, responses {:.2} points",
        gap("attache-sessions"),
        gap("attache-responses")
    );
    let doc = json!({
        "scenario": "multi-turn-agents",
        "command": "cargo xtask bench agents",
        "gap_to_oracle_points": {"attache-sessions": gap("attache-sessions"), "attache-responses": gap("attache-responses")},
        "config": {"engines": 4, "sessions": a.sessions, "turns": a.turns, "system_tokens": a.system_tokens,
                    "turn_tokens": a.turn_tokens, "max_tokens": a.max_tokens, "num_gpu_blocks": 4096,
                    "time_scale": a.time_scale, "seed": a.seed},
        "runs": runs,
    });
    write_results(&a.out, doc)
}
