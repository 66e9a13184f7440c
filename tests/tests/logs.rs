//! Log hygiene: at the default levels (Envoy `info`, host `info`), neither Envoy with the
//! Attaché filter nor the host writes prompts, client credentials or the admin token to its
//! log, on good requests and on refused ones. Real Envoy 1.40, host and simulator.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::process::Command;
use std::time::Duration;

use attache_e2e::client;
use attache_e2e::Stack;
use common::*;
use serde_json::json;

const ADMIN_TOKEN: &str = "log-test-admin-token-7f3a9c21";
const PROMPT: &str = "PROMPT-MARKER-ultraviolet-heron-6612";
const CLIENT_KEY: &str = "sk-client-secret-9d2e77ab";
const WRONG_TOKEN: &str = "wrong-admin-token-c4b1e0f9";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_and_secrets_stay_out_of_the_logs() {
    let mut s = Stack::new("logs").expect("stack");
    s.envoy_log_level = "info".into();
    let keys = s.workdir.join("keys");
    let out = Command::new(&s.paths.host_bin).args(["policy", "keygen", "--out"]).arg(&keys).output().expect("keygen");
    assert!(out.status.success(), "keygen: {}", String::from_utf8_lossy(&out.stderr));
    let token_file = s.workdir.join("admin.token");
    std::fs::write(&token_file, ADMIN_TOKEN).expect("token");
    s.host_policy = Some(json!({
        "store_dir": s.workdir.join("policies"),
        "trust": keys.join("attache.pub"),
        "admin_token_file": token_file,
        "auto": {"enabled": false},
    }));
    start_attache(&mut s, small_pool());

    let http = fresh_client();
    let auth = format!("Bearer {CLIENT_KEY}");
    let headers = [("authorization", auth.as_str()), ("x-api-key", CLIENT_KEY), ("x-session-id", PROMPT)];
    let mut served = 0;
    let mut refused = 0;
    // Good requests on all three APIs.
    let bodies = [
        ("/v1/chat/completions", chat("You are terse.", &format!("Tell me about {PROMPT}."), 4)),
        (
            "/v1/completions",
            json!({"model": "tinyllama", "prompt": format!("Explain {PROMPT}"), "max_tokens": 4}).to_string().into_bytes(),
        ),
        (
            "/v1/responses",
            json!({"model": "tinyllama", "input": format!("Summarise {PROMPT}"), "instructions": PROMPT, "max_output_tokens": 4})
                .to_string()
                .into_bytes(),
        ),
    ];
    for (path, body) in &bodies {
        let o = client::post(&http, &s.url(path), body.clone(), &headers).await;
        assert_eq!(o.status, 200, "{path}: {}", o.body);
        served += 1;
    }
    // Refused requests carrying the prompt: malformed JSON, unknown model, missing field.
    let bad: [(&str, Vec<u8>, u16); 3] = [
        ("/v1/chat/completions", format!("{{\"model\": \"tinyllama\", \"messages\": [{PROMPT}").into_bytes(), 400),
        ("/v1/chat/completions", chat(PROMPT, PROMPT, 4).replace_model(PROMPT), 404),
        ("/v1/completions", json!({"model": "tinyllama", "suffix": PROMPT}).to_string().into_bytes(), 400),
    ];
    for (path, body, want) in bad {
        let o = client::post(&http, &s.url(path), body, &headers).await;
        assert_eq!(o.status, want, "{path}: {}", o.body);
        refused += 1;
    }
    // The admin API: the right token, a wrong one, and none.
    let admin = format!("http://127.0.0.1:{}/v1/policy/status", s.host_admin_port);
    for (token, want) in [(Some(ADMIN_TOKEN), 200), (Some(WRONG_TOKEN), 401), (None, 401)] {
        let mut req = http.get(&admin);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let r = req.send().await.expect("admin");
        assert_eq!(r.status().as_u16(), want, "admin with {token:?}");
    }
    assert_eq!((served, refused), (3, 3));

    // Let Envoy and the host flush what they log.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let envoy_log = std::fs::read_to_string(s.workdir.join("envoy.log")).expect("envoy log");
    let host_log = std::fs::read_to_string(s.workdir.join("host.log")).expect("host log");
    // The logs are real and at the levels under test: not empty, with info lines.
    assert!(envoy_log.contains("[info]"), "Envoy should log at info: {} bytes", envoy_log.len());
    assert!(host_log.contains("INFO"), "the host should log at info: {} bytes", host_log.len());
    for (name, log) in [("envoy.log", &envoy_log), ("host.log", &host_log)] {
        for secret in [PROMPT, CLIENT_KEY, ADMIN_TOKEN, WRONG_TOKEN] {
            let line = log.lines().find(|l| l.contains(secret));
            assert!(line.is_none(), "{name} contains {secret:?}: {line:?}");
        }
    }
}

/// Set a JSON body's `model`.
trait ReplaceModel {
    fn replace_model(self, model: &str) -> Vec<u8>;
}

impl ReplaceModel for Vec<u8> {
    fn replace_model(self, model: &str) -> Vec<u8> {
        let mut v: serde_json::Value = serde_json::from_slice(&self).expect("json body");
        v["model"] = json!(model);
        v.to_string().into_bytes()
    }
}

const DEBUG_TOKEN: &str = "explain-test-debug-token-5c0ffee";

/// The SHA-256 of `s`, as hex (what `debug.token_sha256` holds).
fn sha256_hex(s: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(s.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authorized_debug_header_explains_the_decision_and_no_other_does() {
    let mut s = Stack::new("explain").expect("stack");
    let mut config = Stack::default_scheduler_config();
    config["debug"] = json!({"token_sha256": sha256_hex(DEBUG_TOKEN)});
    s.start_sim(small_pool()).expect("sim");
    s.start_host().expect("host");
    s.start_envoy(attache_e2e::EnvoyKind::Attache, &config, 2).expect("envoy");
    s.wait_snapshot(4, Duration::from_secs(20)).expect("snapshot");
    let http = fresh_client();
    let engines = s.engine_addrs();

    // With the token: the response names, per candidate, its verdict and its scores, and the
    // engine that served the request is the one picked first.
    let o = send(&s, &http, chat("You are terse.", "explain me", 4), &[("x-attache-debug", DEBUG_TOKEN)]).await;
    assert!(o.ok(), "{} {}", o.status, o.body);
    let x: serde_json::Value =
        serde_json::from_str(o.header("x-attache-explain").expect("an explanation")).expect("JSON");
    println!("explanation: {x}");
    let picked = x["picked"][0].as_str().unwrap();
    assert_eq!(picked.rsplit(':').next().and_then(|p| p.parse().ok()), o.engine_port, "{x}");
    let rows = x["candidates"].as_array().unwrap();
    assert_eq!((x["pool"].as_u64(), rows.len()), (Some(4), 4), "{x}");
    for row in rows {
        assert!(engines.iter().any(|e| row["endpoint"] == e.as_str()), "{row}");
        assert_eq!(row["verdict"], "scored", "{row}");
        let scores = row["scores"].as_object().unwrap();
        assert!(scores.contains_key("queue-scorer") && scores.contains_key("kv-cache-utilization-scorer"), "{row}");
    }
    assert_eq!(rows[0]["endpoint"], picked);
    assert_eq!(rows[0]["pick"], 0);

    // A wrong token, or none: no explanation, and the wrong one is counted.
    for headers in [&[("x-attache-debug", "not-the-token")][..], &[]] {
        let o = send(&s, &http, chat("You are terse.", "explain me", 4), headers).await;
        assert!(o.ok(), "{} {}", o.status, o.body);
        assert_eq!(o.header("x-attache-explain"), None, "{headers:?}");
    }
    let stats = s.envoy_stats_when("wasmcustom.attache.debug.refused", 1, Duration::from_secs(5));
    assert!(stats.contains("wasmcustom.attache.debug.refused: 1"), "{stats}");
}
