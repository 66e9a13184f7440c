//! Engine profiles: what each model server (`vllm`, `sglang`) calls the metrics a router reads,
//! and the format its KV events come in (`reference/engines.md` §1, §2, §4, §7).
//!
//! Discovery names an endpoint's engine (`engine:` in the endpoints file, the
//! `llm-d.ai/engine-type` label); the host's scraper and KV-event subscriber ask the profile
//! instead of comparing names.

use crate::events::{self, EventBatch, KvEventError};

/// A model server's profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Engine {
    #[default]
    Vllm,
    Sglang,
}

impl Engine {
    /// The profile discovery names: `sglang`, or vLLM for anything else (vLLM's names are
    /// the ones the inference-extension protocol uses).
    pub fn from_name(name: &str) -> Self {
        if name == "sglang" {
            Engine::Sglang
        } else {
            Engine::Vllm
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        }
    }

    /// The names of the metrics a router reads from this engine's `/metrics`.
    pub fn metrics(self) -> &'static MetricNames {
        match self {
            Engine::Vllm => &VLLM,
            Engine::Sglang => &SGLANG,
        }
    }

    /// How this engine publishes its KV events.
    pub fn event_format(self) -> EventFormat {
        match self {
            Engine::Vllm | Engine::Sglang => EventFormat::VllmMsgpack,
        }
    }
}

/// Which metric names an engine uses. Where a field lists several, the first present is read
/// (fallbacks come second).
#[derive(Debug, PartialEq)]
pub struct MetricNames {
    /// Requests queued (gauge, summed over data-parallel engines).
    pub waiting: &'static [&'static str],
    /// Requests running (gauge, summed); its `model_name` label lists the served models.
    pub running: &'static [&'static str],
    /// KV-cache usage 0..1 (gauge, averaged).
    pub kv_usage: &'static [&'static str],
    /// The info metric whose labels give the cache geometry, and those labels.
    pub cache_info: &'static str,
    pub block_size_label: &'static str,
    pub num_blocks_label: &'static str,
    /// The time-to-first-token histogram (`_sum` and `_count` are read).
    pub ttft: &'static str,
    /// Prefix-cache query and hit counters.
    pub prefix_cache_queries: &'static str,
    pub prefix_cache_hits: &'static str,
    /// The LoRA info metric (`running_lora_adapters`, `waiting_lora_adapters`, `max_lora`).
    pub lora_info: &'static str,
}

const VLLM: MetricNames = MetricNames {
    waiting: &["vllm:num_requests_waiting"],
    running: &["vllm:num_requests_running"],
    kv_usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    cache_info: "vllm:cache_config_info",
    block_size_label: "block_size",
    num_blocks_label: "num_gpu_blocks",
    ttft: "vllm:time_to_first_token_seconds",
    prefix_cache_queries: "vllm:prefix_cache_queries_total",
    prefix_cache_hits: "vllm:prefix_cache_hits_total",
    lora_info: "vllm:lora_requests_info",
};

const SGLANG: MetricNames = MetricNames {
    waiting: &["sglang:num_queue_reqs"],
    running: &["sglang:num_running_reqs"],
    kv_usage: &["sglang:token_usage"],
    cache_info: "sglang:cache_config_info",
    block_size_label: "page_size",
    num_blocks_label: "num_pages",
    ttft: "sglang:time_to_first_token_seconds",
    // SGLang has no prefix-cache counters or LoRA info of its own: the router reads the
    // protocol's (vLLM's) names from it too.
    prefix_cache_queries: VLLM.prefix_cache_queries,
    prefix_cache_hits: VLLM.prefix_cache_hits,
    lora_info: VLLM.lora_info,
};

/// A KV-event wire format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventFormat {
    /// vLLM's: three ZMQ frames (topic, sequence, payload), the payload a msgpack batch
    /// ([`events`]). SGLang's publisher speaks it too.
    VllmMsgpack,
}

impl EventFormat {
    /// Decode one batch payload.
    pub fn decode(self, payload: &[u8]) -> Result<EventBatch, KvEventError> {
        match self {
            EventFormat::VllmMsgpack => events::decode_batch(payload),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_pick_profiles() {
        assert_eq!(Engine::from_name("sglang"), Engine::Sglang);
        for n in ["vllm", "", "other"] {
            assert_eq!(Engine::from_name(n), Engine::Vllm, "{n:?}");
        }
        for e in [Engine::Vllm, Engine::Sglang] {
            assert_eq!(Engine::from_name(e.name()), e);
        }
        assert_eq!(Engine::Sglang.metrics().waiting, ["sglang:num_queue_reqs"]);
        assert_eq!(Engine::Sglang.event_format(), Engine::Vllm.event_format());
    }
}
