//! Engine configuration.

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct EngineConfig {
    /// Served model name.
    pub model: String,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV capacity in blocks.
    pub num_gpu_blocks: usize,
    /// Maximum concurrently running sequences.
    pub max_num_seqs: usize,
    /// Token budget of one scheduler step.
    pub max_num_batched_tokens: usize,
    /// Longest prompt + output accepted.
    pub max_model_len: usize,
    /// Multiplies every simulated step time (0.1 = ten times faster than modelled).
    pub time_scale: f64,
    /// Enable prefix caching.
    pub enable_prefix_caching: bool,
    /// CPU-offload tier in blocks (0 = none): GPU blocks evicted from the prefix cache move
    /// there, and a later hit reloads them instead of recomputing.
    pub num_cpu_blocks: usize,
    /// Cost of reloading a token's KV from the CPU tier, as a fraction of prefilling it.
    pub cpu_reload_cost: f64,
    /// Cost of pulling a token's KV from a prefill engine (P/D), as a fraction of prefilling it.
    pub kv_transfer_cost: f64,
    /// Multiply the modelled prefill / decode step times (calibrate the latency model to other
    /// hardware; 1.0 = Dynamo mocker's default polynomials).
    pub prefill_scale: f64,
    pub decode_scale: f64,
    /// Tokens per hand-off to the API layer after the first (vLLM's `--stream-interval`).
    pub stream_interval: usize,
    /// LoRA adapters this engine can serve (`--lora-modules`), and how many can be active at
    /// once (`--max-loras`): a request for an adapter that is not active waits for a free slot.
    pub lora_adapters: Vec<String>,
    pub max_loras: usize,
    /// A fault for tests: answer every inference request with this HTTP status (an OpenAI
    /// error body), as a broken engine would. Health, metrics and the model list still answer.
    pub fail_status: Option<u16>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            model: "tinyllama".into(),
            block_size: 16,
            num_gpu_blocks: 2048,
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            max_model_len: 131_072,
            time_scale: 1.0,
            enable_prefix_caching: true,
            num_cpu_blocks: 0,
            cpu_reload_cost: 0.2,
            kv_transfer_cost: 0.1,
            prefill_scale: 1.0,
            decode_scale: 1.0,
            stream_interval: 1,
            lora_adapters: Vec::new(),
            max_loras: 1,
            fail_status: None,
        }
    }
}
