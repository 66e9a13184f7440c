//! The pool state a snapshot carries: endpoints, their role, readiness and engine metrics.

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

/// An endpoint's role in a disaggregated pool (`llm-d.ai/role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Serves whole requests (prefill and decode). Unlabelled pods are `Both`.
    #[default]
    Both,
    Prefill,
    Decode,
}

impl Role {
    /// Parse a `llm-d.ai/role` label value. Unknown values are treated as `Both`.
    pub fn from_label(v: &str) -> Self {
        match v {
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            _ => Role::Both,
        }
    }
}

/// Engine metrics scraped by the host.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct EndpointMetrics {
    /// `vllm:num_requests_waiting` / `sglang:num_queue_reqs`.
    pub waiting: f64,
    /// `vllm:num_requests_running` / `sglang:num_running_reqs`.
    pub running: f64,
    /// `vllm:kv_cache_usage_perc` / `sglang:token_usage`, 0..1.
    pub kv_usage: f64,
    /// Age of the last successful scrape when the snapshot was built, in ms.
    pub age_ms: u64,
    /// Recent mean time to first token, ms (0 = unknown).
    #[serde(default)]
    pub ttft_ms: f64,
    /// The engine's prefill rate learned by the host, uncached prompt tokens per second of
    /// prefill (0 = unknown: the affinity gate's configured rate stands in).
    #[serde(default)]
    pub prefill_tokens_per_s: f64,
}

/// One model-server endpoint.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Endpoint {
    /// The host's stable id for this endpoint (the precise index refers to it).
    pub id: u32,
    /// `ip:port`, exactly as it goes into `x-gateway-destination-endpoint`.
    pub address: String,
    /// Served model names (base model and loaded adapters).
    pub models: Vec<String>,
    pub role: Role,
    /// Pod readiness / health as discovery reports it.
    pub ready: bool,
    /// `None` when the engine has never been scraped successfully.
    pub metrics: Option<EndpointMetrics>,
    /// Tokens per KV block (from `vllm:cache_config_info`), 0 if unknown.
    pub block_size: u32,
    /// KV blocks the engine's cache holds (`num_gpu_blocks` of `vllm:cache_config_info`), 0 if
    /// unknown.
    #[serde(default)]
    pub kv_blocks: u64,
    /// Tokens the engine has written into its KV cache so far: prompt tokens its prefix cache
    /// did not hold (`vllm:prefix_cache_queries_total` − `vllm:prefix_cache_hits_total`). The
    /// approximate index's eviction clock ([`crate::index::KvClock`]); `None` when the engine
    /// reports no prefix-cache counters.
    #[serde(default)]
    pub kv_written: Option<u64>,
    /// Prompt tokens the engine found in its prefix cache so far
    /// (`vllm:prefix_cache_hits_total`): with `kv_written`, what the expected hit is
    /// calibrated against ([`crate::calibration`]). `None` when it reports none.
    #[serde(default)]
    pub kv_hits: Option<u64>,
    /// Pod labels, sorted by key (for scorers, e.g. `attache.io/accelerator`).
    #[serde(default)]
    pub labels: Vec<(String, String)>,
    /// LoRA adapters (`vllm:lora_requests_info`), when the engine serves them.
    #[serde(default)]
    pub lora: Option<LoraState>,
}

/// An engine's LoRA adapters, from the newest `vllm:lora_requests_info` series.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LoraState {
    /// Adapters loaded and running requests.
    pub running: Vec<String>,
    /// Adapters that requests wait for.
    pub waiting: Vec<String>,
    /// Adapter slots (`--max-loras`).
    pub max_lora: u32,
}

impl Endpoint {
    /// A ready endpoint serving `model` for whole requests, with fresh, idle metrics (for
    /// tests and the cost examples).
    pub fn idle(address: String, model: &str) -> Self {
        Self {
            address,
            models: vec![model.to_owned()],
            role: Role::Both,
            ready: true,
            metrics: Some(EndpointMetrics::default()),
            ..Default::default()
        }
    }

    pub fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| m == model)
    }

    /// The base model: the first of `models`; the others are LoRA adapters.
    pub fn base_model(&self) -> Option<&str> {
        self.models.first().map(String::as_str)
    }

    /// The engine's KV cache as the approximate index models it: its write clock, and a block
    /// survives `share` of the cache's tokens of writes. `None` without both the clock and the
    /// cache geometry, or with `share` 0.
    pub fn kv_clock(&self, share: f64) -> Option<crate::index::KvClock> {
        let tokens = self.kv_blocks.saturating_mul(u64::from(self.block_size));
        let holds = (tokens as f64 * share) as u64;
        (holds > 0).then_some(crate::index::KvClock { written: self.kv_written?, holds })
    }

    /// Metrics if they are fresh enough to act on: younger than `stale_ms` (so 0 means none is).
    pub fn fresh_metrics(&self, stale_ms: u64) -> Option<&EndpointMetrics> {
        self.metrics.as_ref().filter(|m| m.age_ms < stale_ms)
    }
}

/// The pool as of one snapshot version.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PoolState {
    pub version: u64,
    pub endpoints: Vec<Endpoint>,
    /// The host's saturation detector ([`crate::flow::pool_saturation`]); >= 1.0 is saturated.
    #[serde(default)]
    pub saturation: Option<f64>,
    /// InferenceObjective name → priority, as the host pushed it.
    #[serde(default)]
    pub objectives: std::collections::BTreeMap<String, i32>,
    /// Saturation one more dispatched request adds ([`crate::flow::dispatch_cost`]).
    #[serde(default)]
    pub dispatch_cost: f64,
    /// When the engine metrics behind `saturation` were scraped, ms since the epoch.
    #[serde(default)]
    pub observed_ms: u64,
    /// Lookups for pre-selection on large pools, built on first use ([`crate::preselect`]).
    #[serde(skip)]
    pub index: IndexCell,
}

impl PoolState {
    /// The pre-selection lookups for these endpoints.
    pub fn index(&self) -> &PoolIndex {
        self.index.get_or_build(&self.endpoints)
    }

    /// Forget the lookups after editing `endpoints` in place.
    pub fn reindex(&mut self) {
        self.index = Default::default();
    }

    /// Bring the lookups up to date after the endpoints at `positions` changed in place (same
    /// addresses and ids): O(pool) moves of small integers, no rebuild. Lookups not built yet
    /// stay unbuilt.
    pub fn index_updated(&mut self, positions: &[usize]) {
        if let Some(ix) = self.index.get_mut() {
            ix.update(&self.endpoints, positions);
        }
    }

    /// Whether lookups go through the [`PoolIndex`] rather than a scan.
    fn indexed(&self) -> bool {
        self.endpoints.len() > INDEXED_ABOVE
    }

    /// The position of the endpoint at `address`: a lookup on pools large enough to have
    /// been indexed, a scan on small ones.
    pub fn position(&self, address: &str) -> Option<usize> {
        if self.indexed() {
            self.index().position(&self.endpoints, address)
        } else {
            self.endpoints.iter().position(|e| e.address == address)
        }
    }

    /// The endpoint at `address` (a lookup on large pools, a scan on small ones).
    pub fn by_address(&self, address: &str) -> Option<&Endpoint> {
        self.position(address).and_then(|p| self.endpoints.get(p))
    }

    /// The endpoint at `address`'s KV cache as the approximate index models it
    /// ([`Endpoint::kv_clock`]).
    pub fn kv_clock(&self, address: &str, share: f64) -> Option<crate::index::KvClock> {
        self.by_address(address).and_then(|e| e.kv_clock(share))
    }

    /// The endpoint whose host id is `id` (a lookup on large pools, a scan on small ones).
    pub fn by_id(&self, id: u32) -> Option<&Endpoint> {
        if self.indexed() {
            self.index().by_id.get(&id).and_then(|&p| self.endpoints.get(p as usize))
        } else {
            self.endpoints.iter().find(|e| e.id == id)
        }
    }

    /// The distinct known KV block sizes of the endpoints, ascending (most pools have one).
    pub fn block_sizes(&self) -> Vec<u32> {
        if self.indexed() {
            self.index().block_sizes.clone()
        } else {
            block_sizes(&self.endpoints)
        }
    }

    /// Whether any endpoint is ready to serve.
    pub fn has_ready(&self) -> bool {
        self.endpoints.iter().any(|e| e.ready)
    }
}

impl PoolState {
    /// Whether any endpoint serves `model`.
    pub fn knows_model(&self, model: &str) -> bool {
        self.endpoints.iter().any(|e| e.serves(model))
    }
}

// Pre-selection lookups (`crate::preselect`): built once per pool, kept current by deltas.

/// Pools larger than this are looked up through their [`PoolIndex`]; smaller ones are scanned.
pub const INDEXED_ABOVE: usize = 128;

/// The distinct known (non-zero) block sizes of `endpoints`, ascending.
fn block_sizes(endpoints: &[Endpoint]) -> Vec<u32> {
    let mut sizes: Vec<u32> = Vec::with_capacity(2);
    for e in endpoints.iter().filter(|e| e.block_size > 0) {
        if let Err(at) = sizes.binary_search(&e.block_size) {
            sizes.insert(at, e.block_size);
        }
    }
    sizes
}

/// FNV-1a of an address: a fixed hash (hashbrown's default is seeded per instance).
fn fixed_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Per-pool lookups for the shortlist, built once per pool version.
#[derive(Debug, Default)]
pub struct PoolIndex {
    /// Hash of the address -> positions (more than one only on a hash collision).
    pub(crate) by_address: HashMap<u64, Vec<u32>>,
    pub(crate) by_id: HashMap<u32, u32>,
    /// Per model: the ready endpoints serving it, least reported load first, each with its
    /// load: the shortlist reads the head of the list and a sample of it and nothing else.
    pub(crate) by_load: HashMap<String, Vec<Ranked>>,
    /// Per adapter: the endpoints with it loaded (running or waiting).
    pub(crate) lora: HashMap<String, Vec<u32>>,
    /// The endpoints of the prefill role, in pool order (most pools have none).
    pub(crate) prefill: Vec<u32>,
    /// The distinct known KV block sizes, ascending (precise scoring keys a prompt per size).
    pub(crate) block_sizes: Vec<u32>,
    /// Each endpoint's reported load by position ([`reported`]), as the lists hold it: where
    /// [`PoolIndex::update`] finds a changed endpoint's entry.
    pub(crate) load: Vec<f64>,
}

/// An endpoint in a model's load order: its reported load and its position. Ordered by load,
/// then position.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ranked {
    pub load: f64,
    pub position: u32,
}

impl Ranked {
    fn order(&self, other: &Ranked) -> std::cmp::Ordering {
        self.load.total_cmp(&other.load).then(self.position.cmp(&other.position))
    }
}

/// A snapshot's reported load: waiting + running (unknown counts as idle).
pub(crate) fn reported(e: &Endpoint) -> f64 {
    e.metrics.as_ref().map_or(0.0, |m| m.waiting + m.running)
}

impl PoolIndex {
    pub fn build(endpoints: &[Endpoint]) -> Self {
        let mut ix = PoolIndex::default();
        for (i, e) in endpoints.iter().enumerate() {
            let Ok(p) = u32::try_from(i) else { break };
            ix.by_address.entry(fixed_hash(&e.address)).or_default().push(p);
            ix.by_id.insert(e.id, p);
            if e.ready {
                for m in &e.models {
                    ix.by_load.entry(m.clone()).or_default().push(Ranked { load: reported(e), position: p });
                }
            }
            if let Some(l) = &e.lora {
                for a in l.running.iter().chain(&l.waiting) {
                    ix.lora.entry(a.clone()).or_default().push(p);
                }
            }
            if e.role == Role::Prefill {
                ix.prefill.push(p);
            }
        }
        for list in ix.by_load.values_mut() {
            list.sort_by(Ranked::order);
        }
        ix.block_sizes = block_sizes(endpoints);
        ix.load = endpoints.iter().map(reported).collect();
        ix
    }

    /// Follow in-place changes to the endpoints at `changed` (their addresses and ids stay):
    /// re-place them in each model's load order and in the adapters' holders.
    pub fn update(&mut self, endpoints: &[Endpoint], changed: &[usize]) {
        if changed.is_empty() {
            return;
        }
        // A block size appears or goes only when an engine restarts with another: rare, and
        // a scan of the pool is cheap next to the other lists' moves.
        if changed.iter().any(|&p| {
            endpoints.get(p).is_some_and(|e| e.block_size > 0 && self.block_sizes.binary_search(&e.block_size).is_err())
        }) || self.block_sizes.len() > 1
        {
            self.block_sizes = block_sizes(endpoints);
        }
        let mut changed: Vec<u32> = changed.iter().filter_map(|&p| u32::try_from(p).ok()).collect();
        changed.sort_unstable();
        changed.dedup();
        // Each list stays sorted by (load, position): a changed endpoint is found by its old
        // load and put back by its new one, O(log n) searches and one move each, not a pass
        // over every list per delta.
        let PoolIndex { by_load, load, .. } = self;
        for &p in &changed {
            let (Some(e), Some(&old)) = (endpoints.get(p as usize), load.get(p as usize)) else { continue };
            let (old, new) = (Ranked { load: old, position: p }, Ranked { load: reported(e), position: p });
            for (model, list) in by_load.iter_mut() {
                if let Ok(i) = list.binary_search_by(|q| q.order(&old)) {
                    list.remove(i);
                }
                if e.ready && e.serves(model) {
                    let i = list.partition_point(|q| q.order(&new).is_lt());
                    list.insert(i, new);
                }
            }
            let new = new.load;
            if let Some(l) = load.get_mut(p as usize) {
                *l = new;
            }
        }
        let changed_at = |p: &u32| changed.binary_search(p).is_ok();
        // A model no list had yet (an endpoint started serving it).
        for &p in &changed {
            let Some(e) = endpoints.get(p as usize).filter(|e| e.ready) else { continue };
            for m in &e.models {
                if !self.by_load.contains_key(m) {
                    self.by_load.insert(m.clone(), vec![Ranked { load: reported(e), position: p }]);
                }
            }
        }
        for holders in self.lora.values_mut() {
            holders.retain(|p| !changed_at(p));
        }
        // A role can change in place (a relabelled pod): re-place the changed ones.
        self.prefill.retain(|p| !changed_at(p));
        for &p in &changed {
            if endpoints.get(p as usize).is_some_and(|e| e.role == Role::Prefill) {
                let at = self.prefill.partition_point(|&q| q < p);
                self.prefill.insert(at, p);
            }
        }
        for &p in &changed {
            let Some(l) = endpoints.get(p as usize).and_then(|e| e.lora.as_ref()) else { continue };
            for a in l.running.iter().chain(&l.waiting) {
                let holders = self.lora.entry(a.clone()).or_default();
                if !holders.contains(&p) {
                    holders.push(p);
                }
            }
        }
    }

    /// The `k` ready endpoints serving `model` with the least reported load, least first.
    pub fn least_loaded(&self, model: &str, k: usize) -> Vec<usize> {
        self.by_load.get(model).map(|l| l.iter().take(k).map(|r| r.position as usize).collect()).unwrap_or_default()
    }

    /// The position of the endpoint at `address`.
    pub fn position(&self, endpoints: &[Endpoint], address: &str) -> Option<usize> {
        self.by_address
            .get(&fixed_hash(address))?
            .iter()
            .map(|&p| p as usize)
            .find(|&p| endpoints.get(p).is_some_and(|e| e.address == address))
    }
}

/// The per-pool index, built on first use after the pool changes. Cloning or comparing pools
/// ignores it (it is derived from the endpoints); whoever edits `endpoints` in place resets it.
#[derive(Default)]
pub struct IndexCell(std::sync::OnceLock<PoolIndex>);

impl IndexCell {
    pub fn get_mut(&mut self) -> Option<&mut PoolIndex> {
        self.0.get_mut()
    }

    pub fn get_or_build(&self, endpoints: &[Endpoint]) -> &PoolIndex {
        self.0.get_or_init(|| PoolIndex::build(endpoints))
    }
}

impl Clone for IndexCell {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl PartialEq for IndexCell {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for IndexCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() { "IndexCell(built)" } else { "IndexCell(empty)" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random sequence for the test's changes.
    fn next(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    #[test]
    fn an_updated_index_equals_one_built_afresh() {
        let mut endpoints: Vec<Endpoint> = (0..300)
            .map(|i| Endpoint {
                id: 1000 + i as u32,
                block_size: 16,
                metrics: Some(EndpointMetrics {
                    waiting: (i % 4) as f64,
                    running: (i % 9) as f64,
                    ..Default::default()
                }),
                ..Endpoint::idle(format!("10.0.{}.{}:8000", i / 256, i % 256), if i % 3 == 0 { "a" } else { "b" })
            })
            .collect();
        let mut ix = PoolIndex::build(&endpoints);
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for round in 0..200 {
            let changed: Vec<usize> = (0..1 + next(&mut x) % 6).map(|_| (next(&mut x) % 300) as usize).collect();
            for &p in &changed {
                let e = &mut endpoints[p];
                match next(&mut x) % 6 {
                    0 => e.ready = !e.ready,
                    1 => e.models = vec![["a", "b", "c"][(next(&mut x) % 3) as usize].to_owned()],
                    2 => e.block_size = [16, 32][(next(&mut x) % 2) as usize],
                    3 => e.role = if e.role == Role::Prefill { Role::Both } else { Role::Prefill },
                    _ => {
                        // Ties are common: loads from a few small integers.
                        e.metrics = Some(EndpointMetrics { running: (next(&mut x) % 5) as f64, ..Default::default() })
                    }
                }
            }
            ix.update(&endpoints, &changed);
            let fresh = PoolIndex::build(&endpoints);
            let lists = |ix: &PoolIndex| {
                let mut v: Vec<(String, Vec<(u32, u64)>)> = ix
                    .by_load
                    .iter()
                    .filter(|(_, l)| !l.is_empty())
                    .map(|(m, l)| (m.clone(), l.iter().map(|r| (r.position, r.load.to_bits())).collect()))
                    .collect();
                v.sort();
                v
            };
            assert_eq!(lists(&ix), lists(&fresh), "round {round}: by load");
            assert_eq!(ix.load, fresh.load, "round {round}");
            assert_eq!(ix.prefill, fresh.prefill, "round {round}");
            assert_eq!(ix.block_sizes, fresh.block_sizes, "round {round}");
        }
    }
}
