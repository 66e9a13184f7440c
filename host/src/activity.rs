//! Engine activity: KV events from an engine wake its scraper early (its metrics are about to
//! change), so an idle engine's long scrape interval does not delay the first sign of load.

use std::sync::Arc;

use tokio::sync::Notify;

/// Wakes an engine's scraper early: its KV events say it is working, so its metrics are
/// about to change.
#[derive(Clone, Default)]
pub struct Activity(Arc<std::sync::RwLock<std::collections::HashMap<String, Arc<Notify>>>>);

impl Activity {
    /// The engine at `address` did something (cheap when its scraper is already fast).
    pub fn wake(&self, address: &str) {
        if let Some(n) = self.0.read().unwrap_or_else(|p| p.into_inner()).get(address) {
            n.notify_one();
        }
    }

    pub(crate) fn register(&self, address: &str) -> Arc<Notify> {
        let n = Arc::new(Notify::new());
        self.0.write().unwrap_or_else(|p| p.into_inner()).insert(address.to_owned(), n.clone());
        n
    }

    pub(crate) fn forget(&self, address: &str) {
        self.0.write().unwrap_or_else(|p| p.into_inner()).remove(address);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_kv_event_wakes_only_its_engines_scraper() {
        let a = Activity::default();
        let (x, y) = (a.register("10.0.0.1:8000"), a.register("10.0.0.2:8000"));
        a.wake("10.0.0.1:8000");
        a.wake("10.0.0.9:8000");
        tokio::time::timeout(Duration::from_millis(100), x.notified()).await.expect("woken");
        assert!(tokio::time::timeout(Duration::from_millis(20), y.notified()).await.is_err());
        a.forget("10.0.0.1:8000");
        a.wake("10.0.0.1:8000");
        assert!(tokio::time::timeout(Duration::from_millis(20), x.notified()).await.is_err(), "forgotten");
    }
}
