//! The Envoy of a stack: which bootstrap, rendering it, starting Envoy, and reading its stats.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use attache_envoy::{Params, Pool, Variant};

use super::Stack;
use crate::admin_http::http_get_blocking;
use crate::process::wait_until;
use crate::stats::stat_value;

/// Which Envoy configuration to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvoyKind {
    /// Attaché with the override_host pool (recommended).
    Attache,
    /// Attaché with an ORIGINAL_DST pool ([`Variant::OriginalDst`]).
    AttacheOriginalDst,
    /// Attaché without the bootstrap singleton: every worker subscribes (Istio's shape,
    /// [`Variant::PerWorker`]).
    AttachePerWorker,
    /// Plain round-robin, no Attaché.
    RoundRobin,
}

impl Stack {
    /// The scheduler filter's JSON configuration used by default.
    /// `ATTACHE_SCHEDULER_CONFIG` (JSON) replaces it, to try other weights without rebuilding.
    pub fn default_scheduler_config() -> serde_json::Value {
        if let Some(v) = std::env::var("ATTACHE_SCHEDULER_CONFIG").ok().and_then(|s| serde_json::from_str(&s).ok()) {
            return v;
        }
        serde_json::json!({"role": "scheduler", "scheduler": {"max_body_bytes": 4_194_304}})
    }

    /// Render `kind`'s bootstrap: `envoy/attache.yaml` as written or as one of its variants,
    /// or `envoy/round-robin.yaml`. [`Stack::envoy_template`] replaces the file.
    pub fn render_envoy(&self, kind: EnvoyKind, scheduler_config: &serde_json::Value) -> anyhow::Result<String> {
        self.render_envoy_on(kind, scheduler_config, self.envoy_port, self.envoy_admin_port)
    }

    /// [`Stack::render_envoy`] for an Envoy listening on `port`, its admin on `admin_port`.
    pub fn render_envoy_on(
        &self,
        kind: EnvoyKind,
        scheduler_config: &serde_json::Value,
        port: u16,
        admin_port: u16,
    ) -> anyhow::Result<String> {
        let (file, variant) = match kind {
            EnvoyKind::Attache => ("attache.yaml", Variant::AsWritten),
            EnvoyKind::AttacheOriginalDst => ("attache.yaml", Variant::OriginalDst),
            EnvoyKind::AttachePerWorker => ("attache.yaml", Variant::PerWorker),
            EnvoyKind::RoundRobin => ("round-robin.yaml", Variant::AsWritten),
        };
        let path = self.envoy_template.clone().unwrap_or_else(|| self.paths.root.join("envoy").join(file));
        let tpl = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let loopback = |port: u16| std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let pool = Pool::Static(self.engine_addrs());
        let hosts: Vec<std::net::SocketAddr> = std::iter::once(self.host_grpc_port)
            .chain(self.more_hosts.iter().map(|h| h.grpc_port))
            .map(loopback)
            .collect();
        let params = Params {
            admin: loopback(admin_port),
            listen: loopback(port),
            host_grpc: &hosts,
            wasm: &self.paths.wasm,
            scheduler_config,
            pool: &pool,
            scorer_slots: &self.scorer_slots,
            variant,
        };
        attache_envoy::render(&tpl, &params).with_context(|| format!("rendering {} as {variant:?}", path.display()))
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

    /// A URL on Envoy's inference listener.
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
                        // The agent has it; each scheduler worker takes it on its next tick (20 ms).
                        std::thread::sleep(Duration::from_millis(50));
                        return Ok(version);
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("filters never saw a snapshot with {want_ready} ready endpoints")
    }
}
