//! An Envoy configured the way gateways configure it for an endpoint picker (EPP): one of
//! `attache_envoy`'s two EPP bootstraps ([`EppShape`]), in front of this stack's engines and
//! calling a picker at a given address. It runs beside the stack's own Envoy (its own ports,
//! log and config file), so a test can send the same requests through both.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use attache_envoy::{EppParams, EppShape};

use super::Stack;
use crate::admin_http::http_get_blocking;
use crate::ports::{free_port, port_open};
use crate::process::{wait_until, Proc};
use crate::stats::stat_value;

/// What [`Stack::start_epp_envoy`] starts.
#[derive(Debug, Clone)]
pub struct EppEnvoyOpts {
    pub shape: EppShape,
    /// The picker's `ext_proc` gRPC address.
    pub epp: SocketAddr,
    /// Connect to the picker over TLS, accepting any certificate.
    pub tls: bool,
    /// The InferencePool's `failureMode`: `FailOpen` is true.
    pub failure_mode_allow: bool,
    /// Test only: the subset hint for requests with `x-test-subset: on`
    /// ([`attache_envoy::SUBSET_HINT_HEADER`]).
    pub subset_hint: Option<Vec<String>>,
    /// Test only: the picker cluster follows the picker's gRPC readiness, as Kubernetes
    /// endpoints would ([`attache_envoy::EppParams::picker_readiness`]).
    pub picker_readiness: bool,
    /// The pool's members for [`EppShape::OverrideHost`]; `None`: the stack's engines.
    pub pool: Option<Vec<String>>,
    /// Envoy's `--concurrency` (worker threads).
    pub concurrency: u32,
}

impl EppEnvoyOpts {
    /// `shape` calling the picker at `epp` over plaintext HTTP/2, `FailClose` (GIE's default),
    /// no subset hint, the stack's engines, one worker.
    pub fn new(shape: EppShape, epp: SocketAddr) -> Self {
        Self {
            shape,
            epp,
            tls: false,
            failure_mode_allow: false,
            subset_hint: None,
            picker_readiness: false,
            pool: None,
            concurrency: 1,
        }
    }
}

/// A running EPP-shaped Envoy; killed when dropped.
pub struct EppEnvoy {
    pub shape: EppShape,
    /// The inference listener's port (loopback).
    pub port: u16,
    /// The admin listener's port (loopback).
    pub admin_port: u16,
    /// The rendered bootstrap.
    pub config: PathBuf,
    pub proc: Proc,
}

impl EppEnvoy {
    /// A URL on the inference listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// A URL on the admin listener.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin_port)
    }

    /// Envoy's admin `/stats` as text (blocking).
    pub fn stats(&self) -> String {
        http_get_blocking(self.admin_port, "/stats").unwrap_or_default()
    }

    /// A counter or gauge from `/stats`, 0 if absent: `http.inference.ext_proc.streams_failed`,
    /// `cluster.pool.upstream_rq_retry`, `cluster.epp.upstream_cx_connect_fail`, ...
    pub fn stat(&self, name: &str) -> u64 {
        stat_value(&self.stats(), name)
    }

    /// Stat `name` once it reads at least `want`, or its last value when `timeout` runs out.
    pub fn stat_when(&self, name: &str, want: u64, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        loop {
            let v = self.stat(name);
            if v >= want || Instant::now() >= deadline {
                return v;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Envoy's log file.
    pub fn log(&self) -> &Path {
        &self.proc.log
    }
}

/// Run Envoy's `--mode validate` on a bootstrap file: Ok, or Envoy's complaint.
pub fn validate_bootstrap(envoy: &Path, file: &Path) -> anyhow::Result<()> {
    let out = Command::new(envoy)
        .args(["--mode", "validate", "-c"])
        .arg(file)
        .output()
        .with_context(|| format!("running {}", envoy.display()))?;
    if !out.status.success() {
        bail!(
            "Envoy rejects {}:\n{}{}",
            file.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

impl Stack {
    /// Render `opts.shape`'s template (`envoy/epp-gie.yaml` or `envoy/epp-istio.yaml`, read
    /// from the repository like [`Stack::render_envoy`]) for loopback ports `port` and
    /// `admin_port`.
    pub fn render_epp_envoy(&self, opts: &EppEnvoyOpts, port: u16, admin_port: u16) -> anyhow::Result<String> {
        let path = self.paths.root.join("envoy").join(opts.shape.file());
        let tpl = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let loopback = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let params = EppParams {
            admin: loopback(admin_port),
            listen: loopback(port),
            epp: opts.epp,
            epp_tls: opts.tls,
            failure_mode_allow: opts.failure_mode_allow,
            pool: opts.pool.clone().unwrap_or_else(|| self.engine_addrs()),
            subset_hint: opts.subset_hint.clone(),
            picker_readiness: opts.picker_readiness,
        };
        attache_envoy::render_epp_template(&tpl, opts.shape, &params)
            .with_context(|| format!("rendering {}", path.display()))
    }

    /// Start an EPP-shaped Envoy on fresh ports and wait until it is ready; `name` names its
    /// log (`<workdir>/<name>.log`) and rendered bootstrap (`<workdir>/<name>.yaml`). The
    /// picker need not be up: Envoy connects to it per request.
    pub fn start_epp_envoy(&self, name: &str, opts: &EppEnvoyOpts) -> anyhow::Result<EppEnvoy> {
        let (port, admin_port) = (free_port(), free_port());
        let config = self.workdir.join(format!("{name}.yaml"));
        std::fs::write(&config, self.render_epp_envoy(opts, port, admin_port)?)?;
        let proc = self.spawn(
            name,
            Command::new(&self.paths.envoy)
                .arg("-c")
                .arg(&config)
                .arg("--concurrency")
                .arg(opts.concurrency.to_string())
                .arg("--log-level")
                .arg(&self.envoy_log_level)
                .arg("--base-id")
                .arg(admin_port.to_string()),
        )?;
        let envoy = EppEnvoy { shape: opts.shape, port, admin_port, config, proc };
        let ready = wait_until(Duration::from_secs(30), || {
            http_get_blocking(admin_port, "/ready").is_some_and(|b| b.contains("LIVE")) && port_open(port)
        });
        if !ready {
            bail!("{name} (Envoy) not ready; see {}", envoy.log().display());
        }
        Ok(envoy)
    }
}
