//! Many models behind one gateway: one host and one Envoy route `--models` base models, each
//! its own pool of `--engines / --models` engines, by the request's model, with no process per
//! pool. Measured against one model on the same number of engines, in one run: the filter's
//! decision time (`attache_decision_us`) and whether every request reached an engine of its
//! model.

use std::path::PathBuf;
use std::time::Duration;

use attache_e2e::stats::histogram_quantile;
use attache_e2e::{client, EnvoyKind, SimOpts, Stack};
use serde_json::json;

#[derive(clap::Parser, Debug, Clone)]
pub struct Args {
    #[arg(long, default_value = "bench/results/models.json")]
    pub out: PathBuf,
    /// Engines in the pool (both runs).
    #[arg(long, default_value_t = 200)]
    pub engines: u16,
    /// Base models of the many-model run.
    #[arg(long, default_value_t = 100)]
    pub models: usize,
    /// Requests per run (spread over the models).
    #[arg(long, default_value_t = 2_000)]
    pub requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
}

/// What one run measured.
struct Run {
    label: String,
    decision_p50_us: Option<f64>,
    decision_p99_us: Option<f64>,
    ok: usize,
    wrong_model: usize,
    errors: usize,
}

async fn run_one(a: &Args, label: &str, models: &[String]) -> anyhow::Result<Run> {
    let mut s = Stack::new(&format!("models-{label}"))?;
    // Two hundred engines: scrape each once a second (the default 50 ms is 4,000 GETs/s here).
    s.host_extra = Some(json!({"scrape_interval_ms": 1000, "unready_after_ms": 10000, "models_interval_ms": 0}));
    s.start_sim(SimOpts { engines: a.engines, model: models.join(","), time_scale: 0.05, ..SimOpts::default() })?;
    s.start_host()?;
    s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2)?;
    s.wait_snapshot(usize::from(a.engines), Duration::from_secs(60))?;
    let engines = s.engine_addrs();
    let model_of = |port: u16| {
        let i = engines.iter().position(|e| e.ends_with(&format!(":{port}")))?;
        models.get(i % models.len()).cloned()
    };
    let http = reqwest::Client::builder().pool_max_idle_per_host(64).build()?;
    let url = s.url("/v1/chat/completions");
    let (mut ok, mut wrong_model, mut errors) = (0, 0, 0);
    for chunk in (0..a.requests).collect::<Vec<_>>().chunks(a.concurrency.max(1)) {
        let sends = chunk.iter().map(|&n| {
            let model = models[n % models.len()].clone();
            let body = client::chat_body(&model, "You are a helpful assistant.", &format!("question {n}"), 4);
            let (http, url) = (http.clone(), url.clone());
            async move { (model, client::post(&http, &url, body, &[]).await) }
        });
        for (model, o) in futures::future::join_all(sends).await {
            if !o.ok() {
                errors += 1;
            } else if o.engine_port.and_then(model_of).as_deref() == Some(model.as_str()) {
                ok += 1;
            } else {
                wrong_model += 1;
            }
        }
    }
    // Envoy merges histograms at its stats flush (5 s).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let stats = s.envoy_stats();
    let q = |p| histogram_quantile(&stats, "wasmcustom.attache.decision_us", p);
    Ok(Run { label: label.to_owned(), decision_p50_us: q("P50"), decision_p99_us: q("P99"), ok, wrong_model, errors })
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(a.models >= 1 && a.engines as usize >= a.models, "need at least one engine per model");
    let many: Vec<String> = (0..a.models).map(|i| format!("model-{i:03}")).collect();
    let one = vec!["model-000".to_owned()];
    let mut runs = Vec::new();
    for (label, models) in [("one-model", &one), ("many-models", &many)] {
        let r = run_one(&a, label, models).await?;
        println!(
            "{label}: {} models on {} engines: decision p50 {:?} µs, p99 {:?} µs; {} ok, {} on another model's engine, {} errors",
            models.len(),
            a.engines,
            r.decision_p50_us,
            r.decision_p99_us,
            r.ok,
            r.wrong_model,
            r.errors
        );
        runs.push(r);
    }
    let ratio = match (runs[1].decision_p99_us, runs[0].decision_p99_us) {
        (Some(m), Some(o)) if o > 0.0 => Some(m / o),
        _ => None,
    };
    println!("decision p99, many models vs one: {ratio:?}x (target <= 1.2x)");
    let doc = json!({
        "scenario": "models",
        "command": format!("cargo xtask bench models --engines {} --models {} --requests {}", a.engines, a.models, a.requests),
        "runs": runs.iter().map(|r| json!({
            "system": r.label, "decision_p50_us": r.decision_p50_us, "decision_p99_us": r.decision_p99_us,
            "ok": r.ok, "wrong_model": r.wrong_model, "errors": r.errors,
        })).collect::<Vec<_>>(),
        "checks": {"decision_p99_ratio": ratio, "target": 1.2, "met": ratio.is_some_and(|r| r <= 1.2)
            && runs.iter().all(|r| r.wrong_model == 0 && r.errors == 0)},
    });
    crate::run::write_results(&a.out, doc)
}
