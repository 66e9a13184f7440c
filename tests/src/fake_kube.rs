//! A **stand-in Kubernetes API server** for the discovery tests. No kube-apiserver can be
//! installed on this machine, so this serves the part of the API a watch-based client uses,
//! with the real wire shapes: `GET` lists (`{kind}List` with `metadata.resourceVersion`) and
//! `?watch=true` streams of newline-delimited `{"type": ADDED|MODIFIED|DELETED|ERROR, "object"}`
//! events resumed from a `resourceVersion`, for core (`/api/v1/...`) and grouped
//! (`/apis/{group}/{version}/...`) resources, namespaced or across all namespaces.
//!
//! It also serves single objects for the writers (the host keeps its policy state in
//! ConfigMaps and elects its rollout controller with a Lease): `GET` by name, `POST` (create;
//! `409 AlreadyExists`), `PUT` (replace, with `metadata.resourceVersion` as a precondition:
//! `409 Conflict` when another writer got there first, as optimistic concurrency works in the
//! real API) and `DELETE`. Every version written stays readable through [`FakeApiServer::history`].
//!
//! It does *not* check RBAC, admission, schemas, field or label selectors, or server-side
//! apply; the tests that use it test the host's client, not Kubernetes. The knobs tests need:
//! [`FakeApiServer::break_watches`] (the server ends every open watch, as an API server restart
//! or a load balancer timeout does) and [`FakeApiServer::compact`] (history before now is
//! gone, so a watch resumed from an older `resourceVersion` gets `410 Gone`, as after etcd
//! compaction).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::{broadcast, watch};

/// Every request must carry this bearer token (from the kubeconfig written by the server).
pub const TOKEN: &str = "stand-in-token";

#[derive(Clone, Debug)]
struct Stored {
    rv: u64,
    api_version: String,
    plural: String,
    ns: String,
    kind: &'static str,
    object: Value,
}

#[derive(Default)]
struct Data {
    rv: u64,
    /// (apiVersion, plural, namespace, name) → object.
    objects: BTreeMap<(String, String, String, String), Value>,
    log: Vec<Stored>,
    /// Events at or below this resourceVersion are forgotten.
    compacted: u64,
    lists: BTreeMap<String, u64>,
    watches: BTreeMap<String, u64>,
    /// Every version of every object written through the API or `apply`, oldest first.
    history: Vec<Value>,
    kinds: BTreeMap<String, String>,
}

struct Inner {
    data: Mutex<Data>,
    events: broadcast::Sender<Stored>,
    breaker: watch::Sender<u64>,
    /// While true, watch requests wait unanswered (an unreachable API server).
    held: watch::Sender<bool>,
}

pub struct FakeApiServer {
    pub addr: SocketAddr,
    inner: Arc<Inner>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn plural_of(kind: &str) -> String {
    format!("{}s", kind.to_ascii_lowercase())
}

/// `(apiVersion, namespace, plural)` from a collection path, or None.
fn route(path: &str) -> Option<(String, Option<String>, String)> {
    match object_route(path)? {
        (gv, ns, plural, None) => Some((gv, ns, plural)),
        _ => None,
    }
}

/// `(apiVersion, namespace, plural, name)` from a collection or object path, or None.
fn object_route(path: &str) -> Option<(String, Option<String>, String, Option<String>)> {
    let seg: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (gv, rest) = match seg.as_slice() {
        ["api", v, rest @ ..] => ((*v).to_string(), rest),
        ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest),
        _ => return None,
    };
    let s = |v: &&str| (*v).to_string();
    match rest {
        [plural] => Some((gv, None, s(plural), None)),
        ["namespaces", ns, plural] => Some((gv, Some(s(ns)), s(plural), None)),
        ["namespaces", ns, plural, name] => Some((gv, Some(s(ns)), s(plural), Some(s(name)))),
        _ => None,
    }
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn line(v: &Value) -> Result<Bytes, Infallible> {
    let mut b = serde_json::to_vec(v).unwrap_or_default();
    b.push(b'\n');
    Ok(Bytes::from(b))
}

impl FakeApiServer {
    pub async fn start() -> anyhow::Result<Self> {
        let (events, _) = broadcast::channel(4096);
        let (breaker, _) = watch::channel(0);
        let (held, _) = watch::channel(false);
        let inner = Arc::new(Inner { data: Mutex::new(Data { rv: 100, ..Default::default() }), events, breaker, held });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let app = axum::Router::new().fallback(handle).with_state(inner.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, inner, task })
    }

    /// A kubeconfig pointing at this server, written to `dir/kubeconfig`.
    pub fn kubeconfig(&self, dir: &Path) -> anyhow::Result<PathBuf> {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: stand-in\n  cluster:\n    server: http://{}\n\
                 users:\n- name: host\n  user:\n    token: {TOKEN}\ncontexts:\n- name: stand-in\n  context:\n    \
                 cluster: stand-in\n    user: host\n    namespace: default\ncurrent-context: stand-in\n",
                self.addr
            ),
        )?;
        Ok(path)
    }

    fn record(&self, kind: &'static str, object: Value, delete: bool) {
        record(&self.inner, kind, object, delete);
    }

    /// Every version written of the object `plural/name` (any namespace), oldest first, each
    /// with the `metadata.resourceVersion` it got.
    pub fn history(&self, plural: &str, name: &str) -> Vec<Value> {
        let d = self.inner.data.lock().unwrap_or_else(|e| e.into_inner());
        d.history
            .iter()
            .filter(|o| {
                o["kind"].as_str().map(plural_of).as_deref() == Some(plural) && o["metadata"]["name"] == json!(name)
            })
            .cloned()
            .collect()
    }

    /// The object `plural/name` in `ns` now, if it exists.
    pub fn get(&self, api_version: &str, plural: &str, ns: &str, name: &str) -> Option<Value> {
        let d = self.inner.data.lock().unwrap_or_else(|e| e.into_inner());
        d.objects.get(&(api_version.into(), plural.into(), ns.into(), name.into())).cloned()
    }
}

/// Store a new version of `object` (or delete it) and tell the watchers; returns it as stored.
fn record(inner: &Inner, kind: &'static str, mut object: Value, delete: bool) -> Value {
    {
        let mut d = inner.data.lock().unwrap_or_else(|e| e.into_inner());
        d.rv += 1;
        let rv = d.rv;
        let api_version = object["apiVersion"].as_str().unwrap_or("v1").to_string();
        let k = object["kind"].as_str().unwrap_or_default().to_string();
        let plural = plural_of(&k);
        d.kinds.insert(plural.clone(), k);
        let ns = object["metadata"]["namespace"].as_str().unwrap_or("default").to_string();
        let name = object["metadata"]["name"].as_str().unwrap_or_default().to_string();
        let key = (api_version.clone(), plural.clone(), ns.clone(), name.clone());
        let kind = if delete {
            match d.objects.remove(&key) {
                Some(old) => object = old,
                None => return object,
            }
            "DELETED"
        } else if d.objects.contains_key(&key) {
            kind
        } else {
            "ADDED"
        };
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        object["metadata"]["namespace"] = json!(ns);
        if object["metadata"]["uid"].is_null() {
            object["metadata"]["uid"] = json!(format!("uid-{plural}-{ns}-{name}"));
        }
        if !delete {
            d.objects.insert(key, object.clone());
            d.history.push(object.clone());
        }
        let ev = Stored { rv, api_version, plural, ns, kind, object: object.clone() };
        d.log.push(ev.clone());
        let _ = inner.events.send(ev);
        object
    }
}

impl FakeApiServer {
    /// Create or replace an object (it needs `apiVersion`, `kind`, `metadata.name`).
    pub fn apply(&self, object: Value) {
        self.record("MODIFIED", object, false);
    }

    /// Delete an object; watchers get `DELETED` with its last state.
    pub fn delete(&self, api_version: &str, kind: &str, ns: &str, name: &str) {
        let object = json!({"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": ns}});
        self.record("DELETED", object, true);
    }

    /// End every open watch stream now (clients resume from their last resourceVersion).
    pub fn break_watches(&self) {
        self.inner.breaker.send_modify(|g| *g += 1);
    }

    /// Forget the event history up to now: a watch resumed from an older resourceVersion is
    /// answered `410 Gone` (`Expired`), and the client must list again.
    pub fn compact(&self) {
        let mut d = self.inner.data.lock().unwrap_or_else(|e| e.into_inner());
        d.compacted = d.rv;
        d.log.clear();
    }

    /// End every open watch and leave new ones unanswered until [`Self::release_watches`]: the
    /// client misses whatever changes meanwhile, as during an API server outage.
    pub fn hold_watches(&self) {
        self.inner.held.send_replace(true);
        self.break_watches();
    }
    pub fn release_watches(&self) {
        self.inner.held.send_replace(false);
    }

    /// How many lists / watches were served for a resource (plural).
    pub fn lists(&self, plural: &str) -> u64 {
        self.inner.data.lock().map(|d| d.lists.get(plural).copied().unwrap_or(0)).unwrap_or(0)
    }
    pub fn watches(&self, plural: &str) -> u64 {
        self.inner.data.lock().map(|d| d.watches.get(plural).copied().unwrap_or(0)).unwrap_or(0)
    }
}

async fn handle(State(inner): State<Arc<Inner>>, req: Request) -> Response {
    let authorized = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Bearer {TOKEN}"));
    if !authorized {
        return (StatusCode::UNAUTHORIZED, axum::Json(status(401, "Unauthorized", "Unauthorized"))).into_response();
    }
    if let Some((gv, Some(ns), plural, name)) = object_route(req.uri().path()) {
        if name.is_some() || req.method() != axum::http::Method::GET {
            return write(&inner, req, gv, ns, plural, name).await;
        }
    }
    let Some((gv, ns, plural)) = route(req.uri().path()) else {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(status(404, "NotFound", "the server could not find the requested resource")),
        )
            .into_response();
    };
    let query: BTreeMap<String, String> = req
        .uri()
        .query()
        .map(|q| {
            q.split('&').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
        })
        .unwrap_or_default();
    let matches = move |gv2: &str, plural2: &str, ns2: &str| {
        gv2 == gv && plural2 == plural && ns.as_deref().is_none_or(|n| n == ns2)
    };
    let watching = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    let plural = route(req.uri().path()).map(|r| r.2).unwrap_or_default();
    if !watching {
        let mut d = inner.data.lock().unwrap_or_else(|e| e.into_inner());
        *d.lists.entry(plural.clone()).or_default() += 1;
        let items: Vec<Value> =
            d.objects.iter().filter(|((g, p, n, _), _)| matches(g, p, n)).map(|(_, o)| o.clone()).collect();
        let kind = d.kinds.get(&plural).cloned().unwrap_or_default();
        let gv = route(req.uri().path()).map(|r| r.0).unwrap_or_default();
        let body = json!({"apiVersion": gv, "kind": format!("{kind}List"),
                          "metadata": {"resourceVersion": d.rv.to_string()}, "items": items});
        return axum::Json(body).into_response();
    }

    // A watch: replay history after `resourceVersion`, then follow live events.
    // Subscribe to breaks before anything else, so a break during this request ends it too.
    let mut breaker = inner.breaker.subscribe();
    let mut held = inner.held.subscribe();
    let _ = held.wait_for(|h| !*h).await;
    let broken = breaker.has_changed().unwrap_or(true);
    let from: u64 = query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    let timeout = Duration::from_secs(query.get("timeoutSeconds").and_then(|v| v.parse().ok()).unwrap_or(290));
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(256);
    let mut live = inner.events.subscribe();
    let (backlog, gone) = {
        let mut d = inner.data.lock().unwrap_or_else(|e| e.into_inner());
        *d.watches.entry(plural).or_default() += 1;
        if from < d.compacted {
            (Vec::new(), Some(d.compacted))
        } else {
            (d.log.iter().filter(|e| e.rv > from && matches(&e.api_version, &e.plural, &e.ns)).cloned().collect(), None)
        }
    };
    tokio::spawn(async move {
        if broken {
            return;
        }
        if let Some(now) = gone {
            let msg = format!("too old resource version: {from} ({now})");
            let _ = tx.send(line(&json!({"type": "ERROR", "object": status(410, "Expired", &msg)}))).await;
            return;
        }
        let mut last = from;
        for e in backlog {
            last = e.rv;
            if tx.send(line(&json!({"type": e.kind, "object": e.object}))).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                biased;
                _ = breaker.changed() => return,
                ev = live.recv() => match ev {
                    Ok(e) if e.rv > last && matches(&e.api_version, &e.plural, &e.ns) => {
                        last = e.rv;
                        if tx.send(line(&json!({"type": e.kind, "object": e.object}))).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => return,
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = &mut deadline => return,
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn reply(code: StatusCode, body: Value) -> Response {
    (code, axum::Json(body)).into_response()
}

/// One object: read, create, replace (resourceVersion-checked) or delete.
async fn write(inner: &Inner, req: Request, gv: String, ns: String, plural: String, name: Option<String>) -> Response {
    let method = req.method().clone();
    let body = axum::body::to_bytes(req.into_body(), 8 << 20).await.unwrap_or_default();
    let sent: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let name = name.or_else(|| sent["metadata"]["name"].as_str().map(str::to_owned)).unwrap_or_default();
    let key = (gv.clone(), plural.clone(), ns.clone(), name.clone());
    let current = inner.data.lock().unwrap_or_else(|e| e.into_inner()).objects.get(&key).cloned();
    let not_found = || reply(StatusCode::NOT_FOUND, status(404, "NotFound", &format!("{plural} \"{name}\" not found")));
    let mut object = sent.clone();
    if object.is_object() {
        object["metadata"]["namespace"] = json!(ns);
    }
    match method.as_str() {
        "GET" => current.map_or_else(not_found, |o| reply(StatusCode::OK, o)),
        "POST" if current.is_some() => {
            reply(StatusCode::CONFLICT, status(409, "AlreadyExists", &format!("{plural} \"{name}\" already exists")))
        }
        "POST" => {
            object["metadata"]["resourceVersion"] = Value::Null;
            reply(StatusCode::CREATED, record(inner, "ADDED", object, false))
        }
        "PUT" => {
            let Some(current) = current else { return not_found() };
            let want = sent["metadata"]["resourceVersion"].as_str().unwrap_or_default();
            if !want.is_empty() && Some(want) != current["metadata"]["resourceVersion"].as_str() {
                let msg = format!(
                    "Operation cannot be fulfilled on {plural} \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
                );
                return reply(StatusCode::CONFLICT, status(409, "Conflict", &msg));
            }
            reply(StatusCode::OK, record(inner, "MODIFIED", object, false))
        }
        "DELETE" => match current {
            Some(o) => {
                record(inner, "DELETED", o, true);
                reply(StatusCode::OK, status(200, "", "deleted"))
            }
            None => not_found(),
        },
        _ => reply(StatusCode::METHOD_NOT_ALLOWED, status(405, "MethodNotAllowed", "method not allowed")),
    }
}

/// A pod as the kubelet reports it: labels, annotations, pod IP, and the `Ready` condition.
pub fn pod(ns: &str, name: &str, labels: &[(&str, &str)], ip: &str, ready: bool) -> Value {
    let labels: serde_json::Map<String, Value> = labels.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}
    })
}

/// An `InferencePool` (`inference.networking.k8s.io/v1`) selecting `app=<app>` on `ports`.
pub fn pool(ns: &str, name: &str, app: &str, ports: &[u16]) -> Value {
    let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
    json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"selector": {"matchLabels": {"app": app}}, "targetPorts": ports,
                 "endpointPickerRef": {"name": "attache", "port": {"number": 9002}}}
    })
}

/// An `InferenceObjective` (`inference.networking.x-k8s.io/v1alpha2`).
pub fn objective(ns: &str, name: &str, pool: &str, priority: i32) -> Value {
    json!({
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"priority": priority, "poolRef": {"name": pool}}
    })
}
