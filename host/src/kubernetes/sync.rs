//! Keeping the host in step with what the watchers discovered: each new endpoint list goes to
//! the discovery [`Sink`], each new objective table over the configuration's own into the pool
//! state.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::RwLock;

use super::Discovered;
use crate::discovery::{Sink, StaticEndpoints};
use crate::state::PoolState;

/// Follow `d` until its watchers stop. `static_objectives` is the configuration's table; the
/// cluster's objectives are laid over it.
pub fn spawn(
    mut d: Discovered,
    mut sink: Sink,
    state: Arc<RwLock<PoolState>>,
    static_objectives: BTreeMap<String, i32>,
) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                r = d.endpoints.changed() => {
                    if r.is_err() { break; }
                    let endpoints = d.endpoints.borrow_and_update().clone();
                    sink.apply(StaticEndpoints { endpoints }).await;
                }
                r = d.objectives.changed() => {
                    if r.is_err() { break; }
                    let mut table = static_objectives.clone();
                    table.extend(d.objectives.borrow_and_update().iter().map(|(k, v)| (k.clone(), *v)));
                    let mut st = state.write().await;
                    st.flow.objectives = table;
                    st.generation += 1;
                }
            }
        }
    });
}
