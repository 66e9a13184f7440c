//! Start and stop the real processes of an Attaché deployment on loopback.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::paths::Paths;

/// Ports handed out by this process: never twice, so the simulator's range cannot overlap
/// ports already given to Envoy or the host but not yet bound.
static PORTS: std::sync::Mutex<Option<(u16, std::collections::HashSet<u16>)>> = std::sync::Mutex::new(None);

/// The range ports are taken from: below the kernel's ephemeral range (32768-60999 by
/// default), so outgoing connections (Envoy's, the clients') cannot take them between the
/// moment a port is picked and the moment its server binds it.
const PORT_LOW: u16 = 20_000;
const PORT_HIGH: u16 = 32_000;

fn bindable(p: u16) -> bool {
    TcpListener::bind(("127.0.0.1", p)).is_ok()
}

/// Pick `n` consecutive free loopback ports (the simulator binds base..base+n); 0 if none.
pub fn free_port_range(n: u16) -> u16 {
    let mut guard = PORTS.lock().unwrap_or_else(|p| p.into_inner());
    let (next, used) = guard.get_or_insert_with(|| {
        // Start somewhere different in each process, so concurrent runs rarely meet.
        let seed = std::process::id() as u64
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos() as u64)
                .unwrap_or(0);
        (PORT_LOW + (seed % u64::from(PORT_HIGH - PORT_LOW)) as u16, std::collections::HashSet::new())
    });
    for _ in 0..(PORT_HIGH - PORT_LOW) {
        let base = *next;
        *next = if base + n >= PORT_HIGH { PORT_LOW } else { base + n };
        if base + n > PORT_HIGH {
            continue;
        }
        if (0..n).all(|i| !used.contains(&(base + i)) && bindable(base + i)) {
            used.extend((0..n).map(|i| base + i));
            return base;
        }
    }
    0
}

/// Pick a free loopback port.
pub fn free_port() -> u16 {
    free_port_range(1)
}

/// A child process, killed when dropped. Its output goes to `<workdir>/<name>.log`.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

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
        }
    }
}

/// Which Envoy configuration to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvoyKind {
    /// Attaché with the override_host pool (recommended).
    Attache,
    /// Attaché with an ORIGINAL_DST pool.
    AttacheOriginalDst,
    /// Attaché without the bootstrap singleton: every worker subscribes (Istio's shape).
    AttachePerWorker,
    /// Plain round-robin, no Attaché.
    RoundRobin,
}

/// A running deployment: simulator, host and Envoy, on fresh ports.
pub struct Stack {
    pub paths: Paths,
    pub workdir: PathBuf,
    pub sim: Option<Proc>,
    pub host: Option<Proc>,
    pub envoy: Option<Proc>,
    pub sim_opts: SimOpts,
    pub sim_base_port: u16,
    /// First KV-event port: engine i publishes on base+2i, replays on base+2i+1.
    pub kv_base_port: u16,
    pub host_grpc_port: u16,
    pub host_admin_port: u16,
    pub envoy_port: u16,
    pub envoy_admin_port: u16,
    /// Envoy's `--log-level` (`warn` keeps test logs short; Envoy's own default is `info`).
    pub envoy_log_level: String,
    pub endpoints_file: PathBuf,
    pub http: reqwest::Client,
    /// Engines not run by this stack (a live vLLM), listed after the simulated ones.
    pub external: Vec<ExternalEngine>,
    /// Processes started next to the stack (killed with it).
    pub extra_procs: Vec<Proc>,
    /// Custom scorer slots in Envoy's chain (each a stable and a canary ECDS filter, then the
    /// picker). Empty: the scheduler routes alone.
    pub scorer_slots: Vec<String>,
    /// The host's `policy:` configuration (JSON), if the policy service should run.
    pub host_policy: Option<serde_json::Value>,
    /// The host's `flow:` configuration (JSON): saturation detector and objectives.
    pub host_flow: Option<serde_json::Value>,
    /// The host's `kubernetes:` configuration (JSON): discovery from an API server instead of
    /// the endpoints file.
    pub host_kubernetes: Option<serde_json::Value>,
    /// Pod labels per engine (by index in `engine_addrs`), written to the endpoints file.
    pub endpoint_labels: Vec<Vec<(String, String)>>,
    /// `llm-d.ai/role` per engine (`prefill`, `decode`, `both`); engines not listed are `both`.
    pub endpoint_roles: Vec<String>,
    /// An Envoy template to render instead of `envoy/<kind>.yaml` (same placeholders): what a
    /// benchmark variant uses to measure an edited route or cluster.
    pub envoy_template: Option<PathBuf>,
}

/// An engine this stack does not start, and where its KV events are published.
#[derive(Debug, Clone)]
pub struct ExternalEngine {
    pub address: String,
    /// ZMQ endpoint the engine's PUB binds (the host connects to it) and its replay ROUTER.
    pub kv_publisher: Option<String>,
    pub kv_replay: Option<String>,
}

fn wait_until<F: FnMut() -> bool>(timeout: Duration, mut f: F) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

fn port_open(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200)).is_ok()
}

impl Stack {
    /// A stack with nothing started yet; `name` names its work directory.
    pub fn new(name: &str) -> anyhow::Result<Self> {
        let paths = Paths::discover()?;
        let workdir = paths.target.join("attache-e2e").join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&workdir).with_context(|| format!("creating {}", workdir.display()))?;
        Ok(Self {
            endpoints_file: workdir.join("endpoints.yaml"),
            paths,
            workdir,
            sim: None,
            host: None,
            envoy: None,
            sim_opts: SimOpts::default(),
            sim_base_port: 0,
            kv_base_port: 0,
            host_grpc_port: free_port(),
            host_admin_port: free_port(),
            envoy_port: free_port(),
            envoy_admin_port: free_port(),
            envoy_log_level: "warn".into(),
            http: reqwest::Client::builder().pool_max_idle_per_host(64).build()?,
            external: Vec::new(),
            extra_procs: Vec::new(),
            scorer_slots: Vec::new(),
            host_policy: None,
            host_flow: None,
            host_kubernetes: None,
            endpoint_labels: Vec::new(),
            endpoint_roles: Vec::new(),
            envoy_template: None,
        })
    }

    /// Start a process whose output goes to `<workdir>/<name>.log`.
    pub fn spawn(&self, name: &str, cmd: &mut Command) -> anyhow::Result<Proc> {
        let log = self.workdir.join(format!("{name}.log"));
        let f = std::fs::OpenOptions::new().create(true).append(true).open(&log)?;
        let child = cmd
            .stdout(Stdio::from(f.try_clone()?))
            .stderr(Stdio::from(f))
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Proc { name: name.into(), child, log })
    }

    /// Engine addresses (`127.0.0.1:port`): the simulated ones, then any external ones.
    pub fn engine_addrs(&self) -> Vec<String> {
        let sims = if self.sim_base_port == 0 { 0 } else { self.sim_opts.engines };
        (0..sims)
            .map(|i| format!("127.0.0.1:{}", self.sim_base_port + i))
            .chain(self.external.iter().map(|e| e.address.clone()))
            .collect()
    }

    /// Start one more simulated engine in its own process (so a test can kill just that
    /// engine), listed after the others; returns its address. Call before `start_host`, or
    /// the host picks it up when it re-reads the endpoints file.
    pub fn start_extra_engine(&mut self) -> anyhow::Result<String> {
        let port = free_port();
        let opts = self.sim_opts.clone();
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
        cmd
    }

    /// Start (or restart, with cold caches) the simulated engines.
    pub fn start_sim(&mut self, opts: SimOpts) -> anyhow::Result<()> {
        if let Some(mut p) = self.sim.take() {
            p.kill();
        }
        if self.sim_base_port == 0 || self.sim_opts.engines != opts.engines {
            self.sim_base_port = free_port_range(opts.engines);
        }
        self.sim_opts = opts.clone();
        let mut cmd = self.sim_command(&opts, opts.engines, self.sim_base_port);
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
        for a in addrs {
            let index = self.engine_addrs().iter().position(|x| x == a).unwrap_or(usize::MAX);
            let role = self.endpoint_roles.get(index).map(String::as_str).unwrap_or("both");
            let mut models = vec![self.sim_opts.model.clone()];
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
            } else if self.sim_opts.kv_events {
                // Engine i of the simulator publishes on kv_base_port + 2i.
                let i = self.engine_addrs().iter().position(|x| x == a).unwrap_or(0) as u16;
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

    /// Start the host (or restart it).
    pub fn start_host(&mut self) -> anyhow::Result<()> {
        if let Some(mut p) = self.host.take() {
            p.kill();
        }
        let mut cmd = Command::new(&self.paths.host_bin);
        // The tests choose the admin token; one in the caller's environment would change them.
        cmd.arg("host").env_remove("ATTACHE_ADMIN_TOKEN");
        if self.host_policy.is_some() || self.host_flow.is_some() || self.host_kubernetes.is_some() {
            let mut config = serde_json::json!({});
            if let Some(policy) = &self.host_policy {
                config["policy"] = policy.clone();
            }
            if let Some(flow) = &self.host_flow {
                config["flow"] = flow.clone();
            }
            if let Some(k) = &self.host_kubernetes {
                config["kubernetes"] = k.clone();
            }
            let path = self.workdir.join("host.yaml");
            // YAML is a superset of JSON.
            std::fs::write(&path, config.to_string())?;
            cmd.arg("--config").arg(path);
        }
        if self.host_kubernetes.is_none() {
            cmd.arg("--endpoints").arg(&self.endpoints_file);
        }
        let p = self.spawn(
            "host",
            cmd.arg("--grpc-listen")
                .arg(format!("127.0.0.1:{}", self.host_grpc_port))
                .arg("--admin-listen")
                .arg(format!("127.0.0.1:{}", self.host_admin_port))
                .env("RUST_LOG", "info"),
        )?;
        self.host = Some(p);
        let port = self.host_grpc_port;
        if !wait_until(Duration::from_secs(20), || port_open(port)) {
            bail!("host did not listen; see {}", self.workdir.join("host.log").display());
        }
        Ok(())
    }

    pub fn kill_host(&mut self) {
        if let Some(mut p) = self.host.take() {
            p.kill();
        }
    }

    /// The scheduler filter's JSON configuration used by default.
    /// `ATTACHE_SCHEDULER_CONFIG` (JSON) replaces it, to try other weights without rebuilding.
    pub fn default_scheduler_config() -> serde_json::Value {
        if let Some(v) = std::env::var("ATTACHE_SCHEDULER_CONFIG").ok().and_then(|s| serde_json::from_str(&s).ok()) {
            return v;
        }
        serde_json::json!({"role": "scheduler", "scheduler": {"max_body_bytes": 4_194_304}})
    }

    /// Render an Envoy template.
    pub fn render_envoy(&self, kind: EnvoyKind, scheduler_config: &serde_json::Value) -> anyhow::Result<String> {
        let file = match kind {
            EnvoyKind::Attache => "attache.yaml",
            EnvoyKind::AttacheOriginalDst => "attache-original-dst.yaml",
            EnvoyKind::AttachePerWorker => "attache-per-worker.yaml",
            EnvoyKind::RoundRobin => "round-robin.yaml",
        };
        let path = self.envoy_template.clone().unwrap_or_else(|| self.paths.root.join("envoy").join(file));
        let tpl = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let loopback = |port: u16| std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let pool = attache_host::bootstrap::Pool::Static(self.engine_addrs());
        let params = attache_host::bootstrap::Params {
            admin: loopback(self.envoy_admin_port),
            listen: loopback(self.envoy_port),
            host_grpc: loopback(self.host_grpc_port),
            wasm: &self.paths.wasm,
            scheduler_config,
            pool: &pool,
            scorer_slots: &self.scorer_slots,
        };
        attache_host::bootstrap::render(&tpl, &params).with_context(|| format!("rendering {}", path.display()))
    }

    /// Start Envoy (or restart it) with `kind`, and wait until it is ready.
    pub fn start_envoy(
        &mut self,
        kind: EnvoyKind,
        scheduler_config: &serde_json::Value,
        concurrency: u32,
    ) -> anyhow::Result<()> {
        if let Some(mut p) = self.envoy.take() {
            p.kill();
        }
        let cfg = self.render_envoy(kind, scheduler_config)?;
        let path = self.workdir.join("envoy.yaml");
        std::fs::write(&path, cfg)?;
        let p = self.spawn(
            "envoy",
            Command::new(&self.paths.envoy)
                .arg("-c")
                .arg(&path)
                .arg("--concurrency")
                .arg(concurrency.to_string())
                .arg("--log-level")
                .arg(&self.envoy_log_level)
                .arg("--base-id")
                .arg(self.envoy_admin_port.to_string()),
        )?;
        self.envoy = Some(p);
        let admin = self.envoy_admin_port;
        let ready = wait_until(Duration::from_secs(30), || {
            http_get_blocking(admin, "/ready").is_some_and(|b| b.contains("LIVE"))
        });
        if !ready {
            bail!("envoy not ready; see {}", self.workdir.join("envoy.log").display());
        }
        Ok(())
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.envoy_port)
    }

    /// Envoy's admin `/stats` as text (blocking, for use outside async code too).
    pub fn envoy_stats(&self) -> String {
        http_get_blocking(self.envoy_admin_port, "/stats").unwrap_or_default()
    }

    /// A counter or gauge from Envoy's `/stats`, 0 if absent.
    pub fn envoy_stat(&self, name: &str) -> u64 {
        stat_value(&self.envoy_stats(), name)
    }

    /// Envoy's stats once counter `name` reads `want`, or when `timeout` runs out (the caller
    /// asserts on what it got). For the counters the filters add from their tick (the
    /// per-request ones, `attache.requests.scheduled` and `attache.endpoint.*.picks`): they
    /// lag the requests by at most one tick.
    pub fn envoy_stats_when(&self, name: &str, want: u64, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let stats = self.envoy_stats();
            if stat_value(&stats, name) == want || Instant::now() >= deadline {
                return stats;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait until the filters have a snapshot with `want_ready` ready engines: reads the host's
    /// view through its admin API, then waits for the snapshot agent's gauges to show that host
    /// epoch and at least that version.
    pub fn wait_snapshot(&self, want_ready: usize, timeout: Duration) -> anyhow::Result<u64> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(body) = http_get_blocking(self.host_admin_port, "/v1/snapshot") {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) {
                    let ready =
                        v["endpoints"].as_array().map(|a| a.iter().filter(|e| e["ready"] == true).count()).unwrap_or(0);
                    let version = v["version"].as_u64().unwrap_or(0);
                    let epoch = v["host_epoch"].as_u64().unwrap_or(0);
                    let stats = self.envoy_stats();
                    let seen_epoch = stat_value(&stats, "wasmcustom.attache.snapshot.host_epoch");
                    let seen_version = stat_value(&stats, "wasmcustom.attache.snapshot.version");
                    if ready == want_ready && version > 0 && seen_epoch == epoch && seen_version >= version {
                        return Ok(version);
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("filters never saw a snapshot with {want_ready} ready endpoints")
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

/// Value of the first sample line of `name` in a Prometheus exposition.
pub fn stat_line(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// A quantile (`"P99"`) of histogram `name` in Envoy's `/stats` text, over all samples so far
/// (the cumulative value of `P99(interval,cumulative)`). `None` without samples.
pub fn histogram_quantile(stats: &str, name: &str, quantile: &str) -> Option<f64> {
    let rest = stats.lines().find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(": ")))?;
    let q = rest.split_whitespace().find_map(|t| t.strip_prefix(quantile).and_then(|r| r.strip_prefix('(')))?;
    q.trim_end_matches(')').split(',').nth(1)?.parse().ok().filter(|v: &f64| v.is_finite())
}

/// Value of `name: N` in Envoy's `/stats` text.
pub fn stat_value(stats: &str, name: &str) -> u64 {
    stats
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(": ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A tiny blocking HTTP/1.0 GET for admin endpoints (no runtime needed).
pub fn http_get_blocking(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s =
        std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.") {
        return None;
    }
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return Some(dechunk(body));
    }
    Some(body.to_string())
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}
