//! The endpoint picker: Gateway API Inference Extension gateways (GKE, Istio, kgateway, Envoy
//! Gateway, Envoy AI Gateway, NGINX) call it over Envoy's `ext_proc`, as GIE's endpoint-picker
//! protocol specifies. It plans on the host's live state (snapshots, the precise index) with
//! the same `attache_policies` calls as the in-Envoy filter.

pub mod config;
pub mod metrics;
pub mod picker;
pub mod service;
pub mod stream;
pub mod wire;

pub use config::{EppConfig, TlsFiles};
pub use picker::Picker;
