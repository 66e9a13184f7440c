//! Scheduler configuration: plain data with documented defaults. The filter reads it from its
//! plugin configuration (JSON); the host and simulator build it in code.

use serde::{Deserialize, Serialize};

pub use crate::filters::prefix_affinity::AffinityGate;
pub use crate::filters::saturation::SaturationConfig;

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
    /// Maximum number of (block, endpoint-set) entries the approximate index holds (64 bytes
    /// each with their eviction clocks, allocated once). 50,000 blocks of 64 tokens is about 1.3 times the KV capacity of
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
    /// The share of an engine's KV cache the approximate index counts on: a block routed to an
    /// engine is taken as evicted once the engine has written `cache_share` × its cache's
    /// tokens after the block's last use ([`crate::index::KvClock`]). Below 1 for the
    /// generated tokens the clock does not count and the blocks running requests pin. 0, or an
    /// engine without prefix-cache counters or cache geometry: blocks are never taken as
    /// evicted (llm-d's approximate mode).
    pub cache_share: f64,
    /// llm-d's `prefix-cache-affinity-filter`: where some candidates hold at least
    /// `affinity_threshold` of the prompt, the primary is chosen among them alone (load
    /// scorers still order them), instead of letting load scores outvote the cache. Moving a
    /// warm request off its cache costs a full prefill there. The other candidates stay as
    /// fallbacks. See [`AffinityGate`] for when load breaks it.
    pub affinity_filter: AffinityGate,
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
            cache_share: 0.9,
            affinity_filter: AffinityGate::default(),
        }
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
    /// Bytes of tokenized prompt prefixes each worker keeps, so that a conversation's next
    /// turn tokenizes only what it added (`policies::token_prefix`); 0 keeps none.
    pub prefix_store_bytes: usize,
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
            prefix_store_bytes: 16 << 20,
        }
    }
}

/// The full scheduler configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// The scheduling profiles and their plugins ([`crate::profiles`]).
    pub profiles: crate::profiles::ProfilesConfig,
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
    /// Large pools: score a shortlist (the candidates holding the request's prefix, session or
    /// adapter, and the least loaded) instead of every candidate (crate::preselect).
    pub preselect: crate::preselect::PreselectConfig,
    /// Sheddable requests (negative flow-control priority) go to the endpoints serving no
    /// interactive traffic ([`crate::spare`]).
    pub spare: crate::spare::SpareConfig,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            profiles: crate::profiles::ProfilesConfig::default(),
            prefix: PrefixConfig::default(),
            saturation: SaturationConfig::default(),
            precise: PreciseConfig::default(),
            max_endpoints: 3,
            max_body_bytes: 4 * 1024 * 1024,
            pd: crate::pd::PdConfig::default(),
            host_stale_ms: 3_000,
            preselect: crate::preselect::PreselectConfig::default(),
            spare: crate::spare::SpareConfig::default(),
        }
    }
}
