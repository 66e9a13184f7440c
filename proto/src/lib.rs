//! Attaché's wire contracts, generated from `proto/attache/v1/*.proto`.

#[allow(clippy::all, clippy::pedantic)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/attache.v1.rs"));
}

/// The gRPC health checking protocol (vendored), for the endpoint picker's health service.
#[allow(clippy::all, clippy::pedantic)]
pub mod health {
    include!(concat!(env!("OUT_DIR"), "/grpc.health.v1.rs"));
}

pub mod delta;
pub mod pool;
pub mod shared_layout;

pub use prost::Message;
