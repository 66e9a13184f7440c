//! The launcher shared by the end-to-end tests, the demo and the benchmarks: find the built
//! binaries, render Envoy configs, start and stop real processes, wait until they are ready.
//!
//! - [`stack`]: a deployment (engines, host, Envoy) and its parts;
//! - [`process`]: child processes with log files, and polling until something holds;
//! - [`ports`]: free loopback ports;
//! - [`stats`]: numbers out of Envoy's `/stats` and Prometheus text;
//! - [`admin_http`]: a blocking GET for admin endpoints;
//! - [`client`] and [`load`]: OpenAI-style requests and load generators;
//! - [`fake_kube`]: a stand-in Kubernetes API server;
//! - [`helm`]: the Helm chart rendered by the real helm;
//! - [`controllers`]: the Envoy configuration istiod or Envoy Gateway would send for it;
//! - [`paths`]: where the built binaries are.

// A harness: its scenarios read top to bottom (workspace lint `too_many_lines`).
#![allow(clippy::too_many_lines)]

pub mod admin_http;
pub mod async_worker;
pub mod client;
pub mod controllers;
pub mod fake_kube;
pub mod helm;
pub mod load;
pub mod paths;
pub mod ports;
pub mod process;
pub mod redis;
pub mod stack;
pub mod stats;

pub use paths::Paths;
pub use stack::{CheapOpts, EnvoyKind, EppEnvoy, EppEnvoyOpts, Replica, SimOpts, Stack};
