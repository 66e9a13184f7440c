//! The sticky table (policies::session) in shared data, so a session or a Responses API
//! conversation bound on one Envoy worker is found by every other: key `attache.sticky.<slot>`,
//! value `[key u64][expires_ms u64][endpoint]`, big-endian. Bounded by the slot count.

use attache_policies::session::{Sticky, StickyStore};

use crate::host;

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

/// The response id at the start of a Responses API body (`{"id":"resp_…"` non-streamed, or the
/// `response.created` event streamed), if the first bytes carry one.
pub fn response_id(first_bytes: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(first_bytes.get(..first_bytes.len().min(4096))?).ok()?;
    let at = text.find("\"resp_")? + 1;
    let id: String =
        text.get(at..)?.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-').take(128).collect();
    (id.len() > 5).then_some(id)
}

#[cfg(test)]
mod tests {
    #[test]
    fn finds_response_ids_in_plain_and_streamed_bodies() {
        let plain = br#"{"id":"resp_abc123","object":"response","output":[]}"#;
        assert_eq!(super::response_id(plain).as_deref(), Some("resp_abc123"));
        let sse = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_9f-x\",\"object\":\"response\"}}\n\n";
        assert_eq!(super::response_id(sse).as_deref(), Some("resp_9f-x"));
        assert_eq!(super::response_id(b"{\"id\":\"chatcmpl-1\"}"), None);
        assert_eq!(super::response_id(&[0xff, 0xfe]), None);
    }
}
