//! The Attaché host process of a stack: its configuration file and command line.

use std::process::Command;
use std::time::Duration;

use anyhow::bail;

use super::Stack;
use crate::ports::port_open;
use crate::process::wait_until;

impl Stack {
    /// Start the host (or restart it).
    pub fn start_host(&mut self) -> anyhow::Result<()> {
        if let Some(mut p) = self.host.take() {
            p.kill();
        }
        let mut cmd = Command::new(&self.paths.host_bin);
        // The tests choose the admin token; one in the caller's environment would change them.
        cmd.arg("host").env_remove("ATTACHE_ADMIN_TOKEN");
        if self.host_policy.is_some()
            || self.host_flow.is_some()
            || self.host_kubernetes.is_some()
            || self.host_epp.is_some()
            || self.host_extra.is_some()
        {
            let mut config = self.host_extra.clone().unwrap_or_else(|| serde_json::json!({}));
            if let Some(policy) = &self.host_policy {
                config["policy"] = policy.clone();
            }
            if let Some(flow) = &self.host_flow {
                config["flow"] = flow.clone();
            }
            if let Some(k) = &self.host_kubernetes {
                config["kubernetes"] = k.clone();
            }
            if let Some(e) = &self.host_epp {
                let mut e = e.clone();
                if e.get("listen").is_none() {
                    e["listen"] = serde_json::json!(format!("127.0.0.1:{}", self.host_epp_port));
                }
                config["epp"] = e;
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
        let epp = self.host_epp.as_ref().map(|_| self.host_epp_port);
        if !wait_until(Duration::from_secs(20), || port_open(port) && epp.is_none_or(port_open)) {
            bail!("host did not listen; see {}", self.workdir.join("host.log").display());
        }
        Ok(())
    }

    pub fn kill_host(&mut self) {
        if let Some(mut p) = self.host.take() {
            p.kill();
        }
    }
}
