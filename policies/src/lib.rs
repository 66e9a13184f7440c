//! Attaché's scheduling logic, written once.
//!
//! This crate has no I/O, no clock and no proxy-wasm dependency. Time, randomness and pool
//! state come in as arguments, so the same code runs inside the Envoy Wasm filters, in the
//! host service, in the simulator and in the benchmarks, and is unit-tested natively.
//!
//! The vocabulary follows llm-d's router: a request is parsed into [`request::InferenceRequest`]
//! features; a scheduling [`profiles`] entry lists the plugins that run on it: [`filters`] narrow
//! the candidate endpoints, weighted [`scorers`] score them 0..1, and a [`pickers`] entry chooses
//! the primary endpoint plus fallbacks. [`scheduler::Scheduler`] runs the decode profile and,
//! for a disaggregated request, the prefill one. [`plan::plan`] is the one call a host makes per
//! request: request → parse → plan → apply.

pub mod arm;
pub mod calibration;
pub mod canary;
pub mod chat_template;
pub mod config;
pub mod endpoint;
pub mod error;
pub mod explain;
pub mod filters;
pub mod flow;
pub mod index;
pub mod intake;
pub mod messages;
pub mod model_list;
pub mod pickers;
pub mod plan;
pub mod plugin_config;
pub mod precise;
pub mod prefix;
pub mod preselect;
pub mod probe;
pub mod profiles;
pub mod prompt_tokens;
pub mod replay;
pub mod request;
pub mod responses;
pub mod rng;
pub mod scheduler;
pub mod scorers;
pub mod scoring;
pub mod scratch;
pub mod session;
pub mod spare;
pub mod template_json;
pub mod token_prefix;
pub mod tokenizer;

pub use config::SchedulerConfig;
pub use endpoint::{Endpoint, EndpointMetrics, PoolState, Role};
pub use error::{ErrorResponse, RequestError, ScheduleError};
pub use index::ApproxPrefixIndex;
pub use plan::{plan, Plan, PlanConfig, PlanRequest, StateView};
pub use profiles::{pd, SchedulingInput, Scored, ScoredEndpoint};
pub use request::{Api, InferenceRequest, Prompt};
pub use scheduler::{Decision, Scheduler, SchedulerState};
