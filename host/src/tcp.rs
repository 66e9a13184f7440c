//! TCP listeners for the gRPC servers.

use futures::Stream;
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::TcpListenerStream;
use tracing::debug;

/// Accepted connections with Nagle's algorithm off. A small gRPC message otherwise waits for
/// the peer's delayed ACK (40 ms on Linux) whenever the one before it is still unacknowledged:
/// on the snapshot stream that was the whole tail of event → filter propagation. Tonic's own
/// `tcp_nodelay` does not apply to `serve_with_incoming`.
pub fn no_delay(listener: TcpListener) -> impl Stream<Item = std::io::Result<TcpStream>> + Send + 'static {
    use futures::StreamExt as _;
    TcpListenerStream::new(listener).map(|conn| {
        conn.inspect(|c| {
            if let Err(e) = c.set_nodelay(true) {
                debug!(error = %e, "TCP_NODELAY not set");
            }
        })
    })
}
