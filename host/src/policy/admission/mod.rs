//! Admission: before a policy module may be rolled out, the host runs it in `wasmtime` under an
//! emulation of the proxy-wasm ABI ([`abi`]): the module must export the ABI, accept its
//! configuration in `on_configure`, and handle a set of recorded sample requests ([`samples`])
//! without trapping, within a time budget. Runaway code is stopped by fuel.

mod abi;
mod samples;

use std::time::{Duration, Instant};

use wasmtime::{Config, Engine, Instance, Module, Store, TypedFunc, WasmParams, WasmResults};

use abi::HostState;
pub use samples::{check_scorer_outputs, default_samples, scorer_samples, SampleRequest};

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
    plugin_config_len: usize,
) -> Result<Callbacks, AdmissionError> {
    let start_trap = |e: wasmtime::Error| AdmissionError::Start(trap_message(&e));
    for init in ["_initialize", "_start"] {
        if let Ok(f) = instance.get_typed_func::<(), ()>(&mut *store, init) {
            f.call(&mut *store, ()).map_err(start_trap)?;
        }
    }
    let cb = Callbacks::get(instance, store)?;
    cb.create.call(&mut *store, (ROOT, 0)).map_err(start_trap)?;
    if let Ok(vm_start) = instance.get_typed_func::<(i32, i32), i32>(&mut *store, "proxy_on_vm_start") {
        vm_start.call(&mut *store, (ROOT, 0)).map_err(start_trap)?;
    }
    let ok = cb.configure.call(&mut *store, (ROOT, plugin_config_len as i32)).map_err(start_trap)?;
    if ok == 0 {
        return Err(AdmissionError::ConfigureRejected);
    }
    Ok(cb)
}

/// Replay sample `k` through a new HTTP context, each callback with `fuel`; returns what the
/// module did and how long it took.
fn run_sample(
    store: &mut Store<HostState>,
    cb: &Callbacks,
    fuel: u64,
    k: usize,
    sample: &SampleRequest,
) -> Result<(SampleOutcome, Duration), AdmissionError> {
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
    let refuel = |store: &mut Store<HostState>| store.set_fuel(fuel).map_err(|e| AdmissionError::Start(e.to_string()));
    refuel(store)?;
    cb.create.call(&mut *store, (ctx, ROOT)).map_err(trap("on_context_create"))?;
    let headers = sample.headers.len() as i32;
    let empty = i32::from(sample.body.is_empty());
    refuel(store)?;
    let _action = cb.on_headers.call(&mut *store, (ctx, headers, empty)).map_err(trap("on_request_headers"))?;
    if !sample.body.is_empty() && store.data().local_response.is_none() {
        refuel(store)?;
        cb.on_body.call(&mut *store, (ctx, sample.body.len() as i32, 1)).map_err(trap("on_request_body"))?;
    }
    if let Some(f) = &cb.on_log {
        refuel(store)?;
        f.call(&mut *store, ctx).map_err(trap("on_log"))?;
    }
    cb.on_done.call(&mut *store, ctx).map_err(trap("on_done"))?;
    cb.on_delete.call(&mut *store, ctx).map_err(trap("on_delete"))?;
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
    let engine = Engine::new(&config).map_err(|e| AdmissionError::Compile(e.to_string()))?;
    let module = Module::new(&engine, bytes).map_err(|e| AdmissionError::Compile(trap_message(&e)))?;
    let abi = check_interface(&module)?;
    let linker = abi::link(&engine, &module)?;

    let mut state = HostState { plugin_config: cfg.plugin_config.clone(), ..HostState::default() };
    for (k, v) in &cfg.shared_data {
        state.shared.insert(k.clone(), (v.clone(), 1));
    }
    let mut store = Store::new(&engine, state);
    store.set_fuel(cfg.fuel_per_call).map_err(|e| AdmissionError::Start(e.to_string()))?;
    let instance = linker.instantiate(&mut store, &module).map_err(|e| AdmissionError::Start(trap_message(&e)))?;
    let cb = start(&instance, &mut store, cfg.plugin_config.len())?;

    let mut report = AdmissionReport { abi, ..AdmissionReport::default() };
    for (k, sample) in cfg.samples.iter().enumerate() {
        let (outcome, took) = run_sample(&mut store, &cb, cfg.fuel_per_call, k, sample)?;
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
        wat(&include_str!("../../../tests/fixtures/filter.wat").replace("BODY", body_fn))
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
        let plain = include_bytes!("../../../tests/fixtures/minimal.wasm");
        assert!(matches!(admit(plain, &AdmissionConfig::default()), Err(AdmissionError::NoAbiVersion)));
        let no_body = wat(r#"(module (memory (export "memory") 1) (func (export "proxy_abi_version_0_2_1")))"#);
        assert!(matches!(admit(&no_body, &AdmissionConfig::default()), Err(AdmissionError::MissingExport(_))));
        let foreign = wat(r#"(module (import "evil" "syscall" (func)) (func (export "proxy_abi_version_0_2_1")))"#);
        assert!(matches!(admit(&foreign, &AdmissionConfig::default()), Err(AdmissionError::UnknownImport { .. })));
        assert!(matches!(admit(b"garbage", &AdmissionConfig::default()), Err(AdmissionError::Compile(_))));
    }
}
