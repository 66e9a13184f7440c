//! The snapshot stream carries the precise index: a subscriber gets the snapshot, a full
//! resend of the index (reset), then live deltas in order; a late subscriber starts from a
//! full resend that already contains earlier changes. Real tonic server and client on loopback.

// Helpers beside the tests may unwrap too: a failing unwrap is a failing test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use attache_host::push::{self, IndexFeed};
use attache_host::state::PoolState;
use attache_kv::events::{KvEvent, Medium};
use attache_kv::index::{KvIndex, GPU};
use attache_proto::v1::snapshot_service_client::SnapshotServiceClient;
use attache_proto::v1::{update, SubscribeRequest, Update};
use tokio::sync::RwLock;

fn stored(hashes: &[u64], tokens: std::ops::Range<u32>) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: None,
        token_ids: tokens.collect(),
        block_size: 4,
        lora_name: None,
        medium: Medium::Gpu,
    }
}

async fn next_index(stream: &mut tonic::Streaming<Update>) -> attache_proto::v1::IndexDelta {
    loop {
        let u = tokio::time::timeout(Duration::from_secs(5), stream.message()).await.unwrap().unwrap().unwrap();
        if let Some(update::Kind::Index(d)) = u.kind {
            return d;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_resend_then_live_deltas() {
    let index = Arc::new(Mutex::new(KvIndex::new(10_000)));
    index.lock().unwrap().apply(1, "m", &stored(&[1, 2], 0..8));
    let state = Arc::new(RwLock::new(PoolState::default()));
    let rx = push::spawn_publisher(state, 1, Duration::from_millis(20), Duration::from_secs(2));
    let feed = IndexFeed::spawn(index.clone(), Default::default(), Duration::from_millis(5), Duration::ZERO);
    let svc = push::Snapshots::new(rx, Duration::from_secs(1)).with_index(feed).into_server();
    let url = crate::serve(svc).await;
    tokio::time::sleep(Duration::from_millis(50)).await; // the first deltas are taken

    let mut client = SnapshotServiceClient::connect(url).await.unwrap();
    let mut stream = client.subscribe(SubscribeRequest { node: "test".into() }).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert!(matches!(first.kind, Some(update::Kind::Full(_))), "a full snapshot comes first");
    let resend = next_index(&mut stream).await;
    assert!(resend.reset);
    assert_eq!(resend.keys.len(), 2);
    assert!(resend.endpoints.iter().all(|e| *e == 1) && resend.tiers.iter().all(|t| *t == u32::from(GPU)));

    // Live: a new block on endpoint 2, then a removal.
    let t0 = Instant::now();
    index.lock().unwrap().apply(2, "m", &stored(&[9], 100..104));
    let d = next_index(&mut stream).await;
    let lag = t0.elapsed();
    assert!(!d.reset && d.seq > resend.seq);
    assert_eq!((d.endpoints.as_slice(), d.tiers.as_slice()), (&[2u32][..], &[u32::from(GPU)][..]));
    assert!(lag < Duration::from_secs(1), "delta took {lag:?}");
    index.lock().unwrap().apply(2, "m", &KvEvent::BlockRemoved { block_hashes: vec![9], medium: Medium::Gpu });
    let d2 = next_index(&mut stream).await;
    assert_eq!(d2.tiers, vec![0]);
    assert!(d2.seq > d.seq);

    // A late subscriber's resend already has endpoint 1's blocks and not the removed one.
    let mut late = client.subscribe(SubscribeRequest { node: "late".into() }).await.unwrap().into_inner();
    let r = next_index(&mut late).await;
    assert!(r.reset);
    assert_eq!(r.keys.len(), 2);
}
