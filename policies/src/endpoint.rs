//! The pool state a snapshot carries: endpoints, their role, readiness and engine metrics.

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
    pub index: crate::preselect::IndexCell,
}

impl PoolState {
    /// The pre-selection lookups for these endpoints.
    pub fn index(&self) -> &crate::preselect::PoolIndex {
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

    /// The position of the endpoint at `address`: a lookup on pools large enough to have
    /// been indexed, a scan on small ones.
    pub fn position(&self, address: &str) -> Option<usize> {
        if self.endpoints.len() > 128 {
            self.index().position(&self.endpoints, address)
        } else {
            self.endpoints.iter().position(|e| e.address == address)
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
