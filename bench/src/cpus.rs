//! Pinning processes to CPUs (`taskset`, util-linux), so a measured proxy has a core of its
//! own and figures agree from run to run on a small shared machine.

use anyhow::Context;

/// Pin every thread of `pid` to the CPUs `cpus` (a `taskset` list, `0-2`).
pub(crate) fn pin(pid: u32, cpus: &str) -> anyhow::Result<()> {
    let out = std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .output()
        .context("running taskset (util-linux)")?;
    anyhow::ensure!(out.status.success(), "taskset -c {cpus} {pid}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// The CPUs this process may run on, as `taskset` lists them (`0-1`).
pub(crate) fn own_cpus() -> anyhow::Result<String> {
    let out = std::process::Command::new("taskset")
        .args(["-c", "-p", &std::process::id().to_string()])
        .output()
        .context("running taskset (util-linux)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let list = text.rsplit(':').next().map(str::trim).unwrap_or_default();
    anyhow::ensure!(out.status.success() && !list.is_empty(), "taskset -p: {text:?}");
    Ok(list.to_owned())
}

/// The last CPU for the process under test and the others for everything else, as `taskset`
/// lists (`("1", "0-0")`); `None` with one CPU.
pub(crate) fn split() -> Option<(String, String)> {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    (cpus >= 2).then(|| (format!("{}", cpus - 1), format!("0-{}", cpus - 2)))
}
