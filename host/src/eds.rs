//! Envoy's Endpoint Discovery Service (state-of-the-world xDS over gRPC), serving the pool's
//! members from discovery.
//!
//! With it the engines are listed once, in the host's endpoints file (or found in
//! Kubernetes), and Envoy's `pool` cluster follows: an engine added to discovery becomes a
//! member Envoy's `override_host` policy may route to, and one removed stops receiving
//! traffic, with no Envoy restart. Every requested cluster name gets the same membership:
//! Attaché serves one pool per host.
//!
//! The stream sends a new `ClusterLoadAssignment` version whenever the membership changes,
//! and records Envoy's ACK or NACK of each; a NACK is logged with Envoy's reason.

use std::pin::Pin;

use envoy_types::pb::envoy::config::core::v3::{address, socket_address, Address, SocketAddress};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::endpoint::v3::endpoint_discovery_service_server::{
    EndpointDiscoveryService, EndpointDiscoveryServiceServer,
};
use envoy_types::pb::google::protobuf::Any;
use futures::Stream;
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

pub const CLUSTER_LOAD_ASSIGNMENT: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// The pool's members (`ip:port`) with a version that goes up on every change.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Membership {
    pub version: u64,
    pub addresses: Vec<String>,
}

/// Keeps the membership that the EDS streams serve.
#[derive(Debug, Clone)]
pub struct Members {
    tx: watch::Sender<Membership>,
}

impl Default for Members {
    fn default() -> Self {
        Self { tx: watch::channel(Membership::default()).0 }
    }
}

impl Members {
    /// Replace the membership; a new version only when the set changed.
    pub fn set(&self, mut addresses: Vec<String>) {
        addresses.sort();
        addresses.dedup();
        self.tx.send_if_modified(|m| {
            if m.addresses == addresses {
                return false;
            }
            m.version += 1;
            m.addresses = addresses;
            true
        });
    }

    pub fn subscribe(&self) -> watch::Receiver<Membership> {
        self.tx.subscribe()
    }
}

/// One `ip:port` as an Envoy endpoint; `None` for an address Envoy could not use.
fn lb_endpoint(address: &str) -> Option<LbEndpoint> {
    let sa: std::net::SocketAddr = address.parse().ok()?;
    Some(LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
            address: Some(Address {
                address: Some(address::Address::SocketAddress(SocketAddress {
                    address: sa.ip().to_string(),
                    port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(sa.port()))),
                    ..Default::default()
                })),
            }),
            ..Default::default()
        })),
        ..Default::default()
    })
}

/// The `ClusterLoadAssignment` of `cluster` for a membership.
pub fn assignment(cluster: &str, m: &Membership) -> ClusterLoadAssignment {
    ClusterLoadAssignment {
        cluster_name: cluster.to_owned(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints: m
                .addresses
                .iter()
                .filter_map(|a| {
                    let e = lb_endpoint(a);
                    if e.is_none() {
                        warn!(address = %a, "eds: not an ip:port; left out of the pool");
                    }
                    e
                })
                .collect(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn response(names: &[String], m: &Membership, nonce: u64) -> DiscoveryResponse {
    DiscoveryResponse {
        version_info: m.version.to_string(),
        resources: names
            .iter()
            .map(|n| Any { type_url: CLUSTER_LOAD_ASSIGNMENT.into(), value: assignment(n, m).encode_to_vec() })
            .collect(),
        type_url: CLUSTER_LOAD_ASSIGNMENT.into(),
        nonce: nonce.to_string(),
        ..Default::default()
    }
}

/// The tonic service.
pub struct EdsServer {
    members: watch::Receiver<Membership>,
}

impl EdsServer {
    pub fn new(members: &Members) -> Self {
        Self { members: members.subscribe() }
    }

    pub fn into_server(self) -> EndpointDiscoveryServiceServer<Self> {
        EndpointDiscoveryServiceServer::new(self)
    }
}

type SotwStream = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;
type DeltaStream = Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl EndpointDiscoveryService for EdsServer {
    type StreamEndpointsStream = SotwStream;
    type DeltaEndpointsStream = DeltaStream;

    async fn stream_endpoints(
        &self,
        req: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamEndpointsStream>, Status> {
        let mut requests = req.into_inner();
        let mut members = self.members.clone();
        let (tx, out) = mpsc::channel(4);
        tokio::spawn(async move {
            let mut names: Vec<String> = Vec::new();
            let mut node = String::new();
            let mut nonce = 0u64;
            // The version last sent, so a changed membership is sent once.
            let mut sent: Option<u64> = None;
            loop {
                tokio::select! {
                    r = requests.message() => {
                        let req = match r {
                            Ok(Some(req)) => req,
                            Ok(None) => break,
                            Err(e) => { debug!(error = %e, "eds stream ended"); break; }
                        };
                        if let Some(n) = &req.node { node.clone_from(&n.id); }
                        if let Some(err) = &req.error_detail {
                            warn!(%node, version = %req.version_info, reason = %err.message, "envoy refused the pool's endpoints (NACK)");
                        } else if !req.response_nonce.is_empty() {
                            debug!(%node, version = %req.version_info, "envoy applied the pool's endpoints (ACK)");
                        }
                        let mut wanted = req.resource_names.clone();
                        wanted.sort();
                        wanted.dedup();
                        if wanted != names {
                            // A new subscription: answer it now, with the current membership.
                            names = wanted;
                            sent = None;
                        }
                    }
                    r = members.changed() => {
                        if r.is_err() { break; }
                    }
                }
                let m = members.borrow_and_update().clone();
                if names.is_empty() || sent == Some(m.version) {
                    continue;
                }
                nonce += 1;
                info!(%node, version = m.version, endpoints = m.addresses.len(), "eds: sending the pool's endpoints");
                if tx.send(Ok(response(&names, &m, nonce))).await.is_err() {
                    break;
                }
                sent = Some(m.version);
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }

    async fn delta_endpoints(
        &self,
        _req: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaEndpointsStream>, Status> {
        Err(Status::unimplemented("the host serves EDS as state-of-the-world GRPC; set api_type: GRPC"))
    }

    async fn fetch_endpoints(&self, req: Request<DiscoveryRequest>) -> Result<Response<DiscoveryResponse>, Status> {
        let m = self.members.borrow().clone();
        Ok(Response::new(response(&req.into_inner().resource_names, &m, 0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn membership_versions_only_on_change_and_assignments_carry_every_valid_address() {
        let members = Members::default();
        let rx = members.subscribe();
        members.set(vec!["127.0.0.1:8001".into(), "127.0.0.1:8000".into()]);
        assert_eq!(rx.borrow().version, 1);
        members.set(vec!["127.0.0.1:8000".into(), "127.0.0.1:8001".into()]);
        assert_eq!(rx.borrow().version, 1, "same set, same version");
        members.set(vec!["127.0.0.1:8000".into(), "[::1]:9000".into(), "not-an-address".into()]);
        let m = rx.borrow().clone();
        assert_eq!(m.version, 2);
        let a = assignment("pool", &m);
        assert_eq!(a.cluster_name, "pool");
        let ips: Vec<String> = a.endpoints[0]
            .lb_endpoints
            .iter()
            .filter_map(|e| match &e.host_identifier {
                Some(lb_endpoint::HostIdentifier::Endpoint(ep)) => match &ep.address.as_ref()?.address {
                    Some(address::Address::SocketAddress(s)) => Some(format!("{}:{:?}", s.address, s.port_specifier)),
                    _ => None,
                },
                _ => None,
            })
            .collect();
        assert_eq!(ips.len(), 2, "{ips:?}");
        assert!(ips[0].starts_with("127.0.0.1:") && ips[1].starts_with("::1:"), "{ips:?}");
        let r = response(&["pool".into()], &m, 7);
        assert_eq!((r.version_info.as_str(), r.nonce.as_str(), r.resources.len()), ("2", "7", 1));
        assert_eq!(ClusterLoadAssignment::decode(r.resources[0].value.as_slice()).unwrap(), a);
    }
}
