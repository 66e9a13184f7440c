//! The in-memory Responses store: each stored response is a record in its tenant's LRU, and
//! its conversation a node in a persistent list shared with the responses that continue it.
//!
//! - **O(1) resolution.** A node holds its own turn (input and output items) and an `Arc` to
//!   the node of the response it continued, so resolving a chain is one map lookup and a walk
//!   of pointers already in memory, however long the chain; nothing is copied per turn.
//! - **Bounded.** The bytes counted are the bytes alive: a node's are freed when the last
//!   record or node that holds it goes. Past `max_bytes` or `max_responses`, the tenant holding
//!   the most bytes loses its least recently used record first (each tenant's fair share),
//!   until the store is back under its bounds. An evicted response's ancestors stay alive only
//!   while a later turn of its chain is kept.
//! - **TTL.** A record older than `ttl` resolves as evicted.
//! - **Isolation.** Records live in their tenant's map: another tenant's id is simply absent.

use std::hash::{Hash, Hasher};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use lru::LruCache;

/// How many evicted ids are remembered, to answer "evicted" rather than "not found".
const EVICTED_MEMORY: usize = 65_536;
/// Per-record overhead counted on top of its text (the map entries, the node, the id).
const RECORD_OVERHEAD: usize = 160;

/// The store's bounds.
#[derive(Clone, Debug)]
pub struct Limits {
    pub max_responses: usize,
    pub max_bytes: usize,
    pub ttl: Duration,
}

/// Bytes alive, for the whole store or one tenant.
#[derive(Default, Debug)]
pub struct Usage(AtomicUsize);

impl Usage {
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
    fn add(&self, n: usize) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    fn sub(&self, n: usize) {
        self.0.fetch_sub(n, Ordering::Relaxed);
    }
}

/// One turn of a conversation: its input items and the response's output items (each the
/// inner text of a JSON array, without its brackets), after the turn it continued.
struct Node {
    input: Box<str>,
    output: Box<str>,
    prev: Option<Arc<Node>>,
    bytes: usize,
    usage: [Arc<Usage>; 2],
}

impl Node {
    fn new(input: Box<str>, output: Box<str>, prev: Option<Arc<Node>>, usage: [Arc<Usage>; 2]) -> Self {
        let bytes = input.len() + output.len() + std::mem::size_of::<Self>();
        usage.iter().for_each(|u| u.add(bytes));
        Self { input, output, prev, bytes, usage }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.usage.iter().for_each(|u| u.sub(self.bytes));
        // Unlink iteratively: a long chain freed at once must not recurse once per turn.
        let mut next = self.prev.take();
        while let Some(n) = next {
            match Arc::try_unwrap(n) {
                Ok(mut inner) => next = inner.prev.take(),
                Err(_) => break,
            }
        }
    }
}

/// One stored response.
struct Record {
    node: Arc<Node>,
    /// The response object without its `output` (spliced back in when it is read).
    meta: Box<str>,
    /// Items in this turn's input (the input_items listing numbers them).
    input_count: usize,
    stored: Instant,
    /// Counted in the tenant's and the store's bytes besides the node.
    bytes: usize,
}

struct Tenant {
    records: LruCache<String, Record>,
    usage: Arc<Usage>,
}

/// A new response to keep.
pub struct NewResponse<'a> {
    pub tenant: &'a str,
    pub id: &'a str,
    pub previous_id: Option<&'a str>,
    /// This turn's input items: a JSON array.
    pub input_items: &'a str,
    /// The response object, JSON.
    pub response: &'a str,
}

/// A response split as the store keeps it: its input and output items (each the inner text of
/// a JSON array) and the response object without `output`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parts {
    pub input: String,
    pub input_count: usize,
    pub output: String,
    pub meta: String,
}

impl Parts {
    pub fn parse(r: &NewResponse<'_>) -> Result<Self, StoreError> {
        let input: serde_json::Value =
            serde_json::from_str(r.input_items).map_err(|e| StoreError::BadInput(e.to_string()))?;
        let input_count = input.as_array().map(Vec::len).ok_or_else(|| StoreError::BadInput("not an array".into()))?;
        let input = array_inner(&input).ok_or_else(|| StoreError::BadInput("not an array".into()))?;
        let mut response: serde_json::Value =
            serde_json::from_str(r.response).map_err(|e| StoreError::BadResponse(e.to_string()))?;
        let output = response
            .as_object_mut()
            .and_then(|o| o.remove("output"))
            .and_then(|o| array_inner(&o))
            .ok_or_else(|| StoreError::BadResponse("no output array".into()))?;
        Ok(Self { input, input_count, output, meta: response.to_string() })
    }
}

/// Why a response was not kept.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    #[error("the response it continues ({0}) is no longer stored")]
    PreviousGone(String),
    #[error("the input items are not a JSON array: {0}")]
    BadInput(String),
    #[error("the response is not a JSON object with an `output` array: {0}")]
    BadResponse(String),
    #[error("the response takes {0} bytes, more than the store's bound")]
    TooLarge(usize),
}

/// What resolving an id found.
#[derive(Debug, PartialEq, Eq)]
pub enum Resolved {
    /// The conversation's items, a JSON array, oldest first.
    Found(String),
    NotFound,
    Evicted,
    /// Not held here, and Redis behind the store could not be asked.
    Unavailable,
    /// A background response still queued or running: no output to continue from yet.
    Pending,
}

/// A kept response's lifecycle, from its object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    /// `completed`, `incomplete`, `queued`, `in_progress`, `failed` or `cancelled`.
    pub status: String,
    pub background: bool,
}

impl State {
    /// A background response that has not ended: queued or running.
    pub fn pending(&self) -> bool {
        self.background && matches!(self.status.as_str(), "queued" | "in_progress")
    }
}

/// Why records left the store.
#[derive(Default, Debug, Clone, Copy)]
pub struct Evictions {
    pub bytes: u64,
    pub count: u64,
    pub expired: u64,
}

/// The store.
pub struct ResponseStore {
    limits: Limits,
    tenants: HashMap<Arc<str>, Tenant>,
    usage: Arc<Usage>,
    records: usize,
    evicted: LruCache<u64, ()>,
    pub evictions: Evictions,
}

fn id_key(tenant: &str, id: &str) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    (tenant, id).hash(&mut h);
    h.finish()
}

/// The inner text of a JSON array (`[a,b]` → `a,b`), after checking it is one.
fn array_inner(v: &serde_json::Value) -> Option<String> {
    let s = serde_json::to_string(v.as_array()?).ok()?;
    Some(s[1..s.len() - 1].to_owned())
}

impl ResponseStore {
    pub fn new(limits: Limits) -> Self {
        let cap = NonZeroUsize::new(EVICTED_MEMORY).unwrap_or(NonZeroUsize::MIN);
        Self {
            limits,
            tenants: HashMap::new(),
            usage: Arc::default(),
            records: 0,
            evicted: LruCache::new(cap),
            evictions: Evictions::default(),
        }
    }

    /// Records kept.
    pub fn len(&self) -> usize {
        self.records
    }

    pub fn is_empty(&self) -> bool {
        self.records == 0
    }

    /// Bytes alive (records and every node they hold).
    pub fn bytes(&self) -> usize {
        self.usage.get()
    }

    /// Tenants holding records.
    pub fn tenants(&self) -> usize {
        self.tenants.len()
    }

    /// Keep a response. Replaces an earlier record of the same id.
    pub fn store(&mut self, r: &NewResponse<'_>, now: Instant) -> Result<Parts, StoreError> {
        let parts = Parts::parse(r)?;
        self.insert(r.tenant, r.id, r.previous_id, &parts, now)?;
        Ok(parts)
    }

    /// Whether `id` is held for `tenant` (not refreshed in its LRU).
    pub fn contains(&self, tenant: &str, id: &str) -> bool {
        self.tenants.get(tenant).is_some_and(|t| t.records.contains(id))
    }

    /// Keep a response already split into its parts (a new one, or one read back from Redis).
    pub fn insert(
        &mut self,
        tenant: &str,
        id: &str,
        previous_id: Option<&str>,
        parts: &Parts,
        now: Instant,
    ) -> Result<(), StoreError> {
        let size = parts.input.len() + parts.output.len() + parts.meta.len() + RECORD_OVERHEAD;
        if size > self.limits.max_bytes {
            return Err(StoreError::TooLarge(size));
        }
        let prev = match previous_id.filter(|p| !p.is_empty()) {
            None => None,
            Some(p) => match self.record(tenant, p, now) {
                Some(rec) => Some(rec.node.clone()),
                None => return Err(StoreError::PreviousGone(p.to_owned())),
            },
        };
        let total = self.usage.clone();
        let tenant_usage = self.tenant(tenant).usage.clone();
        let node = Node::new(
            parts.input.as_str().into(),
            parts.output.as_str().into(),
            prev,
            [tenant_usage.clone(), total.clone()],
        );
        let bytes = parts.meta.len() + RECORD_OVERHEAD;
        tenant_usage.add(bytes);
        total.add(bytes);
        let record = Record {
            node: Arc::new(node),
            meta: parts.meta.as_str().into(),
            input_count: parts.input_count,
            stored: now,
            bytes,
        };
        let t = self.tenant(tenant);
        if let Some(old) = t.records.put(id.to_owned(), record) {
            t.usage.sub(old.bytes);
            self.usage.sub(old.bytes);
        } else {
            self.records += 1;
        }
        self.evicted.pop(&id_key(tenant, id));
        self.enforce();
        Ok(())
    }

    /// The conversation ending with `id`'s output.
    pub fn resolve(&mut self, tenant: &str, id: &str, now: Instant) -> Resolved {
        let Some(rec) = self.record(tenant, id, now) else {
            return if self.evicted.contains(&id_key(tenant, id)) { Resolved::Evicted } else { Resolved::NotFound };
        };
        let mut chain = Vec::new();
        let mut node = Some(&rec.node);
        let mut len = 2;
        while let Some(n) = node {
            len += n.input.len() + n.output.len() + 2;
            chain.push(&**n);
            node = n.prev.as_ref();
        }
        let mut out = String::with_capacity(len);
        out.push('[');
        for n in chain.iter().rev() {
            for part in [&n.input, &n.output] {
                if part.is_empty() {
                    continue;
                }
                if out.len() > 1 {
                    out.push(',');
                }
                out.push_str(part);
            }
        }
        out.push(']');
        Resolved::Found(out)
    }

    /// The response object, as `GET /v1/responses/{id}` answers it.
    pub fn response(&mut self, tenant: &str, id: &str, now: Instant) -> Option<String> {
        let rec = self.record(tenant, id, now)?;
        let meta = rec.meta.strip_suffix('}')?;
        let sep = if meta.ends_with('{') { "" } else { "," };
        Some(format!("{meta}{sep}\"output\":[{}]}}", rec.node.output))
    }

    /// The response object's `status` and whether it is a background response, read from
    /// its stored object.
    pub fn state(&mut self, tenant: &str, id: &str, now: Instant) -> Option<State> {
        #[derive(serde::Deserialize)]
        struct Head {
            status: Option<String>,
            #[serde(default)]
            background: Option<bool>,
        }
        let rec = self.record(tenant, id, now)?;
        let head: Head = serde_json::from_str(&rec.meta).ok()?;
        Some(State { status: head.status.unwrap_or_default(), background: head.background.unwrap_or(false) })
    }

    /// The response object without `output` (a JSON object), as stored.
    pub fn meta(&mut self, tenant: &str, id: &str, now: Instant) -> Option<String> {
        Some(self.record(tenant, id, now)?.meta.to_string())
    }

    /// Replace a kept response's object and output (a background response that ran), keeping
    /// its turn's input and the chain it continues. Returns its parts as now kept, or `None`
    /// when it is no longer held.
    pub fn update(&mut self, tenant: &str, id: &str, meta: &str, output: &str, now: Instant) -> Option<Parts> {
        let (node, input_count, old_bytes) = {
            let rec = self.record(tenant, id, now)?;
            (rec.node.clone(), rec.input_count, rec.bytes)
        };
        let usage = node.usage.clone();
        let new_node = Node::new(node.input.clone(), output.into(), node.prev.clone(), usage);
        let bytes = meta.len() + RECORD_OVERHEAD;
        let parts =
            Parts { input: node.input.to_string(), input_count, output: output.to_owned(), meta: meta.to_owned() };
        drop(node);
        let t = self.tenants.get_mut(tenant)?;
        let rec = t.records.get_mut(id)?;
        rec.node = Arc::new(new_node);
        rec.meta = meta.into();
        rec.bytes = bytes;
        t.usage.add(bytes);
        t.usage.sub(old_bytes);
        self.usage.add(bytes);
        self.usage.sub(old_bytes);
        self.enforce();
        Some(parts)
    }

    /// This turn's input items (a JSON array) and their count.
    pub fn input_items(&mut self, tenant: &str, id: &str, now: Instant) -> Option<(String, usize)> {
        let rec = self.record(tenant, id, now)?;
        Some((format!("[{}]", rec.node.input), rec.input_count))
    }

    /// Forget `id`. False: not stored for this tenant.
    pub fn delete(&mut self, tenant: &str, id: &str) -> bool {
        let Some(t) = self.tenants.get_mut(tenant) else { return false };
        let Some(rec) = t.records.pop(id) else { return false };
        self.drop_record(tenant, rec);
        true
    }

    /// Drop what has expired from the least recently used end of every tenant's list (what a
    /// read would find expired is dropped then).
    pub fn expire(&mut self, now: Instant) {
        let ttl = self.limits.ttl;
        let names: Vec<Arc<str>> = self.tenants.keys().cloned().collect();
        for name in names {
            while let Some(t) = self.tenants.get_mut(&*name) {
                let Some((_, rec)) = t.records.peek_lru() else { break };
                if now.duration_since(rec.stored) < ttl {
                    break;
                }
                let Some((id, rec)) = t.records.pop_lru() else { break };
                self.evicted.put(id_key(&name, &id), ());
                self.evictions.expired += 1;
                self.drop_record(&name, rec);
            }
        }
    }

    fn tenant(&mut self, name: &str) -> &mut Tenant {
        self.tenants.entry_ref(name).or_insert_with(|| Tenant { records: LruCache::unbounded(), usage: Arc::default() })
    }

    /// A live record (refreshed in its tenant's LRU); an expired one is dropped.
    fn record(&mut self, tenant: &str, id: &str, now: Instant) -> Option<&Record> {
        let ttl = self.limits.ttl;
        let t = self.tenants.get_mut(tenant)?;
        let expired = now.duration_since(t.records.peek(id)?.stored) >= ttl;
        if expired {
            let rec = t.records.pop(id)?;
            self.drop_record(tenant, rec);
            self.evicted.put(id_key(tenant, id), ());
            self.evictions.expired += 1;
            return None;
        }
        self.tenants.get_mut(tenant)?.records.get(id)
    }

    fn drop_record(&mut self, tenant: &str, rec: Record) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.usage.sub(rec.bytes);
        }
        self.usage.sub(rec.bytes);
        self.records -= 1;
        drop(rec);
        if self.tenants.get(tenant).is_some_and(|t| t.records.is_empty()) {
            self.tenants.remove(tenant);
        }
    }

    /// Evict until the store is within its bounds: each time, the least recently used record
    /// of the tenant holding the most bytes.
    fn enforce(&mut self) {
        while self.usage.get() > self.limits.max_bytes || self.records > self.limits.max_responses {
            let over_bytes = self.usage.get() > self.limits.max_bytes;
            let Some(name) = self.tenants.iter().max_by_key(|(_, t)| t.usage.get()).map(|(n, _)| n.clone()) else {
                break;
            };
            let Some(t) = self.tenants.get_mut(&*name) else { break };
            let Some((id, rec)) = t.records.pop_lru() else {
                self.tenants.remove(&*name);
                continue;
            };
            self.evicted.put(id_key(&name, &id), ());
            self.drop_record(&name, rec);
            if over_bytes {
                self.evictions.bytes += 1;
            } else {
                self.evictions.count += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_bytes: usize) -> Limits {
        Limits { max_responses: 1000, max_bytes, ttl: Duration::from_secs(60) }
    }

    fn response(id: &str, text: &str) -> String {
        serde_json::json!({"id": id, "object": "response", "status": "completed", "output": [
            {"type": "message", "id": format!("msg_{id}"), "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": text, "annotations": []}]}]})
        .to_string()
    }

    fn turn(s: &mut ResponseStore, tenant: &str, id: &str, prev: Option<&str>, said: &str, now: Instant) {
        let input = serde_json::json!([{"role": "user", "content": said}]).to_string();
        let resp = response(id, &format!("answer to {said}"));
        let r = NewResponse { tenant, id, previous_id: prev, input_items: &input, response: &resp };
        s.store(&r, now).expect("stored");
    }

    fn texts(items: &str) -> Vec<String> {
        let v: Vec<serde_json::Value> = serde_json::from_str(items).expect("an array");
        v.iter()
            .map(|i| match &i["content"] {
                serde_json::Value::String(s) => s.clone(),
                c => c[0]["text"].as_str().unwrap_or_default().to_owned(),
            })
            .collect()
    }

    #[test]
    fn a_chain_resolves_to_the_whole_conversation_for_its_tenant_only() {
        let now = Instant::now();
        let mut s = ResponseStore::new(limits(1 << 20));
        turn(&mut s, "a", "r1", None, "one", now);
        turn(&mut s, "a", "r2", Some("r1"), "two", now);
        turn(&mut s, "a", "r3", Some("r2"), "three", now);
        let Resolved::Found(items) = s.resolve("a", "r3", now) else { panic!("r3 resolves") };
        assert_eq!(texts(&items), ["one", "answer to one", "two", "answer to two", "three", "answer to three"]);
        // A branch from r1 sees only r1's conversation.
        turn(&mut s, "a", "r2b", Some("r1"), "other", now);
        let Resolved::Found(items) = s.resolve("a", "r2b", now) else { panic!() };
        assert_eq!(texts(&items), ["one", "answer to one", "other", "answer to other"]);
        assert_eq!(s.resolve("b", "r3", now), Resolved::NotFound, "another tenant");
        assert_eq!(s.resolve("a", "nope", now), Resolved::NotFound);
        let got: serde_json::Value = serde_json::from_str(&s.response("a", "r2", now).unwrap()).unwrap();
        assert_eq!(
            (got["id"].as_str(), got["output"][0]["content"][0]["text"].as_str()),
            (Some("r2"), Some("answer to two"))
        );
        assert_eq!(s.input_items("a", "r3", now).map(|(_, n)| n), Some(1));
        // Continuing a response of another tenant is refused.
        let r = NewResponse {
            tenant: "b",
            id: "x",
            previous_id: Some("r3"),
            input_items: "[]",
            response: &response("x", "y"),
        };
        assert_eq!(s.store(&r, now).map(|_| ()), Err(StoreError::PreviousGone("r3".into())));
    }

    #[test]
    fn a_background_response_is_updated_in_place_and_keeps_its_chain() {
        let now = Instant::now();
        let mut s = ResponseStore::new(limits(1 << 20));
        turn(&mut s, "a", "r1", None, "one", now);
        let queued = r#"{"id":"bg","object":"response","status":"queued","background":true,"output":[]}"#;
        let input = r#"[{"role":"user","content":"two"}]"#;
        let r = NewResponse { tenant: "a", id: "bg", previous_id: Some("r1"), input_items: input, response: queued };
        s.store(&r, now).unwrap();
        let st = s.state("a", "bg", now).unwrap();
        assert!(st.pending() && st.status == "queued", "{st:?}");
        assert!(!s.state("a", "r1", now).unwrap().pending());
        let (before, meta_before) = (s.bytes(), s.meta("a", "bg", now).unwrap().len());
        let done = r#"{"id":"bg","object":"response","status":"completed","background":true}"#;
        let output =
            r#"{"type":"message","role":"assistant","content":[{"type":"output_text","text":"answer to two"}]}"#;
        let parts = s.update("a", "bg", done, output, now).unwrap();
        assert_eq!((parts.input_count, parts.output.as_str()), (1, output));
        assert_eq!(s.state("a", "bg", now).unwrap().status, "completed");
        let Resolved::Found(items) = s.resolve("a", "bg", now) else { panic!("bg resolves") };
        assert_eq!(texts(&items), ["one", "answer to one", "two", "answer to two"]);
        assert_eq!(s.bytes(), before - meta_before + done.len() + output.len(), "the old turn's bytes are freed");
        assert_eq!(s.update("b", "bg", done, "", now), None, "another tenant's id");
    }

    #[test]
    fn the_bounds_evict_the_heaviest_tenants_least_recently_used_and_free_their_bytes() {
        let now = Instant::now();
        let mut s = ResponseStore::new(limits(64 * 1024));
        // Tenant "small" keeps a few; tenant "big" sends far more than the bound.
        for i in 0..4 {
            turn(&mut s, "small", &format!("s{i}"), None, &"x".repeat(500), now);
        }
        let mut prev: Option<String> = None;
        for i in 0..400 {
            let id = format!("b{i}");
            // Chains of 10 turns.
            let p = if i % 10 == 0 { None } else { prev.clone() };
            turn(&mut s, "big", &id, p.as_deref(), &"y".repeat(1000), now);
            prev = Some(id);
            assert!(s.bytes() <= 64 * 1024, "over the bound after {i}: {}", s.bytes());
        }
        for i in 0..4 {
            assert!(matches!(s.resolve("small", &format!("s{i}"), now), Resolved::Found(_)), "small's share kept");
        }
        assert!(matches!(s.resolve("big", "b399", now), Resolved::Found(_)), "the newest kept");
        assert_eq!(s.resolve("big", "b0", now), Resolved::Evicted, "the oldest evicted, and said so");
        assert!(s.evictions.bytes > 300, "{:?}", s.evictions);
        // Deleting everything frees every byte.
        for t in ["small", "big"] {
            for i in 0..400 {
                s.delete(t, &format!("{}{i}", &t[..1]));
            }
        }
        assert_eq!((s.len(), s.bytes(), s.tenants()), (0, 0, 0));
    }

    #[test]
    fn records_expire_and_count_bounds_hold() {
        let now = Instant::now();
        let mut s = ResponseStore::new(Limits { max_responses: 3, max_bytes: 1 << 20, ttl: Duration::from_secs(10) });
        for i in 0..5 {
            turn(&mut s, "a", &format!("r{i}"), None, "hi", now);
        }
        assert_eq!((s.len(), s.evictions.count), (3, 2));
        let later = now + Duration::from_secs(11);
        assert_eq!(s.resolve("a", "r4", later), Resolved::Evicted, "expired");
        s.expire(later);
        assert_eq!((s.len(), s.bytes()), (0, 0));
    }

    #[test]
    fn a_long_chain_is_freed_without_recursing() {
        let now = Instant::now();
        let mut s = ResponseStore::new(Limits { max_responses: 1, max_bytes: 1 << 30, ttl: Duration::from_secs(60) });
        let mut prev: Option<String> = None;
        for i in 0..200_000 {
            let id = format!("r{i}");
            let r = NewResponse {
                tenant: "a",
                id: &id,
                previous_id: prev.as_deref(),
                input_items: "[1]",
                response: r#"{"output":[2]}"#,
            };
            s.store(&r, now).unwrap();
            prev = Some(id);
        }
        let Resolved::Found(items) = s.resolve("a", "r199999", now) else { panic!() };
        assert_eq!(items.len(), 2 + 200_000 * 4 - 1);
        s.delete("a", "r199999");
        assert_eq!(s.bytes(), 0);
    }
}
