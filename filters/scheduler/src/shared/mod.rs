//! Adapters over Envoy's shared data: the state every worker of one Envoy sees. Each module
//! owns its keys and their encoding; nothing here decides anything.

pub mod cold_lru;
pub mod entry_log;
pub mod fleet;
pub mod kv_table;
pub mod sessions;
pub mod snapshot;
