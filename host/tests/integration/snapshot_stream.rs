//! The snapshot stream sends deltas: a subscriber gets the whole snapshot once, then only the
//! endpoints that changed, and applying them rebuilds exactly the host's snapshot. Real tonic
//! server and client on loopback, a pool of 10,000 endpoints.

// Helpers beside the tests may unwrap too: a failing unwrap is a failing test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use attache_host::endpoints::StaticEndpoint;
use attache_host::push;
use attache_host::state::PoolState;
use attache_kv::prom::EngineMetrics;
use attache_proto::v1::snapshot_service_client::SnapshotServiceClient;
use attache_proto::v1::{update, SubscribeRequest, Update};
use attache_proto::Message;
use tokio::sync::RwLock;

fn spec(i: usize) -> StaticEndpoint {
    StaticEndpoint {
        address: format!("10.{}.{}.{}:8000", i / 65_536, (i / 256) % 256, i % 256),
        models: vec!["m".into()],
        role: "both".into(),
        engine: "vllm".into(),
        metrics_path: "/metrics".into(),
        kv_events: None,
        labels: Default::default(),
    }
}

async fn next_state(stream: &mut tonic::Streaming<Update>) -> Update {
    loop {
        let u = tokio::time::timeout(Duration::from_secs(10), stream.message()).await.unwrap().unwrap().unwrap();
        if matches!(u.kind, Some(update::Kind::Full(_) | update::Kind::Delta(_))) {
            return u;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_changed_engine_of_ten_thousand_travels_alone() {
    const N: usize = 10_000;
    let state = Arc::new(RwLock::new(PoolState::default()));
    {
        let mut st = state.write().await;
        st.set_endpoints((0..N).map(spec).collect());
        let now = Instant::now();
        for i in 0..N {
            st.record_scrape(&spec(i).address, Ok(EngineMetrics { running: 1.0, ..Default::default() }), now);
            st.set_scrape_interval(&spec(i).address, Duration::from_secs(5));
        }
    }
    let rx = push::spawn_publisher(state.clone(), 1, Duration::from_millis(20), Duration::from_secs(30));
    let svc = push::Snapshots::new(rx.clone(), Duration::from_secs(1)).into_server();
    let url = crate::serve(svc).await;
    // The first published version holds the whole pool.
    let mut watch = rx.clone();
    while watch.borrow_and_update().endpoints.len() < N {
        watch.changed().await.unwrap();
    }

    let mut client = SnapshotServiceClient::connect(url).await.unwrap().max_decoding_message_size(64 << 20);
    let mut stream = client.subscribe(SubscribeRequest { node: "test".into() }).await.unwrap().into_inner();
    let first = next_state(&mut stream).await;
    let full_bytes = first.encoded_len();
    let Some(update::Kind::Full(mut mine)) = first.kind else { panic!("a full snapshot comes first") };
    assert_eq!(mine.endpoints.len(), N);

    // Engines change one at a time; each goes out as a delta of one record.
    for k in 0..5 {
        let changed = spec(17 + 1_000 * k).address;
        state.write().await.record_scrape(
            &changed,
            Ok(EngineMetrics { running: 7.0 + k as f64, ..Default::default() }),
            Instant::now(),
        );
        let u = next_state(&mut stream).await;
        let bytes = u.encoded_len();
        let Some(update::Kind::Delta(d)) = u.kind else {
            panic!("a delta, not {:?}", u.kind.map(|_| "a full snapshot"))
        };
        assert_eq!(d.upserts.iter().map(|e| e.address.as_str()).collect::<Vec<_>>(), vec![changed.as_str()]);
        assert!(bytes <= 1_024, "{bytes} bytes for one changed engine (the whole pool is {full_bytes})");
        attache_proto::delta::apply(&mut mine, &d).unwrap();
        assert_eq!(&mine, &rx.borrow().snapshot, "the delta rebuilds the host's snapshot");
    }
    assert!(full_bytes > 500_000, "the whole pool is {full_bytes} bytes");
}
