//! `attache async` beside a stack: the batch worker between a [`Redis`] job store and the
//! stack's gateway, reading the stack's host for the pool's saturation.

use std::process::Command;
use std::time::Duration;

use crate::admin_http::http_get_blocking;
use crate::ports::{free_port, port_open};
use crate::process::{wait_until, Proc};
use crate::redis::Redis;
use crate::stats::stat_line;
use crate::Stack;

pub struct AsyncWorker {
    pub proc: Proc,
    /// Its metrics port (`/metrics`).
    pub admin: u16,
}

impl AsyncWorker {
    /// Start the worker on `s`'s gateway and host with `extra` flags (an `--host-admin` among
    /// them replaces the stack's host).
    pub fn start(s: &Stack, redis: &Redis, extra: &[&str]) -> anyhow::Result<Self> {
        let admin = free_port();
        let mut cmd = Command::new(&s.paths.host_bin);
        cmd.arg("async")
            .args(["--redis", &redis.addr().to_string()])
            .args(["--gateway", &format!("http://127.0.0.1:{}", s.envoy_port)])
            .args(["--admin-listen", &format!("127.0.0.1:{admin}")]);
        if !extra.contains(&"--host-admin") {
            cmd.args(["--host-admin", &format!("http://127.0.0.1:{}", s.host_admin_port)]);
        }
        cmd.args(extra).env("RUST_LOG", "info");
        let proc = s.spawn("async-worker", &mut cmd)?;
        anyhow::ensure!(
            wait_until(Duration::from_secs(10), || port_open(admin)),
            "the worker's metrics did not come up"
        );
        Ok(Self { proc, admin })
    }

    /// A sample of its metrics (`name` may carry labels); 0 when absent or unreachable.
    pub fn metric(&self, name: &str) -> f64 {
        http_get_blocking(self.admin, "/metrics").map(|t| stat_line(&t, name)).unwrap_or(0.0)
    }

    /// Its whole exposition.
    pub fn metrics(&self) -> String {
        http_get_blocking(self.admin, "/metrics").unwrap_or_default()
    }
}
