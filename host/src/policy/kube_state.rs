//! The policy service's state in the Kubernetes API, so that two or more host replicas share
//! it and none keeps it on its own disk (`policy.kubernetes`):
//! - `<name>-state` ConfigMap: `rollout.json` (which module each slot runs, the canary in
//!   flight) and `transitions.jsonl` (the newest [`KEEP_TRANSITIONS`]). Every write carries the
//!   `resourceVersion` it read as a precondition, so a replica that lost a race gets `409
//!   Conflict`, reads again, and its operator gets a `409 conflict` to retry: no write is lost.
//! - `<name>-m-<sha256 prefix>-<version hash>` ConfigMaps: one per uploaded module version,
//!   `binaryData.module.wasm` and `data.record.json`. Each replica imports them into its local
//!   store (a cache; the signature is verified again) before it serves a state that deploys
//!   them.
//! - `<name>-controller` Lease: the replica that holds it runs the rollout controller. It
//!   renews every third of the lease; a replica takes over only after the holder's lease ran
//!   out, and a holder stops acting once its last renewal is older than two thirds of the lease,
//!   before anyone may take over (so two controllers never act at once).
//!
//! Every replica serves the admin API and ECDS from the shared state, which it reads every
//! `sync_ms` and at once before each write.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::ByteString;
use kube::api::{Api, ListParams, PostParams};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::rollout::{RolloutState, Transition};
use super::store::ModuleRecord;

/// Transitions kept in the state ConfigMap.
pub const KEEP_TRANSITIONS: usize = 500;
/// Largest module kept in a ConfigMap (1 MiB minus room for base64 and the record).
pub const MAX_MODULE_BYTES: usize = 760 * 1024;

/// `policy.kubernetes` in the host configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyKubernetes {
    /// A kubeconfig file. Default: the pod's service account, else `$KUBECONFIG`.
    pub kubeconfig: Option<PathBuf>,
    /// The namespace of the ConfigMaps and the Lease. Default: the kubeconfig's (in a pod,
    /// its own).
    pub namespace: Option<String>,
    /// Prefix of the objects' names (the chart: its release's full name).
    pub name: String,
    /// How often each replica reads the shared state.
    pub sync_ms: u64,
    /// The controller Lease's duration; the holder renews every third of it.
    pub lease_ms: u64,
}

impl Default for PolicyKubernetes {
    fn default() -> Self {
        Self { kubeconfig: None, namespace: None, name: "attache-policy".into(), sync_ms: 500, lease_ms: 3_000 }
    }
}

/// Why a write of the shared state failed.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("the policy state changed on another replica; read it again and retry")]
    Conflict,
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error("encoding the policy state: {0}")]
    Encode(#[from] serde_json::Error),
}

/// The shared state as last read: the rollout state, the transitions, and the version read.
#[derive(Debug, Clone, Default)]
pub struct Shared {
    pub state: RolloutState,
    pub transitions: Vec<Transition>,
    /// The ConfigMap's `resourceVersion` (None: it does not exist yet).
    pub version: Option<String>,
}

pub struct KubeState {
    cms: Api<ConfigMap>,
    leases: Api<Lease>,
    cfg: PolicyKubernetes,
    identity: String,
    /// When this replica last renewed (or took) the Lease.
    renewed: Mutex<Option<Instant>>,
    leader: AtomicBool,
}

fn conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

fn not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

fn labels(component: &str) -> BTreeMap<String, String> {
    [
        ("app.kubernetes.io/name".to_owned(), "attache".to_owned()),
        ("app.kubernetes.io/component".to_owned(), component.to_owned()),
    ]
    .into()
}

/// FNV-1a, for short stable object names.
fn fnv(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

impl KubeState {
    pub async fn connect(cfg: PolicyKubernetes, identity: String) -> anyhow::Result<Self> {
        let client = crate::kubernetes::client(cfg.kubeconfig.as_deref()).await?;
        let ns = cfg.namespace.clone().unwrap_or_else(|| client.default_namespace().to_owned());
        info!(namespace = %ns, name = %cfg.name, identity = %identity, "policy state in the Kubernetes API");
        Ok(Self {
            cms: Api::namespaced(client.clone(), &ns),
            leases: Api::namespaced(client, &ns),
            cfg,
            identity,
            renewed: Mutex::new(None),
            leader: AtomicBool::new(false),
        })
    }

    pub fn config(&self) -> &PolicyKubernetes {
        &self.cfg
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    fn state_name(&self) -> String {
        format!("{}-state", self.cfg.name)
    }

    fn module_name(&self, r: &ModuleRecord) -> String {
        let sha = r.sha256.get(..16).unwrap_or(&r.sha256);
        format!("{}-m-{sha}-{:08x}", self.cfg.name, fnv(&r.version))
    }

    /// Read the shared rollout state.
    pub async fn read(&self) -> anyhow::Result<Shared> {
        let Some(cm) = self.cms.get_opt(&self.state_name()).await.context("reading the policy state ConfigMap")? else {
            return Ok(Shared::default());
        };
        let data = cm.data.unwrap_or_default();
        let state = match data.get("rollout.json") {
            Some(t) => serde_json::from_str(t).context("parsing rollout.json in the policy state ConfigMap")?,
            None => RolloutState::default(),
        };
        let transitions = data
            .get("transitions.jsonl")
            .map(|t| t.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
            .unwrap_or_default();
        Ok(Shared { state, transitions, version: cm.metadata.resource_version })
    }

    /// Write `state` with `t` appended to `transitions`, if the ConfigMap is still at
    /// `version` (None: it must not exist yet). Returns the new version.
    pub async fn write(
        &self,
        state: &RolloutState,
        transitions: &[Transition],
        version: Option<&str>,
    ) -> Result<String, WriteError> {
        let skip = transitions.len().saturating_sub(KEEP_TRANSITIONS);
        let mut log = String::new();
        for t in transitions.iter().skip(skip) {
            log.push_str(&serde_json::to_string(t)?);
            log.push('\n');
        }
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(self.state_name()),
                labels: Some(labels("policy-state")),
                resource_version: version.map(str::to_owned),
                ..ObjectMeta::default()
            },
            data: Some(
                [
                    ("rollout.json".to_owned(), serde_json::to_string_pretty(state)?),
                    ("transitions.jsonl".to_owned(), log),
                ]
                .into(),
            ),
            ..ConfigMap::default()
        };
        let written = match version {
            Some(_) => self.cms.replace(&self.state_name(), &PostParams::default(), &cm).await,
            None => self.cms.create(&PostParams::default(), &cm).await,
        };
        match written {
            Ok(cm) => Ok(cm.metadata.resource_version.unwrap_or_default()),
            Err(e) if conflict(&e) => {
                crate::telemetry::metrics().policy_conflict();
                Err(WriteError::Conflict)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Store an uploaded module version for every replica (kept if it is already there).
    pub async fn put_module(&self, r: &ModuleRecord, bytes: &[u8]) -> anyhow::Result<()> {
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(self.module_name(r)),
                labels: Some(labels("policy-module")),
                ..ObjectMeta::default()
            },
            data: Some([("record.json".to_owned(), serde_json::to_string(r)?)].into()),
            binary_data: Some([("module.wasm".to_owned(), ByteString(bytes.to_vec()))].into()),
            ..ConfigMap::default()
        };
        match self.cms.create(&PostParams::default(), &cm).await {
            Ok(_) => Ok(()),
            Err(e) if conflict(&e) => Ok(()),
            Err(e) => Err(e).context("storing the module in a ConfigMap"),
        }
    }

    /// Every module version stored, with its bytes.
    pub async fn modules(&self) -> anyhow::Result<Vec<(ModuleRecord, Vec<u8>)>> {
        let prefix = format!("{}-m-", self.cfg.name);
        let list = self.cms.list(&ListParams::default()).await.context("listing policy module ConfigMaps")?;
        let mut out = Vec::new();
        for cm in list.items {
            if !cm.metadata.name.as_deref().is_some_and(|n| n.starts_with(&prefix)) {
                continue;
            }
            let record = cm.data.as_ref().and_then(|d| d.get("record.json")).and_then(|t| serde_json::from_str(t).ok());
            let bytes = cm.binary_data.and_then(|mut b| b.remove("module.wasm")).map(|b| b.0);
            match (record, bytes) {
                (Some(r), Some(b)) => out.push((r, b)),
                _ => warn!(name = ?cm.metadata.name, "policy module ConfigMap without a record or module; skipped"),
            }
        }
        Ok(out)
    }

    /// One round of the controller election: take the Lease if it is free or ran out, renew
    /// it if held. Returns whether this replica may act as the controller now.
    pub async fn campaign(&self) -> bool {
        let lease_ms = self.cfg.lease_ms.max(300);
        let name = format!("{}-controller", self.cfg.name);
        let now = k8s_openapi::jiff::Timestamp::now();
        let round = async {
            let current = self.leases.get_opt(&name).await?;
            let spec = current.as_ref().and_then(|l| l.spec.clone()).unwrap_or_default();
            let holder = spec.holder_identity.clone().unwrap_or_default();
            let mine = holder == self.identity;
            let expired = spec.renew_time.as_ref().is_none_or(|t| {
                let dur = i64::from(spec.lease_duration_seconds.unwrap_or(0)).saturating_mul(1000).max(lease_ms as i64);
                now.as_millisecond() - t.0.as_millisecond() > dur
            });
            if !mine && !holder.is_empty() && !expired {
                return Ok::<bool, kube::Error>(false);
            }
            let transitions = spec.lease_transitions.unwrap_or(0) + i32::from(!mine);
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    labels: Some(labels("policy-controller")),
                    resource_version: current.as_ref().and_then(|l| l.metadata.resource_version.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(lease_ms.div_ceil(1000) as i32),
                    acquire_time: if mine { spec.acquire_time.clone() } else { Some(MicroTime(now)) },
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(transitions),
                    ..LeaseSpec::default()
                }),
            };
            match current {
                Some(_) => self.leases.replace(&name, &PostParams::default(), &lease).await?,
                None => self.leases.create(&PostParams::default(), &lease).await?,
            };
            if !mine {
                info!(identity = %self.identity, previous = %holder, "took the policy controller lease");
            }
            Ok(true)
        };
        let started = Instant::now();
        let held = match round.await {
            Ok(held) => held,
            Err(e) if conflict(&e) || not_found(&e) => false,
            Err(e) => {
                warn!(error = %e, "policy controller lease");
                false
            }
        };
        let mut renewed = self.renewed.lock().unwrap_or_else(|p| p.into_inner());
        if held {
            *renewed = Some(started);
        } else if self.leader.load(Ordering::Relaxed)
            && renewed.is_some_and(|r| r.elapsed() * 3 > Duration::from_millis(lease_ms) * 2)
        {
            *renewed = None;
        }
        let leader = self.may_act_locked(*renewed);
        if leader != self.leader.swap(leader, Ordering::Relaxed) {
            info!(identity = %self.identity, leader, "policy controller role changed");
            crate::telemetry::metrics().policy_leader(leader);
        }
        leader
    }

    fn may_act_locked(&self, renewed: Option<Instant>) -> bool {
        let margin = Duration::from_millis(self.cfg.lease_ms.max(300)) * 2 / 3;
        renewed.is_some_and(|r| r.elapsed() < margin)
    }

    /// Whether this replica holds a Lease renewed recently enough to act on it now.
    pub fn may_act(&self) -> bool {
        let renewed = *self.renewed.lock().unwrap_or_else(|p| p.into_inner());
        self.may_act_locked(renewed)
    }
}
