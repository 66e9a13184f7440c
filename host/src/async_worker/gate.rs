//! The headroom gate: the worker dispatches only while the pool's saturation, as the host
//! computes it for the filters' flow control, is below a ceiling. It reads the host's
//! `GET /v1/snapshot` and fails closed: no answer for longer than `max_age`, or no saturation
//! figure, shuts the gate, because a worker that cannot see the pool must not add load to it.

use std::time::{Duration, Instant};

use serde::Deserialize;

#[derive(Deserialize)]
struct SnapshotView {
    saturation: Option<f64>,
    /// The saturation one more request adds (`1 / (queue_threshold × endpoints)`).
    #[serde(default)]
    dispatch_cost: f64,
}

/// Why the gate is shut, for logs and the `attache_async_gate_closed_total{reason}` counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shut {
    /// The pool is at or above the ceiling.
    Saturated,
    /// The host did not answer, or answered without a saturation figure.
    Blind,
}

impl Shut {
    pub fn label(self) -> &'static str {
        match self {
            Shut::Saturated => "saturated",
            Shut::Blind => "host_unreachable",
        }
    }
}

pub struct Gate {
    http: reqwest::Client,
    url: String,
    token: Option<String>,
    ceiling: f64,
    /// The last reading, and when it was taken.
    last: Option<(f64, Instant)>,
    /// The saturation one dispatch adds, from the last reading.
    cost: f64,
    /// How long a reading stays good.
    max_age: Duration,
}

impl Gate {
    pub fn new(host_admin: &str, token: Option<String>, ceiling: f64, max_age: Duration) -> Self {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap_or_default();
        Self {
            http,
            url: format!("{}/v1/snapshot", host_admin.trim_end_matches('/')),
            token,
            ceiling,
            last: None,
            cost: 0.0,
            max_age,
        }
    }

    pub fn ceiling(&self) -> f64 {
        self.ceiling
    }

    /// The latest saturation reading, if one is fresh.
    pub fn saturation(&self) -> Option<f64> {
        self.last.filter(|(_, at)| at.elapsed() < self.max_age).map(|(s, _)| s)
    }

    /// Read the host now. Errors keep the old reading, which ages out.
    pub async fn refresh(&mut self) -> Result<f64, String> {
        let mut req = self.http.get(&self.url);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.map_err(|e| format!("reading {}: {e}", self.url))?;
        if !resp.status().is_success() {
            return Err(format!("{} answered {}", self.url, resp.status()));
        }
        let view: SnapshotView = resp.json().await.map_err(|e| format!("parsing {}: {e}", self.url))?;
        let s = view.saturation.filter(|s| s.is_finite()).ok_or("the snapshot has no saturation figure")?;
        self.last = Some((s, Instant::now()));
        self.cost = view.dispatch_cost.max(0.0);
        Ok(s)
    }

    /// Open, or why not. `since` counts the worker's own dispatches since the reading: they
    /// have not reached the engines' metrics yet, so each adds the pool's dispatch cost.
    pub fn check(&self, since: u32) -> Result<(), Shut> {
        match self.saturation() {
            None => Err(Shut::Blind),
            Some(s) if s + f64::from(since) * self.cost >= self.ceiling => Err(Shut::Saturated),
            Some(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fails_closed_without_a_reading() {
        let g = Gate::new("http://127.0.0.1:1", None, 0.8, Duration::from_secs(1));
        assert_eq!(g.check(0), Err(Shut::Blind));
    }

    #[test]
    fn opens_below_the_ceiling_only() {
        let mut g = Gate::new("http://127.0.0.1:1", None, 0.8, Duration::from_secs(60));
        g.last = Some((0.5, Instant::now()));
        g.cost = 0.1;
        assert_eq!(g.check(0), Ok(()));
        assert_eq!(g.check(2), Ok(()));
        assert_eq!(g.check(3), Err(Shut::Saturated));
        g.last = Some((0.8, Instant::now()));
        assert_eq!(g.check(0), Err(Shut::Saturated));
    }

    #[test]
    fn an_old_reading_shuts_the_gate() {
        let mut g = Gate::new("http://127.0.0.1:1", None, 0.8, Duration::from_millis(10));
        g.last = Some((0.1, Instant::now() - Duration::from_millis(50)));
        assert_eq!(g.check(0), Err(Shut::Blind));
    }

    #[tokio::test]
    async fn an_unreachable_host_is_an_error() {
        let mut g = Gate::new("http://127.0.0.1:1", None, 0.8, Duration::from_secs(1));
        assert!(g.refresh().await.is_err());
        assert_eq!(g.check(0), Err(Shut::Blind));
    }
}
