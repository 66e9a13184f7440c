//! Cost-aware scorer: prefers endpoints on cheaper accelerator classes.
//!
//! Each endpoint's class comes from a pod label (default `attache.io/accelerator`); `costs`
//! maps classes to a relative price (say, $/hour). The cheapest candidate scores 1, the
//! others `cheapest / cost`. Unlabelled or unknown classes cost `unknown_cost` (default: the
//! dearest configured class), so they are never preferred by accident.
//!
//! `params`: `{"label": "attache.io/accelerator", "costs": {"l4": 0.8, "a100": 2.5,
//! "h100": 4.0}, "unknown_cost": 4.0}`.

use std::collections::BTreeMap;

use attache_scorer_sdk::{scorer, Candidate, Params, Request, Scorer};

pub struct CostAware {
    label: String,
    costs: BTreeMap<String, f32>,
    unknown: f32,
}

impl CostAware {
    pub fn cost(&self, e: &Candidate) -> f32 {
        e.label(&self.label).and_then(|c| self.costs.get(c)).copied().unwrap_or(self.unknown)
    }
}

impl Scorer for CostAware {
    fn configure(params: &Params) -> Result<Self, String> {
        let label = params.get("label").and_then(|v| v.as_str()).unwrap_or("attache.io/accelerator").to_owned();
        let table =
            params.get("costs").and_then(|v| v.as_object()).ok_or("costs: a map of class -> price is required")?;
        let mut costs = BTreeMap::new();
        for (k, v) in table {
            match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => {
                    costs.insert(k.clone(), x as f32);
                }
                _ => return Err(format!("costs.{k} must be a number > 0, got {v}")),
            }
        }
        let dearest = costs.values().copied().fold(0.0f32, f32::max);
        if dearest <= 0.0 {
            return Err("costs must name at least one class".into());
        }
        let unknown = match params.get("unknown_cost").map(|v| v.as_f64()) {
            None => dearest,
            Some(Some(x)) if x.is_finite() && x > 0.0 => x as f32,
            Some(_) => return Err("unknown_cost must be a number > 0".into()),
        };
        Ok(Self { label, costs, unknown })
    }

    fn score(&self, request: &Request, endpoint: &Candidate) -> f32 {
        let cheapest = request.candidates.iter().map(|c| self.cost(c)).fold(f32::INFINITY, f32::min);
        let mine = self.cost(endpoint);
        if cheapest.is_finite() && mine > 0.0 {
            cheapest / mine
        } else {
            0.5
        }
    }
}

scorer!(CostAware);

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(class: Option<&str>) -> Candidate {
        Candidate {
            labels: class.map(|c| vec![("attache.io/accelerator".to_owned(), c.to_owned())]).unwrap_or_default(),
            ..Default::default()
        }
    }

    #[test]
    fn cheapest_class_wins_and_unknown_is_dear() {
        let s = CostAware::configure(&serde_json::json!({"costs": {"l4": 1.0, "h100": 4.0}})).unwrap();
        let r = Request {
            candidates: vec![ep(Some("l4")), ep(Some("h100")), ep(None), ep(Some("tpu"))],
            ..Default::default()
        };
        let scores: Vec<f32> = r.candidates.iter().map(|c| s.score(&r, c)).collect();
        assert_eq!(scores, vec![1.0, 0.25, 0.25, 0.25]);
    }

    #[test]
    fn bad_params_are_refused() {
        assert!(CostAware::configure(&serde_json::json!({})).is_err());
        assert!(CostAware::configure(&serde_json::json!({"costs": {"l4": -1}})).is_err());
        assert!(CostAware::configure(&serde_json::json!({"costs": {}})).is_err());
        assert!(CostAware::configure(&serde_json::json!({"costs": {"l4": 1}, "unknown_cost": "x"})).is_err());
    }
}
