//! A worker's flow-control state: its queue (policies::flow), its saturation gate, and its
//! side of the fairness board every worker of the Envoy shares (in shared data).

use std::collections::BTreeMap;

use attache_policies::flow::{Board, FlowConfig, FlowQueue, Gate};
use attache_policies::PoolState;

use crate::hostcalls as host;
use crate::request::SharedRequest;
use crate::shared::fleet;

/// Shared-data key of the per-Envoy fairness board.
pub const BOARD_KEY: &str = "attache.flow.board";
/// Shared-data key of the counter that names workers on the board.
const WORKER_SEQ_KEY: &str = "attache.flow.workers";
/// A worker re-posts unchanged demand this often, so it does not look silent.
const REPOST_MS: u64 = 100;

/// This worker's flow-control state.
pub struct FlowState {
    pub queue: FlowQueue<SharedRequest>,
    pub gate: Gate,
    /// Estimated tokens dispatched per tenant since the last board merge.
    pub pending: BTreeMap<String, f64>,
    /// The board as last read.
    pub board: Board,
    board_cas: Option<u32>,
    pub worker_id: String,
    last_post_ms: u64,
    last_posted: Vec<(i32, String, u32)>,
}

/// A name for this worker on the board, unique within the Envoy (a shared counter).
fn next_worker_id() -> String {
    for _ in 0..16 {
        let (v, cas) = host::shared_data_cas(WORKER_SEQ_KEY);
        let n = v.and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok()).map(u64::from_be_bytes).unwrap_or(0) + 1;
        if host::set_shared_data_cas(WORKER_SEQ_KEY, &n.to_be_bytes(), cas) {
            return format!("w{n}");
        }
    }
    format!("w{}", host::now_us())
}

impl FlowState {
    pub fn new(enabled: bool) -> Self {
        Self {
            queue: FlowQueue::default(),
            gate: Gate::default(),
            pending: BTreeMap::new(),
            board: Board::default(),
            board_cas: None,
            worker_id: if enabled { next_worker_id() } else { String::new() },
            last_post_ms: 0,
            last_posted: Vec::new(),
        }
    }

    /// Estimated pool saturation now: the host's figure plus this worker's dispatches it has
    /// not seen yet. `None` when the pool has no endpoints.
    pub fn estimate(&mut self, pool: &PoolState) -> Option<f64> {
        self.gate.estimate_pool(pool)
    }

    pub fn usage(board: &Board, pending: &BTreeMap<String, f64>, tenant: &str) -> f64 {
        board.usage(tenant) + pending.get(tenant).copied().unwrap_or(0.0)
    }

    /// Fold this worker's dispatched tokens and waiting requests into the board (CAS; on a
    /// lost race, the next tick retries with the newer board).
    pub fn sync_board(&mut self, cfg: &FlowConfig, now_ms: u64) {
        let (bytes, cas) = host::shared_data_cas(BOARD_KEY);
        if cas != self.board_cas || bytes.is_none() {
            self.board = bytes.as_deref().and_then(Board::decode).unwrap_or_default();
            self.board_cas = cas;
        }
        // The other Envoys' usage, as the host last sent it (fleet state), decayed to now.
        self.board.remote = fleet::remote_usage(now_ms, cfg.usage_half_life_ms);
        let waiting: Vec<(i32, String, u32)> =
            self.queue.depths().into_iter().map(|(p, t, n)| (p, t, n.min(u32::MAX as usize) as u32)).collect();
        let changed = !self.pending.is_empty() || waiting != self.last_posted;
        let due = !waiting.is_empty() && now_ms.saturating_sub(self.last_post_ms) >= REPOST_MS;
        if !changed && !due {
            return;
        }
        let mut next = self.board.clone();
        next.remote.clear();
        next.merge(&self.worker_id, now_ms, &self.pending, waiting.clone(), cfg);
        if host::set_shared_data_cas(BOARD_KEY, &next.encode(), cas) {
            next.remote = std::mem::take(&mut self.board.remote);
            self.board = next;
            // Our write bumped the CAS; read it back next tick only if someone else writes.
            self.board_cas = host::shared_data_cas(BOARD_KEY).1;
            self.pending.clear();
            self.last_posted = waiting;
            self.last_post_ms = now_ms;
        }
    }
}
