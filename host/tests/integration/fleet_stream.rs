//! Fleet state over `Exchange`: what one Envoy reports reaches every other Envoy and not its
//! own, a late subscriber starts from the merged state, and a report stream that breaks off
//! loses nothing already merged. Real tonic server and clients on loopback.

// Helpers beside the tests may unwrap too: a failing unwrap is a failing test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use attache_host::fleet::{FleetConfig, FleetFeed};
use attache_host::push;
use attache_host::state::PoolState;
use attache_proto::v1::snapshot_service_client::SnapshotServiceClient;
use attache_proto::v1::{update, Binding, FleetDelta, Report, Update};
use tokio::sync::{mpsc, RwLock};
use tokio_stream::wrappers::ReceiverStream;

async fn serve() -> String {
    let state = Arc::new(RwLock::new(PoolState::default()));
    let rx = push::spawn_publisher(state, 1, Duration::from_millis(20), Duration::from_secs(2));
    let fleet = FleetFeed::spawn(FleetConfig::default());
    let svc = push::Snapshots::new(rx, Duration::from_secs(1)).with_fleet(fleet).into_server();
    crate::serve(svc).await
}

/// An `Exchange` stream for Envoy `envoy`: the sender for its reports and its updates.
async fn member(url: &str, envoy: &str) -> (mpsc::Sender<Report>, tonic::Streaming<Update>) {
    let mut client = SnapshotServiceClient::connect(url.to_owned()).await.unwrap();
    let (tx, rx) = mpsc::channel(16);
    tx.send(Report { node: format!("{envoy}/1"), envoy: envoy.into(), resync: true, ..Default::default() })
        .await
        .unwrap();
    let stream = client.exchange(ReceiverStream::new(rx)).await.unwrap().into_inner();
    (tx, stream)
}

/// The next fleet message, or `None` within `wait`.
async fn next_fleet(stream: &mut tonic::Streaming<Update>, wait: Duration) -> Option<FleetDelta> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let u = tokio::time::timeout_at(deadline, stream.message()).await.ok()?.unwrap()?;
        if let Some(update::Kind::Fleet(d)) = u.kind {
            return Some(d);
        }
    }
}

fn binding(key: u64, endpoint: &str) -> Binding {
    Binding { key, endpoint: endpoint.into(), expires_unix_ms: attache_host::fleet::now_ms() + 60_000 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_reaches_every_other_envoy_and_a_late_one_starts_from_the_merged_state() {
    let url = serve().await;
    let (a_tx, mut a) = member(&url, "envoy-a").await;
    let (_b_tx, mut b) = member(&url, "envoy-b").await;
    // Both start from an (empty) reset.
    assert!(next_fleet(&mut a, Duration::from_secs(5)).await.unwrap().reset);
    assert!(next_fleet(&mut b, Duration::from_secs(5)).await.unwrap().reset);

    let sent = std::time::Instant::now();
    let report = Report {
        bindings: vec![binding(1, "10.0.0.1:8000")],
        affinity_keys: vec![7, 8],
        affinity_endpoints: vec!["10.0.0.2:8000".into(), "10.0.0.2:8000".into()],
        ..Default::default()
    };
    a_tx.send(report).await.unwrap();
    let got = next_fleet(&mut b, Duration::from_secs(5)).await.expect("b hears a's report");
    let lag = sent.elapsed();
    assert!(!got.reset && got.seq > 0);
    let bound: Vec<_> = got.bindings.iter().map(|b| (b.key, b.endpoint.as_str())).collect();
    assert_eq!(bound, vec![(1, "10.0.0.1:8000")]);
    assert_eq!(got.affinity_keys, vec![7, 8]);
    assert!(got.oldest_report_unix_us > 0);
    println!("report to the other Envoy: {lag:?}");
    assert!(next_fleet(&mut a, Duration::from_millis(200)).await.is_none(), "nothing of its own comes back");

    // A late Envoy (a restarted one) recovers the merged state from its reset.
    let (_c_tx, mut c) = member(&url, "envoy-c").await;
    let reset = next_fleet(&mut c, Duration::from_secs(5)).await.unwrap();
    assert!(reset.reset);
    assert_eq!(
        reset.bindings.iter().map(|b| (b.key, b.endpoint.as_str())).collect::<Vec<_>>(),
        vec![(1, "10.0.0.1:8000")]
    );
    assert_eq!(reset.affinity_keys.len(), 2);

    // a's report stream ends (its Envoy died): what it reported stays merged.
    drop(a_tx);
    drop(a);
    let (_d_tx, mut d) = member(&url, "envoy-d").await;
    let reset = next_fleet(&mut d, Duration::from_secs(5)).await.unwrap();
    assert_eq!(reset.bindings.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_from_the_other_envoys_comes_back_summed() {
    let url = serve().await;
    let (a_tx, mut a) = member(&url, "envoy-a").await;
    let (b_tx, _b) = member(&url, "envoy-b").await;
    let (c_tx, _c) = member(&url, "envoy-c").await;
    assert!(next_fleet(&mut a, Duration::from_secs(5)).await.unwrap().reset);
    let now = attache_host::fleet::now_ms();
    let usage =
        |t: &str, u: f64| Report { usage: [(t.to_owned(), u)].into(), usage_unix_ms: now, ..Default::default() };
    a_tx.send(usage("t1", 1_000.0)).await.unwrap();
    b_tx.send(usage("t1", 300.0)).await.unwrap();
    c_tx.send(usage("t2", 50.0)).await.unwrap();
    let mut seen = std::collections::HashMap::new();
    while seen.len() < 2 {
        let d = next_fleet(&mut a, Duration::from_secs(5)).await.expect("usage");
        if d.usage_unix_ms > 0 {
            seen = d.remote_usage;
        }
    }
    assert!((seen["t1"] - 300.0).abs() < 1.0, "a hears b's t1 only: {seen:?}");
    assert!((seen["t2"] - 50.0).abs() < 1.0, "{seen:?}");

    // A stream whose first report names nobody is refused with a reason.
    let mut client = SnapshotServiceClient::connect(url.clone()).await.unwrap();
    let (tx, rx) = mpsc::channel(1);
    tx.send(Report::default()).await.unwrap();
    let err = client.exchange(ReceiverStream::new(rx)).await.expect_err("refused");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("node and envoy"), "{}", err.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_waits_for_a_binding_still_on_its_way() {
    let url = serve().await;
    let (a_tx, _a) = member(&url, "envoy-a").await;
    let mut client = SnapshotServiceClient::connect(url.clone()).await.unwrap();
    let ask = |wait_ms: u32| attache_proto::v1::LookupRequest { keys: vec![42], wait_ms };
    // Nobody holds key 42: the lookup waits its 100 ms and answers nothing.
    let t = std::time::Instant::now();
    let r = client.lookup(ask(100)).await.unwrap().into_inner();
    assert!(r.bindings.is_empty() && t.elapsed() >= Duration::from_millis(100), "{:?}", t.elapsed());
    // The binding arrives while a lookup waits: it answers as soon as it is merged.
    let mut waiting = client.clone();
    let pending = tokio::spawn(async move { waiting.lookup(ask(2_000)).await.unwrap().into_inner() });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t = std::time::Instant::now();
    a_tx.send(Report { bindings: vec![binding(42, "10.0.0.9:8000")], ..Default::default() }).await.unwrap();
    let r = pending.await.unwrap();
    assert_eq!(r.bindings.iter().map(|b| b.endpoint.as_str()).collect::<Vec<_>>(), vec!["10.0.0.9:8000"]);
    assert!(t.elapsed() < Duration::from_millis(500), "answered on the merge: {:?}", t.elapsed());
    // Too many keys is refused with a reason.
    let err = client
        .lookup(attache_proto::v1::LookupRequest { keys: (0..65).collect(), wait_ms: 0 })
        .await
        .expect_err("refused");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
}
