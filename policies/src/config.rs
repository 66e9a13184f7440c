//! Scheduler configuration: plain data with documented defaults. The filter reads it from its
//! plugin configuration (JSON); the host and simulator build it in code.

use serde::{Deserialize, Serialize};

/// Weights of the built-in scorers. Defaults follow llm-d's default profile
/// (`reference/llmd.md` §1.2): prefix 3, queue 2, kv-cache 2; plus `no-hit-lru` 1.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ScorerWeights {
    pub prefix: f64,
    pub queue: f64,
    pub kv_cache: f64,
    /// `no-hit-lru`: spreads cold prefixes over the pool (weight 1, llm-d's default weight).
    pub no_hit_lru: f64,
    /// Precise prefix affinity, from the engines' KV events (used when `precise.enabled`).
    pub precise_prefix: f64,
    /// `lora-affinity`: for a request naming a LoRA adapter, endpoints with it loaded, then
    /// with a free adapter slot, then with it waiting (`vllm:lora_requests_info`).
    pub lora: f64,
}

impl Default for ScorerWeights {
    fn default() -> Self {
        Self { prefix: 3.0, queue: 2.0, kv_cache: 2.0, no_hit_lru: 1.0, precise_prefix: 3.0, lora: 5.0 }
    }
}

/// Approximate prefix hashing (llm-d "estimate" mode).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixConfig {
    /// Tokens per block. llm-d floors this at 64 to bound its index; so do we by default.
    pub block_size_tokens: usize,
    /// Matching stops after this many (pseudo-)tokens. 0 means unlimited.
    pub max_prefix_tokens: usize,
    /// Bytes per pseudo-token when the prompt is text (llm-d packs 4 bytes per uint32).
    pub bytes_per_token: usize,
    /// Maximum number of (block, endpoint-set) entries the approximate index holds (32 bytes
    /// each, allocated once). 50,000 blocks of 64 tokens is about 1.3 times the KV capacity of
    /// the peer benchmarks' pool (8 engines of 19,212 16-token blocks); a pool with more cache
    /// needs more. A larger table costs
    /// request time in Envoy: each decision touches a dozen random pages of it, and at 200,000
    /// (6.4 MB) a 4 KB request took 14 µs more Envoy CPU (docs/benchmarks.md).
    pub index_capacity: usize,
    /// Entries of each worker's cross-worker affinity table (block hash → endpoint, 16 bytes
    /// each); 0 disables sharing decisions between Envoy workers.
    pub shared_slots: u64,
    /// From its tick, at this period (ms), a worker appends its decisions to its affinity log
    /// in shared data and reads the other workers' logs: they learn a decision within two.
    pub shared_flush_ms: u64,
    /// Prefix affinity counts only where an endpoint holds at least this share of the prompt
    /// (approximate or precise match, 0..1); below it the endpoint scores 0 for prefix, and a
    /// request that reaches it nowhere is spread like a cold one. llm-d's optimized baseline
    /// gates affinity the same way (`prefix-cache-affinity-filter`, `affinityThreshold` 0.8):
    /// a short match, such as a tool preamble every agent session shares, would otherwise pull
    /// every new session onto the few engines that hold it. 0 scores every match.
    pub affinity_threshold: f64,
    /// llm-d's `prefix-cache-affinity-filter`: where some candidates hold at least
    /// `affinity_threshold` of the prompt, the primary is chosen among them alone (load
    /// scorers still order them), instead of letting load scores outvote the cache. Moving a
    /// warm request off its cache costs a full prefill there. The other candidates stay as
    /// fallbacks. See [`AffinityGate`] for when load breaks it.
    pub affinity_filter: AffinityGate,
}

/// When the affinity filter yields to load (llm-d's TTFT load gate): each endpoint's
/// time to first token is estimated as (its in-flight uncached prompt tokens + this request's
/// uncached tokens there) / `peak_prefill_tokens_per_s`; if the best affine endpoint's estimate
/// is more than `max_ttft_penalty_ms` worse than the best other's, the filter is skipped for
/// this request. Saturated endpoints are filtered out before this, whatever their cache.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AffinityGate {
    pub enabled: bool,
    /// llm-d's default, calibrated for Qwen3-32B on 2×H100: 15,928 tokens/s.
    pub peak_prefill_tokens_per_s: f64,
    /// llm-d's default: 18,000 ms.
    pub max_ttft_penalty_ms: f64,
}

impl Default for AffinityGate {
    fn default() -> Self {
        Self { enabled: true, peak_prefill_tokens_per_s: 15_928.0, max_ttft_penalty_ms: 18_000.0 }
    }
}

impl AffinityGate {
    /// Estimated time to first token (ms) behind `tokens` uncached prompt tokens.
    pub fn ttft_ms(&self, tokens: u64) -> f64 {
        if self.peak_prefill_tokens_per_s <= 0.0 {
            return 0.0;
        }
        tokens as f64 * 1000.0 / self.peak_prefill_tokens_per_s
    }
}

impl Default for PrefixConfig {
    fn default() -> Self {
        Self {
            block_size_tokens: 64,
            max_prefix_tokens: 131_072,
            bytes_per_token: 4,
            index_capacity: 50_000,
            shared_slots: 65_536,
            shared_flush_ms: 20,
            affinity_threshold: 0.8,
            affinity_filter: AffinityGate::default(),
        }
    }
}

/// When an endpoint counts as saturated and is filtered out (unless every endpoint is).
/// The queue default follows llm-d's utilization detector (5 waiting requests;
/// `reference/llmd.md` §2). The KV default is higher than the detector's 0.8: running requests
/// that share a cached prefix all reference its blocks, so an endpoint that holds hot prefixes
/// sits near 0.8 by design, and filtering it there would defeat prefix affinity.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SaturationConfig {
    pub queue_threshold: f64,
    pub kv_threshold: f64,
    /// Metrics older than this are stale: the endpoint is scored as unknown load.
    pub metrics_stale_ms: u64,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        Self { queue_threshold: 5.0, kv_threshold: 0.95, metrics_stale_ms: 1_000 }
    }
}

/// Precise prefix routing from the engines' KV events.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PreciseConfig {
    pub enabled: bool,
    /// Block weights by tier.
    pub tier_weights: crate::precise::TierWeights,
    /// Hashing stops after this many prompt tokens.
    pub max_tokens: usize,
    /// Slots of the index table in shared data (the filter's copy of the host's index).
    pub slots: u64,
    /// The served model's `tokenizer.json`, as text, to tokenize text prompts exactly as the
    /// engine does. Without it, only token-id prompts are routed precisely.
    pub tokenizer_json: Option<String>,
    /// Texts with the ids the engine gives them (e.g. from its `/tokenize`), checked when the
    /// filter starts; on a mismatch the tokenizer is not used, and a metric says so.
    pub tokenizer_check: Vec<TokenizerCheck>,
    /// The served model's chat template (Jinja, as in `tokenizer_config.json`), to render chat
    /// and Responses prompts exactly as the engine does before tokenizing them. Without it,
    /// those requests are routed by the approximate scorer only.
    pub chat_template: Option<String>,
    /// `bos_token` / `eos_token` as the template sees them (from `tokenizer_config.json`).
    pub bos_token: String,
    pub eos_token: String,
}

/// One expected tokenization.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TokenizerCheck {
    /// A text prompt (completions), or
    #[serde(default)]
    pub text: String,
    /// a chat conversation, rendered with `chat_template` and tokenized without added special
    /// tokens, as vLLM does for chat requests.
    #[serde(default)]
    pub messages: Option<Vec<crate::chat_template::ChatMessage>>,
    #[serde(default = "default_true")]
    pub add_special_tokens: bool,
    pub ids: Vec<u32>,
}

fn default_true() -> bool {
    true
}

impl Default for PreciseConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            tier_weights: crate::precise::TierWeights::default(),
            max_tokens: 8192,
            slots: 262_144,
            tokenizer_json: None,
            tokenizer_check: Vec::new(),
            chat_template: None,
            bos_token: String::new(),
            eos_token: String::new(),
        }
    }
}

/// The full scheduler configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    pub weights: ScorerWeights,
    pub prefix: PrefixConfig,
    pub saturation: SaturationConfig,
    pub precise: PreciseConfig,
    /// How many endpoints the picker returns: the primary plus fallbacks for
    /// `x-gateway-destination-endpoint`.
    pub max_endpoints: usize,
    /// Request bodies larger than this get 413.
    pub max_body_bytes: usize,
    /// Prefill/decode disaggregation.
    pub pd: crate::pd::PdConfig,
    /// When nothing (snapshot, index delta or heartbeat) has come from the host for this long,
    /// its metrics and KV index are not trusted: scoring uses the filter's own in-flight load
    /// alone until the host is heard again. Three missed heartbeats by default; 0 disables.
    pub host_stale_ms: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            weights: ScorerWeights::default(),
            prefix: PrefixConfig::default(),
            saturation: SaturationConfig::default(),
            precise: PreciseConfig::default(),
            max_endpoints: 3,
            max_body_bytes: 4 * 1024 * 1024,
            pd: crate::pd::PdConfig::default(),
            host_stale_ms: 3_000,
        }
    }
}
