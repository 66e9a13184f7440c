//! The Envoys subscribed to this host's ECDS: which gateways exist, where they are, and where
//! the rollout controller reads their stats.
//!
//! Every Attaché gateway subscribes to its scheduler slot over ECDS, so the host already knows
//! each one by its node id and the address its stream comes from; no list of gateway pods has
//! to be kept by hand. An Envoy that advertises a stats port in its node metadata
//! (`attache.stats_port`, a number; the chart's gateway sets its in-cluster metrics port) is
//! read by the controller at `http://<stream's source address>:<port>/stats`. An Envoy is
//! forgotten when its last ECDS stream ends.
//!
//! Nothing authenticates an ECDS stream, so what may subscribe is for the network to decide
//! (only the gateways should reach the host's gRPC port). The controller reads only Envoys of
//! the configured `node.cluster` (`policy.envoy_cluster`), and at most [`MAX_ENVOYS`] are kept.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Mutex;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::google::protobuf::value::Kind;
use serde::Serialize;
use tracing::{info, warn};

/// The node-metadata key naming the port Envoy serves `/stats` on.
pub const STATS_PORT_KEY: &str = "attache.stats_port";

/// The most Envoys remembered; a further node id is not registered (and logged).
pub const MAX_ENVOYS: usize = 1024;

/// One subscribed Envoy.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Subscriber {
    /// Its `node.cluster`.
    pub cluster: String,
    /// The source address of its (first) ECDS stream.
    pub address: Option<SocketAddr>,
    /// Where the controller reads its stats, if it advertised a stats port.
    pub stats: Option<String>,
    /// Its open ECDS streams (one per slot filter subscription source).
    pub streams: u32,
}

/// The Envoys subscribed now, by node id.
#[derive(Debug, Default)]
pub struct Envoys {
    nodes: Mutex<BTreeMap<String, Subscriber>>,
}

impl Envoys {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Subscriber>> {
        self.nodes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An ECDS stream from `node` opened (from `peer`).
    pub fn connect(&self, node: &Node, peer: Option<SocketAddr>) {
        let stats = stats_url(node, peer);
        let mut nodes = self.lock();
        if nodes.len() >= MAX_ENVOYS && !nodes.contains_key(&node.id) {
            warn!(node = %node.id, limit = MAX_ENVOYS, "too many Envoys subscribed; this one is not remembered");
            return;
        }
        let s = nodes.entry(node.id.clone()).or_insert_with(|| Subscriber {
            cluster: node.cluster.clone(),
            address: peer,
            stats: None,
            streams: 0,
        });
        s.streams += 1;
        if s.stats.is_none() {
            s.stats = stats;
        }
        if s.streams == 1 {
            info!(node = %node.id, peer = ?peer, stats = ?s.stats, "Envoy subscribed");
        }
    }

    /// One of `node`'s ECDS streams ended.
    pub fn disconnect(&self, node: &str) {
        let mut nodes = self.lock();
        if let Some(s) = nodes.get_mut(node) {
            s.streams = s.streams.saturating_sub(1);
            if s.streams == 0 {
                nodes.remove(node);
                info!(node, "Envoy unsubscribed");
            }
        }
    }

    /// `(node id, stats base URL)` of every subscribed Envoy that advertised a stats port, of
    /// `cluster` when one is given.
    pub fn stats_urls(&self, cluster: Option<&str>) -> Vec<(String, String)> {
        self.lock()
            .iter()
            .filter(|(_, s)| cluster.is_none_or(|c| s.cluster == c))
            .filter_map(|(n, s)| Some((n.clone(), s.stats.clone()?)))
            .collect()
    }

    pub fn snapshot(&self) -> BTreeMap<String, Subscriber> {
        self.lock().clone()
    }
}

/// `http://<peer ip>:<attache.stats_port>`, when the node advertises a valid port.
fn stats_url(node: &Node, peer: Option<SocketAddr>) -> Option<String> {
    let value = node.metadata.as_ref()?.fields.get(STATS_PORT_KEY)?.kind.as_ref()?;
    let port = match value {
        Kind::NumberValue(n) if n.fract() == 0.0 && (1.0..=65535.0).contains(n) => *n as u16,
        Kind::StringValue(s) => s.parse::<u16>().ok().filter(|p| *p != 0)?,
        _ => return None,
    };
    Some(format!("http://{}", SocketAddr::new(peer?.ip(), port)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::{Struct, Value};

    fn node(id: &str, port: Option<Kind>) -> Node {
        let mut fields = std::collections::HashMap::new();
        if let Some(k) = port {
            fields.insert(STATS_PORT_KEY.to_owned(), Value { kind: Some(k) });
        }
        Node { id: id.into(), cluster: "gw".into(), metadata: Some(Struct { fields }), ..Default::default() }
    }

    #[test]
    fn envoys_are_known_while_subscribed_and_read_where_they_say() {
        let e = Envoys::default();
        let peer: SocketAddr = "10.1.2.3:40000".parse().unwrap();
        e.connect(&node("gw-a", Some(Kind::NumberValue(9902.0))), Some(peer));
        e.connect(&node("gw-a", Some(Kind::NumberValue(9902.0))), Some(peer));
        e.connect(&node("gw-b", Some(Kind::StringValue("9903".into()))), Some("[fd00::7]:1".parse().unwrap()));
        e.connect(&node("gw-c", None), Some(peer));
        e.connect(&node("gw-d", Some(Kind::NumberValue(70000.0))), Some(peer));
        assert_eq!(
            e.stats_urls(None),
            [
                ("gw-a".to_owned(), "http://10.1.2.3:9902".to_owned()),
                ("gw-b".to_owned(), "http://[fd00::7]:9903".to_owned())
            ]
        );
        assert_eq!(e.snapshot().len(), 4, "every subscriber is listed, with or without a stats port");
        e.disconnect("gw-a");
        assert_eq!(e.stats_urls(Some("gw")).len(), 2, "gw-a still has a stream open");
        assert!(e.stats_urls(Some("another-release")).is_empty(), "only the configured gateways are read");
        e.disconnect("gw-a");
        e.disconnect("gw-b");
        assert!(e.stats_urls(None).is_empty());
        assert_eq!(e.snapshot().keys().collect::<Vec<_>>(), ["gw-c", "gw-d"]);
    }
}
