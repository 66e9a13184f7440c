//! Where discovery results go: Envoy's pool (EDS), the per-endpoint metrics series, the
//! scrapers, the pool state and the KV-event subscribers, all kept in step with one list.

use std::sync::Arc;

use attache_kv::engine::Engine;
use tokio::sync::RwLock;

use super::StaticEndpoints;
use crate::eds;
use crate::kv_subscribe::{EngineSource, KvSubscribers};
use crate::scrape::Scrapers;
use crate::state::PoolState;

/// Applies discovery results.
pub struct Sink {
    scrapers: Scrapers,
    kv: KvSubscribers,
    state: Arc<RwLock<PoolState>>,
    /// Engines may connect to the host's KV-event collector, so every endpoint is a source.
    collector: bool,
    members: eds::Members,
}

impl Sink {
    pub fn new(
        scrapers: Scrapers,
        kv: KvSubscribers,
        state: Arc<RwLock<PoolState>>,
        collector: bool,
        members: eds::Members,
    ) -> Self {
        Self { scrapers, kv, state, collector, members }
    }

    /// Make `eps` the pool: Envoy's members, metrics series, scrapers, pool state, and KV-event
    /// subscribers.
    pub async fn apply(&mut self, eps: StaticEndpoints) {
        self.members.set(eps.endpoints.iter().map(|e| e.address.clone()).collect());
        crate::telemetry::metrics().track(eps.endpoints.iter().map(|e| e.address.as_str()));
        self.scrapers.apply(eps.endpoints.clone()).await;
        let mut st = self.state.write().await;
        let sources = eps
            .endpoints
            .iter()
            .filter(|e| e.kv_events.is_some() || self.collector)
            .map(|e| {
                let spec = e.kv_events.clone().unwrap_or_default();
                EngineSource {
                    endpoint_id: st.id_of(&e.address),
                    address: e.address.clone(),
                    model: e.models.first().cloned().unwrap_or_default(),
                    engine: Engine::from_name(&e.engine),
                    publisher: spec.publisher,
                    replay: spec.replay,
                }
            })
            .collect();
        drop(st);
        self.kv.apply(sources);
    }
}
