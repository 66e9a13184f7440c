//! Agent-aware routing through the real Envoy 1.40 (two workers): session stickiness by
//! `x-session-id` and llm-d's `x-session-token`, re-routing when the sticky engine dies or
//! saturates, and Responses API `previous_response_id` continuity across workers (the simulated
//! engines, like vLLM, only know the responses they produced: a wrong pick is a 404).

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::time::{Duration, Instant};

use attache_e2e::{EnvoyKind, SimOpts, Stack};
use common::*;
use serde_json::json;

fn port_of(addr: &str) -> Option<u16> {
    addr.rsplit(':').next().and_then(|p| p.parse().ok())
}

/// Three engines in the simulator process and one in its own process (so it can be killed).
/// Engines that keep Responses state (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE=1`), and the
/// filter in engine mode: a continuation goes where its response was produced.
fn session_stack(name: &str, max_num_seqs: usize) -> (Stack, String) {
    let mut s = Stack::new(name).expect("stack");
    let opts = SimOpts { engines: 3, time_scale: 0.05, max_num_seqs, responses_store: true, ..SimOpts::default() };
    s.start_sim(opts).expect("sim");
    let extra = s.start_extra_engine().expect("extra engine");
    s.start_host().expect("host");
    let mut cfg = Stack::default_scheduler_config();
    cfg["responses"] = json!({"mode": "engine"});
    s.start_envoy(EnvoyKind::Attache, &cfg, 2).expect("envoy");
    s.wait_snapshot(4, Duration::from_secs(20)).expect("snapshot");
    (s, extra)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_stick_to_their_engine_and_move_when_it_dies() {
    let (mut s, extra) = session_stack("sessions-sticky", 64);
    let http = fresh_client();
    // Unrelated prompts with one session id land on one engine, over both workers.
    let first = send(&s, &http, chat("s", "turn 0 of a long task", 4), &[("x-session-id", "agent-7")]).await;
    assert!(first.ok(), "{}", first.body);
    let home = first.engine_port;
    let token = first.header("x-session-token").expect("a session token on the response").to_owned();
    for t in 1..10 {
        let o = send(
            &s,
            &http,
            chat(&format!("tool output {t}"), &format!("turn {t} {}", "x".repeat(t * 7)), 4),
            &[("x-session-id", "agent-7")],
        )
        .await;
        assert!(o.ok());
        assert_eq!(o.engine_port, home, "turn {t} stays on the session's engine");
    }
    // The token alone (llm-d's stateless form) names the same engine.
    let o = send(&s, &http, chat("other", "via token", 4), &[("x-session-token", &token)]).await;
    assert_eq!(o.engine_port, home);
    assert!(s.envoy_stat("wasmcustom.attache.session.sticky_hits") >= 10);

    // Bind a second session to the separately run engine through a token naming it, then kill
    // that engine: the session moves, and stays on its new engine.
    let to_extra = attache_policies::session::token_for(&extra);
    let o = send(&s, &http, chat("s", "pin", 4), &[("x-session-id", "agent-9"), ("x-session-token", &to_extra)]).await;
    assert_eq!(o.engine_port, port_of(&extra), "{}", o.body);
    let o = send(&s, &http, chat("s", "still pinned", 4), &[("x-session-id", "agent-9")]).await;
    assert_eq!(o.engine_port, port_of(&extra));
    s.kill_extra_engine(&extra);
    s.wait_snapshot(3, Duration::from_secs(10)).expect("the dead engine leaves the pool");
    let moved = send(&s, &http, chat("s", "after the crash", 4), &[("x-session-id", "agent-9")]).await;
    assert!(moved.ok(), "{} {}", moved.status, moved.body);
    assert_ne!(moved.engine_port, port_of(&extra));
    assert!(s.envoy_stat("wasmcustom.attache.session.rebound") >= 1, "the move is counted");
    for t in 0..5 {
        let o = send(&s, &http, chat("s", &format!("after {t}"), 4), &[("x-session-id", "agent-9")]).await;
        assert!(o.ok());
        assert_eq!(o.engine_port, moved.engine_port, "re-bound to its new engine");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_sticky_engine_is_left_for_another() {
    // Two sequences per engine: a few long requests sent straight to the session's engine fill
    // its queue past the saturation threshold (5 waiting).
    let (s, extra) = session_stack("sessions-saturated", 2);
    let http = fresh_client();
    let to_extra = attache_policies::session::token_for(&extra);
    let o = send(&s, &http, chat("s", "pin", 4), &[("x-session-id", "busy"), ("x-session-token", &to_extra)]).await;
    assert_eq!(o.engine_port, port_of(&extra));
    let mut load = Vec::new();
    for i in 0..10 {
        let url = format!("http://{extra}/v1/chat/completions");
        load.push(tokio::spawn(async move {
            attache_e2e::client::post(&fresh_client(), &url, chat("s", &format!("long {i}"), 2000), &[]).await
        }));
    }
    let url = format!("http://127.0.0.1:{}/v1/snapshot", s.host_admin_port);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let snap: serde_json::Value = reqwest::get(&url).await.unwrap().json().await.unwrap();
        let waiting = snap["endpoints"].as_array().and_then(|a| {
            a.iter().find(|e| e["address"] == json!(extra)).map(|e| e["waiting"].as_f64().unwrap_or(0.0))
        });
        if waiting.unwrap_or(0.0) >= 5.0 {
            break;
        }
        assert!(Instant::now() < deadline, "the engine never saturated: {snap}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let o = send(&s, &http, chat("s", "while busy", 4), &[("x-session-id", "busy")]).await;
    assert!(o.ok());
    assert_ne!(o.engine_port, port_of(&extra), "a saturated sticky engine is not used");
    for l in load {
        l.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_response_id_continues_on_the_engine_that_holds_it_across_workers() {
    let (s, _) = session_stack("sessions-responses", 64);
    let http = fresh_client();
    let url = s.url("/v1/responses");
    let body = |input: &str, prev: Option<&str>| {
        let mut b =
            json!({"model": MODEL, "input": input, "instructions": "You are a coding agent.", "max_output_tokens": 8});
        if let Some(p) = prev {
            b["previous_response_id"] = json!(p);
        }
        b.to_string().into_bytes()
    };
    let o = attache_e2e::client::post(&http, &url, body("start the task", None), &[]).await;
    assert!(o.ok(), "{}", o.body);
    let home = o.engine_port;
    let mut prev = o.json()["id"].as_str().expect("response id").to_owned();
    // Ten more turns, each on a fresh connection (both workers), each continuing the last.
    for t in 1..=10 {
        let o = attache_e2e::client::post(&http, &url, body(&format!("tool result {t}"), Some(&prev)), &[]).await;
        assert_eq!(o.status, 200, "turn {t}: {}", o.body);
        assert_eq!(o.engine_port, home, "turn {t} continues where the conversation lives");
        prev = o.json()["id"].as_str().expect("id").to_owned();
    }
    assert!(s.envoy_stat("wasmcustom.attache.session.responses_learned") >= 11);
    // An id nobody produced is routed normally and the engine answers its 404.
    let o = attache_e2e::client::post(&http, &url, body("x", Some("resp_unknown")), &[]).await;
    assert_eq!(o.status, 404, "{}", o.body);
}
