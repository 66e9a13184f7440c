//! Envoy's Extension Config Discovery Service (incremental/delta xDS), serving the scorer slots'
//! filter configurations from the rollout state.
//!
//! Each resource is a `TypedExtensionConfig` holding an `envoy.extensions.filters.http.wasm.v3.Wasm`
//! whose code is the verified module's exact bytes (inline, so Envoy loads what the host
//! checked, with no fetch that can fail) and whose VM id carries the module's sha256. Delta xDS
//! fits slots well: the host sends only resources that changed, and a slot without a version
//! is simply never sent, so Envoy keeps the filter's `default_config` (a passthrough).
//!
//! Envoy's ACK or NACK of every version is recorded per node and shown by `status`: a module
//! Envoy refuses (say, V8 cannot compile it) leaves Envoy on the previous version, and the NACK
//! says why.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::config::core::v3::{
    async_data_source, data_source, AsyncDataSource, DataSource, TypedExtensionConfig,
};
use envoy_types::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
use envoy_types::pb::envoy::extensions::wasm::v3::{plugin_config, FailurePolicy, PluginConfig, VmConfig};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};
use envoy_types::pb::envoy::service::extension::v3::extension_config_discovery_service_server::{
    ExtensionConfigDiscoveryService, ExtensionConfigDiscoveryServiceServer,
};
use envoy_types::pb::google::protobuf::{Any, BoolValue, StringValue};
use prost::Message;
use serde::Serialize;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{info, warn};

use super::envoys::Envoys;
use super::rollout::FilterSpec;
use super::signing::sha256_hex;

pub const TYPED_EXTENSION_CONFIG: &str = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig";
const WASM_FILTER: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const STRING_VALUE: &str = "type.googleapis.com/google.protobuf.StringValue";

/// The resources to serve, by name: (version, resource).
#[derive(Debug, Default)]
pub struct Published {
    pub revision: u64,
    pub resources: BTreeMap<String, (String, Any)>,
}

/// Build the Wasm filter resource of one slot filter from the module bytes.
///
/// Scorer slots always fail open. Envoy 1.40 applies `failure_policy: FAIL_OPEN` to new
/// streams only: streams already inside the VM when it traps are failed mid-response. The
/// deprecated `fail_open` flag also lets those continue (proxy-wasm's `CHECK_FAIL`), so a trap
/// fails no request: the scheduler's own pick routes whatever the scorer did not score.
/// `FAIL_RELOAD` was measured to answer 503 to every request through the slot on that worker
/// until the VM reloaded (hundreds in the 1 s backoff at 4 concurrent clients), so it is not
/// offered.
///
/// A scheduler (the `scheduler` slot) runs as the bootstrap's scheduler does: root
/// `attache_scheduler`, `FAIL_RELOAD`, headers may stop iteration for the body, and the VM id
/// `attache` whatever its code. Shared data is namespaced by VM id alone, so a new scheduler
/// module finds the snapshot, the sticky sessions, the affinity logs and the precise index
/// the previous one left (and the snapshot agent keeps writing), and its workers replay the
/// affinity logs into their tables as they start: warm prefixes keep going to their holders.
pub fn resource(spec: &FilterSpec, module: &[u8]) -> (String, Any) {
    let config = spec.plugin_config();
    let short = spec.deployed.sha256.get(..16).unwrap_or(&spec.deployed.sha256);
    let scheduler = spec.is_scheduler();
    #[allow(deprecated)] // `fail_open`: see below
    let wasm = Wasm {
        config: Some(PluginConfig {
            name: spec.resource.clone(),
            root_id: if scheduler { "attache_scheduler" } else { "attache_scorer" }.into(),
            configuration: Some(Any {
                type_url: STRING_VALUE.into(),
                value: StringValue { value: config.clone() }.encode_to_vec(),
            }),
            fail_open: !scheduler,
            failure_policy: if scheduler { FailurePolicy::FailReload as i32 } else { 0 },
            allow_on_headers_stop_iteration: scheduler.then_some(BoolValue { value: true }),
            vm: Some(plugin_config::Vm::VmConfig(VmConfig {
                // A scorer: one VM per module version, the id naming the code it runs.
                vm_id: if scheduler { "attache".into() } else { format!("attache.scorer.{short}") },
                runtime: "envoy.wasm.runtime.v8".into(),
                code: Some(AsyncDataSource {
                    specifier: Some(async_data_source::Specifier::Local(DataSource {
                        specifier: Some(data_source::Specifier::InlineBytes(module.to_vec())),
                        ..Default::default()
                    })),
                }),
                ..Default::default()
            })),
            ..Default::default()
        }),
    };
    let typed = TypedExtensionConfig {
        name: spec.resource.clone(),
        typed_config: Some(Any { type_url: WASM_FILTER.into(), value: wasm.encode_to_vec() }),
    };
    let version = sha256_hex(format!("{}|{config}", spec.deployed.sha256).as_bytes());
    (
        version.get(..16).unwrap_or(&version).to_owned(),
        Any { type_url: TYPED_EXTENSION_CONFIG.into(), value: typed.encode_to_vec() },
    )
}

/// What one Envoy has said about one resource.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ResourceAck {
    /// Version last sent.
    pub sent: String,
    /// Version Envoy accepted last.
    pub acked: Option<String>,
    /// Envoy's reason for refusing the version last sent.
    pub nack: Option<String>,
}

/// Envoy's answers, per node id, per resource.
#[derive(Debug, Default)]
pub struct Acks {
    nodes: Mutex<BTreeMap<String, BTreeMap<String, ResourceAck>>>,
}

impl Acks {
    pub fn snapshot(&self) -> BTreeMap<String, BTreeMap<String, ResourceAck>> {
        self.nodes.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn with<R>(&self, node: &str, f: impl FnOnce(&mut BTreeMap<String, ResourceAck>) -> R) -> R {
        let mut g = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        f(g.entry(node.to_owned()).or_default())
    }
}

#[derive(Clone)]
pub struct EcdsServer {
    published: watch::Receiver<Arc<Published>>,
    pub acks: Arc<Acks>,
    pub envoys: Arc<Envoys>,
}

impl EcdsServer {
    pub fn new(published: watch::Receiver<Arc<Published>>, acks: Arc<Acks>, envoys: Arc<Envoys>) -> Self {
        Self { published, acks, envoys }
    }

    pub fn into_server(self) -> ExtensionConfigDiscoveryServiceServer<Self> {
        // Modules travel inline; allow large resources.
        ExtensionConfigDiscoveryServiceServer::new(self).max_encoding_message_size(64 << 20)
    }
}

type DeltaStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;
type SotwStream = ReceiverStream<Result<DiscoveryResponse, Status>>;

#[tonic::async_trait]
impl ExtensionConfigDiscoveryService for EcdsServer {
    type StreamExtensionConfigsStream = SotwStream;
    type DeltaExtensionConfigsStream = DeltaStream;

    async fn stream_extension_configs(
        &self,
        _request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<SotwStream>, Status> {
        Err(Status::unimplemented("Attaché serves ECDS as delta xDS: set api_type: DELTA_GRPC"))
    }

    async fn fetch_extension_configs(
        &self,
        _request: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        Err(Status::unimplemented("Attaché serves ECDS as delta xDS: set api_type: DELTA_GRPC"))
    }

    async fn delta_extension_configs(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<DeltaStream>, Status> {
        let peer = request.remote_addr();
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let mut published = self.published.clone();
        let mut session = DeltaSession::new(self.acks.clone());
        let envoys = self.envoys.clone();
        let mut subscribed_as: Option<String> = None;
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    msg = inbound.message() => {
                        match msg {
                            Ok(Some(r)) => {
                                if let (None, Some(node)) = (&subscribed_as, r.node.as_ref().filter(|n| !n.id.is_empty())) {
                                    envoys.connect(node, peer);
                                    subscribed_as = Some(node.id.clone());
                                }
                                session.on_request(r);
                            }
                            Ok(None) => break,
                            Err(e) => { warn!(error = %e, node = session.node, "ECDS stream error"); break; }
                        }
                    }
                    changed = published.changed() => {
                        if changed.is_err() { break; }
                    }
                }
                let p = published.borrow_and_update().clone();
                let Some(resp) = session.response(&p) else { continue };
                if tx.send(Ok(resp)).await.is_err() {
                    break;
                }
            }
            if let Some(node) = subscribed_as {
                envoys.disconnect(&node);
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// One Envoy's delta ECDS stream: what it subscribed to, what it was sent, and which versions
/// each unanswered response carried.
struct DeltaSession {
    acks: Arc<Acks>,
    node: String,
    subscribed: BTreeSet<String>,
    sent: BTreeMap<String, String>,
    /// nonce → the versions that response carried
    inflight: BTreeMap<String, Vec<(String, String)>>,
    nonce: u64,
}

impl DeltaSession {
    fn new(acks: Arc<Acks>) -> Self {
        Self {
            acks,
            node: String::from("unknown"),
            subscribed: BTreeSet::new(),
            sent: BTreeMap::new(),
            inflight: BTreeMap::new(),
            nonce: 0,
        }
    }

    /// A request from Envoy: who it is, the ACK or NACK of an earlier response, and
    /// subscription changes.
    fn on_request(&mut self, r: DeltaDiscoveryRequest) {
        if let Some(n) = r.node.as_ref().filter(|n| !n.id.is_empty()) {
            self.node = n.id.clone();
        }
        let node = &self.node;
        if !r.response_nonce.is_empty() {
            let carried = self.inflight.remove(&r.response_nonce).unwrap_or_default();
            let err = r.error_detail.as_ref().map(|e| e.message.clone());
            if let Some(msg) = &err {
                warn!(node, nonce = r.response_nonce, error = %msg, "Envoy refused a filter configuration; it keeps the previous one");
            }
            self.acks.with(node, |m| {
                for (name, version) in carried {
                    let a = m.entry(name).or_default();
                    match &err {
                        None => {
                            a.acked = Some(version);
                            a.nack = None;
                        }
                        Some(e) => a.nack = Some(e.clone()),
                    }
                }
            });
        }
        for n in r.resource_names_subscribe {
            info!(node, resource = %n, "ECDS subscribe");
            self.subscribed.insert(n);
        }
        for n in r.resource_names_unsubscribe {
            self.subscribed.remove(&n);
            self.sent.remove(&n);
        }
    }

    /// The response that brings Envoy to `p`: subscribed resources whose version it was not
    /// sent, and those no longer published. `None` when it is up to date.
    fn response(&mut self, p: &Published) -> Option<DeltaDiscoveryResponse> {
        let mut resources = Vec::new();
        let mut removed = Vec::new();
        for name in &self.subscribed {
            match p.resources.get(name) {
                Some((version, any)) if self.sent.get(name) != Some(version) => {
                    resources.push(Resource {
                        name: name.clone(),
                        version: version.clone(),
                        resource: Some(any.clone()),
                        ..Default::default()
                    });
                    self.sent.insert(name.clone(), version.clone());
                }
                None if self.sent.remove(name).is_some() => removed.push(name.clone()),
                _ => {}
            }
        }
        if resources.is_empty() && removed.is_empty() {
            return None;
        }
        self.nonce += 1;
        let n = self.nonce.to_string();
        let carried: Vec<(String, String)> = resources.iter().map(|r| (r.name.clone(), r.version.clone())).collect();
        self.acks.with(&self.node, |m| {
            for (name, version) in &carried {
                m.entry(name.clone()).or_default().sent = version.clone();
            }
            for name in &removed {
                m.remove(name);
            }
        });
        info!(node = self.node, nonce = n, updated = ?carried, removed = ?removed, revision = p.revision, "ECDS push");
        self.inflight.insert(n.clone(), carried);
        Some(DeltaDiscoveryResponse {
            system_version_info: p.revision.to_string(),
            resources,
            type_url: TYPED_EXTENSION_CONFIG.into(),
            removed_resources: removed,
            nonce: n,
            ..Default::default()
        })
    }
}
