//! The filter's snapshot decoder: protobuf bytes from shared data into the scheduler's pool.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(pool) = attache_scheduler_filter::snapshot::decode_pool(data) {
        // Whatever decodes must be usable by the scheduler without panicking.
        for e in &pool.endpoints {
            let _ = e.base_model();
            let _ = e.fresh_metrics(1000);
        }
    }
});
