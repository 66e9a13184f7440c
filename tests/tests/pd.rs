//! Prefill/decode disaggregation through the real Envoy 1.40: the scheduler's P/D decider picks
//! a prefill endpoint for long uncached prompts and passes it as `x-prefiller-host-port`; the
//! simulated decode engine runs the prefill there (as llm-d's sidecar does) and pulls the KV.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

mod common;

use std::time::Duration;

use attache_e2e::stats::stat_line;
use attache_e2e::{EnvoyKind, SimOpts, Stack};
use common::*;

/// Engines 0 and 1 prefill, 2 and 3 decode.
fn pd_stack(name: &str) -> Stack {
    let mut s = Stack::new(name).expect("stack");
    s.endpoint_roles = ["prefill", "prefill", "decode", "decode"].map(String::from).to_vec();
    let opts = SimOpts { engines: 4, time_scale: 0.05, ..SimOpts::default() };
    s.start_sim(opts).expect("sim");
    s.start_host().expect("host");
    s.start_envoy(EnvoyKind::Attache, &Stack::default_scheduler_config(), 2).expect("envoy");
    s.wait_snapshot(4, Duration::from_secs(20)).expect("snapshot");
    s
}

async fn engine_metric(s: &Stack, i: usize, name: &str) -> f64 {
    let a = &s.engine_addrs()[i];
    let text = s.http.get(format!("http://{a}/metrics")).send().await.expect("metrics").text().await.expect("text");
    stat_line(&text, name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_split_into_prefill_and_decode_and_short_or_cached_ones_do_not() {
    let s = pd_stack("pd-split");
    let addrs = s.engine_addrs();
    let port = |i: usize| addrs[i].rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
    let (prefill_ports, decode_ports) = ([port(0), port(1)], [port(2), port(3)]);
    let http = fresh_client();

    // A long prompt nobody holds: decoded on a decode engine that received the prefiller.
    let long = long_prefix("pd");
    let o = send(&s, &http, chat(&long, "summarise", 8), &[]).await;
    assert!(o.ok() && o.done, "{} {}", o.status, o.body);
    assert!(decode_ports.contains(&o.engine_port), "decoded on a decode engine: {:?}", o.engine_port);
    let prefiller =
        o.header("x-attache-sim-prefiller").expect("the decode engine got x-prefiller-host-port").to_owned();
    let p_port = prefiller.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
    assert!(prefill_ports.contains(&p_port), "prefilled on a prefill engine: {prefiller}");
    let p_index = if p_port == prefill_ports[0] { 0 } else { 1 };
    let d_index = if o.engine_port == decode_ports[0] { 2 } else { 3 };
    assert_eq!(engine_metric(&s, p_index, "attache_sim_remote_decode_requests_total").await, 1.0);
    let pulled = engine_metric(&s, d_index, "attache_sim_kv_transfer_tokens_total").await;
    assert!(pulled >= 400.0, "the decode engine pulled the prompt's KV, not prefilled it: {pulled}");
    assert_eq!(engine_metric(&s, d_index, "attache_sim_remote_prefill_fallbacks_total").await, 0.0);
    assert_eq!(s.envoy_stat("wasmcustom.attache.pd.disaggregated"), 1);

    // The same prompt again: its decode engine holds it now, so it is not split. The repeat may
    // land on the other Envoy worker, which learns the first decision from the cross-worker
    // affinity table only after the deciding worker's next flush (`prefix.shared_flush_ms`);
    // wait past it, as a client's next turn would, so the check is about P/D and not that window.
    let flush_ms = attache_policies::config::PrefixConfig::default().shared_flush_ms;
    tokio::time::sleep(Duration::from_millis(5 * flush_ms)).await;
    let again = send(&s, &http, chat(&long, "summarise", 8), &[]).await;
    assert!(again.ok());
    assert_eq!(again.engine_port, o.engine_port, "prefix affinity keeps it on its decode engine");
    assert_eq!(again.header("x-attache-sim-prefiller"), None, "fully cached: not split");

    // A short prompt: prefilled where it decodes.
    let short = send(&s, &http, chat("s", "hi", 4), &[]).await;
    assert!(short.ok());
    assert!(decode_ports.contains(&short.engine_port));
    assert_eq!(short.header("x-attache-sim-prefiller"), None, "short: not split");
    assert_eq!(s.envoy_stat("wasmcustom.attache.pd.disaggregated"), 1);

    // A client cannot choose the prefiller: its header is stripped.
    let spoof = send(&s, &http, chat("s", "hello", 4), &[("x-prefiller-host-port", "10.9.9.9:1")]).await;
    assert!(spoof.ok(), "{}", spoof.body);
    assert_eq!(spoof.header("x-attache-sim-prefiller"), None);
}
