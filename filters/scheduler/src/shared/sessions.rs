//! The sticky table (policies::session) in shared data, so a session or a Responses API
//! conversation bound on one Envoy worker is found by every other: key `attache.sticky.<slot>`,
//! value `[key u64][expires_ms u64][endpoint]`, big-endian. Bounded by the slot count.

use attache_policies::session::{Sticky, StickyStore};

use crate::hostcalls as host;

pub struct SharedSticky;

impl StickyStore for SharedSticky {
    fn load(&mut self, slot: u64) -> Option<Sticky> {
        let v = host::shared_data(&format!("attache.sticky.{slot}"))?;
        let (k, rest) = v.split_first_chunk::<8>()?;
        let (e, ep) = rest.split_first_chunk::<8>()?;
        Some(Sticky {
            key: u64::from_be_bytes(*k),
            expires_ms: u64::from_be_bytes(*e),
            endpoint: String::from_utf8(ep.to_vec()).ok()?,
        })
    }

    fn store(&mut self, slot: u64, entry: &Sticky) {
        let mut v = Vec::with_capacity(16 + entry.endpoint.len());
        v.extend_from_slice(&entry.key.to_be_bytes());
        v.extend_from_slice(&entry.expires_ms.to_be_bytes());
        v.extend_from_slice(entry.endpoint.as_bytes());
        host::set_shared_data(&format!("attache.sticky.{slot}"), &v);
    }
}
