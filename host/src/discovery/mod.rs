//! Discovery: which endpoints the pool has. The sources are a static endpoints file
//! ([`static_file`]) or Kubernetes (`crate::kubernetes`); either hands each new endpoint list
//! to a [`Sink`], which brings the rest of the host in step with it.

mod sink;
pub mod static_file;

pub use crate::endpoints::{DiscoveryError, KvEventsSpec, StaticEndpoint, StaticEndpoints};
pub use sink::Sink;
