//! Closed-loop load from several tenants, for the flow-control tests and benchmarks.

use std::time::{Duration, Instant};

use crate::client;

/// What one tenant sent and got.
#[derive(Debug, Clone, Default)]
pub struct TenantStats {
    pub tenant: String,
    /// Concurrent closed-loop clients.
    pub clients: usize,
    pub sent: usize,
    pub served: usize,
    /// Answered 429 or 503 by flow control.
    pub shed: usize,
    /// Output tokens of requests that completed inside the measurement window.
    pub window_tokens: u64,
    pub window_requests: usize,
}

/// Every request's fate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadTally {
    pub served: usize,
    pub shed: usize,
    /// Transport errors or statuses other than 200/429/503.
    pub lost: usize,
}

/// Tenant `tenant-i` runs `clients[i]` closed-loop clients (`x-attache-tenant`), each sending
/// the same short chat request with `max_tokens` until `warmup + window` has passed; output
/// tokens of requests completing inside the window are counted.
pub async fn tenants_closed_loop(
    url: &str,
    clients: &[usize],
    warmup: Duration,
    window: Duration,
    max_tokens: u64,
) -> (Vec<TenantStats>, LoadTally) {
    let urls: Vec<Vec<String>> = clients.iter().map(|&n| vec![url.to_owned(); n]).collect();
    tenants_closed_loop_on(&urls, warmup, window, max_tokens).await
}

/// [`tenants_closed_loop`] with each client's own URL: tenant `tenant-i` runs one client per
/// URL in `urls[i]` (clients of one tenant spread over several gateway replicas).
pub async fn tenants_closed_loop_on(
    urls: &[Vec<String>],
    warmup: Duration,
    window: Duration,
    max_tokens: u64,
) -> (Vec<TenantStats>, LoadTally) {
    let start = Instant::now();
    let (from, until) = (start + warmup, start + warmup + window);
    let mut tasks = Vec::new();
    for (ti, tenant_urls) in urls.iter().enumerate() {
        for (ci, url) in tenant_urls.iter().enumerate() {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                let tenant = format!("tenant-{ti}");
                let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap_or_default();
                let mut st = TenantStats { tenant: tenant.clone(), ..Default::default() };
                let mut tally = LoadTally::default();
                let mut k = 0u64;
                while Instant::now() < until {
                    k += 1;
                    let body = client::chat_body(
                        "tinyllama",
                        "You are a helpful assistant.",
                        &format!("{tenant} client {ci} question {k}"),
                        max_tokens,
                    );
                    st.sent += 1;
                    let o = client::post(&http, &url, body, &[("x-attache-tenant", tenant.as_str())]).await;
                    let now = Instant::now();
                    match (o.status, o.error.is_none()) {
                        (200, true) => {
                            st.served += 1;
                            tally.served += 1;
                            if now >= from && now <= until {
                                st.window_tokens += o.output_tokens;
                                st.window_requests += 1;
                            }
                        }
                        (429 | 503, true) => {
                            st.shed += 1;
                            tally.shed += 1;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        _ => tally.lost += 1,
                    }
                }
                (ti, st, tally)
            }));
        }
    }
    let mut stats: Vec<TenantStats> = urls
        .iter()
        .enumerate()
        .map(|(i, u)| TenantStats { tenant: format!("tenant-{i}"), clients: u.len(), ..Default::default() })
        .collect();
    let mut total = LoadTally::default();
    for t in tasks {
        let Ok((ti, st, tally)) = t.await else {
            total.lost += 1;
            continue;
        };
        let s = &mut stats[ti];
        s.sent += st.sent;
        s.served += st.served;
        s.shed += st.shed;
        s.window_tokens += st.window_tokens;
        s.window_requests += st.window_requests;
        total.served += tally.served;
        total.shed += tally.shed;
        total.lost += tally.lost;
    }
    (stats, total)
}

/// Jain's fairness index over the tenants' window tokens (policies::flow::jain_index).
pub fn jain(stats: &[TenantStats]) -> f64 {
    let x: Vec<f64> = stats.iter().map(|t| t.window_tokens as f64).collect();
    attache_policies::flow::jain_index(&x)
}
