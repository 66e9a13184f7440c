//! The host's Prometheus text-format parser and the engine-metrics extraction on top of it.
#![no_main]

use attache_host::prom;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let exp = prom::parse(&text);
    let _ = prom::names(&exp);
    let _ = prom::engine_metrics(&text, "vllm");
    let _ = prom::engine_metrics(&text, "sglang");
});
