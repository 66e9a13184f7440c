//! Label filter: removes the candidates whose pod label is one of a list, with the reason, so
//! that no request of the slot's rollout buckets goes there (say, to drain an accelerator class
//! or keep a tenant off a pool). The picker drops them across the scheduler's tiers, unless
//! every candidate would go.
//!
//! `params`: `{"label": "attache.io/accelerator", "remove": ["l4"]}`. It scores every candidate
//! 0.5; roll it out with weight 0.

use attache_scorer_sdk::{scorer, Candidate, Params, Request, Scorer};

pub struct LabelFilter {
    label: String,
    remove: Vec<String>,
}

impl Scorer for LabelFilter {
    fn configure(params: &Params) -> Result<Self, String> {
        let label = params.get("label").and_then(|v| v.as_str()).unwrap_or("attache.io/accelerator").to_owned();
        let remove = params
            .get("remove")
            .and_then(|v| v.as_array())
            .ok_or("remove: a list of label values is required")?
            .iter()
            .map(|v| v.as_str().map(str::to_owned).ok_or_else(|| format!("remove: {v} is not a string")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { label, remove })
    }

    fn score(&self, _request: &Request, _endpoint: &Candidate) -> f32 {
        0.5
    }

    fn remove(&self, _request: &Request, endpoint: &Candidate) -> Option<String> {
        let value = endpoint.label(&self.label)?;
        self.remove.iter().any(|r| r == value).then(|| format!("{}={value}", self.label))
    }
}

scorer!(LabelFilter);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn candidate(class: &str) -> Candidate {
        Candidate {
            address: "10.0.0.1:8000".into(),
            labels: vec![("attache.io/accelerator".into(), class.into())],
            ..Default::default()
        }
    }

    #[test]
    fn it_removes_the_listed_classes_with_the_reason_and_keeps_the_rest() {
        let f = LabelFilter::configure(&json!({"remove": ["l4"]})).unwrap();
        let req = Request::default();
        assert_eq!(f.remove(&req, &candidate("l4")).as_deref(), Some("attache.io/accelerator=l4"));
        assert_eq!(f.remove(&req, &candidate("h100")), None);
        assert_eq!(f.remove(&req, &Candidate::default()), None, "unlabelled stays");
        assert!(LabelFilter::configure(&json!({})).is_err());
        assert!(LabelFilter::configure(&json!({"remove": [1]})).is_err());
    }
}
