//! The plugin configuration (JSON in the Wasm filter's `configuration`), defined in
//! `attache_policies::plugin_config`.

pub use attache_policies::plugin_config::*;
