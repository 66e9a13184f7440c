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

#[cfg(test)]
mod tests {
    use super::*;

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
