//! The Wasm plugins' configuration (JSON in each filter's `configuration`): the scheduler, the
//! snapshot agent, the picker. Here rather than in the filter crate so that everything that
//! writes or checks it (the filter, `attache gateway`, the docs test) reads one definition.

use crate::SchedulerConfig;
use serde::Deserialize;

/// Which job this root context does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The HTTP scheduler filter.
    #[default]
    Scheduler,
    /// The bootstrap singleton that receives the snapshot stream.
    Agent,
    /// The picker after custom scorer filters: combines their scores with the scheduler's and
    /// rewrites the destination header.
    Picker,
    /// Does nothing: the safe default of an empty scorer slot.
    Passthrough,
}

/// Hand-off to custom scorer filters (policies::scoring).
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoringConfig {
    /// Write the scheduling context to filter state for scorer filters and the picker.
    pub context: bool,
    /// Request headers whose value keys the sticky rollout bucket, first present wins.
    /// Requests without any get a bucket from their own seed.
    pub session_headers: Vec<String>,
    /// Picker: add `x-attache-scorers: slot=arm@version,...` to responses.
    pub response_header: bool,
    /// Picker: the share of decisions (0..1) sent to the host's decision log
    /// (policies::replay). 0: none.
    pub decision_log_rate: f64,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        Self {
            context: false,
            session_headers: vec!["x-session-id".into(), "x-attache-session".into()],
            response_header: true,
            decision_log_rate: 0.0,
        }
    }
}

/// Where the snapshot stream comes from.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SubscribeConfig {
    /// Envoy cluster of the host's gRPC server.
    pub cluster: String,
    /// Reopen the stream if no message (snapshot or heartbeat) arrived for this long.
    pub idle_timeout_ms: u64,
    /// Tick period of the root context (reconnects, watchdog).
    pub tick_ms: u64,
}

impl Default for SubscribeConfig {
    fn default() -> Self {
        Self { cluster: "attache_host".into(), idle_timeout_ms: 5_000, tick_ms: 500 }
    }
}

/// Fleet state (the `fleet` section): what this Envoy learns goes to the host, and what the
/// other Envoys learned comes back, on the snapshot stream's `Exchange` form.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// Report and receive fleet state. Off: the stream is the one-way `Subscribe`.
    pub enabled: bool,
    /// How often the subscriber reports what this Envoy learned (its tick period at most).
    pub report_ms: u64,
    /// Entries of each kind remembered to resend when the stream reopens (a restarted host
    /// relearns them).
    pub resync_entries: usize,
    /// Most received prefix-affinity entries waiting to be written for the workers; past it
    /// the oldest are dropped and counted.
    pub apply_backlog: usize,
    /// A Responses continuation whose `previous_response_id` is bound nowhere here waits up to
    /// this long for the host to learn it from the Envoy that served it (read-through). 0 routes
    /// it at once, as a new conversation.
    pub lookup_wait_ms: u64,
    /// Envoy cluster of the host's gRPC server, for the read-through.
    pub lookup_cluster: String,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            report_ms: 20,
            resync_entries: 65_536,
            apply_backlog: 65_536,
            lookup_wait_ms: 150,
            lookup_cluster: "attache_host".into(),
        }
    }
}

/// The whole plugin configuration.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct FilterConfig {
    pub role: Role,
    /// Scheduler pipeline settings (weights, prefix hashing, saturation, body limit).
    pub scheduler: SchedulerConfig,
    /// Open the snapshot stream from this root context. Always on for `agent`; for
    /// `scheduler` it selects per-worker mode.
    pub subscribe: Option<SubscribeConfig>,
    /// Custom scorers and rollout.
    pub scoring: ScoringConfig,
    /// Flow control: request classes and shedding (policies::flow).
    pub flow: crate::flow::FlowConfig,
    /// Session and Responses API affinity (policies::session).
    pub sessions: crate::session::SessionConfig,
    /// Fleet state shared with the other Envoys through the host.
    pub fleet: FleetConfig,
    /// Responses API state: kept by the gateway (default), by the engines, or not at all
    /// (policies::responses).
    pub responses: crate::responses::ResponsesConfig,
    /// Time each stage of the body callback and add it to Envoy counters
    /// (`attache.stage.<stage>.ns`, `attache.stage.decisions`). Off by default: each clock
    /// reading is a host call, about 0.35 µs, that every decision pays while it is on.
    pub stage_timings: bool,
    /// Explanations of decisions for an admin-authorized debug header (off without a token).
    pub debug: crate::explain::DebugConfig,
    /// The scheduler's rollout arm, when the chain holds a canary scheduler too
    /// (policies::arm). Absent: it acts on every request.
    pub rollout: Option<crate::arm::ArmConfig>,
}

impl FilterConfig {
    /// Parse the configuration; an empty configuration means all defaults.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        if bytes.iter().all(|b| b.is_ascii_whitespace()) {
            return Ok(Self::default());
        }
        let c: Self = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        c.check_memory()?;
        let share = c.scheduler.prefix.cache_share;
        if !(0.0..=1.0).contains(&share) {
            return Err(format!("scheduler.prefix.cache_share {share} is outside 0..=1"));
        }
        crate::Scheduler::new(c.scheduler.clone()).map_err(|e| e.to_string())?;
        let rate = c.scoring.decision_log_rate;
        if !(0.0..=1.0).contains(&rate) {
            return Err(format!("scoring.decision_log_rate {rate} is outside 0..=1"));
        }
        c.debug.check()?;
        if let Some(arm) = &c.rollout {
            arm.check()?;
        }
        Ok(c)
    }

    /// The tables allocated once per worker must fit the VM: Envoy caps a Wasm VM's memory
    /// at 1 GiB, and a VM that cannot allocate them traps at start.
    fn check_memory(&self) -> Result<(), String> {
        let p = &self.scheduler.prefix;
        if p.index_capacity > MAX_INDEX_CAPACITY {
            return Err(format!(
                "scheduler.prefix.index_capacity {} exceeds {MAX_INDEX_CAPACITY} (64 bytes a block, allocated in every worker)",
                p.index_capacity
            ));
        }
        if p.shared_slots > MAX_SHARED_SLOTS {
            return Err(format!(
                "scheduler.prefix.shared_slots {} exceeds {MAX_SHARED_SLOTS} (16 bytes a slot, allocated in every worker)",
                p.shared_slots
            ));
        }
        Ok(())
    }
}

/// Most blocks the approximate index may hold: 128 MB of the VM.
pub const MAX_INDEX_CAPACITY: usize = 2_000_000;
/// Most entries of the cross-worker affinity table: 64 MB of the VM.
pub const MAX_SHARED_SLOTS: u64 = 4 * 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_too_large_for_the_vm_are_refused_with_the_field_named() {
        let e = FilterConfig::parse(br#"{"scheduler":{"prefix":{"index_capacity":10000000000}}}"#).unwrap_err();
        assert!(e.contains("index_capacity 10000000000 exceeds 2000000"), "{e}");
        let e = FilterConfig::parse(br#"{"scheduler":{"prefix":{"shared_slots":99999999}}}"#).unwrap_err();
        assert!(e.contains("shared_slots 99999999 exceeds"), "{e}");
        assert!(FilterConfig::parse(br#"{"scheduler":{"prefix":{"index_capacity":2000000}}}"#).is_ok());
        let e = FilterConfig::parse(br#"{"scheduler":{"prefix":{"cache_share":1.5}}}"#).unwrap_err();
        assert!(e.contains("cache_share 1.5 is outside 0..=1"), "{e}");
    }

    /// `docs/configuration.md` shows exactly the code's defaults.
    #[test]
    fn configuration_doc_shows_the_defaults() {
        let json = serde_json::to_string_pretty(&FilterConfig::default()).unwrap();
        attache_fixtures::check_generated_block("docs/configuration.md", "scheduler-filter-defaults", "json", &json)
            .unwrap();
    }

    #[test]
    fn parses_defaults_and_rejects_typos() {
        assert_eq!(FilterConfig::parse(b"").unwrap(), FilterConfig::default());
        let c = FilterConfig::parse(br#"{"role":"agent","subscribe":{"cluster":"h"}}"#).unwrap();
        assert_eq!(c.role, Role::Agent);
        assert_eq!(c.subscribe.unwrap().cluster, "h");
        let c = FilterConfig::parse(br#"{"scheduler":{"max_body_bytes":10}}"#).unwrap();
        assert_eq!(c.scheduler.max_body_bytes, 10);
        let profile = br#"{"scheduler":{"profiles":{"decode":{"plugins":[
            {"type":"decode-filter"},{"type":"queue-scorer","weight":4},{"type":"max-score-picker"}]}}}}"#;
        let c = FilterConfig::parse(profile).unwrap();
        assert_eq!(c.scheduler.profiles.decode.plugins[1].weight, Some(4.0));
        assert_eq!(
            c.scheduler.profiles.prefill,
            crate::profiles::ProfilesConfig::default().prefill,
            "the other profile keeps its default"
        );
        let e = FilterConfig::parse(br#"{"scheduler":{"profiles":{"decode":{"plugins":[{"type":"queue-scorer"}]}}}}"#);
        assert!(e.unwrap_err().contains("profile `decode`: needs exactly one picker"));
        assert!(FilterConfig::parse(br#"{"rol":"agent"}"#).is_err());
        assert!(FilterConfig::parse(b"{").is_err());
    }
}
