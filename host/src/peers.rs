//! Host replicas share what their Envoys learned: each host subscribes to every other host's
//! `Exchange` stream as a peer and merges what it hears, so an Envoy connected to any replica
//! sees the whole fleet.
//!
//! A peer stream names its member `host:<this host>`. Hosts send peers only what their own
//! Envoys reported (never what they heard from another peer), and only their own Envoys' usage,
//! so nothing travels in a loop and usage is counted once. Peers come from `fleet.peers`
//! (static addresses) or `fleet.peers_dns` (a headless Service's name, resolved every
//! `peers_refresh_ms`).

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::time::Duration;

use attache_proto::v1::snapshot_service_client::SnapshotServiceClient;
use attache_proto::v1::{self, update};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::fleet::{FleetFeed, PEER_PREFIX};

/// Follow one peer until its stream ends; returns why.
async fn follow(feed: &FleetFeed, me: &str, peer: &str) -> anyhow::Result<()> {
    let url = if peer.contains("://") { peer.to_owned() } else { format!("http://{peer}") };
    let mut client = SnapshotServiceClient::connect(url).await?;
    let hello = v1::Report { node: format!("{me}/peer"), envoy: format!("{PEER_PREFIX}{me}"), ..Default::default() };
    let mut updates = client.exchange(tokio_stream::once(hello)).await?.into_inner();
    let origin = format!("{PEER_PREFIX}{peer}");
    info!(%peer, "following peer host");
    while let Some(u) = updates.message().await? {
        let Some(update::Kind::Fleet(d)) = u.kind else { continue };
        let report = v1::Report {
            bindings: d.bindings,
            affinity_keys: d.affinity_keys,
            affinity_endpoints: d.affinity_endpoints,
            usage: d.remote_usage,
            usage_unix_ms: d.usage_unix_ms,
            resync: d.reset,
            ..Default::default()
        };
        feed.report(&origin, &report);
    }
    Ok(())
}

/// Keep following `peer`, reconnecting after a pause when its stream ends.
fn spawn_follower(feed: FleetFeed, me: String, peer: String) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            match follow(&feed, &me, &peer).await {
                Ok(()) => debug!(%peer, "peer stream ended"),
                Err(e) => debug!(%peer, error = %e, "peer unreachable"),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
}

/// Resolve `name:port` to the peers' addresses, leaving out this host's own.
async fn resolve(dns: &str, own: &BTreeSet<String>) -> Option<BTreeSet<String>> {
    match tokio::net::lookup_host(dns).await {
        Ok(addrs) => Some(addrs.map(|a: SocketAddr| a.to_string()).filter(|a| !own.contains(a)).collect()),
        Err(e) => {
            warn!(%dns, error = %e, "could not resolve the peer hosts");
            None
        }
    }
}

/// Start following the configured peers: the static list at once, and the DNS name's
/// addresses as they come and go. `me` names this host; `own` are its own addresses (left out
/// of DNS answers).
pub fn spawn(feed: FleetFeed, me: String, own: BTreeSet<String>) {
    let cfg = feed.lock().config().clone();
    let mut followers: HashMap<String, JoinHandle<()>> = HashMap::new();
    for p in cfg.peers.iter().filter(|p| !own.contains(*p)) {
        followers.insert(p.clone(), spawn_follower(feed.clone(), me.clone(), p.clone()));
    }
    let Some(dns) = cfg.peers_dns.clone() else { return };
    let every = Duration::from_millis(cfg.peers_refresh_ms.max(100));
    tokio::spawn(async move {
        loop {
            if let Some(want) = resolve(&dns, &own).await {
                followers.retain(|addr, task| {
                    let keep = want.contains(addr) || cfg.peers.contains(addr);
                    if !keep {
                        info!(peer = %addr, "peer host left");
                        task.abort();
                    }
                    keep
                });
                for addr in want {
                    followers
                        .entry(addr.clone())
                        .or_insert_with(|| spawn_follower(feed.clone(), me.clone(), addr.clone()));
                }
            }
            tokio::time::sleep(every).await;
        }
    });
}
