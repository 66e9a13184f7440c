//! Kubernetes discovery: `InferencePool`s, the pods they select and the `InferenceObjective`
//! priority table, followed with `kube` watchers into reflector stores.
//!
//! Replicas are symmetric: every host replica watches the same objects and derives the same
//! endpoint list, so any replica can serve any Envoy, and an Envoy that reconnects to another
//! replica gets a full snapshot. There is no leader election because discovery writes nothing
//! back to the cluster (no status, no leases): electing a leader would only add a failover delay.

pub mod crds;
pub mod endpoints;
pub mod sync;
pub mod watch;

use std::path::PathBuf;

use serde::Deserialize;

pub use watch::{client_from as client, spawn, Discovered};

/// `kubernetes:` in the host configuration.
#[derive(Debug, Clone, serde::Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubernetesConfig {
    /// A kubeconfig file. Default: the pod's service account in a cluster, else `$KUBECONFIG`
    /// or `~/.kube/config`.
    pub kubeconfig: Option<PathBuf>,
    /// Watch one namespace (a namespaced Role suffices); unset watches all namespaces (needs a
    /// ClusterRole).
    pub namespace: Option<String>,
    /// The `InferencePool` names to serve; empty serves every pool in scope.
    pub pools: Vec<String>,
    /// `group/version` of `InferenceObjective` (GIE: `inference.networking.x-k8s.io/v1alpha2`,
    /// llm-d: `llm-d.ai/v1alpha2`); empty disables the objective watch.
    pub objectives_api: String,
    /// Restart every watch with a fresh list this often (seconds), repairing any drift a
    /// missed event could leave; 0 disables.
    pub resync_s: u64,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            kubeconfig: None,
            namespace: None,
            pools: Vec::new(),
            objectives_api: "inference.networking.x-k8s.io/v1alpha2".into(),
            resync_s: 300,
        }
    }
}
