//! The Attaché host service: discovery, metrics scraping, pool state and the snapshot stream.

pub mod activity;
pub mod admin;
pub mod admin_auth;
pub mod async_worker;
pub mod autoscaling;
pub mod config;
pub mod discovery;
pub mod eds;
pub mod endpoints;
pub mod epp;
pub mod fleet;
pub mod gateway;
pub mod host;
pub mod kubernetes;
pub mod kv_subscribe;
pub mod model_list;
pub mod peers;
pub mod policy;
pub mod push;
pub mod responses;
pub mod scrape;
pub mod state;
pub mod tcp;
pub mod telemetry;

pub use config::HostConfig;
pub use host::Host;
