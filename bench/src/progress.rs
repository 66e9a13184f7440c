//! Progress of a long benchmark run on stderr: the stage, requests done out of the total, and
//! an estimate of the time left, every few seconds, so a half-hour run is not silent.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug)]
struct Inner {
    label: String,
    total: usize,
    stages: usize,
    done: AtomicUsize,
    stage: AtomicUsize,
    started: Instant,
}

impl Inner {
    fn line(&self) -> String {
        let done = self.done.load(Ordering::Relaxed);
        let elapsed = self.started.elapsed().as_secs_f64();
        let left = if done == 0 {
            "?".to_owned()
        } else {
            format!("{:.0} s", elapsed * (self.total.saturating_sub(done)) as f64 / done as f64)
        };
        let stage = if self.stages > 1 {
            format!(" stage {}/{},", self.stage.load(Ordering::Relaxed), self.stages.saturating_sub(1))
        } else {
            String::new()
        };
        format!(
            "[{}]{stage} {done}/{} requests ({:.0}%), {elapsed:.0} s elapsed, about {left} left",
            self.label,
            self.total,
            100.0 * done as f64 / self.total.max(1) as f64
        )
    }
}

/// A handle that the request tasks share; the reporter stops when the last one is dropped.
#[derive(Debug, Clone)]
pub struct Progress {
    inner: Arc<Inner>,
}

impl Progress {
    /// Report on `total` requests every `every` until dropped. `stages` counts the warm-up
    /// stage 0 too; 1 or less for runs without stages.
    pub fn start(label: &str, total: usize, stages: usize, every: Duration) -> Self {
        let inner = Arc::new(Inner {
            label: label.to_owned(),
            total,
            stages,
            done: AtomicUsize::new(0),
            stage: AtomicUsize::new(0),
            started: Instant::now(),
        });
        let weak = Arc::downgrade(&inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                match weak.upgrade() {
                    Some(p) => eprintln!("{}", p.line()),
                    None => break,
                }
            }
        });
        Self { inner }
    }

    /// One request finished (whatever its outcome).
    pub fn done(&self) {
        self.inner.done.fetch_add(1, Ordering::Relaxed);
    }

    /// The run reached `stage` (0 is the warm-up).
    pub fn stage(&self, stage: usize) {
        self.inner.stage.fetch_max(stage, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn counts_requests_and_estimates_the_time_left() {
        let p = Progress::start("peers/agentic attache", 10, 3, Duration::from_secs(60));
        let first = p.inner.line();
        assert!(first.contains("0/10 requests (0%)") && first.contains("about ? left"), "{first}");
        p.stage(1);
        for _ in 0..4 {
            p.clone().done();
        }
        let l = p.inner.line();
        assert!(l.starts_with("[peers/agentic attache] stage 1/2, 4/10 requests (40%)"), "{l}");
        assert!(l.contains(" s left"), "{l}");
    }
}
