//! Attaché's scheduling logic, written once.
//!
//! This crate has no I/O, no clock and no proxy-wasm dependency. Time, randomness and pool
//! state come in as arguments, so the same code runs inside the Envoy Wasm filters, in the
//! host service, in the simulator and in the benchmarks, and is unit-tested natively.
//!
//! The vocabulary follows llm-d's router: a request is parsed into [`request::InferenceRequest`]
//! features, [`filter`]s narrow the candidate endpoints, weighted [`scorer`]s score them 0..1,
//! and a [`picker`] chooses the primary endpoint plus fallbacks. [`scheduler::Scheduler`] wires
//! the pipeline together.

pub mod canary;
pub mod chat_template;
pub mod config;
pub mod endpoint;
pub mod error;
pub mod filter;
pub mod flow;
pub mod index;
pub mod pd;
pub mod picker;
pub mod plugin_config;
pub mod precise;
pub mod prefix;
pub mod prompt_tokens;
pub mod request;
pub mod rng;
pub mod scheduler;
pub mod scorer;
pub mod scoring;
pub mod session;
pub mod tokenizer;

pub use config::SchedulerConfig;
pub use endpoint::{Endpoint, EndpointMetrics, PoolState, Role};
pub use error::{ErrorResponse, RequestError, ScheduleError};
pub use index::ApproxPrefixIndex;
pub use request::{Api, InferenceRequest, Prompt};
pub use scheduler::{Decision, Scheduler, SchedulerState, SchedulingInput};
