//! The launcher shared by the end-to-end tests, the demo and the benchmarks: find the built
//! binaries, render Envoy configs, start and stop real processes, wait until they are ready.

pub mod client;
pub mod fake_kube;
pub mod load;
pub mod paths;
pub mod stack;

pub use paths::Paths;
pub use stack::{EnvoyKind, SimOpts, Stack};
