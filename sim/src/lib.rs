//! A vLLM-compatible engine simulator: vLLM's wire formats on top of a step-level scheduling,
//! KV-cache and latency model.

// A harness: its scenarios read top to bottom (workspace lint `too_many_lines`).
#![allow(clippy::too_many_lines)]

pub mod api;
pub mod block_hash;
pub mod cheap;
pub mod config;
pub mod engine;
pub mod generate;
pub mod kv;
pub mod kv_publish;
pub mod latency;
pub mod messages;
pub mod metrics;
pub mod responses;
pub mod tokenizer;
pub mod wire;

pub use cheap::cheap_address;
pub use config::EngineConfig;
pub use engine::Engine;
