//! Scheduling policies as signed Wasm modules: signatures and the trust store, and admission
//! (the module runs in wasmtime under a proxy-wasm emulation before it may be rolled out), the
//! module store, rollout state, the ECDS server that delivers modules to Envoy (and learns which
//! Envoys there are), the admin API, the controller that promotes or rolls back canaries and gates them on a shadow
//! run, and the decision log with its replay.

pub mod admission;
pub mod api;
pub mod controller;
pub mod decisions;
pub mod ecds;
pub mod envoys;
pub mod kube_state;
pub mod replay;
pub mod rollout;
pub mod service;
pub mod signing;
pub mod store;
