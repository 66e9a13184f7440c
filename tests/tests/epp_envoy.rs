//! The endpoint picker's Envoy bootstraps (`attache_envoy::EppShape`, `envoy/epp-*.yaml`):
//! every rendering passes Envoy 1.40's `--mode validate`, and the launcher starts them
//! (`Stack::start_epp_envoy`). With no picker listening, this also pins down what a gateway's
//! `failureMode` gives when the picker is dead, which the picker's own tests build on.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use attache_e2e::ports::free_port;
use attache_e2e::stack::validate_bootstrap;
use attache_e2e::{EppEnvoyOpts, Stack};
use attache_envoy::EppShape;

const SHAPES: [EppShape; 2] = [EppShape::OriginalDst, EppShape::OverrideHost];

#[test]
fn every_rendering_of_both_shapes_passes_envoy_validate() {
    let s = Stack::new("epp-validate").expect("stack");
    let epp = SocketAddr::from(([127, 0, 0, 1], 9002));
    for shape in SHAPES {
        for (tls, fail_open, hint) in [
            (false, false, None),
            (true, true, None),
            (false, true, Some(vec!["127.0.0.1:18091".to_owned(), "127.0.0.1:18092".to_owned()])),
            (true, false, Some(Vec::new())),
        ] {
            let opts = EppEnvoyOpts {
                tls,
                failure_mode_allow: fail_open,
                subset_hint: hint.clone(),
                pool: Some(vec!["127.0.0.1:18091".into(), "127.0.0.1:18092".into()]),
                ..EppEnvoyOpts::new(shape, epp)
            };
            let file = s.workdir.join(format!("{shape:?}-{tls}-{fail_open}-{}.yaml", hint.is_some()));
            std::fs::write(&file, s.render_epp_envoy(&opts, 18081, 19901).expect("render")).unwrap();
            validate_bootstrap(&s.paths.envoy, &file).unwrap_or_else(|e| panic!("{e:#}"));
        }
    }
    // The picker's readiness as Kubernetes applies it (the failure-mode tests' stand-in).
    let opts = EppEnvoyOpts {
        picker_readiness: true,
        pool: Some(vec!["127.0.0.1:18091".into()]),
        ..EppEnvoyOpts::new(EppShape::OverrideHost, epp)
    };
    let file = s.workdir.join("readiness.yaml");
    let rendered = s.render_epp_envoy(&opts, 18081, 19901).expect("render");
    assert!(rendered.contains("service_name: readiness") && rendered.contains("healthy_panic_threshold"));
    std::fs::write(&file, rendered).unwrap();
    validate_bootstrap(&s.paths.envoy, &file).unwrap_or_else(|e| panic!("{e:#}"));
}

/// An HTTP/1.1 server on loopback that answers every request `200 ok` and closes.
fn backend() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            // Headers, then as many body bytes as content-length says.
            while let Ok(n) = c.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&buf).to_ascii_lowercase();
                if let Some(end) = text.find("\r\n\r\n") {
                    let len = text
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if buf.len() >= end + 4 + len {
                        break;
                    }
                }
            }
            let _ = c.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok");
        }
    });
    addr
}

/// Send one request in a single write (headers and body arrive together, as most clients send
/// a small request) and return the response's status.
fn status(port: u16, method: &str, headers: &[(&str, &str)], body: &str) -> u16 {
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = format!("{method} /v1/completions HTTP/1.1\r\nhost: test\r\nconnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if method == "POST" {
        req.push_str(&format!("content-type: application/json\r\ncontent-length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    req.push_str(body);
    c.write_all(req.as_bytes()).unwrap();
    let mut resp = String::new();
    let _ = c.read_to_string(&mut resp);
    resp.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("no status in {resp:?}"))
}

const BODY: &str = r#"{"model":"tinyllama","prompt":"hi","max_tokens":1}"#;

#[test]
fn a_dead_picker_fails_open_only_for_requests_whose_body_has_not_reached_it() {
    let s = Stack::new("epp-dead-picker").expect("stack");
    let up = backend().to_string();
    // Nothing listens there: every ext_proc stream fails to connect.
    let dead_picker = SocketAddr::from(([127, 0, 0, 1], free_port()));

    // Istio's shape, FailOpen: a GET (no body) goes on to the pool's round-robin fallback. A
    // POST's first body chunk is sent with its headers, before the connection to the picker
    // fails, and from then on fail-open no longer applies (Envoy PR #41276): 500.
    let open = EppEnvoyOpts {
        failure_mode_allow: true,
        pool: Some(vec![up.clone()]),
        ..EppEnvoyOpts::new(EppShape::OverrideHost, dead_picker)
    };
    let e = s.start_epp_envoy("envoy-istio-open", &open).expect("envoy");
    assert_eq!(status(e.port, "GET", &[], ""), 200);
    assert_eq!(status(e.port, "POST", &[], BODY), 500);
    assert_eq!(e.stat_when("http.inference.ext_proc.streams_failed", 2, Duration::from_secs(5)), 2);
    assert_eq!(e.stat("http.inference.ext_proc.failure_mode_allowed"), 1, "the GET only");
    assert!(e.stat("cluster.epp.upstream_cx_connect_fail") >= 2);
    assert_eq!(e.stat("cluster.pool.upstream_rq_total"), 1);
    drop(e);

    // FailClose: the GET fails too.
    let closed = EppEnvoyOpts { failure_mode_allow: false, ..open.clone() };
    let e = s.start_epp_envoy("envoy-istio-closed", &closed).expect("envoy");
    assert_eq!(status(e.port, "GET", &[], ""), 500);
    assert_eq!(e.stat("cluster.pool.upstream_rq_total"), 0);
    drop(e);

    // GIE's shape, FailOpen: nothing names a destination, so ORIGINAL_DST has no host (503),
    // unless the client names one itself. That is why the picker must set the header on every
    // request it lets through, overwriting the client's.
    let gie = EppEnvoyOpts { failure_mode_allow: true, ..EppEnvoyOpts::new(EppShape::OriginalDst, dead_picker) };
    let e = s.start_epp_envoy("envoy-gie-open", &gie).expect("envoy");
    assert_eq!(status(e.port, "GET", &[], ""), 503);
    assert_eq!(status(e.port, "GET", &[("x-gateway-destination-endpoint", &up)], ""), 200);
    assert_eq!(e.stat("cluster.pool.upstream_rq_total"), 1);
    assert!(e.url("/v1/models").starts_with("http://127.0.0.1:") && e.admin_url("/stats").contains("/stats"));
}
