//! Policy-module admission on the real scheduler filter: the module Envoy runs passes the
//! host's wasmtime admission (ABI exports, on_configure, recorded sample requests within the
//! budget), and behaves there as it does in Envoy (malformed bodies answered with 400).

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

use attache_e2e::Paths;
use attache_host::policy::admission::{admit, AdmissionConfig, AdmissionError};

#[test]
fn the_scheduler_filter_passes_admission() {
    let paths = Paths::discover().expect("paths");
    let wasm = std::fs::read(&paths.wasm).expect("built filter (cargo xtask build)");
    let cfg = AdmissionConfig {
        plugin_config: br#"{"role": "scheduler", "scheduler": {"max_body_bytes": 4194304}}"#.to_vec(),
        ..AdmissionConfig::default()
    };
    let r = admit(&wasm, &cfg).unwrap_or_else(|e| panic!("admission refused the scheduler filter: {e}"));
    assert!(r.abi.starts_with("proxy_abi_version_0_2_"), "{}", r.abi);
    // Samples 4 and 5 are malformed JSON and an empty body: the filter answers 400 itself.
    assert_eq!(r.outcomes[4].local_response, Some(400), "{:?}", r.outcomes[4]);
    assert_eq!(r.outcomes[5].local_response, Some(400), "{:?}", r.outcomes[5]);
    // With no snapshot in shared data, well-formed requests find no endpoint: 503, not a trap.
    assert_eq!(r.outcomes[0].local_response, Some(503), "{:?}", r.outcomes[0]);
    println!("scheduler filter admitted: slowest sample {} us", r.max_request_us);

    // A configuration the filter rejects (unknown field) fails on_configure.
    let bad = AdmissionConfig { plugin_config: br#"{"role": "scheduler", "nonsense": 1}"#.to_vec(), ..cfg };
    let r = admit(&wasm, &bad);
    assert!(matches!(r, Err(AdmissionError::ConfigureRejected)), "{:?}", r.map(|r| r.logs));
}

/// The example scorers, built with the scorer SDK, pass the host's scorer admission: they read
/// the recorded scheduling contexts from filter state and score every candidate.
#[test]
fn the_example_scorers_pass_scorer_admission() {
    use attache_host::policy::admission::{check_scorer_outputs, scorer_samples};
    let paths = Paths::discover().expect("paths");
    for (module, params) in [
        ("attache_scorer_slo_ttft", serde_json::json!({"ttft_slo_ms": 400})),
        ("attache_scorer_cost_aware", serde_json::json!({"costs": {"l4": 1.0, "a100": 2.5, "h100": 4.0}})),
        ("attache_filter_label", serde_json::json!({"remove": ["l4"]})),
    ] {
        let wasm = std::fs::read(paths.module(module)).expect("built scorer (cargo xtask build)");
        let cfg = AdmissionConfig {
            plugin_config: serde_json::json!({"slot": "x", "params": params}).to_string().into_bytes(),
            samples: scorer_samples(),
            check_outputs: Some(check_scorer_outputs),
            ..AdmissionConfig::default()
        };
        let r = admit(&wasm, &cfg).unwrap_or_else(|e| panic!("{module} refused: {e}"));
        println!("{module} admitted: slowest sample {} us", r.max_request_us);
        // The filter module removed the samples' l4 candidates, each with its reason.
        let removals: usize = r
            .outcomes
            .iter()
            .filter_map(|o| o.properties.iter().find(|(k, _)| k == attache_policies::scoring::SCORES_PROPERTY))
            .filter_map(|(_, v)| attache_policies::scoring::ScoreSheet::decode(v).ok())
            .flat_map(|sheet| sheet.entries)
            .map(|e| e.removed.len())
            .sum();
        assert_eq!(removals > 0, module == "attache_filter_label", "{module}: {removals} removals");
        // Its own parameter checks run in on_configure.
        let bad = AdmissionConfig {
            plugin_config: br#"{"slot": "x", "params": {"ttft_slo_ms": -1, "costs": {}}}"#.to_vec(),
            ..cfg
        };
        assert!(matches!(admit(&wasm, &bad), Err(AdmissionError::ConfigureRejected)), "{module}");
    }
    // A module that runs but writes no scores (the scheduler filter's passthrough root) is refused.
    let wasm = std::fs::read(&paths.wasm).expect("scheduler filter");
    let cfg = AdmissionConfig {
        plugin_config: br#"{"role": "passthrough"}"#.to_vec(),
        samples: scorer_samples(),
        check_outputs: Some(check_scorer_outputs),
        ..AdmissionConfig::default()
    };
    assert!(matches!(admit(&wasm, &cfg), Err(AdmissionError::NoScores { sample: 0, .. })));
}
