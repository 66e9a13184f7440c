//! The gateway's subset hint (GIE endpoint-picker protocol, `envoy.lb.subset_hint` /
//! `x-gateway-destination-endpoint-subset`): the proxy names the endpoints it may route to,
//! and the picker chooses among those alone. Not a profile plugin: it applies to every profile
//! whenever the host passes a hint, after the profile's own filters.

use crate::endpoint::Endpoint;
use crate::error::ScheduleError;

/// The endpoints a gateway allows: each entry `ip:port`, or an IP alone (any port), as GIE's
/// test picker matches them. An entry may itself be a comma-separated list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Subset {
    entries: Vec<String>,
}

impl Subset {
    pub fn new<S: AsRef<str>>(entries: impl IntoIterator<Item = S>) -> Self {
        let entries = entries
            .into_iter()
            .flat_map(|e| e.as_ref().split(',').map(|s| s.trim().to_owned()).collect::<Vec<_>>())
            .filter(|s| !s.is_empty())
            .collect();
        Self { entries }
    }

    /// Whether `address` (`ip:port`) is allowed.
    pub fn allows(&self, address: &str) -> bool {
        let ip = address.rsplit_once(':').map_or(address, |(ip, _)| ip);
        self.entries.iter().any(|e| e == address || e == ip)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keep the candidates (positions in `endpoints`) the hint allows; none left is an error
    /// (503: the gateway asked for endpoints the pool cannot serve the request on).
    pub fn restrict(&self, endpoints: &[Endpoint], candidates: &mut Vec<usize>) -> Result<(), ScheduleError> {
        candidates.retain(|&i| endpoints.get(i).is_some_and(|e| self.allows(&e.address)));
        if candidates.is_empty() {
            return Err(ScheduleError::NoneInSubset);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_ip_port_or_ip_alone_and_comma_lists() {
        let s = Subset::new(["10.0.0.1:8000", "10.0.0.2", "10.0.0.3:8000, 10.0.0.4:9000"]);
        assert!(s.allows("10.0.0.1:8000"));
        assert!(!s.allows("10.0.0.1:8001"), "a port given must match");
        assert!(s.allows("10.0.0.2:8000") && s.allows("10.0.0.2:9"), "an IP alone allows every port");
        assert!(s.allows("10.0.0.3:8000") && s.allows("10.0.0.4:9000"));
        assert!(!s.allows("10.0.0.22:8000"), "no prefix matching");
    }

    #[test]
    fn restricting_to_nothing_eligible_is_an_error() {
        let eps: Vec<Endpoint> = (1..=3).map(|i| Endpoint::idle(format!("10.0.0.{i}:8000"), "m")).collect();
        let mut c = vec![0, 1, 2];
        Subset::new(["10.0.0.2:8000", "10.0.0.9:8000"]).restrict(&eps, &mut c).unwrap();
        assert_eq!(c, vec![1]);
        let mut c = vec![0, 2];
        assert_eq!(Subset::new(["10.0.0.2:8000"]).restrict(&eps, &mut c), Err(ScheduleError::NoneInSubset));
        let mut c = vec![0, 1];
        assert_eq!(Subset::new(Vec::<String>::new()).restrict(&eps, &mut c), Err(ScheduleError::NoneInSubset));
    }
}
