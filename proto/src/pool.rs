//! The wire snapshot as the policies' pool state: the filter and the endpoint picker plan on
//! the same conversion of the same snapshot.

use attache_policies::endpoint::LoraState;
use attache_policies::{Endpoint, EndpointMetrics, PoolState, Role};

use crate::v1;

/// Convert the wire snapshot into the policies' pool state.
pub fn to_pool(s: &v1::Snapshot) -> PoolState {
    PoolState {
        version: s.version,
        endpoints: s.endpoints.iter().map(to_endpoint).collect(),
        saturation: s.saturation,
        dispatch_cost: s.dispatch_cost,
        observed_ms: s.observed_unix_ms,
        objectives: s.objectives.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        ..PoolState::default()
    }
}

/// Convert one wire endpoint.
pub fn to_endpoint(e: &v1::Endpoint) -> Endpoint {
    Endpoint {
        id: e.id,
        block_size: e.block_size,
        kv_blocks: e.num_gpu_blocks,
        kv_written: e.kv_written_tokens,
        kv_hits: e.prefix_cache_hit_tokens,
        address: e.address.clone(),
        models: e.models.clone(),
        role: Role::from_label(&e.role),
        ready: e.ready,
        metrics: e.has_metrics.then_some(EndpointMetrics {
            waiting: e.waiting,
            running: e.running,
            kv_usage: e.kv_usage,
            age_ms: e.metrics_age_ms,
            ttft_ms: e.ttft_ms,
            prefill_tokens_per_s: e.prefill_tokens_per_s,
        }),
        labels: {
            let mut l: Vec<(String, String)> = e.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            l.sort();
            l
        },
        lora: (e.max_lora > 0).then(|| LoraState {
            running: e.lora_running.clone(),
            waiting: e.lora_waiting.clone(),
            max_lora: e.max_lora,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attache_policies::Role;

    #[test]
    fn wire_snapshot_to_pool() {
        let s = v1::Snapshot {
            version: 7,
            host_epoch: 1,
            generated_unix_ms: 0,
            endpoints: vec![
                v1::Endpoint {
                    address: "1.2.3.4:80".into(),
                    models: vec!["m".into()],
                    role: "decode".into(),
                    ready: true,
                    has_metrics: true,
                    waiting: 3.0,
                    kv_usage: 0.5,
                    metrics_age_ms: 20,
                    ..Default::default()
                },
                v1::Endpoint { address: "1.2.3.5:80".into(), ..Default::default() },
            ],
            saturation: Some(1.5),
            objectives: [("chat".to_owned(), 10)].into(),
            dispatch_cost: 0.1,
            observed_unix_ms: 42,
        };
        let p = to_pool(&s);
        assert_eq!((p.dispatch_cost, p.observed_ms), (0.1, 42));
        assert_eq!(p.version, 7);
        assert_eq!(p.endpoints[0].role, Role::Decode);
        assert_eq!(p.endpoints[0].metrics.unwrap().waiting, 3.0);
        assert!(p.endpoints[1].metrics.is_none());
        assert!(!p.endpoints[1].ready);
        assert_eq!((p.saturation, p.objectives.get("chat")), (Some(1.5), Some(&10)));
    }
}
