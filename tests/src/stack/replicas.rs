//! More Envoys beside the stack's own: gateway replicas that share its host and pool, as a
//! Deployment's replicas behind an L4 balancer do. Each is a real Envoy process with its own
//! ports and node id.

use std::process::Command;
use std::time::Duration;

use anyhow::bail;

use super::{EnvoyKind, Stack};
use crate::admin_http::http_get_blocking;
use crate::ports::free_port;
use crate::process::{wait_until, Proc};
use crate::stats::stat_value;

/// One gateway replica.
pub struct Replica {
    pub name: String,
    pub proc: Proc,
    pub port: u16,
    pub admin_port: u16,
}

impl Replica {
    /// A URL on this replica's inference listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Its admin `/stats` as text.
    pub fn stats(&self) -> String {
        http_get_blocking(self.admin_port, "/stats").unwrap_or_default()
    }

    /// A counter or gauge from its `/stats`, 0 if absent.
    pub fn stat(&self, name: &str) -> u64 {
        stat_value(&self.stats(), name)
    }

    /// Its `/stats/prometheus` text (histograms with buckets).
    pub fn prometheus(&self) -> String {
        http_get_blocking(self.admin_port, "/stats/prometheus").unwrap_or_default()
    }

    /// Kill it (SIGKILL: requests in flight on it fail).
    pub fn kill(&mut self) {
        self.proc.kill();
    }
}

impl Stack {
    /// Wait until every replica's filters hold a snapshot of the host's with `ready` ready
    /// engines.
    pub fn wait_replicas(&self, replicas: &[Replica], ready: usize, timeout: Duration) -> anyhow::Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            let host: serde_json::Value = http_get_blocking(self.host_admin_port, "/v1/snapshot")
                .and_then(|b| serde_json::from_str(&b).ok())
                .unwrap_or_default();
            let n = host["endpoints"].as_array().map_or(0, |a| a.iter().filter(|e| e["ready"] == true).count());
            let version = host["version"].as_u64().unwrap_or(0);
            let seen = |r: &Replica| r.stat("wasmcustom.attache.snapshot.version") >= version;
            if n == ready && version > 0 && replicas.iter().all(seen) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("the replicas never saw a snapshot with {ready} ready engines")
    }

    /// Start `n` Envoy replicas of `kind` with `concurrency` workers each, and wait until each
    /// is ready.
    pub fn start_replicas(
        &self,
        n: usize,
        kind: EnvoyKind,
        scheduler_config: &serde_json::Value,
        concurrency: u32,
    ) -> anyhow::Result<Vec<Replica>> {
        (0..n).map(|i| self.start_replica(&format!("envoy-{i}"), kind, scheduler_config, concurrency)).collect()
    }

    /// Start one replica named `name` (its log, work files and node id).
    pub fn start_replica(
        &self,
        name: &str,
        kind: EnvoyKind,
        scheduler_config: &serde_json::Value,
        concurrency: u32,
    ) -> anyhow::Result<Replica> {
        let (port, admin_port) = (free_port(), free_port());
        let cfg = self.render_envoy_on(kind, scheduler_config, port, admin_port)?;
        let path = self.workdir.join(format!("{name}.yaml"));
        std::fs::write(&path, cfg)?;
        let proc = self.spawn(
            name,
            Command::new(&self.paths.envoy)
                .arg("-c")
                .arg(&path)
                .arg("--concurrency")
                .arg(concurrency.to_string())
                .arg("--log-level")
                .arg(&self.envoy_log_level)
                .arg("--service-node")
                .arg(name)
                .arg("--base-id")
                .arg(admin_port.to_string()),
        )?;
        if !wait_until(Duration::from_secs(30), || {
            http_get_blocking(admin_port, "/ready").is_some_and(|b| b.contains("LIVE"))
        }) {
            bail!("{name} not ready; see {}", self.workdir.join(format!("{name}.log")).display());
        }
        Ok(Replica { name: name.to_owned(), proc, port, admin_port })
    }
}
