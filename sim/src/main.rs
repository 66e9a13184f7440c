//! `attache-sim`: serve N simulated vLLM engines on N consecutive ports.

// A harness: its scenarios read top to bottom (workspace lint `too_many_lines`).
#![allow(clippy::too_many_lines)]

use clap::Parser;
use tracing::info;

use attache_sim::api::{self, AppState};
use attache_sim::cheap;
use attache_sim::kv_publish::{self, Encoding, PublisherConfig};
use attache_sim::{Engine, EngineConfig};

#[derive(Parser, Debug)]
#[command(name = "attache-sim", about = "vLLM-compatible engine simulator", version)]
struct Args {
    /// Number of engines.
    #[arg(long, default_value_t = 1)]
    engines: u16,
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port of the first engine; engine i listens on base_port + i.
    #[arg(long, default_value_t = 18001)]
    base_port: u16,
    /// Served model name. A comma-separated list gives engine i the i-th name, cycling
    /// (`--engines 200 --model m0,...,m99`: 100 models of 2 engines each).
    #[arg(long, default_value = "tinyllama")]
    model: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV capacity in blocks, per engine.
    #[arg(long, default_value_t = 2048)]
    num_gpu_blocks: usize,
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    #[arg(long, default_value_t = 131072)]
    max_model_len: usize,
    /// Multiplies every simulated step time.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// CPU-offload tier per engine, in blocks (0 = none). Evicted GPU blocks move there and are
    /// announced with `medium: "CPU"`.
    #[arg(long, default_value_t = 0)]
    num_cpu_blocks: usize,
    /// Cost of reloading a token from the CPU tier, as a fraction of prefilling it.
    #[arg(long, default_value_t = 0.2)]
    cpu_reload_cost: f64,
    /// Cost of pulling a token's KV from a prefill engine (P/D), as a fraction of prefilling it.
    #[arg(long, default_value_t = 0.1)]
    kv_transfer_cost: f64,
    /// LoRA adapters every engine serves (comma-separated names), and how many can be active at
    /// once per engine.
    #[arg(long, value_delimiter = ',')]
    lora_modules: Vec<String>,
    #[arg(long, default_value_t = 1)]
    max_loras: usize,
    /// Multiply modelled prefill step time (hardware calibration; 1.0 = Dynamo's polynomial).
    #[arg(long, default_value_t = 1.0)]
    prefill_scale: f64,
    /// Multiply modelled decode step time.
    #[arg(long, default_value_t = 1.0)]
    decode_scale: f64,
    /// Tokens per streamed chunk after the first (vLLM's `--stream-interval`).
    #[arg(long, default_value_t = 1)]
    stream_interval: usize,
    /// Keep Responses API state in the engine, as vLLM does with
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`: `store`, `previous_response_id`, `background`,
    /// `GET` and `cancel` work. Off, as vLLM ships: `store` is ignored, every id is unknown.
    #[arg(long)]
    responses_store: bool,
    /// Disable prefix caching.
    #[arg(long)]
    no_prefix_caching: bool,
    /// A fault for tests: answer every inference request with this HTTP status (a broken
    /// engine that still reports healthy metrics).
    #[arg(long)]
    fail_status: Option<u16>,
    /// Publish KV events: engine i binds its PUB socket on port BASE+2i and its replay ROUTER
    /// on BASE+2i+1 (vLLM's `tcp://*:port` form).
    #[arg(long)]
    kv_events_port_base: Option<u16>,
    /// Publish KV events by connecting every engine's PUB socket to this collector instead
    /// (vLLM's `tcp://host:port` form); the replay sockets still bind on the port base.
    #[arg(long)]
    kv_events_connect: Option<String>,
    /// KV-event encoding: `map` (vLLM >= 0.26) or `array` (older).
    #[arg(long, default_value = "map")]
    kv_encoding: String,
    /// The model's `tokenizer.json` (byte-level BPE); prompts are tokenized with it.
    #[arg(long)]
    tokenizer: Option<std::path::PathBuf>,
    /// The model's chat template (Jinja); chat and Responses prompts are rendered with it before
    /// tokenizing, as vLLM does. Needs `--tokenizer`.
    #[arg(long, requires = "tokenizer")]
    chat_template: Option<std::path::PathBuf>,
    /// `bos_token` / `eos_token` as the chat template sees them.
    #[arg(long, default_value = "<s>")]
    bos_token: String,
    #[arg(long, default_value = "</s>")]
    eos_token: String,
    /// Cheap mode: serve `--engines` lightweight engines (up to 20,000 and more) from one
    /// listener, engine i at 127.1.{i / 256}.{i % 256}:{base_port} (`attache_sim::cheap`).
    #[arg(long)]
    cheap: bool,
    /// Cheap mode: the fraction of engines whose gauges change.
    #[arg(long, default_value_t = 0.1, requires = "cheap")]
    cheap_busy: f64,
    /// Cheap mode: how often the busy engines' gauges change, in milliseconds.
    #[arg(long, default_value_t = 50, requires = "cheap")]
    cheap_churn_ms: u64,
    /// Cheap mode: KV events a second, in all, published for the busy engines (with
    /// `--kv-events-connect`).
    #[arg(long, default_value_t = 1000.0, requires = "cheap")]
    cheap_kv_events_per_s: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let a = Args::parse();
    if a.cheap {
        return cheap(&a).await;
    }
    let tokenizer = match &a.tokenizer {
        Some(p) => {
            let read = |p: &std::path::Path| {
                std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("reading {}: {e}", p.display()))
            };
            let t = attache_policies::tokenizer::Tokenizer::from_json(read(p)?.as_bytes())?;
            let template = match &a.chat_template {
                Some(c) => {
                    Some(attache_policies::chat_template::ChatTemplate::new(&read(c)?, &a.bos_token, &a.eos_token)?)
                }
                None => None,
            };
            Some(std::sync::Arc::new(std::sync::Mutex::new(attache_policies::prompt_tokens::PromptTokenizer::new(
                t, template,
            ))))
        }
        None => None,
    };
    let mut servers = Vec::new();
    let models: Vec<&str> = a.model.split(',').map(str::trim).filter(|m| !m.is_empty()).collect();
    anyhow::ensure!(!models.is_empty(), "--model names no model");
    for i in 0..a.engines {
        let port = a.base_port + i;
        let model = models[usize::from(i) % models.len()].to_owned();
        let cfg = EngineConfig {
            model: model.clone(),
            block_size: a.block_size,
            num_gpu_blocks: a.num_gpu_blocks,
            max_num_seqs: a.max_num_seqs,
            max_num_batched_tokens: a.max_num_batched_tokens,
            max_model_len: a.max_model_len.min(a.block_size * a.num_gpu_blocks),
            time_scale: a.time_scale,
            enable_prefix_caching: !a.no_prefix_caching,
            num_cpu_blocks: a.num_cpu_blocks,
            cpu_reload_cost: a.cpu_reload_cost,
            kv_transfer_cost: a.kv_transfer_cost,
            lora_adapters: a.lora_modules.clone(),
            max_loras: a.max_loras.max(1),
            prefill_scale: a.prefill_scale,
            decode_scale: a.decode_scale,
            stream_interval: a.stream_interval,
            fail_status: a.fail_status,
        };
        let engine = Engine::new(cfg);
        let base = a.kv_events_port_base.map(|b| b + 2 * i);
        let endpoint = a.kv_events_connect.clone().or_else(|| base.map(|b| format!("tcp://*:{b}")));
        if let Some(endpoint) = endpoint {
            let pc = PublisherConfig {
                endpoint,
                replay_endpoint: base.map(|b| format!("tcp://*:{}", b + 1)),
                topic: format!("kv@{}:{port}@{model}", a.host),
                encoding: if a.kv_encoding == "array" { Encoding::Array } else { Encoding::Map },
                buffer_steps: 10_000,
            };
            let (tx, rx) = std::sync::mpsc::channel();
            engine.set_kv_events(tx);
            kv_publish::spawn(pc, rx)?;
        }
        tokio::spawn(engine.clone().run());
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), port)).await?;
        let app = api::router(AppState {
            engine,
            name: format!("sim-{port}"),
            port,
            address: format!("{}:{port}", a.host),
            tokenizer: tokenizer.clone(),
            responses: attache_sim::responses::ResponseStore::new(a.responses_store),
        });
        info!(port, "engine listening");
        servers.push(tokio::spawn(async move { axum::serve(api::NoDelay(listener), app).await }));
    }
    for s in servers {
        s.await??;
    }
    Ok(())
}

/// `--cheap`: every engine from one listener, one churn task and one KV-event publisher.
async fn cheap(a: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.kv_events_port_base.is_none(),
        "--kv-events-port-base (engines bind their PUB sockets) is not supported with --cheap; \
         use --kv-events-connect tcp://HOST:PORT"
    );
    let models: Vec<String> = a.model.split(',').map(str::trim).filter(|m| !m.is_empty()).map(str::to_owned).collect();
    anyhow::ensure!(!models.is_empty(), "--model names no model");
    let pool = cheap::CheapPool::new(cheap::CheapConfig {
        engines: usize::from(a.engines),
        port: a.base_port,
        models,
        lora_adapters: a.lora_modules.clone(),
        max_loras: a.max_loras.max(1),
        block_size: a.block_size,
        num_gpu_blocks: a.num_gpu_blocks,
        max_model_len: a.max_model_len.min(a.block_size * a.num_gpu_blocks),
        enable_prefix_caching: !a.no_prefix_caching,
        busy_fraction: a.cheap_busy,
    })?;
    let _publisher = match &a.kv_events_connect {
        Some(endpoint) => {
            let encoding = if a.kv_encoding == "array" { Encoding::Array } else { Encoding::Map };
            Some(cheap::spawn_kv_publisher(pool.clone(), endpoint, a.cheap_kv_events_per_s, encoding)?)
        }
        None => None,
    };
    cheap::spawn_churn(pool.clone(), std::time::Duration::from_millis(a.cheap_churn_ms));
    let listener = tokio::net::TcpListener::bind(("0.0.0.0", a.base_port)).await?;
    info!(port = a.base_port, engines = pool.len(), busy = pool.busy().len(), "cheap engines listening");
    cheap::serve(pool, listener).await?;
    Ok(())
}
