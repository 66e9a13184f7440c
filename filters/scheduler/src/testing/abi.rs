//! The proxy-wasm 0.2 host ABI, as the SDK (`proxy_wasm::hostcalls`) imports it, over this
//! thread's [`MockHost`]. Each function has the exact signature of the SDK's `extern "C"`
//! declaration and returns only statuses the SDK's wrapper expects for the case (any other
//! status makes the wrapper panic, which fails the test).
//!
//! Buffers handed back to the VM are allocated with the SDK's own `proxy_on_memory_allocate`,
//! as Envoy does: the SDK takes them over with `Vec::from_raw_parts(ptr, len, len)`. An empty
//! value is returned as a null pointer, as Envoy does. Maps use the SDK's serialized format:
//! `u32` count, `u32` name and value sizes per pair, then each name and value NUL-terminated.
//!
//! Nothing here may panic: a panic cannot unwind out of an `extern "C"` function.

#![allow(clippy::missing_safety_doc, clippy::too_many_arguments)]

use std::sync::atomic::{AtomicU32, Ordering};

use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status, StreamType};

use super::{try_with, GrpcCall, GrpcStream, Headers, LocalResponse, Metric, MockHost};

extern "C" {
    /// The SDK's allocator export (`malloc` in a Wasm build): what Envoy calls to put a value
    /// into the VM's memory.
    fn proxy_on_memory_allocate(size: usize) -> *mut u8;
}

/// The bytes at `data`, or none if it is null.
unsafe fn bytes<'a>(data: *const u8, size: usize) -> &'a [u8] {
    if data.is_null() || size == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(data, size)
    }
}

unsafe fn text(data: *const u8, size: usize) -> String {
    String::from_utf8_lossy(bytes(data, size)).into_owned()
}

unsafe fn put<T>(out: *mut T, value: T) {
    if !out.is_null() {
        *out = value;
    }
}

/// Copy `value` into memory the VM owns and return it through `data` and `size`.
unsafe fn give(value: &[u8], data: *mut *mut u8, size: *mut usize) {
    let ptr = if value.is_empty() {
        std::ptr::null_mut()
    } else {
        let p = proxy_on_memory_allocate(value.len());
        std::ptr::copy_nonoverlapping(value.as_ptr(), p, value.len());
        p
    };
    put(data, ptr);
    put(size, value.len());
}

/// The SDK's serialized map format.
pub fn serialize_map(pairs: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
    for (k, v) in pairs {
        out.extend((k.len() as u32).to_le_bytes());
        out.extend((v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend(k.as_bytes());
        out.push(0);
        out.extend(v);
        out.push(0);
    }
    out
}

/// Parse the SDK's serialized map format (None if malformed).
pub fn deserialize_map(b: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    if b.is_empty() {
        return Some(Vec::new());
    }
    let u32_at = |at: usize| -> Option<usize> {
        let w: [u8; 4] = b.get(at..at.checked_add(4)?)?.try_into().ok()?;
        Some(u32::from_le_bytes(w) as usize)
    };
    let n = u32_at(0)?;
    let mut p = n.checked_mul(8)?.checked_add(4)?;
    let mut out = Vec::with_capacity(n.min(1024));
    for i in 0..n {
        let (k, v) = (u32_at(4 + i * 8)?, u32_at(8 + i * 8)?);
        let key = b.get(p..p.checked_add(k)?)?;
        p += k + 1;
        let value = b.get(p..p.checked_add(v)?)?;
        p += v + 1;
        out.push((String::from_utf8_lossy(key).into_owned(), value.to_vec()));
    }
    Some(out)
}

fn property_path(raw: &[u8]) -> Vec<String> {
    raw.split(|b| *b == 0).map(|p| String::from_utf8_lossy(p).into_owned()).collect()
}

/// A header map of the effective stream.
fn map(h: &mut MockHost, t: MapType) -> Option<&mut Headers> {
    let s = h.stream()?;
    match t {
        MapType::HttpRequestHeaders => Some(&mut s.request_headers),
        MapType::HttpResponseHeaders => Some(&mut s.response_headers),
        _ => None,
    }
}

fn status(r: Option<Status>) -> Status {
    r.unwrap_or(Status::InternalFailure)
}

#[no_mangle]
pub unsafe extern "C" fn proxy_log(level: LogLevel, message_data: *const u8, message_size: usize) -> Status {
    let msg = text(message_data, message_size);
    status(try_with(|h| {
        h.logs.push((level, msg));
        Status::Ok
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_log_level(return_level: *mut LogLevel) -> Status {
    status(try_with(|h| {
        put(return_level, h.log_level);
        Status::Ok
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> Status {
    status(try_with(|h| {
        put(return_time, h.now_ns);
        h.now_ns += h.clock_step_ns;
        Status::Ok
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_set_tick_period_milliseconds(period: u32) -> Status {
    status(try_with(|h| {
        h.tick_period_ms = Some(period);
        Status::Ok
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_buffer_bytes(
    buffer_type: BufferType,
    start: usize,
    max_size: usize,
    return_buffer_data: *mut *mut u8,
    return_buffer_size: *mut usize,
) -> Status {
    status(try_with(|h| {
        let buffer = match buffer_type {
            BufferType::PluginConfiguration => Some(&h.plugin_config),
            BufferType::GrpcReceiveBuffer => Some(&h.grpc_receive),
            BufferType::HttpRequestBody => h.streams.get(&h.current).map(|s| &s.request_body),
            BufferType::HttpResponseBody => h.streams.get(&h.current).map(|s| &s.response_body),
            _ => None,
        };
        let Some(buffer) = buffer else {
            return Status::NotFound;
        };
        let end = start.saturating_add(max_size).min(buffer.len());
        give(buffer.get(start..end).unwrap_or_default(), return_buffer_data, return_buffer_size);
        Status::Ok
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_set_buffer_bytes(
    buffer_type: BufferType,
    start: usize,
    size: usize,
    buffer_data: *const u8,
    buffer_size: usize,
) -> Status {
    let value = bytes(buffer_data, buffer_size).to_vec();
    status(try_with(|h| {
        let Some(s) = h.stream() else {
            return Status::BadArgument;
        };
        let buffer = match buffer_type {
            BufferType::HttpRequestBody => &mut s.request_body,
            BufferType::HttpResponseBody => &mut s.response_body,
            _ => return Status::BadArgument,
        };
        let start = start.min(buffer.len());
        let end = start.saturating_add(size).min(buffer.len());
        buffer.splice(start..end, value);
        Status::Ok
    }))
}

/// Run `f` on a header map of the effective stream (BadArgument if there is none).
fn on_map(t: MapType, f: impl FnOnce(&mut Headers) -> Status) -> Status {
    status(try_with(|h| map(h, t).map_or(Status::BadArgument, f)))
}

/// Add a header, or set it (`replace`: its other values go), as Envoy does, name lower-cased.
unsafe fn write_header(t: MapType, key: (*const u8, usize), value: (*const u8, usize), replace: bool) -> Status {
    let (key, value) = (text(key.0, key.1).to_ascii_lowercase(), bytes(value.0, value.1).to_vec());
    on_map(t, |m| {
        if replace {
            m.retain(|(k, _)| *k != key);
        }
        m.push((key, value));
        Status::Ok
    })
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_header_map_pairs(
    map_type: MapType,
    return_map_data: *mut *mut u8,
    return_map_size: *mut usize,
) -> Status {
    on_map(map_type, |m| {
        give(&serialize_map(m), return_map_data, return_map_size);
        Status::Ok
    })
}

#[no_mangle]
pub unsafe extern "C" fn proxy_set_header_map_pairs(map_type: MapType, map_data: *const u8, map_size: usize) -> Status {
    let Some(pairs) = deserialize_map(bytes(map_data, map_size)) else {
        return Status::SerializationFailure;
    };
    on_map(map_type, |m| {
        *m = pairs.into_iter().map(|(k, v)| (k.to_ascii_lowercase(), v)).collect();
        Status::Ok
    })
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_header_map_value(
    map_type: MapType,
    key_data: *const u8,
    key_size: usize,
    return_value_data: *mut *mut u8,
    return_value_size: *mut usize,
) -> Status {
    let key = text(key_data, key_size);
    on_map(map_type, |m| match m.iter().find(|(k, _)| k.eq_ignore_ascii_case(&key)) {
        Some((_, v)) => {
            give(v, return_value_data, return_value_size);
            Status::Ok
        }
        None => Status::NotFound,
    })
}

#[no_mangle]
pub unsafe extern "C" fn proxy_remove_header_map_value(
    map_type: MapType,
    key_data: *const u8,
    key_size: usize,
) -> Status {
    let key = text(key_data, key_size);
    on_map(map_type, |m| {
        m.retain(|(k, _)| !k.eq_ignore_ascii_case(&key));
        Status::Ok
    })
}

#[no_mangle]
pub unsafe extern "C" fn proxy_replace_header_map_value(
    map_type: MapType,
    key_data: *const u8,
    key_size: usize,
    value_data: *const u8,
    value_size: usize,
) -> Status {
    write_header(map_type, (key_data, key_size), (value_data, value_size), true)
}

#[no_mangle]
pub unsafe extern "C" fn proxy_add_header_map_value(
    map_type: MapType,
    key_data: *const u8,
    key_size: usize,
    value_data: *const u8,
    value_size: usize,
) -> Status {
    write_header(map_type, (key_data, key_size), (value_data, value_size), false)
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_property(
    path_data: *const u8,
    path_size: usize,
    return_value_data: *mut *mut u8,
    return_value_size: *mut usize,
) -> Status {
    let path = property_path(bytes(path_data, path_size));
    status(try_with(|h| {
        let on_stream = h.streams.get(&h.current).and_then(|s| s.properties.get(&path));
        match on_stream.or_else(|| h.properties.get(&path)) {
            Some(v) => {
                give(v, return_value_data, return_value_size);
                Status::Ok
            }
            None => Status::NotFound,
        }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_set_property(
    path_data: *const u8,
    path_size: usize,
    value_data: *const u8,
    value_size: usize,
) -> Status {
    let path = property_path(bytes(path_data, path_size));
    let value = bytes(value_data, value_size).to_vec();
    status(try_with(|h| {
        match h.stream() {
            Some(s) => s.properties.insert(path, value),
            None => h.properties.insert(path, value),
        };
        Status::Ok
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_shared_data(
    key_data: *const u8,
    key_size: usize,
    return_value_data: *mut *mut u8,
    return_value_size: *mut usize,
    return_cas: *mut u32,
) -> Status {
    let key = text(key_data, key_size);
    status(try_with(|h| match h.shared.get(&key) {
        Some((value, cas)) => {
            give(value, return_value_data, return_value_size);
            put(return_cas, *cas);
            Status::Ok
        }
        None => Status::NotFound,
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_set_shared_data(
    key_data: *const u8,
    key_size: usize,
    value_data: *const u8,
    value_size: usize,
    cas: u32,
) -> Status {
    let (key, value) = (text(key_data, key_size), bytes(value_data, value_size).to_vec());
    status(try_with(|h| if h.set_shared(key, value, cas) { Status::Ok } else { Status::CasMismatch }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_register_shared_queue(
    _name_data: *const u8,
    _name_size: usize,
    return_id: *mut u32,
) -> Status {
    put(return_id, 1);
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_resolve_shared_queue(
    _vm_id_data: *const u8,
    _vm_id_size: usize,
    _name_data: *const u8,
    _name_size: usize,
    _return_id: *mut u32,
) -> Status {
    Status::NotFound
}

#[no_mangle]
pub unsafe extern "C" fn proxy_dequeue_shared_queue(
    _queue_id: u32,
    _return_value_data: *mut *mut u8,
    _return_value_size: *mut usize,
) -> Status {
    Status::Empty
}

#[no_mangle]
pub unsafe extern "C" fn proxy_enqueue_shared_queue(
    _queue_id: u32,
    _value_data: *const u8,
    _value_size: usize,
) -> Status {
    Status::NotFound
}

#[no_mangle]
pub unsafe extern "C" fn proxy_continue_stream(stream_type: StreamType) -> Status {
    status(try_with(|h| {
        if let (StreamType::HttpRequest, Some(s)) = (stream_type, h.stream()) {
            s.resumed += 1;
        }
        Status::Ok
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_close_stream(_stream_type: StreamType) -> Status {
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_send_local_response(
    status_code: u32,
    _status_code_details_data: *const u8,
    _status_code_details_size: usize,
    body_data: *const u8,
    body_size: usize,
    headers_data: *const u8,
    headers_size: usize,
    _grpc_status: i32,
) -> Status {
    let Some(headers) = deserialize_map(bytes(headers_data, headers_size)) else {
        return Status::SerializationFailure;
    };
    let headers = headers.into_iter().map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned())).collect();
    let body = bytes(body_data, body_size).to_vec();
    status(try_with(|h| match h.stream() {
        Some(s) => {
            s.local_response = Some(LocalResponse { status: status_code, headers, body });
            Status::Ok
        }
        None => Status::BadArgument,
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_http_call(
    _upstream_data: *const u8,
    _upstream_size: usize,
    _headers_data: *const u8,
    _headers_size: usize,
    _body_data: *const u8,
    _body_size: usize,
    _trailers_data: *const u8,
    _trailers_size: usize,
    _timeout: u32,
    _return_token: *mut u32,
) -> Status {
    Status::InternalFailure
}

#[no_mangle]
pub unsafe extern "C" fn proxy_grpc_call(
    upstream_data: *const u8,
    upstream_size: usize,
    service_name_data: *const u8,
    service_name_size: usize,
    method_name_data: *const u8,
    method_name_size: usize,
    _initial_metadata_data: *const u8,
    _initial_metadata_size: usize,
    message_data_data: *const u8,
    message_data_size: usize,
    timeout: u32,
    return_callout_id: *mut u32,
) -> Status {
    let cluster = text(upstream_data, upstream_size);
    let service = text(service_name_data, service_name_size);
    let method = text(method_name_data, method_name_size);
    let message = if message_data_data.is_null() {
        Vec::new()
    } else {
        std::slice::from_raw_parts(message_data_data, message_data_size).to_vec()
    };
    status(try_with(|h| {
        if h.grpc_unavailable {
            return Status::InternalFailure;
        }
        let token = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
        h.grpc_calls.push(GrpcCall { token, cluster, service, method, message, timeout_ms: timeout });
        put(return_callout_id, token);
        Status::Ok
    }))
}

/// gRPC stream tokens, unique in the process (the SDK's dispatcher refuses a token twice).
static NEXT_TOKEN: AtomicU32 = AtomicU32::new(1);

#[no_mangle]
pub unsafe extern "C" fn proxy_grpc_stream(
    upstream_data: *const u8,
    upstream_size: usize,
    service_name_data: *const u8,
    service_name_size: usize,
    method_name_data: *const u8,
    method_name_size: usize,
    _initial_metadata_data: *const u8,
    _initial_metadata_size: usize,
    return_stream_id: *mut u32,
) -> Status {
    let cluster = text(upstream_data, upstream_size);
    let service = text(service_name_data, service_name_size);
    let method = text(method_name_data, method_name_size);
    status(try_with(|h| {
        if h.grpc_unavailable {
            return Status::InternalFailure;
        }
        let token = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
        h.grpc_streams.push(GrpcStream { token, cluster, service, method, sent: Vec::new(), closed: false });
        put(return_stream_id, token);
        Status::Ok
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_grpc_send(
    token: u32,
    message_ptr: *const u8,
    message_len: usize,
    end_stream: bool,
) -> Status {
    let message = bytes(message_ptr, message_len).to_vec();
    status(try_with(|h| match h.grpc_streams.iter_mut().find(|s| s.token == token) {
        Some(s) => {
            s.sent.push((message, end_stream));
            Status::Ok
        }
        None => Status::NotFound,
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_grpc_cancel(token_id: u32) -> Status {
    status(try_with(|h| match h.grpc_streams.iter_mut().find(|s| s.token == token_id) {
        Some(s) => {
            s.closed = true;
            Status::Ok
        }
        None => Status::NotFound,
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_grpc_close(token_id: u32) -> Status {
    proxy_grpc_cancel(token_id)
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_status(
    return_code: *mut u32,
    return_message_data: *mut *mut u8,
    return_message_size: *mut usize,
) -> Status {
    status(try_with(|h| {
        put(return_code, h.grpc_status.0);
        give(h.grpc_status.1.as_deref().unwrap_or_default().as_bytes(), return_message_data, return_message_size);
        Status::Ok
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_set_effective_context(context_id: u32) -> Status {
    status(try_with(|h| {
        if h.streams.contains_key(&context_id) || h.roots.contains(&context_id) {
            h.current = context_id;
            Status::Ok
        } else {
            Status::BadArgument
        }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_call_foreign_function(
    _function_name_data: *const u8,
    _function_name_size: usize,
    _arguments_data: *const u8,
    _arguments_size: usize,
    _results_data: *mut *mut u8,
    _results_size: *mut usize,
) -> Status {
    Status::NotFound
}

#[no_mangle]
pub unsafe extern "C" fn proxy_done() -> Status {
    Status::Ok
}

#[no_mangle]
pub unsafe extern "C" fn proxy_define_metric(
    metric_type: MetricType,
    name_data: *const u8,
    name_size: usize,
    return_id: *mut u32,
) -> Status {
    let name = text(name_data, name_size);
    status(try_with(|h| {
        let i = match h.metrics.iter().position(|m| m.name == name) {
            Some(i) => i,
            None => {
                h.metrics.push(Metric { name, kind: metric_type, value: 0, samples: Vec::new() });
                h.metrics.len() - 1
            }
        };
        put(return_id, i as u32 + 1);
        Status::Ok
    }))
}

/// Run `f` on metric `id` (NotFound if it was never defined).
fn on_metric(id: u32, f: impl FnOnce(&mut Metric) -> Status) -> Status {
    status(try_with(|h| {
        let i = (id as usize).checked_sub(1);
        i.and_then(|i| h.metrics.get_mut(i)).map_or(Status::NotFound, f)
    }))
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_metric(metric_id: u32, return_value: *mut u64) -> Status {
    on_metric(metric_id, |m| {
        put(return_value, m.value as u64);
        Status::Ok
    })
}

#[no_mangle]
pub unsafe extern "C" fn proxy_record_metric(metric_id: u32, value: u64) -> Status {
    on_metric(metric_id, |m| {
        match m.kind {
            MetricType::Histogram => {
                m.samples.push(value);
                m.value = value as i64;
            }
            MetricType::Counter => m.value += value as i64,
            _ => m.value = value as i64,
        }
        Status::Ok
    })
}

#[no_mangle]
pub unsafe extern "C" fn proxy_increment_metric(metric_id: u32, offset: i64) -> Status {
    on_metric(metric_id, |m| match m.kind {
        // Envoy's counters only go up, and a histogram is not incremented.
        MetricType::Counter if offset < 0 => Status::BadArgument,
        MetricType::Histogram => Status::BadArgument,
        _ => {
            m.value += offset;
            Status::Ok
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{with, Stream};
    use proxy_wasm::hostcalls;

    #[test]
    fn maps_round_trip_in_the_sdk_format() {
        let pairs = vec![(":method".to_owned(), b"POST".to_vec()), ("x".to_owned(), Vec::new())];
        assert_eq!(deserialize_map(&serialize_map(&pairs)), Some(pairs));
        assert_eq!(deserialize_map(&[1, 0, 0, 0]), None, "a count with no sizes");
    }

    #[test]
    fn the_sdk_reads_and_frees_what_the_mock_allocates() {
        with(|h| {
            h.streams.insert(7, Stream { request_body: b"hello".to_vec(), ..Stream::default() });
            h.current = 7;
        });
        assert_eq!(hostcalls::get_buffer(BufferType::HttpRequestBody, 1, 3), Ok(Some(b"ell".to_vec())));
        assert_eq!(hostcalls::get_buffer(BufferType::HttpRequestBody, 0, usize::MAX), Ok(Some(b"hello".to_vec())));
        assert_eq!(hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX), Ok(None), "empty");
        hostcalls::set_map_value(MapType::HttpRequestHeaders, "X-A", Some("1")).unwrap();
        hostcalls::add_map_value(MapType::HttpRequestHeaders, "x-b", "2").unwrap();
        assert_eq!(hostcalls::get_map_value(MapType::HttpRequestHeaders, "x-a"), Ok(Some("1".into())));
        let pairs = hostcalls::get_map(MapType::HttpRequestHeaders).unwrap();
        assert_eq!(pairs, vec![("x-a".to_owned(), "1".to_owned()), ("x-b".to_owned(), "2".to_owned())]);
        hostcalls::remove_map_value(MapType::HttpRequestHeaders, "x-a").unwrap();
        assert_eq!(hostcalls::get_map_value(MapType::HttpRequestHeaders, "x-a"), Ok(None));
        hostcalls::set_property(vec!["wasm", "p"], Some(b"v")).unwrap();
        assert_eq!(hostcalls::get_property(vec!["wasm", "p"]), Ok(Some(b"v".to_vec())));
        assert_eq!(hostcalls::get_property(vec!["absent"]), Ok(None));
        assert_eq!(hostcalls::set_effective_context(99), Err(Status::BadArgument), "no such context");
    }

    #[test]
    fn shared_data_compare_and_swap() {
        assert_eq!(hostcalls::get_shared_data("k"), Ok((None, None)));
        hostcalls::set_shared_data("k", Some(b"a"), None).unwrap();
        let (v, cas) = hostcalls::get_shared_data("k").unwrap();
        assert_eq!(v.as_deref(), Some(&b"a"[..]));
        hostcalls::set_shared_data("k", Some(b"b"), cas).unwrap();
        assert_eq!(hostcalls::set_shared_data("k", Some(b"c"), cas), Err(Status::CasMismatch), "stale token");
        hostcalls::set_shared_data("k", Some(b""), None).unwrap();
        let (v, cas) = hostcalls::get_shared_data("k").unwrap();
        assert!(v.is_none() && cas.is_some(), "an empty value comes back as no bytes, with a token");
    }

    #[test]
    fn metrics_by_kind() {
        let c = hostcalls::define_metric(MetricType::Counter, "c").unwrap();
        assert_eq!(hostcalls::define_metric(MetricType::Counter, "c"), Ok(c), "same name, same id");
        let g = hostcalls::define_metric(MetricType::Gauge, "g").unwrap();
        hostcalls::increment_metric(c, 2).unwrap();
        assert_eq!(hostcalls::increment_metric(c, -1), Err(Status::BadArgument));
        hostcalls::increment_metric(g, -3).unwrap();
        hostcalls::record_metric(g, 5).unwrap();
        assert_eq!((hostcalls::get_metric(c), with(|h| h.metric("g"))), (Ok(2), Some(5)));
        assert_eq!(hostcalls::increment_metric(99, 1), Err(Status::NotFound));
    }
}
