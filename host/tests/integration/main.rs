//! The host's integration tests, in one binary: each linked test binary costs about 20 s of CI
//! (the host library and its dependencies linked again), and these share everything.

// Helpers beside the tests may unwrap too: a failing unwrap is a failing test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fleet_stream;
mod index_stream;
mod kv_wire;
mod policy_cli;
mod snapshot_stream;

/// Serve `svc` on a loopback port in the background; its `http://` address.
async fn serve(
    svc: attache_proto::v1::snapshot_service_server::SnapshotServiceServer<attache_host::push::Snapshots>,
) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    format!("http://{addr}")
}
