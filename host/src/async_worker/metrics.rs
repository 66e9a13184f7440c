//! The worker's Prometheus metrics, served at `GET /metrics` on `--admin-listen`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

use super::queue::Depths;

/// Upper bounds (seconds) of the residence-time histogram: submission to result.
const RESIDENCE_BUCKETS: [f64; 12] = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0];

#[derive(Debug, Default)]
pub struct Metrics {
    pub dispatched: AtomicU64,
    pub completed: AtomicU64,
    pub expired: AtomicU64,
    pub dead_lettered: AtomicU64,
    /// Running jobs this worker stopped because they were cancelled.
    pub cancelled: AtomicU64,
    pub lapsed: AtomicU64,
    /// A result was already written when this worker finished the job (it ran twice).
    pub duplicates: AtomicU64,
    /// Submissions dropped because their id was already waiting, running or finished.
    pub duplicate_submissions: AtomicU64,
    /// Leases this worker lost (it stopped that job; another worker runs it).
    pub leases_lost: AtomicU64,
    /// Running jobs handed back to pending by a graceful stop.
    pub released: AtomicU64,
    pub redis_errors: AtomicU64,
    pub gate_errors: AtomicU64,
    pub inflight: AtomicI64,
    /// Gate saturation × 1000, or -1 when the worker cannot see the pool.
    pub saturation_permille: AtomicI64,
    /// 1 while the gate lets work out.
    pub gate_open: AtomicI64,
    retried: Mutex<BTreeMap<&'static str, u64>>,
    gate_closed: Mutex<BTreeMap<&'static str, u64>>,
    residence: Mutex<(Vec<u64>, u64, f64)>,
    depths: Mutex<Option<Depths>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

impl Metrics {
    pub fn count(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// A retry scheduled, by reason (`shed`, `failed`).
    pub fn retried(&self, reason: &'static str) {
        *lock(&self.retried).entry(reason).or_default() += 1;
    }

    pub fn gate_closed(&self, reason: &'static str) {
        *lock(&self.gate_closed).entry(reason).or_default() += 1;
    }

    /// A job ended, `secs` after it was created.
    pub fn residence(&self, secs: f64) {
        let mut h = lock(&self.residence);
        if h.0.is_empty() {
            h.0 = vec![0; RESIDENCE_BUCKETS.len()];
        }
        for (i, le) in RESIDENCE_BUCKETS.iter().enumerate() {
            if secs <= *le {
                h.0[i] += 1;
            }
        }
        h.1 += 1;
        h.2 += secs.max(0.0);
    }

    pub fn set_depths(&self, d: Depths) {
        *lock(&self.depths) = Some(d);
    }

    pub fn render(&self) -> String {
        let mut out = String::with_capacity(2048);
        self.render_counters(&mut out);
        self.render_gauges(&mut out);
        out
    }

    fn render_counters(&self, out: &mut String) {
        let counters: [(&str, &AtomicU64, &str); 12] = [
            ("attache_async_dispatched_total", &self.dispatched, "Jobs sent to the gateway (every attempt)."),
            (
                "attache_async_completed_total",
                &self.completed,
                "Jobs whose result this worker wrote with a 2xx answer.",
            ),
            ("attache_async_expired_total", &self.expired, "Jobs that reached their deadline before an answer."),
            (
                "attache_async_dead_lettered_total",
                &self.dead_lettered,
                "Jobs moved to the dead-letter set, with a reason.",
            ),
            (
                "attache_async_cancelled_total",
                &self.cancelled,
                "Running jobs this worker stopped because they were cancelled.",
            ),
            (
                "attache_async_lapsed_total",
                &self.lapsed,
                "Leases that lapsed (a worker died) and went back to pending.",
            ),
            (
                "attache_async_duplicate_results_total",
                &self.duplicates,
                "Finished jobs whose result was already written.",
            ),
            (
                "attache_async_duplicate_submissions_total",
                &self.duplicate_submissions,
                "Submissions dropped: their id was already waiting, running or finished.",
            ),
            (
                "attache_async_leases_lost_total",
                &self.leases_lost,
                "Leases lost: the job stopped here, another worker runs it.",
            ),
            ("attache_async_released_total", &self.released, "Running jobs handed back to pending by a graceful stop."),
            ("attache_async_redis_errors_total", &self.redis_errors, "Redis commands that failed (retried)."),
            ("attache_async_gate_errors_total", &self.gate_errors, "Failed reads of the host's saturation."),
        ];
        for (name, c, help) in counters {
            family(out, name, "counter", help);
            let _ = writeln!(out, "{name} {}", c.load(Ordering::Relaxed));
        }
        family(out, "attache_async_retried_total", "counter", "Retries scheduled, by reason (shed, failed).");
        for (reason, n) in lock(&self.retried).iter() {
            let _ = writeln!(out, "attache_async_retried_total{{reason=\"{reason}\"}} {n}");
        }
        family(out, "attache_async_gate_closed_total", "counter", "Claims held back by the gate, by reason.");
        for (reason, n) in lock(&self.gate_closed).iter() {
            let _ = writeln!(out, "attache_async_gate_closed_total{{reason=\"{reason}\"}} {n}");
        }
    }

    fn render_gauges(&self, out: &mut String) {
        family(out, "attache_async_inflight", "gauge", "Jobs this worker is running now.");
        let _ = writeln!(out, "attache_async_inflight {}", self.inflight.load(Ordering::Relaxed));
        family(out, "attache_async_gate_open", "gauge", "1 while the gate lets jobs out.");
        let _ = writeln!(out, "attache_async_gate_open {}", self.gate_open.load(Ordering::Relaxed));
        family(
            out,
            "attache_async_pool_saturation",
            "gauge",
            "The host's pool saturation as the gate last read it (-1: unknown).",
        );
        let s = self.saturation_permille.load(Ordering::Relaxed);
        let _ = writeln!(out, "attache_async_pool_saturation {}", if s < 0 { -1.0 } else { s as f64 / 1000.0 });
        if let Some(d) = *lock(&self.depths) {
            family(out, "attache_async_queue_depth", "gauge", "Jobs in the store, by state.");
            for (state, n) in [
                ("intake", d.intake),
                ("pending", d.pending),
                ("inflight", d.inflight),
                ("delayed", d.delayed),
                ("dead", d.dead),
                ("results", d.results),
            ] {
                let _ = writeln!(out, "attache_async_queue_depth{{state=\"{state}\"}} {n}");
            }
        }
        let h = lock(&self.residence);
        family(out, "attache_async_residence_seconds", "histogram", "Time from a job's creation to its result.");
        for (i, le) in RESIDENCE_BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "attache_async_residence_seconds_bucket{{le=\"{le}\"}} {}",
                h.0.get(i).copied().unwrap_or(0)
            );
        }
        let _ = writeln!(out, "attache_async_residence_seconds_bucket{{le=\"+Inf\"}} {}", h.1);
        let _ = writeln!(out, "attache_async_residence_seconds_sum {}", h.2);
        let _ = writeln!(out, "attache_async_residence_seconds_count {}", h.1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_histogram_and_depths() {
        let m = Metrics::default();
        Metrics::count(&m.dispatched, 3);
        m.retried("shed");
        m.residence(0.3);
        m.residence(70.0);
        m.set_depths(Depths { pending: 5, ..Depths::default() });
        let text = m.render();
        assert!(text.contains("attache_async_dispatched_total 3"), "{text}");
        assert!(text.contains("attache_async_retried_total{reason=\"shed\"} 1"));
        assert!(text.contains("attache_async_residence_seconds_bucket{le=\"0.5\"} 1"));
        assert!(text.contains("attache_async_residence_seconds_bucket{le=\"300\"} 2"));
        assert!(text.contains("attache_async_residence_seconds_count 2"));
        assert!(text.contains("attache_async_queue_depth{state=\"pending\"} 5"));
    }
}
