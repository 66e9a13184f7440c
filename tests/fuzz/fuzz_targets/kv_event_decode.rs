//! The host's vLLM KV-event decoder. The body is `attache_fuzz_targets::kv_event_decode`, which
//! `cargo xtask unit` also replays over the corpus on stable.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| attache_fuzz_targets::kv_event_decode(data));
