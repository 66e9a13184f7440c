//! An emulation of the proxy-wasm ABI (0.2.x, the subset Envoy gives HTTP filters) and of the
//! WASI calls a Rust module may import, for running a module in `wasmtime` at admission.
//!
//! It implements what scheduling filters use (logging, time, buffers, header maps, properties,
//! shared data with CAS, metrics, local responses); every other ABI import answers
//! `Unimplemented`, so a module that depends on one fails here rather than in Envoy.

use std::collections::HashMap;
use std::time::Instant;

use wasmtime::{Caller, Engine, Extern, FuncType, Linker, Module, Val, ValType};

use super::AdmissionError;

/// proxy-wasm status codes.
const OK: i32 = 0;
const NOT_FOUND: i32 = 1;
const BAD_ARGUMENT: i32 = 2;
const CAS_MISMATCH: i32 = 8;
const UNIMPLEMENTED: i32 = 12;

/// Buffer and map types.
const BUF_REQUEST_BODY: i32 = 0;
const BUF_RESPONSE_BODY: i32 = 1;
const BUF_VM_CONFIGURATION: i32 = 6;
const BUF_PLUGIN_CONFIGURATION: i32 = 7;
const MAP_REQUEST_HEADERS: i32 = 0;
const MAP_RESPONSE_HEADERS: i32 = 2;

/// What the emulated Envoy holds for the module.
#[derive(Default)]
pub(super) struct HostState {
    pub(super) plugin_config: Vec<u8>,
    pub(super) headers: Vec<(String, String)>,
    pub(super) body: Vec<u8>,
    pub(super) response_headers: Vec<(String, String)>,
    pub(super) response_body: Vec<u8>,
    pub(super) local_response: Option<u32>,
    pub(super) properties: Vec<(String, Vec<u8>)>,
    pub(super) shared: HashMap<String, (Vec<u8>, u32)>,
    pub(super) metrics: Vec<(String, i64)>,
    pub(super) logs: Vec<String>,
    pub(super) memory: MemoryCap,
}

/// The module's memory limit: a `memory.grow` past it traps, and the refusal names the limit.
#[derive(Debug, Default)]
pub(super) struct MemoryCap {
    pub(super) limit_bytes: usize,
    /// The size a refused growth asked for.
    pub(super) refused: Option<usize>,
}

/// Tables (function references) a module may hold: far above what a compiled filter needs.
const MAX_TABLE_ELEMENTS: usize = 1 << 20;

impl wasmtime::ResourceLimiter for MemoryCap {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.limit_bytes {
            self.refused = Some(desired);
            return Err(wasmtime::Error::msg(format!(
                "memory would grow to {desired} bytes, over the {} byte limit",
                self.limit_bytes
            )));
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS)
    }
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

/// One family of proxy-wasm imports; `None` means the name is not in it.
type Family = fn(&str, &mut Ctx<'_>, &[Val]) -> wasmtime::Result<Option<i32>>;

const FAMILIES: [Family; 6] = [log_time_and_stream, buffers, headers, properties, shared_data, metrics];

/// Implement one proxy-wasm import; `None` means "not emulated" (answers Unimplemented).
fn call(name: &str, c: &mut Ctx<'_>, a: &[Val]) -> wasmtime::Result<Option<i32>> {
    for family in FAMILIES {
        if let Some(status) = family(name, c, a)? {
            return Ok(Some(status));
        }
    }
    Ok(None)
}

/// Logging, time, stream control and local responses.
fn log_time_and_stream(name: &str, c: &mut Ctx<'_>, a: &[Val]) -> wasmtime::Result<Option<i32>> {
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
        "proxy_send_local_response" => {
            c.data_mut().local_response = Some(i(a, 0) as u32);
            OK
        }

        _ => return Ok(None),
    };
    Ok(Some(status))
}

/// The request body and the plugin and VM configuration buffers.
fn buffers(name: &str, c: &mut Ctx<'_>, a: &[Val]) -> wasmtime::Result<Option<i32>> {
    let status = match name {
        "proxy_get_buffer_bytes" => {
            let data = match i(a, 0) {
                BUF_REQUEST_BODY => c.data().body.clone(),
                BUF_RESPONSE_BODY => c.data().response_body.clone(),
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
            let data = read(c, i(a, 3), i(a, 4)).unwrap_or_default();
            match i(a, 0) {
                BUF_REQUEST_BODY => c.data_mut().body = data,
                BUF_RESPONSE_BODY => c.data_mut().response_body = data,
                _ => return Ok(Some(NOT_FOUND)),
            }
            OK
        }
        _ => return Ok(None),
    };
    Ok(Some(status))
}

/// The request and response header maps (other maps are empty).
fn header_map(st: &mut HostState, map: i32) -> Option<&mut Vec<(String, String)>> {
    match map {
        MAP_REQUEST_HEADERS => Some(&mut st.headers),
        MAP_RESPONSE_HEADERS => Some(&mut st.response_headers),
        _ => None,
    }
}

/// Header maps: the request's and the response's.
fn headers(name: &str, c: &mut Ctx<'_>, a: &[Val]) -> wasmtime::Result<Option<i32>> {
    let map = i(a, 0);
    let status = match name {
        "proxy_get_header_map_pairs" => {
            let m = serialize_map(header_map(c.data_mut(), map).map_or(&[][..], |h| h.as_slice()));
            give(c, &m, i(a, 1), i(a, 2))?
        }
        "proxy_get_header_map_value" => {
            let key = read_str(c, i(a, 1), i(a, 2)).unwrap_or_default();
            let v = header_map(c.data_mut(), map)
                .and_then(|h| h.iter().find(|(k, _)| k.eq_ignore_ascii_case(&key)).map(|(_, v)| v.clone()));
            match v {
                Some(v) => give(c, v.as_bytes(), i(a, 3), i(a, 4))?,
                None => NOT_FOUND,
            }
        }
        "proxy_add_header_map_value" | "proxy_replace_header_map_value" => {
            let (k, v) =
                (read_str(c, i(a, 1), i(a, 2)).unwrap_or_default(), read_str(c, i(a, 3), i(a, 4)).unwrap_or_default());
            if let Some(h) = header_map(c.data_mut(), map) {
                if name == "proxy_replace_header_map_value" {
                    h.retain(|(x, _)| !x.eq_ignore_ascii_case(&k));
                }
                h.push((k.to_ascii_lowercase(), v));
            }
            OK
        }
        "proxy_remove_header_map_value" => {
            let k = read_str(c, i(a, 1), i(a, 2)).unwrap_or_default();
            if let Some(h) = header_map(c.data_mut(), map) {
                h.retain(|(x, _)| !x.eq_ignore_ascii_case(&k));
            }
            OK
        }
        "proxy_set_header_map_pairs" => OK,
        _ => return Ok(None),
    };
    Ok(Some(status))
}

/// Filter state (`wasm.<name>` properties).
fn properties(name: &str, c: &mut Ctx<'_>, a: &[Val]) -> wasmtime::Result<Option<i32>> {
    let status = match name {
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
        _ => return Ok(None),
    };
    Ok(Some(status))
}

/// Shared data, with compare-and-swap.
fn shared_data(name: &str, c: &mut Ctx<'_>, a: &[Val]) -> wasmtime::Result<Option<i32>> {
    let status = match name {
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
        _ => return Ok(None),
    };
    Ok(Some(status))
}

/// Metrics: defined, incremented, recorded and read in memory.
fn metrics(name: &str, c: &mut Ctx<'_>, a: &[Val]) -> wasmtime::Result<Option<i32>> {
    let status = match name {
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

/// A linker that answers every import of `module` from the emulation: proxy-wasm imports from
/// [`call`] (Unimplemented when not emulated), WASI imports from [`wasi`].
pub(super) fn link(engine: &Engine, module: &Module) -> Result<Linker<HostState>, AdmissionError> {
    let mut linker: Linker<HostState> = Linker::new(engine);
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

    Ok(linker)
}
