//! Engine profiles: what each model server (`vllm`, `sglang`) calls the metrics a router reads,
//! and the format its KV events come in (`reference/engines.md` §1, §2, §4, §7).
//!
//! Discovery names an endpoint's engine (`engine:` in the endpoints file, the
//! `llm-d.ai/engine-type` label); the host's scraper and KV-event subscriber ask the profile
//! instead of comparing names.

use crate::events::{self, BatchInfo, EventBatch, EventRef, KvEventError};

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

    /// The path and query that ask this engine's `/metrics` (at `metrics_path`) for only the
    /// samples a router reads, or None where the engine cannot filter.
    ///
    /// vLLM serves `GET /metrics` through prometheus-fastapi-instrumentator, which ignores the
    /// query, and everything below `/metrics/` through prometheus_client's ASGI app, which
    /// honours `name[]` (exact sample names) from prometheus_client 0.23
    /// (`vllm/entrypoints/serve/instrumentator/metrics.py` @ ef0feb37; `prometheus_client/
    /// exposition.py` `_bake_output`). A page of a few hundred bytes instead of ~26 KB is most
    /// of what following a large pool costs. In multi-process mode (`--api-server-count` > 1,
    /// or data parallel with internal balancing) vLLM's registry names no metrics and the
    /// filtered page is empty; SGLang always runs that way (sglang#35752), so it is not asked.
    /// The scraper falls back to the plain page when the filtered one lacks what it needs.
    ///
    /// Without `geometry`, the cache-geometry info metric (`cache_info`, half of a real vLLM
    /// page's filtered bytes) is left out: it cannot change while the engine process lives.
    pub fn filtered_metrics_path(self, metrics_path: &str, geometry: bool) -> Option<String> {
        match self {
            Engine::Sglang => None,
            Engine::Vllm => {
                let mut url = String::with_capacity(512);
                url.push_str(metrics_path.trim_end_matches('/'));
                url.push_str("/?");
                let names = self.metrics().sample_names().filter(|n| geometry || *n != self.metrics().cache_info);
                for (i, name) in names.enumerate() {
                    if i > 0 {
                        url.push('&');
                    }
                    url.push_str("name%5B%5D=");
                    url.push_str(&name.replace(':', "%3A"));
                }
                Some(url)
            }
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
    /// The time-to-first-token histogram's `_sum` and `_count` samples.
    pub ttft_sum: &'static str,
    pub ttft_count: &'static str,
    /// The queue-time histogram's `_sum`: TTFT minus it is the time spent prefilling.
    pub queue_time_sum: &'static str,
    /// The inter-token latency histogram's `_sum` and `_count` (time per output token), then
    /// a fallback pair (vLLM before 0.11 named it `time_per_output_token_seconds`).
    pub itl_sum: [&'static str; 2],
    pub itl_count: [&'static str; 2],
    /// Prefix-cache query and hit counters.
    pub prefix_cache_queries: &'static str,
    pub prefix_cache_hits: &'static str,
    /// The LoRA info metric (`running_lora_adapters`, `waiting_lora_adapters`, `max_lora`).
    pub lora_info: &'static str,
}

impl MetricNames {
    /// Every sample name a router reads, fallbacks included: what a `name[]` filter asks for.
    pub fn sample_names(&self) -> impl Iterator<Item = &'static str> + '_ {
        let ttft = [self.ttft_sum, self.ttft_count, self.queue_time_sum];
        self.waiting
            .iter()
            .chain(self.running)
            .chain(self.kv_usage)
            .copied()
            .chain([self.cache_info, self.prefix_cache_queries, self.prefix_cache_hits, self.lora_info])
            .chain(ttft)
            .chain(self.itl_sum)
            .chain(self.itl_count)
    }
}

const VLLM: MetricNames = MetricNames {
    waiting: &["vllm:num_requests_waiting"],
    running: &["vllm:num_requests_running"],
    kv_usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    cache_info: "vllm:cache_config_info",
    block_size_label: "block_size",
    num_blocks_label: "num_gpu_blocks",
    ttft_sum: "vllm:time_to_first_token_seconds_sum",
    ttft_count: "vllm:time_to_first_token_seconds_count",
    queue_time_sum: "vllm:request_queue_time_seconds_sum",
    itl_sum: ["vllm:inter_token_latency_seconds_sum", "vllm:time_per_output_token_seconds_sum"],
    itl_count: ["vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"],
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
    ttft_sum: "sglang:time_to_first_token_seconds_sum",
    ttft_count: "sglang:time_to_first_token_seconds_count",
    queue_time_sum: "sglang:queue_time_seconds_sum",
    itl_sum: ["sglang:inter_token_latency_seconds_sum", "sglang:time_per_output_token_seconds_sum"],
    itl_count: ["sglang:inter_token_latency_seconds_count", "sglang:time_per_output_token_seconds_count"],
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
    /// Decode one batch payload into owned events, all or nothing.
    pub fn decode(self, payload: &[u8]) -> Result<EventBatch, KvEventError> {
        match self {
            EventFormat::VllmMsgpack => events::decode_batch(payload),
        }
    }

    /// Read one batch payload in place, handing each complete event to `visit`
    /// ([`events::visit_batch`]).
    pub fn visit<'a>(self, payload: &'a [u8], visit: impl FnMut(EventRef<'a>)) -> Result<BatchInfo, KvEventError> {
        match self {
            EventFormat::VllmMsgpack => events::visit_batch(payload, visit),
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

    #[test]
    fn vllm_is_asked_below_metrics_slash_for_the_samples_it_reads() {
        let p = Engine::Vllm.filtered_metrics_path("/metrics", true).unwrap();
        assert!(p.starts_with("/metrics/?name%5B%5D=vllm%3Anum_requests_waiting&"), "{p}");
        assert!(p.contains("&name%5B%5D=vllm%3Atime_to_first_token_seconds_sum&"), "{p}");
        assert!(p.contains("=vllm%3Acache_config_info&"), "{p}");
        assert_eq!(Engine::Vllm.filtered_metrics_path("/metrics/", true), Some(p.clone()));
        assert!(p.contains("&name%5B%5D=vllm%3Ainter_token_latency_seconds_count"), "{p}");
        assert_eq!(Engine::Vllm.metrics().sample_names().count(), 15, "with both TPOT names, sum and count");
        let lean = Engine::Vllm.filtered_metrics_path("/metrics", false).unwrap();
        assert_eq!(lean.replace("name%5B%5D=vllm%3Acache_config_info&", ""), lean);
        assert_eq!(p.replace("name%5B%5D=vllm%3Acache_config_info&", ""), lean);
        assert_eq!(Engine::Sglang.filtered_metrics_path("/metrics", true), None, "SGLang's filtered page is empty");
    }
}
