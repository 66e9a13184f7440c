//! The Gateway API Inference Extension resources the host reads: `InferencePool`
//! (`inference.networking.k8s.io/v1`) as a typed resource, and `InferenceObjective`, whose API
//! group differs between GIE (`inference.networking.x-k8s.io/v1alpha2`) and llm-d
//! (`llm-d.ai/v1alpha2`), read through [`kube::core::DynamicObject`] with a configured group.
//!
//! Only the fields the router uses are modelled; unknown fields are ignored, as a client of a
//! newer server must.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::{DynamicObject, NamespaceResourceScope};
use serde::{Deserialize, Serialize};

pub const POOL_GROUP: &str = "inference.networking.k8s.io";
pub const POOL_VERSION: &str = "v1";

/// `InferencePool`: which pods serve a pool, and on which ports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InferencePool {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: InferencePoolSpec,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    #[serde(default)]
    pub selector: PoolSelector,
    #[serde(default)]
    pub target_ports: Vec<TargetPort>,
    /// The external picker a GIE gateway would call; Attaché decides in Envoy, so it is only
    /// reported, never called.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<serde_json::Value>,
}

/// A pool's selector is deliberately Service-like: `matchLabels` only.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetPort {
    pub number: i32,
}

impl kube::Resource for InferencePool {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "InferencePool".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        POOL_GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        POOL_VERSION.into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "inferencepools".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The fields of an `InferenceObjective` the router uses.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectiveSpec {
    /// Higher is served first; negative is sheddable. Unset is 0.
    #[serde(default)]
    pub priority: Option<i32>,
    #[serde(default)]
    pub pool_ref: Option<PoolRef>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct PoolRef {
    #[serde(default)]
    pub name: String,
}

/// An objective's name, namespace and spec, or why it could not be read.
pub fn objective_of(o: &DynamicObject) -> Result<(String, String, ObjectiveSpec), String> {
    let name = o.metadata.name.clone().unwrap_or_default();
    let ns = o.metadata.namespace.clone().unwrap_or_default();
    let spec = o.data.get("spec").cloned().unwrap_or(serde_json::Value::Null);
    let spec: ObjectiveSpec = if spec.is_null() {
        ObjectiveSpec::default()
    } else {
        serde_json::from_value(spec).map_err(|e| format!("InferenceObjective {ns}/{name}: {e}"))?
    };
    Ok((name, ns, spec))
}
