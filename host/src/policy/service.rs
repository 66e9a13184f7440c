//! The policy service: uploads (verify, admit, store), rollout operations, publishing to ECDS,
//! and the controller that promotes or rolls back canaries from Envoy's stats.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::watch;
use tracing::{info, warn};

use attache_policies::arm::SCHEDULER_SLOT;
use attache_policies::canary::{self, ArmCounters, AutoPolicy, ShadowReport, Verdict};

use super::admission::{self, AdmissionConfig};
use super::controller::{self as ctl, Controller, Counters, PerEnvoy, Reading};
use super::decisions::DecisionLog;
use super::ecds::{self, Acks, Published};
use super::envoys::Envoys;
use super::kube_state::{KubeState, PolicyKubernetes, WriteError};
use super::rollout::{self, Deployed, RolloutError, RolloutFiles, RolloutState, Transition};
use super::signing::TrustStore;
use super::store::{ModuleRecord, ModuleStore, UploadError};

/// `policy:` in the host configuration.
#[derive(Debug, Clone, serde::Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// Module store, rollout state and transition log.
    pub store_dir: PathBuf,
    /// Trusted public keys: one `.pub` file or a directory of them.
    pub trust: PathBuf,
    /// File holding the admin API bearer token (else `ATTACHE_ADMIN_TOKEN`).
    #[serde(default)]
    pub admin_token_file: Option<PathBuf>,
    /// Envoy base URLs whose `/stats` the controller reads (`http://127.0.0.1:9901`). Empty:
    /// every Envoy subscribed to this host's ECDS that advertises `attache.stats_port` in its
    /// node metadata (`policy::envoys`), so gateway pods need not be listed.
    #[serde(default)]
    pub envoy_admin: Vec<String>,
    /// With `envoy_admin` empty, read only subscribed Envoys whose `node.cluster` is this (the
    /// chart: its gateway's name); unset, any that advertises a stats port.
    #[serde(default)]
    pub envoy_cluster: Option<String>,
    #[serde(default)]
    pub auto: AutoPolicy,
    /// Wall-clock budget per admission sample, ms: a module still running at it is stopped.
    #[serde(default = "default_budget")]
    pub admission_budget_ms: u64,
    /// The most memory a module may grow to at admission, MiB.
    #[serde(default = "default_memory_mb")]
    pub admission_memory_mb: usize,
    /// Distinct modules the store keeps (uploads of a new module past this are refused with
    /// 507 `store_full`; uploading a module already stored always works).
    #[serde(default = "default_max_modules")]
    pub max_modules: usize,
    /// Keep the module store, rollout state and transitions in the Kubernetes API (ConfigMaps)
    /// and elect the rollout controller with a Lease, so that two or more host replicas share
    /// them (`policy::kube_state`). `store_dir` is then a local cache.
    #[serde(default)]
    pub kubernetes: Option<PolicyKubernetes>,
    /// The decision log's bound, MiB (`<store_dir>/decisions.log` and the file before it); 0:
    /// decisions the pickers send are not kept. What share they send is the scheduler
    /// configuration's `scoring.decision_log_rate`.
    #[serde(default = "default_decision_log_mb")]
    pub decision_log_mb: u64,
}

fn default_decision_log_mb() -> u64 {
    16
}

/// Recorded decisions a scorer is admitted on, the newest in the log.
const ADMISSION_RECORDED_SAMPLES: usize = 32;

fn default_max_modules() -> usize {
    super::store::DEFAULT_MAX_MODULES
}

fn default_budget() -> u64 {
    50
}

fn default_memory_mb() -> usize {
    admission::DEFAULT_MEMORY_LIMIT_BYTES >> 20
}

/// Parse Envoy `/stats` text lines `wasmcustom.attache.rollout.<slot>.<arm>.<what>: N`.
pub fn parse_rollout_stats(text: &str, into: &mut Counters) {
    for line in text.lines() {
        let Some((name, value)) = line.split_once(": ") else {
            continue;
        };
        let Some(rest) = name.strip_prefix("wasmcustom.attache.rollout.") else {
            continue;
        };
        let mut parts = rest.rsplitn(3, '.');
        let (Some(what), Some(arm), Some(slot)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let Ok(v) = value.trim().parse::<u64>() else {
            continue;
        };
        let c = into.entry((slot.to_owned(), arm.to_owned())).or_default();
        match what {
            "requests" => c.requests += v,
            "errors" => c.errors += v,
            "traps" => c.traps += v,
            "ttfb_us" => c.ttfb_us += v,
            "hit_permille" => c.hit_permille += v,
            "agree" => c.agree += v,
            "load_milli" => c.load_milli += v,
            _ => {}
        }
    }
}

/// Envoy's `server.uptime` (seconds) from `/stats` text.
pub fn parse_uptime(text: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix("server.uptime: ")).and_then(|v| v.trim().parse().ok())
}

/// A failed API operation: HTTP status, machine code, message.
#[derive(Debug)]
pub struct ApiError {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    fn new(status: u16, code: &'static str, message: impl ToString) -> Self {
        Self { status, code, message: message.to_string() }
    }
}

impl From<UploadError> for ApiError {
    fn from(e: UploadError) -> Self {
        use super::signing::SignatureError as S;
        let code = match &e {
            UploadError::Signature(S::Unsigned) => "unsigned",
            UploadError::Signature(S::Tampered { .. }) => "tampered",
            UploadError::Signature(S::UntrustedKey { .. }) => "untrusted_key",
            UploadError::Signature(S::Malformed(_)) => "malformed_module",
            UploadError::Admission(_) => "admission_refused",
            UploadError::InvalidName(_) => "bad_request",
            UploadError::Io(_) => "store_error",
            UploadError::StoreFull { .. } => "store_full",
        };
        let status = match code {
            "bad_request" => 400,
            "store_full" => 507,
            "store_error" => 500,
            _ => 422,
        };
        ApiError::new(status, code, e)
    }
}

impl From<RolloutError> for ApiError {
    fn from(e: RolloutError) -> Self {
        let (status, code) = match &e {
            RolloutError::NoCanary(..) | RolloutError::NothingToRollBack(_) => (409, "conflict"),
            RolloutError::CanaryInFlight(..) => (409, "conflict"),
            _ => (400, "bad_request"),
        };
        ApiError::new(status, code, e)
    }
}

pub struct PolicyService {
    pub cfg: PolicyConfig,
    /// The shared state in the Kubernetes API, when configured.
    kube: Option<KubeState>,
    /// The shared state's transitions and version, as last read or written (Kubernetes mode).
    shared: Mutex<(Vec<Transition>, Option<String>)>,
    store: ModuleStore,
    trust: TrustStore,
    files: RolloutFiles,
    state: Mutex<RolloutState>,
    published: watch::Sender<Arc<Published>>,
    pub acks: Arc<Acks>,
    /// The Envoys subscribed to ECDS (where the controller finds them when `envoy_admin` is
    /// empty).
    pub envoys: Arc<Envoys>,
    token: crate::admin_auth::BearerToken,
    /// Each canary's starting counters and the last verdicts.
    controller: Mutex<Controller>,
    http: reqwest::Client,
    /// Sampled decisions the pickers sent (`Share`), for replay and admission.
    pub decisions: Arc<DecisionLog>,
}

impl PolicyService {
    /// Open the store and the rollout state; with `policy.kubernetes`, connect to the shared
    /// state as `identity` and take it (the first replica there seeds it with its own).
    pub async fn open(cfg: PolicyConfig, identity: &str) -> anyhow::Result<Arc<Self>> {
        use anyhow::Context;
        let token = crate::admin_auth::BearerToken::load(cfg.admin_token_file.as_deref())
            .context("the policy API's bearer token")?
            .context("the policy API needs a bearer token of at least 16 characters (admin_token_file or ATTACHE_ADMIN_TOKEN)")?;
        let trust = TrustStore::load(&cfg.trust)?;
        let store = ModuleStore::open(&cfg.store_dir)
            .with_context(|| format!("opening {}", cfg.store_dir.display()))?
            .with_max_modules(cfg.max_modules);
        let files = RolloutFiles::new(&cfg.store_dir);
        let state = files.load().context("loading the rollout state")?;
        let kube = match &cfg.kubernetes {
            Some(k) => Some(KubeState::connect(k.clone(), identity.to_owned()).await?),
            None => None,
        };
        let (published, _) = watch::channel(Arc::new(Published::default()));
        let svc = Arc::new(Self {
            kube,
            shared: Mutex::new((Vec::new(), None)),
            store,
            trust,
            files,
            state: Mutex::new(state),
            published,
            acks: Arc::new(Acks::default()),
            envoys: Arc::default(),
            token,
            controller: Mutex::new(Controller::default()),
            http: reqwest::Client::builder().timeout(Duration::from_secs(2)).build()?,
            decisions: Arc::new(DecisionLog::open(&cfg.store_dir, cfg.decision_log_mb.saturating_mul(1 << 20))),
            cfg,
        });
        if svc.kube.is_some() {
            svc.import_modules().await.context("importing the shared policy modules")?;
            let first = svc.sync().await.context("reading the shared policy state")?;
            if !first {
                info!("no shared policy state yet; seeding it from this replica's");
                let (state, transitions) =
                    (svc.lock().clone(), svc.files.transitions(super::kube_state::KEEP_TRANSITIONS));
                if let Some(k) = &svc.kube {
                    match k.write(&state, &transitions, None).await {
                        Ok(v) => *svc.shared() = (transitions, Some(v)),
                        // Another replica seeded it first: take theirs.
                        Err(WriteError::Conflict) => {
                            svc.sync().await?;
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
        svc.publish()?;
        Ok(svc)
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, (Vec<Transition>, Option<String>)> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Import every shared module version this replica's store lacks (signatures checked).
    async fn import_modules(&self) -> anyhow::Result<usize> {
        let Some(k) = &self.kube else { return Ok(0) };
        let have = self.store.history(None)?;
        let mut n = 0;
        for (record, bytes) in k.modules().await? {
            if have.iter().any(|h| h.sha256 == record.sha256 && h.version == record.version && h.slot == record.slot) {
                continue;
            }
            match self.store.import(&self.trust, &record, &bytes) {
                Ok(()) => n += 1,
                Err(e) => warn!(slot = %record.slot, version = %record.version, error = %e, "shared module refused"),
            }
        }
        if n > 0 {
            info!(modules = n, "imported shared policy modules");
        }
        Ok(n)
    }

    /// Read the shared state; when it moved, take it (importing any module it deploys that
    /// this replica lacks) and republish ECDS. Returns whether a shared state exists. Without
    /// `policy.kubernetes`, does nothing.
    async fn sync(&self) -> anyhow::Result<bool> {
        let Some(k) = &self.kube else { return Ok(false) };
        let shared = k.read().await?;
        if shared.version.is_none() {
            return Ok(false);
        }
        if shared.version == self.shared().1 {
            return Ok(true);
        }
        let missing = shared.state.filters().iter().any(|f| !self.store.module_path(&f.deployed.sha256).exists());
        if missing {
            self.import_modules().await?;
        }
        if let Err(e) = self.files.mirror(&shared.state, &shared.transitions) {
            warn!(error = %e, "could not mirror the shared policy state to the local store");
        }
        let changed = {
            let mut st = self.lock();
            let changed = st.revision != shared.state.revision || st.slots != shared.state.slots;
            *st = shared.state;
            changed
        };
        *self.shared() = (shared.transitions, shared.version);
        if changed {
            info!("took the shared policy state");
            self.publish()?;
        }
        Ok(true)
    }

    /// Apply `op` to the rollout state: on this replica's files, or on the shared state (read
    /// at once, written back only if nobody wrote in between: else 409 `conflict`).
    async fn change(
        &self,
        op: impl FnOnce(&mut RolloutState) -> Result<Transition, RolloutError>,
    ) -> Result<Transition, ApiError> {
        let Some(k) = &self.kube else {
            let t = op(&mut self.lock())?;
            self.record(&t);
            return Ok(t);
        };
        let unavailable = |e: String| ApiError::new(503, "state_unavailable", e);
        self.sync().await.map_err(|e| unavailable(format!("{e:#}")))?;
        let (next, mut t) = {
            let mut next = self.lock().clone();
            let t = op(&mut next)?;
            (next, t)
        };
        t.host = Some(k.identity().to_owned());
        let (mut transitions, version) = self.shared().clone();
        transitions.push(t.clone());
        match k.write(&next, &transitions, version.as_deref()).await {
            Ok(v) => {
                if let Err(e) = self.files.mirror(&next, &transitions) {
                    warn!(error = %e, "could not mirror the shared policy state to the local store");
                }
                *self.lock() = next;
                *self.shared() = (transitions, Some(v));
                self.announce(&t);
                Ok(t)
            }
            Err(WriteError::Conflict) => {
                let _ = self.sync().await;
                Err(ApiError::new(409, "conflict", WriteError::Conflict))
            }
            Err(e) => Err(unavailable(e.to_string())),
        }
    }

    /// Store an uploaded module version where every replica finds it (Kubernetes mode).
    pub async fn share_module(&self, record: &ModuleRecord) -> Result<(), ApiError> {
        let Some(k) = &self.kube else { return Ok(()) };
        let bytes = self.store.load(&record.sha256).map_err(|e| ApiError::new(500, "store_error", e))?;
        k.put_module(record, &bytes).await.map_err(|e| ApiError::new(503, "state_unavailable", format!("{e:#}")))
    }

    pub fn subscribe(&self) -> watch::Receiver<Arc<Published>> {
        self.published.subscribe()
    }

    /// Constant-time bearer token check.
    pub fn authorized(&self, header: Option<&str>) -> bool {
        self.token.authorized(header)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RolloutState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn controller(&self) -> std::sync::MutexGuard<'_, Controller> {
        self.controller.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rebuild the ECDS resources from the rollout state.
    fn publish(&self) -> anyhow::Result<()> {
        let state = self.lock().clone();
        let mut resources = BTreeMap::new();
        let mut cache: HashMap<String, Vec<u8>> = HashMap::new();
        for spec in state.filters() {
            let sha = spec.deployed.sha256.clone();
            if !cache.contains_key(&sha) {
                cache.insert(sha.clone(), self.store.load(&sha)?);
            }
            let bytes = cache.get(&sha).map(Vec::as_slice).unwrap_or_default();
            resources.insert(spec.resource.clone(), ecds::resource(&spec, bytes));
        }
        self.published.send_replace(Arc::new(Published { revision: state.revision, resources }));
        Ok(())
    }

    fn admission_for(&self, slot: &str, params: &Value) -> AdmissionConfig {
        let budget_per_request = Duration::from_millis(self.cfg.admission_budget_ms);
        let memory_limit_bytes = self.cfg.admission_memory_mb.saturating_mul(1 << 20);
        if slot == SCHEDULER_SLOT {
            // A scheduler: its configuration as Envoy will get it, on a pool of its own.
            let mut config = params.clone();
            config["rollout"] = json!({"arm": "stable", "version": "admission"});
            let pool = admission::scheduler_pool();
            return AdmissionConfig {
                plugin_config: config.to_string().into_bytes(),
                samples: admission::default_samples(),
                shared_data: attache_proto::shared_layout::whole(&pool, rollout::now_ms())
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v))
                    .collect(),
                check_outputs: Some(admission::check_scheduler_outputs),
                budget_per_request,
                memory_limit_bytes,
                ..AdmissionConfig::default()
            };
        }
        // Recorded decisions' contexts when the log holds any, else the synthetic ones.
        let recorded: Vec<_> = self
            .decisions
            .recent(ADMISSION_RECORDED_SAMPLES)
            .iter()
            .map(|r| &r.ctx)
            .map(admission::context_sample)
            .collect();
        AdmissionConfig {
            plugin_config: json!({"slot": slot, "arm": "stable", "version": "admission", "weight": 1.0,
                                  "buckets": [0, attache_policies::scoring::BUCKETS], "params": params})
            .to_string()
            .into_bytes(),
            samples: if recorded.is_empty() { admission::scorer_samples() } else { recorded },
            check_outputs: Some(admission::check_scorer_outputs),
            budget_per_request,
            memory_limit_bytes,
            ..AdmissionConfig::default()
        }
    }

    /// Verify, admit and store a scorer module for `slot`.
    pub fn upload(&self, slot: &str, version: &str, params: &Value, bytes: &[u8]) -> Result<ModuleRecord, ApiError> {
        if !rollout::valid_slot(slot) {
            return Err(RolloutError::BadSlot(slot.into()).into());
        }
        if self.kube.is_some() && bytes.len() > super::kube_state::MAX_MODULE_BYTES {
            return Err(ApiError::new(
                413,
                "module_too_large",
                format!(
                    "{} bytes: with the policy state in Kubernetes a module is kept in a ConfigMap, at most {} bytes",
                    bytes.len(),
                    super::kube_state::MAX_MODULE_BYTES
                ),
            ));
        }
        let adm = self.admission_for(slot, params);
        let record = self.store.upload(&self.trust, &adm, slot, version, params, bytes).map_err(ApiError::from);
        let record = match record {
            Ok(r) => r,
            Err(e) => {
                warn!(slot, version, error = %e.message, "module upload refused");
                return Err(e);
            }
        };
        info!(slot, version, sha256 = %record.sha256, signers = ?record.signers, "module uploaded");
        Ok(record)
    }

    /// A configuration-only version: module `from` (a version or sha256 stored for `slot`)
    /// with new `params`, admitted under them and recorded as `version`. No module moves.
    pub fn configure(&self, slot: &str, version: &str, from: &str, params: &Value) -> Result<ModuleRecord, ApiError> {
        let history = self.modules(Some(slot))?;
        let base =
            history.iter().rev().find(|r| r.sha256 == from || r.version == from).ok_or_else(|| {
                ApiError::new(404, "not_found", format!("no module {from:?} uploaded for slot {slot:?}"))
            })?;
        let bytes = self.store.load(&base.sha256).map_err(|e| ApiError::new(500, "store_error", e))?;
        let record = self.upload(slot, version, params, &bytes)?;
        info!(slot, version, from, sha256 = %record.sha256, "configuration version recorded");
        Ok(record)
    }

    pub fn modules(&self, slot: Option<&str>) -> Result<Vec<ModuleRecord>, ApiError> {
        self.store.history(slot).map_err(|e| ApiError::new(500, "store_error", e))
    }

    /// Log and count a transition.
    fn announce(&self, t: &Transition) {
        info!(slot = %t.slot, action = %t.action, by = %t.by, host = ?t.host, from = ?t.from, to = ?t.to, reason = %t.reason, "rollout transition");
        crate::telemetry::metrics().policy_transition(&t.action);
        if let Err(e) = self.publish() {
            warn!(error = %e, "could not publish the rollout state");
        }
    }

    /// Persist a transition to this replica's files, then announce it.
    fn record(&self, t: &Transition) {
        if let Err(e) = self.files.save(&self.lock(), t) {
            warn!(error = %e, "could not persist the rollout state");
        }
        self.announce(t);
    }

    /// A stored version of `slot` (by sha256 or version label), to deploy with `weight`.
    async fn deployable(&self, slot: &str, module: &str, weight: f64) -> Result<Deployed, ApiError> {
        if self.kube.is_some() {
            // A version uploaded through another replica.
            self.import_modules().await.map_err(|e| ApiError::new(503, "state_unavailable", format!("{e:#}")))?;
        }
        let history = self.modules(Some(slot))?;
        let rec = history.iter().rev().find(|r| r.sha256 == module || r.version == module).ok_or_else(|| {
            ApiError::new(404, "not_found", format!("no module {module:?} uploaded for slot {slot:?}"))
        })?;
        Ok(Deployed { sha256: rec.sha256.clone(), version: rec.version.clone(), weight, params: rec.params.clone() })
    }

    /// With `auto.require_shadow`, refuse a canary of `deployed` unless the same version ran
    /// in shadow in `slot` and its comparison passes the gate (`counters`: a fresh reading).
    fn shadow_gate(&self, slot: &str, deployed: &Deployed, counters: Option<&PerEnvoy>) -> Result<(), ApiError> {
        if !self.cfg.auto.require_shadow {
            return Ok(());
        }
        let state = self.lock().clone();
        let same = state
            .slots
            .get(slot)
            .and_then(|s| s.shadow.as_ref())
            .is_some_and(|sh| sh.deployed.sha256 == deployed.sha256 && sh.deployed.params == deployed.params);
        let mut ctl = self.controller();
        if let Some(c) = counters {
            // Bring the shadow's window up to now (verdicts on canaries wait for the next pass).
            ctl.judge(&state, c, &self.cfg.auto, rollout::now_ms());
        }
        let report = if same { ctl.shadow_report(slot) } else { None };
        canary::shadow_gate(&self.cfg.auto, report.as_ref()).map_err(|e| {
            warn!(slot, version = %deployed.version, reason = %e, "canary refused by the shadow gate");
            ApiError::new(409, "shadow_gate", e)
        })
    }

    /// Run a stored module in shadow in `slot`: it scores every request, acts on none, and is
    /// compared with the live pick.
    pub async fn shadow(&self, slot: &str, module: &str, weight: f64) -> Result<Transition, ApiError> {
        let deployed = self.deployable(slot, module, weight).await?;
        let counters = self.read_counters().await;
        let t = self.change(|st| st.shadow(slot, deployed)).await?;
        let started = self.lock().slots.get(slot).and_then(|s| s.shadow.as_ref()).map(|c| c.started_unix_ms);
        if let (Some(started), Some(counters)) = (started, counters) {
            self.controller().start(slot, started, &counters);
        }
        Ok(t)
    }

    /// Start a canary of a stored module (by sha256 or version label) in `slot`.
    pub async fn rollout(&self, slot: &str, module: &str, percent: f64, weight: f64) -> Result<Transition, ApiError> {
        let deployed = self.deployable(slot, module, weight).await?;
        // The canary is judged on what happens after this instant.
        let counters = self.read_counters().await;
        self.shadow_gate(slot, &deployed, counters.as_ref())?;
        let t = self.change(|st| st.rollout(slot, deployed, percent)).await?;
        let started = self.lock().slots.get(slot).and_then(|s| s.canary.as_ref()).map(|c| c.started_unix_ms);
        if let (Some(started), Some(counters)) = (started, counters) {
            self.controller().start(slot, started, &counters);
        }
        Ok(t)
    }

    pub async fn promote(&self, slot: &str, by: &str, reason: &str) -> Result<Transition, ApiError> {
        self.change(|st| st.promote(slot, by, reason)).await
    }

    pub async fn rollback(&self, slot: &str, by: &str, reason: &str) -> Result<Transition, ApiError> {
        self.change(|st| st.rollback(slot, by, reason)).await
    }

    /// The Envoys whose stats the controller reads: `envoy_admin` when it lists any, else
    /// every subscribed Envoy that advertised a stats port. `(name, base URL)`.
    pub fn stats_targets(&self) -> Vec<(String, String)> {
        if self.cfg.envoy_admin.is_empty() {
            self.envoys.stats_urls(self.cfg.envoy_cluster.as_deref())
        } else {
            self.cfg.envoy_admin.iter().map(|u| (u.clone(), u.clone())).collect()
        }
    }

    /// Each Envoy's rollout counters, read in parallel; None if none answered.
    pub async fn read_counters(&self) -> Option<PerEnvoy> {
        let reads = self.stats_targets().into_iter().map(|(envoy, base)| async move {
            // The rollout counters, and server.uptime to tell a restart.
            let url = format!(
                "{}/stats?filter=%5E(wasmcustom%5C.attache%5C.rollout%5C.%7Cserver%5C.uptime%24)",
                base.trim_end_matches('/')
            );
            let text = match self.http.get(&url).send().await.and_then(|r| r.error_for_status()) {
                Ok(r) => r.text().await,
                Err(e) => Err(e),
            };
            match text {
                Ok(t) => {
                    crate::telemetry::metrics().policy_stats_read("ok");
                    let mut counters = Counters::new();
                    parse_rollout_stats(&t, &mut counters);
                    Some((envoy, Reading { counters, uptime_s: parse_uptime(&t) }))
                }
                Err(e) => {
                    warn!(envoy, url = %base, error = %e, "reading Envoy stats");
                    crate::telemetry::metrics().policy_stats_read("error");
                    None
                }
            }
        });
        let per: PerEnvoy = futures::future::join_all(reads).await.into_iter().flatten().collect();
        (!per.is_empty()).then_some(per)
    }

    /// One controller pass: bring every canary's window and every shadow's report up to now,
    /// then act on the verdicts. Every replica judges, so each one's status is current; only
    /// with `auto.enabled`, and with the state in Kubernetes only on the replica holding the
    /// controller Lease, does it act.
    pub async fn evaluate(&self) {
        let Some(counters) = self.read_counters().await else {
            return;
        };
        let (verdicts, shadows) = {
            let state = self.lock();
            let mut ctl = self.controller();
            let verdicts = ctl.judge(&state, &counters, &self.cfg.auto, rollout::now_ms());
            let shadows: Vec<(String, Option<ShadowReport>)> = state
                .slots
                .iter()
                .map(|(slot, s)| (slot.clone(), s.shadow.as_ref().and_then(|_| ctl.shadow_report(slot))))
                .collect();
            (verdicts, shadows)
        };
        for (slot, r) in shadows {
            let r = r.map(|r| (r.requests, r.agreement, r.hit_delta, r.load_delta));
            crate::telemetry::metrics().policy_shadow(&slot, r);
        }
        if !self.cfg.auto.enabled {
            return;
        }
        for (slot, verdict) in verdicts {
            // Only the Lease holder acts (it may have lapsed while the stats were read).
            if self.kube.as_ref().is_some_and(|k| !k.may_act()) {
                return;
            }
            let result = match verdict {
                Verdict::Rollback(reason) => Some(self.rollback(&slot, "controller", &reason).await),
                Verdict::Promote(reason) if self.cfg.auto.promote => {
                    Some(self.promote(&slot, "controller", &reason).await)
                }
                _ => None,
            };
            if let Some(Err(e)) = result {
                warn!(slot, error = %e.message, "controller action failed");
            }
        }
    }

    /// Run the background work until the process ends: with the state in Kubernetes, follow
    /// it and campaign for the controller Lease; the controller, if enabled.
    pub fn spawn_controller(self: &Arc<Self>) {
        if let Some(k) = &self.kube {
            let (sync_ms, lease_ms) = (k.config().sync_ms.max(50), k.config().lease_ms.max(300));
            let svc = self.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(sync_ms.min(lease_ms / 3)));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let (mut last_campaign, mut last_sync, mut last_import) = (None::<std::time::Instant>, None, None);
                loop {
                    tick.tick().await;
                    let Some(k) = &svc.kube else { return };
                    let due = |last: Option<std::time::Instant>, every: u64| {
                        last.is_none_or(|t| t.elapsed() >= Duration::from_millis(every))
                    };
                    if due(last_campaign, lease_ms / 3) {
                        last_campaign = Some(std::time::Instant::now());
                        k.campaign().await;
                    }
                    if due(last_import, 10_000) {
                        last_import = Some(std::time::Instant::now());
                        if let Err(e) = svc.import_modules().await {
                            warn!(error = %format!("{e:#}"), "importing shared policy modules");
                        }
                    }
                    if due(last_sync, sync_ms) {
                        last_sync = Some(std::time::Instant::now());
                        if let Err(e) = svc.sync().await {
                            warn!(error = %format!("{e:#}"), "reading the shared policy state");
                        }
                    }
                }
            });
        }
        if !self.cfg.auto.enabled {
            info!("rollout controller judges but does not act (auto.enabled false)");
        }
        if self.cfg.envoy_admin.is_empty() {
            info!("rollout controller reads the stats of the Envoys subscribed to ECDS (no envoy_admin listed)");
        }
        let svc = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(svc.cfg.auto.interval_ms.max(100)));
            loop {
                tick.tick().await;
                svc.evaluate().await;
            }
        });
    }

    pub async fn status(&self) -> Value {
        let state = self.lock().clone();
        let per = self.read_counters().await.unwrap_or_default();
        let counters = ctl::sum(&per);
        let verdicts = self.controller().verdicts().clone();
        let slots: serde_json::Map<String, Value> = state
            .slots
            .iter()
            .map(|(slot, s)| {
                let raw = |a: &str| counters.get(&(slot.clone(), a.to_owned())).copied();
                let arm = |a: &str| raw(a).as_ref().map(ArmCounters::json);
                // The shadow over the controller's window, else over Envoy's whole counts.
                let shadow = s.shadow.as_ref().map(|_| {
                    self.controller().shadow_report(slot).unwrap_or_else(|| {
                        ShadowReport::new(&raw("shadow").unwrap_or_default(), &raw("live").unwrap_or_default())
                    })
                });
                (
                    slot.clone(),
                    json!({
                        "stable": s.stable,
                        "canary": s.canary,
                        "shadow": s.shadow.as_ref().map(|sh| json!({"deployed": sh, "report": shadow})),
                        "previous": s.previous.iter().map(|d| &d.version).collect::<Vec<_>>(),
                        "counters": {"stable": arm("stable"), "canary": arm("canary")},
                        "controller": verdicts.get(slot),
                        "window": self.controller().window(slot),
                    }),
                )
            })
            .collect();
        json!({
            "revision": state.revision,
            "slots": slots,
            "envoy": self.acks.snapshot(),
            "envoys": self.envoys.snapshot(),
            "stats_from": self.stats_targets().into_iter().map(|(_, url)| url).collect::<Vec<_>>(),
            "transitions": self.files.transitions(50),
            "auto": {"enabled": self.cfg.auto.enabled, "promote": self.cfg.auto.promote},
            "state": match &self.kube {
                Some(k) => json!({"in": "kubernetes", "version": self.shared().1, "replica": k.identity(), "controller": k.may_act()}),
                None => json!({"in": "files", "dir": self.cfg.store_dir}),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_lines_parse_into_arms() {
        let text = "wasmcustom.attache.rollout.slo.canary.requests: 10\nwasmcustom.attache.rollout.slo.canary.traps: 1\n\
                    wasmcustom.attache.rollout.slo.stable.errors: 2\nwasmcustom.attache.rollout.my_slot.stable.ttfb_us: 5000\n\
                    cluster.pool.upstream_rq: 9\nwasmcustom.attache.rollout.bad: x\n";
        let mut c = Counters::new();
        parse_rollout_stats(text, &mut c);
        parse_rollout_stats(text, &mut c); // a second Envoy adds up
        assert_eq!(c[&("slo".into(), "canary".into())].requests, 20);
        assert_eq!(c[&("slo".into(), "canary".into())].traps, 2);
        assert_eq!(c[&("slo".into(), "stable".into())].errors, 4);
        assert_eq!(c[&("my_slot".into(), "stable".into())].ttfb_us, 10_000);
        assert_eq!(c.len(), 3);
        assert_eq!(parse_uptime(text), None);
        assert_eq!(parse_uptime(&format!("{text}server.uptime: 42\n")), Some(42));
    }
}
