//! Scheduling policies as signed Wasm modules: signatures and the trust store, and admission
//! (the module runs in wasmtime under a proxy-wasm emulation before it may be rolled out).

pub mod admission;
pub mod signing;
pub mod store;
