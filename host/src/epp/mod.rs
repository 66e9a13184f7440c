pub mod config;
pub use config::{EppConfig, TlsFiles};
