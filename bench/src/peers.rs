//! The peer routers, run side by side with Attaché on the same pool: `vllm-router`
//! (vllm-project/router; `cache_aware`, and `kv_aware` fed the simulator's KV events) and `smg`
//! (SGLang Model Gateway; `cache_aware`), installed from PyPI into a project-local virtualenv
//! (`.venv-peers/`). Other versions: `--vllm-router-version X --smg-version Y` (the venv is
//! reinstalled when the pinned versions differ from what it holds).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use attache_e2e::ports::free_port;
use attache_e2e::process::Proc;
use attache_e2e::Stack;

#[derive(clap::Args, Debug, Clone)]
pub struct PeerVersions {
    /// vllm-router version from PyPI.
    #[arg(long, default_value = "0.1.17")]
    pub vllm_router_version: String,
    /// smg (SGLang Model Gateway) version from PyPI.
    #[arg(long, default_value = "1.13.0")]
    pub smg_version: String,
}

/// Which peer, with which policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    VllmRouterCache,
    VllmRouterKv,
    SmgCache,
}

impl Peer {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "vllm-router-cache-aware" => Some(Self::VllmRouterCache),
            "vllm-router-kv-aware" => Some(Self::VllmRouterKv),
            "smg-cache-aware" => Some(Self::SmgCache),
            _ => None,
        }
    }
}

/// Install (or reuse) the peers' virtualenv; returns its `bin/`.
pub fn ensure_venv(root: &Path, v: &PeerVersions) -> anyhow::Result<PathBuf> {
    let venv = root.join(".venv-peers");
    let bin = venv.join("bin");
    let stamp = venv.join("attache-versions.txt");
    let want = format!("vllm-router=={}\nsmg=={}\n", v.vllm_router_version, v.smg_version);
    if bin.join("vllm-router").exists()
        && bin.join("smg").exists()
        && std::fs::read_to_string(&stamp).is_ok_and(|s| s == want)
    {
        return Ok(bin);
    }
    println!("peers: installing vllm-router=={} smg=={} into {}", v.vllm_router_version, v.smg_version, venv.display());
    if !bin.join("pip").exists() {
        let st = Command::new("python3").args(["-m", "venv"]).arg(&venv).status().context("python3 -m venv")?;
        anyhow::ensure!(st.success(), "creating {} failed", venv.display());
    }
    let st = Command::new(bin.join("pip"))
        .args(["install", "--quiet", "--disable-pip-version-check"])
        .arg(format!("vllm-router=={}", v.vllm_router_version))
        .arg(format!("smg=={}", v.smg_version))
        .status()
        .context("pip install")?;
    anyhow::ensure!(st.success(), "pip install of the peers failed");
    std::fs::write(&stamp, want)?;
    Ok(bin)
}

fn port_open(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200)).is_ok()
}

/// Start `peer` in front of `workers` (`ip:port`); `kv` gives each worker's KV-event PUB and
/// replay endpoints (for `kv_aware`). Returns the process, its port and its Prometheus port,
/// once it answers.
pub fn start(
    s: &Stack,
    bin: &Path,
    peer: Peer,
    workers: &[String],
    kv: &[(String, String)],
    block_size: usize,
) -> anyhow::Result<(Proc, u16, u16)> {
    let port = free_port();
    let metrics_port = free_port();
    let urls: Vec<String> = workers.iter().map(|w| format!("http://{w}")).collect();
    let mut cmd = match peer {
        Peer::VllmRouterCache | Peer::VllmRouterKv => {
            let mut c = Command::new(bin.join("vllm-router"));
            c.args(["--host", "127.0.0.1", "--port", &port.to_string(), "--prometheus-port"])
                .arg(metrics_port.to_string())
                .arg("--worker-urls")
                .args(&urls)
                .args(["--log-level", "warning"]);
            if peer == Peer::VllmRouterKv {
                c.args(["--policy", "kv_aware", "--kv-event-block-size", &block_size.to_string()]);
                c.args(["--kv-event-model", "tinyllama"]);
                for (url, (publisher, replay)) in urls.iter().zip(kv) {
                    c.arg("--kv-event-source").arg(format!("{url}={publisher}"));
                    c.arg("--kv-event-replay-source").arg(format!("{url}={replay}"));
                }
            } else {
                c.args(["--policy", "cache_aware"]);
            }
            c
        }
        Peer::SmgCache => {
            let mut c = Command::new(bin.join("smg"));
            c.args(["launch", "--host", "127.0.0.1", "--port", &port.to_string(), "--prometheus-port"])
                .arg(metrics_port.to_string())
                .arg("--worker-urls")
                .args(&urls)
                .args(["--policy", "cache_aware", "--log-level", "warn"]);
            c
        }
    };
    let name = format!("{peer:?}").to_lowercase();
    let p = s.spawn(&name, &mut cmd)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if port_open(port) {
            return Ok((p, port, metrics_port));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("{name} did not listen on {port}; see {}", p.log.display())
}

/// Wait until a chat request through `url` succeeds: peers register their workers
/// asynchronously after they start listening.
pub async fn wait_serving(url: &str, model: &str) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let body = attache_e2e::client::chat_body(model, "You are terse.", "ready?", 1);
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut last = String::new();
    while Instant::now() < deadline {
        let o = attache_e2e::client::post(&http, url, body.clone(), &[]).await;
        if o.status == 200 {
            return Ok(());
        }
        last = format!("{} {}", o.status, o.body);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bail!("{url} never served a request: {last}")
}
