//! Admission: before a policy module may be rolled out, the host runs it in `wasmtime` under an
//! emulation of the proxy-wasm ABI (0.2.x, the subset Envoy gives HTTP filters): the module must
//! export the ABI, accept its configuration in `on_configure`, and handle a set of recorded
//! sample requests without trapping, within a time budget. Runaway code is stopped by fuel.
//!
//! The emulation implements what scheduling filters use (logging, time, buffers, header maps,
//! properties, shared data with CAS, metrics, local responses); every other ABI import answers
//! `Unimplemented`, so a module that depends on one fails here rather than in Envoy.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use wasmtime::{Caller, Config, Engine, Extern, FuncType, Linker, Module, Store, Val, ValType};

/// proxy-wasm status codes.
const OK: i32 = 0;
const NOT_FOUND: i32 = 1;
const BAD_ARGUMENT: i32 = 2;
const CAS_MISMATCH: i32 = 8;
const UNIMPLEMENTED: i32 = 12;

/// Buffer and map types.
const BUF_REQUEST_BODY: i32 = 0;
const BUF_VM_CONFIGURATION: i32 = 6;
const BUF_PLUGIN_CONFIGURATION: i32 = 7;
const MAP_REQUEST_HEADERS: i32 = 0;

/// The ABI exports a module must have.
pub const REQUIRED_EXPORTS: [&str; 7] = [
    "memory",
    "proxy_on_context_create",
    "proxy_on_configure",
    "proxy_on_request_headers",
    "proxy_on_request_body",
    "proxy_on_done",
    "proxy_on_delete",
];

/// A recorded request to replay through the module.
#[derive(Debug, Clone)]
pub struct SampleRequest {
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Filter state present when the module sees the request (`wasm.<name>` → value), e.g.
    /// the scheduling context a custom scorer reads.
    pub properties: Vec<(String, Vec<u8>)>,
}

impl SampleRequest {
    /// A POST to `path` with a JSON body.
    pub fn post(path: &str, body: &str) -> Self {
        Self {
            headers: vec![
                (":method".into(), "POST".into()),
                (":path".into(), path.into()),
                (":authority".into(), "gateway".into()),
                ("content-type".into(), "application/json".into()),
                ("content-length".into(), body.len().to_string()),
            ],
            body: body.as_bytes().to_vec(),
            properties: Vec::new(),
        }
    }
}

/// A check of what a module did with the samples.
pub type OutputCheck = fn(&[SampleRequest], &AdmissionReport) -> Result<(), AdmissionError>;

/// What admission requires.
#[derive(Debug, Clone)]
pub struct AdmissionConfig {
    /// The plugin configuration the module will get in Envoy.
    pub plugin_config: Vec<u8>,
    /// Recorded requests to replay.
    pub samples: Vec<SampleRequest>,
    /// Wall-clock budget per sample request (all callbacks).
    pub budget_per_request: Duration,
    /// Wasm instructions (fuel) allowed per callback; stops infinite loops.
    pub fuel_per_call: u64,
    /// Shared data to pre-load (for example the current snapshot), key → value.
    pub shared_data: Vec<(String, Vec<u8>)>,
    /// Checks what the module did with the samples (e.g. [`check_scorer_outputs`]).
    pub check_outputs: Option<OutputCheck>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            plugin_config: b"{}".to_vec(),
            samples: default_samples(),
            budget_per_request: Duration::from_millis(50),
            fuel_per_call: 500_000_000,
            shared_data: Vec::new(),
            check_outputs: None,
        }
    }
}

/// A few representative requests: completions (text and token ids), chat, Responses,
/// malformed JSON and an empty body.
pub fn default_samples() -> Vec<SampleRequest> {
    let long = "The scheduler routes each request to the engine that already holds its prefix. ".repeat(40);
    vec![
        SampleRequest::post("/v1/completions", &format!(r#"{{"model":"m","prompt":"{long}","max_tokens":8}}"#)),
        SampleRequest::post("/v1/completions", r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10],"max_tokens":4}"#),
        SampleRequest::post(
            "/v1/chat/completions",
            &format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"{long}"}},{{"role":"user","content":"hi"}}],"stream":true}}"#
            ),
        ),
        SampleRequest::post("/v1/responses", r#"{"model":"m","input":"hello","instructions":"be brief"}"#),
        SampleRequest::post("/v1/completions", r#"{"model":"m","prompt":"#),
        SampleRequest::post("/v1/completions", ""),
    ]
}

/// Recorded scheduling contexts for a custom scorer: the filter state the scheduler leaves
/// (1, 4 and 16 candidates; labelled and unlabelled; idle, queued and cold endpoints).
pub fn scorer_samples() -> Vec<SampleRequest> {
    use attache_policies::scoring::{Candidate, ScoringContext, CONTEXT_PROPERTY};
    let classes = ["l4", "a100", "h100", ""];
    let ctx = |n: usize, prompt_tokens: u32, seed: u64| ScoringContext {
        bucket: (seed % 10_000) as u16,
        seed,
        max_endpoints: 3,
        model: "m".into(),
        prompt_tokens,
        max_tokens: 128,
        stream: seed.is_multiple_of(2),
        candidates: (0..n)
            .map(|i| Candidate {
                address: format!("10.0.{}.{}:8000", i / 250, i % 250),
                labels: match classes[i % classes.len()] {
                    "" => Vec::new(),
                    c => vec![("attache.io/accelerator".into(), c.into())],
                },
                waiting: (i % 5) as f32,
                running: (i % 7) as f32,
                kv_usage: (i % 10) as f32 / 10.0,
                ttft_ms: [0.0, 35.0, 250.0, 2400.0][i % 4],
                prefix_hit: [0.0, 0.5, 1.0][i % 3],
                score: 1.0 + i as f64 / 10.0,
            })
            .collect(),
    };
    [ctx(1, 12, 1), ctx(4, 6000, 2), ctx(16, 900, 3), ctx(16, 0, 9_999)]
        .into_iter()
        .map(|c| SampleRequest {
            properties: vec![(CONTEXT_PROPERTY.into(), c.encode())],
            ..SampleRequest::post("/v1/chat/completions", "")
        })
        .collect()
}

/// Check that a scorer scored every sample: a decodable score sheet with one finite score per
/// candidate.
pub fn check_scorer_outputs(samples: &[SampleRequest], report: &AdmissionReport) -> Result<(), AdmissionError> {
    use attache_policies::scoring::{ScoreSheet, ScoringContext, CONTEXT_PROPERTY, SCORES_PROPERTY};
    for (k, (sample, outcome)) in samples.iter().zip(&report.outcomes).enumerate() {
        let no = |reason: String| AdmissionError::NoScores { sample: k, reason };
        let ctx = sample
            .properties
            .iter()
            .find(|(p, _)| p == CONTEXT_PROPERTY)
            .and_then(|(_, v)| ScoringContext::decode(v).ok())
            .ok_or_else(|| no("sample has no scoring context".into()))?;
        let sheet = outcome
            .properties
            .iter()
            .find(|(p, _)| p == SCORES_PROPERTY)
            .ok_or_else(|| no("the module wrote no score sheet (is it built with the scorer SDK?)".into()))?;
        let sheet = ScoreSheet::decode(&sheet.1).map_err(|e| no(format!("score sheet does not decode: {e}")))?;
        let entry = sheet.entries.first().ok_or_else(|| no("score sheet is empty".into()))?;
        if entry.scores.len() != ctx.candidates.len() {
            return Err(no(format!("{} scores for {} candidates", entry.scores.len(), ctx.candidates.len())));
        }
        if let Some(s) = entry.scores.iter().find(|s| !s.is_finite()) {
            return Err(no(format!("non-finite score {s}")));
        }
    }
    Ok(())
}

/// Why a module is refused.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    #[error("module does not compile: {0}")]
    Compile(String),
    #[error("module does not export `{0}`: it is not a proxy-wasm HTTP filter")]
    MissingExport(String),
    #[error("module does not export a proxy-wasm ABI version (proxy_abi_version_0_2_0 or _0_2_1)")]
    NoAbiVersion,
    #[error("module imports `{module}.{name}`, which neither Envoy's proxy-wasm ABI nor WASI provides")]
    UnknownImport { module: String, name: String },
    #[error("module failed to start: {0}")]
    Start(String),
    #[error("on_configure rejected the plugin configuration")]
    ConfigureRejected,
    #[error("module trapped in {phase} of sample request {sample}: {message}")]
    Trap { sample: usize, phase: &'static str, message: String },
    #[error("scorer did not score sample request {sample}: {reason}")]
    NoScores { sample: usize, reason: String },
    #[error("sample request {sample} took {took_ms:.1} ms, over the {budget_ms:.1} ms budget")]
    OverBudget { sample: usize, took_ms: f64, budget_ms: f64 },
}

/// What the module did with one sample request.
#[derive(Debug, Clone, Default)]
pub struct SampleOutcome {
    /// The request headers after the module ran (e.g. the destination it set).
    pub headers: Vec<(String, String)>,
    /// The status of the local response, if the module answered the request itself.
    pub local_response: Option<u32>,
    /// Filter state after the module ran.
    pub properties: Vec<(String, Vec<u8>)>,
}

/// What the module did with the samples.
#[derive(Debug, Clone, Default)]
pub struct AdmissionReport {
    pub abi: String,
    /// Per sample, what the module did.
    pub outcomes: Vec<SampleOutcome>,
    pub max_request_us: u64,
    pub logs: Vec<String>,
}

#[derive(Default)]
struct HostState {
    plugin_config: Vec<u8>,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    local_response: Option<u32>,
    properties: Vec<(String, Vec<u8>)>,
    shared: HashMap<String, (Vec<u8>, u32)>,
    metrics: Vec<(String, i64)>,
    logs: Vec<String>,
}

type Ctx<'a> = Caller<'a, HostState>;

fn memory(c: &mut Ctx<'_>) -> Option<wasmtime::Memory> {
    c.get_export("memory").and_then(Extern::into_memory)
}

fn read(c: &mut Ctx<'_>, ptr: i32, len: i32) -> Option<Vec<u8>> {
    let mem = memory(c)?;
    let (p, l) = (usize::try_from(ptr).ok()?, usize::try_from(len).ok()?);
    mem.data(&*c).get(p..p.checked_add(l)?).map(<[u8]>::to_vec)
}

fn read_str(c: &mut Ctx<'_>, ptr: i32, len: i32) -> Option<String> {
    read(c, ptr, len).and_then(|b| String::from_utf8(b).ok())
}

fn write(c: &mut Ctx<'_>, ptr: i32, bytes: &[u8]) -> bool {
    let Some(mem) = memory(c) else { return false };
    let Ok(p) = usize::try_from(ptr) else { return false };
    match mem.data_mut(&mut *c).get_mut(p..p + bytes.len()) {
        Some(dst) => {
            dst.copy_from_slice(bytes);
            true
        }
        None => false,
    }
}

/// Copy `data` into guest memory (allocated by the module) and store its pointer and size.
fn give(c: &mut Ctx<'_>, data: &[u8], ret_ptr: i32, ret_len: i32) -> wasmtime::Result<i32> {
    let alloc = c
        .get_export("proxy_on_memory_allocate")
        .or_else(|| c.get_export("malloc"))
        .and_then(Extern::into_func)
        .ok_or_else(|| wasmtime::Error::msg("module exports no allocator"))?;
    let mut out = [Val::I32(0)];
    alloc.call(&mut *c, &[Val::I32(data.len() as i32)], &mut out)?;
    let ptr = out[0].i32().unwrap_or(0);
    if ptr == 0 && !data.is_empty() {
        return Err(wasmtime::Error::msg("allocator returned null"));
    }
    if !write(c, ptr, data)
        || !write(c, ret_ptr, &ptr.to_le_bytes())
        || !write(c, ret_len, &(data.len() as i32).to_le_bytes())
    {
        return Ok(BAD_ARGUMENT);
    }
    Ok(OK)
}

fn serialize_map(map: &[(String, String)]) -> Vec<u8> {
    let mut b = (map.len() as u32).to_le_bytes().to_vec();
    for (k, v) in map {
        b.extend_from_slice(&(k.len() as u32).to_le_bytes());
        b.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in map {
        b.extend_from_slice(k.as_bytes());
        b.push(0);
        b.extend_from_slice(v.as_bytes());
        b.push(0);
    }
    b
}

fn i(args: &[Val], n: usize) -> i32 {
    args.get(n).and_then(Val::i32).unwrap_or(0)
}

/// Implement one proxy-wasm import; `None` means "not emulated" (answers Unimplemented).
fn call(name: &str, c: &mut Ctx<'_>, a: &[Val]) -> wasmtime::Result<Option<i32>> {
    let status = match name {
        "proxy_log" => {
            let msg = read_str(c, i(a, 1), i(a, 2)).unwrap_or_default();
            if c.data().logs.len() < 1000 {
                c.data_mut().logs.push(msg);
            }
            OK
        }
        "proxy_get_log_level" => {
            if write(c, i(a, 0), &2i32.to_le_bytes()) {
                OK
            } else {
                BAD_ARGUMENT
            }
        }
        "proxy_get_current_time_nanoseconds" => {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            if write(c, i(a, 0), &(now.as_nanos() as u64).to_le_bytes()) {
                OK
            } else {
                BAD_ARGUMENT
            }
        }
        "proxy_set_tick_period_milliseconds" | "proxy_set_effective_context" | "proxy_done" => OK,
        "proxy_continue_stream" | "proxy_close_stream" | "proxy_continue_request" | "proxy_continue_response" => OK,
        "proxy_get_buffer_bytes" => {
            let data = match i(a, 0) {
                BUF_REQUEST_BODY => c.data().body.clone(),
                BUF_PLUGIN_CONFIGURATION => c.data().plugin_config.clone(),
                BUF_VM_CONFIGURATION => Vec::new(),
                _ => return Ok(Some(NOT_FOUND)),
            };
            // Sizes are u32 on the wire (the SDK asks for `usize::MAX`, which reads as -1 as an i32).
            let (start, max) = (i(a, 1) as u32 as usize, i(a, 2) as u32 as usize);
            let slice = data.get(start..).unwrap_or(&[]);
            let slice = &slice[..slice.len().min(max)];
            if slice.is_empty() {
                return Ok(Some(NOT_FOUND));
            }
            give(c, slice, i(a, 3), i(a, 4))?
        }
        "proxy_set_buffer_bytes" => {
            if i(a, 0) != BUF_REQUEST_BODY {
                return Ok(Some(NOT_FOUND));
            }
            let data = read(c, i(a, 3), i(a, 4)).unwrap_or_default();
            c.data_mut().body = data;
            OK
        }
        "proxy_get_header_map_pairs" => {
            if i(a, 0) != MAP_REQUEST_HEADERS {
                return Ok(Some(give(c, &serialize_map(&[]), i(a, 1), i(a, 2))?));
            }
            let m = serialize_map(&c.data().headers);
            give(c, &m, i(a, 1), i(a, 2))?
        }
        "proxy_get_header_map_value" => {
            let key = read_str(c, i(a, 1), i(a, 2)).unwrap_or_default();
            let v = if i(a, 0) == MAP_REQUEST_HEADERS {
                c.data().headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(&key)).map(|(_, v)| v.clone())
            } else {
                None
            };
            match v {
                Some(v) => give(c, v.as_bytes(), i(a, 3), i(a, 4))?,
                None => NOT_FOUND,
            }
        }
        "proxy_add_header_map_value" | "proxy_replace_header_map_value" => {
            let (k, v) =
                (read_str(c, i(a, 1), i(a, 2)).unwrap_or_default(), read_str(c, i(a, 3), i(a, 4)).unwrap_or_default());
            if i(a, 0) == MAP_REQUEST_HEADERS {
                let h = &mut c.data_mut().headers;
                if name == "proxy_replace_header_map_value" {
                    h.retain(|(x, _)| !x.eq_ignore_ascii_case(&k));
                }
                h.push((k.to_ascii_lowercase(), v));
            }
            OK
        }
        "proxy_remove_header_map_value" => {
            let k = read_str(c, i(a, 1), i(a, 2)).unwrap_or_default();
            if i(a, 0) == MAP_REQUEST_HEADERS {
                c.data_mut().headers.retain(|(x, _)| !x.eq_ignore_ascii_case(&k));
            }
            OK
        }
        "proxy_set_header_map_pairs" => OK,
        "proxy_get_property" => {
            // A path is its segments joined by NUL; filter state is a single segment.
            let path = read_str(c, i(a, 0), i(a, 1)).unwrap_or_default();
            match c.data().properties.iter().find(|(k, _)| *k == path).map(|(_, v)| v.clone()) {
                Some(v) => give(c, &v, i(a, 2), i(a, 3))?,
                None => NOT_FOUND,
            }
        }
        "proxy_set_property" => {
            let path = read_str(c, i(a, 0), i(a, 1)).unwrap_or_default();
            let value = read(c, i(a, 2), i(a, 3)).unwrap_or_default();
            let props = &mut c.data_mut().properties;
            props.retain(|(k, _)| *k != path);
            if props.len() < 64 {
                props.push((path, value));
            }
            OK
        }
        "proxy_get_shared_data" => {
            let key = read_str(c, i(a, 0), i(a, 1)).unwrap_or_default();
            match c.data().shared.get(&key).cloned() {
                Some((v, cas)) => {
                    let st = give(c, &v, i(a, 2), i(a, 3))?;
                    if st == OK && !write(c, i(a, 4), &cas.to_le_bytes()) {
                        BAD_ARGUMENT
                    } else {
                        st
                    }
                }
                None => NOT_FOUND,
            }
        }
        "proxy_set_shared_data" => {
            let key = read_str(c, i(a, 0), i(a, 1)).unwrap_or_default();
            let val = read(c, i(a, 2), i(a, 3)).unwrap_or_default();
            let cas = i(a, 4) as u32;
            let shared = &mut c.data_mut().shared;
            let cur = shared.get(&key).map_or(0, |(_, c)| *c);
            if cas != 0 && cas != cur {
                CAS_MISMATCH
            } else {
                shared.insert(key, (val, cur.wrapping_add(1).max(1)));
                OK
            }
        }
        "proxy_define_metric" => {
            let name = read_str(c, i(a, 1), i(a, 2)).unwrap_or_default();
            let id = c.data().metrics.len() as i32;
            c.data_mut().metrics.push((name, 0));
            if write(c, i(a, 3), &id.to_le_bytes()) {
                OK
            } else {
                BAD_ARGUMENT
            }
        }
        "proxy_increment_metric" | "proxy_record_metric" => {
            let id = i(a, 0) as usize;
            let v = a.get(1).and_then(Val::i64).unwrap_or(0);
            match c.data_mut().metrics.get_mut(id) {
                Some(m) => {
                    m.1 = if name == "proxy_increment_metric" { m.1.saturating_add(v) } else { v };
                    OK
                }
                None => NOT_FOUND,
            }
        }
        "proxy_get_metric" => {
            let v = c.data().metrics.get(i(a, 0) as usize).map(|m| m.1);
            match v {
                Some(v) if write(c, i(a, 1), &v.to_le_bytes()) => OK,
                _ => NOT_FOUND,
            }
        }
        "proxy_send_local_response" => {
            c.data_mut().local_response = Some(i(a, 0) as u32);
            OK
        }
        _ => return Ok(None),
    };
    Ok(Some(status))
}

/// WASI functions a Rust `wasm32-wasip1` module may import; answered without real I/O.
fn wasi(name: &str, c: &mut Ctx<'_>, a: &[Val]) -> Option<i32> {
    Some(match name {
        "fd_write" => {
            // Count the bytes as written (stdout/stderr are discarded).
            let (iovs, n, ret) = (i(a, 1), i(a, 2), i(a, 3));
            let mut total = 0i32;
            for k in 0..n.max(0) {
                let len = read(c, iovs + k * 8 + 4, 4).map_or(0, |b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                total = total.saturating_add(len);
            }
            write(c, ret, &total.to_le_bytes());
            0
        }
        "environ_sizes_get" | "args_sizes_get" => {
            write(c, i(a, 0), &0i32.to_le_bytes());
            write(c, i(a, 1), &0i32.to_le_bytes());
            0
        }
        "environ_get" | "args_get" | "fd_close" | "fd_seek" | "fd_fdstat_get" | "sched_yield" => 0,
        "clock_time_get" => {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            write(c, i(a, 2), &(now.as_nanos() as u64).to_le_bytes());
            0
        }
        "random_get" => {
            let (ptr, len) = (i(a, 0), i(a, 1).max(0) as usize);
            let seed = Instant::now().elapsed().as_nanos() as u64 ^ 0x9e37_79b9_7f4a_7c15;
            let bytes: Vec<u8> = (0..len).map(|k| (seed.rotate_left((k % 64) as u32) >> 3) as u8).collect();
            write(c, ptr, &bytes);
            0
        }
        "proc_exit" => return None,
        _ => 52, // ENOSYS
    })
}

fn trap_message(e: &wasmtime::Error) -> String {
    let s = format!("{e:#}");
    s.lines().next().unwrap_or("trap").to_string()
}

/// Load `bytes` (already signature-verified; a signature section is a custom section and is
/// ignored by the runtime) and run the admission checks.
pub fn admit(bytes: &[u8], cfg: &AdmissionConfig) -> Result<AdmissionReport, AdmissionError> {
    let mut config = Config::new();
    config.consume_fuel(true);
    let engine = Engine::new(&config).map_err(|e| AdmissionError::Compile(e.to_string()))?;
    let module = Module::new(&engine, bytes).map_err(|e| AdmissionError::Compile(trap_message(&e)))?;

    let exports: Vec<String> = module.exports().map(|e| e.name().to_string()).collect();
    let abi = exports
        .iter()
        .find(|n| n.starts_with("proxy_abi_version_0_2_"))
        .cloned()
        .ok_or(AdmissionError::NoAbiVersion)?;
    for imp in module.imports() {
        let (m, name) = (imp.module(), imp.name());
        let is_func = matches!(imp.ty(), wasmtime::ExternType::Func(_));
        let known = (m == "env" && name.starts_with("proxy_")) || m.starts_with("wasi_snapshot_preview1");
        if !is_func || !known {
            return Err(AdmissionError::UnknownImport { module: m.to_string(), name: name.to_string() });
        }
    }
    for req in REQUIRED_EXPORTS {
        if !exports.iter().any(|e| e == req) {
            return Err(AdmissionError::MissingExport(req.to_string()));
        }
    }
    if !exports.iter().any(|e| e == "proxy_on_memory_allocate" || e == "malloc") {
        return Err(AdmissionError::MissingExport("proxy_on_memory_allocate".into()));
    }

    let mut linker: Linker<HostState> = Linker::new(&engine);
    for imp in module.imports() {
        let (m, name) = (imp.module().to_string(), imp.name().to_string());
        let wasmtime::ExternType::Func(ty) = imp.ty() else {
            return Err(AdmissionError::UnknownImport { module: m, name });
        };
        let ty: FuncType = ty.clone();
        let is_wasi = m != "env";
        let fname = name.clone();
        linker
            .func_new(&m, &name, ty.clone(), move |mut c, args, results| {
                let status = if is_wasi {
                    match wasi(&fname, &mut c, args) {
                        Some(s) => s,
                        None => return Err(wasmtime::Error::msg("module called proc_exit")),
                    }
                } else {
                    call(&fname, &mut c, args)?.unwrap_or(UNIMPLEMENTED)
                };
                for (r, t) in results.iter_mut().zip(ty.results()) {
                    *r = match t {
                        ValType::I64 => Val::I64(i64::from(status)),
                        _ => Val::I32(status),
                    };
                }
                Ok(())
            })
            .map_err(|e| AdmissionError::Start(e.to_string()))?;
    }

    let mut state = HostState { plugin_config: cfg.plugin_config.clone(), ..HostState::default() };
    for (k, v) in &cfg.shared_data {
        state.shared.insert(k.clone(), (v.clone(), 1));
    }
    let mut store = Store::new(&engine, state);
    let fuel = cfg.fuel_per_call;
    store.set_fuel(fuel).map_err(|e| AdmissionError::Start(e.to_string()))?;
    let instance = linker.instantiate(&mut store, &module).map_err(|e| AdmissionError::Start(trap_message(&e)))?;

    // Reactor initialisation, then the root context.
    for init in ["_initialize", "_start"] {
        if let Ok(f) = instance.get_typed_func::<(), ()>(&mut store, init) {
            f.call(&mut store, ()).map_err(|e| AdmissionError::Start(trap_message(&e)))?;
        }
    }
    let create = instance
        .get_typed_func::<(i32, i32), ()>(&mut store, "proxy_on_context_create")
        .map_err(|e| AdmissionError::MissingExport(format!("proxy_on_context_create ({e})")))?;
    let configure = instance
        .get_typed_func::<(i32, i32), i32>(&mut store, "proxy_on_configure")
        .map_err(|e| AdmissionError::MissingExport(format!("proxy_on_configure ({e})")))?;
    let on_headers = instance
        .get_typed_func::<(i32, i32, i32), i32>(&mut store, "proxy_on_request_headers")
        .map_err(|e| AdmissionError::MissingExport(format!("proxy_on_request_headers ({e})")))?;
    let on_body = instance
        .get_typed_func::<(i32, i32, i32), i32>(&mut store, "proxy_on_request_body")
        .map_err(|e| AdmissionError::MissingExport(format!("proxy_on_request_body ({e})")))?;
    let on_log = instance.get_typed_func::<i32, ()>(&mut store, "proxy_on_log").ok();
    let on_done = instance
        .get_typed_func::<i32, i32>(&mut store, "proxy_on_done")
        .map_err(|e| AdmissionError::MissingExport(format!("proxy_on_done ({e})")))?;
    let on_delete = instance
        .get_typed_func::<i32, ()>(&mut store, "proxy_on_delete")
        .map_err(|e| AdmissionError::MissingExport(format!("proxy_on_delete ({e})")))?;

    const ROOT: i32 = 1;
    let start_trap = |e: wasmtime::Error| AdmissionError::Start(trap_message(&e));
    create.call(&mut store, (ROOT, 0)).map_err(start_trap)?;
    if let Ok(vm_start) = instance.get_typed_func::<(i32, i32), i32>(&mut store, "proxy_on_vm_start") {
        vm_start.call(&mut store, (ROOT, 0)).map_err(start_trap)?;
    }
    let n = cfg.plugin_config.len() as i32;
    let ok = configure.call(&mut store, (ROOT, n)).map_err(|e| AdmissionError::Start(trap_message(&e)))?;
    if ok == 0 {
        return Err(AdmissionError::ConfigureRejected);
    }

    let mut report = AdmissionReport { abi, ..AdmissionReport::default() };
    for (k, sample) in cfg.samples.iter().enumerate() {
        let ctx = 100 + k as i32;
        {
            let st = store.data_mut();
            st.headers = sample.headers.clone();
            st.body = sample.body.clone();
            st.local_response = None;
            st.properties = sample.properties.clone();
        }
        let started = Instant::now();
        let trap = |phase: &'static str| {
            move |e: wasmtime::Error| AdmissionError::Trap { sample: k, phase, message: trap_message(&e) }
        };
        store.set_fuel(fuel).map_err(|e| AdmissionError::Start(e.to_string()))?;
        create.call(&mut store, (ctx, ROOT)).map_err(trap("on_context_create"))?;
        let headers = sample.headers.len() as i32;
        let empty = i32::from(sample.body.is_empty());
        store.set_fuel(fuel).map_err(|e| AdmissionError::Start(e.to_string()))?;
        let action = on_headers.call(&mut store, (ctx, headers, empty)).map_err(trap("on_request_headers"))?;
        let _ = action;
        if !sample.body.is_empty() && store.data().local_response.is_none() {
            store.set_fuel(fuel).map_err(|e| AdmissionError::Start(e.to_string()))?;
            on_body.call(&mut store, (ctx, sample.body.len() as i32, 1)).map_err(trap("on_request_body"))?;
        }
        if let Some(f) = &on_log {
            store.set_fuel(fuel).map_err(|e| AdmissionError::Start(e.to_string()))?;
            f.call(&mut store, ctx).map_err(trap("on_log"))?;
        }
        on_done.call(&mut store, ctx).map_err(trap("on_done"))?;
        on_delete.call(&mut store, ctx).map_err(trap("on_delete"))?;
        let took = started.elapsed();
        if took > cfg.budget_per_request {
            return Err(AdmissionError::OverBudget {
                sample: k,
                took_ms: took.as_secs_f64() * 1000.0,
                budget_ms: cfg.budget_per_request.as_secs_f64() * 1000.0,
            });
        }
        report.max_request_us = report.max_request_us.max(took.as_micros() as u64);
        let st = store.data();
        report.outcomes.push(SampleOutcome {
            headers: st.headers.clone(),
            local_response: st.local_response,
            properties: st.properties.clone(),
        });
    }
    report.logs = std::mem::take(&mut store.data_mut().logs);
    if let Some(check) = cfg.check_outputs {
        check(&cfg.samples, &report)?;
    }
    Ok(report)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn wat(src: &str) -> Vec<u8> {
        wat::parse_str(src).unwrap()
    }

    /// A hand-written proxy-wasm filter whose `on_request_body` runs `body_fn`.
    pub(crate) fn filter(body_fn: &str) -> Vec<u8> {
        wat(&include_str!("../../tests/fixtures/filter.wat").replace("BODY", body_fn))
    }

    #[test]
    fn a_well_behaved_module_is_admitted() {
        let r = admit(&filter("(i32.const 0)"), &AdmissionConfig::default()).unwrap();
        assert_eq!(r.abi, "proxy_abi_version_0_2_1");
        assert_eq!(r.outcomes.len(), default_samples().len());
    }

    #[test]
    fn traps_loops_and_missing_exports_are_refused() {
        let e = admit(&filter("(unreachable)"), &AdmissionConfig::default()).unwrap_err();
        assert!(matches!(e, AdmissionError::Trap { phase: "on_request_body", .. }), "{e}");
        let e = admit(&filter("(loop $l (br $l)) (i32.const 0)"), &AdmissionConfig::default()).unwrap_err();
        assert!(matches!(e, AdmissionError::Trap { .. }), "an endless loop must run out of fuel: {e}");
        let plain = include_bytes!("../../tests/fixtures/minimal.wasm");
        assert!(matches!(admit(plain, &AdmissionConfig::default()), Err(AdmissionError::NoAbiVersion)));
        let no_body = wat(r#"(module (memory (export "memory") 1) (func (export "proxy_abi_version_0_2_1")))"#);
        assert!(matches!(admit(&no_body, &AdmissionConfig::default()), Err(AdmissionError::MissingExport(_))));
        let foreign = wat(r#"(module (import "evil" "syscall" (func)) (func (export "proxy_abi_version_0_2_1")))"#);
        assert!(matches!(admit(&foreign, &AdmissionConfig::default()), Err(AdmissionError::UnknownImport { .. })));
        assert!(matches!(admit(b"garbage", &AdmissionConfig::default()), Err(AdmissionError::Compile(_))));
    }
}
