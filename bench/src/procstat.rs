//! What a process costs, read from `/proc`: on-CPU time of all its threads and resident memory.

/// On-CPU nanoseconds of every thread of `pid` (`/proc/<pid>/task/*/schedstat`).
pub fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Resident set size of `pid` in MiB (`VmRSS`), or 0 when the process is gone.
pub fn rss_mb(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// CPU time the hypervisor gave to other guests ("steal"), measured from when this was made:
/// on a shared VM it is why one build's figures move between runs, so results carry it.
pub struct StealMeter {
    start: Option<(u64, u64)>,
}

/// (steal, total) jiffies over all CPUs, from the first line of `/proc/stat`.
fn steal_and_total(stat: &str) -> Option<(u64, u64)> {
    let fields: Vec<u64> =
        stat.lines().next()?.strip_prefix("cpu ")?.split_whitespace().filter_map(|f| f.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal [guest guest_nice, already in user/nice]
    let steal = *fields.get(7)?;
    Some((steal, fields.iter().take(8).sum()))
}

impl StealMeter {
    pub fn start() -> Self {
        Self { start: std::fs::read_to_string("/proc/stat").ok().as_deref().and_then(steal_and_total) }
    }

    /// Percent of all CPU time stolen since [`StealMeter::start`] (None where /proc/stat is not
    /// readable or no time passed).
    pub fn percent(&self) -> Option<f64> {
        let (s0, t0) = self.start?;
        let (s1, t1) = std::fs::read_to_string("/proc/stat").ok().as_deref().and_then(steal_and_total)?;
        let dt = t1.checked_sub(t0).filter(|&d| d > 0)?;
        Some((s1.saturating_sub(s0)) as f64 * 100.0 / dt as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steal_is_the_eighth_field_of_the_cpu_line() {
        let stat = "cpu  100 5 50 800 10 1 2 32 0 0\ncpu0 50 2 25 400 5 0 1 16 0 0\n";
        assert_eq!(steal_and_total(stat), Some((32, 1000)));
        assert_eq!(steal_and_total("intr 1 2 3\n"), None);
        // A kernel without the steal column cannot be read as zero steal.
        assert_eq!(steal_and_total("cpu  1 2 3 4 5 6 7\n"), None);
    }

    #[test]
    fn reads_this_process() {
        let me = std::process::id();
        let before = cpu_ns(me);
        // /proc counts CPU in clock ticks (10 ms): spin until a tick lands, for at most 3 s.
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while cpu_ns(me) <= before && start.elapsed() < std::time::Duration::from_secs(3) {
            for i in 0..1_000_000u64 {
                x = x.wrapping_mul(31).wrapping_add(i);
            }
            std::hint::black_box(x);
        }
        assert!(cpu_ns(me) > before, "3 s of spinning must add on-CPU time");
        assert!(rss_mb(me) > 1.0);
        assert_eq!(rss_mb(u32::MAX), 0.0);
    }
}
