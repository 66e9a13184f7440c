//! The engines of a stack: the simulated pool (its options and command line), engines started
//! one at a time or run elsewhere, the host's endpoints file listing them, and their metrics.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::bail;

use super::Stack;
use crate::ports::{free_port, free_port_range, port_open};
use crate::process::wait_until;
use crate::stats::stat_line;

/// Options of the simulated pool.
#[derive(Debug, Clone)]
pub struct SimOpts {
    pub engines: u16,
    pub model: String,
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub max_num_seqs: usize,
    pub time_scale: f64,
    /// Publish KV events (and have the host follow them).
    pub kv_events: bool,
    /// The model's `tokenizer.json` for the simulator (else its byte-level fallback).
    pub tokenizer: Option<PathBuf>,
    /// The model's chat template for the simulator (needs `tokenizer`).
    pub chat_template: Option<PathBuf>,
    /// CPU-offload tier per engine, in blocks (0 = none).
    pub num_cpu_blocks: usize,
    /// Token budget of one engine step.
    pub max_num_batched_tokens: usize,
    /// Tokens per streamed chunk after the first.
    pub stream_interval: usize,
    /// Multipliers of the modelled prefill and decode step times.
    pub prefill_scale: f64,
    pub decode_scale: f64,
    /// LoRA adapters every engine serves, and how many each can run at once.
    pub lora_modules: Vec<String>,
    pub max_loras: usize,
    /// The simulator's cheap mode (thousands of engines; `attache_sim::cheap`): engine i at
    /// `cheap_address(i, port)`, KV events (with `kv_events`) sent to the host's collector.
    pub cheap: Option<CheapOpts>,
    /// A fault: every inference request is answered with this status (`--fail-status`).
    pub fail_status: Option<u16>,
    /// Keep Responses API state in the engines (`--responses-store`, vLLM's
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`). Off, as vLLM ships.
    pub responses_store: bool,
}

/// The simulator's cheap mode: which engines churn, and how many KV events they publish.
#[derive(Debug, Clone)]
pub struct CheapOpts {
    /// Fraction of engines whose load gauges change every `churn_ms`.
    pub busy: f64,
    pub churn_ms: u64,
    /// KV events per second over the whole pool (from the busy engines).
    pub kv_events_per_s: u64,
}

impl Default for SimOpts {
    fn default() -> Self {
        Self {
            engines: 4,
            model: "tinyllama".into(),
            block_size: 16,
            num_gpu_blocks: 4096,
            max_num_seqs: 32,
            time_scale: 0.2,
            kv_events: false,
            tokenizer: None,
            chat_template: None,
            num_cpu_blocks: 0,
            max_num_batched_tokens: 2048,
            stream_interval: 1,
            prefill_scale: 1.0,
            decode_scale: 1.0,
            lora_modules: Vec::new(),
            max_loras: 1,
            cheap: None,
            fail_status: None,
            responses_store: false,
        }
    }
}

/// An engine this stack does not start, and where its KV events are published.
#[derive(Debug, Clone)]
pub struct ExternalEngine {
    pub address: String,
    /// ZMQ endpoint the engine's PUB binds (the host connects to it) and its replay ROUTER.
    pub kv_publisher: Option<String>,
    pub kv_replay: Option<String>,
}

impl Stack {
    /// Engine addresses (`127.0.0.1:port`): the simulated ones, then any external ones.
    pub fn engine_addrs(&self) -> Vec<String> {
        let sims = if self.sim_base_port == 0 { 0 } else { self.sim_opts.engines };
        let cheap = self.sim_opts.cheap.is_some();
        (0..sims)
            .map(|i| {
                if cheap {
                    attache_sim::cheap_address(usize::from(i), self.sim_base_port).to_string()
                } else {
                    format!("127.0.0.1:{}", self.sim_base_port + i)
                }
            })
            .chain(self.external.iter().map(|e| e.address.clone()))
            .collect()
    }

    /// Start one more simulated engine in its own process (so a test can kill just that
    /// engine), listed after the others; returns its address. Call before `start_host`, or
    /// the host picks it up when it re-reads the endpoints file.
    pub fn start_extra_engine(&mut self) -> anyhow::Result<String> {
        self.start_extra_engine_with(self.sim_opts.clone())
    }

    /// [`Stack::start_extra_engine`] with its own options (`engines` is ignored): a slower or
    /// broken engine beside the others.
    pub fn start_extra_engine_with(&mut self, opts: SimOpts) -> anyhow::Result<String> {
        let port = free_port();
        let name = format!("sim-extra-{port}");
        let p = self.spawn(&name, &mut self.sim_command(&opts, 1, port))?;
        self.extra_procs.push(p);
        if !wait_until(Duration::from_secs(20), || port_open(port)) {
            bail!("extra engine did not listen on {port}");
        }
        let address = format!("127.0.0.1:{port}");
        self.external.push(ExternalEngine { address: address.clone(), kv_publisher: None, kv_replay: None });
        self.write_endpoints(&self.engine_addrs())?;
        Ok(address)
    }

    /// Start `n` simulated engines as a Service's pods look: each on its own loopback address
    /// (127.0.0.2, .3, …), all on one port, each in its own process, listed after the others.
    /// Returns the port.
    pub fn start_engine_pods(&mut self, n: u8) -> anyhow::Result<u16> {
        let port = free_port();
        let opts = self.sim_opts.clone();
        for i in 0..n {
            let host = format!("127.0.0.{}", 2 + i);
            let mut cmd = self.sim_command(&opts, 1, port);
            let p = self.spawn(&format!("sim-pod-{host}"), cmd.arg("--host").arg(&host))?;
            self.extra_procs.push(p);
            let address = format!("{host}:{port}");
            let up = wait_until(Duration::from_secs(20), || std::net::TcpStream::connect(&address).is_ok());
            if !up {
                bail!("engine pod {address} did not listen");
            }
            self.external.push(ExternalEngine { address, kv_publisher: None, kv_replay: None });
        }
        self.write_endpoints(&self.engine_addrs())?;
        Ok(port)
    }

    /// Kill an engine started with [`Stack::start_extra_engine`].
    pub fn kill_extra_engine(&mut self, address: &str) {
        let port = address.rsplit(':').next().unwrap_or_default();
        if let Some(p) = self.extra_procs.iter_mut().find(|p| p.name == format!("sim-extra-{port}")) {
            p.kill();
        }
    }

    /// The simulator's command line for `engines` engines from `base_port`, with `opts`.
    fn sim_command(&self, opts: &SimOpts, engines: u16, base_port: u16) -> Command {
        let mut cmd = Command::new(&self.paths.sim_bin);
        cmd.arg("--engines").arg(engines.to_string()).arg("--base-port").arg(base_port.to_string());
        cmd.arg("--model").arg(&opts.model);
        for (flag, v) in [
            ("--block-size", opts.block_size.to_string()),
            ("--num-gpu-blocks", opts.num_gpu_blocks.to_string()),
            ("--max-num-seqs", opts.max_num_seqs.to_string()),
            ("--time-scale", opts.time_scale.to_string()),
            ("--num-cpu-blocks", opts.num_cpu_blocks.to_string()),
            ("--max-num-batched-tokens", opts.max_num_batched_tokens.to_string()),
            ("--stream-interval", opts.stream_interval.to_string()),
            ("--prefill-scale", opts.prefill_scale.to_string()),
            ("--decode-scale", opts.decode_scale.to_string()),
        ] {
            cmd.arg(flag).arg(v);
        }
        if let Some(t) = &opts.tokenizer {
            cmd.arg("--tokenizer").arg(t);
        }
        if let Some(t) = &opts.chat_template {
            cmd.arg("--chat-template").arg(t);
        }
        if !opts.lora_modules.is_empty() {
            cmd.arg("--lora-modules").arg(opts.lora_modules.join(","));
            cmd.arg("--max-loras").arg(opts.max_loras.max(1).to_string());
        }
        if let Some(code) = opts.fail_status {
            cmd.arg("--fail-status").arg(code.to_string());
        }
        if opts.responses_store {
            cmd.arg("--responses-store");
        }
        cmd
    }

    /// Start (or restart, with cold caches) the simulated engines.
    pub fn start_sim(&mut self, opts: SimOpts) -> anyhow::Result<()> {
        if let Some(mut p) = self.sim.take() {
            p.kill();
        }
        if self.sim_base_port == 0 || self.sim_opts.engines != opts.engines {
            self.sim_base_port = if opts.cheap.is_some() { free_port() } else { free_port_range(opts.engines) };
        }
        self.sim_opts = opts.clone();
        let mut cmd = self.sim_command(&opts, opts.engines, self.sim_base_port);
        if let Some(c) = &opts.cheap {
            cmd.arg("--cheap")
                .arg("--cheap-busy")
                .arg(c.busy.to_string())
                .arg("--cheap-churn-ms")
                .arg(c.churn_ms.to_string())
                .arg("--cheap-kv-events-per-s")
                .arg(c.kv_events_per_s.to_string());
            if opts.kv_events {
                // One PUB socket for the pool, connected to the host's collector.
                if self.kv_base_port == 0 {
                    self.kv_base_port = free_port();
                }
                cmd.arg("--kv-events-connect").arg(format!("tcp://127.0.0.1:{}", self.kv_base_port));
            }
            let p = self.spawn("sim", &mut cmd)?;
            self.sim = Some(p);
            let port = self.sim_base_port;
            if !wait_until(Duration::from_secs(20), || port_open(port)) {
                bail!("simulator did not listen on {port}; see {}", self.workdir.join("sim.log").display());
            }
            return self.write_endpoints(&self.engine_addrs());
        }
        if opts.kv_events {
            if self.kv_base_port == 0 {
                self.kv_base_port = free_port_range(2 * opts.engines);
            }
            cmd.arg("--kv-events-port-base").arg(self.kv_base_port.to_string());
        }
        let p = self.spawn("sim", &mut cmd)?;
        self.sim = Some(p);
        let ports: Vec<u16> = (0..opts.engines).map(|i| self.sim_base_port + i).collect();
        if !wait_until(Duration::from_secs(20), || ports.iter().all(|p| port_open(*p))) {
            bail!("simulator did not listen on {ports:?}; see {}", self.workdir.join("sim.log").display());
        }
        self.write_endpoints(&self.engine_addrs())?;
        Ok(())
    }

    /// Write the host's static endpoints file.
    pub fn write_endpoints(&self, addrs: &[String]) -> anyhow::Result<()> {
        let mut y = String::from("endpoints:\n");
        let all = self.engine_addrs();
        let position: std::collections::HashMap<&str, usize> =
            all.iter().enumerate().map(|(i, a)| (a.as_str(), i)).collect();
        // `model` may list several, one per engine in turn (the simulator's `--model`).
        let served: Vec<&str> = self.sim_opts.model.split(',').map(str::trim).collect();
        for a in addrs {
            let index = position.get(a.as_str()).copied().unwrap_or(usize::MAX);
            let role = self.endpoint_roles.get(index).map(String::as_str).unwrap_or("both");
            let own = served.get(index % served.len().max(1)).copied().unwrap_or_default();
            let mut models = vec![own.to_owned()];
            models.extend(self.sim_opts.lora_modules.iter().cloned());
            y.push_str(&format!(
                "  - address: {a}\n    models: [{}]\n    role: {role}\n    engine: vllm\n",
                models.join(", ")
            ));
            if let Some(labels) = self.endpoint_labels.get(index).filter(|l| !l.is_empty()) {
                let kv: Vec<String> = labels.iter().map(|(k, v)| format!("\"{k}\": \"{v}\"")).collect();
                y.push_str(&format!("    labels: {{{}}}\n", kv.join(", ")));
            }
            if let Some(e) = self.external.iter().find(|e| &e.address == a) {
                if let Some(p) = &e.kv_publisher {
                    y.push_str(&format!("    kv_events: {{publisher: \"{p}\""));
                    if let Some(r) = &e.kv_replay {
                        y.push_str(&format!(", replay: \"{r}\""));
                    }
                    y.push_str("}\n");
                }
            } else if self.sim_opts.kv_events && self.sim_opts.cheap.is_none() {
                // Engine i of the simulator publishes on kv_base_port + 2i.
                let i = index.min(usize::from(u16::MAX)) as u16;
                let p = self.kv_base_port + 2 * i;
                y.push_str(&format!(
                    "    kv_events: {{publisher: \"tcp://127.0.0.1:{p}\", replay: \"tcp://127.0.0.1:{}\"}}\n",
                    p + 1
                ));
            }
        }
        let tmp = self.endpoints_file.with_extension("tmp");
        std::fs::write(&tmp, y)?;
        std::fs::rename(&tmp, &self.endpoints_file)?;
        Ok(())
    }

    /// Prefix-cache counters summed over the engines: (queries, hits), in tokens.
    pub async fn prefix_counters(&self) -> anyhow::Result<(f64, f64)> {
        let mut q = 0.0;
        let mut h = 0.0;
        for a in self.engine_addrs() {
            let text = self.http.get(format!("http://{a}/metrics")).send().await?.text().await?;
            q += stat_line(&text, "vllm:prefix_cache_queries_total");
            h += stat_line(&text, "vllm:prefix_cache_hits_total");
        }
        Ok((q, h))
    }

    /// Real milliseconds the simulated engines fell behind their step deadlines, summed: when
    /// this grows, the machine did not keep up with the time scale.
    pub async fn sim_lost_ms(&self) -> anyhow::Result<f64> {
        let mut lost = 0.0;
        for a in self.engine_addrs() {
            let text = self.http.get(format!("http://{a}/metrics")).send().await?.text().await?;
            lost += stat_line(&text, "attache_sim_lost_ms_total");
        }
        Ok(lost)
    }
}
