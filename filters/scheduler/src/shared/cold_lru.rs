//! The no-hit LRU (policies `no-hit-lru-scorer`) in shared data, key `attache.prefix.no_hit_lru`
//! (encoded by `LastCold::encode`): every worker of one Envoy spreads cold prefixes over one
//! table. Without it, each worker would send its first new prefixes to the same never-used
//! endpoints, and a pool of eight would serve eight hot prompts on four.
//!
//! Each tick, a worker replays the cold decisions it made since its last share on the shared
//! table and writes it back (compare-and-swap; a lost race replays them again next tick), or,
//! with nothing of its own, adopts the table when another worker changed it.

use attache_policies::scorers::no_hit_lru::LastCold;

use crate::hostcalls as host;

/// Shared-data key of the table.
pub const KEY: &str = "attache.prefix.no_hit_lru";

/// A worker's side of the shared table: the version it last saw.
#[derive(Debug, Default)]
pub struct SharedColdLru {
    cas: Option<u32>,
}

/// What one share did, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Shared {
    /// The shared table did not decode and was replaced.
    pub corrupt: bool,
    /// A write lost a race (its records wait for the next tick).
    pub lost_race: bool,
}

impl SharedColdLru {
    /// Share `lru` with the other workers: one host call when neither side changed.
    pub fn share(&mut self, lru: &mut LastCold) -> Shared {
        let (bytes, cas) = host::shared_data_cas(KEY);
        if cas == self.cas && !lru.has_unshared() {
            return Shared::default();
        }
        let share = lru.share(bytes.as_deref());
        let mut out = Shared { corrupt: share.corrupt, lost_race: false };
        match share.write {
            None => self.cas = cas,
            Some(table) if host::set_shared_data_cas(KEY, &table, cas) => {
                lru.shared();
                self.cas = host::shared_data_cas(KEY).1;
            }
            Some(_) => {
                self.cas = None;
                out.lost_race = true;
            }
        }
        out
    }
}
