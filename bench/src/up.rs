//! `cargo xtask up`: the demo stack, kept running to try by hand.
//!
//! Simulated vLLM engines with the reference model's tokenizer and chat template (the real
//! vLLM 0.32 captures' model, `tests/fixtures/vllm-0.32/model/`), publishing KV events; the host
//! following them; Envoy with the scheduler filter in front. It prints where each part answers
//! and stays in the foreground; Ctrl-C (or SIGTERM) stops every process it started.

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use anyhow::{bail, Context};
use attache_e2e::{EnvoyKind, SimOpts, Stack};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Simulated engines.
    #[arg(long, default_value_t = 4)]
    engines: u16,
    /// The OpenAI-compatible listener (Envoy).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Envoy's admin port (stats).
    #[arg(long, default_value_t = 9901)]
    envoy_admin_port: u16,
    /// The host's admin port (`/metrics`, `/v1/snapshot`, `/v1/kv`).
    #[arg(long, default_value_t = 9190)]
    host_admin_port: u16,
    /// Precise prefix routing: the filter renders and tokenizes prompts with the reference
    /// tokenizer and scores the engines' KV events (else approximate).
    #[arg(long)]
    precise: bool,
    /// Simulated step times are multiplied by this (smaller is faster).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    envoy_concurrency: u32,
    /// Start, check one request end to end, print the URLs, and stop (for scripts and tests).
    #[arg(long)]
    check: bool,
}

/// Refuse a port someone else holds, naming the flag that moves it.
fn ensure_free(port: u16, flag: &str) -> anyhow::Result<()> {
    if TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).is_err() {
        bail!("port {port} is in use; pick another with {flag}");
    }
    Ok(())
}

/// Ctrl-C or SIGTERM.
async fn stopped() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    // Listen for Ctrl-C and SIGTERM from the start: a stop during start-up then ends here, and
    // dropping the stack stops what had started.
    let stop = tokio::spawn(stopped());
    ensure_free(a.port, "--port")?;
    ensure_free(a.envoy_admin_port, "--envoy-admin-port")?;
    ensure_free(a.host_admin_port, "--host-admin-port")?;
    // Chosen by the caller (a test picks them in its own process): keep the stack's own port
    // picks (engines, the host's gRPC) off them, since nothing has bound them yet.
    attache_e2e::ports::reserve(&[a.port, a.envoy_admin_port, a.host_admin_port]);
    let mut stack = Stack::new("up")?;
    stack.envoy_port = a.port;
    stack.envoy_admin_port = a.envoy_admin_port;
    stack.host_admin_port = a.host_admin_port;
    let sim = SimOpts {
        engines: a.engines,
        model: "tinyllama".into(),
        time_scale: a.time_scale,
        kv_events: true,
        tokenizer: Some(attache_fixtures::vllm("model/tokenizer.json")),
        chat_template: Some(attache_fixtures::vllm("model/chat_template.jinja")),
        ..SimOpts::default()
    };
    eprintln!("up: starting {} simulated engines, the host and Envoy (logs in {})", a.engines, stack.workdir.display());
    stack.start_sim(sim)?;
    stack.start_host()?;
    let config = if a.precise { crate::overhead::precise_config()? } else { Stack::default_scheduler_config() };
    stack.start_envoy(EnvoyKind::Attache, &config, a.envoy_concurrency)?;
    stack.wait_snapshot(usize::from(a.engines), Duration::from_secs(30)).context("waiting for the first snapshot")?;

    // One request through the whole path before saying it is up.
    let body = serde_json::json!({"model": "tinyllama", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8});
    let resp = stack.http.post(stack.url("/v1/chat/completions")).json(&body).send().await?;
    let status = resp.status();
    let text = resp.text().await?;
    if !status.is_success() {
        bail!("the first request through Envoy answered {status}: {text}");
    }
    let mode = if a.precise { "precise" } else { "approximate" };
    println!(
        "\nAttaché is up ({mode} prefix routing, model \"tinyllama\", {} engines).\n\n\
         OpenAI base URL    http://127.0.0.1:{}/v1\n\
         Envoy stats        http://127.0.0.1:{}/stats/prometheus\n\
         Host admin         http://127.0.0.1:{}  (/metrics, /v1/snapshot, /v1/kv)\n\n\
         Try:\n  curl -s http://127.0.0.1:{}/v1/chat/completions -H 'content-type: application/json' \\\n    \
         -d '{{\"model\": \"tinyllama\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'\n",
        a.engines, a.port, a.envoy_admin_port, a.host_admin_port, a.port
    );
    if a.check {
        return Ok(());
    }
    println!("Ctrl-C stops everything.");
    let _ = stop.await;
    eprintln!("up: stopping");
    // Dropping the stack stops the engines, the host and Envoy.
    drop(stack);
    Ok(())
}
