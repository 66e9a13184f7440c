//! Scheduling policies as signed Wasm modules: signatures and the trust store.

pub mod signing;
