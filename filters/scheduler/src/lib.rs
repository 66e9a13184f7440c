//! The Attaché scheduler as a proxy-wasm module.
//!
//! One module, two roles chosen by the plugin configuration's `role`:
//! - `scheduler` (HTTP filter): buffers the body, parses it, runs the policies pipeline on the
//!   newest snapshot and sets `x-gateway-destination-endpoint` (primary plus fallbacks).
//! - `agent` (bootstrap singleton): holds the gRPC stream to the host and writes each snapshot
//!   into shared data for every worker. A scheduler can also subscribe itself (per-worker mode,
//!   for Istio's WasmPlugin, which cannot add a singleton).
//! - `picker` (HTTP filter, after custom scorer filters): combines their scores with the
//!   scheduler's and rewrites the destination header (policies::scoring).
//! - `passthrough` (HTTP filter): does nothing; the safe default of an empty scorer slot.
//!
//! The scheduling itself is `attache_policies::plan`: this crate parses, plans and applies.
//! Its modules import one way: the role roots ([`root`], [`http`], [`picker`], [`agent`]), the
//! request path ([`queue`], [`dispatch`]), worker state ([`worker`], [`flow_state`]), request
//! state ([`request`]), then the adapters over the host ([`shared`], [`metrics`],
//! [`hostcalls`]).
//!
//! Nothing here may panic: a panic is a Wasm trap that kills the worker's VM. Every host call
//! goes through the fallible wrappers in [`hostcalls`].

pub mod agent;
pub mod config;
pub mod decision_log;
pub mod dispatch;
pub mod fleet;
pub mod flow_state;
pub mod hostcalls;
pub mod http;
pub mod lookup;
pub mod metrics;
pub mod picker;
pub mod queue;
pub mod request;
pub mod responses;
pub mod root;
pub mod shared;
pub mod stages;
#[cfg(test)]
mod testing;
pub mod worker;

#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::AttacheRoot::new(context_id))
    });
}}
