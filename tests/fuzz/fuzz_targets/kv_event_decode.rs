//! The host's vLLM KV-event decoder: the three ZMQ frames, then the msgpack batch.
//! Input: the payload frame; the first 8 bytes also serve as the sequence frame.
#![no_main]

use attache_host::kv_events;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let seq = data.get(..8).unwrap_or(&[0; 8]);
    if let Ok(m) = kv_events::split_frames(&[b"kv@fuzz@m", seq, data]) {
        let _ = kv_events::decode_batch(m.payload);
    }
});
