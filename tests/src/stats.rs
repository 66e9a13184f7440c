//! Reading numbers out of stats text: Envoy's admin `/stats` and Prometheus expositions.

/// Value of the first sample line of `name` in a Prometheus exposition.
pub fn stat_line(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// A quantile (`"P99"`) of histogram `name` in Envoy's `/stats` text, over all samples so far
/// (the cumulative value of `P99(interval,cumulative)`). `None` without samples.
pub fn histogram_quantile(stats: &str, name: &str, quantile: &str) -> Option<f64> {
    let rest = stats.lines().find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(": ")))?;
    let q = rest.split_whitespace().find_map(|t| t.strip_prefix(quantile).and_then(|r| r.strip_prefix('(')))?;
    q.trim_end_matches(')').split(',').nth(1)?.parse().ok().filter(|v: &f64| v.is_finite())
}

/// Value of `name: N` in Envoy's `/stats` text.
pub fn stat_value(stats: &str, name: &str) -> u64 {
    stats
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(": ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}
