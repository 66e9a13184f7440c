//! What gateway Responses state costs: a continuation (`previous_response_id`, resolved from the
//! worker's cache or by the host, then rewritten into the whole conversation) against a plain
//! request carrying the same conversation, at each size, interleaved in one run through one
//! Envoy build; and the host's bytes per stored response.
//!
//! Two gateway replicas share the host and the engines: `cached` (the default filter, one
//! worker, so a continuation of a response it captured resolves in the worker) and `host`
//! (`responses.cache_bytes: 0`: every continuation asks the host). Requests are not streamed,
//! ask for one token and store nothing (`store: false`), so each round continues the same
//! response and the engines' work is the same for all three kinds.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use attache_e2e::admin_http::http_get_blocking;
use attache_e2e::stats::stat_line;
use attache_e2e::{client, EnvoyKind, SimOpts, Stack};
use serde_json::{json, Value};

use crate::run::{percentile, write_results};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    #[arg(long, default_value = "bench/results/responses.json")]
    out: PathBuf,
    /// Requests of each kind at each size.
    #[arg(long, default_value_t = 300)]
    rounds: usize,
    /// Conversation sizes, bytes of text.
    #[arg(long, value_delimiter = ',', default_value = "4096,102400")]
    sizes: Vec<usize>,
    /// Responses stored to measure the host's bytes per stored response, at each size.
    #[arg(long, default_value_t = 200)]
    stored: usize,
}

const MODEL: &str = "tinyllama";

fn text(bytes: usize, tag: &str) -> String {
    let mut s = format!("{tag} ");
    while s.len() < bytes {
        s.push_str("lorem ipsum dolor ");
    }
    s.truncate(bytes);
    s
}

fn host_metric(s: &Stack, name: &str) -> f64 {
    http_get_blocking(s.host_admin_port, "/metrics").map(|t| stat_line(&t, name)).unwrap_or(0.0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn r3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

fn summary(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (percentile(&v, 50.0), percentile(&v, 99.0))
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let mut s = Stack::new("bench-responses")?;
    s.start_sim(SimOpts { engines: 2, time_scale: 0.01, ..SimOpts::default() })?;
    s.start_host()?;
    let cached = s.start_replica("envoy-cached", EnvoyKind::Attache, &Stack::default_scheduler_config(), 1)?;
    let mut host_cfg = Stack::default_scheduler_config();
    host_cfg["responses"] = json!({"cache_bytes": 0});
    let host = s.start_replica("envoy-host", EnvoyKind::Attache, &host_cfg, 1)?;
    let replicas = [cached, host];
    s.wait_replicas(&replicas, 2, Duration::from_secs(20))?;
    let [cached, host] = &replicas;
    let http = reqwest::Client::new();
    let post = |url: String, body: Value| {
        let http = http.clone();
        async move { client::post(&http, &url, body.to_string().into_bytes(), &[]).await }
    };
    println!("responses: plain vs continuation (worker cache, host) at {:?} bytes, {} rounds", a.sizes, a.rounds);
    let mut rows = Vec::new();
    for &size in &a.sizes {
        // The conversation: one turn of `size` bytes, captured through each replica.
        let first = json!({"model": MODEL, "input": text(size, "conversation"), "max_output_tokens": 4});
        let mut ids = Vec::new();
        for r in [cached, host] {
            let o = post(r.url("/v1/responses"), first.clone()).await;
            anyhow::ensure!(o.ok(), "first turn: {} {}", o.status, o.body);
            ids.push((o.json()["id"].as_str().context("an id")?.to_owned(), o.json()["output"].clone()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut history: Vec<Value> = vec![json!({"role": "user", "content": first["input"]})];
        history.extend(ids[0].1.as_array().cloned().unwrap_or_default());
        history.push(json!({"role": "user", "content": "next"}));
        let plain = json!({"model": MODEL, "input": history, "max_output_tokens": 1, "store": false});
        let cont = |id: &str| json!({"model": MODEL, "input": "next", "previous_response_id": id, "max_output_tokens": 1, "store": false});
        let kinds = [
            ("plain", cached.url("/v1/responses"), plain),
            ("worker_cache", cached.url("/v1/responses"), cont(&ids[0].0)),
            ("host", host.url("/v1/responses"), cont(&ids[1].0)),
        ];
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); 3];
        for round in 0..a.rounds + 20 {
            for k in 0..3 {
                let i = (k + round) % 3;
                let (_, url, body) = &kinds[i];
                let o = post(url.clone(), body.clone()).await;
                anyhow::ensure!(o.ok(), "{}: {} {}", kinds[i].0, o.status, o.body);
                if round >= 20 {
                    times[i].push(ms(o.total));
                }
            }
        }
        let body_bytes = kinds[0].2.to_string().len();
        let (p50, p99) = summary(times[0].clone());
        let mut row = json!({"conversation_bytes": size, "plain_body_bytes": body_bytes,
                             "plain_p50_ms": r3(p50), "plain_p99_ms": r3(p99)});
        print!("  {size:>7} B: plain p50 {p50:.3} p99 {p99:.3} ms");
        for (i, name) in [(1, "worker_cache"), (2, "host")] {
            let (c50, c99) = summary(times[i].clone());
            row[format!("{name}_p50_ms")] = json!(r3(c50));
            row[format!("{name}_p99_ms")] = json!(r3(c99));
            row[format!("{name}_added_p50_ms")] = json!(r3(c50 - p50));
            row[format!("{name}_added_p99_ms")] = json!(r3(c99 - p99));
            print!("; {name} +{:.3} / +{:.3} ms", c50 - p50, c99 - p99);
        }
        println!();
        // The host's bytes per stored response of this size.
        let (b0, n0) = (host_metric(&s, "attache_responses_bytes"), host_metric(&s, "attache_responses_stored"));
        for i in 0..a.stored {
            let body = json!({"model": MODEL, "input": text(size, &format!("stored {i}")), "max_output_tokens": 4});
            let o = post(host.url("/v1/responses"), body).await;
            anyhow::ensure!(o.ok(), "store: {} {}", o.status, o.body);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (b1, n1) = (host_metric(&s, "attache_responses_bytes"), host_metric(&s, "attache_responses_stored"));
        let per = if n1 > n0 { (b1 - b0) / (n1 - n0) } else { f64::NAN };
        println!("           host bytes per stored response: {per:.0} ({} responses)", n1 - n0);
        row["host_bytes_per_response"] = json!(per.round());
        rows.push(row);
    }
    write_results(&a.out, json!({"benchmark": "responses", "rounds": a.rounds, "results": rows}))?;
    println!("wrote {}", a.out.display());
    Ok(())
}
