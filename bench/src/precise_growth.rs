//! What a growing conversation costs each mode: conversations that grow from about 2,000 to
//! 100,000 prompt tokens over 50 turns, sent through Envoy to the fast endpoint of the overhead
//! benchmark, with plain Envoy as the baseline, Attaché approximate, precise, and precise
//! without its tokenization prefix store, side by side in one run.
//!
//! Each turn, every system gets the same turn of every conversation, one request at a time on
//! its own keep-alive connection (so one Envoy worker, and one prefix store, sees a
//! conversation's every turn); the systems' order rotates from turn to turn. A row gives the
//! turn, its prompt tokens (the reference model's chat template and tokenizer, as vLLM counts
//! them), each system's proxy CPU per request and the prefix store's hit rate over the turn.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use attache_e2e::stack::ExternalEngine;
use attache_e2e::{client, EnvoyKind, Stack};
use attache_policies::chat_template::ChatMessage;
use attache_policies::prompt_tokens::PromptTokenizer;
use serde_json::{json, Value};

use crate::overhead::{fast_endpoint, precise_config};
use crate::procstat::cpu_ns;
use crate::run::{percentile, write_results};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    #[arg(long, default_value = "bench/results/precise-growth.json")]
    out: PathBuf,
    /// Turns per conversation.
    #[arg(long, default_value_t = 50)]
    turns: usize,
    /// Conversations, each sent once per turn to every system.
    #[arg(long, default_value_t = 6)]
    conversations: usize,
    /// Prompt tokens at the first turn.
    #[arg(long, default_value_t = 2_000)]
    start_tokens: usize,
    /// Prompt tokens at the last turn.
    #[arg(long, default_value_t = 100_000)]
    end_tokens: usize,
}

const MODEL: &str = "tinyllama";

/// One system under test.
struct System {
    name: &'static str,
    stack: Stack,
    url: String,
    pid: u32,
    http: reqwest::Client,
    /// Whether its Envoy counts prefix-store hits (precise with the store).
    store: bool,
}

async fn start(name: &'static str, fast: std::net::SocketAddr, config: Option<Value>) -> anyhow::Result<System> {
    let mut s = Stack::new(&format!("precise-growth-{name}"))?;
    s.external = vec![ExternalEngine { address: fast.to_string(), kv_publisher: None, kv_replay: None }];
    s.write_endpoints(&s.engine_addrs())?;
    let store = config.as_ref().is_some_and(|c| {
        c.pointer("/scheduler/precise/enabled") == Some(&json!(true))
            && c.pointer("/scheduler/precise/prefix_store_bytes") != Some(&json!(0))
    });
    match &config {
        None => s.start_envoy(EnvoyKind::RoundRobin, &Stack::default_scheduler_config(), 2)?,
        Some(c) => {
            s.start_host()?;
            s.start_envoy(EnvoyKind::Attache, c, 2)?;
            s.wait_snapshot(1, Duration::from_secs(20))?;
        }
    }
    let pid = s.envoy.as_ref().map(|p| p.pid()).context("envoy not running")?;
    let http = reqwest::Client::builder().pool_max_idle_per_host(1).tcp_nodelay(true).build()?;
    Ok(System { name, url: s.url("/v1/chat/completions"), pid, http, store, stack: s })
}

/// Words for the conversations' text, chosen by a seeded generator.
const WORDS: [&str; 16] = [
    "parse", "route", "score", "cache", "block", "token", "queue", "shard", "the", "agent", "reads", "file", "tests",
    "passed", "diff", "patch",
];

fn text(seed: u64, bytes: usize) -> String {
    let mut k = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        k = k.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        s.push_str(WORDS[(k >> 33) as usize % WORDS.len()]);
        s.push(if (k >> 20).is_multiple_of(11) { '\n' } else { ' ' });
    }
    s
}

/// Conversation `c` at turn `t` (from 0): a system prompt, then a user and an assistant message
/// per earlier turn and this turn's user message, sized so the prompt grows linearly.
fn conversation(c: usize, t: usize, a: &Args, bytes_per_token: f64) -> Vec<ChatMessage> {
    let tokens_at = |t: usize| {
        let span = a.end_tokens.saturating_sub(a.start_tokens) as f64;
        a.start_tokens as f64 + span * t as f64 / (a.turns.max(2) - 1) as f64
    };
    let msg = |role: &str, content: String| ChatMessage { role: role.into(), content, ..ChatMessage::default() };
    let seed = c as u64 * 1_000_003;
    let mut m = vec![msg(
        "system",
        format!("Conversation {c}. {}", text(seed, (tokens_at(0) * 0.5 * bytes_per_token) as usize)),
    )];
    for turn in 0..=t {
        let grow = if turn == 0 { tokens_at(0) * 0.5 } else { tokens_at(turn) - tokens_at(turn - 1) };
        let bytes = (grow * bytes_per_token) as usize;
        m.push(msg("user", text(seed + 2 * turn as u64 + 1, bytes * 4 / 5)));
        if turn < t {
            m.push(msg("assistant", text(seed + 2 * turn as u64 + 2, bytes / 5)));
        }
    }
    m
}

fn body(messages: &[ChatMessage]) -> Vec<u8> {
    json!({"model": MODEL, "messages": messages, "max_tokens": 1}).to_string().into_bytes()
}

/// The reference model's tokenizer and template, without a prefix store: the prompt tokens of
/// a conversation as vLLM counts them.
fn tokenizer() -> anyhow::Result<PromptTokenizer> {
    let cfg: attache_policies::config::PreciseConfig =
        serde_json::from_value(precise_config()?.pointer("/scheduler/precise").cloned().unwrap_or_default())?;
    let (t, failed) = PromptTokenizer::load_checked(&cfg).map_err(|e| anyhow::anyhow!("reference tokenizer: {e}"))?;
    anyhow::ensure!(failed == 0, "reference tokenizer fails its checks");
    Ok(t.with_prefix_store(0))
}

fn store_counts(s: &System) -> (u64, u64) {
    let stats = s.stack.envoy_stats();
    let v = |n: &str| attache_e2e::stats::stat_value(&stats, &format!("wasmcustom.attache.precise.prefix_store.{n}"));
    (v("hits"), v("misses"))
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let mut tok = tokenizer()?;
    let sample = text(7, 20_000);
    let sample_ids = tok.conversation(
        &[ChatMessage { role: "user".into(), content: sample.clone(), ..ChatMessage::default() }],
        true,
        0,
    )?;
    let bytes_per_token = sample.len() as f64 / sample_ids.len().max(1) as f64;
    let fast = fast_endpoint().await?;
    let precise = precise_config()?;
    let mut no_store = precise.clone();
    no_store["scheduler"]["precise"]["prefix_store_bytes"] = json!(0);
    let systems = vec![
        start("envoy", fast, None).await?,
        start("attache-approx", fast, Some(Stack::default_scheduler_config())).await?,
        start("attache-precise", fast, Some(precise)).await?,
        start("attache-precise-no-store", fast, Some(no_store)).await?,
    ];
    println!(
        "precise-growth: {} conversations x {} turns, {} -> {} prompt tokens ({bytes_per_token:.2} bytes a token); fast endpoint at {fast}; Envoy --concurrency 2",
        a.conversations, a.turns, a.start_tokens, a.end_tokens
    );
    // Warm V8 and the connections on a conversation that is not measured.
    for s in &systems {
        for t in 0..3 {
            let o = client::post(&s.http, &s.url, body(&conversation(10_000, t, &a, bytes_per_token)), &[]).await;
            anyhow::ensure!(o.status == 200, "{}: warm-up failed: {} {}", s.name, o.status, o.body);
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut seen: Vec<(u64, u64)> = systems.iter().map(store_counts).collect();
    let mut rows = Vec::new();
    for t in 0..a.turns {
        let bodies: Vec<Vec<u8>> =
            (0..a.conversations).map(|c| body(&conversation(c, t, &a, bytes_per_token))).collect();
        let prompt_tokens = tok.conversation(&conversation(0, t, &a, bytes_per_token), true, 0)?.len();
        let mut cpu_us = vec![0.0; systems.len()];
        let mut p50_us = vec![0.0; systems.len()];
        for k in (0..systems.len()).map(|k| (k + t) % systems.len()) {
            let s = &systems[k];
            let mut lat = Vec::with_capacity(bodies.len());
            let cpu0 = cpu_ns(s.pid);
            for b in &bodies {
                let start = Instant::now();
                let o = client::post(&s.http, &s.url, b.clone(), &[]).await;
                lat.push(start.elapsed().as_secs_f64() * 1e6);
                anyhow::ensure!(o.status == 200, "{} turn {t}: {} {}", s.name, o.status, o.body);
            }
            cpu_us[k] = cpu_ns(s.pid).saturating_sub(cpu0) as f64 / 1e3 / bodies.len() as f64;
            lat.sort_by(f64::total_cmp);
            p50_us[k] = percentile(&lat, 50.0);
        }
        // The filter adds its store counters at its 100 ms tick.
        tokio::time::sleep(Duration::from_millis(250)).await;
        let mut hit_rate = serde_json::Map::new();
        for (k, s) in systems.iter().enumerate().filter(|(_, s)| s.store) {
            let now = store_counts(s);
            let (h, m) = (now.0.saturating_sub(seen[k].0), now.1.saturating_sub(seen[k].1));
            seen[k] = now;
            let rate = (h + m > 0).then(|| h as f64 / (h + m) as f64);
            hit_rate.insert(s.name.into(), json!(rate));
        }
        let cpu: serde_json::Map<String, Value> =
            systems.iter().zip(&cpu_us).map(|(s, c)| (s.name.to_string(), json!(c.round()))).collect();
        let lat: serde_json::Map<String, Value> =
            systems.iter().zip(&p50_us).map(|(s, c)| (s.name.to_string(), json!(c.round()))).collect();
        println!(
            "  turn {:>2} {:>7} tokens  CPU us/req: envoy {:>6.0}  approx {:>6.0}  precise {:>6.0}  no store {:>6.0}  store hit rate {:?}",
            t + 1,
            prompt_tokens,
            cpu_us[0],
            cpu_us[1],
            cpu_us[2],
            cpu_us[3],
            hit_rate.get("attache-precise").and_then(Value::as_f64)
        );
        rows.push(json!({
            "turn": t + 1, "prompt_tokens": prompt_tokens, "body_bytes": bodies.first().map_or(0, Vec::len),
            "proxy_cpu_us_per_request": cpu, "p50_us": lat, "prefix_store_hit_rate": hit_rate,
        }));
    }
    let last = rows.last().cloned().unwrap_or_default();
    let cpu = |name: &str| last["proxy_cpu_us_per_request"][name].as_f64().unwrap_or(0.0);
    let base = cpu("envoy");
    let ratio = |a: f64, b: f64| if b > 0.0 { Some((a / b * 100.0).round() / 100.0) } else { None };
    let summary = json!({
        "turn": last["turn"], "prompt_tokens": last["prompt_tokens"],
        "precise_over_approx_cpu": ratio(cpu("attache-precise"), cpu("attache-approx")),
        "precise_over_approx_added_cpu": ratio(cpu("attache-precise") - base, cpu("attache-approx") - base),
        "no_store_over_approx_cpu": ratio(cpu("attache-precise-no-store"), cpu("attache-approx")),
        "target": "precise <= 1.5x approximate's proxy CPU per request at the last turn",
    });
    println!("  last turn: {summary}");
    let doc = json!({
        "scenario": "precise-growth",
        "command": "cargo xtask bench precise-growth",
        "config": {"turns": a.turns, "conversations": a.conversations, "start_tokens": a.start_tokens,
            "end_tokens": a.end_tokens, "envoy_concurrency": 2, "model": MODEL,
            "client": "one keep-alive connection per system, sequential requests, the systems' order rotating each turn"},
        "cpu": "proxy_cpu_us_per_request: Envoy's on-CPU µs per request over the turn's requests (all its threads); envoy is plain Envoy, the baseline",
        "summary": summary,
        "rows": rows,
    });
    write_results(&a.out, doc)
}
