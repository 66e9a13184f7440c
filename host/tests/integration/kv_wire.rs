//! Wire tests of the host's KV-event subscriber against an independent publisher written with
//! pyzmq and msgpack (the Python libraries, not Attaché's encoder), over real ZMQ sockets on
//! loopback. Needs `.venv` with pyzmq and msgpack: `cargo xtask test` installs them.

// Helpers beside the tests may unwrap too: a failing unwrap is a failing test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use attache_host::kv_subscribe::{EngineSource, KvSubscribers};
use attache_kv::block_key;
use attache_kv::engine::Engine;
use attache_kv::index::{KvIndex, CPU, DISK, GPU, OTHER};

fn python() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(p.exists(), "{} missing: run `cargo xtask test`, which installs pyzmq and msgpack", p.display());
    p
}

/// A free port below the kernel's ephemeral range (so no outgoing connection can take it
/// before the publisher binds it), never the same twice in this process.
fn port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let _ = NEXT.compare_exchange(0, 15_000 + (std::process::id() % 4_000) as u16, Ordering::SeqCst, Ordering::SeqCst);
    loop {
        let p = NEXT.fetch_add(1, Ordering::SeqCst);
        if TcpListener::bind(("127.0.0.1", p)).is_ok() {
            return p;
        }
    }
}

fn publisher(args: &[&str]) -> serde_json::Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/pyzmq_publisher.py");
    let out = Command::new(python()).arg(script).args(args).output().expect("python");
    assert!(out.status.success(), "publisher failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("publisher output")
}

fn keys(tokens: std::ops::Range<u32>) -> Vec<u64> {
    block_key::token_block_keys(block_key::chain_seed("tinyllama", None), &tokens.collect::<Vec<_>>(), 16)
}

fn run_bind_scenario(encoding: &str) {
    let (pub_port, replay_port) = (port(), port());
    let index = Arc::new(Mutex::new(KvIndex::new(10_000)));
    let mut subs = KvSubscribers::new(index.clone(), Default::default());
    subs.apply(vec![EngineSource {
        endpoint_id: 3,
        address: "127.0.0.1:1".into(),
        model: "tinyllama".into(),
        engine: Engine::Vllm,
        publisher: Some(format!("tcp://127.0.0.1:{pub_port}")),
        replay: Some(format!("tcp://127.0.0.1:{replay_port}")),
    }]);
    let out = publisher(&["bind", encoding, &pub_port.to_string(), &replay_port.to_string()]);
    assert_eq!(out["replays_served"], 1, "exactly one gap (seq 5) should be replayed");
    let c = &subs.counters;
    assert_eq!(c.decode_errors.load(Ordering::Relaxed), 3, "truncated payload, absurd length, wrong frame count");
    assert_eq!(c.skipped_events.load(Ordering::Relaxed), 1, "the unknown event type");
    assert_eq!(c.gaps.load(Ordering::Relaxed), 1);
    assert_eq!(c.replayed_batches.load(Ordering::Relaxed), 1);

    let mut ix = index.lock().unwrap();
    // Chain 0..64: uint64 hashes, then an int64 parent/child, then a bytes hash.
    let k = keys(0..64);
    assert_eq!(ix.tiers(k[0], 3), GPU);
    assert_eq!(ix.tiers(k[1], 3), 0, "seq 6 removed the block with hash 2^63+7");
    assert_eq!(ix.tiers(k[2], 3), GPU, "int64 hash, parent resolved by uint64 hash");
    assert_eq!(ix.tiers(k[3], 3), GPU, "bytes hash, parent given as int64");
    // The replayed batch.
    assert_eq!(ix.tiers(keys(500..516)[0], 3), GPU);
    assert_eq!(ix.stats.orphan_events, 0);
}

#[test]
fn pyzmq_publisher_map_encoding_with_garbage_gap_and_replay() {
    run_bind_scenario("map");
}

#[test]
fn pyzmq_publisher_array_encoding_with_garbage_gap_and_replay() {
    run_bind_scenario("array");
}

#[test]
fn collector_mode_engines_connect_and_topics_name_them() {
    let p = port();
    let index = Arc::new(Mutex::new(KvIndex::new(1000)));
    let mut subs = KvSubscribers::new(index.clone(), Default::default());
    let endpoint = format!("tcp://127.0.0.1:{p}");
    subs.bind_collector(&endpoint).unwrap();
    subs.apply(vec![EngineSource {
        endpoint_id: 7,
        address: "127.0.0.1:8000".into(),
        model: "tinyllama".into(),
        engine: Engine::Vllm,
        publisher: None,
        replay: None,
    }]);
    publisher(&["collector", &endpoint, "kv@127.0.0.1:8000@tinyllama"]);
    let k = keys(0..32);
    let mut ix = index.lock().unwrap();
    assert_eq!(ix.tiers(k[0], 7), GPU);
    assert_eq!(ix.tiers(k[1], 7), GPU);
    assert_eq!(subs.counters.unknown_topics.load(Ordering::Relaxed), 1, "the message from an unknown engine");
}

/// vLLM as shipped publishes on topic `""`; the chart's engines said `kv-events`; Attaché's
/// own form is `kv@ip:port@model`. A subscriber connected to an engine's own socket indexes
/// every event whatever the topic, and a tier it does not know is counted and kept lowest.
#[test]
fn an_engines_own_socket_is_followed_whatever_its_topic() {
    for (i, topic) in ["", "kv-events", "kv@127.0.0.1:1@tinyllama"].into_iter().enumerate() {
        let pub_port = port();
        let index = Arc::new(Mutex::new(KvIndex::new(1000)));
        let mut subs = KvSubscribers::new(index.clone(), Default::default());
        subs.apply(vec![EngineSource {
            endpoint_id: 4,
            address: format!("127.0.0.1:{}", 1 + i),
            model: "tinyllama".into(),
            engine: Engine::Vllm,
            publisher: Some(format!("tcp://127.0.0.1:{pub_port}")),
            replay: None,
        }]);
        let out = publisher(&["topic", &pub_port.to_string(), topic]);
        let c = &subs.counters;
        assert_eq!(c.events.load(Ordering::Relaxed), out["events"].as_u64().unwrap(), "topic {topic:?}: every event");
        assert_eq!(c.unknown_media.load(Ordering::Relaxed), 1, "topic {topic:?}: the NVME block is counted");
        assert_eq!(c.decode_errors.load(Ordering::Relaxed), 0);
        let k = keys(0..64);
        let mut ix = index.lock().unwrap();
        assert_eq!([ix.tiers(k[0], 4), ix.tiers(k[1], 4)], [GPU, GPU], "topic {topic:?}");
        assert_eq!(ix.tiers(k[2], 4), OTHER, "topic {topic:?}: NVME is its own, unknown tier");
        assert_eq!(ix.tiers(k[3], 4), CPU);
        let w = attache_policies::precise::TierWeights::default();
        assert!(w.best(OTHER) <= w.best(DISK).min(w.best(CPU)), "and it weighs least");
    }
}

/// In collector mode the topic is all that names the engine: messages whose topic names none
/// (vLLM's default `""`, `kv-events`, a foreign engine) are counted, not applied to anyone.
#[test]
fn collector_mode_counts_topics_that_name_no_engine() {
    for topic in ["", "kv-events"] {
        let p = port();
        let index = Arc::new(Mutex::new(KvIndex::new(1000)));
        let subs = KvSubscribers::new(index.clone(), Default::default());
        let endpoint = format!("tcp://127.0.0.1:{p}");
        subs.bind_collector(&endpoint).unwrap();
        publisher(&["collector", &endpoint, topic]);
        assert_eq!(subs.counters.unknown_topics.load(Ordering::Relaxed), 2, "topic {topic:?} and the foreign one");
        assert_eq!(subs.counters.events.load(Ordering::Relaxed), 0);
        let text = attache_host::telemetry::render(
            &attache_host::telemetry::HostMetrics::default(),
            &attache_host::telemetry::Gauges {
                ready_endpoints: 0,
                unready_endpoints: 0,
                kv_index_blocks: 0,
                kv: Some(&subs.counters),
            },
        );
        assert!(text.contains("attache_host_kv_events_dropped_total{reason=\"unknown_topic\"} 2\n"), "{text}");
    }
}

#[test]
fn a_sequence_that_goes_back_is_a_restart_and_clears_the_engine() {
    let p = port();
    let index = Arc::new(Mutex::new(KvIndex::new(1000)));
    let mut subs = KvSubscribers::new(index.clone(), Default::default());
    subs.apply(vec![EngineSource {
        endpoint_id: 1,
        address: "127.0.0.1:1".into(),
        model: "tinyllama".into(),
        engine: Engine::Vllm,
        publisher: Some(format!("tcp://127.0.0.1:{p}")),
        replay: None,
    }]);
    publisher(&["restart", &p.to_string()]);
    assert_eq!(subs.counters.restarts.load(Ordering::Relaxed), 1);
    let mut ix = index.lock().unwrap();
    assert_eq!(ix.tiers(keys(0..16)[0], 1), 0, "entries from before the restart are gone");
    assert_eq!(ix.tiers(keys(100..116)[0], 1), 0);
    assert_eq!(ix.tiers(keys(200..216)[0], 1), GPU);
}
