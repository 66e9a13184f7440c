//! The engine: a step-level scheduler in the style of vLLM V1.
//!
//! Each step spends a token budget on the running set first (one token per decoding sequence,
//! a chunk for each sequence still in prefill), then admits waiting requests FCFS while
//! `max_num_seqs` and the KV pool allow. Admission looks up the longest cached block prefix;
//! only uncached tokens cost prefill time. A decoding sequence that needs a block when none is
//! free preempts the newest running sequence (recompute). The step then "runs" for the
//! modelled time multiplied by `time_scale`, and its tokens are delivered.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Notify};

use crate::block_hash::{self, Digest32};
use crate::config::EngineConfig;
use crate::kv::{BlockId, BlockPool};
use crate::latency;
use crate::metrics::Stats;

/// What a request receives from the engine.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenEvent {
    /// Generated tokens (one, or several with a stream interval); the flag is set with the
    /// request's last token.
    Tokens(Vec<u32>, bool),
    Done(Usage),
}

/// Token accounting of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub finish_reason: &'static str,
}

/// A request as submitted by the API layer.
pub struct SimRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub tx: mpsc::UnboundedSender<TokenEvent>,
    /// Leading prompt tokens whose KV a prefill engine computed and this engine pulls
    /// (P/D decode side): they are transferred, not prefilled here.
    pub remote_tokens: usize,
    /// The LoRA adapter the request names (None: the base model).
    pub lora: Option<String>,
}

struct Seq {
    id: u64,
    /// Tokens to prefill (the prompt, plus generated tokens after a preemption).
    prefill: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    /// Leading prompt tokens to pull from a prefill engine instead of computing.
    remote_tokens: usize,
    /// When the pulled KV has arrived (the request is not scheduled before).
    transfer_until: Option<Instant>,
    lora: Option<String>,
    output: Vec<u32>,
    tx: mpsc::UnboundedSender<TokenEvent>,
    blocks: Vec<BlockId>,
    /// Digests of every full block of prompt + output computed so far.
    digests: Vec<Digest32>,
    num_computed: usize,
    cached_tokens: usize,
    /// Output tokens already handed to the API layer.
    sent: usize,
    /// Leading full blocks already cached (or found cached at admission).
    stored: usize,
    /// Block digests of `prefill`, computed once while the request waits.
    prefill_digests: Option<Vec<Digest32>>,
    arrival: Instant,
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

impl Seq {
    fn total_len(&self) -> usize {
        self.prefill.len() + self.output.len().saturating_sub(self.prefill.len() - self.prompt_len)
    }
    fn in_prefill(&self) -> bool {
        self.num_computed < self.prefill.len()
    }
    fn tokens(&self) -> impl Iterator<Item = u32> + '_ {
        let extra = self.prefill.len() - self.prompt_len;
        self.prefill.iter().copied().chain(self.output.iter().skip(extra).copied())
    }
}

/// The engine's mutable state.
pub struct EngineState {
    pub cfg: EngineConfig,
    pub pool: BlockPool,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    pub stats: Stats,
    next_id: u64,
    seed: Digest32,
    /// Where the engine's KV events go (one batch per step), if publishing is on.
    pub kv_events: Option<std::sync::mpsc::Sender<Vec<crate::kv::KvEvent>>>,
}

impl EngineState {
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    /// Time until the next KV transfer of a running request lands.
    pub fn next_transfer(&self) -> Option<Duration> {
        let now = Instant::now();
        self.running.iter().filter_map(|s| s.transfer_until).filter(|t| *t > now).min().map(|t| t - now)
    }
    /// Adapters of running requests (vLLM's `running_lora_adapters`).
    pub fn active_loras(&self) -> Vec<String> {
        let mut v: Vec<String> = self.running.iter().filter_map(|s| s.lora.clone()).collect();
        v.sort();
        v.dedup();
        v
    }
    /// Adapters of waiting requests (`waiting_lora_adapters`).
    pub fn waiting_loras(&self) -> Vec<String> {
        let mut v: Vec<String> = self.waiting.iter().filter_map(|s| s.lora.clone()).collect();
        v.sort();
        v.dedup();
        v
    }
}

/// A shared handle on one simulated engine.
#[derive(Clone)]
pub struct Engine {
    state: Arc<Mutex<EngineState>>,
    wake: Arc<Notify>,
}

enum Planned {
    Prefill {
        id: u64,
        tokens: usize,
    },
    Decode {
        id: u64,
    },
    /// KV loaded back from the CPU tier for a newly admitted request.
    Reload {
        tokens: usize,
    },
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Self {
        let pool = BlockPool::with_cpu_tier(cfg.num_gpu_blocks, cfg.num_cpu_blocks, cfg.block_size);
        Self {
            state: Arc::new(Mutex::new(EngineState {
                pool,
                waiting: VecDeque::new(),
                running: Vec::new(),
                stats: Stats::new(),
                next_id: 0,
                seed: block_hash::none_hash(None),
                kv_events: None,
                cfg,
            })),
            wake: Arc::new(Notify::new()),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, EngineState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publish this engine's KV events to `tx`, one batch per step.
    pub fn set_kv_events(&self, tx: std::sync::mpsc::Sender<Vec<crate::kv::KvEvent>>) {
        self.lock().kv_events = Some(tx);
    }

    /// Reset the prefix cache (vLLM's `/reset_prefix_cache`), emitting AllBlocksCleared.
    pub fn reset_prefix_cache(&self) {
        let mut st = self.lock();
        st.pool.clear_cache();
        flush_events(&mut st);
    }

    pub fn config(&self) -> EngineConfig {
        self.lock().cfg.clone()
    }

    /// Load a LoRA adapter at run time (vLLM's `POST /v1/load_lora_adapter`); false if it is
    /// already loaded.
    pub fn load_lora(&self, name: &str) -> bool {
        let mut st = self.lock();
        if st.cfg.lora_adapters.iter().any(|a| a == name) {
            return false;
        }
        st.cfg.lora_adapters.push(name.to_owned());
        true
    }

    /// Unload one (`POST /v1/unload_lora_adapter`); false if it was not loaded.
    pub fn unload_lora(&self, name: &str) -> bool {
        let mut st = self.lock();
        let before = st.cfg.lora_adapters.len();
        st.cfg.lora_adapters.retain(|a| a != name);
        st.cfg.lora_adapters.len() != before
    }

    /// Queue a request.
    pub fn submit(&self, req: SimRequest) {
        let mut st = self.lock();
        st.next_id += 1;
        let id = st.next_id;
        let prompt_len = req.prompt.len();
        st.waiting.push_back(Seq {
            id,
            prefill: req.prompt,
            prompt_len,
            max_tokens: req.max_tokens.max(1),
            remote_tokens: req.remote_tokens,
            transfer_until: None,
            lora: req.lora,
            output: Vec::new(),
            tx: req.tx,
            blocks: Vec::new(),
            digests: Vec::new(),
            num_computed: 0,
            cached_tokens: 0,
            sent: 0,
            stored: 0,
            prefill_digests: None,
            arrival: Instant::now(),
            scheduled: None,
            first_token: None,
            last_token: None,
        });
        drop(st);
        self.wake.notify_one();
    }

    /// Run the step loop forever.
    pub async fn run(self) {
        // Steps are scheduled against deadlines, not slept one after another, so timer
        // granularity (about 1 ms) does not stretch short, time-scaled steps: a late wake-up is
        // made up by the following steps.
        let mut next = tokio::time::Instant::now();
        loop {
            let (planned, ms) = {
                let mut st = self.lock();
                drop_aborted(&mut st);
                let planned = plan_step(&mut st);
                let (mut p, mut d) = (0, 0);
                for x in &planned {
                    match x {
                        Planned::Prefill { tokens, .. } => p += tokens,
                        Planned::Decode { .. } => d += 1,
                        // Loading KV from the CPU tier costs a fraction of recomputing it.
                        Planned::Reload { tokens } => p += (*tokens as f64 * st.cfg.cpu_reload_cost).ceil() as usize,
                    }
                }
                let ms = latency::scaled_step_ms(p, d, st.pool.usage(), st.cfg.prefill_scale, st.cfg.decode_scale)
                    * st.cfg.time_scale;
                if !planned.is_empty() {
                    st.stats.iteration_tokens.observe((p + d) as f64);
                }
                (planned, ms)
            };
            if planned.is_empty() {
                // Idle, or only waiting for KV transfers: sleep until woken or the next transfer lands.
                let wait =
                    self.lock().next_transfer().map_or(Duration::from_millis(50), |d| d.min(Duration::from_millis(50)));
                let _ = tokio::time::timeout(wait, self.wake.notified()).await;
                next = tokio::time::Instant::now();
                continue;
            }
            let now = tokio::time::Instant::now();
            // Never bank more than one step of lag (a stalled process should not then race).
            if next + Duration::from_millis(20) < now {
                // The process fell behind (CPU-starved): simulated time is lost. Counted, so a
                // benchmark can tell whether the machine kept up.
                self.lock().stats.lost_ms += now.duration_since(next).as_secs_f64() * 1000.0;
                next = now;
            }
            next += Duration::from_secs_f64(ms.max(0.0) / 1000.0);
            tokio::time::sleep_until(next).await;
            let mut st = self.lock();
            apply_step(&mut st, &planned);
        }
    }
}

fn finish(st: &mut EngineState, seq: Seq, reason: &'static str) {
    st.pool.release(&seq.blocks);
    let now = Instant::now();
    let usage = Usage {
        prompt_tokens: seq.prompt_len,
        completion_tokens: seq.output.len(),
        cached_tokens: seq.cached_tokens,
        finish_reason: reason,
    };
    if reason != "abort" {
        st.stats.success(reason);
        st.stats.e2e.observe(now.duration_since(seq.arrival).as_secs_f64());
        st.stats.generation_hist.observe(seq.output.len() as f64);
        st.stats.prompt_hist.observe(seq.prompt_len as f64);
        if let (Some(s), Some(f)) = (seq.scheduled, seq.first_token) {
            st.stats.prefill_time.observe(f.duration_since(s).as_secs_f64());
            st.stats.decode_time.observe(now.duration_since(f).as_secs_f64());
        }
    } else {
        st.stats.success("abort");
    }
    let _ = seq.tx.send(TokenEvent::Done(usage));
}

fn drop_aborted(st: &mut EngineState) {
    let mut i = 0;
    while i < st.running.len() {
        if st.running[i].tx.is_closed() {
            let s = st.running.remove(i);
            finish(st, s, "abort");
        } else {
            i += 1;
        }
    }
    let before = st.waiting.len();
    st.waiting.retain(|s| !s.tx.is_closed());
    for _ in st.waiting.len()..before {
        st.stats.success("abort");
    }
}

/// Preempt the newest running sequence other than `keep`; returns false if there is none.
fn preempt(st: &mut EngineState, keep: u64) -> bool {
    // As vLLM's scheduler does, only a sequence not yet scheduled in this step (after `keep`
    // in the running order) is preempted: one already scheduled has had its blocks cached.
    let after = st.running.iter().position(|s| s.id == keep).map_or(0, |p| p + 1);
    let Some(pos) = st.running.iter().rposition(|s| s.id != keep).filter(|&p| p >= after) else {
        return false;
    };
    let mut s = st.running.remove(pos);
    st.pool.release(&s.blocks);
    s.blocks.clear();
    s.digests.clear();
    s.stored = 0;
    s.prefill_digests = None;
    // Recompute: prefill the prompt and what was generated so far.
    let toks: Vec<u32> = s.tokens().collect();
    s.prefill = toks;
    s.num_computed = 0;
    st.stats.preemptions += 1;
    st.waiting.push_front(s);
    true
}

fn plan_step(st: &mut EngineState) -> Vec<Planned> {
    let bs = st.cfg.block_size.max(1);
    let mut budget = st.cfg.max_num_batched_tokens.max(1);
    let mut planned = Vec::new();
    let started = Instant::now();

    // 1. The running set: prefill chunks and decodes.
    let mut i = 0;
    while i < st.running.len() && budget > 0 {
        let id = st.running[i].id;
        if st.running[i].transfer_until.is_some_and(|t| t > started) {
            // Its KV is still arriving from the prefill engine; it takes no step time here.
            i += 1;
            continue;
        }
        if st.running[i].in_prefill() {
            let n = (st.running[i].prefill.len() - st.running[i].num_computed).min(budget);
            budget -= n;
            planned.push(Planned::Prefill { id, tokens: n });
            let upto = st.running[i].num_computed + n;
            store_full_blocks(st, i, Some(upto));
            i += 1;
            continue;
        }
        // Decoding: make room for one more token.
        let need_block = st.running[i].total_len() + 1 > st.running[i].blocks.len() * bs;
        if need_block {
            let got = loop {
                if let Some(b) = st.pool.allocate(1) {
                    break Some(b);
                }
                if !preempt(st, id) {
                    break None;
                }
            };
            // Preemption may have removed sequences before i; find ours again.
            let Some(pos) = st.running.iter().position(|s| s.id == id) else {
                break;
            };
            i = pos;
            match got {
                Some(b) => st.running[i].blocks.extend(b),
                None => {
                    i += 1;
                    continue;
                }
            }
        }
        budget -= 1;
        planned.push(Planned::Decode { id });
        i += 1;
    }

    // 2. Admit waiting requests.
    while budget > 0 && st.running.len() < st.cfg.max_num_seqs {
        let caching = st.cfg.enable_prefix_caching;
        let seed = st.seed;
        // LoRA: an adapter that is not active needs a free slot (vLLM's `max_loras`); the
        // request waits at the head of the queue until one frees.
        if let Some(a) = st.waiting.front().and_then(|s| s.lora.clone()) {
            let active = st.active_loras();
            if !active.contains(&a) && active.len() >= st.cfg.max_loras {
                break;
            }
        }
        let Some(seq) = st.waiting.front_mut() else { break };
        let len = seq.prefill.len();
        // Hash the prompt once while it waits, not at every step that cannot admit it.
        let digests = seq.prefill_digests.get_or_insert_with(|| {
            if caching {
                block_hash::chain(&seed, &seq.prefill, bs)
            } else {
                Vec::new()
            }
        });
        let ids: Vec<u64> = digests.iter().map(block_hash::event_id).collect();
        // vLLM always recomputes at least the last prompt token.
        let hit = st.pool.lookup(&ids).blocks.min(len.saturating_sub(1) / bs);
        let total_blocks = len.div_ceil(bs).max(1);
        // GPU hits are referenced; CPU-tier hits are reloaded into fresh GPU blocks.
        let (hit_blocks, reloaded) = st.pool.acquire_prefix(&ids[..hit]);
        let hit = hit_blocks.len();
        let Some(fresh) = st.pool.allocate(total_blocks - hit) else {
            st.pool.release(&hit_blocks);
            break;
        };
        let Some(mut seq) = st.waiting.pop_front() else {
            break;
        };
        st.stats.prefix_queries += len as u64;
        st.stats.prefix_hits += (hit * bs) as u64;
        let now = Instant::now();
        if seq.scheduled.is_none() {
            st.stats.queue_time.observe(now.duration_since(seq.arrival).as_secs_f64());
            seq.scheduled = Some(now);
            seq.cached_tokens = hit * bs;
        }
        seq.blocks = hit_blocks;
        seq.blocks.extend(fresh);
        seq.digests = seq.prefill_digests.take().unwrap_or_default();
        seq.stored = hit;
        seq.num_computed = hit * bs;
        // P/D: full blocks the prefill engine computed and this engine does not hold are pulled,
        // not prefilled; the last prompt token is always computed here.
        // The pull runs beside the engine's steps (NIXL reads the prefill engine's memory):
        // it delays this request by a fraction of what prefilling those tokens would take,
        // without stalling the other sequences.
        let remote_blocks = seq.remote_tokens.min(len.saturating_sub(1)) / bs;
        let mut pulling = false;
        if remote_blocks > hit {
            let pulled = (remote_blocks - hit) * bs;
            seq.num_computed += pulled;
            st.stats.kv_transfer_tokens += pulled as u64;
            let ms = latency::prefill_ms(pulled) * st.cfg.prefill_scale * st.cfg.kv_transfer_cost * st.cfg.time_scale;
            seq.transfer_until = Some(now + Duration::from_secs_f64(ms.max(0.0) / 1000.0));
            pulling = true;
        }
        let n = if pulling { 0 } else { (len - seq.num_computed).min(budget) };
        budget -= n;
        if st.pool.cpu_len() > 0 || reloaded > 0 {
            st.stats.external_queries += (len - hit * bs + reloaded * bs) as u64;
        }
        if reloaded > 0 {
            st.stats.external_hits += (reloaded * bs) as u64;
            planned.push(Planned::Reload { tokens: reloaded * bs });
        }
        if n > 0 {
            planned.push(Planned::Prefill { id: seq.id, tokens: n });
        }
        let upto = seq.num_computed + n;
        st.running.push(seq);
        if n > 0 {
            store_full_blocks(st, st.running.len() - 1, Some(upto));
        }
    }
    planned
}

/// Cache the blocks of sequence `idx` that are full once its first `upto` tokens are computed
/// (`None`: what it has computed now). vLLM caches a step's blocks when it schedules them
/// (`allocate_slots` → `cache_blocks(request, num_computed + num_new_tokens)` in
/// `vllm/v1/core/kv_cache_manager.py`), so a request admitted later in the same step already
/// hits them: the samples of a group sent at once share one prefill.
fn store_full_blocks(st: &mut EngineState, idx: usize, upto: Option<usize>) {
    let bs = st.cfg.block_size.max(1);
    if !st.cfg.enable_prefix_caching {
        return;
    }
    let s = &st.running[idx];
    let computed_tokens = match upto {
        Some(n) => n.min(s.total_len()),
        None if s.in_prefill() => s.num_computed,
        None => s.total_len(),
    };
    let full = computed_tokens / bs;
    // Only blocks that became full since the last call (vLLM keeps the same watermark,
    // `num_cached_blocks`): the cost of a step follows what changed, not the sequence length.
    if full <= s.stored {
        return;
    }
    let lo = s.stored.min(s.digests.len());
    let toks: Vec<u32> = s.tokens().skip(lo * bs).take((full - lo) * bs).collect();
    let block = |b: usize| toks.get((b - lo) * bs..(b - lo + 1) * bs).unwrap_or(&[]);
    let mut new_digests = Vec::new();
    let mut prev = s.digests.last().copied().unwrap_or(st.seed);
    for b in s.digests.len()..full {
        prev = block_hash::block_digest(&prev, block(b));
        new_digests.push(prev);
    }
    let s = &mut st.running[idx];
    s.digests.extend(new_digests);
    let start = s.stored;
    s.stored = full;
    let s = &st.running[idx];
    let id_of = |b: usize| s.digests.get(b).map(block_hash::event_id);
    let items: Vec<(usize, BlockId, u64, Option<u64>)> = (start..full)
        .filter_map(|b| Some((b, *s.blocks.get(b)?, id_of(b)?, b.checked_sub(1).and_then(id_of))))
        .collect();
    // Publish newly cached blocks as contiguous runs, each with its parent's id, as vLLM does.
    let mut run: Option<(usize, Vec<u64>)> = None;
    let mut runs = Vec::new();
    for (b, id, h, parent) in items {
        if st.pool.store(id, h, parent, block(b).to_vec()) {
            match &mut run {
                Some((_, hs)) => hs.push(h),
                None => run = Some((b, vec![h])),
            }
        } else if let Some(r) = run.take() {
            runs.push(r);
        }
    }
    runs.extend(run);
    for (first, hashes) in runs {
        let parent = first.checked_sub(1).and_then(|p| st.running[idx].digests.get(p)).map(block_hash::event_id);
        let tokens = toks.get((first - lo) * bs..(first - lo + hashes.len()) * bs).unwrap_or(&[]).to_vec();
        st.pool.events.push(crate::kv::KvEvent::Stored {
            hashes,
            parent,
            tokens,
            block_size: bs as u32,
            medium: crate::kv::Medium::Gpu,
        });
    }
}

fn emit_token(st: &mut EngineState, idx: usize, now: Instant) -> bool {
    let stream_interval = st.cfg.stream_interval.max(1);
    let s = &mut st.running[idx];
    let tok = 3 + ((s.id as u32).wrapping_mul(2654435761).wrapping_add(s.output.len() as u32) % 31_997);
    s.output.push(tok);
    match s.first_token {
        None => {
            s.first_token = Some(now);
            let ttft = now.duration_since(s.arrival).as_secs_f64();
            st.stats.ttft.observe(ttft);
        }
        Some(_) => {
            if let Some(l) = s.last_token {
                let itl = now.duration_since(l).as_secs_f64();
                st.stats.itl.observe(itl);
            }
        }
    }
    let s = &mut st.running[idx];
    s.last_token = Some(now);
    st.stats.generation_tokens += 1;
    let last = s.output.len() >= s.max_tokens;
    // Hand tokens to the API layer in stream-interval batches (the first one at once), as
    // vLLM's output processor does with --stream-interval.
    let n = s.output.len();
    if s.sent == 0 || last || n - s.sent >= stream_interval {
        let toks = s.output.get(s.sent..).unwrap_or(&[]).to_vec();
        s.sent = n;
        let _ = s.tx.send(TokenEvent::Tokens(toks, last));
    }
    last
}

/// Hand the step's KV events to the publisher, if one is attached.
fn flush_events(st: &mut EngineState) {
    if st.pool.events.is_empty() {
        return;
    }
    let events = std::mem::take(&mut st.pool.events);
    if let Some(tx) = &st.kv_events {
        let _ = tx.send(events);
    }
}

fn apply_step(st: &mut EngineState, planned: &[Planned]) {
    let now = Instant::now();
    let mut done = Vec::new();
    // The running set does not change order during the step: index it once.
    let index: hashbrown::HashMap<u64, usize> = st.running.iter().enumerate().map(|(i, s)| (s.id, i)).collect();
    for p in planned {
        let id = match p {
            Planned::Prefill { id, .. } | Planned::Decode { id } => *id,
            Planned::Reload { .. } => continue,
        };
        let Some(&idx) = index.get(&id) else {
            continue;
        };
        let finished = match p {
            Planned::Prefill { tokens, .. } => {
                st.running[idx].num_computed += tokens;
                st.stats.prompt_tokens += *tokens as u64;
                store_full_blocks(st, idx, None);
                if st.running[idx].in_prefill() {
                    false
                } else {
                    emit_token(st, idx, now)
                }
            }
            Planned::Decode { .. } => {
                let f = emit_token(st, idx, now);
                store_full_blocks(st, idx, None);
                f
            }
            Planned::Reload { .. } => false,
        };
        if finished {
            done.push(id);
        }
    }
    for id in done {
        if let Some(idx) = st.running.iter().position(|s| s.id == id) {
            let s = st.running.remove(idx);
            finish(st, s, "length");
        }
    }
    flush_events(st);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> EngineConfig {
        EngineConfig {
            block_size: 4,
            num_gpu_blocks: 16,
            max_num_seqs: 4,
            max_num_batched_tokens: 64,
            time_scale: 0.0,
            ..Default::default()
        }
    }

    async fn run_one(e: &Engine, prompt: Vec<u32>, max_tokens: usize) -> (Vec<u32>, Usage) {
        let (tx, mut rx) = mpsc::unbounded_channel();
        e.submit(SimRequest { prompt, max_tokens, tx, remote_tokens: 0, lora: None });
        let mut toks = Vec::new();
        while let Some(ev) = rx.recv().await {
            match ev {
                TokenEvent::Tokens(t, _) => toks.extend(t),
                TokenEvent::Done(u) => return (toks, u),
            }
        }
        panic!("engine dropped the request");
    }

    #[tokio::test]
    async fn prefix_hits_counted_and_all_tokens_delivered() {
        let e = Engine::new(cfg());
        tokio::spawn(e.clone().run());
        let prompt: Vec<u32> = (10..30).collect(); // 20 tokens = 5 blocks
        let (t, u) = run_one(&e, prompt.clone(), 3).await;
        assert_eq!(t.len(), 3);
        assert_eq!((u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.finish_reason), (20, 3, 0, "length"));
        let (_, u) = run_one(&e, prompt.clone(), 2).await;
        assert_eq!(u.cached_tokens, 16, "4 full blocks hit; the last token is always recomputed");
        let st = e.lock();
        assert_eq!(st.stats.prefix_queries, 40);
        assert_eq!(st.stats.prefix_hits, 16);
        assert_eq!(st.pool.usage(), 0.0, "all blocks released");
    }

    /// vLLM caches a step's blocks as it schedules them: identical prompts admitted in the same
    /// step (a rollout group sent at once) prefill once, and the others hit.
    #[tokio::test]
    async fn identical_prompts_admitted_in_one_step_share_its_prefill() {
        let e = Engine::new(cfg());
        let prompt: Vec<u32> = (10..30).collect(); // 20 tokens = 5 blocks
        let mut rxs = Vec::new();
        for _ in 0..4 {
            let (tx, rx) = mpsc::unbounded_channel();
            e.submit(SimRequest { prompt: prompt.clone(), max_tokens: 1, tx, remote_tokens: 0, lora: None });
            rxs.push(rx);
        }
        tokio::spawn(e.clone().run());
        let mut cached = Vec::new();
        for mut rx in rxs {
            while let Some(ev) = rx.recv().await {
                if let TokenEvent::Done(u) = ev {
                    cached.push(u.cached_tokens);
                }
            }
        }
        cached.sort_unstable();
        assert_eq!(cached, [0, 16, 16, 16], "one prefill, three hits");
    }

    #[tokio::test]
    async fn eviction_under_pressure_and_preemption_completes_everything() {
        let e = Engine::new(EngineConfig { num_gpu_blocks: 12, ..cfg() });
        tokio::spawn(e.clone().run());
        let mut handles = Vec::new();
        for i in 0..6u32 {
            let e = e.clone();
            handles.push(tokio::spawn(async move { run_one(&e, (i * 100..i * 100 + 12).collect(), 20).await }));
        }
        for h in handles {
            let (t, u) = h.await.unwrap();
            assert_eq!(t.len(), 20);
            assert_eq!(u.completion_tokens, 20);
        }
        let st = e.lock();
        assert!(st.stats.preemptions > 0, "12 blocks cannot hold 4 x 8 blocks of decode");
        assert_eq!(st.num_running() + st.num_waiting(), 0);
    }

    #[tokio::test]
    async fn pulled_kv_is_not_prefilled_here_and_becomes_cached() {
        let e = Engine::new(cfg());
        tokio::spawn(e.clone().run());
        let prompt: Vec<u32> = (10..30).collect(); // 20 tokens = 5 blocks
        let (tx, mut rx) = mpsc::unbounded_channel();
        e.submit(SimRequest { prompt: prompt.clone(), max_tokens: 2, tx, remote_tokens: 20, lora: None });
        let mut got = 0;
        while let Some(ev) = rx.recv().await {
            match ev {
                TokenEvent::Tokens(t, _) => got += t.len(),
                TokenEvent::Done(_) => break,
            }
        }
        assert_eq!(got, 2);
        {
            let st = e.lock();
            // 4 full blocks pulled (the last token is always computed locally).
            assert_eq!(st.stats.kv_transfer_tokens, 16);
            assert_eq!(st.stats.prompt_tokens, 4, "only the tokens after the pulled blocks were prefilled");
        }
        let (_, u) = run_one(&e, prompt, 1).await;
        assert_eq!(u.cached_tokens, 16, "the pulled blocks serve later requests as prefix hits");
    }
}
