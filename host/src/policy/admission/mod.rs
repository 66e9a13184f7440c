//! Admission: before a policy module may be rolled out, the host runs it in `wasmtime` under an
//! emulation of the proxy-wasm ABI ([`abi`]): the module must export the ABI, accept its
//! configuration in `on_configure`, and handle a set of built-in synthetic sample requests ([`samples`])
//! and their responses without trapping. Three limits bound what a module may take, each
//! enforced while it runs and named when it refuses one: memory (a `memory.grow` past the limit
//! traps), wall-clock time per sample request (epoch interruption: a ticker thread advances
//! the engine's epoch, so a loop is stopped at the deadline rather than measured after it
//! returns), and fuel per callback (Wasm instructions).

mod abi;
mod samples;

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use wasmtime::{Config, Engine, Instance, Module, Store, Trap, TypedFunc, WasmParams, WasmResults};

use abi::{HostState, MemoryCap};
pub use samples::{
    check_scheduler_outputs, check_scorer_outputs, context_sample, default_samples, scheduler_pool, scorer_samples,
    SampleRequest,
};

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

/// A check of what a module did with the samples.
pub type OutputCheck = fn(&[SampleRequest], &AdmissionReport) -> Result<(), AdmissionError>;

/// What admission requires.
#[derive(Debug, Clone)]
pub struct AdmissionConfig {
    /// The plugin configuration the module will get in Envoy.
    pub plugin_config: Vec<u8>,
    /// Sample requests to run the module on.
    pub samples: Vec<SampleRequest>,
    /// Wall-clock budget per sample request (all callbacks), enforced while the module runs.
    pub budget_per_request: Duration,
    /// Wall-clock budget for starting the module (instantiation, `on_vm_start`, `on_configure`).
    pub budget_to_start: Duration,
    /// Wasm instructions (fuel) allowed per callback.
    pub fuel_per_call: u64,
    /// The most linear memory the module may grow to.
    pub memory_limit_bytes: usize,
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
            budget_to_start: Duration::from_secs(1),
            fuel_per_call: 500_000_000,
            memory_limit_bytes: DEFAULT_MEMORY_LIMIT_BYTES,
            shared_data: Vec::new(),
            check_outputs: None,
        }
    }
}

/// The default memory limit: far above what a scorer or the scheduler needs for one pool.
pub const DEFAULT_MEMORY_LIMIT_BYTES: usize = 128 << 20;

/// Where in admission a module was: a callback, and the sample request it was handling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Site {
    pub phase: &'static str,
    /// `None` while the module starts.
    pub sample: Option<usize>,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.sample {
            Some(k) => write!(f, "{} of sample request {k}", self.phase),
            None => f.write_str(self.phase),
        }
    }
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
    #[error("scheduler did not schedule sample request {sample}: {reason}")]
    NotScheduled { sample: usize, reason: String },
    #[error("sample request {sample} took {took_ms:.1} ms, over the {budget_ms:.1} ms budget (admission_budget_ms)")]
    OverBudget { sample: usize, took_ms: f64, budget_ms: f64 },
    #[error("module was stopped in {site} at the wall-clock limit of {budget_ms:.1} ms ({limit})")]
    Interrupted { site: Site, budget_ms: f64, limit: &'static str },
    #[error("module ran out of fuel in {site}: more than {fuel} Wasm instructions in one callback (the fuel limit)")]
    OutOfFuel { site: Site, fuel: u64 },
    #[error("module asked for {requested_mib:.1} MiB of memory in {site}, over the memory limit of {limit_mib:.1} MiB (admission_memory_mb)")]
    MemoryLimit { site: Site, requested_mib: f64, limit_mib: f64 },
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

/// Name the limit a failed call ran into, if any: memory, the wall-clock deadline, fuel;
/// otherwise `other`.
fn limit_hit(
    e: &wasmtime::Error,
    store: &Store<HostState>,
    cfg: &AdmissionConfig,
    site: Site,
    other: impl FnOnce(String) -> AdmissionError,
) -> AdmissionError {
    if let Some(requested) = store.data().memory.refused {
        return AdmissionError::MemoryLimit {
            site,
            requested_mib: mib(requested),
            limit_mib: mib(cfg.memory_limit_bytes),
        };
    }
    match e.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => {
            let (budget, limit) = match site.sample {
                Some(_) => (cfg.budget_per_request, "admission_budget_ms, per sample request"),
                None => (cfg.budget_to_start, "the start-up budget"),
            };
            AdmissionError::Interrupted { site, budget_ms: budget.as_secs_f64() * 1000.0, limit }
        }
        Some(Trap::OutOfFuel) => AdmissionError::OutOfFuel { site, fuel: cfg.fuel_per_call },
        _ => other(trap_message(e)),
    }
}

/// The length of one epoch tick: the resolution of the wall-clock limit.
const TICK: Duration = Duration::from_millis(1);

/// Epoch deadline in ticks for `budget` (at least one tick).
fn ticks(budget: Duration) -> u64 {
    (budget.as_micros() / TICK.as_micros()).max(1) as u64 + 1
}

/// Advances an engine's epoch every [`TICK`] while admission runs, so that a module past its
/// deadline traps with [`Trap::Interrupt`] inside the call. Stopped and joined on drop.
struct Ticker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Ticker {
    fn start(engine: &Engine) -> Result<Self, AdmissionError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (engine, flag) = (engine.clone(), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("admission-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(TICK);
                    engine.increment_epoch();
                }
            })
            .map_err(|e| AdmissionError::Start(format!("cannot start the admission ticker: {e}")))?;
        Ok(Self { stop, thread: Some(thread) })
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
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

fn trap_message(e: &wasmtime::Error) -> String {
    let s = format!("{e:#}");
    s.lines().next().unwrap_or("trap").to_string()
}

/// The interface checks: a proxy-wasm ABI version, only ABI and WASI imports, the required
/// exports and an allocator. Returns the ABI version the module exports.
fn check_interface(module: &Module) -> Result<String, AdmissionError> {
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
    Ok(abi)
}

/// The module's proxy-wasm callbacks that admission drives.
struct Callbacks {
    create: TypedFunc<(i32, i32), ()>,
    configure: TypedFunc<(i32, i32), i32>,
    on_headers: TypedFunc<(i32, i32, i32), i32>,
    on_body: TypedFunc<(i32, i32, i32), i32>,
    on_response_headers: Option<TypedFunc<(i32, i32, i32), i32>>,
    on_response_body: Option<TypedFunc<(i32, i32, i32), i32>>,
    on_log: Option<TypedFunc<i32, ()>>,
    on_done: TypedFunc<i32, i32>,
    on_delete: TypedFunc<i32, ()>,
}

impl Callbacks {
    fn get(instance: &Instance, store: &mut Store<HostState>) -> Result<Self, AdmissionError> {
        fn typed<P: WasmParams, R: WasmResults>(
            instance: &Instance,
            store: &mut Store<HostState>,
            name: &str,
        ) -> Result<TypedFunc<P, R>, AdmissionError> {
            instance
                .get_typed_func::<P, R>(&mut *store, name)
                .map_err(|e| AdmissionError::MissingExport(format!("{name} ({e})")))
        }
        Ok(Self {
            create: typed(instance, store, "proxy_on_context_create")?,
            configure: typed(instance, store, "proxy_on_configure")?,
            on_headers: typed(instance, store, "proxy_on_request_headers")?,
            on_body: typed(instance, store, "proxy_on_request_body")?,
            on_response_headers: instance
                .get_typed_func::<(i32, i32, i32), i32>(&mut *store, "proxy_on_response_headers")
                .ok(),
            on_response_body: instance
                .get_typed_func::<(i32, i32, i32), i32>(&mut *store, "proxy_on_response_body")
                .ok(),
            on_log: instance.get_typed_func::<i32, ()>(&mut *store, "proxy_on_log").ok(),
            on_done: typed(instance, store, "proxy_on_done")?,
            on_delete: typed(instance, store, "proxy_on_delete")?,
        })
    }
}

/// The root context's id.
const ROOT: i32 = 1;

/// Initialise the reactor, find the callbacks, create the root context, start the VM and
/// configure the plugin.
fn start(
    instance: &Instance,
    store: &mut Store<HostState>,
    cfg: &AdmissionConfig,
) -> Result<Callbacks, AdmissionError> {
    let start_trap = |store: &Store<HostState>, phase: &'static str, e: wasmtime::Error| {
        limit_hit(&e, store, cfg, Site { phase, sample: None }, AdmissionError::Start)
    };
    for init in ["_initialize", "_start"] {
        if let Ok(f) = instance.get_typed_func::<(), ()>(&mut *store, init) {
            f.call(&mut *store, ()).map_err(|e| start_trap(store, init, e))?;
        }
    }
    let cb = Callbacks::get(instance, store)?;
    cb.create.call(&mut *store, (ROOT, 0)).map_err(|e| start_trap(store, "on_context_create", e))?;
    if let Ok(vm_start) = instance.get_typed_func::<(i32, i32), i32>(&mut *store, "proxy_on_vm_start") {
        vm_start.call(&mut *store, (ROOT, 0)).map_err(|e| start_trap(store, "on_vm_start", e))?;
    }
    let config_len = cfg.plugin_config.len() as i32;
    let ok = cb.configure.call(&mut *store, (ROOT, config_len)).map_err(|e| start_trap(store, "on_configure", e))?;
    if ok == 0 {
        return Err(AdmissionError::ConfigureRejected);
    }
    Ok(cb)
}

/// Replay sample `k` through a new HTTP context, request and response, each callback with its
/// fuel and the whole sample under one wall-clock deadline; returns what the module did and
/// how long it took.
fn run_sample(
    store: &mut Store<HostState>,
    cb: &Callbacks,
    cfg: &AdmissionConfig,
    k: usize,
    sample: &SampleRequest,
) -> Result<(SampleOutcome, Duration), AdmissionError> {
    let ctx = 100 + k as i32;
    {
        let st = store.data_mut();
        st.headers = sample.headers.clone();
        st.body = sample.body.clone();
        st.response_headers = sample.response_headers.clone();
        st.response_body = sample.response_body.clone();
        st.local_response = None;
        st.properties = sample.properties.clone();
    }
    store.set_epoch_deadline(ticks(cfg.budget_per_request));
    let started = Instant::now();
    let failed = |store: &Store<HostState>, phase: &'static str, e: wasmtime::Error| {
        limit_hit(&e, store, cfg, Site { phase, sample: Some(k) }, |message| AdmissionError::Trap {
            sample: k,
            phase,
            message,
        })
    };
    let refuel = |store: &mut Store<HostState>| {
        store.set_fuel(cfg.fuel_per_call).map_err(|e| AdmissionError::Start(e.to_string()))
    };
    refuel(store)?;
    cb.create.call(&mut *store, (ctx, ROOT)).map_err(|e| failed(store, "on_context_create", e))?;
    let headers = sample.headers.len() as i32;
    let empty = i32::from(sample.body.is_empty());
    refuel(store)?;
    let _action =
        cb.on_headers.call(&mut *store, (ctx, headers, empty)).map_err(|e| failed(store, "on_request_headers", e))?;
    if !sample.body.is_empty() && store.data().local_response.is_none() {
        refuel(store)?;
        let len = sample.body.len() as i32;
        cb.on_body.call(&mut *store, (ctx, len, 1)).map_err(|e| failed(store, "on_request_body", e))?;
    }
    // The response path, as Envoy runs it once the engine answers (unless the module answered
    // the request itself).
    if store.data().local_response.is_none() {
        if let Some(f) = &cb.on_response_headers {
            refuel(store)?;
            let n = sample.response_headers.len() as i32;
            let empty = i32::from(sample.response_body.is_empty());
            f.call(&mut *store, (ctx, n, empty)).map_err(|e| failed(store, "on_response_headers", e))?;
        }
        if let (Some(f), false) = (&cb.on_response_body, sample.response_body.is_empty()) {
            refuel(store)?;
            let len = sample.response_body.len() as i32;
            f.call(&mut *store, (ctx, len, 1)).map_err(|e| failed(store, "on_response_body", e))?;
        }
    }
    if let Some(f) = &cb.on_log {
        refuel(store)?;
        f.call(&mut *store, ctx).map_err(|e| failed(store, "on_log", e))?;
    }
    refuel(store)?;
    cb.on_done.call(&mut *store, ctx).map_err(|e| failed(store, "on_done", e))?;
    cb.on_delete.call(&mut *store, ctx).map_err(|e| failed(store, "on_delete", e))?;
    let took = started.elapsed();
    let st = store.data();
    let outcome = SampleOutcome {
        headers: st.headers.clone(),
        local_response: st.local_response,
        properties: st.properties.clone(),
    };
    Ok((outcome, took))
}

/// Load `bytes` (already signature-verified; a signature section is a custom section and is
/// ignored by the runtime) and run the admission checks.
pub fn admit(bytes: &[u8], cfg: &AdmissionConfig) -> Result<AdmissionReport, AdmissionError> {
    let mut config = Config::new();
    config.consume_fuel(true);
    config.epoch_interruption(true);
    let engine = Engine::new(&config).map_err(|e| AdmissionError::Compile(e.to_string()))?;
    let module = Module::new(&engine, bytes).map_err(|e| AdmissionError::Compile(trap_message(&e)))?;
    let abi = check_interface(&module)?;
    let linker = abi::link(&engine, &module)?;

    let mut state = HostState {
        plugin_config: cfg.plugin_config.clone(),
        memory: MemoryCap { limit_bytes: cfg.memory_limit_bytes, refused: None },
        ..HostState::default()
    };
    for (k, v) in &cfg.shared_data {
        state.shared.insert(k.clone(), (v.clone(), 1));
    }
    let mut store = Store::new(&engine, state);
    store.limiter(|st| &mut st.memory);
    store.set_fuel(cfg.fuel_per_call).map_err(|e| AdmissionError::Start(e.to_string()))?;
    let _ticker = Ticker::start(&engine)?;
    store.set_epoch_deadline(ticks(cfg.budget_to_start));
    let instance = linker.instantiate(&mut store, &module).map_err(|e| {
        limit_hit(&e, &store, cfg, Site { phase: "instantiation", sample: None }, AdmissionError::Start)
    })?;
    let cb = start(&instance, &mut store, cfg)?;

    let mut report = AdmissionReport { abi, ..AdmissionReport::default() };
    for (k, sample) in cfg.samples.iter().enumerate() {
        let (outcome, took) = run_sample(&mut store, &cb, cfg, k, sample)?;
        if took > cfg.budget_per_request {
            return Err(AdmissionError::OverBudget {
                sample: k,
                took_ms: took.as_secs_f64() * 1000.0,
                budget_ms: cfg.budget_per_request.as_secs_f64() * 1000.0,
            });
        }
        report.max_request_us = report.max_request_us.max(took.as_micros() as u64);
        report.outcomes.push(outcome);
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
        filter_with(body_fn, "(i32.const 0)")
    }

    /// [`filter`], with `on_response_body` running `response_fn`.
    pub(crate) fn filter_with(body_fn: &str, response_fn: &str) -> Vec<u8> {
        wat(&include_str!("../../../tests/fixtures/filter.wat")
            .replace("BODY", body_fn)
            .replace("RESPONSE", response_fn))
    }

    /// Grows memory a MiB at a time, forever.
    const MEMORY_HOG: &str = "(loop $l (drop (memory.grow (i32.const 16))) (br $l)) (i32.const 0)";
    const ENDLESS: &str = "(loop $l (br $l)) (i32.const 0)";

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
        let plain = include_bytes!("../../../tests/fixtures/minimal.wasm");
        assert!(matches!(admit(plain, &AdmissionConfig::default()), Err(AdmissionError::NoAbiVersion)));
        let no_body = wat(r#"(module (memory (export "memory") 1) (func (export "proxy_abi_version_0_2_1")))"#);
        assert!(matches!(admit(&no_body, &AdmissionConfig::default()), Err(AdmissionError::MissingExport(_))));
        let foreign = wat(r#"(module (import "evil" "syscall" (func)) (func (export "proxy_abi_version_0_2_1")))"#);
        assert!(matches!(admit(&foreign, &AdmissionConfig::default()), Err(AdmissionError::UnknownImport { .. })));
        assert!(matches!(admit(b"garbage", &AdmissionConfig::default()), Err(AdmissionError::Compile(_))));
    }

    #[test]
    fn a_module_that_grows_memory_without_bound_is_refused_naming_the_limit() {
        let cfg = AdmissionConfig { memory_limit_bytes: 32 << 20, ..AdmissionConfig::default() };
        let started = Instant::now();
        let e = admit(&filter(MEMORY_HOG), &cfg).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
        match &e {
            AdmissionError::MemoryLimit { site, requested_mib, limit_mib } => {
                assert_eq!(*site, Site { phase: "on_request_body", sample: Some(0) });
                assert!(*requested_mib > 32.0 && *requested_mib <= 33.0, "{requested_mib}");
                assert_eq!(*limit_mib, 32.0);
            }
            other => panic!("expected the memory limit, got {other}"),
        }
        let msg = e.to_string();
        assert!(msg.contains("memory limit of 32.0 MiB") && msg.contains("admission_memory_mb"), "{msg}");
        // A module that declares more initial memory than the limit is refused as it starts.
        let big = wat(&include_str!("../../../tests/fixtures/filter.wat")
            .replace("(memory (export \"memory\") 1)", "(memory (export \"memory\") 1024)")
            .replace("BODY", "(i32.const 0)")
            .replace("RESPONSE", "(i32.const 0)"));
        let e = admit(&big, &cfg).unwrap_err();
        assert!(
            matches!(e, AdmissionError::MemoryLimit { site: Site { phase: "instantiation", sample: None }, .. }),
            "{e}"
        );
        // Within the limit, the same module is admitted.
        let roomy = AdmissionConfig { memory_limit_bytes: 80 << 20, ..AdmissionConfig::default() };
        assert!(admit(&big, &roomy).is_ok());
    }

    #[test]
    fn an_endless_loop_is_stopped_at_the_deadline_inside_the_call() {
        let cfg = AdmissionConfig { budget_per_request: Duration::from_millis(50), ..AdmissionConfig::default() };
        let started = Instant::now();
        let e = admit(&filter(ENDLESS), &cfg).unwrap_err();
        let took = started.elapsed();
        // Stopped at about 50 ms, not after the fuel (seconds of looping) ran out.
        assert!(took < Duration::from_secs(1), "took {took:?}");
        match &e {
            AdmissionError::Interrupted { site, budget_ms, .. } => {
                assert_eq!(*site, Site { phase: "on_request_body", sample: Some(0) });
                assert_eq!(*budget_ms, 50.0);
            }
            other => panic!("expected the wall-clock limit, got {other}"),
        }
        assert!(e.to_string().contains("admission_budget_ms"), "{e}");
        // With a small fuel allowance and a long deadline, fuel stops it first and is named.
        let cfg = AdmissionConfig {
            budget_per_request: Duration::from_secs(30),
            fuel_per_call: 1_000_000,
            ..AdmissionConfig::default()
        };
        let e = admit(&filter(ENDLESS), &cfg).unwrap_err();
        assert!(matches!(e, AdmissionError::OutOfFuel { fuel: 1_000_000, .. }), "{e}");
        assert!(e.to_string().contains("1000000 Wasm instructions"), "{e}");
    }

    #[test]
    fn the_response_path_is_exercised() {
        let e = admit(&filter_with("(i32.const 0)", "(unreachable)"), &AdmissionConfig::default()).unwrap_err();
        assert!(matches!(e, AdmissionError::Trap { phase: "on_response_body", sample: 0, .. }), "{e}");
        let e = admit(&filter_with("(i32.const 0)", ENDLESS), &AdmissionConfig::default()).unwrap_err();
        assert!(matches!(e, AdmissionError::Interrupted { site: Site { phase: "on_response_body", .. }, .. }), "{e}");
    }
}
