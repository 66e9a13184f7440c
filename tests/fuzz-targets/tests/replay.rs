//! Replays every checked-in fuzz input on the stable toolchain: the seeds in
//! `tests/fuzz/corpus/<target>/` and every crash ever found, in `tests/fuzz/regressions/<target>/`.
//! Fuzzing itself (new inputs, nightly libFuzzer) is `cargo xtask fuzz`.

use std::path::PathBuf;

fn inputs(kind: &str, target: &str) -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz").join(kind).join(target);
    let mut files: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(rd) => rd.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect(),
        Err(_) => Vec::new(),
    };
    files.sort();
    files
}

#[test]
fn every_corpus_seed_and_regression_replays_without_a_panic() {
    let mut report = Vec::new();
    for (name, body) in attache_fuzz_targets::TARGETS {
        let seeds = inputs("corpus", name);
        assert!(!seeds.is_empty(), "target {name} has no corpus seeds");
        let regressions = inputs("regressions", name);
        for path in seeds.iter().chain(&regressions) {
            let data = std::fs::read(path).unwrap();
            let outcome = std::panic::catch_unwind(|| body(&data));
            assert!(outcome.is_ok(), "{name}: {} panicked", path.display());
        }
        report.push(format!("{name}: {} seeds, {} regressions", seeds.len(), regressions.len()));
    }
    println!("{}", report.join("\n"));
}

#[test]
fn the_reference_tokenizer_path_is_exercised() {
    // Byte 1 bit 0 asks request_parse to render and tokenize; the fixture tokenizer must load,
    // or that half of the target would silently do nothing.
    let body = br#"{"model": "m", "messages": [{"role": "user", "content": "hello"}]}"#;
    let mut data = vec![1u8, 1];
    data.extend_from_slice(body);
    assert!(attache_fuzz_targets::reference_tokenizer_loads(), "the fixture tokenizer did not load");
    attache_fuzz_targets::request_parse(&data);
}
