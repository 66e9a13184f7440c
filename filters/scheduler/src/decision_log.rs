//! The picker's side of the decision log: a sampled share of the policy chain's decisions,
//! batched per worker and sent to the host (`SnapshotService/Share`, fire and forget), which
//! keeps them for `attache policy replay` and for admission's samples (policies::replay).
//! A record is the scoring context, tiers and score sheet as the picker read them (filter
//! state: no prompt text) and the primary it routed to.

use std::time::Duration;

use attache_policies::rng::SplitMix64;
use attache_proto::v1;
use prost::Message;
use proxy_wasm::hostcalls;

use crate::hostcalls as host;
use crate::shared::snapshot::VERSION_KEY;

/// Records a worker sends in one call; fewer wait for the picker's tick.
pub const BATCH: usize = 32;
/// Most records waiting; past it new ones are dropped and counted.
pub const PENDING_MAX: usize = 8 * BATCH;
/// How often the picker's tick sends what waits.
pub const FLUSH_MS: u64 = 1_000;

/// One worker's pending records and sampling state.
#[derive(Default)]
pub struct DecisionLog {
    pending: Vec<v1::Decision>,
    rng: Option<SplitMix64>,
    envoy: Option<String>,
}

impl DecisionLog {
    /// Whether to record this decision, at `rate` (0..1).
    pub fn sample(&mut self, rate: f64) -> bool {
        if rate <= 0.0 {
            return false;
        }
        if rate >= 1.0 {
            return true;
        }
        let rng = self.rng.get_or_insert_with(|| SplitMix64::new(host::now_us()));
        (rng.next_u64() % 1_000_000) as f64 / 1_000_000.0 < rate
    }

    /// Keep a record; false if the batch is full (dropped).
    pub fn record(&mut self, context: &[u8], tiers: &[u8], sheet: &[u8], picked: usize) -> bool {
        if self.pending.len() >= PENDING_MAX {
            return false;
        }
        let snapshot_version = host::shared_data(VERSION_KEY)
            .and_then(|k| k.get(8..16).and_then(|b| <[u8; 8]>::try_from(b).ok()))
            .map_or(0, u64::from_be_bytes);
        self.pending.push(v1::Decision {
            at_unix_ms: host::now_ms(),
            snapshot_version,
            context: context.to_vec(),
            tiers: tiers.to_vec(),
            sheet: sheet.to_vec(),
            picked: u32::try_from(picked).unwrap_or(u32::MAX),
        });
        true
    }

    /// Whether a full batch waits.
    pub fn due(&self) -> bool {
        self.pending.len() >= BATCH
    }

    /// Send what waits to the host over `cluster`; the count sent, or the count lost when the
    /// call could not be made.
    pub fn flush(&mut self, cluster: &str) -> Result<usize, usize> {
        if self.pending.is_empty() {
            return Ok(0);
        }
        let envoy = self.envoy.get_or_insert_with(crate::shared::fleet::envoy_id).clone();
        let decisions = std::mem::take(&mut self.pending);
        let n = decisions.len();
        let msg = v1::Report { envoy, decisions, ..Default::default() }.encode_to_vec();
        let timeout = Duration::from_millis(2_000);
        match hostcalls::dispatch_grpc_call(cluster, "attache.v1.SnapshotService", "Share", vec![], Some(&msg), timeout)
        {
            Ok(_) => Ok(n),
            Err(_) => Err(n),
        }
    }
}
