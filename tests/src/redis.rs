//! A `redis-server` (Debian's, which `cargo xtask` installs) on a fresh port, with append-only
//! persistence fsynced on every write, in a stack's folder: the async worker's job store in
//! its tests and benchmark.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::ports::{free_port, port_open};
use crate::process::{wait_until, Proc};
use crate::Stack;

pub struct Redis {
    pub port: u16,
    dir: PathBuf,
    proc: Option<Proc>,
}

impl Redis {
    pub fn start(s: &Stack) -> anyhow::Result<Self> {
        let dir = s.workdir.join("redis");
        std::fs::create_dir_all(&dir)?;
        let mut r = Self { port: free_port(), dir, proc: None };
        r.restart(s)?;
        Ok(r)
    }

    /// Start it again on the same port and folder (it reloads its append-only file).
    pub fn restart(&mut self, s: &Stack) -> anyhow::Result<()> {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "yes", "--appendfsync", "always"])
            .arg("--dir")
            .arg(&self.dir);
        self.proc = Some(s.spawn("redis", &mut cmd)?);
        anyhow::ensure!(wait_until(Duration::from_secs(10), || port_open(self.port)), "redis-server did not start");
        Ok(())
    }

    /// SIGKILL: no chance to flush anything the append-only file does not already hold.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        ([127, 0, 0, 1], self.port).into()
    }
}
