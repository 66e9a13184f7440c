//! Writes the structured corpus seeds that hand-written files cannot easily be: a snapshot as
//! the host encodes it, and modules signed by a fuzz-only key (public half in keys/fuzz.pub).
//! Run once with `cargo run --release -p attache-host --example fuzz_seeds`; the outputs are
//! checked in under `tests/fuzz/`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use attache_host::discovery::StaticEndpoint;
use attache_host::policy::signing;
use attache_host::state::PoolState;
use prost::Message;

fn main() -> anyhow::Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fuzz");
    snapshot(&root.join("corpus/snapshot_decode"))?;
    modules(&root)?;
    Ok(())
}

fn snapshot(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let metrics = attache_fixtures::read_vllm("metrics.under-load.txt")?;
    let mut pool = PoolState::default();
    let eps: Vec<StaticEndpoint> = serde_json::from_value(serde_json::json!([
        {"address": "10.0.0.1:8000", "models": ["m", "sql"], "role": "decode", "labels": {"attache.io/accelerator": "l4"}},
        {"address": "10.0.0.2:8000", "models": ["m"], "role": "prefill"},
        {"address": "10.0.0.3:8000", "models": ["m"]},
    ]))?;
    pool.set_endpoints(eps);
    let now = Instant::now();
    let m =
        attache_kv::prom::engine_metrics(&metrics, attache_kv::Engine::Vllm).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    pool.record_scrape("10.0.0.1:8000", Ok(m.clone()), now);
    pool.record_scrape("10.0.0.2:8000", Ok(m), now);
    pool.record_scrape("10.0.0.3:8000", Err("connection refused".into()), now);
    let snap = pool.snapshot(7, 3, now, Duration::from_secs(1));
    std::fs::write(dir.join("host-3-endpoints"), snap.encode_to_vec())?;
    let empty = pool.snapshot(1, 1, now, Duration::ZERO);
    std::fs::write(dir.join("host-unready"), empty.encode_to_vec())?;
    Ok(())
}

fn modules(root: &Path) -> anyhow::Result<()> {
    let dir = root.join("corpus/signature_verify");
    std::fs::create_dir_all(&dir)?;
    let tmp = std::env::temp_dir().join(format!("attache-fuzz-keys-{}", std::process::id()));
    let (key, public, _) = signing::keygen(&tmp)?;
    std::fs::create_dir_all(root.join("keys"))?;
    std::fs::copy(&public, root.join("keys/fuzz.pub"))?;
    // The smallest valid module, and one with a custom section and a function.
    let empty = b"\0asm\x01\0\0\0".to_vec();
    let mut custom = empty.clone();
    custom.extend_from_slice(&[0, 5, 4, b'n', b'o', b't', b'e']);
    custom.extend_from_slice(&[1, 4, 1, 0x60, 0, 0, 3, 2, 1, 0, 10, 4, 1, 2, 0, 11]);
    let secret = std::fs::read(&key)?;
    for (name, m) in [("empty", &empty), ("function", &custom)] {
        std::fs::write(dir.join(format!("unsigned-{name}")), m)?;
        let signed = signing::sign(&secret, m)?;
        let mut tampered = signed.clone();
        if let Some(last) = tampered.last_mut() {
            *last ^= 1;
        }
        std::fs::write(dir.join(format!("signed-{name}")), &signed)?;
        std::fs::write(dir.join(format!("tampered-{name}")), tampered)?;
    }
    std::fs::remove_dir_all(&tmp)?;
    Ok(())
}
