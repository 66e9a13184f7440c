//! Flow control through the real Envoy 1.40: request classes from InferenceObjective names and
//! body priorities, unknown objectives, and shedding of sheddable requests while the host's
//! saturation detector says the pool is saturated.

mod common;

use std::time::Duration;

use attache_e2e::{EnvoyKind, Stack};
use common::*;
use serde_json::{json, Value};

/// A stack whose host pushes `saturation_cfg` and objectives {interactive: 10, batch: -1}, and
/// whose filter runs flow control.
fn flow_stack(name: &str, saturation_cfg: Value) -> Stack {
    let mut s = Stack::new(name).expect("stack");
    s.host_flow = Some(json!({"saturation": saturation_cfg, "objectives": {"interactive": 10, "batch": -1}}));
    let opts = small_pool();
    let engines = usize::from(opts.engines);
    s.start_sim(opts).expect("sim");
    s.start_host().expect("host");
    let mut cfg = Stack::default_scheduler_config();
    cfg["flow"] = json!({"enabled": true});
    s.start_envoy(EnvoyKind::Attache, &cfg, 2).expect("envoy");
    s.wait_snapshot(engines, Duration::from_secs(20)).expect("snapshot");
    s
}

async fn snapshot(s: &Stack) -> Value {
    let url = format!("http://127.0.0.1:{}/v1/snapshot", s.host_admin_port);
    reqwest::get(url).await.expect("admin").json().await.expect("json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_objectives_get_a_clear_400_and_known_ones_pass() {
    let s = flow_stack("flow-objectives", json!({}));
    let http = fresh_client();
    for (objective, want) in [("interactive", 200), ("batch", 200), ("no-such-objective", 400)] {
        let o = send(&s, &http, chat("system", "hi", 2), &[("x-llm-d-inference-objective", objective)]).await;
        assert_eq!(o.status, want, "{objective}: {}", o.body);
        if want == 400 {
            assert_eq!(o.header("x-attache-dropped-reason"), Some("unknown_objective"));
            let msg = o.json()["error"]["message"].as_str().unwrap_or("").to_owned();
            assert!(msg.contains("no-such-objective"), "{msg}");
        }
    }
    // The proxy keeps serving.
    assert!(send(&s, &http, chat("system", "hi", 2), &[]).await.ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sheddable_requests_get_429_while_the_pool_is_saturated() {
    // stale_ms 0: every endpoint's metrics count as stale, so the detector reports the pool
    // fully saturated (1.0) for as long as the test runs.
    let s = flow_stack("flow-shed", json!({"stale_ms": 0}));
    let snap = snapshot(&s).await;
    assert!(snap["saturation"].as_f64().unwrap_or(0.0) >= 1.0, "{snap}");
    assert_eq!(snap["objectives"]["batch"], json!(-1));
    let http = fresh_client();
    let mut shed = 0;
    let mut served = 0;
    for i in 0..12 {
        let (headers, body): (Vec<(&str, &str)>, Vec<u8>) = match i % 3 {
            0 => (vec![("x-llm-d-inference-objective", "batch")], chat("s", "hi", 2)),
            1 => (vec![], serde_json::to_vec(&json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -3})).unwrap()),
            _ => (vec![("x-llm-d-inference-objective", "interactive")], chat("s", "hi", 2)),
        };
        let o = send(&s, &http, body, &headers).await;
        if i % 3 == 2 {
            assert!(o.ok(), "non-sheddable requests pass (queueing is not built yet): {} {}", o.status, o.body);
            served += 1;
        } else {
            assert_eq!(o.status, 429, "sheddable request {i}: {}", o.body);
            assert_eq!(o.header("x-attache-dropped-reason"), Some("sheddable"));
            assert_eq!(o.header("retry-after"), Some("1"));
            assert!(o.json()["error"]["message"].as_str().unwrap_or("").contains("saturated"));
            shed += 1;
        }
    }
    // Every request is accounted for: served or answered 429.
    assert_eq!((served, shed), (4, 8));
    let shed_stat = s.envoy_stat("wasmcustom.attache.errors.sheddable");
    assert_eq!(shed_stat, 8, "shed count in Envoy's stats");
}
