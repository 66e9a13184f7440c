//! One Envoy worker's scheduler state, shared by its HTTP contexts: the configuration, what the
//! worker learned from its own decisions, its in-flight load, its flow-control queue, metrics.

use attache_policies::index::AffinityTable;
use attache_policies::plan::Plan;
use attache_policies::prompt_tokens::PromptTokenizer;
use attache_policies::{Scheduler, SchedulerState};
use hashbrown::HashMap;
use proxy_wasm::types::LogLevel;

use crate::config::FilterConfig;
use crate::flow_state::FlowState;
use crate::hostcalls as host;
use crate::metrics::Metrics;
use crate::shared::cold_lru::SharedColdLru;
use crate::shared::entry_log::{self, Entry, EntryLog, PENDING_MAX};
use crate::shared::snapshot::{self, SnapshotCache};

/// State shared by one worker's HTTP contexts.
pub struct Worker {
    /// Shared so per-request code can hold it while borrowing the worker mutably.
    pub config: std::rc::Rc<FilterConfig>,
    pub scheduler: Scheduler,
    pub state: SchedulerState,
    pub cache: SnapshotCache,
    /// Requests this worker has dispatched and not yet finished, per endpoint.
    pub inflight: HashMap<String, u32>,
    /// Uncached prompt tokens of those requests per endpoint (the affinity filter's TTFT gate).
    pub inflight_tokens: HashMap<String, u64>,
    pub metrics: Metrics,
    /// The model's tokenizer and chat template, for precise routing of text and chat prompts
    /// (None if not configured or if it failed its start-up check).
    pub tokenizer: Option<PromptTokenizer>,
    /// Flow control: this worker's queue, saturation gate and fairness board.
    pub flow: FlowState,
    /// What this worker knows of every worker's decisions (its own at once, the others' from
    /// the affinity log at each tick), probed on the request path without a host call.
    pub affinity: AffinityTable,
    /// This worker's side of the affinity log in shared data ([`crate::shared::entry_log`]).
    pub affinity_log: EntryLog,
    /// This worker's side of the no-hit LRU every worker shares, synced from the tick.
    pub cold_lru: SharedColdLru,
    /// This worker's decisions not yet appended to its log: `(block hash, endpoint)`, written
    /// from the tick, off the request path.
    pub affinity_pending: Vec<(u64, String)>,
    /// Session and Responses-id bindings this worker made since its last tick, for the fleet:
    /// `(sticky key, expiry ms, endpoint)`.
    pub bindings_pending: Vec<Entry>,
    /// This worker's side of the binding log, which the agent reports to the host.
    pub bindings_log: EntryLog,
    /// This Envoy's fleet id, once a binding was shared.
    pub envoy: Option<String>,
    /// When the host was last heard from, as of this worker's last tick (see [`Worker::housekeep`]).
    pub heard_ms: Option<u64>,
    /// The conversations of the Responses this worker captured last (gateway mode).
    pub conversations: attache_policies::responses::ConversationCache,
    /// The worker's root context, which makes the calls that must outlive a request.
    pub root_context: u32,
}

/// The scheduler's tick period when neither flow control nor the affinity table asks for a
/// shorter one: it records histogram samples and re-reads the host's heartbeat and the log level.
pub const HOUSEKEEPING_TICK_MS: u64 = 100;

impl Worker {
    /// Milliseconds since the host was last heard from (0 if it never was). Reads the heartbeat
    /// from the tick's copy, off the request path; only when that copy says the host has been
    /// silent longer than `stale_after_ms` is the shared heartbeat read again, so a host heard
    /// since the last tick never gets a load-only decision.
    pub fn host_silent_ms(&mut self, now_ms: u64, stale_after_ms: u64) -> u64 {
        let silent = |heard: Option<u64>| heard.map_or(0, |h| now_ms.saturating_sub(h));
        if self.heard_ms.is_none() || silent(self.heard_ms) > stale_after_ms {
            if let Some(h) = snapshot::heard_ms() {
                self.heard_ms = Some(h);
            }
        }
        silent(self.heard_ms)
    }

    /// The tick's bookkeeping, kept off the request path: histogram samples, stage timings, the
    /// host's heartbeat and its silence gauge, Envoy's log level.
    pub fn housekeep(&mut self, now_ms: u64) {
        self.metrics.flush_samples();
        crate::stages::flush();
        if let Some(t) = &self.tokenizer {
            self.metrics.prefix_store(t.prefix_store_stats());
        }
        if let Some(h) = snapshot::heard_ms() {
            self.heard_ms = Some(h);
            self.metrics.host_silence(now_ms.saturating_sub(h));
        }
        host::refresh_log_level();
    }

    /// Append this worker's pending decisions to its affinity log, and learn the other
    /// workers' new ones from theirs. Returns the decisions written.
    pub fn flush_affinity(&mut self, now_ms: u64) -> Vec<(u64, String)> {
        if self.affinity.capacity() == 0 {
            return Vec::new();
        }
        let batch = std::mem::take(&mut self.affinity_pending);
        if !batch.is_empty() {
            let entries: Vec<Entry> = batch.iter().map(|(k, e)| (*k, now_ms, e.clone())).collect();
            self.affinity_log.write(&entries);
        }
        let pool = &self.cache.pool;
        let written = |a: &str| pool.by_address(a).and_then(|e| e.kv_written);
        let learned = self.affinity_log.read_into(&mut self.affinity, written);
        self.metrics.affinity_learned(learned);
        batch
    }

    /// Share the no-hit LRU with the other workers (from the tick), counting a corrupt table.
    pub fn share_cold_lru(&mut self) {
        let shared = self.cold_lru.share(&mut self.state.no_hit_lru);
        if shared.corrupt {
            self.metrics.shared_table_corrupt();
        }
    }

    /// A session or Responses-id binding was made: keep it for the fleet (reported from the
    /// tick). Past [`PENDING_MAX`] waiting, it is dropped and counted. A `new` binding (a key
    /// not bound here before, or bound elsewhere) is also sent to the host at once: the next
    /// turn may reach another replica before the next report.
    pub fn bound(&mut self, key: u64, endpoint: &str, expires_ms: u64, new: bool) {
        if !self.config.fleet.enabled {
            return;
        }
        if new {
            let envoy = self.envoy.get_or_insert_with(crate::shared::fleet::envoy_id);
            let shared = crate::lookup::share(&self.config.fleet, envoy, key, endpoint, expires_ms);
            self.metrics.fleet_shared(shared);
        }
        if self.bindings_pending.len() >= PENDING_MAX {
            self.metrics.fleet_dropped(1);
            return;
        }
        self.bindings_pending.push((key, expires_ms, endpoint.to_owned()));
    }

    /// Take the bindings made since the last tick, appending them to the binding log for the
    /// agent when `for_agent` (a worker that reports itself does not need the log).
    pub fn flush_bindings(&mut self, for_agent: bool) -> Vec<Entry> {
        let batch = std::mem::take(&mut self.bindings_pending);
        if for_agent && !batch.is_empty() {
            self.bindings_log.write(&batch);
        }
        batch
    }
}

impl Worker {
    /// The worker for a checked configuration. `Err`: its profiles do not resolve (the root
    /// refuses the configuration).
    pub fn new(config: FilterConfig) -> Result<Self, String> {
        let scheduler = Scheduler::new(config.scheduler.clone()).map_err(|e| e.to_string())?;
        let mut metrics = Metrics::define(scheduler.decode_profile());
        let tokenizer = load_tokenizer(&config, &mut metrics);
        Ok(Self {
            tokenizer,
            flow: FlowState::new(config.flow.enabled),
            affinity: AffinityTable::new(config.scheduler.prefix.shared_slots),
            affinity_log: EntryLog::new(entry_log::AFFINITY),
            affinity_pending: Vec::new(),
            cold_lru: SharedColdLru::default(),
            bindings_pending: Vec::new(),
            bindings_log: EntryLog::new(entry_log::BINDINGS),
            envoy: None,
            heard_ms: None,
            conversations: attache_policies::responses::ConversationCache::new(config.responses.cache_bytes),
            root_context: 0,
            state: SchedulerState::new(&config.scheduler),
            scheduler,
            cache: SnapshotCache::default(),
            inflight: HashMap::new(),
            inflight_tokens: HashMap::new(),
            metrics,
            config: std::rc::Rc::new(config),
        })
    }

    /// Count a planned request against its endpoint until it ends.
    pub fn dispatched(&mut self, plan: &Plan) {
        let d = &plan.dispatch;
        *self.inflight.entry_ref(d.endpoint.as_str()).or_insert(0) += 1;
        *self.inflight_tokens.entry_ref(d.endpoint.as_str()).or_insert(0) += d.uncached_tokens;
    }

    /// The engine at `endpoint` prefilled a request's `tokens` uncached prompt tokens: they no
    /// longer queue ahead of the next request's (the affinity gate's TTFT estimate).
    pub fn prefilled(&mut self, endpoint: &str, tokens: u64) {
        if let Some(t) = self.inflight_tokens.get_mut(endpoint) {
            *t = t.saturating_sub(tokens);
        }
    }

    /// A request to `endpoint` with `tokens` uncached prompt tokens ended. An endpoint with
    /// nothing left in flight leaves the tables: they hold what is in flight now, not every
    /// endpoint ever used, so a decision's lookups stay in a small table (none at all while the
    /// worker has nothing in flight).
    pub fn released(&mut self, endpoint: &str, tokens: u64) {
        if let Some(n) = self.inflight.get_mut(endpoint) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.inflight.remove(endpoint);
                self.inflight_tokens.remove(endpoint);
                return;
            }
        }
        self.prefilled(endpoint, tokens);
    }
}

/// The model's tokenizer and chat template for precise routing, if configured and if they give
/// the engine's ids on the configured checks; otherwise none, logged and counted.
fn load_tokenizer(config: &FilterConfig, metrics: &mut Metrics) -> Option<PromptTokenizer> {
    PromptTokenizer::for_routing(&config.scheduler.precise).unwrap_or_else(|why| {
        host::log(LogLevel::Error, &format!("attache: {why}; text and chat prompts will not be routed precisely"));
        metrics.tokenizer_mismatch();
        None
    })
}

#[cfg(test)]
mod tests {
    use crate::shared::snapshot::heard;
    use crate::testing::harness::{prompt, publish, snapshot, Filter, Request};
    use crate::testing::{advance_ms, metric, now_ms};

    #[test]
    fn a_silent_host_makes_decisions_load_only_until_it_is_heard_again() {
        publish(&snapshot(2));
        heard(now_ms());
        let mut f = Filter::configure("");
        f.send(Request::completion(&prompt("one")));
        assert_eq!(metric("attache.host.load_only_decisions"), Some(0));
        advance_ms(5_000);
        f.send(Request::completion(&prompt("two")));
        assert_eq!(metric("attache.host.load_only_decisions"), Some(1), "silent past host_stale_ms (3 s)");
        f.tick();
        assert_eq!(metric("attache.host.silent_ms"), Some(5_000));
        // Heard since the last tick: the request reads the heartbeat again.
        heard(now_ms());
        f.send(Request::completion(&prompt("three")));
        assert_eq!(metric("attache.host.load_only_decisions"), Some(1));
    }

    #[test]
    fn a_worker_learns_where_the_other_workers_sent_a_prefix() {
        publish(&snapshot(3));
        let mut one = Filter::configure("");
        let (mut two, ok) = Filter::try_configure_as(2, "");
        assert!(ok);
        let prompts: Vec<String> =
            (0..6).map(|i| format!("{i} {}", "a long shared system prompt ".repeat(40))).collect();
        let firsts: Vec<_> = prompts.iter().map(|p| one.send(Request::completion(&prompt(p))).primary()).collect();
        assert!(firsts.iter().all(Option::is_some));
        one.tick();
        two.tick();
        assert!(metric("attache.affinity.learned").unwrap_or(0) > 0, "worker two read worker one's log");
        let seconds: Vec<_> = prompts.iter().map(|p| two.send(Request::completion(&prompt(p))).primary()).collect();
        assert_eq!(seconds, firsts);
        two.tick();
        let matched = metric("attache.prefix.blocks_matched");
        assert!(matched > Some(0), "{matched:?}: worker two's decisions found the prefixes worker one routed");
    }

    /// Precise routing with the reference model's tokenizer and template: a conversation's
    /// later turns resume from the worker's tokenization prefix store, and its counters say so.
    #[test]
    fn a_growing_conversation_resumes_from_the_tokenization_prefix_store() {
        let model = |f: &str| attache_fixtures::read_vllm(&format!("model/{f}")).expect("reference model");
        let config = serde_json::json!({"scheduler": {"precise": {
            "enabled": true, "max_tokens": 0, "tokenizer_json": model("tokenizer.json"),
            "chat_template": model("chat_template.jinja"), "bos_token": "<s>", "eos_token": "</s>"}}});
        publish(&snapshot(2));
        let mut f = Filter::configure(&config.to_string());
        let mut messages = Vec::new();
        for turn in 0..5 {
            let said = format!("turn {turn}: {}", "the agent read the file and ran the tests again. ".repeat(120));
            messages.push(serde_json::json!({"role": "user", "content": said}));
            let body = serde_json::json!({"model": crate::testing::harness::MODEL, "messages": messages}).to_string();
            f.send(Request::post("/v1/chat/completions", &body)).primary().expect("routed");
            messages.push(serde_json::json!({"role": "assistant", "content": "done"}));
        }
        f.tick();
        assert_eq!(metric("attache.precise.prompt_untokenized"), Some(0));
        assert_eq!(metric("attache.precise.prefix_store.misses"), Some(1), "the first turn");
        assert_eq!(metric("attache.precise.prefix_store.hits"), Some(4), "every later turn");
        let skipped = metric("attache.precise.prefix_store.bytes_skipped").unwrap_or(0);
        assert!(skipped > 4 * 4096, "each later turn skipped at least a chunk: {skipped}");
        assert!(metric("attache.precise.prefix_store.bytes") > Some(0));
    }

    #[test]
    fn workers_share_the_no_hit_lru_so_new_prefixes_spread_over_the_pool() {
        publish(&snapshot(4));
        let mut one = Filter::configure("");
        let (mut two, ok) = Filter::try_configure_as(2, "");
        assert!(ok);
        let prompts: Vec<String> = (0..4).map(|i| format!("{i} {}", "a distinct system prompt ".repeat(40))).collect();
        // Workers take turns with new prefixes; between requests, the sender's tick shares
        // its decision, then the other's adopts it.
        let mut primaries = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let (sender, other) = if i % 2 == 0 { (&mut one, &mut two) } else { (&mut two, &mut one) };
            primaries.push(sender.send(Request::completion(&prompt(p))).primary().expect("routed"));
            sender.tick();
            other.tick();
        }
        primaries.sort_unstable();
        primaries.dedup();
        assert_eq!(primaries.len(), 4, "each new prefix went to its own endpoint: {primaries:?}");
        // A table another writer corrupted is replaced at the next tick, and counted.
        crate::testing::with(|h| h.shared.insert(crate::shared::cold_lru::KEY.into(), (vec![1, 2, 3], 99)));
        one.tick();
        assert_eq!(metric("attache.shared.corrupt_tables"), Some(1));
        let table = crate::testing::with(|h| h.shared.get(crate::shared::cold_lru::KEY).cloned());
        let table = table.expect("rewritten").0;
        assert!(attache_policies::scorers::no_hit_lru::LastCold::decode(&table).is_some());
    }
}
