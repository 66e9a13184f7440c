//! The queue of requests waiting for the pool: strict priority bands; inside a band, the
//! least-served tenant goes first (least attained service over decayed estimated tokens, so
//! fairness is by tokens, not requests, and can count service given by other workers); each
//! tenant's requests in arrival order.

use std::collections::{BTreeMap, HashMap, VecDeque};

use super::fairness::Rivals;
use super::{FlowConfig, RequestClass};

/// Why a request left (or never entered) the queue without being served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// Sheddable (priority < 0) while saturated.
    Sheddable,
    /// The band's request or byte limit.
    BandFull,
    /// The global request or byte limit.
    QueueFull,
    /// Waited longer than its TTL while the pool had endpoints.
    Expired,
    /// The pool has no ready endpoint (at arrival, or still when the TTL ran out).
    NoEndpoints,
}

impl Shed {
    /// `x-attache-dropped-reason`, and the metric's name segment.
    pub fn reason(self) -> &'static str {
        match self {
            Shed::Sheddable => "sheddable",
            Shed::BandFull => "band_full",
            Shed::QueueFull => "queue_full",
            Shed::Expired => "ttl_expired",
            Shed::NoEndpoints => "no_endpoints",
        }
    }

    /// 503 when there is nothing to serve the request, 429 (back-pressure) otherwise.
    pub fn status(self) -> u16 {
        match self {
            Shed::NoEndpoints => 503,
            _ => 429,
        }
    }

    pub const ALL: [Shed; 5] = [Shed::Sheddable, Shed::BandFull, Shed::QueueFull, Shed::Expired, Shed::NoEndpoints];
}

#[derive(Debug)]
struct Item<T> {
    id: u64,
    continuing: bool,
    bytes: usize,
    tokens: u64,
    enqueued_ms: u64,
    deadline_ms: u64,
    value: T,
}

#[derive(Debug)]
struct Band<T> {
    /// Per tenant, FCFS.
    flows: HashMap<String, VecDeque<Item<T>>>,
    /// Tenants with queued items; ties on usage go to the one nearest the front, and a tenant
    /// just served goes to the back.
    order: VecDeque<String>,
    requests: usize,
    bytes: usize,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Self { flows: HashMap::new(), order: VecDeque::new(), requests: 0, bytes: 0 }
    }
}

/// A request taken out of the queue, with what the caller accounts it by.
#[derive(Debug)]
pub struct Popped<T> {
    pub id: u64,
    pub priority: i32,
    pub tenant: String,
    /// Estimated tokens (prompt plus expected output).
    pub tokens: u64,
    pub bytes: usize,
    pub enqueued_ms: u64,
    pub value: T,
}

/// The waiting requests of one scheduler instance (one Envoy worker).
#[derive(Debug)]
pub struct FlowQueue<T> {
    bands: BTreeMap<i32, Band<T>>,
    /// id → (priority, tenant), to find an item on removal.
    index: HashMap<u64, (i32, String)>,
    requests: usize,
    bytes: usize,
}

impl<T> Default for FlowQueue<T> {
    fn default() -> Self {
        Self { bands: BTreeMap::new(), index: HashMap::new(), requests: 0, bytes: 0 }
    }
}

impl<T> FlowQueue<T> {
    pub fn len(&self) -> usize {
        self.requests
    }

    pub fn is_empty(&self) -> bool {
        self.requests == 0
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn contains(&self, id: u64) -> bool {
        self.index.contains_key(&id)
    }

    /// The highest band with queued requests.
    pub fn top_priority(&self) -> Option<i32> {
        self.bands.keys().next_back().copied()
    }

    /// Queued requests per (priority, tenant), highest band first.
    pub fn depths(&self) -> Vec<(i32, String, usize)> {
        let mut out = Vec::new();
        for (p, b) in self.bands.iter().rev() {
            for t in &b.order {
                if let Some(q) = b.flows.get(t) {
                    out.push((*p, t.clone(), q.len()));
                }
            }
        }
        out
    }

    /// Queue a request, or say why it cannot wait.
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue(
        &mut self,
        cfg: &FlowConfig,
        id: u64,
        class: &RequestClass,
        bytes: usize,
        tokens: u64,
        now_ms: u64,
        value: T,
    ) -> Result<(), Shed> {
        let limits = cfg.band(class.priority);
        if self.requests + 1 > cfg.max_requests || self.bytes + bytes > cfg.max_bytes {
            return Err(Shed::QueueFull);
        }
        if self.index.contains_key(&id) {
            // An id is queued once; callers use unique ids (Envoy's context ids).
            return Err(Shed::QueueFull);
        }
        let band = self.bands.entry(class.priority).or_default();
        if band.requests + 1 > limits.max_requests || band.bytes + bytes > limits.max_bytes {
            if band.requests == 0 {
                self.bands.remove(&class.priority);
            }
            return Err(Shed::BandFull);
        }
        let flow = band.flows.entry(class.tenant.clone()).or_default();
        if flow.is_empty() {
            band.order.push_back(class.tenant.clone());
        }
        let item = Item {
            id,
            continuing: class.continuing,
            bytes,
            tokens: tokens.max(1),
            enqueued_ms: now_ms,
            deadline_ms: now_ms.saturating_add(cfg.ttl_ms),
            value,
        };
        if class.continuing {
            // Behind the other continuing turns, ahead of new sessions.
            let at = flow.iter().take_while(|i| i.continuing).count();
            flow.insert(at, item);
        } else {
            flow.push_back(item);
        }
        band.requests += 1;
        band.bytes += bytes;
        self.requests += 1;
        self.bytes += bytes;
        self.index.insert(id, (class.priority, class.tenant.clone()));
        Ok(())
    }

    fn take(&mut self, priority: i32, tenant: &str, pos: usize) -> Option<Popped<T>> {
        let band = self.bands.get_mut(&priority)?;
        let flow = band.flows.get_mut(tenant)?;
        let item = flow.remove(pos)?;
        if flow.is_empty() {
            band.flows.remove(tenant);
            band.order.retain(|t| t != tenant);
        }
        band.requests -= 1;
        band.bytes -= item.bytes;
        self.requests -= 1;
        self.bytes -= item.bytes;
        self.index.remove(&item.id);
        if band.requests == 0 {
            self.bands.remove(&priority);
        }
        Some(Popped {
            id: item.id,
            priority,
            tenant: tenant.to_owned(),
            tokens: item.tokens,
            bytes: item.bytes,
            enqueued_ms: item.enqueued_ms,
            value: item.value,
        })
    }

    /// The next request to dispatch, if one may go now:
    /// - the highest band with work, unless another worker (`rivals`) waits with a higher
    ///   one, or `open(priority)` says the pool has no room for that band;
    /// - in it, the tenant with the least `usage` (ties: the one served longest ago), unless a
    ///   tenant waiting on another worker has had more than `slack` less;
    /// - that tenant's oldest request.
    pub fn pop(
        &mut self,
        usage: impl Fn(&str) -> f64,
        rivals: &Rivals,
        slack: f64,
        open: impl Fn(i32) -> bool,
    ) -> Option<Popped<T>> {
        let (&priority, band) = self.bands.iter_mut().next_back()?;
        if rivals.top().is_some_and(|p| p > priority) || !open(priority) {
            return None;
        }
        let mut best: Option<(usize, f64)> = None;
        for (i, t) in band.order.iter().enumerate() {
            let u = usage(t);
            if best.is_none_or(|(_, b)| u < b) {
                best = Some((i, u));
            }
        }
        let (pos, u) = best?;
        if rivals.least_usage(priority).is_some_and(|m| u > m + slack) {
            return None;
        }
        let tenant = band.order.remove(pos)?;
        band.order.push_back(tenant.clone());
        self.take(priority, &tenant, 0)
    }

    /// The next request flow control lets go at `saturation`: [`Self::pop`] with the
    /// configured quantum as the fairness slack, and a band open while the saturation is under
    /// its ceiling.
    pub fn dispatch(
        &mut self,
        cfg: &FlowConfig,
        saturation: f64,
        usage: impl Fn(&str) -> f64,
        rivals: &Rivals,
    ) -> Option<Popped<T>> {
        self.pop(usage, rivals, cfg.quantum_tokens as f64, |prio| saturation < cfg.band(prio).ceiling)
    }

    /// Remove a request (its client went away).
    pub fn remove(&mut self, id: u64) -> Option<Popped<T>> {
        let (priority, tenant) = self.index.get(&id).cloned()?;
        let pos = self.bands.get(&priority)?.flows.get(&tenant)?.iter().position(|i| i.id == id)?;
        self.take(priority, &tenant, pos)
    }

    /// Remove and return every request whose TTL has passed.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Popped<T>> {
        let mut dead = Vec::new();
        for (p, b) in &self.bands {
            for (t, f) in &b.flows {
                // Turn priority reorders a tenant's queue, so check every item.
                for i in f.iter().filter(|i| i.deadline_ms <= now_ms) {
                    dead.push((*p, t.clone(), i.id));
                }
            }
        }
        let mut out = Vec::with_capacity(dead.len());
        for (p, t, id) in dead {
            if let Some(pos) =
                self.bands.get(&p).and_then(|b| b.flows.get(&t)).and_then(|f| f.iter().position(|i| i.id == id))
            {
                out.extend(self.take(p, &t, pos));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::{jain_index, BandLimits, RequestClass};
    use super::*;

    fn class(p: i32, t: &str) -> RequestClass {
        RequestClass { priority: p, tenant: t.into(), continuing: false }
    }

    /// Pop everything, charging each tenant its tokens (one worker, no rivals).
    fn drain<T>(q: &mut FlowQueue<T>) -> Vec<Popped<T>> {
        let mut used: HashMap<String, f64> = HashMap::new();
        let mut out = Vec::new();
        loop {
            let u = used.clone();
            let Some(p) = q.pop(|t| u.get(t).copied().unwrap_or(0.0), &Rivals::default(), 0.0, |_| true) else {
                break;
            };
            *used.entry(p.tenant.clone()).or_default() += p.tokens as f64;
            out.push(p);
        }
        out
    }

    #[test]
    fn a_band_goes_only_while_the_saturation_is_under_its_ceiling() {
        let cfg = FlowConfig::default();
        let mut q = FlowQueue::default();
        q.enqueue(&cfg, 1, &class(0, "a"), 10, 100, 0, 1u64).unwrap();
        let ceiling = cfg.band(0).ceiling;
        assert!(q.dispatch(&cfg, ceiling, |_| 0.0, &Rivals::default()).is_none(), "at the ceiling it waits");
        assert_eq!(q.dispatch(&cfg, ceiling - 0.01, |_| 0.0, &Rivals::default()).map(|p| p.value), Some(1));
    }

    #[test]
    fn strict_bands_then_fair_tenants_then_fcfs() {
        let cfg = FlowConfig::default();
        let mut q = FlowQueue::default();
        let mut id = 0;
        let mut push = |q: &mut FlowQueue<u64>, p: i32, t: &str| {
            id += 1;
            q.enqueue(&cfg, id, &class(p, t), 10, 100, 0, id).unwrap();
            id
        };
        // Tenant a floods band 0 first, b arrives later, then one high-priority request.
        let a: Vec<u64> = (0..4).map(|_| push(&mut q, 0, "a")).collect();
        let b: Vec<u64> = (0..2).map(|_| push(&mut q, 0, "b")).collect();
        let hi = push(&mut q, 5, "c");
        let order: Vec<u64> = drain(&mut q).into_iter().map(|p| p.value).collect();
        assert_eq!(order[0], hi, "strict priority first");
        assert_eq!(&order[1..], &[a[0], b[0], a[1], b[1], a[2], a[3]], "tenants alternate, each FCFS");
        assert!(q.is_empty() && q.bytes() == 0);
    }

    #[test]
    fn later_turns_of_a_session_go_ahead_of_new_sessions_in_their_tenant() {
        let cfg = FlowConfig::default();
        let mut q = FlowQueue::default();
        let turn = RequestClass { continuing: true, ..class(0, "a") };
        for (id, c) in [(1, class(0, "a")), (2, class(0, "a")), (3, turn.clone()), (4, turn), (5, class(0, "a"))] {
            q.enqueue(&cfg, id, &c, 1, 10, 0, id).unwrap();
        }
        let order: Vec<u64> = drain(&mut q).into_iter().map(|p| p.value).collect();
        assert_eq!(order, vec![3, 4, 1, 2, 5]);
    }

    #[test]
    fn fairness_shares_tokens_not_requests() {
        let cfg = FlowConfig::default();
        let mut q = FlowQueue::default();
        // Tenant big sends 1000-token requests, small sends 100-token ones.
        for i in 0..40u64 {
            q.enqueue(&cfg, i, &class(0, "big"), 1, 1000, 0, ()).unwrap();
            q.enqueue(&cfg, 100 + i, &class(0, "small"), 1, 100, 0, ()).unwrap();
        }
        let mut tokens: HashMap<bool, f64> = HashMap::new();
        for p in drain(&mut q).into_iter().take(40) {
            *tokens.entry(p.tenant == "big").or_default() += p.tokens as f64;
        }
        let (big, small) = (tokens[&true], tokens[&false]);
        assert!(jain_index(&[big, small]) > 0.95, "tokens served big {big} small {small}");
    }

    #[test]
    fn a_closed_gate_or_a_higher_rival_band_holds_the_queue() {
        let cfg = FlowConfig::default();
        let mut q = FlowQueue::default();
        q.enqueue(&cfg, 1, &class(0, "a"), 1, 10, 0, ()).unwrap();
        q.enqueue(&cfg, 2, &class(5, "b"), 1, 10, 0, ()).unwrap();
        let none = Rivals::default();
        assert!(q.pop(|_| 0.0, &none, 0.0, |p| p >= 5).is_some_and(|p| p.id == 2), "band 5 may go");
        assert!(q.pop(|_| 0.0, &none, 0.0, |p| p >= 5).is_none(), "band 0 is over its ceiling");
        let mut rivals = Rivals::default();
        rivals.note(3, 0.0);
        assert!(q.pop(|_| 0.0, &rivals, 0.0, |_| true).is_none(), "another worker holds band 3 work");
        // Same band elsewhere: only a tenant served much less elsewhere holds ours back.
        let mut rivals = Rivals::default();
        rivals.note(0, 500.0);
        assert!(q.pop(|_| 900.0, &rivals, 100.0, |_| true).is_none(), "a waits: 900 > 500 + 100");
        assert!(q.pop(|_| 550.0, &rivals, 100.0, |_| true).is_some(), "within slack");
        assert!(q.is_empty());
    }

    #[test]
    fn bounds_ttl_and_removal_leave_no_state() {
        let mut cfg = FlowConfig { max_requests: 5, ttl_ms: 1000, ..FlowConfig::default() };
        cfg.bands.insert(-1, BandLimits { max_requests: 2, max_bytes: 1 << 20, ceiling: 1.0 });
        let mut q = FlowQueue::default();
        q.enqueue(&cfg, 1, &class(-1, "a"), 10, 1, 0, ()).unwrap();
        q.enqueue(&cfg, 2, &class(-1, "a"), 10, 1, 0, ()).unwrap();
        assert_eq!(q.enqueue(&cfg, 3, &class(-1, "a"), 10, 1, 0, ()), Err(Shed::BandFull));
        assert_eq!(q.enqueue(&cfg, 2, &class(0, "a"), 10, 1, 0, ()), Err(Shed::QueueFull), "ids are unique");
        q.enqueue(&cfg, 4, &class(0, "a"), 10, 1, 500, ()).unwrap();
        q.enqueue(&cfg, 5, &class(0, "b"), 10, 1, 500, ()).unwrap();
        q.enqueue(&cfg, 6, &class(0, "b"), 10, 1, 500, ()).unwrap();
        assert_eq!(q.enqueue(&cfg, 7, &class(0, "c"), 10, 1, 500, ()), Err(Shed::QueueFull));
        let bytes_cfg = FlowConfig { max_bytes: 55, ..cfg.clone() };
        assert_eq!(q.enqueue(&bytes_cfg, 8, &class(0, "c"), 10, 1, 500, ()), Err(Shed::QueueFull));
        assert_eq!(q.depths(), vec![(0, "a".into(), 1), (0, "b".into(), 2), (-1, "a".into(), 2)]);
        assert!(q.remove(5).is_some_and(|p| p.tenant == "b" && p.priority == 0));
        assert!(q.remove(5).is_none(), "removed once");
        let expired: Vec<u64> = q.expire(1000).into_iter().map(|p| p.id).collect();
        assert_eq!(expired, vec![1, 2]);
        assert_eq!(q.len(), 2);
        q.expire(2000);
        assert!(q.is_empty() && q.bytes() == 0 && q.depths().is_empty() && q.index.is_empty() && q.bands.is_empty());
        assert_eq!(Shed::Expired.status(), 429);
        assert_eq!(Shed::NoEndpoints.status(), 503);
    }
}
