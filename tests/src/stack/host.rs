//! The Attaché host process of a stack: its configuration file and command line.

use std::process::Command;
use std::time::Duration;

use anyhow::bail;

use super::Stack;
use crate::ports::{free_port, port_open};
use crate::process::{wait_until, Proc};

/// A host replica beside the stack's own, sharing its discovery and configuration.
pub struct MoreHost {
    pub proc: Proc,
    pub grpc_port: u16,
    pub admin_port: u16,
}

impl Stack {
    /// Start the host (or restart it). With [`Stack::more_hosts`] it peers with them.
    pub fn start_host(&mut self) -> anyhow::Result<()> {
        if let Some(mut p) = self.host.take() {
            p.kill();
        }
        let (grpc, admin) = (self.host_grpc_port, self.host_admin_port);
        let p = self.spawn_host("host", grpc, admin)?;
        self.host = Some(p);
        Ok(())
    }

    /// Start another host replica on fresh ports, peered with every other one (restart the
    /// stack's own host after, so it peers with this one too).
    pub fn start_more_host(&mut self) -> anyhow::Result<usize> {
        let (grpc, admin) = (free_port(), free_port());
        let name = format!("host-{}", self.more_hosts.len() + 1);
        self.more_hosts.push(MoreHost {
            proc: self.spawn_host(&name, grpc, admin)?,
            grpc_port: grpc,
            admin_port: admin,
        });
        Ok(self.more_hosts.len() - 1)
    }

    /// Kill host replica `i` of [`Stack::more_hosts`] (SIGKILL).
    pub fn kill_more_host(&mut self, i: usize) {
        if let Some(h) = self.more_hosts.get_mut(i) {
            h.proc.kill();
        }
    }

    /// Start host replica `i` again on its ports.
    pub fn restart_more_host(&mut self, i: usize) -> anyhow::Result<()> {
        let Some((grpc, admin)) = self.more_hosts.get(i).map(|h| (h.grpc_port, h.admin_port)) else {
            bail!("no host replica {i}");
        };
        let p = self.spawn_host(&format!("host-{}", i + 1), grpc, admin)?;
        if let Some(h) = self.more_hosts.get_mut(i) {
            h.proc = p;
        }
        Ok(())
    }

    /// Every host replica's admin port: the stack's own first.
    pub fn host_admin_ports(&self) -> Vec<u16> {
        std::iter::once(self.host_admin_port).chain(self.more_hosts.iter().map(|h| h.admin_port)).collect()
    }

    /// Every host replica's gRPC port: the stack's own first.
    pub fn host_grpc_ports(&self) -> Vec<u16> {
        std::iter::once(self.host_grpc_port).chain(self.more_hosts.iter().map(|h| h.grpc_port)).collect()
    }

    fn spawn_host(&self, name: &str, grpc_port: u16, admin_port: u16) -> anyhow::Result<Proc> {
        let mut cmd = Command::new(&self.paths.host_bin);
        // The tests choose the admin token; one in the caller's environment would change them.
        cmd.arg("host").env_remove("ATTACHE_ADMIN_TOKEN");
        let peers: Vec<String> =
            self.host_grpc_ports().into_iter().filter(|p| *p != grpc_port).map(|p| format!("127.0.0.1:{p}")).collect();
        if self.host_policy.is_some()
            || self.host_flow.is_some()
            || self.host_kubernetes.is_some()
            || self.host_epp.is_some()
            || self.host_extra.is_some()
            || !peers.is_empty()
            || self.cheap_kv_collector().is_some()
        {
            let mut config = self.host_extra.clone().unwrap_or_else(|| serde_json::json!({}));
            if let Some(c) = self.cheap_kv_collector() {
                config["kv_events_bind"] = serde_json::json!(c);
            }
            if !peers.is_empty() {
                config["fleet"]["peers"] = serde_json::json!(peers);
            }
            if let Some(policy) = &self.host_policy {
                config["policy"] = policy.clone();
                // Each replica keeps its own store (with the state in Kubernetes, a cache).
                if let (true, Some(dir)) = (name != "host", policy["store_dir"].as_str()) {
                    config["policy"]["store_dir"] = serde_json::json!(format!("{dir}-{name}"));
                }
            }
            if let Some(flow) = &self.host_flow {
                config["flow"] = flow.clone();
            }
            if let Some(k) = &self.host_kubernetes {
                config["kubernetes"] = k.clone();
            }
            if let Some(e) = self.host_epp.as_ref().filter(|_| name == "host") {
                let mut e = e.clone();
                if e.get("listen").is_none() {
                    e["listen"] = serde_json::json!(format!("127.0.0.1:{}", self.host_epp_port));
                }
                config["epp"] = e;
            }
            let path = self.workdir.join(format!("{name}.yaml"));
            // YAML is a superset of JSON.
            std::fs::write(&path, config.to_string())?;
            cmd.arg("--config").arg(path);
        }
        if self.host_kubernetes.is_none() {
            cmd.arg("--endpoints").arg(&self.endpoints_file);
        }
        let p = self.spawn(
            name,
            cmd.arg("--grpc-listen")
                .arg(format!("127.0.0.1:{grpc_port}"))
                .arg("--admin-listen")
                .arg(format!("127.0.0.1:{admin_port}"))
                .env("RUST_LOG", "info"),
        )?;
        // The endpoint picker listens on the stack's own host only.
        let epp = self.host_epp.as_ref().filter(|_| name == "host").map(|_| self.host_epp_port);
        if !wait_until(Duration::from_secs(20), || port_open(grpc_port) && epp.is_none_or(port_open)) {
            bail!("{name} did not listen; see {}", self.workdir.join(format!("{name}.log")).display());
        }
        Ok(p)
    }

    /// Where the host binds its KV-event collector for the simulator's cheap mode, whose one
    /// publisher connects to it.
    fn cheap_kv_collector(&self) -> Option<String> {
        (self.sim_opts.cheap.is_some() && self.sim_opts.kv_events && self.kv_base_port != 0)
            .then(|| format!("tcp://127.0.0.1:{}", self.kv_base_port))
    }

    pub fn kill_host(&mut self) {
        if let Some(mut p) = self.host.take() {
            p.kill();
        }
    }
}
