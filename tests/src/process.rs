//! Child processes with their output in a log file, killed when dropped, and waiting on them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

/// A child process, killed when dropped. Its output goes to `<workdir>/<name>.log`.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    /// Start `cmd` with its output appended to `<workdir>/<name>.log`.
    pub fn spawn(workdir: &Path, name: &str, cmd: &mut Command) -> anyhow::Result<Self> {
        let log = workdir.join(format!("{name}.log"));
        let f = std::fs::OpenOptions::new().create(true).append(true).open(&log)?;
        let child = cmd
            .stdout(Stdio::from(f.try_clone()?))
            .stderr(Stdio::from(f))
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Self { name: name.into(), child, log })
    }
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

/// Poll `f` every 50 ms until it holds (true) or `timeout` runs out (false).
pub fn wait_until<F: FnMut() -> bool>(timeout: Duration, mut f: F) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}
