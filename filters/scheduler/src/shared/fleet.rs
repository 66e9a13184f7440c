//! Fleet state in shared data: this Envoy's identity in the fleet, and the other Envoys'
//! tenant usage as the host last sent it.
//!
//! Shared-data layout (namespaced by `vm_id`):
//! - `attache.fleet.envoy`: this Envoy's fleet id (UTF-8), made once by the first root context
//!   that needs it (compare-and-swap), so every reporter of one Envoy names the same one.
//! - `attache.fleet.usage`: when the figures were computed (ms since the epoch, 8 bytes LE),
//!   then per tenant: usage (f64, 8 bytes LE), name length (1 byte), name.

use std::collections::BTreeMap;

use crate::hostcalls as host;

const ENVOY_KEY: &str = "attache.fleet.envoy";
pub const USAGE_KEY: &str = "attache.fleet.usage";

/// This Envoy's fleet id: Envoy's node id (if set) and the time the id was made, in µs.
pub fn envoy_id() -> String {
    for _ in 0..8 {
        let (value, cas) = host::shared_data_cas(ENVOY_KEY);
        if let Some(id) = value.and_then(|v| String::from_utf8(v).ok()).filter(|v| !v.is_empty()) {
            return id;
        }
        let node = host::property_path(&["node", "id"])
            .and_then(|b| String::from_utf8(b).ok())
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "envoy".into());
        let id = format!("{node}-{:x}", host::now_us());
        if host::set_shared_data_cas(ENVOY_KEY, id.as_bytes(), cas) {
            return id;
        }
    }
    format!("envoy-{:x}", host::now_us())
}

/// Encode remote usage; tenant names longer than 255 bytes are left out.
pub fn encode_usage(at_ms: u64, usage: &BTreeMap<String, f64>) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + usage.len() * 24);
    out.extend_from_slice(&at_ms.to_le_bytes());
    for (tenant, u) in usage {
        let Ok(len) = u8::try_from(tenant.len()) else { continue };
        out.extend_from_slice(&u.to_le_bytes());
        out.push(len);
        out.extend_from_slice(tenant.as_bytes());
    }
    out
}

/// Decode remote usage; a truncated entry ends it (what came before stands).
pub fn decode_usage(bytes: &[u8]) -> Option<(u64, BTreeMap<String, f64>)> {
    let at = host::read_u64(bytes)?;
    let mut rest = bytes.get(8..)?;
    let mut usage = BTreeMap::new();
    while !rest.is_empty() {
        let Some(u) = host::read_u64(rest).map(f64::from_bits) else { break };
        let Some(&len) = rest.get(8) else { break };
        let end = 9 + usize::from(len);
        let Some(t) = rest.get(9..end).and_then(|b| std::str::from_utf8(b).ok()) else { break };
        if u.is_finite() && u >= 0.0 {
            usage.insert(t.to_owned(), u);
        }
        rest = rest.get(end..).unwrap_or_default();
    }
    Some((at, usage))
}

/// Write the other Envoys' usage for every worker.
pub fn publish_usage(at_ms: u64, usage: &BTreeMap<String, f64>) -> bool {
    host::set_shared_data(USAGE_KEY, &encode_usage(at_ms, usage))
}

/// The other Envoys' usage, decayed from when the host computed it to `now_ms`.
pub fn remote_usage(now_ms: u64, half_life_ms: u64) -> BTreeMap<String, f64> {
    let Some((at, mut usage)) = host::shared_data(USAGE_KEY).as_deref().and_then(decode_usage) else {
        return BTreeMap::new();
    };
    if half_life_ms > 0 && now_ms > at {
        let f = 0.5f64.powf((now_ms - at) as f64 / half_life_ms as f64);
        usage.values_mut().for_each(|v| *v *= f);
    }
    usage
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_round_trips_and_a_garbled_entry_ends_it_without_a_panic() {
        let usage: BTreeMap<String, f64> = [("a".to_owned(), 1.5), ("b".into(), 20.0), ("x".repeat(300), 1.0)].into();
        let bytes = encode_usage(77, &usage);
        let (at, got) = decode_usage(&bytes).expect("decodes");
        assert_eq!(at, 77);
        assert_eq!(got, [("a".to_owned(), 1.5), ("b".into(), 20.0)].into());
        for cut in 0..bytes.len() {
            let _ = decode_usage(&bytes[..cut]);
        }
        assert!(decode_usage(&bytes[..7]).is_none());
    }
}
