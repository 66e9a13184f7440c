//! What engines say about their KV caches (turned into the router's precise prefix index) and
//! about their load (their `/metrics`).
//!
//! This crate does no I/O: no sockets, no threads, no clock. The host reads ZMQ frames and
//! scrapes `/metrics`, and asks this crate what they mean; the filter computes the same block
//! keys from the prompts it tokenizes (through `attache_policies::prefix`).
//!
//! * [`engine`]: each engine's profile (`vllm`, `sglang`): its metric names and event format.
//! * [`prom`]: the Prometheus text format, and the metrics a router reads from an engine's
//!   `/metrics` under its profile's names.
//! * [`events`]: decoding KV-event batches ([`msgpack`] underneath).
//! * [`block_key`]: Attaché's block keys, computed from token ids.
//! * [`index`]: the precise index (block key → holders and tiers), on an [`open_table`].
//! * [`tier`]: where a block lives.

pub mod block_key;
pub mod engine;
pub mod events;
pub mod index;
pub mod msgpack;
pub mod open_table;
pub mod prom;
pub mod tier;

pub use engine::Engine;
pub use events::{EventBatch, KvEvent};
pub use index::KvIndex;
pub use tier::Medium;
