//! Engine statistics and their `/metrics` exposition, in vLLM 0.32's names, label sets and
//! order (`engine` then `model_name`; counters as `_total` plus `_created`).

use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::EngineConfig;

pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
pub const ITL_BUCKETS: &[f64] =
    &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
pub const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];
pub const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0, 100000.0,
];
pub const ITERATION_BUCKETS: &[f64] =
    &[1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];

#[derive(Debug, Clone)]
pub struct Histogram {
    buckets: &'static [f64],
    counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn new(buckets: &'static [f64]) -> Self {
        Self { buckets, counts: vec![0; buckets.len()], sum: 0.0, count: 0 }
    }
    pub fn observe(&mut self, v: f64) {
        self.sum += v;
        self.count += 1;
        if let Some(i) = self.buckets.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
    }
    /// `n` observations of `v` at once.
    pub fn observe_n(&mut self, v: f64, n: u64) {
        self.sum += v * n as f64;
        self.count += n;
        if let Some(i) = self.buckets.iter().position(|b| v <= *b) {
            self.counts[i] += n;
        }
    }
}

#[derive(Debug, Clone)]
pub struct Stats {
    pub created: f64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// Tokens reloaded from the CPU-offload tier (vLLM counts connector hits as external).
    pub external_hits: u64,
    pub external_queries: u64,
    /// Real milliseconds the engine loop fell behind its step deadlines (machine too slow).
    pub lost_ms: f64,
    /// Prompt tokens whose KV was pulled from a prefill engine (P/D decode side).
    pub kv_transfer_tokens: u64,
    /// Requests served as the prefill half of a P/D pair (`do_remote_decode`).
    pub remote_decode_requests: u64,
    /// Requests that arrived with `x-prefiller-host-port` (P/D decode side), and of those, the
    /// ones whose prefill call failed and were prefilled here instead.
    pub remote_prefill_requests: u64,
    pub remote_prefill_fallbacks: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub preemptions: u64,
    pub finished: [(&'static str, u64); 5],
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    pub prefill_time: Histogram,
    pub decode_time: Histogram,
    pub prompt_hist: Histogram,
    pub generation_hist: Histogram,
    pub iteration_tokens: Histogram,
}

impl Default for Stats {
    fn default() -> Self {
        Self::new()
    }
}

impl Stats {
    pub fn new() -> Self {
        Self {
            created: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0),
            prefix_queries: 0,
            prefix_hits: 0,
            external_hits: 0,
            external_queries: 0,
            lost_ms: 0.0,
            kv_transfer_tokens: 0,
            remote_decode_requests: 0,
            remote_prefill_requests: 0,
            remote_prefill_fallbacks: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            preemptions: 0,
            finished: [("stop", 0), ("length", 0), ("abort", 0), ("error", 0), ("repetition", 0)],
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(REQUEST_BUCKETS),
            queue_time: Histogram::new(REQUEST_BUCKETS),
            prefill_time: Histogram::new(REQUEST_BUCKETS),
            decode_time: Histogram::new(REQUEST_BUCKETS),
            prompt_hist: Histogram::new(TOKEN_BUCKETS),
            generation_hist: Histogram::new(TOKEN_BUCKETS),
            iteration_tokens: Histogram::new(ITERATION_BUCKETS),
        }
    }

    pub fn success(&mut self, reason: &str) {
        if let Some(f) = self.finished.iter_mut().find(|(r, _)| *r == reason) {
            f.1 += 1;
        }
    }
}

/// Gauges sampled at scrape time.
pub struct Gauges {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    /// Adapters of running and of waiting requests (LoRA engines only).
    pub running_loras: Vec<String>,
    pub waiting_loras: Vec<String>,
}

fn fmt_f(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

struct W<'a> {
    out: String,
    labels: String,
    created: f64,
    /// Sample names asked for: families with none of them are skipped.
    only: Option<&'a [String]>,
}

impl W<'_> {
    /// Whether any asked-for sample belongs to the family `name`.
    fn wanted(&self, name: &str) -> bool {
        self.only.is_none_or(|only| only.iter().any(|n| n.starts_with(name)))
    }
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }
    fn gauge(&mut self, name: &str, help: &str, v: f64) {
        if !self.wanted(name) {
            return;
        }
        self.head(name, "gauge", help);
        let _ = writeln!(self.out, "{name}{{{}}} {}", self.labels, fmt_f(v));
    }
    fn counter(&mut self, name: &str, help: &str, v: u64) {
        if !self.wanted(name) {
            return;
        }
        self.head(&format!("{name}_total"), "counter", help);
        let _ = writeln!(self.out, "{name}_total{{{}}} {}", self.labels, fmt_f(v as f64));
        self.head(&format!("{name}_created"), "gauge", help);
        let _ = writeln!(self.out, "{name}_created{{{}}} {}", self.labels, self.created);
    }
    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        if !self.wanted(name) {
            return;
        }
        self.head(name, "histogram", help);
        let (engine, model) = self.labels.split_once(',').unwrap_or(("", ""));
        let mut cum = 0;
        for (b, c) in h.buckets.iter().zip(&h.counts) {
            cum += c;
            let _ = writeln!(self.out, "{name}_bucket{{{engine},le=\"{}\",{model}}} {}", fmt_f(*b), fmt_f(cum as f64));
        }
        let _ = writeln!(self.out, "{name}_bucket{{{engine},le=\"+Inf\",{model}}} {}", fmt_f(h.count as f64));
        let _ = writeln!(self.out, "{name}_count{{{}}} {}", self.labels, fmt_f(h.count as f64));
        let _ = writeln!(self.out, "{name}_sum{{{}}} {}", self.labels, h.sum);
        self.head(&format!("{name}_created"), "gauge", help);
        let _ = writeln!(self.out, "{name}_created{{{}}} {}", self.labels, self.created);
    }
}

/// The page for `GET /metrics/?<query>`: vLLM routes everything below `/metrics/` to
/// prometheus_client's ASGI app, which keeps only the samples named by `name[]` parameters
/// when there are any ([`attache_kv::prom::restrict`]). `GET /metrics` ignores the query.
pub fn render_query(cfg: &EngineConfig, s: &Stats, g: &Gauges, query: Option<&str>) -> String {
    let names: Vec<String> = form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .filter(|(k, _)| k == "name[]")
        .map(|(_, v)| v.into_owned())
        .collect();
    if names.is_empty() {
        return render(cfg, s, g);
    }
    // Families none of whose samples are asked for are not written at all (a thousand
    // simulated engines answer thousands of these a second); the rest is cut to the samples.
    let page = render_families(cfg, s, g, Some(&names));
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    attache_kv::prom::restrict(&page, &names)
}

/// Render `/metrics`.
pub fn render(cfg: &EngineConfig, s: &Stats, g: &Gauges) -> String {
    render_families(cfg, s, g, None)
}

fn render_families(cfg: &EngineConfig, s: &Stats, g: &Gauges, only: Option<&[String]>) -> String {
    let mut w = W {
        out: String::with_capacity(16 * 1024),
        labels: format!("engine=\"0\",model_name=\"{}\"", cfg.model),
        created: s.created,
        only,
    };
    w.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", g.running as f64);
    w.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", g.waiting as f64);
    w.head("vllm:num_requests_waiting_by_reason", "gauge", "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.");
    let _ = writeln!(
        w.out,
        "vllm:num_requests_waiting_by_reason{{{},reason=\"capacity\"}} {}",
        w.labels,
        fmt_f(g.waiting as f64)
    );
    let _ = writeln!(w.out, "vllm:num_requests_waiting_by_reason{{{},reason=\"deferred\"}} 0.0", w.labels);
    w.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", g.kv_usage);
    w.counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        s.prefix_queries,
    );
    w.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_hits);
    w.counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.", s.external_queries);
    w.counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.", s.external_hits);
    w.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.preemptions);
    // Simulator-only: real time the engine loop fell behind its step deadlines.
    let _ = writeln!(w.out, "attache_sim_lost_ms_total {}", fmt_f(s.lost_ms));
    let _ = writeln!(w.out, "attache_sim_kv_transfer_tokens_total {}", s.kv_transfer_tokens);
    let _ = writeln!(w.out, "attache_sim_remote_decode_requests_total {}", s.remote_decode_requests);
    let _ = writeln!(w.out, "attache_sim_remote_prefill_requests_total {}", s.remote_prefill_requests);
    let _ = writeln!(w.out, "attache_sim_remote_prefill_fallbacks_total {}", s.remote_prefill_fallbacks);
    w.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens);
    w.counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).", s.prefix_hits);
    w.counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens);
    w.head("vllm:request_success_total", "counter", "Count of successfully processed requests.");
    for (r, n) in &s.finished {
        let (e, m) = w.labels.split_once(',').unwrap_or(("", ""));
        let _ = writeln!(w.out, "vllm:request_success_total{{{e},finished_reason=\"{r}\",{m}}} {}", fmt_f(*n as f64));
    }
    w.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", &s.prompt_hist);
    w.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", &s.generation_hist);
    w.histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", &s.iteration_tokens);
    w.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", &s.ttft);
    w.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", &s.itl);
    w.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", &s.e2e);
    w.histogram(
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        &s.queue_time,
    );
    w.histogram(
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        &s.prefill_time,
    );
    w.histogram(
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        &s.decode_time,
    );
    if !cfg.lora_adapters.is_empty() {
        // vLLM: no model_name/engine labels; the value is the update time; one series.
        w.head("vllm:lora_requests_info", "gauge", "Running stats on lora requests.");
        let _ = writeln!(
            w.out,
            "vllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {}",
            cfg.max_loras,
            g.running_loras.join(","),
            g.waiting_loras.join(","),
            fmt_f(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0))
        );
    }
    w.head("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig");
    let _ = writeln!(
        w.out,
        "vllm:cache_config_info{{block_size=\"{bs}\",cache_dtype=\"auto\",enable_prefix_caching=\"{pc}\",engine=\"0\",gpu_memory_utilization=\"0.9\",kv_cache_size_tokens=\"{tok}\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{nb}\",num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"sha256_cbor\",sliding_window=\"None\"}} 1.0",
        bs = cfg.block_size,
        pc = if cfg.enable_prefix_caching { "True" } else { "False" },
        tok = cfg.block_size * cfg.num_gpu_blocks,
        nb = cfg.num_gpu_blocks,
    );
    w.out
}
